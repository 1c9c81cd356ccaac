"""``jaxq.quantize``: annotate, calibrate and realize composed into an ordinary JAX function."""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxq import _compat as C
from jaxq import _serialize, _warnings
from jaxq._program import Program, TraceError, leaf_dtype, short_type, trace
from jaxq._taps import intermediates
from jaxq._walk import RewriteError, interpret, rewrite
from jaxq.quantize._annotate import annotate, prepare, with_params
from jaxq.quantize._arith import quantize_weight
from jaxq.quantize._calibrate import calibrate, calibrate_program, check_batches, progress_bar
from jaxq.quantize._config import QConfig, Scheme
from jaxq.quantize._lower import (
    LOOP_REASON,
    UNFOLLOWED,
    Engine,
    lower,
    raise_cause,
    simulate_handler,
    source_inputs,
)
from jaxq.quantize._params import float_leaf, stack_qarrays, to_float, to_qarray, to_site
from jaxq.quantize._qarray import QArray, is_qarray, packed_shape, register_flax_serialization
from jaxq.quantize._realize import realize, realize_handler, realize_program
from jaxq.quantize._report import (
    Report,
    check_mask,
    fit_mask,
    make_report,
    masked,
    sqnr_db,
)
from jaxq.quantize._state import (
    INLINE,
    QState,
    QuantizeError,
    Site,
    get_state,
    param_spec,
    shaped_aval,
    with_state,
)
from jaxq.quantize._tuning import current_tuning
from jaxq.transform import Sequential

MODES = ("realize", "simulate")


_QARRAY_DTYPES = {
    "codes": "int8",
    "scale": "float32",
    "zero_point": "int32",
    "sums": "int32",
    "act_scale": "float32",
    "act_zero_point": "int32",
}
"""The dtypes of a QArray's arrays (what realize computes with)."""


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), leaf_dtype(x))


def _specs(tree: Any) -> Any:
    return jax.tree.map(_spec, tree)


