"""calibrate: run calibration data through the float program (jitted) and fix activation scales."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxq import _warnings
from jaxq._program import Program
from jaxq._walk import RewriteError, interpret
from jaxq.quantize._annotate import check_sites, float_source
from jaxq.quantize._arith import dequantized_weight, host_range_to_qparams, quantize_weight
from jaxq.quantize._awq import awq_factors
from jaxq.quantize._config import CALIBRATIONS, INHERIT, QConfig
from jaxq.quantize._lower import (
    ARRAY_STATS,
    Engine,
    lower,
    raise_cause,
    simulate_handler,
    source_inputs,
)
from jaxq.quantize._observers import Observer, batch_stats, pool
from jaxq.quantize._params import to_float
from jaxq.quantize._sites import gptq_input_axis
from jaxq.quantize._smooth import factors
from jaxq.quantize._state import (
    ActParams,
    QState,
    QuantizeError,
    QWeight,
    Site,
    get_state,
    with_state,
)
from jaxq.transform import Pass, PassContext, program_pass, register_config


def progress_bar(it: Iterable[Any], enabled: bool, desc: str, unit: str = "batch") -> Iterator[Any]:
    """tqdm when it is installed, else one line on stderr at the end; silent when disabled."""
    if not enabled:
        yield from it
        return
    try:
        from tqdm import tqdm
    except ImportError:
        count = 0
        for x in it:
            count += 1
            yield x
        plural = unit if count == 1 else {"batch": "batches"}.get(unit, unit + "s")
        print(f"{desc}: {count} {plural}", file=sys.stderr)
        return
    yield from tqdm(it, desc=desc, unit=unit)


def _observed_keys(state: QState) -> list[tuple[str, Site]]:
    keys: list[tuple[str, Site]] = []
    for name, site in state.sites.items():
        if not site.static_act(state.config.dynamic):
            continue  # (dynamic scales are computed at run time)
        keys.extend((k, site) for k in site.act_keys())  # (a stack's layers: one per iteration)
        if state.config.requantize == "fixed_point":
            keys.append((name + ":out", site))
    return keys


def _gram(a: jax.Array, axis: int) -> jax.Array:
    """``X^T X`` of an activation, rows = every position, columns = the contracted ``axis``."""
    x = jnp.moveaxis(a.astype(jnp.float32), axis, -1)
    x = x.reshape(-1, x.shape[-1])
    return jnp.dot(x.T, x, precision=lax.Precision.HIGHEST)


CONV_PATCHES_MAX = 2**25
"""Largest patch matrix (elements per calibration batch) built for a convolution's GPTQ."""


def _conv_gram(visit: Any, site: Site, a: jax.Array) -> jax.Array | None:
    """``P^T P`` over a convolution's input patches, rows and columns in the order of the kernel's
    contracted axes flattened (as GPTQ sees the kernel); None for grouped convolutions or a
    patch matrix above ``CONV_PATCHES_MAX`` (those keep minmax codes)."""
    p = visit.params
    if site.primitive != "conv_general_dilated" or p["feature_group_count"] != 1:
        return None
    dn = p["dimension_numbers"]
    w_shape = visit.eqn.invars[site.weight_index].aval.shape
    if site.channel_axis != dn.rhs_spec[0] or p["batch_group_count"] != 1:
        return None
    window = tuple(w_shape[d] for d in dn.rhs_spec[2:])
    out_shape = visit.eqn.outvars[0].aval.shape
    k = math.prod(w_shape) // w_shape[site.channel_axis]
    if math.prod(out_shape) // out_shape[dn.out_spec[1]] * k > CONV_PATCHES_MAX:
        return None
    patches = lax.conv_general_dilated_patches(
        a.astype(jnp.float32),
        window,
        p["window_strides"],
        p["padding"],
        p["lhs_dilation"],
        p["rhs_dilation"],
        dn,
        precision=lax.Precision.HIGHEST,
    )  # features ordered (input channel, window position)
    patches = jnp.moveaxis(patches, dn.out_spec[1], -1).reshape(-1, k)
    coords = dict(
        zip(site.contract_axes, np.indices([w_shape[d] for d in site.contract_axes]), strict=True)
    )
    spatial = [coords[d].reshape(-1) for d in dn.rhs_spec[2:]]
    order = coords[dn.rhs_spec[1]].reshape(-1) * math.prod(window) + np.ravel_multi_index(
        spatial, window
    )
    g = jnp.dot(patches.T, patches, precision=lax.Precision.HIGHEST)
    return g[order][:, order]


