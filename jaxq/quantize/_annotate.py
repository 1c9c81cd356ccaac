"""annotate: choose what to quantize (rules over equation names) and insert `simulated_quantize`.

Every phase reads the float program off the program it is given (:func:`float_source`): the one
the previous phase kept, when it is given that phase's output unchanged, or else the given program
with its ``simulated_quantize`` markers removed, so a pass run between phases is kept.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from jaxq import _warnings
from jaxq._program import Program
from jaxq._walk import rewrite
from jaxq.quantize._config import RULE_PRIMITIVES, QConfig
from jaxq.quantize._lower import CUSTOM_REASON, LOOKUP, Engine, lower, simulate_handler
from jaxq.quantize._state import META_KEY, QState, QuantizeError, param_spec, with_state
from jaxq.transform import Pass, infer_layouts, name_expressions, program_pass


def prepare(program: Program) -> Program:
    """The float program every phase starts from: stable names and layouts."""
    state = program.meta.get(META_KEY) if program.meta else None
    if isinstance(state, QState):
        return state.source
    return infer_layouts()(name_expressions()(program))


def strip(program: Program) -> Program:
    """The program without its ``simulated_quantize`` markers (each replaced by its input)."""
    meta = {k: v for k, v in (program.meta or {}).items() if k != META_KEY}
    plain = program.replace(meta=meta)
    return rewrite(plain, {"simulated_quantize": lambda visit, x, *_: x}, scope="strip")


def float_source(program: Program, state: QState, who: str) -> Program:
    """The float program a phase lowers: the state's, or (when a pass changed the program since
    the last phase) the given program without its markers."""
    if state.output is None or program.jaxpr is state.output:
        return state.source
    if state.smooth:
        raise QuantizeError(
            f"{who}: the program was changed by a pass since the last quantization phase, and "
            "SmoothQuant factors cannot be taken back out of it. Run that pass before "
            "jaxq.quantize.annotate, or without QConfig(smoothing=...)."
        )
    return infer_layouts()(name_expressions()(strip(program)))


def check_sites(state: QState, engine: Engine, who: str) -> None:
    """A phase must find every site the state knows: say which are gone, by name."""
    gone = sorted(set(state.sites) - set(engine.sites))
    if gone:
        raise QuantizeError(
            f"{who}: the program's quantization sites no longer match its state; these layers "
            f"were quantized by annotate but are not in the program it was given: {gone}. "
            "A pass between phases may rewrite equations but must keep their names; run passes "
            "that remove layers before jaxq.quantize.annotate."
        )


def unmatched_rules(config: QConfig, matched: frozenset[int], source: Program) -> list[str]:
    """The rules that chose no layer's schemes, each noting where an earlier rule took every
    layer it matches (its pattern is right: it is shadowed)."""
    sites = [(e.name, e.primitive) for e in source.equations() if e.primitive in RULE_PRIMITIVES]
    taken = lambda i, n, p: any(q.matches(n, p) for q in config.rules[:i])
    return [
        f"rules[{i}]: {r!r}"
        + (" (shadowed: an earlier rule takes every layer it matches)" if shadowed else "")
        for i, r in enumerate(config.rules)
        if i not in matched
        for shadowed in [any(r.matches(n, p) and taken(i, n, p) for n, p in sites)]
    ]


def annotate_program(
    program: Program, config: QConfig, *, params_argnum: int | None = None, warn: bool = True
) -> Program:
    if not isinstance(config, QConfig):
        raise TypeError(f"annotate: config must be a jaxq.QConfig; got {type(config).__name__}")
    source = prepare(program)
    params = None if params_argnum is None else param_spec(source, params_argnum)
    state = QState(config=config, source=source, sites={}, skipped={}, weights={}, params=params)
    out, engine = lower(state, simulate_handler(state))
    if engine.early_float & engine.leaves.keys():  # (a tied weight read before its layer)
        known = state.replace(sites=engine.sites, leaves=engine.leaves)
        out, engine = lower(known, simulate_handler(known))
    state = state.replace(
        sites=engine.sites,
        skipped=engine.skipped,
        weights=engine.weights,
        leaves=engine.leaves,
        site_leaves=engine.site_leaves,
        float_leaves=frozenset(engine.float_leaves),
        float_reads={k: tuple(v) for k, v in engine.float_reads.items()},
        act_act=dict(engine.act_act),
        matched_rules=frozenset(engine.matched),
        output=out.jaxpr,
        kv_caches=tuple(engine.kv_caches),
    )
    # a layer left float (by a Rule, or by a scheme of its own) that reads a param another
    # layer quantizes: the params hold only that leaf's codes, so it computes with them
    # dequantized, not with the float weight (as a tied table's lookup does, said in the docs)
    reads = {
        name: f"{state.params.paths[leaf]} (quantized for {state.leaves[leaf].site!r})"
        for name, leaves in engine.float_reads.items()
        if name in state.skipped and state.params is not None
        for leaf in leaves
        if leaf in state.leaves and state.leaves[leaf].site != name
    }
    shared = {k: v for k, v in reads.items() if not state.skipped[k].startswith(LOOKUP)}
    if reads:
        skipped = dict(state.skipped)
        for k, v in reads.items():
            if k in shared:
                skipped[k] = f"{skipped[k]}; reads the dequantized {v}"
            else:  # (a tied table's lookup: documented, no warning)
                skipped[k] = (
                    f"{LOOKUP}{v}, a tied table: reads its dequantized codes (to quantize the "
                    "lookup itself, one scale per row: QConfig(rules=(jaxq.Rule(primitives="
                    "{'gather'}),)))"
                )
        state = state.replace(skipped=skipped)
    if shared and warn:
        _warnings.warn(
            "jaxq.quantize: these layers stay float but read a param that another layer "
            "quantizes, so they compute with its dequantized codes:\n  "
            + "\n  ".join(f"{k}: {v}" for k, v in shared.items())
            + "\nTo keep them exact, leave the other layer float too (a Rule with skip=True)"
            ", or give the layers separate params.",
            UserWarning,
        )
    if config.requantize == "fixed_point" and state.site_leaves:
        raise QuantizeError(
            "quantize: requantize='fixed_point' computes each layer's integer multipliers on the "
            f"host from its weight scales, but the weight of {next(iter(state.site_leaves))!r} "
            f"(and {len(state.site_leaves) - 1} more) is a param (an input). Quantize with the "
            "weights closed over (jaxq.quantize(functools.partial(f, params), ...)), or use "
            "requantize='float'."
        )
    custom = {  # params entering a custom_jvp / custom_vjp function whose layers stay float
        call: [state.params.paths[leaf] for leaf in leaves]
        for call, leaves in engine.custom_reads.items()
        if state.params is not None
        and any(n.startswith(call + "/") and w == CUSTOM_REASON for n, w in engine.skipped.items())
    }
    if warn and custom:
        _warnings.warn(
            "jaxq.quantize: params enter custom_jvp / custom_vjp functions, whose layers stay "
            "float (quantizing a body would change the function its derivative rule was "
            "written for): "
            + "; ".join(f"{call} reads {', '.join(paths)}" for call, paths in custom.items())
            + ". Call the layers outside the custom function to quantize them; qf.report() "
            "lists them",
            UserWarning,
        )
    if warn and engine.per_channel:
        shown = [f"{k} {list(v)}" for k, v in sorted(engine.per_channel.items())]
        _warnings.warn(
            f"jaxq.quantize: granularity='group' applies to 2-D matmul weights whose "
            f"contracted size group_size divides; {len(shown)} layer(s) get one weight scale per "
            f"channel instead (convolutions, N-D kernels such as DenseGeneral's, narrow "
            f"layers): {', '.join(shown[:4])}"
            + (" ..." if len(shown) > 4 else "")
            + ". qf.report() shows each layer's scheme",
            UserWarning,
        )
    missing = unmatched_rules(config, state.matched_rules, source)
    if warn and missing:
        warnings.warn(
            "jaxq.quantize: these rules matched no equation (check the patterns against "
            "[e.name for e in program.equations()], and with params as an argument against "
            "their paths, jax.tree_util.keystr of each leaf):\n  " + "\n  ".join(missing),
            UserWarning,
            stacklevel=3,
        )
    return with_state(out, state)


def annotate(config: QConfig | None = None, *, params_argnum: int | None = None) -> Pass:
    """A pass that marks weights and activations with ``simulated_quantize``.

    Weights are the arrays the program closes over (quantized once, here) or, with
    ``params_argnum``, the leaves of that argument (``f(params, *args)``): their scales are then
    computed inside the program from the weights it is given, so ``jax.grad`` trains them (QAT).
    Activation scales come from :func:`calibrate` (until then they are computed at run time). The
    float program, the sites and the plan for each param leaf are kept in
    ``program.meta["quantize"]``.
    """
    config = QConfig() if config is None else config
    if not isinstance(config, QConfig):
        raise TypeError(f"annotate: config must be a jaxq.QConfig; got {type(config).__name__}")

    @program_pass(name="quantize.annotate")
    def run(program: Program) -> Program:
        return annotate_program(program, config, params_argnum=params_argnum)

    return run


def with_params(batches: Iterable[Any], params: Any) -> Iterable[tuple[Any, ...]]:
    """Calibration tuples ``(x, ...)`` as arguments of ``f(params, x, ...)``: a list for a list
    (the progress bar shows its length), else lazily."""

    def lead(b: Any) -> tuple[Any, ...]:
        return (params, *(b if isinstance(b, tuple) else (b,)))

    return [lead(b) for b in batches] if isinstance(batches, Sequence) else map(lead, batches)
