"""Quantization schemes as data: ``Scheme``, ``Rule`` and ``QConfig`` (frozen, keyword-only)."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from collections.abc import Callable
from typing import Any

from jaxq.annotate._simulated_quantize import ROUNDINGS

QUANTIZABLE = ("dot_general", "conv_general_dilated")
ELEMENTWISE = ("add", "mul")
"""Quantized only where a Rule names them in ``primitives`` (a bias or a scale): weights only."""
EMBEDDING = ("gather",)
"""Row lookups in a weight table (``emb[ids]``, ``jnp.take(emb, ids, axis=0)``): quantized only
where a Rule names them in ``primitives``, one scale per row, dequantized after the gather."""
OPT_IN = (*ELEMENTWISE, *EMBEDDING)
"""Primitives quantized only where a Rule names them: weights only, no activation scheme."""
RULE_PRIMITIVES = (*QUANTIZABLE, *OPT_IN)
"""What ``Rule.primitives`` may name."""

GRANULARITIES: tuple[str, ...] = ("tensor", "channel", "group", "token")
CALIBRATIONS: tuple[str, ...] = ("minmax", "percentile", "entropy", "mse")
REQUANTIZE: tuple[str, ...] = ("float", "fixed_point")
WEIGHT_CALIBRATIONS: tuple[str, ...] = ("minmax", "mse", "gptq", "awq")
INHERIT: Any = ...
"""``Rule(weights=...)``: the rule keeps the QConfig's scheme for that side."""


class _Unset:
    def __repr__(self) -> str:
        return "<default>"