def _observer_fn(
    state: QState,
    source: Program,
    histogram: bool,
    gptq: bool,
    absmax: bool,
    awq: bool,
    weights: bool,
) -> Callable[..., Any]:
    """A jitted ``(radii, *flat_args) -> {key: stats}`` over the float program. With ``gptq``,
    also each eligible layer's ``X^T X`` under ``name + ":gram"``; with ``awq`` (AWQ's first
    pass), only each matmul's ``X^T X``, and with ``weights`` its weight as the layer sees it
    (``name + ":weight"``);
    with ``absmax`` (SmoothQuant's), only each smoothable layer's per-input-channel ``max |X|``
    under ``name + ":absmax"``. Inside a layer stack every key is the iteration's (``name@i``,
    ``name@i:gram``)."""

    def run(radii: dict[str, Any], *flat: Any) -> dict[str, Any]:
        def handle(visit: Any, site: Site, qw: QWeight | None, invals: list[Any], act: Any) -> Any:
            y = visit.bind(*invals)
            if site.in_loop:
                return y
            stats, radii = engine.sink, engine.radii  # (inside a layer stack: the iteration's)
            a = invals[1 - site.weight_index]
            axis = gptq_input_axis(visit, site)
            if absmax:
                if axis is not None and site.activations is not None:
                    (k_axis,) = site.contract_axes
                    stats[site.name + ":absmax"] = _channel_absmax(a, axis)
                    stats[site.name + ":wabsmax"] = _channel_absmax(
                        invals[site.weight_index], k_axis
                    )
                return y
            if awq:  # (AWQ's first pass: nothing else)
                if axis is not None:
                    stats[site.name + ":gram"] = _gram(a, axis)
                    if weights:
                        stats[site.name + ":weight"] = invals[site.weight_index]
                return y
            if gptq:
                gram = _gram(a, axis) if axis is not None else _conv_gram(visit, site, a)
                if gram is not None:
                    stats[site.name + ":gram"] = gram
            if site.static_act(state.config.dynamic):  # (not per token: no scale to calibrate)
                stats[site.name] = batch_stats(a, radii.get(site.name))
                out_key = site.name + ":out"
                # (fixed-point requantize leaves the layers of a stack alone)
                stack = bool(engine.loops)
                if not stack and (out_key in radii or state.config.requantize == "fixed_point"):
                    stats[out_key] = batch_stats(y, radii.get(out_key))
            return y

        engine = Engine(state, handle, mode="observe")
        engine.radii = dict(radii)
        inputs = list(flat)
        if state.params is not None:
            inputs = source_inputs(state, source.in_tree, flat, quantized=False)
        interpret(source, engine.rules(), *inputs, scope="quantize", coerce=to_float)
        return engine.sink

    return jax.jit(run)


def _channel_absmax(v: Any, axis: int) -> Any:
    """``max |v|`` per index of ``axis`` (an input channel); on the host for a constant weight
    (XLA would constant-fold the reduction, slowly)."""
    xp = np if isinstance(v, (np.ndarray, np.generic)) else jnp
    x = xp.moveaxis(xp.abs(xp.asarray(v).astype(np.float32)), axis, -1)
    return xp.max(x.reshape(-1, x.shape[-1]), axis=0)


def _by_observer(stats: dict[str, Any], observers: dict[str, Observer]) -> dict[str, Any]:
    """Statistics keyed by their observer: a layer with a loop constant for its weight reports
    once per iteration of that loop (``name@i``, or ``name@layer@i`` inside a layer stack),
    pooled into one (``name``, ``name@layer``)."""
    out: dict[str, Any] = {}
    pooled: dict[str, list[Any]] = {}
    for k, v in stats.items():
        base = k
        while base not in observers and "@" in base:
            base = base.rpartition("@")[0]
        if base == k or base not in observers:
            out[k] = v
        else:
            pooled.setdefault(base, []).append(v)
    for k, vs in pooled.items():  # (one radius for every iteration: histograms add up)
        out[k] = functools.reduce(functools.partial(pool, k), vs)
    return out


