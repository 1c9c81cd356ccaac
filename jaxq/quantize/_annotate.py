"""annotate: choose what to quantize (rules over equation names) and insert `simulated_quantize`."""

from __future__ import annotations

import warnings

from jaxq._program import Program
from jaxq.quantize._config import QConfig
from jaxq.quantize._lower import META_KEY, QState, lower, simulate_handler, with_state
from jaxq.transform import Pass, infer_layouts, name_expressions, program_pass


def prepare(program: Program) -> Program:
    """The float program every phase starts from: stable names and layouts."""
    state = program.meta.get(META_KEY) if program.meta else None
    if isinstance(state, QState):
        return state.source
    return infer_layouts()(name_expressions()(program))


def unmatched_rules(config: QConfig, matched: frozenset[int]) -> list[str]:
    return [f"rules[{i}]: {r!r}" for i, r in enumerate(config.rules) if i not in matched]


def annotate_program(program: Program, config: QConfig, *, warn: bool = True) -> Program:
    if not isinstance(config, QConfig):
        raise TypeError(f"annotate: config must be a jaxq.QConfig; got {type(config).__name__}")
    source = prepare(program)
    state = QState(config=config, source=source, sites={}, skipped={}, weights={})
    out, engine = lower(state, simulate_handler(state))
    state = state.replace(
        sites=engine.sites,
        skipped=engine.skipped,
        weights=engine.weights,
        matched_rules=frozenset(engine.matched),
    )
    missing = unmatched_rules(config, state.matched_rules)
    if warn and missing:
        warnings.warn(
            "jaxq.quantize: these rules matched no equation (check the patterns against "
            "[e.name for e in program.equations()]):\n  " + "\n  ".join(missing),
            UserWarning,
            stacklevel=3,
        )
    return with_state(out, state)


def annotate(config: QConfig | None = None) -> Pass:
    """A pass that quantizes weights and marks activations with ``simulated_quantize``.

    Weights are quantized once here (their scales come from their values); activation scales come
    from :func:`calibrate` (until then they are computed at run time). The float program, the
    sites and the quantized weights are kept in ``program.meta["quantize"]``.
    """
    config = QConfig() if config is None else config
    if not isinstance(config, QConfig):
        raise TypeError(f"annotate: config must be a jaxq.QConfig; got {type(config).__name__}")

    @program_pass(name="quantize.annotate")
    def run(program: Program) -> Program:
        return annotate_program(program, config)

    return run