_UNSET: Any = _Unset()
_SCHEME_DEFAULTS: dict[str, Any] = {
    "bits": 8,
    "signed": True,
    "symmetric": True,
    "granularity": "tensor",
    "group_size": None,
    "narrow_range": False,
    "rounding": "nearest_even",
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class Scheme:
    """How one tensor is quantized.

    Args:
      bits: code width, 2..16 (realized integer code supports up to 8; 4 or fewer bits are stored
        packed two per byte).
      signed: signed codes (``[-2**(bits-1), 2**(bits-1) - 1]``) or unsigned (``[0, 2**bits - 1]``).
      symmetric: zero point fixed at 0 (otherwise chosen by calibration).
      granularity: one scale per ``"tensor"``, per output ``"channel"`` (weights), per ``"group"``
        of ``group_size`` consecutive contraction elements and output channel (weights), or per
        ``"token"`` (activations, computed at run time: under ``QConfig(dynamic=True)``, or in
        a Rule for the layers it matches; a matmul's rows, a convolution's samples, as its
        windows sum over positions that one scale per position could not factor out of). A
        matmul weight's ``"channel"`` scales run along
        every axis it does not contract: its several matrices along batch axes of the
        ``dot_general`` (experts in ``einsum("ebd,edf->ebf")``, a weight under ``vmap``) and
        several output axes (a ``DenseGeneral``'s heads) each get their own; a stack of weights
        that ``lax.scan`` runs gets scales per layer.
      group_size: with ``granularity="group"``, how many consecutive elements along the
        contracted axis share a scale; None for the other granularities. A layer whose
        contracted size it does not divide, a convolution or an N-D kernel gets one scale
        per channel instead, with a warning (an error where a ``Rule`` asks for groups).
        Group scales change along the sum, so realize computes such a layer as simulated, a
        float op on the dequantized codes (an integer route needs one int32 product per
        group: W4 group(32) A8 at 2048 x 2048 ran at 0.09x float on XLA:CPU).
      narrow_range: drop the lowest code (``[-127, 127]`` for signed 8 bits).
      rounding: ``"nearest_even"``, ``"half_away_from_zero"``, ``"half_up"`` or ``"floor"``.

    Fields left out take the defaults ``bits=8, signed=True, symmetric=True,
    granularity="tensor", narrow_range=False, rounding="nearest_even"``, except in a
    :class:`Rule`, where they come from the QConfig's scheme for that side: under the default
    config ``Rule(weights=Scheme(bits=4))`` means 4-bit per-channel narrow-range weights.
    (``granularity`` and ``group_size`` go together: setting either sets both.)
    """

    bits: int = _UNSET
    signed: bool = _UNSET
    symmetric: bool = _UNSET
    granularity: str = _UNSET
    group_size: int | None = _UNSET
    narrow_range: bool = _UNSET
    rounding: str = _UNSET
    _given: frozenset[str] = dataclasses.field(
        default=frozenset(), init=False, repr=False, compare=False
    )
    """The fields the caller set; the others are inherited inside a Rule. Equality compares the
    values; the repr shows the fields as they were written, since ``Scheme(bits=4)`` and
    ``Scheme(bits=4, granularity="tensor")`` are one scheme alone but two in a Rule under a
    per-channel config (a Rule printed and rebuilt keeps its meaning)."""

    def __repr__(self) -> str:
        given = ", ".join(f"{f}={getattr(self, f)!r}" for f in _SCHEME_DEFAULTS if f in self._given)
        return f"Scheme({given})"

    def __post_init__(self) -> None:
        given = frozenset(f for f in _SCHEME_DEFAULTS if getattr(self, f) is not _UNSET)
        for f in _SCHEME_DEFAULTS.keys() - given:
            object.__setattr__(self, f, _SCHEME_DEFAULTS[f])
        object.__setattr__(self, "_given", given)
        if not _is_int(self.bits):
            raise TypeError(f"Scheme: bits must be an int; got {self.bits!r}")
        if not 2 <= self.bits <= 16:
            raise ValueError(f"Scheme: bits must be in [2, 16]; got {self.bits}")
        for name in ("signed", "symmetric", "narrow_range"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Scheme: {name} must be a bool; got {getattr(self, name)!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"Scheme: granularity must be one of {GRANULARITIES}; got {self.granularity!r}"
            )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"Scheme: rounding must be one of {ROUNDINGS}; got {self.rounding!r}")
        if self.granularity == "group":
            if self.group_size is None:
                raise ValueError(
                    "Scheme: group_size must be set when granularity='group'; got None"
                )
            if not _is_int(self.group_size) or self.group_size <= 0:
                raise ValueError(
                    f"Scheme: group_size must be a positive int; got {self.group_size!r}"
                )
        elif self.group_size is not None:
            raise ValueError(
                f"Scheme: group_size only applies to granularity='group'; got "
                f"group_size={self.group_size} with granularity={self.granularity!r}"
            )
        if self.narrow_range and not self.signed and self.symmetric:
            raise ValueError(
                "Scheme: narrow_range with an unsigned symmetric scheme leaves no code for zero "
                "(range [1, 2**bits - 1] with zero point 0); drop narrow_range or use signed=True"
            )

    @property
    def qrange(self) -> tuple[int, int]:
        """The integer range ``(qmin, qmax)`` of the codes (``(-127, 127)`` for signed 8-bit
        narrow range)."""
        lo = -(2 ** (self.bits - 1)) if self.signed else 0
        hi = 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1
        return lo + int(self.narrow_range), hi

    def inherit(self, base: Scheme) -> Scheme:
        """This scheme with the fields it was not given taken from ``base`` (what a Rule's scheme
        means: an override of the QConfig's)."""
        own = set(self._given)
        if own & {"granularity", "group_size"}:
            own |= {"granularity", "group_size"}
        values = {f: getattr(self if f in own else base, f) for f in _SCHEME_DEFAULTS}
        out = Scheme(**values)
        object.__setattr__(out, "_given", self._given)  # inheriting again starts from the same
        return out

    def short(self) -> str:
        """``int8 sym channel`` style summary for reports."""
        kind = "int" if self.signed else "uint"
        parts = [f"{kind}{self.bits}", "sym" if self.symmetric else "asym", self.granularity]
        if self.group_size:
            parts[-1] += f"({self.group_size})"
        if self.narrow_range:
            parts.append("narrow")
        if self.rounding != "nearest_even":
            parts.append(self.rounding)
        return " ".join(parts)


# (``help(Scheme)`` and editors show the defaults a field left out takes alone, not a sentinel)
_sig = inspect.signature(Scheme)
Scheme.__signature__ = _sig.replace(  # type: ignore[attr-defined]
    parameters=[p.replace(default=_SCHEME_DEFAULTS[p.name]) for p in _sig.parameters.values()]
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """Per-layer override, matched against equation names (``CNN/Dense_0/dot_general``) and,
    with params as an argument, the path of the param a layer reads as its weight.

    Args:
      pattern: regular expression searched in the equation name, and in the weight's param path
        (``['Dense_0']['kernel']``; Equinox: ``.blocks[1].fc2.weight``, where the names hold no
        attribute paths); None matches every layer.
      primitives: primitive names the rule applies to (None: any quantizable primitive).
        Three primitives are quantized only where a rule names them here, weights only:
        ``"add"`` and ``"mul"`` (a constant bias or scale), and ``"gather"``: a lookup of whole
        rows in a weight table (token and position embeddings, ``params["emb"][ids]`` or
        ``jnp.take(emb, ids, axis=0)``), stored as codes with one scale per row under
        ``granularity="channel"`` (the QConfig's default) or one per table under
        ``"tensor"``, and dequantized after the gather, only the rows gathered:
        ``Rule(primitives={"gather"})`` quantizes every embedding table with the QConfig's
        weight scheme, ``Rule(primitives={"gather"}, weights=Scheme(bits=4))`` to int4.
      weights, activations: the schemes for this layer; ``...`` keeps the QConfig's, ``None``
        leaves that side in float (``weights=None`` leaves the layer unquantized).
      skip: leave matching layers in float.
      smoothing: SmoothQuant's ``alpha`` for matching layers (see ``QConfig.smoothing``), None
        to leave them unsmoothed, ``...`` to keep the QConfig's: smoothing only the layers whose
        activations have outliers spares the others' multiplies.
    The first matching rule wins.
    """

    pattern: str | None = None
    primitives: frozenset[str] | None = None
    weights: Scheme | None | Any = INHERIT
    activations: Scheme | None | Any = INHERIT
    skip: bool = False
    smoothing: float | None | Any = INHERIT

    def __post_init__(self) -> None:
        if self.pattern is not None:
            if not isinstance(self.pattern, str):
                raise TypeError(f"Rule: pattern must be a str or None; got {self.pattern!r}")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(
                    f"Rule: pattern {self.pattern!r} is not a valid regular expression: {e}"
                ) from e
        if self.primitives is not None:
            prims = (self.primitives,) if isinstance(self.primitives, str) else self.primitives
            prims = frozenset(prims)
            if not all(isinstance(p, str) for p in prims):
                raise TypeError(
                    f"Rule: primitives must be primitive names; got {self.primitives!r}"
                )
            unknown = sorted(prims - set(RULE_PRIMITIVES))
            if unknown or not prims:
                near = [m for u in unknown for m in difflib.get_close_matches(u, RULE_PRIMITIVES)]
                raise ValueError(
                    f"Rule: primitives {sorted(prims)} must name quantizable primitives, "
                    f"{', '.join(RULE_PRIMITIVES)}"
                    + (f" (did you mean {', '.join(near)}?)" if near else "")
                    + "; None applies the rule to all"
                )
            object.__setattr__(self, "primitives", prims)
        for side in ("weights", "activations"):
            v = getattr(self, side)
            if v is not INHERIT and v is not None and not isinstance(v, Scheme):
                raise TypeError(f"Rule: {side} must be a Scheme, None or ...; got {v!r}")
        if not isinstance(self.skip, bool):
            raise TypeError(f"Rule: skip must be a bool; got {self.skip!r}")
        if self.skip and (self.weights is not INHERIT or self.activations is not INHERIT):
            raise ValueError(
                "Rule: skip=True leaves the layers float, so its weights= / activations= would "
                "be dropped; give one or the other"
            )
        if self.weights is None and isinstance(self.activations, Scheme):
            raise ValueError(
                "Rule: weights=None leaves the layers unquantized, activations too, so its "
                "activations= would be dropped; for weight-only layers give activations=None"
            )
        if self.smoothing is not INHERIT and self.smoothing is not None:
            _check_number(
                "smoothing", self.smoothing, "[0, 1]", lambda v: 0 <= v <= 1, " or None", "Rule"
            )
            if self.activations is None or self.skip:
                raise ValueError(
                    "Rule: smoothing moves activation outliers into the weights; the layers "
                    "this rule keeps with float activations have none to move. Drop smoothing "
                    "from the rule"
                )

    def matches(self, name: str, primitive: str, path: str | None = None) -> bool:
        """Whether this rule applies to the equation ``name`` of primitive ``primitive``, whose
        weight is the param at ``path`` (None: a constant, or no weight)."""
        if self.primitives is not None and primitive not in self.primitives:
            return False
        if self.pattern is None or re.search(self.pattern, name) is not None:
            return True
        return path is not None and re.search(self.pattern, path) is not None


def _check_number(
    field: str,
    value: Any,
    interval: str,
    inside: Callable[[float], bool],
    alt: str = "",
    owner: str = "QConfig",
) -> None:
    """A real number (a bool is not one) inside ``interval``; else an error naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        what = f"a number in {interval}{alt}" if alt else "a number"
        raise TypeError(f"{owner}: {field} must be {what}; got {value!r}")
    if not inside(value):
        raise ValueError(f"{owner}: {field} must be in {interval}; got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QConfig:
    """What to quantize and how.

    Defaults: weights int8 symmetric per output channel with the narrow range ``[-127, 127]``
    (zero point 0, so the only zero-point term left in an integer dot is a constant vector);
    activations int8 asymmetric per tensor (ReLU outputs are one-sided, and the zero-point term
    ``za * sum(w)`` is precomputed per channel, so asymmetry is nearly free); min/max calibration;
    float requantization.

    Args:
      weights: scheme for weights (arrays the function closes over, or ``weight_argnums``).
      activations: scheme for activations; None quantizes weights only.
      calibration: ``"minmax"``, ``"percentile"``, ``"entropy"`` (KL, TensorRT style) or ``"mse"``.
      percentile: for ``calibration="percentile"``, the share of values kept, in (0, 100]: the
        smallest magnitudes (symmetric schemes), or the middle of the range with the rest cut
        evenly from both tails (asymmetric).
      requantize: ``"float"`` (int32 accumulator times a float scale) or ``"fixed_point"``
        (integer-only multiplier and rounding shift to an int8 output, gemmlowp style; the
        multipliers are computed on the host, so the weights must be closed over, not params).
        Fixed point rounds each output code twice, half away from zero (in the multiply, then
        in the shift), whatever the scheme's ``rounding`` (which the input codes follow): an
        output code can differ by one step from the single rounding of ``mode="simulate"``
        (measured: about 1 in 300 with the default rounding, half of them with ``"floor"``).
      rules: per-layer ``Rule`` overrides, first match wins.
      dynamic: compute activation scales at run time (per tensor, or per token where asked).
        One layer can be dynamic per token in a static config: a rule with
        ``activations=Scheme(granularity="token")`` (an outlier-heavy layer, say), while the
        others keep their calibrated scales.
      weight_calibration: how weight codes are chosen. ``"minmax"``: scales cover each
        channel's (group's) range, codes round to nearest. ``"mse"``: each channel's range is
        clipped to the ratio that minimises the weight's squared error (helps 4-bit).
        ``"gptq"``: minmax scales, codes chosen by GPTQ to minimise the layer's output error on
        the calibration data (matmuls with one contracted axis; other layers use minmax).
        ``"awq"``: AWQ, activation-aware scaling: each input channel of a matmul's weight is
        multiplied by ``s_k = m_k^alpha`` before minmax rounding and the activation divided by
        it, with ``m_k`` the channel's RMS on the calibration data and ``alpha`` in [0, 1]
        chosen per layer to minimise the layer's output error (a weight-side method: it keeps
        the accuracy of few-bit weights where a few channels carry large activations).
      gptq_damp: for ``"gptq"``, the share of the mean diagonal added to ``X^T X``.
      smoothing: SmoothQuant's migration strength ``alpha`` in [0, 1], or None (off): matmuls
        with one contracted axis quantize ``X / s`` and ``s W`` with per-input-channel
        ``s = max|X|^alpha / max|W|^(1 - alpha)`` from the calibration data (a second pass);
        layers that read one activation (q, k and v) share ``s``, from their weights' joint
        ``max|W|``, so the activation is scaled and quantized once for all of them.
      kv_cache: store a decode loop's KV cache in int8: in a ``lax.scan`` that params enter, a
        carry the body updates with ``lax.dynamic_update_slice`` (the cache written at each step;
        or a stacked cache a layer scan takes as xs and writes back as ys) is carried as int8
        codes with one float32 scale per position and head (its last axis reduced, symmetric,
        computed when written), and dequantized where it is read. A quarter of the cache's
        memory; quantize raises if no such carry is found.
      attention: None keeps matmuls without a weight operand (attention's ``Q K^T`` and
        ``P V``) in float; a signed symmetric Scheme runs them int8 x int8 -> int32 with both
        operands quantized at run time: one scale per row of each operand (its contracted axes
        reduced: per query / key position and head for ``Q K^T``, per head and channel for
        ``V``) under ``granularity="token"``, or one per operand under ``"tensor"``. The output
        is the int32 product times both scales. A ``Rule(skip=True)`` keeps a matching layer in
        float.
      nan_rows: True: a row of a quantized matmul (a sample of a convolution) whose activations
        hold NaN or Inf comes out NaN, since codes cannot hold them (where float may give a
        finite value, e.g. ``tanh(inf)``, the row is NaN still; one reduction per layer input
        and one add per output, in both modes). False drops that
        check, for activations known to be finite: such a row's outputs are then unspecified
        (finite and wrong, mostly, as in ONNX Runtime's and TFLite's int8 kernels). The check
        is about 10% of MiniLM's time offloaded to ONNX Runtime.
    """

    weights: Scheme = Scheme(granularity="channel", narrow_range=True)
    activations: Scheme | None = Scheme(symmetric=False)
    calibration: str = "minmax"
    percentile: float = 99.99
    requantize: str = "float"
    rules: tuple[Rule, ...] = ()
    dynamic: bool = False
    weight_calibration: str = "minmax"
    gptq_damp: float = 0.1
    smoothing: float | None = None
    kv_cache: bool = False
    attention: Scheme | None = None
    nan_rows: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.nan_rows, bool):
            raise TypeError(f"QConfig: nan_rows must be True or False; got {self.nan_rows!r}")
        if not isinstance(self.weights, Scheme):
            raise TypeError(f"QConfig: weights must be a Scheme; got {self.weights!r}")
        if self.activations is not None and not isinstance(self.activations, Scheme):
            raise TypeError(
                f"QConfig: activations must be a Scheme or None; got {self.activations!r}"
            )
        if self.calibration not in CALIBRATIONS:
            raise ValueError(
                f"QConfig: calibration must be one of {CALIBRATIONS}; got {self.calibration!r}"
            )
        _check_number("percentile", self.percentile, "(0, 100]", lambda v: 0 < v <= 100)
        if self.requantize not in REQUANTIZE:
            raise ValueError(
                f"QConfig: requantize must be one of {REQUANTIZE}; got {self.requantize!r}"
            )
        given = self.rules
        if isinstance(given, (Rule, str)) or not hasattr(given, "__iter__"):
            raise TypeError(f"QConfig: rules must be a sequence of Rule; got {given!r}")
        given = tuple(given)  # (read once: a generator would be empty the second time)
        if not all(isinstance(r, Rule) for r in given):
            raise TypeError(f"QConfig: rules must be a sequence of Rule; got {given!r}")
        rules = tuple(self._inherit(i, r) for i, r in enumerate(given))
        object.__setattr__(self, "rules", rules)
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"QConfig: dynamic must be a bool; got {self.dynamic!r}")
        if not isinstance(self.kv_cache, bool):
            raise TypeError(f"QConfig: kv_cache must be a bool; got {self.kv_cache!r}")
        a = self.attention
        if a is not None and (
            not isinstance(a, Scheme)
            or not (a.symmetric and a.signed)
            or a.granularity not in ("tensor", "token")
            or a.bits > 8
        ):
            raise ValueError(
                "QConfig: attention must be None or a signed symmetric Scheme of at most 8 bits "
                "with granularity 'token' or 'tensor' (scales computed at run time), e.g. "
                f"Scheme(granularity='token'); got {a!r}"
            )
        if self.weight_calibration not in WEIGHT_CALIBRATIONS:
            raise ValueError(
                f"QConfig: weight_calibration must be one of {WEIGHT_CALIBRATIONS}; got "
                f"{self.weight_calibration!r}"
            )
        _check_number("gptq_damp", self.gptq_damp, "(0, 10]", lambda v: 0 < v <= 10)
        if self.smoothing is not None:
            _check_number("smoothing", self.smoothing, "[0, 1]", lambda v: 0 <= v <= 1, " or None")
        if self.smooths:
            weight_only = [
                f"rules[{i}]"
                for i, r in enumerate(self.rules)
                if r.smoothing is not INHERIT and r.smoothing is not None
                and r.activations is INHERIT
            ]  # fmt: skip
            if self.activations is None and (self.smoothing is not None or weight_only):
                raise ValueError(
                    "QConfig: smoothing moves activation outliers into the weights; it needs "
                    "quantized activations (got activations=None"
                    f"{', inherited by ' + weight_only[0] if weight_only else ''}). Drop "
                    "smoothing for weight-only, or give the rule an activation Scheme."
                )
            if self.weight_calibration == "awq":
                raise ValueError(
                    "QConfig: smoothing and weight_calibration='awq' both scale the input "
                    "channels of a layer; choose one"
                )
        if self.requantize == "fixed_point":
            dynamic = ["activations=None"] if self.activations is None else []
            dynamic += ["dynamic=True"] if self.dynamic else []
            dynamic += [
                f"per-token activations in rules[{i}]"
                for i, r in enumerate(self.rules)
                if isinstance(r.activations, Scheme) and r.activations.granularity == "token"
            ]
            if dynamic:
                raise ValueError(
                    "QConfig: requantize='fixed_point' needs static activation scales (an int8 "
                    f"output scale is calibrated per layer); got {dynamic[0]}"
                )
        check_weights(self.weights, "QConfig")
        if self.activations is not None:
            check_activations(self.activations, self.dynamic, "QConfig")
        for i, r in enumerate(self.rules):
            if isinstance(r.weights, Scheme):
                check_weights(r.weights, f"QConfig: rules[{i}]")
            if isinstance(r.activations, Scheme):
                # (per token in a rule: that layer's scales come from each row at run time)
                check_activations(r.activations, True, f"QConfig: rules[{i}]")

    @property
    def smooths(self) -> bool:
        """Whether any layer may be smoothed (by ``smoothing`` or a rule's)."""
        return self.smoothing is not None or any(
            r.smoothing is not INHERIT and r.smoothing is not None for r in self.rules
        )

    def smoothing_for(self, rule: int | None) -> float | None:
        """The SmoothQuant ``alpha`` of a layer that ``rules[rule]`` matched (None: no rule)."""
        r = None if rule is None else self.rules[rule]
        return self.smoothing if r is None or r.smoothing is INHERIT else r.smoothing

    def _inherit(self, i: int, rule: Rule) -> Rule:
        """``rule`` with the fields its schemes leave out taken from this config's schemes."""
        changes: dict[str, Any] = {}
        for side in ("weights", "activations"):
            mine, base = getattr(rule, side), getattr(self, side)
            if not isinstance(mine, Scheme) or base is None:
                continue
            try:
                changes[side] = mine.inherit(base)
            except ValueError as e:
                unset = ", ".join(f for f in _SCHEME_DEFAULTS if f not in mine._given)
                raise ValueError(
                    f"QConfig: rules[{i}].{side} takes the fields it leaves out ({unset}) from "
                    f"QConfig.{side} ({base.short()}), which makes it invalid: {e}. Set those "
                    "fields in the rule's Scheme."
                ) from e
        return dataclasses.replace(rule, **changes) if changes else rule


def check_weights(s: Scheme, where: str) -> None:
    if s.granularity == "token":
        raise ValueError(
            f"{where}: weights cannot use granularity='token' (tokens are rows of an activation); "
            "use 'tensor', 'channel' or 'group'"
        )


def check_activations(s: Scheme, dynamic: bool, where: str) -> None:
    if s.granularity in ("channel", "group"):
        raise ValueError(
            f"{where}: activations cannot use granularity={s.granularity!r}: a scale along the "
            "contracted axis does not factor out of an integer dot; use 'tensor' or 'token'"
        )
    if s.granularity == "token" and not dynamic:
        raise ValueError(
            f"{where}: activations with granularity='token' need QConfig(dynamic=True): the "
            "tokens of a new input are not known at calibration time (for some layers only: "
            "a Rule with these activations)"
        )