class QuantizedFunction:
    """A quantized JAX function.

    Made by :func:`jaxq.quantize`. With params (``jaxq.quantize(f, params, ...)``), call
    ``qf.apply(qf.params, *args)`` (or ``qf(*args)``, which passes ``qf.params``); the quantized
    params are a pytree shaped like the float ones, with a :class:`jaxq.QArray` at every quantized
    weight, so ``jax.jit(qf.apply)`` compiles a program whose size does not grow with the model's.
    Without params (weights closed over), call it like the original function.

    It works under ``jax.jit``, ``jax.vmap`` and, in simulate mode, ``jax.grad`` (QAT: with params,
    the gradient reaches every float param through a straight-through estimator). New input shapes
    re-trace the original function and reuse the calibrated scales, matched by equation name.

    Attributes:
      program: the quantized Program at the example shapes.
      mode: ``"realize"`` (integer code) or ``"simulate"`` (fake quantization).
      params: the params the function is called with by ``qf(*args)``: quantized (realize) or
        float (simulate); None when the weights are closed over.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        program: Program,
        params: Any = None,
        float_params: Any = None,
    ) -> None:
        self._fun = fun
        self.program = program
        self._state: QState = get_state(program, "QuantizedFunction")
        self.mode = self._state.mode
        self.params = params
        self._float_params = float_params
        self._cache: dict[Any, Program] = {self._key_of(program): program}
        self.__name__ = getattr(fun, "__name__", "quantized")
        self.__doc__ = getattr(fun, "__doc__", None)
        register_flax_serialization()  # (flax users save params with flax.serialization)

    # -- programs per shape -----------------------------------------------------------------------
    @property
    def _with_params(self) -> bool:
        return self._state.params is not None

    def _key(self, tree: Any, specs: Any) -> Any:
        """Shapes and dtypes (key<fry> too), the mesh in context (a program traced for one
        shard under ``shard_map`` or ``pmap`` carries that mesh's axes in its types), and for
        integer code the lowering table in force (an offload realizes for its backend's
        kernels)."""
        shapes = tuple((tuple(s.shape), str(s.dtype)) for s in specs)
        tune = current_tuning() if self.mode == "realize" else None
        return tree, shapes, jax.sharding.get_abstract_mesh(), tune

    def _key_of(self, program: Program) -> Any:
        avals = program.jaxpr.in_avals
        args, kwargs = jax.tree.unflatten(program.in_tree, list(avals))
        if self._with_params:
            args = args[1:]
        leaves, tree = jax.tree.flatten((tuple(args), kwargs), is_leaf=is_qarray)
        return self._key(tree, leaves)

    def specialize(self, *args: Any, **kwargs: Any) -> Program:
        """The quantized Program for arguments of these shapes (traced once per shape). With
        params, ``args`` are the other arguments (the Program takes the params first)."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        specs = [_spec(x) for x in leaves]
        key = self._key(tree, specs)
        prog = self._cache.get(key)
        if prog is None:
            a, k = jax.tree.unflatten(tree, specs)
            spec = self._state.params
            if spec is not None:
                avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in spec.avals]
                a = (jax.tree.unflatten(spec.tree, avals), *a)
            try:
                source = prepare(trace(self._fun, *a, **k))
            except TraceError as e:
                hint = _flag_hint(leaves)
                if hint:
                    raise TraceError(f"{e}{hint}") from e
                skip = 0 if spec is None else len(spec.avals)
                was = [a.str_short() for a in self._state.source.jaxpr.in_avals[skip:]]
                now = [short_type(x.dtype, x.shape) for x in specs]
                raise TraceError(
                    f"{e}\nf was quantized with arguments {', '.join(was)}; this call gives "
                    f"{', '.join(now)}. Other shapes are traced again, through f itself, which "
                    "failed on these: check them against the calibration batches."
                ) from e
            state = self._state.replace(source=source)
            if spec is not None:
                state = state.replace(params=param_spec(source, 0))
            realize_mode = self.mode == "realize"
            handler = realize_handler(state) if realize_mode else simulate_handler(state)
            prog, engine = lower(
                state, handler, mode=self.mode, integer_chains=realize_mode, verify_weights=True
            )
            state = state.replace(
                sites=engine.sites,
                skipped=engine.skipped,
                weights=engine.weights,
                output=prog.jaxpr,
            )
            prog = with_state(prog, state)
            self._cache[key] = prog
        return prog

    # -- calling ----------------------------------------------------------------------------------
    def apply(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        """``f(params, *args)`` quantized: integer code on quantized params (realize), or fake
        quantization of the float params given (simulate: differentiate it for QAT)."""
        if not self._with_params:
            raise TypeError(
                "QuantizedFunction.apply: this function was quantized with its weights closed over "
                "(no params); call it as qf(*args), or quantize with jaxq.quantize(f, params, ...)"
            )
        self._check_params(params, quantized=self.mode == "realize", who="apply")
        return self._run(self.specialize(*args, **kwargs), (params, *args), kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._with_params:
            return self.apply(self.params, *args, **kwargs)
        return self._run(self.specialize(*args, **kwargs), args, kwargs)

    def _run(self, program: Program, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fun = program.as_fun()
        if self.mode == "simulate" or not self._rounds_activations():
            return fun(*args, **kwargs)
        return _no_derivative(lambda *a: fun(*a, **kwargs))(*args)

    def _rounds_activations(self) -> bool:
        """Whether the realized program rounds values computed from its inputs (activation codes,
        int8 attention, an int8 KV cache). Weight-only code does not: its derivative in the
        inputs is the float function's on the dequantized weights (classifier guidance)."""
        config, sites = self._state.config, self._state.sites
        return (
            config.attention is not None
            or config.kv_cache
            or any(s.activations is not None for s in sites.values())
        )

    def _check_params(self, params: Any, *, quantized: bool, who: str) -> list[Any]:
        """The flat params (QArrays as leaves), after checking them against the traced ones; the
        errors name the path and say what to pass instead."""
        spec = self._state.params
        assert spec is not None  # only called with params
        flat, tree = jax.tree.flatten(params, is_leaf=is_qarray)
        if tree != spec.tree:
            raise QuantizeError(
                f"{who}: params do not have the structure f was quantized with "
                f"({_first_difference(spec.tree, tree)}).\n"
                f"  expected: {spec.tree}\n  got:      {tree}\n"
                "Pass a pytree shaped like the params given to jaxq.quantize (qf.params is one)."
            )
        for i, x in enumerate(flat):
            path, aval = f"params{spec.paths[i]}", spec.avals[i]
            plan = self._state.leaves.get(i)
            if quantized and plan is not None:
                if not isinstance(x, QArray):
                    raise QuantizeError(
                        f"{who}: {path} is a float array, but this realized function takes a "
                        "QArray there (int8 codes and scales). Pass qf.params, or "
                        "qf.quantize_params(float_params)."
                    )
                if x.shape != plan.shape or x.bits != plan.scheme.bits:
                    raise QuantizeError(
                        f"{who}: {path} is a QArray of shape {x.shape} ({x.bits} bits); expected "
                        f"shape {plan.shape} ({plan.scheme.bits} bits). Quantize these params with "
                        "qf.quantize_params(float_params)."
                    )
                codes = packed_shape(plan.shape) if plan.scheme.bits <= 4 else plan.shape
                if tuple(np.shape(x.codes)) != tuple(codes):
                    raise QuantizeError(
                        f"{who}: {path}'s codes are shaped {tuple(np.shape(x.codes))}, not "
                        f"{tuple(codes)}: a slice of the quantized weight (one shard's, inside "
                        "shard_map), while its layer is planned for the whole weight. Replicate "
                        "the params there (in_specs PartitionSpec()), or place them with "
                        "jax.device_put(qf.params, jaxq.param_shardings(qf.params, mesh, axis)) "
                        "and call jax.jit(qf.apply), which XLA partitions."
                    )
                wrong = [
                    f"{k} is {np.dtype(leaf_dtype(v)).name}, not {want}"
                    for k, want in _QARRAY_DTYPES.items()
                    if (v := getattr(x, k)) is not None and np.dtype(leaf_dtype(v)).name != want
                ]
                if wrong:
                    raise QuantizeError(
                        f"{who}: {path} is a QArray whose {'; '.join(wrong)}: its arrays keep "
                        "their dtypes (a tree.map that casts float leaves changes its scales). "
                        "Cast before quantizing, or pass qf.params as they are."
                    )
                continue
            if isinstance(x, QArray):
                raise QuantizeError(
                    f"{who}: {path} is a QArray, but this function takes float params there "
                    + (
                        "(mode='simulate' fake-quantizes the float weights it is given; "
                        "qf.realize(params) makes the integer function)."
                        if self.mode == "simulate"
                        else "(quantize_params takes the float params and makes the QArrays)."
                        if not quantized
                        else "(it feeds no quantized layer)."
                    )
                )
            shape, dtype = np.shape(x), leaf_dtype(x)
            if shape != tuple(aval.shape) or dtype != aval.dtype:
                got = f"{getattr(dtype, 'name', dtype)}{list(shape)}"
                raise QuantizeError(f"{who}: {path}: expected {aval.str_short()}, got {got}")
        return flat

    # -- params -----------------------------------------------------------------------------------
    def quantize_params(self, params: Any, *, progress: bool = False) -> Any:
        """Quantize float ``params`` (shaped like the ones given to jaxq.quantize) with this
        function's config, layers and calibration: a pytree with a QArray at every quantized
        weight, the other leaves as given. Leaf by leaf on the host; no re-trace."""
        if not self._with_params:
            raise TypeError("quantize_params: this function was quantized without params")
        spec = self._state.params
        assert spec is not None  # checked above
        flat = self._check_params(params, quantized=False, who="quantize_params")
        if any(C.is_tracer(x) for x in flat):
            raise QuantizeError(
                "quantize_params: the params are traced values (inside jax.jit, grad or vmap): "
                "the codes are chosen on the host, once. Call it outside the transformation and "
                "pass the QArrays in: jax.jit(qf.apply)(qf.quantize_params(params), x)"
            )
        out = list(flat)
        plans = sorted(self._state.leaves.items())
        for i, plan in progress_bar(
            plans, progress and len(plans) > 8, "jaxq quantize params", unit="weight"
        ):
            out[i] = quantize_leaf(self._state, plan, flat[i])
        return jax.tree.unflatten(spec.tree, out)

    def realize(
        self, params: Any = None, *, calibration: Iterable[Any] | None = None
    ) -> QuantizedFunction:
        """The integer function of a simulate-mode one (after QAT): ``params`` (default
        ``qf.params``) quantized with the same config and activation scales, or scales measured
        again on ``calibration`` (argument tuples, as for jaxq.quantize)."""
        if self.mode != "simulate":
            raise QuantizeError("realize: this function is realized already")
        program = self.program
        params = self.params if params is None else params
        if calibration is not None:
            data = with_params(calibration, params) if self._with_params else calibration
            program = calibrate_program(program, data, progress=False, retrace=self._retrace)
        program = realize_program(program)
        if not self._with_params:
            return QuantizedFunction(self._fun, program)
        qf = QuantizedFunction(self._fun, program, float_params=params)
        qf.params = qf.quantize_params(params)
        return qf

    def _retrace(self, *args: Any) -> Program:
        return prepare(trace(self._fun, *args))

    # -- inspection -------------------------------------------------------------------------------
    def _simulated(self, *args: Any, **kwargs: Any) -> tuple[Program, Program, tuple, tuple]:
        """(float program, fake-quantized program, their leading arguments) at these shapes."""
        spec = self._state.params
        if spec is None:
            if self.mode == "simulate":
                prog = self.specialize(*args, **kwargs)
                return get_state(prog, "layer_sqnr").source, prog, (), ()
            source = prepare(trace(self._fun, *args, **kwargs))
            state = self._state.replace(source=source)
            prog, _ = lower(state, simulate_handler(state))
            return source, prog, (), ()
        fp = self._float_params
        if fp is None:
            raise QuantizeError(
                "layer_sqnr: the float params are not known; quantize with "
                "jaxq.quantize(f, params, ...) or call qf.quantize_params(params) first"
            )
        source = prepare(trace(self._fun, _specs(fp), *_specs(args), **_specs(kwargs)))
        state = self._state.replace(source=source, params=param_spec(source, 0))
        quantized = self.mode == "realize"
        sim, _ = lower(state, simulate_handler(state), quantized_params=quantized)
        return source, sim, (fp,), (self.params if quantized else fp,)

    def layer_sqnr(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """SQNR (dB) of each quantized layer's output against float on these arguments.

        Measured on the fake-quantized program, whose integer results realize computes (up to a
        code on a rounding boundary, see ``mode`` of :func:`jaxq.quantize`); errors of earlier
        layers accumulate into later ones, as a user sees them. A layer inside a loop that
        takes its weight param pools every run of it (a layer stack: one value per layer, as
        ``name@i``); layers in loops over closed-over weights are left out.
        """
        return self._layer_sqnr(args, kwargs)

    def _layer_sqnr(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], mask: np.ndarray | None = None
    ) -> dict[str, float]:
        """:meth:`layer_sqnr`, counting only the elements at ``mask``'s valid positions."""
        traced, sim, ref_lead, sim_lead = self._simulated(*args, **kwargs)
        source = _inline_calls(traced)  # layers inside jit calls (jnp.take) are top-level in sim
        quantized = {r.name for r in make_report(self.program).layers if r.status == "quantized"}
        top = {e.name for e in sim.equations() if len(e.path) == 1}
        names = [
            e.name
            for e in source.equations()
            if len(e.path) == 1 and e.name in quantized and e.name in top
        ]
        if mask is not None:  # every layer's shapes checked before anything runs
            for e in source.equations():
                if e.name in names:
                    shape = tuple(shaped_aval(e.eqn.outvars[0]).shape)
                    try:
                        fit_mask(mask, shape, e.name, "output", "report")
                    except QuantizeError:  # (attention scores [b, heads, t, s]: left out)
                        if e.name not in self._state.act_act:
                            raise
                        names.remove(e.name)
        ref = intermediates(source, names, *ref_lead, *args, **kwargs)
        got = intermediates(sim, names, *sim_lead, *args, **kwargs)
        pick = lambda n, v: masked(np.asarray(v), mask, n, "output", "report")
        out = {n: sqnr_db(pick(n, ref[n]), pick(n, got[n])) for n in names}
        sites = self._state.sites
        inner = [n for n, s in sites.items() if not s.in_loop and n not in names]
        if inner and self._float_params is not None:  # layers inside scans that params enter
            ref, got = self._stack_outputs(traced, args, kwargs, mask)
            groups: dict[str, list[str]] = {}
            for k in ref:
                groups.setdefault(_layer_key(k, sites), []).append(k)
            at = lambda y, valid: np.asarray(y)[np.broadcast_to(valid, np.shape(y))]
            flat = lambda vals, ks: np.concatenate([at(*vals[k]) for k in ks])
            out.update({g: sqnr_db(flat(ref, ks), flat(got, ks)) for g, ks in groups.items()})
        return out

    def _stack_outputs(
        self,
        source: Program,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        mask: np.ndarray | None,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The output of every iteration of every layer inside a scan that params enter
        (``name@i``, nested loops adding ``@j``) in float and fake-quantized (errors of earlier
        layers accumulating, as in :meth:`layer_sqnr`), each with where ``mask`` marks it valid
        (that step's mask in a loop over time), from ``source`` (the float program with params)
        in one compiled call."""
        fp = self._float_params
        state = self._state.replace(source=source, params=param_spec(source, 0))
        fake = simulate_handler(state)

        def outputs(quantized: bool, flat: tuple[Any, ...]) -> dict[str, Any]:
            def handle(visit: Any, site: Any, qw: Any, invals: list[Any], act: Any) -> Any:
                y = fake(visit, site, qw, invals, act) if quantized else visit.bind(*invals)
                if engine.loops:
                    valid = np.ones((), bool)
                    if mask is not None:
                        shape = np.shape(y)
                        valid = fit_mask(mask, shape, site.name, "output", "report", engine.loops)
                    engine.sink[site.name] = (y, valid)
                return y

            engine = Engine(state, handle, mode="simulate" if quantized else "observe")
            inputs = source_inputs(state, source.in_tree, flat, quantized=False)
            interpret(source, engine.rules(), *inputs, scope="quantize", coerce=to_float)
            return engine.sink

        run = jax.jit(lambda *flat: (outputs(False, flat), outputs(True, flat)))
        try:
            return jax.device_get(run(*source.flatten_args((fp, *args), kwargs)))
        except RewriteError as e:
            raise_cause(e)
            raise

    def clipped(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """The share of each statically quantized layer's activation values that fall outside
        its calibrated range on these arguments (and are clipped): inputs unlike the
        calibration data show up here first."""
        return self._clipped(args, kwargs)

    def _clipped(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], mask: np.ndarray | None = None
    ) -> dict[str, float]:
        """:meth:`clipped`, counting only the activation values at ``mask``'s valid positions."""
        spec = self._state.params
        lead: tuple[Any, ...] = ()
        if spec is None:
            source = prepare(trace(self._fun, *args, **kwargs))
        else:
            if self._float_params is None:
                raise QuantizeError("clipped: the float params are not known")
            lead = (self._float_params,)
            source = prepare(trace(self._fun, _specs(lead[0]), *_specs(args), **_specs(kwargs)))
        state = self._state.replace(source=source)
        if spec is not None:
            state = state.replace(params=param_spec(source, 0))

        def run(m: Any, *flat: Any) -> dict[str, Any]:
            def handle(visit: Any, site: Any, qw: Any, invals: list[Any], act: Any) -> Any:
                stats = engine.sink  # (inside a layer stack: the iteration's)
                if act is not None and site.activations is not None and not site.in_loop:
                    a = jnp.asarray(invals[1 - site.weight_index], jnp.float32)
                    qmin, qmax = site.activations.qrange
                    q = jnp.round(a / act[0]) + act[1]
                    outside = ((q < qmin) | (q > qmax)).astype(jnp.float32)
                    valid = jnp.ones((), jnp.float32)
                    if m is not None:
                        fit = fit_mask(m, a.shape, site.name, "activation", "report", engine.loops)
                        valid = jnp.broadcast_to(fit, a.shape).astype(jnp.float32)
                    # (counts: a loop's steps pool by their valid values, not one share each)
                    count = jnp.sum(jnp.broadcast_to(valid, a.shape))
                    stats[site.name] = jnp.stack([jnp.sum(outside * valid), count])
                return visit.bind(*invals)

            inputs = list(flat)
            if state.params is not None:
                inputs = source_inputs(state, source.in_tree, flat, quantized=False)
            engine = Engine(state, handle, mode="observe")
            interpret(source, engine.rules(), *inputs, scope="quantize", coerce=to_float)
            return engine.sink

        flat = source.flatten_args((*lead, *args), kwargs)
        try:
            stats = jax.jit(run)(mask, *flat)
        except RewriteError as e:
            raise_cause(e)
            raise
        counts: dict[str, Any] = {}
        for k, v in jax.device_get(stats).items():  # the steps of a loop over time: one layer
            key = _layer_key(k, self._state.sites)
            counts[key] = counts.get(key, 0) + np.asarray(v, np.float64)
        return {k: float(c[0] / c[1]) if c[1] else float("nan") for k, c in counts.items()}

    def check_saturation(
        self, *args: Any, threshold: float = 0.01, **kwargs: Any
    ) -> dict[str, float]:
        """An opt-in check on live inputs: :meth:`clipped` on these arguments, with a warning
        naming every layer that clips more than ``threshold`` of its activations (the inputs
        have drifted from the calibration data: calibrate again, or use dynamic scales)."""
        if not 0 <= threshold <= 1:
            raise ValueError(f"check_saturation: threshold must be in [0, 1]; got {threshold}")
        shares = self.clipped(*args, **kwargs)
        over = {k: v for k, v in shares.items() if v > threshold}
        if over:
            listed = ", ".join(f"{k} {100 * v:.1f}%" for k, v in sorted(over.items()))
            warnings.warn(
                f"jaxq: {len(over)} layer(s) clip more than {100 * threshold:g}% of their "
                f"activations on these inputs ({listed}); they are outside the calibrated "
                "ranges: calibrate on data like them, or use QConfig(dynamic=True)",
                UserWarning,
                stacklevel=2,
            )
        return shares

    def report(self, sample: tuple[Any, ...] | None = None, *, mask: Any = None) -> Report:
        """What was quantized and how; with ``sample`` (a tuple of arguments, params excluded)
        also the SQNR of every quantized layer and the share of its activations clipped, rows
        sorted worst first.

        ``mask`` (with ``sample``) marks the valid positions of the sample, e.g. a
        ``[batch, tokens]`` bool array that is False at padded tokens: each layer's SQNR and
        clipped share then count only the elements at valid positions. The mask's axes are
        matched against the leading axes of each layer's output (SQNR) and activation input
        (clipped): each must equal the tensor's axis or be 1, and the tensor's remaining axes
        (features) are broadcast; a tensor whose first axis holds all the mask's positions
        flattened in row-major order (``[batch * tokens, features]``) takes the mask flattened,
        and one that lost the mask's last axes (a pooled ``[batch, features]``) takes the mask
        reduced over them (a row is valid where any of its positions is). A layer whose tensors
        fit none of these raises a :class:`QuantizeError` naming it and both shapes, except
        an activation x activation product (attention's ``[batch, heads, t, s]`` scores),
        which then has no SQNR. Integer masks count non-zero as valid (``attention_mask``).
        """
        params = self.params if self._with_params else None
        if sample is None:
            if mask is not None:
                raise ValueError("report: mask applies to a sample; pass sample=(x, ...) too")
            return make_report(self.program, qparams=params)
        sample = sample if isinstance(sample, tuple) else (sample,)
        m = None if mask is None else check_mask(mask, "report")
        return make_report(
            self.program,
            self._layer_sqnr(sample, {}, m),
            qparams=params,
            clipped=self._clipped(sample, {}, m),
        )

    def save(self, path: str | os.PathLike[str], *example_args: Any, **example_kwargs: Any) -> Path:
        """Save the quantized program, with ``qf.params`` in it (int8 weights as int8, int4
        packed), to one safetensors file; ``jaxq.load(path)`` runs it without the model code.

        By default the saved program takes any batch size: it is exported with a symbolic
        leading dimension where the model allows one (else at the shapes it was traced at, and
        the loaded program's shape error says why). ``example_args`` (arrays or
        ``jax.ShapeDtypeStruct``, without the params) save it at their shapes instead."""
        if example_args or example_kwargs:
            program = self._program_at(example_args, example_kwargs)
            fixed = "it was saved at the shapes of the example arguments given to save"
        else:
            args, kwargs = jax.tree.unflatten(
                self.program.in_tree, list(self.program.jaxpr.in_avals)
            )
            args = args[1:] if self._with_params else args
            errors: list[str] = []
            for batched in _batch_choices(tuple(args), kwargs):
                try:
                    program = self._program_at(*_batch_polymorphic(tuple(args), kwargs, batched))
                    _check_runs(program, tuple(args), kwargs, batched)
                    fixed = None
                    break
                except Exception as e:  # (the model fixes its batch: a reshape, a constant, ...)
                    errors.append(f"{type(e).__name__}: {e}".splitlines()[0][:200])
            else:
                program = self._program_at(tuple(args), kwargs)
                why = errors[0] if errors else "no argument has a leading dimension"
                fixed = f"no leading dimension of its arguments runs as a symbolic batch ({why})"
                _warnings.warn(
                    f"save: {os.fspath(path)!r} runs only at the traced shapes: {fixed}. Save "
                    "at the shapes you will call it with: qf.save(path, x)",
                    UserWarning,
                )
        if not self._with_params:
            return _serialize.save(program, path, fixed=fixed)
        # tensors named by their param paths: Dense_0/kernel.codes
        by_id = {
            id(leaf): _tensor_name(p)
            for p, leaf in jax.tree_util.tree_flatten_with_path(self.params)[0]
        }
        names = {i: by_id[id(c)] for i, c in enumerate(program.jaxpr.consts) if id(c) in by_id}
        return _serialize.save(program, path, names, fixed=fixed)

    def _program_at(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Program:
        """The quantized function at these argument shapes as a Program of the arguments alone
        (``qf.params`` in it as constants)."""
        specs = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
        if not self._with_params:
            return self.specialize(*args, **kwargs)
        params = self.params

        def fun(*a: Any, **k: Any) -> Any:
            return self.apply(params, *a, **k)

        fun.__name__ = self.__name__
        return trace(fun, *specs(args), **specs(kwargs))

    def __repr__(self) -> str:
        style = " params" if self._with_params else ""
        return f"<jaxq.QuantizedFunction {self.__name__} mode={self.mode}{style}>"


def _check_runs(
    program: Program, args: tuple[Any, ...], kwargs: dict[str, Any], batched: list[bool]
) -> None:
    """Export ``program`` (traced with a symbolic batch in the ``batched`` argument leaves) and
    run it one row larger than traced: a model whose reshapes pin the batch traces with a
    symbol, then fails at any other size."""
    closed = program.jaxpr
    big = {
        i: c
        for i, c in enumerate(closed.consts)
        if getattr(c, "size", 0) > 1 and not _serialize.is_key(c)
    }

    def run(lifted: dict[int, Any], *flat: Any) -> Any:  # (weights as arguments, not constants)
        consts = [lifted.get(i, c) for i, c in enumerate(closed.consts)]
        return C.jaxpr_as_fun(C.ClosedJaxpr(closed.jaxpr, consts))(*flat)

    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
    big_specs = {i: jax.ShapeDtypeStruct(c.shape, c.dtype) for i, c in big.items()}
    exported = jax.export.export(jax.jit(run))(big_specs, *specs)
    leaves = jax.tree.leaves((args, kwargs))
    flat = [
        jnp.zeros((a.shape[0] + 1, *a.shape[1:]) if grow else a.shape, a.dtype)
        for a, grow in zip(leaves, batched, strict=True)
    ]
    jax.block_until_ready(exported.call(big, *flat))


def _batch_choices(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[bool]]:
    """Which argument leaves carry the batch, in the order save tries them (at most six): all
    whose leading dimension is the first leaf's, then each other size's; then each argument's
    leaves alone (an input beside adapter matrices of the same leading size: f(p, x, lora))."""
    lead = [a.shape[0] if len(a.shape) else None for a in jax.tree.leaves((args, kwargs))]
    choices = [[d == n for d in lead] for n in dict.fromkeys(d for d in lead if d is not None)]
    start = 0
    for arg in (*args, *(kwargs[k] for k in sorted(kwargs))):  # (the order leaves flatten in)
        n = len(jax.tree.leaves(arg))
        own = [d for d in lead[start : start + n] if d is not None]
        if own:
            one = [start <= i < start + n and d == own[0] for i, d in enumerate(lead)]
            if one not in choices:
                choices.append(one)
        start += n
    return choices[:6]


def _batch_polymorphic(
    args: tuple[Any, ...], kwargs: dict[str, Any], batched: list[bool]
) -> tuple[Any, Any]:
    """Specs of the arguments with one symbolic ``batch`` as the leading dimension of the
    ``batched`` leaves."""
    (batch,) = jax.export.symbolic_shape("batch")
    leaves, tree = jax.tree.flatten((args, kwargs))
    specs = [
        jax.ShapeDtypeStruct((batch, *a.shape[1:]) if b else tuple(a.shape), a.dtype)
        for a, b in zip(leaves, batched, strict=True)
    ]
    return jax.tree.unflatten(tree, specs)


def _inline_calls(program: Program) -> Program:
    """``program`` with its ``jit`` calls inlined, as the quantization phases inline them, so
    that a layer inside one (``jnp.take``) can be tapped under the same name."""

    def inline(visit: Any, *invals: Any) -> Any:
        subs = C.subjaxpr_params(visit.params)
        if len(subs) != 1 or subs[0][1] is not None:
            return visit.bind(*invals)
        return visit.inline(*invals)

    return rewrite(program, dict.fromkeys(INLINE, inline), scope="quantize")


def _first_difference(want: Any, got: Any, path: str = "params") -> str:
    """Where two pytree structures first differ, in words (a FrozenDict for a dict is easy to
    miss in two printed trees)."""
    w, g = want.node_data(), got.node_data()
    name = lambda d: "a leaf" if d is None else f"a {d[0].__name__}"
    if w is None or g is None or w[0] is not g[0]:
        return f"{path} is {name(g)} where f was quantized with {name(w)}"
    if w[1] != g[1] or len(want.children()) != len(got.children()):
        keys = lambda d, t: list(d[1]) if isinstance(d[1], (list, tuple)) else len(t.children())
        return f"{path} holds {keys(g, got)} where f was quantized with {keys(w, want)}"
    names = w[1] if isinstance(w[1], (list, tuple)) and len(w[1]) == len(want.children()) else None
    for i, (a, b) in enumerate(zip(want.children(), got.children(), strict=True)):
        if a != b:
            return _first_difference(a, b, f"{path}[{names[i]!r}]" if names else f"{path}[{i}]")
    return "the same nodes, in another order"


def _flag_hint(leaves: Sequence[Any]) -> str:
    """Where arguments hold Python flags (``train=False``), which jaxq traces like arrays: how
    to bind them instead ("" where none does)."""
    flags = [x for x in leaves if isinstance(x, (bool, str))]
    if not flags:
        return ""
    return (
        f"\nA quantized function traces every argument, Python values such as {flags[0]!r} "
        "too: bind flags and modes into f before quantizing it, e.g. "
        "jaxq.quantize(functools.partial(f, train=False), params, ...)"
    )


def _tensor_name(path: tuple[Any, ...]) -> str:
    """A param path as a tensor name: ``Dense_0/kernel.codes``."""
    name = ""
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            name += f".{k.name}"
        else:
            part = k.key if isinstance(k, jax.tree_util.DictKey) else getattr(k, "idx", k)
            name += f"/{part}" if name else str(part)
    return name


def _no_derivative(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun``, with derivatives that raise: integer code has none (every rounding and int8 cast
    has a zero derivative, so ``jax.grad`` would silently return zeros)."""
    wrapped = jax.custom_jvp(fun)

    def jvp(primals: Any, tangents: Any) -> Any:
        raise QuantizeError(
            "jax.grad / jvp of a realized (integer) function: integer code has no derivative, "
            "so the gradient would be silently zero. Differentiate the simulated function "
            "instead: jaxq.quantize(f, params, ..., mode='simulate') (QAT), then qf.realize()."
        )

    wrapped.defjvp(jvp)
    return wrapped


def quantize_leaf(state: QState, plan: Any, value: Any) -> QArray:
    """One param leaf quantized on the host, with the scheme, smoothing and GPTQ statistics of
    the layer it feeds, in the leaf's own layout; a stacked leaf layer by layer (scales and
    activation parameters of its own for each)."""
    if plan.layers:
        one = dataclasses.replace(plan, layers=0, shape=plan.layer_shape, act_site=None)
        value = np.asarray(value)
        parts = [_quantize_layer(state, one, value[i], f"@{i}") for i in range(plan.layers)]
        acts = [
            _act_of(state, plan, f"{plan.act_site}@{i}")
            for i in range(plan.layers if plan.act_site is not None else 0)
        ]
        return stack_qarrays(plan, parts, acts)
    act = None if plan.act_site is None else _act_of(state, plan, plan.act_site)
    return _quantize_layer(state, plan, value, "", act)


def _act_of(state: QState, plan: Any, key: str) -> Any:
    act = state.act.get(key)
    if act is None:
        raise QuantizeError(
            f"quantize_params: layer {key!r} (param {plan.path}) has no calibrated activation "
            "scale; calibrate first (jaxq.quantize with calibration=...), or use "
            "QConfig(dynamic=True)"
        )
    return act


def _quantize_layer(state: QState, plan: Any, value: Any, suffix: str, act: Any = None) -> QArray:
    """One weight (a leaf, or one layer of a stacked leaf: statistics keyed ``site + suffix``)."""
    site = state.sites[plan.site]
    w = to_site(np.asarray(value), plan.chain)
    smooth = state.smooth.get(plan.site + suffix)
    if smooth is not None:
        (k_axis,) = site.contract_axes
        w = w.astype(np.float32) * smooth.reshape([-1 if d == k_axis else 1 for d in range(w.ndim)])
    config = state.config
    qw = quantize_weight(
        w, site, config.weight_calibration, state.grams.get(plan.site + suffix), config.gptq_damp
    )
    return to_qarray(
        plan,
        qw.codes,
        qw.scale,
        qw.zero_point,
        qw.group_scale,
        qw.group_zero_point,
        site.channel_axis,
        act,
    )


def _layer_key(key: str, sites: Mapping[str, Site]) -> str:
    """The layer a per-iteration key belongs to: ``name@i`` (layer ``i`` of a stack) for a
    stack's ``name@i@j...``, the layer's name for the steps of loops over constant weights."""
    name, *idx = key.split("@")
    return f"{name}@{idx[0]}" if idx and sites[name].layers else name


def _bind_weights(
    f: Callable[..., Any], weight_argnums: tuple[int, ...], full_args: tuple[Any, ...]
) -> Callable[..., Any]:
    weights = {i: full_args[i] for i in weight_argnums}
    n = len(full_args)

    def fun(*rest: Any, **kwargs: Any) -> Any:
        if len(rest) < n - len(weights):
            others = [i for i in range(n) if i not in weights]
            raise TypeError(
                f"quantize: f takes positional arguments {others} besides the weights "
                f"(weight_argnums={sorted(weights)}); called with {len(rest)}. Call it with "
                "all of them, weights left out"
            )
        it = iter(rest)
        args = [weights[i] if i in weights else next(it) for i in range(n)]
        return f(*args, *it, **kwargs)

    fun.__name__ = getattr(f, "__name__", "f")
    return fun


def _python_scalars(params: Any) -> list[str]:
    """The paths of the params leaves that are Python numbers or bools (a module's flags)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return [
        f"{jax.tree_util.keystr(path)}={v!r}"
        for path, v in leaves
        if isinstance(v, (bool, int, float, complex))
    ]


def _reads_params(program: Program, n: int) -> bool:
    """Whether a program traced as ``f(params, ...)`` reads any of its ``n`` param leaves."""
    jaxpr = program.jaxpr.jaxpr
    used = C.use_counts(jaxpr.eqns, jaxpr.outvars)
    return n == 0 or any(used.get(v, 0) for v in jaxpr.invars[:n])


def _looks_like_batches(params: Any) -> bool:
    """Whether ``params`` looks like calibration batches passed where the params go: a list of
    tuples alike in structure and shape but for the batch axis (a model's layers, such as the
    README's ``[(w0, b0), (w1, b1)]``, differ in shape)."""
    if not (isinstance(params, list) and params and all(isinstance(b, tuple) for b in params)):
        return False
    kinds = {
        (jax.tree.structure(b), tuple(np.shape(x)[1:] for x in jax.tree.leaves(b))) for b in params
    }
    return len(kinds) == 1


def _check_params_tree(params: Any) -> None:
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    if any(C.is_tracer(x) for _, x in leaves):
        raise QuantizeError(
            "quantize: the params are traced values: jaxq.quantize was called inside a JAX "
            "transformation (jit, grad, vmap). Quantize outside it, then transform the result: "
            "jax.grad(lambda p: loss(qf.apply(p, x)))(params) with mode='simulate' for QAT."
        )
    if any(isinstance(x, QArray) for x in jax.tree.leaves(params, is_leaf=is_qarray)):
        raise QuantizeError(
            "quantize: params hold QArrays already; pass the float params (QAT: "
            "jaxq.quantize(f, params, mode='simulate'), then qf.realize(trained_params))"
        )
    for path, x in leaves:  # (Keras Variables: jit refuses them too, with a raw error)
        if hasattr(x, "__jax_array__") and not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(
                f"quantize: params{jax.tree_util.keystr(path)} is a {type(x).__name__}, which "
                "converts to an array but is not one; pass the arrays it holds (Keras: "
                "[v.value for v in model.trainable_variables])"
            )
    if not any(float_leaf(x) for _, x in leaves):
        raise QuantizeError(
            "quantize: params hold no float arrays, so there is no weight to quantize; "
            "f is called as f(params, *args)"
        )
    for path, x in leaves:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")) and not isinstance(
            x, (int, float, bool, complex)
        ):
            raise TypeError(
                f"quantize: params{jax.tree_util.keystr(path)} is a {type(x).__name__}, not an "
                "array; params must be a pytree of arrays. For a module that holds functions too "
                "(Equinox), pass its arrays and rebuild it inside f: params, static = "
                "eqx.partition(model, eqx.is_inexact_array); f = lambda p, x: "
                "eqx.combine(p, static)(x)"
            )


def quantize(
    f: Callable[..., Any],
    params: Any = None,
    *,
    calibration: Iterable[Any] | None = None,
    config: QConfig | None = None,
    mode: str = "realize",
    weight_argnums: int | Iterable[int] = (),
    example_args: tuple[Any, ...] | None = None,
    progress: bool = True,
    max_batches: int | None = None,
) -> QuantizedFunction:
    """Quantize ``f``: annotate, calibrate and (in ``"realize"`` mode) lower to integer code.

    This is ``Sequential([annotate, calibrate, realize])`` run under the current
    ``jaxq.transform.PassContext`` (its instruments see each phase; ``disabled=
    ["quantize.realize"]`` gives the simulated function), wrapped in a :class:`QuantizedFunction`.

    Args:
      f: the function, called as ``f(params, *args)`` when ``params`` is given (``model.apply``),
        else ``f(*args)`` with the weights closed over (``functools.partial(model.apply, p)``) or
        at ``weight_argnums``.
      params: the float params, a pytree of arrays. Every leaf that feeds a matmul or convolution
        (possibly through a transpose or a dtype convert) is quantized; ``qf.params`` holds a
        :class:`jaxq.QArray` there and the other leaves as given. Embedding tables (leaves
        indexed by a ``gather``) are quantized per row where a rule asks for it:
        ``QConfig(rules=(Rule(primitives={"gather"}),))``.
      calibration: an iterable of argument tuples of ``f`` without the params (a bare array
        stands for a 1-tuple). Needed for static activation scales; not for
        ``QConfig(dynamic=True)`` or weight-only.
      config: a :class:`QConfig` (default: W8 per channel, A8 per tensor, min/max).
      mode: ``"realize"`` (integer code) or ``"simulate"`` (fake quantization; QAT with
        ``jax.grad`` of ``qf.apply`` with respect to the float params). One layer computes the
        same integers in both; through several, the float ops between layers may round apart in
        the last bit, so a code on a rounding boundary can differ by one step (measured: 2 of
        2048 values in a 4-layer MLP; 5e-4 relative on a 3-layer GPT's logits). Under
        ``QConfig(requantize="fixed_point")`` realize rounds each output code the integer way
        (see there), so a few output codes of one layer differ by one step from simulate's.
        Under ``jax.jit``, XLA divides by a scale as a multiply by its reciprocal, so a code on
        a rounding boundary can move by one step between a jitted call and an eager one too.
        A realized function has no derivative where it rounds activations (``jax.grad``
        raises); a weight-only one differentiates in its inputs as the float function on the
        dequantized weights.
      weight_argnums: (without params) positions of ``f``'s arguments that are weights, taken
        from ``example_args`` (or the first calibration tuple); the result does not take them.
      example_args: arguments of ``f`` (without the params) to trace with (default: the first
        calibration tuple).
      progress: show progress over calibration batches.
      max_batches: use at most this many calibration batches.
    """
    if not callable(f):
        raise TypeError(f"quantize: f must be callable; got {type(f).__name__}")
    config = QConfig() if config is None else config
    if not isinstance(config, QConfig):
        raise TypeError(f"quantize: config must be a jaxq.QConfig; got {type(config).__name__}")
    if mode not in MODES:
        raise ValueError(f"quantize: mode must be one of {MODES}; got {mode!r}")
    if mode == "simulate" and params is not None and config.weight_calibration == "gptq":
        _warnings.warn(
            "quantize: mode='simulate' rounds the params it is given to the nearest code (its "
            "scales follow the weights as they train), while GPTQ chooses codes from calibration "
            "data when qs.realize(params) quantizes them, so qs.apply(params, x) and "
            "qs.realize(params)(x) differ. For quantization-aware training use "
            "weight_calibration='minmax' or 'mse', which the simulation computes the same way",
            UserWarning,
        )
    wa = (weight_argnums,) if isinstance(weight_argnums, int) else tuple(weight_argnums)
    if not all(isinstance(i, int) and i >= 0 for i in wa):
        raise ValueError(
            f"quantize: weight_argnums must be non-negative ints; got {weight_argnums!r}"
        )
    if params is not None:
        if wa:
            raise ValueError(
                "quantize: pass the weights either as params or with weight_argnums, not both"
            )
        _check_params_tree(params)
    batches: Iterable[Any] | None = None
    first = None
    if calibration is not None:
        check_batches(calibration, "quantize: calibration")
        it = iter(calibration)
        if max_batches is not None:
            if not isinstance(max_batches, int) or max_batches < 1:
                raise ValueError(
                    f"quantize: max_batches must be a positive int; got {max_batches!r}"
                )
            it = itertools.islice(it, max_batches)
        # (f is traced with the first batch that holds data: traced at a size-0 batch, every
        # layer is empty, nothing to quantize, and the model came back float without a word)
        empty: list[Any] = []
        for first in it:
            if not any(np.size(x) == 0 for x in jax.tree.leaves(first) if hasattr(x, "shape")):
                break
            empty.append(first)
        else:
            raise QuantizeError(
                "quantize: the calibration data is empty; pass at least one tuple of arguments"
                if not empty
                else f"quantize: every calibration batch ({len(empty)}) holds an empty array (a "
                "size-0 axis): nothing to calibrate; pass batches with data"
            )
        batches = itertools.chain(empty, [first], it)
    gptq = config.weight_calibration in ("gptq", "awq")
    smooth = config.smooths
    static = config.activations is not None or any(  # (a rule may give a layer activations)
        isinstance(r.activations, Scheme) and r.activations.granularity != "token"
        for r in config.rules
    )
    needs_data = (static and not config.dynamic) or gptq or smooth
    slip = (  # (the batches passed by position, where the params go)
        "\nparams is a list of tuples alike in shape, as calibration batches are: if they are "
        "the batches, pass them by name, jaxq.quantize(f, params, calibration=batches) (or "
        "without params, jaxq.quantize(f, calibration=batches))."
        if _looks_like_batches(params)
        else ""
    )
    if batches is None and (gptq or smooth):
        what = (
            f"weight_calibration={config.weight_calibration!r} chooses weight codes"
            if gptq
            else "smoothing measures"
        )
        raise QuantizeError(
            f"quantize: {what} from calibration data.\nPass calibration=[(x1,), (x2,), ...]." + slip
        )
    if batches is None and needs_data:
        raise QuantizeError(
            "quantize: static activation scales need calibration data.\n"
            "Pass calibration=[(x1,), (x2,), ...], or use QConfig(dynamic=True) (scales at run "
            "time) or QConfig(activations=None) (weight-only)." + slip
        )
    example = example_args if example_args is not None else first
    if example is None:
        raise QuantizeError("quantize: pass example_args (or calibration data) to trace f with")
    example = example if isinstance(example, tuple) else (example,)
    if wa and max(wa) >= len(example):
        raise ValueError(
            f"quantize: weight_argnums={wa} but the example arguments have {len(example)} positions"
        )
    fun = _bind_weights(f, wa, example) if wa else f

    def drop(args: Any) -> tuple[Any, ...]:
        args = args if isinstance(args, tuple) else (args,)
        return tuple(x for i, x in enumerate(args) if i not in wa) if wa else args

    def retrace(*args: Any) -> Program:
        return prepare(trace(fun, *args))

    lead: tuple[Any, ...] = ()
    loose = [] if params is None else _python_scalars(params)
    if params is not None:
        params = jax.device_put(params)  # once: every calibration batch passes them again
        lead = (_specs(params),)
    try:
        program = trace(fun, *lead, *drop(example))
    except Exception as e:
        given = "example_args" if example_args is not None else "the first calibration batch"
        call = "f(params, *batch)" if params is not None else "f(*batch)"
        held = " after the params" if params is not None else ""
        as_one = (  # (a list is one argument: only a tuple is unpacked)
            f"; this batch is a {type(example[0]).__name__}, which f received as one "
            "argument: if f takes several, write each batch as a tuple, (x, mask)"
            if len(example) == 1 and isinstance(example[0], (list, dict))
            else ""
        )
        flags = (
            f"\nThe params hold Python values, not arrays ({', '.join(loose[:4])}), which "
            "quantize traces like every params leaf, so Python control flow on them fails. "
            "Pass only the arrays as params (Equinox: params, static = eqx.partition(model, "
            "eqx.is_array), then f(params, x) calls eqx.combine(params, static)(x))"
            if loose and any(isinstance(x, jax.errors.JAXTypeError) for x in (e, e.__cause__))
            else ""
        )
        raise QuantizeError(
            f"quantize: could not trace f with {given}, called as {call} (a batch is a tuple "
            f"of the arguments{held}{as_one}): {type(e).__name__}: {e}{flags}"
            f"{_flag_hint(jax.tree.leaves(example))}"
        ) from e
    if params is not None and not _reads_params(program, len(jax.tree.leaves(params))):
        _warnings.warn(
            "jaxq.quantize: f never reads the params it is given, so its weights are closed "
            "over: qf.params holds no QArray, and params passed to qf.apply are ignored. Pass "
            "them through f (for a Hugging Face Flax model: lambda p, x: model(x, params=p))",
            UserWarning,
        )
    phases = [annotate(config, params_argnum=0 if params is not None else None)]
    if batches is not None and needs_data:
        # (a list in memory already stays one, so the progress bar knows how many batches)
        data: Iterable[Any] = (
            [drop(b) for b in batches] if isinstance(calibration, Sequence) else map(drop, batches)
        )
        data = with_params(data, params) if params is not None else data
        phases.append(calibrate(data, progress=progress, retrace=retrace))
    if mode == "realize":
        phases.append(realize())
    program = Sequential(phases, name="quantize")(program)
    in_loops = sorted(
        n for n, why in get_state(program, "quantize").skipped.items() if why == LOOP_REASON
    )
    if in_loops:
        warnings.warn(
            f"jaxq.quantize: {len(in_loops)} layer(s) inside scan / while / cond bodies stay float "
            f"(layers in loops and branches are quantized where the loop takes their weight param "
            f"itself, not a closed-over array nor a slice or product of a param made before the "
            f"loop): {in_loops[:5]}"
            + (" ..." if len(in_loops) > 5 else "")
            + "; qf.report() lists them",
            UserWarning,
            stacklevel=2,
        )
    unfollowed = sorted(
        f"{n} ({why.split(', which')[0].removeprefix('its weight, ').replace(', reaches it', '')})"
        for n, why in get_state(program, "quantize").skipped.items()
        if why.startswith(UNFOLLOWED)
    )
    if unfollowed:
        _warnings.warn(
            f"jaxq.quantize: {len(unfollowed)} layer(s) stay float: their weight params reach "
            "them through equations quantization does not follow (only transposes and casts): "
            f"{unfollowed[:5]}{' ...' if len(unfollowed) > 5 else ''}. Store each param in the "
            "shape its layer uses, computed outside f (a scaled or merged weight); qf.report() "
            "lists them",
            UserWarning,
        )
    if params is None:
        return QuantizedFunction(fun, program)
    qf = QuantizedFunction(fun, program, float_params=params)
    realized = get_state(program, "quantize").mode == "realize"
    qf.params = qf.quantize_params(params, progress=progress) if realized else params
    return qf
