"""``build``: run a partitioned (and placed) program, each region on its backend."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxq import _compat as C
from jaxq._program import Program
from jaxq._warnings import warn
from jaxq.partition._backends import (
    BackendError,
    Codegen,
    check_results,
    get_backend,
    xla_backend,
)
from jaxq.partition._partition_graph import regions
from jaxq.partition._placement import META_KEY as PLACEMENT_KEY
from jaxq.partition._placement import device_of


class BackendFallbackWarning(UserWarning):
    """A region's backend failed and the region runs with XLA instead (``build(fallback="xla")``)."""


def build(
    program: Program,
    *,
    backends: Mapping[str, str | Codegen] | None = None,
    fallback: str | None = None,
    jit: bool = True,
) -> Callable[..., Any]:
    """A function with ``program``'s signature that runs every region (see
    :func:`jaxq.partition.regions`) on its backend and everything else with XLA. Derivatives
    (``jax.grad``, ``jax.jvp``) of a region on another backend are its jaxpr's, from XLA.

    Args:
      backends: ``compiler -> backend name or codegen``; a compiler not listed uses the backend
        registered under its own name.
      fallback: ``"xla"`` to run a region whose backend fails (to compile it, or, when running
        eagerly, to run it) with XLA instead, with a :class:`BackendFallbackWarning`; ``None`` (the
        default) raises :class:`BackendError` naming the region.
      jit: compile the whole function with ``jax.jit`` where every backend allows it. Programs
        placed by ``plan_devices`` run eagerly: one compiled call per device segment, with real
        copies between devices.
    """
    if not isinstance(program, Program):
        raise TypeError(
            f"build: expects a jaxq.Program; got {type(program).__name__}. Trace the function "
            "and partition it first: jaxq.build(partitioned(jaxq.trace(f, *example_args)))"
        )
    if fallback not in (None, "xla"):
        raise ValueError(f"build: fallback must be None or 'xla'; got {fallback!r}")
    backends = dict(backends or {})
    unpartitioned = sorted(
        {
            e.params["compiler"]
            for e in program.jaxpr.jaxpr.eqns
            if e.primitive.name == "compiler_begin"
        }
    )
    if unpartitioned:
        warn(
            f"build: {program.name!r} holds compiler_begin annotations for {unpartitioned} "
            "that are not regions, so those ops run with XLA: run partition_graph() on it first "
            "(annotate_target, merge_compiler_regions, partition_graph)",
            UserWarning,
        )
    found = regions(program)
    compilers = sorted({r.compiler for r in found})
    unused = sorted(set(backends) - set(compilers) - set(unpartitioned))
    if unused and set(compilers) - set(backends):  # (a misspelled compiler: a region left out)
        folded = {c.lower(): c for c in compilers}
        near = {k: difflib.get_close_matches(k.lower(), list(folded), n=1) for k in unused}
        hints = "".join(f" (did you mean {folded[n[0]]!r}?)" for n in near.values() if n)
        warn(
            f"build: backends names {unused}, which no region of {program.name!r} is annotated "
            f"for; its regions' compilers are {compilers}{hints}",
            UserWarning,
        )
    runners: dict[str, Callable[..., Sequence[Any]]] = {}
    for r in found:
        if r.num_outputs == 0:  # (dead code JAX kept, e.g. an unused x[0]: nothing to compute)
            runners[r.name] = lambda *args: []
            continue
        choice = backends.get(r.compiler, r.compiler)
        codegen = (
            choice if callable(choice) else get_backend(choice, region=r.name, compiler=r.compiler)
        )
        label = choice if isinstance(choice, str) else getattr(choice, "__name__", "codegen")
        try:
            fn = codegen(r.program())
            if not callable(fn):
                raise TypeError(f"codegen returned {type(fn).__name__}, not a callable")
        except Exception as e:
            msg = (
                f"backend {label!r} failed to compile region {r.name!r} (compiler {r.compiler!r}, "
                f"primitives {list(r.primitives)}): {type(e).__name__}: {e}"
            )
            if fallback != "xla":
                raise BackendError(msg + "\nPass fallback='xla' to run it with XLA instead.") from e
            warn(msg + "; running it with XLA instead", BackendFallbackWarning)
            fn = xla_backend()(r.program())
        run = _guard(fn, r.name, label, r.program() if fallback == "xla" else None, r.program())
        runners[r.name] = run if label == "xla" else _differentiable(run, r.program())
    placement = dict(program.meta.get(PLACEMENT_KEY, {}))
    jittable = all(getattr(f, "jittable", True) for f in runners.values()) and not placement
    closed = program.jaxpr

    def interp(jaxpr: C.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for eqn in jaxpr.eqns:
            invals = [C.read_atom(v, env) for v in eqn.invars]
            name = C.call_name(eqn)
            if name in runners:
                outs = list(runners[name](*invals))
            elif name in segments:
                outs = list(segments[name](*invals))
            elif C.is_call_eqn(eqn) and _holds_region(eqn, runners):
                sub = C.call_body(eqn)
                outs = interp(sub.jaxpr, sub.consts, invals)
            else:
                with C.eqn_context(eqn):
                    outs = C.bind(eqn, invals, eqn.params)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [C.read_atom(v, env) for v in jaxpr.outvars]

    segments: dict[str, Callable[..., Any]] = {}
    for eqn in closed.jaxpr.eqns:
        name = C.call_name(eqn)
        if name is not None and name in placement:
            segments[name] = _segment_runner(C.call_body(eqn), device_of(placement[name]), interp)

    def flat_run(*flat: Any) -> list[Any]:
        return interp(closed.jaxpr, closed.consts, flat)

    run = jax.jit(flat_run) if (jit and jittable) else flat_run

    def fun(*args: Any, **kwargs: Any) -> Any:
        flat = program.flatten_args(args, kwargs)
        if placement and any(C.is_tracer(x) for x in flat):
            raise BackendError(
                f"build: {program.name!r} is placed on devices by plan_devices, so it runs "
                "eagerly (one compiled call per device segment, with real copies between "
                "devices); call it outside jax.jit / jax.vmap / jax.grad. Each segment is "
                "compiled already."
            )
        try:
            outs = run(*flat)
        except jax.errors.TracerArrayConversionError as e:
            if run is flat_run:
                raise BackendError(
                    f"build: a region's runner turned a traced value into a numpy array: "
                    f"{program.name!r} runs eagerly (a runner sets jittable = False, or "
                    "jit=False), so call it outside jax.jit and jax.vmap (jax.grad works), or "
                    "make the runner traceable (jax.pure_callback)."
                ) from e
            raise BackendError(
                f"build: a region's runner turned a traced value into a numpy array while "
                f"{program.name!r} was compiled with jax.jit: a runner that must run eagerly "
                "(numpy, a vendor library called from Python) sets run.jittable = False on the "
                "callable its codegen returns (build then runs the program eagerly), or wrap it "
                "in jax.pure_callback; build(..., jit=False) runs everything eagerly."
            ) from e
        return jax.tree.unflatten(program.out_tree, outs)

    fun.__name__ = fun.__qualname__ = program.name
    fun.jittable = jittable  # type: ignore[attr-defined]
    return fun


def _holds_region(eqn: C.JaxprEqn, runners: Mapping[str, Any]) -> bool:
    return any(
        C.is_call_eqn(e) and (C.call_name(e) in runners or _holds_region(e, runners))
        for e in C.call_body(eqn).jaxpr.eqns
    )


def _segment_runner(closed: C.ClosedJaxpr, device: jax.Device, interp: Any) -> Callable[..., Any]:
    sharding = jax.sharding.SingleDeviceSharding(device)
    n_in, n_out = len(closed.in_avals), len(closed.out_avals)

    def body(*args: Any) -> list[Any]:
        return interp(closed.jaxpr, closed.consts, args)

    return jax.jit(body, in_shardings=(sharding,) * n_in, out_shardings=[sharding] * n_out)


def _guard(
    fn: Callable[..., Sequence[Any]],
    region: str,
    backend: str,
    fallback: Program | None,
    declared: Program,
) -> Callable[..., Sequence[Any]]:
    """Check what the backend returns against the region's types, name the region in errors
    raised while running it, and fall back to XLA if asked."""
    xla: list[Any] = []
    avals = declared.jaxpr.out_avals

    def run(*args: Any) -> Sequence[Any]:
        try:
            return check_results(region, backend, fn(*args), avals)
        except BackendError:
            raise
        except Exception as e:
            if isinstance(e, jax.errors.JAXTypeError) or _tracing(args):
                raise
            msg = f"backend {backend!r} failed to run region {region!r}: {type(e).__name__}: {e}"
            if fallback is None:
                raise BackendError(msg) from e
            warn(msg + "; running it with XLA instead", BackendFallbackWarning)
            if not xla:
                xla.append(xla_backend()(fallback))
            return xla[0](*args)

    run.jittable = getattr(fn, "jittable", True)  # type: ignore[attr-defined]
    return run


def _differentiable(run: Callable[..., Sequence[Any]], region: Program) -> Callable[..., Any]:
    """``run`` with the region's own derivatives: a backend computes values (ONNX Runtime, a
    numpy interpreter and ``jax.pure_callback`` have no JVP), and ``jax.grad`` / ``jax.jvp``
    take the region jaxpr's, computed by XLA at the same inputs (as for any XLA region)."""
    reference = C.jaxpr_as_fun(region.jaxpr)

    @jax.custom_jvp
    def call(*args: Any) -> list[Any]:
        return list(run(*args))

    @call.defjvp
    def _(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        return call(*primals), jax.jvp(reference, primals, tangents)[1]

    def differentiable(*args: Any) -> list[Any]:
        return call(*args)

    differentiable.jittable = getattr(run, "jittable", True)  # type: ignore[attr-defined]
    return differentiable


def _tracing(args: Sequence[Any]) -> bool:
    return any(C.is_tracer(a) for a in args)