def _layer_arrays(
    stats: dict[str, Any], layers: set[str]
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Split the per-layer arrays (``:gram`` ...) off a batch's statistics, keyed by the
    ``layers`` they belong to: a loop constant's reports of every iteration (``name@i:gram``)
    are kept under ``name`` and accumulated by the caller like those of further batches."""
    arrays: dict[str, list[np.ndarray]] = {}
    rest = {}
    for k, v in stats.items():
        if not k.endswith(ARRAY_STATS):
            rest[k] = v
            continue
        name, kind = k.rsplit(":", 1)
        while name not in layers and "@" in name:
            name = name.rpartition("@")[0]
        keep = np.asarray(v) if kind == "weight" else np.asarray(v, np.float64)
        arrays.setdefault(f"{name}:{kind}", []).append(keep)
    return rest, {k: functools.reduce(functools.partial(pool, k), vs) for k, vs in arrays.items()}


def _nonfinite(what: str, state: QState, flat: list[Any], batch: int) -> QuantizeError:
    """The error for NaN or Inf in ``what`` (a layer's input or output): blamed on the params
    that hold NaN or Inf where some do, else on the calibration batch."""
    spec = state.params
    bad = [] if spec is None else [
        path
        for path, v in zip(spec.paths, flat[spec.start : spec.start + spec.count], strict=True)
        if jnp.issubdtype(jnp.result_type(v), jnp.inexact) and not bool(jnp.all(jnp.isfinite(v)))
    ]  # fmt: skip
    if bad:
        return QuantizeError(
            f"calibrate: NaN or Inf in {what}, from the params: {', '.join(bad[:5])} "
            f"{'hold' if len(bad) > 1 else 'holds'} NaN or Inf; fix the params (the "
            "calibration data is not the cause)"
        )
    return QuantizeError(
        f"calibrate: NaN or Inf in {what} (calibration batch {batch}); clean the calibration data"
    )


def _observe(
    state: QState,
    data: Iterable[Any],
    *,
    keys: list[tuple[str, Site]],
    histogram: bool,
    gptq: bool,
    absmax: bool,
    progress: bool,
    retrace: Callable[..., Program] | None,
    awq: bool = False,
) -> tuple[dict[str, Observer], dict[str, np.ndarray], int]:
    """One pass over the calibration data: the observers of ``keys``, and the accumulated
    ``:gram`` (sum) / ``:absmax`` (max) / ``:weight`` arrays by layer key (``name``, or
    ``name@i`` in a layer stack), and the number of batches."""
    observers = {k: Observer(k, histogram) for k, _ in keys}
    layers = {k for site in state.sites.values() for k in site.act_keys()}
    arrays: dict[str, np.ndarray] = {}
    fns: dict[Any, tuple[Program, Callable[..., Any]]] = {}
    n = 0
    desc = "jaxq calibrate (smoothing)" if absmax else "jaxq calibrate"
    for n, batch in enumerate(progress_bar(data, progress, desc), 1):
        args = batch if isinstance(batch, tuple) else (batch,)
        leaves, tree = jax.tree.flatten(args)
        # (AWQ reads the weights once, from the first batch: one copy, in their own dtype)
        weights = awq and n == 1
        key = (tree, tuple((np.shape(x), jax.dtypes.result_type(x)) for x in leaves), weights)
        if key not in fns:
            try:
                source = state.source
                source.flatten_args(args, {})
            except TypeError as e:
                if retrace is None:
                    raise QuantizeError(
                        f"calibrate: calibration batch {n - 1} does not match the program's "
                        f"arguments:\n{e}"
                    ) from e
                try:
                    source = retrace(*args)
                except Exception as e2:
                    raise QuantizeError(
                        f"calibrate: calibration batch {n - 1} cannot be passed to the function: "
                        f"{type(e2).__name__}: {e2}"
                    ) from e2
            fns[key] = (source, _observer_fn(state, source, histogram, gptq, absmax, awq, weights))
        source, fn = fns[key]
        flat = source.flatten_args(args, {})
        if not observers and not gptq and not absmax and not awq:
            continue
        radii = {k: np.float32(o.radius) for k, o in observers.items() if o.radius is not None}
        try:
            stats = fn(radii if histogram and radii else {}, *flat) if histogram else fn({}, *flat)
        except RewriteError as e:
            raise_cause(e)
            raise
        stats, new = _layer_arrays(jax.device_get(stats), layers)
        stats = _by_observer(stats, observers)
        for k, v in new.items():
            if not k.endswith(":weight") and not np.all(np.isfinite(v)):
                raise _nonfinite(f"the input of layer {k.rsplit(':', 1)[0]!r}", state, flat, n - 1)
            arrays[k] = pool(k, arrays[k], v) if k in arrays else v
        for k, s in stats.items():
            if int(s["nonfinite"]):
                side = "output" if k.endswith(":out") else "input"
                what = f"the {side} of layer {k.removesuffix(':out')!r}"
                raise _nonfinite(what, state, flat, n - 1)
        if histogram:
            grown = False
            for k, s in stats.items():
                o = observers[k]
                r = o.radius_for(float(s["min"]), float(s["max"]))
                if o.radius is None or r > o.radius:
                    o.set_radius(r)
                    grown = True
            if grown or not radii:
                radii = {k: np.float32(o.radius) for k, o in observers.items()}
                stats = _by_observer(
                    _layer_arrays(jax.device_get(fn(radii, *flat)), layers)[0], observers
                )
        for k, s in stats.items():
            observers[k].update(s)
    if n == 0:
        raise QuantizeError(
            "calibrate: the calibration data is empty; pass at least one tuple of arguments"
        )
    return observers, arrays, n


def _uncalibrated_to_dynamic(state: QState, keys: list[tuple[str, Site]]) -> QState:
    """Layers the calibration data never reached (a cond branch not taken, a loop that never
    ran) keep activation scales computed at run time, with a warning: their weights' QArrays
    then carry no activation scale."""
    missing = sorted({site.name for k, site in keys if k not in state.act and ":" not in k})
    if not missing:
        return state
    warnings.warn(
        f"calibrate: the calibration data never reached {len(missing)} layer(s) (a branch not "
        f"taken, a loop that ran no iteration): {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        "; their activation scales are computed at run time. Calibrate with data that reaches "
        "them for static scales.",
        UserWarning,
        stacklevel=3,
    )
    leaves = {
        i: dataclasses.replace(p, act_site=None) if p.act_site in missing else p
        for i, p in state.leaves.items()
    }
    return state.replace(leaves=leaves, calibration={**state.calibration, "unreached": missing})


def _joint_factors(
    absmax: dict[str, np.ndarray], ranges: dict[str, Any], alphas: dict[str, Any]
) -> dict[str, np.ndarray]:
    """SmoothQuant's factors per layer, one set for the layers that read one activation (q, k
    and v): taken from the weights' joint range, so the activation is scaled and quantized once
    for all of them. Those layers are found by their inputs' per-channel ranges being equal on
    every batch; (if two inputs merely had equal ranges, sharing still keeps each product
    exact.)"""
    groups: dict[tuple[Any, ...], list[str]] = collections.defaultdict(list)
    for name, a in absmax.items():
        a = np.asarray(a)
        groups[(a.dtype.str, a.shape, a.tobytes())].append(name)
    out = {}
    for names in groups.values():
        alpha = {alphas[n] for n in names}
        if len(alpha) > 1:
            raise QuantizeError(
                f"calibrate: layers {', '.join(repr(n) for n in names)} read one activation, "
                f"so they are smoothed with one set of factors, but their rules give them "
                f"different smoothing ({', '.join(str(alphas[n]) for n in names)}): give them "
                "the same alpha (one Rule matching all of them)"
            )
        w = np.max([np.asarray(ranges[n + ":wabsmax"]) for n in names], axis=0)
        s = factors(absmax[names[0]], w, alpha.pop())
        out.update({n: s for n in names})
    return out


def _shared_leaves(
    state: QState, smooth: dict[str, np.ndarray], joint: Any = None
) -> dict[str, np.ndarray]:
    """Smoothing factors with every layer of a shared param leaf using one set: one set of
    codes holds ``s W``, so every layer reading it divides its activation by the same ``s``.
    ``joint(keys, owner)`` gives the factors for the activations ``keys`` together (SmoothQuant:
    from their joint range; one layer's alone served another badly: relative error 0.12
    against 0.026 unsmoothed, a helper's two-layer repro); without it, those of the layer the
    leaf is quantized for (AWQ). A leaf that also feeds a layer without factors (a tied
    embedding table's lookup), or that some equation reads as floats, is not smoothed."""
    by_leaf = collections.defaultdict(list)
    for name, leaf in state.site_leaves.items():
        by_leaf[leaf].append(name)
    out = dict(smooth)
    dropped: dict[str, list[str]] = {"floats": [], "shared": []}
    for leaf, names in by_leaf.items():
        if len(names) < 2 and leaf not in state.float_leaves:
            continue
        owner = state.sites[state.leaves[leaf].site].act_keys()
        pairs = [
            (k, o)
            for name in names
            for k, o in zip(state.sites[name].act_keys(), owner, strict=False)
        ]
        keys = [k for name in names for k in state.sites[name].act_keys()]
        ok = (
            leaf not in state.float_leaves
            and len(pairs) == len(keys)
            and all(o in smooth for _, o in pairs)
        )
        for k in keys:
            out.pop(k, None)
        if ok:
            for o in dict.fromkeys(o for _, o in pairs):  # (each owner key: a layer of a stack)
                keys_o = [k for k, o2 in pairs if o2 == o]
                s_o = smooth[o] if joint is None else joint(keys_o, o)
                out.update({k: s_o for k in keys_o})
        else:  # (a Rule asking for smoothing is not met: say so; the config's is documented)
            asked = [
                n
                for n in names
                if _rule_smooths(state, n) and any(k in smooth for k in state.sites[n].act_keys())
            ]
            dropped["floats" if leaf in state.float_leaves else "shared"] += asked
    why = {
        "floats": "their weight param is also read as floats (a tied embedding's lookup, say)",
        "shared": "their weight param is also read by a layer without smoothing, and one set of "
        "codes holds s * W for every layer that reads it: give all those layers the same "
        "smoothing (one Rule matching them all)",
    }
    for reason, names in dropped.items():
        if names:
            _warnings.warn(
                f"calibrate: the smoothing that rules give {len(names)} layer(s) is dropped: "
                f"{names[:5]}{' ...' if len(names) > 5 else ''}; {why[reason]}",
                UserWarning,
            )
    return out


def _rule_smooths(state: QState, name: str) -> bool:
    """Whether layer ``name``'s smoothing comes from a Rule of its own (not the config's)."""
    rule = state.sites[name].rule
    alpha = None if rule is None else state.config.rules[rule].smoothing
    return alpha is not None and alpha is not INHERIT


def _awq_of(state: QState, key: str, w: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """AWQ's factors for layer ``key`` (``name`` or ``name@i``), ``w`` as the layer sees it."""
    site = state.sites[key.partition("@")[0]]
    (k_axis,) = site.contract_axes
    fake = lambda v: dequantized_weight(quantize_weight(v, site), np.float32)
    return awq_factors(w.astype(np.float32), k_axis, gram, fake)


def check_batches(data: Any, who: str) -> None:
    """Calibration data must be an iterable of argument tuples: say so, naming the likely slip
    (one array, whose rows would each be taken for a batch; a dict of keyword arguments)."""
    if (
        isinstance(data, (str, bytes, Mapping))
        or not isinstance(data, Iterable)
        or hasattr(data, "shape")
    ):
        hint = (
            " (one array: wrap each batch in a tuple)"
            if hasattr(data, "shape")
            else " (one batch of keyword arguments: not supported, pass them by position)"
            if isinstance(data, Mapping)
            else ""
        )
        raise TypeError(
            f"{who} must be an iterable of argument tuples, e.g. [(x1,), (x2,)]; got "
            f"{type(data).__name__}{hint}"
        )


def calibrate_program(
    program: Program,
    data: Iterable[Any],
    *,
    method: str | None = None,
    percentile: float | None = None,
    progress: bool = True,
    retrace: Callable[..., Program] | None = None,
    max_batches: int | None = None,
) -> Program:
    """See :func:`calibrate`. ``retrace(*args)`` gives the float program at new shapes (used by
    ``jaxq.quantize``, which has the function); without it every batch must match the program."""
    state = get_state(program, "calibrate")
    state = state.replace(source=float_source(program, state, "calibrate"))
    config: QConfig = state.config
    method = config.calibration if method is None else method
    if method not in CALIBRATIONS:
        raise ValueError(f"calibrate: method must be one of {CALIBRATIONS}; got {method!r}")
    pct = config.percentile if percentile is None else percentile
    if not 0 < pct <= 100:
        raise ValueError(f"calibrate: percentile must be in (0, 100]; got {pct}")
    check_batches(data, "calibrate: data")
    if max_batches is not None:
        if not isinstance(max_batches, int) or max_batches < 1:
            raise ValueError(f"calibrate: max_batches must be a positive int; got {max_batches!r}")
        data = list(itertools.islice(data, max_batches))
    histogram = method != "minmax"
    gptq = config.weight_calibration == "gptq"
    observe = functools.partial(_observe, progress=progress, retrace=retrace)
    if config.smooths or config.weight_calibration == "awq":
        # Pass 1 measures what the factors need (each input channel's range, or X^T X and the
        # weight); pass 2 calibrates the smoothed operands.
        if iter(data) is data:  # a one-shot iterator: keep the batches for the second pass
            data = list(data)
        # (a program calibrated before is measured again without its factors: they would
        # otherwise scale the inputs pass 1 measures, and the new factors replace them)
        state = state.replace(smooth={}, act_absmax={})
        absmax: dict[str, np.ndarray] = {}
        if config.smooths:
            _, ranges, _ = observe(state, data, keys=[], histogram=False, gptq=False, absmax=True)
            measured = [k.removesuffix(":absmax") for k in ranges if k.endswith(":absmax")]
            alphas = {  # (a layer of a stack: name@i)
                k: config.smoothing_for(state.sites[k.partition("@")[0]].rule) for k in measured
            }
            absmax = {k: ranges[k + ":absmax"] for k, a in alphas.items() if a is not None}
            smooth = _joint_factors(absmax, ranges, alphas)
            joint = lambda keys, o: factors(  # (the activations of one shared weight, together)
                np.max([absmax[k] for k in keys], axis=0), ranges[o + ":wabsmax"], alphas[o] or 0
            )
        else:
            _, arrays, _ = observe(
                state, data, keys=[], histogram=False, gptq=False, absmax=False, awq=True
            )
            names = [k.removesuffix(":weight") for k in arrays if k.endswith(":weight")]
            smooth = {  # (each weight copy dropped once its factors are chosen)
                name: _awq_of(state, name, arrays.pop(name + ":weight"), arrays[name + ":gram"])
                for name in names
            }
            joint = None
        smooth = _shared_leaves(state, smooth, joint)
        absmax = {k: v for k, v in absmax.items() if k in smooth}
        weights = {k: v for k, v in state.weights.items() if k not in smooth}
        state = state.replace(act_absmax=absmax, smooth=smooth, weights=weights)
    keys = _observed_keys(state)
    observers, arrays, n = observe(
        state, data, keys=keys, histogram=histogram, gptq=gptq, absmax=False
    )
    grams = {k.removesuffix(":gram"): v for k, v in arrays.items()}
    act: dict[str, ActParams] = dict(state.act)
    negative: list[str] = []  # inputs with negative values under unsigned symmetric codes
    for k, site in keys:
        o = observers[k]
        if o.batches == 0:
            continue
        scheme = site.activations
        assert scheme is not None  # _observed_keys keeps only sites with activation schemes
        if scheme.symmetric and not scheme.signed and float(o.min) < 0:
            negative.append(f"{k.removesuffix(':out')} (min {float(o.min):.3g})")
        lo, hi = o.value_range(method, scheme, pct)
        if float(o.min) == float(o.max):  # all zero (scale 1.0 is a guess) or one constant
            _warnings.warn(
                f"calibrate: the {'output' if k.endswith(':out') else 'input'} of layer "
                f"{k.removesuffix(':out')!r} was {float(o.min):g} everywhere in all {o.batches} "
                "calibration batch(es), a degenerate range; calibrate with data like the inputs "
                "it will see",
                UserWarning,
            )
        scale, zp = host_range_to_qparams(lo, hi, scheme)
        act[k] = ActParams(float(scale), int(zp))
    if negative:
        _warnings.warn(
            f"calibrate: {len(negative)} activation(s) quantized unsigned and symmetric (codes "
            "from 0, zero point 0) hold negative values, which all clip to 0: "
            f"{', '.join(negative[:5])}{' ...' if len(negative) > 5 else ''}. Use "
            "Scheme(signed=True) or Scheme(symmetric=False) for them (a Rule per layer), or "
            "keep unsigned symmetric codes for inputs that are never negative (after a ReLU)",
            UserWarning,
        )
    info: dict[str, Any] = {
        "method": method,
        "batches": n,
        "percentile": pct if method == "percentile" else None,
    }
    if gptq:
        info["weights"] = "gptq"
        info["gptq_layers"] = len(grams)
    if config.smooths:
        info["smoothed_layers"] = len(state.smooth)
    if config.weight_calibration == "awq":
        info["weights"] = "awq"
        info["awq_layers"] = len(state.smooth)
    state = state.replace(act=act, calibration=info)
    if state.params is not None:  # the codes are chosen per leaf by quantize_params
        state = state.replace(grams={k: v.astype(np.float32) for k, v in grams.items()})
        grams = {}
    out, engine = lower(state, simulate_handler(state), grams=grams)
    check_sites(state, engine, "calibrate")
    state = _uncalibrated_to_dynamic(state, keys)
    state = state.replace(mode="simulate", weights=engine.weights, output=out.jaxpr)
    return with_state(out, state)


register_config(
    "quantize.calibrate.method",
    str,
    f"the calibration method of every calibrate pass given none, one of {CALIBRATIONS}",
)
register_config(
    "quantize.calibrate.percentile",
    float,
    "the share of values kept by percentile calibration, in (0, 100]",
)


def calibrate(
    data: Iterable[Any],
    method: str | None = None,
    *,
    percentile: float | None = None,
    progress: bool = True,
    max_batches: int | None = None,
    retrace: Callable[..., Program] | None = None,
) -> Pass:
    """A pass that runs ``data`` (an iterable of argument tuples; a one-shot iterator is used up by
    the first run) through the float program, jitted, and stores activation scales per layer.

    ``method`` (default: the annotated QConfig's): ``"minmax"``, ``"percentile"``, ``"entropy"``
    (KL divergence, TensorRT style) or ``"mse"``; ``PassContext(config={"quantize.calibrate.method":
    ..., "quantize.calibrate.percentile": ...})`` sets them for a whole pipeline. Memory is
    bounded: running min/max and a fixed-size histogram per activation, never the activations
    themselves. ``max_batches`` stops after that many batches (an endless iterator is fine).
    ``retrace(*args)`` gives the float program for a batch of other shapes (``jaxq.quantize``
    passes one; without it every batch must match the program's shapes). A program traced with
    params (``annotate(..., params_argnum=0)``) takes them in every batch: ``(params, x)``.
    """
    if method is not None and method not in CALIBRATIONS:
        raise ValueError(f"calibrate: method must be one of {CALIBRATIONS}; got {method!r}")

    @program_pass(name="quantize.calibrate")
    def run(program: Program) -> Program:
        options = PassContext.current().config
        return calibrate_program(
            program,
            data,
            method=method or options.get("quantize.calibrate.method"),
            percentile=percentile or options.get("quantize.calibrate.percentile"),
            progress=progress,
            retrace=retrace,
            max_batches=max_batches,
        )

    return run
