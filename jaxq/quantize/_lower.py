"""The engine of annotate / calibrate / realize: one table of rules over the float program.

Every phase rewrites the float program through the same rules, one per quantizable primitive,
whose work depends on the mode: ``"simulate"`` (fake-quantize with ``simulated_quantize``),
``"observe"`` (record statistics for calibration) or ``"realize"`` (integer code). What the phases
share lives in ``_state``; the arithmetic in ``_arith``; which equations are sites in ``_sites``; the
integer pass-through chains of realize in ``_chains``.

A weight is either a param leaf (``jaxq.quantize(f, params)``: an input of the program, tracked
through layout-only equations as a ``WeightRef``, see ``_params``) or an operand whose value is
known while rewriting: a constant of the jaxpr (arrays the function closes over), or one derived
from constants only through pass-through ops (transpose, reshape, convert...), which are folded
here. Calls to ``jit`` are inlined so that weights flow into their bodies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxq import _compat as C
from jaxq._program import Program
from jaxq._program import _path_str as path_str
from jaxq._walk import RewriteError, Visit, retrace, rewrite
from jaxq.quantize._arith import (
    act_qparams,
    codes,
    dequantized_weight,
    fake_quant_act,
    fake_quant_weight,
    int8_codes,
    quantize_weight,
    reciprocal,
    storage_offset,
    straight_through,
    traced_qweight,
    view_qweight,
)
from jaxq.quantize._chains import (
    PASS_THROUGH,
    QTensor,
    follow_mask,
    passthrough_input,
    plan_chains,
    sample_chains,
)
from jaxq.quantize._config import EMBEDDING, OPT_IN, QUANTIZABLE, Scheme
from jaxq.quantize._intsums import int_dot
from jaxq.quantize._kvcache import KVCache, cache_carries
from jaxq.quantize._observers import pool
from jaxq.quantize._params import (
    CHAIN,
    LeafPlan,
    QView,
    WeightRef,
    chain_value,
    float_leaf,
    leaf_axis,
    to_float,
    to_leaf,
    to_site,
)
from jaxq.quantize._qarray import QArray, is_qarray
from jaxq.quantize._sites import (
    gptq_input_axis,
    make_site,
    nonfinite_rows,
    poison_rows,
    resolve,
)
from jaxq.quantize._state import (
    FOLDABLE,
    INLINE,
    REMATS,
    QState,
    QuantizeError,
    QWeight,
    Site,
    is_concrete,
    shaped_aval,
    weight_digest,
)

# ---- the engine ---------------------------------------------------------------------------------


SiteHandler = Callable[[Visit, Site, Any, list[Any], Any], Any]
"""``handler(visit, site, qweight, invals, act)``: ``qweight`` is None where the weight needs none
(calibration; params already quantized); ``act`` the layer's static activation ``(scale,
zero_point)`` as float32 values (constants, or values of the program: a QArray's, an iteration's
of a layer stack), or None where there are none (dynamic scales, before calibration)."""


LOOP_REASON = (
    "inside a scan / while / cond body, and its weight is no param the body takes as it is (a "
    "closed-over array, or a param sliced, scaled or otherwise computed before the loop): stays "
    "float (layers in loops and branches are quantized where the loop takes the param itself: "
    "jaxq.quantize(f, params, ...), or scans over a stack of them: lax.scan(body, x, params))"
)
CUSTOM_REASON = (
    "inside a custom_jvp / custom_vjp function: stays float (quantizing its body would change "
    "the function its derivative rule was written for); call the layer outside it to quantize it"
)
SPARSE = (
    *("bcoo_dot_general", "bcoo_spdot_general", "bcoo_dot_general_sampled", "bcsr_dot_general"),
    *("coo_matmat", "coo_matvec", "csr_matmat", "csr_matvec"),
)
"""The matmuls of ``jax.experimental.sparse`` (a BCOO weight or input): float, and listed."""
SPARSE_REASON = "a sparse matmul (jax.experimental.sparse): stays float (codes are dense)"
SOLVE_REASON = (
    "inside a linear solve (custom_linear_solve: jnp.linalg.solve, lax.custom_linear_solve): "
    "stays float (its products are the solver's steps, not layers)"
)
ARRAY_STATS = (":gram", ":absmax", ":wabsmax", ":weight")
"""Suffixes of the per-layer arrays calibration collects (GPTQ / AWQ / SmoothQuant statistics)
beside the activation statistics, which are keyed by the layer's name (``:out``: its output)."""


def iteration_key(key: str, i: int, layer: bool) -> str:
    """The statistic ``key`` of iteration ``i`` of a loop: ``name@i`` (``name@i:kind``). A layer
    stack's index comes first, a loop's over constant weights last, however the loops nest:
    ``name@layer@step`` for a decode loop over a stack and for a stack of time loops alike."""
    kind = next((k for k in (*ARRAY_STATS, ":out") if key.endswith(k)), "")
    name, sep, inner = key.removesuffix(kind).partition("@")
    if layer:
        return f"{name}@{i}{sep}{inner}{kind}"
    return f"{name}{sep}{inner}@{i}{kind}"


DERIVED = (
    *("sub", "div", "neg", "integer_pow", "square", "sqrt", "rsqrt", "abs", "exp", "log", "tanh"),
    *("max", "min", "select_n", "reduce_sum", "reduce_max", "reduce_min"),
    *("gt", "ge", "lt", "le", "eq", "ne", "and", "or", "not", "clamp", "pad", "iota"),
    "dynamic_update_slice",
    *("scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max"),
)
"""Equations whose result, computed from a param, is noted as derived from it: elementwise ones,
reductions (a weight normalized in f: weight standardization, Flax's WeightNorm) and updates (a
pruned or masked weight; ``iota``: a mask's positions, computed from no input). ``add`` and
``mul`` are opt-in sites and note it themselves."""
COMPLEX_REASON = "complex operands: stays float (int8 codes hold real values)"
COMPUTED_CONSTANT = (
    "one operand is computed in f from constants alone, not a param (an interpolation matrix: "
    "jax.image.resize): stays float"
)
LOOKUP = "a lookup in params"
"""How the reason of an embedding lookup left float (embeddings are opt-in) begins."""
UNFOLLOWED = "its weight, params"
"""How the reason of a layer whose weight param reaches it through an equation quantization
does not follow (a reshape) begins."""
WITH_RUNTIME = " with run-time values"
"""Noted after the primitive of a weight computed from a param and values f computes."""
NO_WEIGHT_REASON = (
    "no weight operand (both are activations; a weight passed as an argument must be in params: "
    "jaxq.quantize(f, params, ...))"
)
NO_WEIGHT_MATMUL = NO_WEIGHT_REASON.replace(
    "; a weight",
    ": attention's Q K^T and P V run int8 under "
    "QConfig(attention=jaxq.Scheme(granularity='token')); a weight",
)


class Engine:
    """Rules shared by every mode; ``handler(visit, site, qweight, invals, act)`` does the mode's
    work. Observing handlers (calibration) put their statistics in :attr:`sink` and read their
    histogram radii from :attr:`radii`: inside a layer stack both are the current iteration's."""

    def __init__(
        self,
        state: QState,
        handler: SiteHandler,
        chains: Mapping[str, str] | None = None,
        grams: Mapping[str, np.ndarray] | None = None,
        *,
        mode: str = "simulate",
        verify_weights: bool = False,
        samples: frozenset[str] = frozenset(),
    ) -> None:
        self.state = state
        self.verify_weights = verify_weights  # (a constant weight must be the one quantized)
        self.chains = dict(chains or {})
        self.samples = samples  # (layers whose chains carry one NaN flag per sample)
        self.grams = dict(grams or {})  # layers to (re)quantize with GPTQ
        self.handler = handler
        self.mode = mode  # "simulate", "observe" or "realize": what a param weight becomes
        self.leaves: dict[int, LeafPlan] = {}
        self.site_leaves: dict[str, int] = {}  # the param leaf of every param site
        self.sites: dict[str, Site] = {}
        self.skipped: dict[str, str] = {}
        # layers the config's granularity="group" does not apply to (a convolution, an N-D
        # kernel): per channel instead, with their weight shapes
        self.per_channel: dict[str, tuple[int, ...]] = {}
        self.weights: dict[str, QWeight] = dict(state.weights)
        self.matched: set[int] = set()
        self.inlined: set[tuple[Any, ...]] = {()}
        self.act_inputs: dict[str, tuple[Any, Any]] = {}  # site -> a QArray's (scale, zp)
        self.smooth_inputs: dict[str, Any] = {}  # site -> the iteration's smoothing factors
        self.float_leaves: set[int] = set()  # param leaves some equation reads as floats
        # ... before the layer that quantizes them planned them (a tied embedding's lookup):
        # simulate gave those readers floats, so the program is lowered again (see annotate)
        self.early_float: set[int] = set()
        self.float_reads: dict[str, list[int]] = {}  # a layer left float -> the leaves it reads
        self.custom_reads: dict[str, list[int]] = {}  # a custom_jvp / vjp call -> params entering
        # the reasons of the opaque calls (custom derivatives, solves) being re-bound, outermost first
        self.opaque: list[str] = []
        # values made from a param leaf by equations a weight cannot pass (a reshape): by id,
        # the value (kept alive) and (leaf, primitive), for the reason its layer stays float
        # (None: a value of constants alone, which may go into such a weight)
        self.derived: dict[int, tuple[Any, tuple[int, str] | None]] = {}
        self.act_act: dict[str, Scheme] = {}  # activation x activation matmuls in int8
        self.sink: dict[str, Any] = {}  # an observing handler's statistics
        self.radii: dict[str, Any] = {}  # an observing handler's histogram radii
        # (length, iteration index, whether a layer stack) of each scan the current equation is
        # inside, outermost first
        self.loops: tuple[tuple[int, Any, bool], ...] = ()
        self.kv_caches: list[str] = []  # the scans whose carries became int8 KV caches
        self.kv_on = state.config.kv_cache and mode in ("simulate", "realize")

    def take_inputs(self, values: list[Any]) -> list[Any]:
        """Note the activation scales the QArrays among a call's inputs carry (realize reads
        them as values of the program, not constants)."""
        for v in values:
            if isinstance(v, WeightRef) and isinstance(v.value, QView):
                view, plan = v.value, self.state.leaves.get(v.leaf)
                if view.act_scale is not None and plan is not None and plan.act_site:
                    self.act_inputs[plan.act_site] = (view.act_scale, view.act_zero_point)
        return values

    def act_params(self, site: Site) -> tuple[Any, Any] | None:
        """A layer's static activation (scale, zero point) as float32: the values its weight's
        QArray carries (or the current iteration's, in a layer stack), else the calibrated
        constants; None where there are none (computed at run time, or not calibrated yet)."""
        carried = self.act_inputs.get(site.name)
        if carried is None:
            params = self.state.act.get(site.name)
            if params is None:
                return None
            return np.float32(params.scale), np.float32(params.zero_point)
        scale, zp = carried
        if zp is None:  # symmetric: the zero point of the scheme (0), the same for every layer
            return scale, np.float32(0)
        return scale, jnp.asarray(zp).astype(jnp.float32)

    def smoothing(self, name: str) -> Any:
        """A layer's per-input-channel smoothing factors (SmoothQuant, AWQ), or with
        ``name + ":inv"`` their reciprocals: the current iteration's in a layer stack; None where
        it is not smoothed."""
        if name in self.smooth_inputs:
            return self.smooth_inputs[name]
        if name.endswith(":inv"):  # 1 / s, rounded once on the host (as for a layer stack)
            s = self.state.smooth.get(name.removesuffix(":inv"))
            return None if s is None else np.float32(1) / np.asarray(s, np.float32)
        return self.state.smooth.get(name)

    def release(self) -> None:
        """Drop the values traced in this lowering (JAX's trace caches keep the engine alive)."""
        self.act_inputs, self.smooth_inputs, self.derived = {}, {}, {}

    def _note_derived(self, invals: Sequence[Any], out: Any, primitive: str) -> Any:
        """Remember that ``out`` is computed from params and constants alone (``w * 2``,
        ``w + a @ b``): a layer that takes it as its weight then says so instead of "no weight
        operand". (An activation plus a bias param is an activation.)"""
        own = lambda v: (
            isinstance(v, WeightRef)
            or id(v) in self.derived
            or isinstance(v, (np.ndarray, np.generic, int, float))
            or (isinstance(v, jax.Array) and is_concrete(v))
        )
        if isinstance(out, (list, tuple)):
            return out
        if not all(own(v) for v in invals):
            # A param plus (or times) run-time values into a value of the param's own shape is a
            # weight built in f (a LoRA update merged on the fly, w + a @ b), not an activation
            # plus a bias, which broadcasts the param up to the activation's shape. (Not a value
            # of constants alone, nor a param written with dynamic_update_slice: a KV cache.)
            base = [v for v in invals if isinstance(v, WeightRef) or self._origin([v])]
            shape = np.shape(out)
            if (
                primitive not in ("add", "sub", "mul")
                or not base
                or len(shape) < 2
                or np.shape(to_float(base[0])) != shape
            ):
                return out
            primitive = f"{primitive}{WITH_RUNTIME}"
        leaf = next((v.leaf for v in invals if isinstance(v, WeightRef)), None)
        origin = (leaf, primitive) if leaf is not None else self._origin(invals)
        # (origin None: computed from constants alone, which jit traces like any value)
        self.derived[id(out)] = (out, origin)
        return out

    def _origin(self, values: Sequence[Any]) -> tuple[int, str] | None:
        """The (leaf, primitive) of the first of ``values`` computed from a param, or None."""
        found = (self.derived.get(id(v), (None, None))[1] for v in values)
        return next((o for o in found if o is not None), None)

    def derived_rule(self, visit: Visit, *invals: Any) -> Any:
        """An arithmetic equation, bound as it is, that notes a result computed from a param."""
        out = visit.bind(*(self.coerce(v) for v in _read_caches(invals)))
        return self._note_derived(invals, out, visit.primitive)

    def index_rule(self, visit: Visit, *invals: Any) -> Any:
        """A ``dynamic_slice``, noting a slice of whole layers of a param (``p["w"][i]`` with a
        traced ``i``: a stack indexed by a loop counter) as derived from it."""
        out = visit.bind(*(self.coerce(v) for v in _read_caches(invals)))
        src = invals[0]
        whole = tuple(visit.params["slice_sizes"])[1:] == tuple(np.shape(to_float(src)))[1:]
        if whole and isinstance(src, WeightRef):
            self.derived[id(out)] = (out, (src.leaf, visit.primitive))
        elif whole and id(src) in self.derived:
            self.derived[id(out)] = (out, self._origin([src]))
        return out

    def custom_rule(self, visit: Visit, *invals: Any) -> Any:
        """A custom_jvp / custom_vjp call, bound as it is (its layers stay float), noting the
        params that enter it; a ReLU on an int8 chain passes codes through."""
        refs = [v.leaf for v in invals if isinstance(v, WeightRef)]
        if refs:
            self.custom_reads[visit.name] = refs
        if visit.name in self.chains:
            return self.passthrough_rule(visit, *invals)
        return self.opaque_rule(visit, *invals)

    def sparse_rule(self, visit: Visit, *invals: Any) -> Any:
        """A sparse matmul, bound as it is: reported (with the param it reads) as staying float."""
        self.skipped[visit.name] = SPARSE_REASON
        refs = [v.leaf for v in invals if isinstance(v, WeightRef)]
        if refs:
            self.float_reads[visit.name] = refs
        return visit.bind(*(self.coerce(v) for v in invals))

    def opaque_rule(self, visit: Visit, *invals: Any) -> Any:
        """A call whose layers stay float (custom derivatives, a linear solve), bound as it is;
        a layer anywhere inside, under loops too, is reported with the outermost one's reason."""
        self.opaque.append(CUSTOM_REASON if visit.primitive in C.CUSTOM_CALLS else SOLVE_REASON)
        try:
            return visit.bind(*(self.coerce(v) for v in invals))
        finally:
            self.opaque.pop()

    def rules(self) -> dict[str, Any]:
        table: dict[str, Any] = {p: self.site_rule for p in (*QUANTIZABLE, *OPT_IN)}
        if self.state.params is not None:  # (params: a weight computed from one is named)
            table.update({p: self.derived_rule for p in DERIVED})
            table["dynamic_slice"] = self.index_rule
        table.update({p: self.fold_rule for p in FOLDABLE})
        table.update({p: self.inline_rule for p in INLINE})
        table["scan"] = self.scan_rule
        table["while"] = self.while_rule
        table["cond"] = self.cond_rule
        if self.kv_on:
            table["dynamic_update_slice"] = self.cache_write_rule
        if self.chains:
            table.update({p: self.passthrough_rule for p in PASS_THROUGH})
        table.update({p: self.custom_rule for p in C.CUSTOM_CALLS})
        table["custom_linear_solve"] = self.opaque_rule
        sparse = sys.modules.get("jax.experimental.sparse")  # (its primitives: once imported)
        if sparse is not None:
            table.update({getattr(sparse, f"{p}_p"): self.sparse_rule for p in SPARSE})
        return table

    def coerce(self, v: Any) -> Any:
        """What an equation without a rule receives: a weight's float value (noting that its
        leaf is read as floats), an int8 KV cache read."""
        if isinstance(v, WeightRef):
            self.float_leaves.add(v.leaf)
            plan = self.leaves.get(v.leaf) or self.state.leaves.get(v.leaf)
            if self.mode == "simulate" and not isinstance(v.value, QView):
                if plan is not None:
                    return self._as_deployed(v, plan)
                self.early_float.add(v.leaf)
        return v.dequantize() if isinstance(v, KVCache) else to_float(v)

    def _as_deployed(self, ref: WeightRef, plan: Any) -> Any:
        """A float param leaf that is quantized for another layer, as a layer that stays float
        reads it once deployed: the dequantized codes (a tied weight; realize has only the
        QArray), so QAT trains the function realize runs."""
        w = jnp.asarray(ref.value)
        site = self.sites.get(plan.site) or self.state.sites[plan.site]

        def deployed(leaf: Any) -> Any:  # (one layer's slice of a stacked leaf: its own scales)
            w_site = to_site(leaf, plan.chain)
            qw = traced_qweight(w_site, site, self.state.config.weight_calibration)
            return to_leaf(fake_quant_weight(w_site, qw, site), plan.chain)

        leaf = to_leaf(w, ref.chain)
        fq = jax.vmap(deployed)(leaf) if plan.layers and not ref.layers else deployed(leaf)
        return to_site(fq, ref.chain).astype(w.dtype)

    def plain(self, v: Any) -> Any:
        """A value as an array at a loop's boundary (int8 codes dequantized, weights as floats)."""
        return v.dequantize() if isinstance(v, QTensor) else self.coerce(v)

    def _same_smoothing(self, a: str, b: str) -> bool:
        """Whether layers ``a`` and ``b`` scale their input channels alike (or neither does):
        then one set of codes serves both."""
        smooth = self.state.smooth
        fa = [v for k, v in smooth.items() if k == a or k.startswith(a + "@")]
        fb = [v for k, v in smooth.items() if k == b or k.startswith(b + "@")]
        return len(fa) == len(fb) and all(np.array_equal(x, y) for x, y in zip(fa, fb, strict=True))

    def passthrough_rule(self, visit: Visit, *invals: Any) -> Any:
        """Run a planned pass-through equation on int8 codes (quantizing its input if needed)."""
        site_name = self.chains.get(visit.name)
        if site_name is None:
            fold = visit.primitive in FOLDABLE
            return self.fold_rule(visit, *invals) if fold else visit.bind(*invals)
        k = passthrough_input(visit.eqn)
        assert k is not None  # plan_chains only plans equations with a pass-through input
        invals = _read_caches(invals)
        x = invals[k]
        if not isinstance(x, QTensor):
            site = self.state.sites[site_name]
            scheme = site.activations
            assert scheme is not None  # plan_chains only plans sites with activation schemes
            act = self.act_params(site)
            assert act is not None  # plan_chains only plans calibrated sites
            scale, zp = act
            off = storage_offset(scheme)
            q = codes(x, scale, zp, scheme)
            zp_s = (zp + off).astype(np.int32 if isinstance(zp, np.generic) else jnp.int32)
            bad = None
            if self.state.config.nan_rows:  # (one flag per sample where that is exact)
                bad = ~jnp.isfinite(x)
                if site_name in self.samples and x.ndim > 1:
                    bad = jnp.any(bad, axis=tuple(range(1, x.ndim)), keepdims=True)
            x = QTensor(int8_codes(q + off if off else q), scale, zp_s, bad)
        if visit.primitive in ("max", "custom_jvp_call"):  # ReLU: the code of 0 is the zero point
            out = jnp.maximum(x.codes, x.zero_point.astype(np.int8))
        else:
            new = list(invals)
            new[k] = x.codes
            out = visit.bind(*new)
        qt = QTensor(out, x.scale, x.zero_point, follow_mask(x.bad, visit.eqn))
        return [qt] if visit.eqn.primitive.multiple_results else qt

    def fold_rule(self, visit: Visit, *invals: Any) -> Any:
        invals = _read_caches(invals)
        if any(isinstance(v, WeightRef) for v in invals):
            ref = invals[0]
            if visit.primitive in CHAIN and len(invals) == 1 and isinstance(ref, WeightRef):
                many = visit.eqn.primitive.multiple_results  # (a barrier of the weight alone)
                bind = (lambda v: visit.bind(v)[0]) if many else visit.bind
                out = ref.then(
                    visit.primitive,
                    visit.params,
                    chain_value(ref.value, visit.primitive, visit.params, bind),
                )
                return [out] if many else out
            out = visit.bind(*(self.coerce(v) for v in invals))
            leaf = next(v.leaf for v in invals if isinstance(v, WeightRef))
            for o in out if visit.eqn.primitive.multiple_results else [out]:  # (split: each)
                self.derived[id(o)] = (o, (leaf, visit.primitive))
            return out
        if any(id(v) in self.derived for v in invals):  # (still the param's value, reshaped
            out = visit.bind(*invals)  # again or cast; or a value of constants alone)
            origin = self._origin(invals)
            for o in out if visit.eqn.primitive.multiple_results else [out]:
                self.derived[id(o)] = (o, origin)
            return out
        # (folded on the host where the inputs are known, unless a shape is symbolic: a
        # jnp.zeros((x.shape[0], d)) under jax.export with a symbolic batch is not a constant;
        # or inside a body re-bound without constants: jnp.clip's bounds in a custom_vjp)
        fixed = all(isinstance(d, int) for o in visit.eqn.outvars for d in shaped_aval(o).shape)
        if invals and fixed and not visit.in_open_body and all(is_concrete(v) for v in invals):
            with jax.ensure_compile_time_eval():
                return visit.bind(*invals)
        return visit.bind(*invals)

    def inline_rule(self, visit: Visit, *invals: Any) -> Any:
        subs = C.subjaxpr_params(visit.params)
        if len(subs) != 1 or subs[0][1] is not None:
            return visit.bind(*invals)
        key = subs[0][0]
        if visit.path[:-1] in self.inlined:
            self.inlined.add((*visit.path, key))
        if visit.primitive not in REMATS or self.mode == "observe":
            return visit.inline(*invals)
        # a remat keeps its policy around the quantized body (QAT saves what the user chose):
        # traced arrays go in as its arguments; weights, constants and int8 chains closed over
        arrays = [i for i, v in enumerate(invals) if isinstance(v, jax.Array) and C.is_tracer(v)]

        def body(*args: Any) -> list[Any]:
            vals = list(invals)
            for i, a in zip(arrays, args, strict=True):
                vals[i] = a
            return [self.plain(v) for v in visit.eval_body(key, *vals)]

        with visit.own_scope():  # (named as the remat it replaces, its body under it)
            outs = C.remat_like(visit.params, body)(*(invals[i] for i in arrays))
        return outs if visit.eqn.primitive.multiple_results else outs[0]

    def scan_rule(self, visit: Visit, *invals: Any) -> Any:
        """A scan that params enter runs its body through these rules, so the layers inside are
        quantized. A param leaf among its ``xs`` (a stack of layers: ``nn.scan``, stacked params)
        is sliced per iteration into the weight of one layer: stacked codes and scales,
        activations calibrated per iteration (keys ``name@i``), their scales sliced the same
        way. A param among its constants (a decode loop's weights) is one weight for every
        iteration, its activations calibrated over all of them. Scans nest (a decode loop over a
        layer stack). Any other scan is re-bound as it is (its layers stay float)."""
        p = visit.params
        n_consts, n_carry = C.scan_counts(p)
        loop = C.scan_loop(p)
        length = int(loop["length"])
        consts = list(invals[:n_consts])
        xs = list(invals[n_consts + n_carry :])
        stacked = [
            isinstance(v, WeightRef) and not v.chain and not v.layers and v.value is not None
            for v in xs
        ]
        if not any(stacked) and not any(isinstance(v, WeightRef) for v in consts):
            return visit.bind(*invals)
        self.inlined.add((*visit.path, C.SCAN_BODY))  # its layers are quantized, not left in a loop
        init: list[Any] = [self.plain(v) for v in invals[n_consts : n_consts + n_carry]]
        init_dtypes = [jnp.asarray(v).dtype for v in init]
        caches: list[int] = []
        if self.kv_on:  # (QConfig.kv_cache; calibration observes the float cache)
            caches = cache_carries(p[C.SCAN_BODY], n_consts, n_carry)
            if caches:
                self.kv_caches.append(visit.name)
            for c in caches:  # carried as (codes, scales)
                kv = KVCache.of(init[c])
                init[c] = (kv.codes, kv.scale)
        leaf_xs = [v.value if st else None for v, st in zip(xs, stacked, strict=True)]
        plain_xs = [
            None if st else _kv_arrays(v) if isinstance(v, KVCache) else self.plain(v)
            for v, st in zip(xs, stacked, strict=True)
        ]
        kv_dtypes = {i: v.dtype for i, v in enumerate(xs) if isinstance(v, KVCache)}
        views = {i: v for i, v in enumerate(leaf_xs) if isinstance(v, QView)}
        leaf_xs = [v.arrays() if isinstance(v, QView) else v for v in leaf_xs]
        # what each iteration of a layer stack reads besides its slices: its calibrated
        # activation parameters and (calibration) its histogram radii, stacked (a loop over
        # constant weights has one set for all its iterations, even where its length is a
        # stack's: a time loop in each layer of as many layers)
        keys = lambda table: _stacked_keys(table, length) if any(stacked) else []
        per_iter: dict[tuple[str, str], Any] = {
            ("act", k): (
                np.asarray([self.state.act[f"{k}@{i}"].scale for i in range(length)], np.float32),
                np.asarray(
                    [self.state.act[f"{k}@{i}"].zero_point for i in range(length)], np.int32
                ),
            )
            for k in keys(self.state.act)
        }
        per_iter.update(
            {
                ("radius", k): jnp.stack([self.radii[f"{k}@{i}"] for i in range(length)])
                for k in keys(self.radii)
            }
        )
        per_iter.update(
            {
                ("smooth", k): np.stack([self.state.smooth[f"{k}@{i}"] for i in range(length)])
                for k in keys(self.state.smooth)
            }
        )
        per_iter.update(
            {
                ("smooth", k + ":inv"): np.float32(1) / per_iter["smooth", k]
                for k in keys(self.state.smooth)
            }
        )

        out_kv: dict[int, Any] = {}  # body outputs that are int8 KV caches: their dtypes

        def body(carry: list[Any], x: Any) -> Any:
            x_plain, x_leaves, x_iter, index = x
            carry = list(carry)
            for c in caches:
                carry[c] = KVCache(carry[c][0], carry[c][1], init_dtypes[c])
            with self._body_scope() as sink:
                self.loops = (*self.loops, (length, index, any(stacked)))
                for (kind, k), v in x_iter.items():
                    {"act": self.act_inputs, "radius": self.radii, "smooth": self.smooth_inputs}[
                        kind
                    ][k] = v
                xs_in: list[Any] = []
                for i, (v, st) in enumerate(zip(x_plain, stacked, strict=True)):
                    if i in kv_dtypes:  # one layer's slice of an int8 KV cache
                        xs_in.append(KVCache(v["codes"], v["scale"], kv_dtypes[i]))
                        continue
                    if not st:
                        xs_in.append(v)
                        continue
                    ref, value = xs[i], x_leaves[i]
                    if i in views:  # this iteration's slice of a stacked QArray
                        value = views[i].layer(value, index)
                        plan = self.state.leaves.get(ref.leaf)
                        if value.act_scale is not None and plan is not None and plan.act_site:
                            self.act_inputs[plan.act_site] = (
                                value.act_scale,
                                value.act_zero_point,
                            )
                    xs_in.append(WeightRef(ref.leaf, value, (), layers=length))
                outs = visit.eval_body(C.SCAN_BODY, *consts, *carry, *xs_in)
            for c in caches:
                kv = outs[c] if isinstance(outs[c], KVCache) else KVCache.of(self.plain(outs[c]))
                outs[c] = (kv.codes, kv.scale)
            out_kv.update({i: v.dtype for i, v in enumerate(outs) if isinstance(v, KVCache)})
            outs = [
                v if i in caches else _kv_arrays(v) if isinstance(v, KVCache) else self.plain(v)
                for i, v in enumerate(outs)
            ]
            return outs[:n_carry], (outs[n_carry:], sink)

        with visit.own_scope():
            carry, (ys, sink) = lax.scan(
                body, init, (plain_xs, leaf_xs, per_iter, np.arange(length, dtype=np.int32)), **loop
            )
        carry = [
            KVCache(v[0], v[1], init_dtypes[i]).dequantize() if i in caches else v
            for i, v in enumerate(carry)
        ]
        ys = [  # (the layers' int8 KV caches, stacked)
            KVCache(y["codes"], y["scale"], out_kv[n_carry + i]) if isinstance(y, dict) else y
            for i, y in enumerate(ys)
        ]
        for k, v in sink.items():  # one entry per iteration (a layer's, or a loop constant's)
            for i in range(length):
                key = iteration_key(k, i, layer=any(stacked))
                self.sink[key] = jax.tree.map(lambda a, i=i: a[i], v)
        return [*carry, *ys]

    def act_act_rule(self, visit: Visit, raw: list[Any], scheme: Scheme) -> Any:
        """A matmul of two activations (``QConfig.attention``): both operands quantized with
        scales computed here (per row, or per operand), the product int8 x int8 -> int32 times
        both scales (realize), or the float product of the fake-quantized operands
        (simulate). A NaN or Inf in a row makes that row's scale, and so its outputs,
        non-finite."""
        self.act_act[visit.name] = scheme
        lhs, rhs = (v.dequantize() if isinstance(v, QTensor) else self.coerce(v) for v in raw)
        if self.mode == "observe":  # (nothing to calibrate)
            return visit.bind(lhs, rhs)
        (lc, rc), (lb, rb) = visit.params["dimension_numbers"]
        scale = _operand_scale if scheme.granularity == "token" else _tensor_scale
        sl, sr = scale(lhs, tuple(lc), scheme), scale(rhs, tuple(rc), scheme)
        zero = np.float32(0)
        ql, qr = codes(lhs, sl, zero, scheme), codes(rhs, sr, zero, scheme)
        if self.mode == "simulate":  # (QAT: gradients straight through the rounding)
            fl = straight_through(lhs, (ql * sl).astype(lhs.dtype))
            return visit.bind(fl, straight_through(rhs, (qr * sr).astype(rhs.dtype)))
        acc = int_dot(int8_codes(ql), int8_codes(qr), visit.params["dimension_numbers"])
        l_free = [d for d in range(lhs.ndim) if d not in (*lc, *lb)]
        r_free = [d for d in range(rhs.ndim) if d not in (*rc, *rb)]
        sl = _to_output(sl, lc, [*lb, *l_free], trailing=len(r_free))
        sr = _to_output(sr, rc, [*rb, *r_free], inner=(len(lb), len(l_free)))
        out_dtype = shaped_aval(visit.eqn.outvars[0]).dtype
        return (acc.astype(jnp.float32) * sl * sr).astype(out_dtype)

    def while_rule(self, visit: Visit, *invals: Any) -> Any:
        """A while loop whose body reads params (``fori_loop`` with traced bounds, a decode
        loop until a stop token) runs its body through these rules: each weight gets one scale,
        its activations calibrated over every iteration (statistics pooled in the loop's
        carry: the trip count is not known)."""
        cond_n, body_n = C.while_counts(visit.params)
        cond_consts = [self.plain(v) for v in invals[:cond_n]]
        consts = invals[cond_n : cond_n + body_n]
        if not any(isinstance(v, WeightRef) for v in consts):
            return visit.bind(*invals)
        self.inlined.add((*visit.path, C.WHILE_BODY))
        init = [self.plain(v) for v in invals[cond_n + body_n :]]
        body = lambda carry: self._run_body(visit, C.WHILE_BODY, [*consts, *carry])

        def cond_fun(state: Any) -> Any:
            return visit.eval_body(C.WHILE_COND, *cond_consts, *state[0])[0]

        with visit.own_scope():
            if self.mode != "observe":
                return lax.while_loop(lambda c: cond_fun((c,)), lambda c: body(c)[0], init)
            acc = _neutral_stats(jax.eval_shape(lambda c: body(c)[1], init))

            def body_fun(state: Any) -> Any:
                outs, sink = body(state[0])
                return outs, {k: pool(k, a, sink[k], jnp) for k, a in state[1].items()}

            outs, sink = lax.while_loop(cond_fun, body_fun, (init, acc))
        self.sink.update(sink)
        return outs

    def cond_rule(self, visit: Visit, index: Any, *ops: Any) -> Any:
        """A cond (``lax.cond`` / ``lax.switch``) whose branches read params runs each branch
        through these rules; a layer's statistics count only where its branch was taken."""
        if not any(isinstance(v, WeightRef) for v in ops):
            return visit.bind(index, *ops)
        labels = C.cond_branches(visit.params)
        for label in labels:
            self.inlined.add((*visit.path, label))
        branches = [functools.partial(self._run_body, visit, label, list(ops)) for label in labels]
        with visit.own_scope():
            if self.mode != "observe":
                return lax.switch(_plain_index(index), [lambda b=b: b()[0] for b in branches])
            shapes = [jax.eval_shape(lambda b=b: b()[1]) for b in branches]
            union = _neutral_stats({k: v for s in shapes for k, v in s.items()})

            def taken(b: Callable[[], Any]) -> Any:
                outs, sink = b()
                return outs, {**union, **sink}

            outs, sink = lax.switch(
                _plain_index(index), [functools.partial(taken, b) for b in branches]
            )
        self.sink.update(sink)
        return outs

    def _run_body(self, visit: Visit, key: str, invals: list[Any]) -> tuple[list[Any], Any]:
        """A nested body evaluated with the rules: its outputs (plain arrays) and what observing
        handlers recorded in it."""
        with self._body_scope() as sink:
            outs = visit.eval_body(key, *invals)
        return [self.plain(v) for v in outs], sink

    @contextlib.contextmanager
    def _body_scope(self) -> Iterator[dict[str, Any]]:
        """While a nested body is evaluated: the activation inputs, radii and smoothing factors
        it sets stay its own, and observing handlers record into the dict yielded (restored,
        enclosing loops included, on the way out)."""
        saved = (self.act_inputs, self.radii, self.smooth_inputs, self.sink, self.loops)
        self.act_inputs, self.radii = dict(self.act_inputs), dict(self.radii)
        self.smooth_inputs, self.sink = dict(self.smooth_inputs), {}
        try:
            yield self.sink
        finally:
            self.act_inputs, self.radii, self.smooth_inputs, self.sink, self.loops = saved

    def cache_write_rule(self, visit: Visit, *invals: Any) -> Any:
        """A write into an int8 KV cache quantizes the written vectors only."""
        cache, new, *starts = invals
        if isinstance(cache, KVCache):
            return cache.update(to_float(new), [to_float(s) for s in starts])
        return visit.bind(*(self.coerce(v) for v in invals))

    def site_rule(self, visit: Visit, *invals: Any) -> Any:
        config = self.state.config
        name = visit.name
        invals = _read_caches(invals)
        refs = [v.leaf for v in invals if isinstance(v, WeightRef)]
        spec = self.state.params
        path = spec.paths[refs[0]] if len(refs) == 1 and spec is not None else None
        weights, acts, rule = resolve(config, name, visit.primitive, path)
        if rule is not None:
            self.matched.add(rule)
        raw = list(invals)

        def bind_float() -> Any:  # leave the equation as it is (dequantizing any int8 operand)
            out = visit.bind(
                *(v.dequantize() if isinstance(v, QTensor) else self.coerce(v) for v in raw)
            )
            return self._note_derived(raw, out, visit.primitive)

        if refs:  # (if it stays float: the leaves it reads, named if another layer quantizes them)
            self.float_reads[name] = refs
        if weights is None:
            if visit.primitive not in OPT_IN or rule is not None:
                self.skipped[name] = (
                    f"skipped by rules[{rule}]" if rule is not None else "weights=None"
                )
            elif (
                visit.primitive in EMBEDDING and isinstance(raw[0], WeightRef) and spec is not None
            ):
                self.skipped[name] = (  # (often the largest weight: listed, not left unsaid)
                    f"{LOOKUP}{spec.paths[raw[0].leaf]}: stays float (embeddings are "
                    "opt-in: QConfig(rules=(jaxq.Rule(primitives={'gather'}),)))"
                )
            return bind_float()
        if any(jnp.iscomplexobj(shaped_aval(v)) for v in visit.eqn.invars):
            self.skipped[name] = COMPLEX_REASON
            return bind_float()
        concrete = [
            i
            for i, v in enumerate(raw)
            if isinstance(v, WeightRef) or (not isinstance(v, QTensor) and is_concrete(v))
        ]
        if visit.primitive in EMBEDDING:  # the table is the weight; its indices may be known too
            concrete = [i for i in concrete if i == 0]
        if len(concrete) != 1:
            if len(refs) == 1 and len(concrete) == 2 and spec is not None:
                self.skipped[name] = (  # (a backward pass's unit cotangent times a weight)
                    f"its operands are param {spec.paths[refs[0]]} and a constant, no "
                    "activation: stays float"
                )
            elif concrete and refs and spec is not None:  # (LoRA's a @ b)
                paths = ", ".join(dict.fromkeys(spec.paths[r] for r in refs))
                self.skipped[name] = (
                    f"both operands are params ({paths}): stays float. A weight computed from "
                    "params (a LoRA update a @ b) is quantized merged: w + a @ b in the params "
                    "before jaxq.quantize"
                )
            elif concrete:
                self.skipped[name] = "both operands constant"
            elif visit.path[:-1] not in self.inlined:
                self.skipped[name] = self.opaque[0] if self.opaque else LOOP_REASON
            elif any(id(v) in self.derived and self.derived[id(v)][1] is None for v in raw):
                self.skipped[name] = COMPUTED_CONSTANT
            elif visit.primitive == "dot_general" and config.attention is not None:
                return self.act_act_rule(visit, raw, config.attention)
            else:
                self.skipped[name] = self._no_weight_reason(raw, visit.primitive)
            return bind_float()
        wi = concrete[0]
        in_loop = visit.path[:-1] not in self.inlined
        layers = raw[wi].layers if isinstance(raw[wi], WeightRef) else 0
        site = make_site(visit, config, wi, weights, acts, rule, in_loop, layers)
        if not isinstance(site, str) and site.weights.granularity != weights.granularity:
            self.per_channel[name] = tuple(shaped_aval(visit.eqn.invars[wi]).shape)
        if isinstance(site, str):
            self.skipped[name] = site
            return bind_float()
        if isinstance(raw[wi], WeightRef):
            plan = self.plan_leaf(raw[wi], site, visit)
            if isinstance(plan, str):
                self.skipped[name] = plan
                return bind_float()
            self.site_leaves[name] = raw[wi].leaf
        smooth = self.smoothing(name)
        if smooth is not None:
            a_axis = gptq_input_axis(visit, site)
            assert a_axis is not None  # calibrate measures absmax only where it applies
            (k_axis,) = site.contract_axes
            shape = lambda ndim, axis: [-1 if d == axis else 1 for d in range(ndim)]
            a = raw[1 - wi]
            # (times 1 / s: a multiply, where a division costs more in every runtime)
            inv = self.smoothing(name + ":inv")
            raw[1 - wi] = a * inv.reshape(shape(a.ndim, a_axis)).astype(a.dtype)
            w = raw[wi]
            if not isinstance(w, WeightRef):
                w = np.asarray(w)
                raw[wi] = (w * smooth.reshape(shape(w.ndim, k_axis))).astype(w.dtype)
            elif not isinstance(w.value, QView):  # (a QArray holds the codes of s W already)
                v = w.value
                factor = smooth.reshape(shape(v.ndim, k_axis)).astype(v.dtype)
                raw[wi] = dataclasses.replace(w, value=v * factor)
        if isinstance(raw[wi], WeightRef):
            return self.param_site(visit, site, raw)
        qw = self.weights.get(name)
        if qw is not None and self.verify_weights and qw.digest != weight_digest(raw[wi]):
            raise QuantizeError(
                f"quantize: layer {name!r} reads another weight than the one it was quantized "
                "and calibrated with: the function's layers come in another order at these "
                "argument shapes, or its closed-over weights changed. Pass the weights as params "
                "(jaxq.quantize(f, params, ...), layers matched by param path), or quantize "
                "again for these shapes"
            )
        if qw is None or qw.shape != tuple(np.shape(raw[wi])) or name in self.grams:
            digest = weight_digest(raw[wi])
            qw = quantize_weight(
                raw[wi], site, config.weight_calibration, self.grams.get(name), config.gptq_damp
            )
            self.weights[name] = qw = dataclasses.replace(qw, digest=digest)
        if qw.method == "gptq":  # codes not from rounding: the simulated weight is their value
            raw[wi] = dequantized_weight(qw, np.asarray(raw[wi]).dtype)
        self.sites[name] = site
        return self.handler(visit, site, qw, raw, self.act_params(site))

    def _no_weight_reason(self, operands: list[Any], primitive: str) -> str:
        """Why a layer has no weight: none of its operands is a param, or one is a param's value
        after an equation a weight cannot pass through (named, with the fix)."""
        origin = self._origin(operands)
        spec = self.state.params
        if origin is None or spec is None:
            if primitive in EMBEDDING:
                return "a gather from an activation, not a table in params: stays float"
            return NO_WEIGHT_MATMUL if primitive == "dot_general" else NO_WEIGHT_REASON
        leaf, primitive = origin
        path = "" if spec.paths[leaf].startswith("args[") else spec.paths[leaf]  # (bare: params)
        if primitive == "concatenate":
            fix = (
                "A weight assembled from several params (Flax's OptimizedLSTMCell joins its gates' "
                "kernels): use a cell with a layer per gate (flax.linen.LSTMCell), or keep the "
                "joined kernel as one param"
            )
        elif primitive in ("slice", "dynamic_slice"):  # (a stack of layers, one per slice)
            fix = (
                "A stack of layers sliced per layer: run it with lax.scan over the stacked "
                "params (lax.scan(body, x, params), nn.scan), whose layers are quantized, or "
                "keep one param per layer"
            )
        elif primitive.endswith(WITH_RUNTIME):
            fix = (
                "A weight updated in f by values it computes or takes as arguments (a LoRA "
                "update, w + a @ b): apply the update as a layer of its own, x @ w + (x @ a) @ b, "
                "whose w is quantized, or merge it into the params before jaxq.quantize"
            )
        elif primitive in FOLDABLE:
            fix = (
                "Store the param in the shape the layer uses; where a library reshapes it "
                "inside the layer (Keras' depthwise convolutions), quantize with the weights "
                "closed over, jaxq.quantize(functools.partial(f, params), ...), which folds it"
            )
        else:
            fix = (
                "Compute the weight outside f and pass it as the param (e.g. merge w * s or "
                "w + a @ b into the params before jaxq.quantize)"
            )
        return (
            f"{UNFOLLOWED}{path}, reaches it through {primitive}, which "
            f"quantization does not follow (only {', '.join(CHAIN[:2])}): stays float. {fix}"
        )

    def plan_leaf(self, ref: WeightRef, site: Site, visit: Visit) -> LeafPlan | str:
        """The plan of the param leaf behind ``ref`` for this site, shared with an earlier site
        only when both quantize it the same way (a reason to stay float otherwise)."""
        spec = self.state.params
        assert spec is not None  # WeightRefs only enter programs traced with params
        group = site.weights.granularity == "group"
        a = site.activations
        # realize's activation zero-point term needs the codes' sums: stored, not recomputed
        sums = a is not None and not (a.symmetric and a.signed) and not group
        plan = LeafPlan(
            leaf=ref.leaf,
            path=spec.paths[ref.leaf],
            site=site.name,
            chain=ref.chain,
            scheme=site.weights,
            scale_axes=tuple(sorted(leaf_axis(ref.chain, d) for d in site.scale_axes)),
            group_axis=leaf_axis(ref.chain, site.contract_axes[0]) if group else None,
            shape=tuple(spec.avals[ref.leaf].shape),
            dtype=np.dtype(spec.avals[ref.leaf].dtype).name,
            sum_axes=tuple(sorted(leaf_axis(ref.chain, d) for d in site.contract_axes))
            if sums
            else None,
            # a calibrated per-tensor activation scale travels with the weight (an input, not a
            # constant: layers alike in shape then compile to the same code)
            act_site=site.name if site.static_act(self.state.config.dynamic) else None,
            act_asymmetric=a is not None and not a.symmetric,
            layers=ref.layers,
        )
        first = self.leaves.get(ref.leaf)
        if first is None:
            known = self.state.leaves.get(ref.leaf)
            stale = known is not None and known.site != site.name  # (float params: simulate)
            if stale or (isinstance(ref.value, QView) and known is None):
                raise QuantizeError(
                    f"quantize: the program's quantization sites no longer match its state: "
                    f"param {plan.path} reaches {site.name!r}, planned for "
                    f"{None if known is None else known.site!r}: a pass between the phases "
                    "changed the program (run such passes before jaxq.quantize.annotate), or the "
                    "function's layers come in another order at these argument shapes (quantize "
                    "it again for them)."
                )
            self.leaves[ref.leaf] = plan
            return plan
        if first.scheme != plan.scheme:
            return (
                f"param {plan.path} is quantized for {first.site!r} with another scheme; a Rule "
                "giving both layers one scheme quantizes it for both"
            )
        per_tensor = plan.scheme.granularity == "tensor"  # (no scale axes to agree on)
        same = (first.group_axis, first.layers) == (plan.group_axis, plan.layers) and (
            per_tensor or first.scale_axes == plan.scale_axes
        )
        why = [] if same else ["its scales run along other axes (per-tensor weights share them)"]
        if len({first.sum_axes, plan.sum_axes} - {None}) > 1:
            why.append(
                "its code sums, stored for activations with a zero point, run over other axes "
                "(symmetric activations need none)"
            )
        if why:
            return (
                f"param {plan.path} is quantized for {first.site!r}, which reads it in another "
                f"layout (as a backward pass reads W transposed): {'; '.join(why)}. One QArray "
                "serves one layout"
            )
        if not self._same_smoothing(site.name, first.site):
            return (
                f"param {plan.path} is quantized for {first.site!r}, which smooths its input "
                "channels otherwise (SmoothQuant / AWQ factors differ); one QArray holds one "
                "smoothing"
            )
        if first.sum_axes is None and plan.sum_axes is not None:
            # one layer needs the codes' sums (its activations have a zero point), the other
            # not (a tied embedding table and output projection): the QArray stores them
            first = dataclasses.replace(first, sum_axes=plan.sum_axes)
        if first.act_site is None and plan.act_site is not None:
            # (a QArray carries one layer's activation scale; any other layer's is a constant)
            first = dataclasses.replace(
                first, act_site=plan.act_site, act_asymmetric=plan.act_asymmetric
            )
        self.leaves[ref.leaf] = first
        return first

    def param_site(self, visit: Visit, site: Site, raw: list[Any]) -> Any:
        """A site whose weight is a param leaf: a float value (the program computes its scales,
        or, in calibration, only observes) or a QArray (realize: the codes are inputs)."""
        wi = site.weight_index
        ref = raw[wi]
        self.sites[site.name] = site
        new = list(raw)
        act = self.act_params(site)
        if isinstance(ref.value, QView):
            if self.mode == "realize":  # integer code on the QArray's codes
                new[wi] = None
                return self.handler(visit, site, view_qweight(ref.value, site), new, act)
            new[wi] = ref.value.dequantize()  # simulate on quantized params: the weight's value
            return self.handler(visit, site, None, new, act)
        new[wi] = ref.value
        if self.mode != "simulate":
            return self.handler(visit, site, None, new, act)
        qw = traced_qweight(ref.value, site, self.state.config.weight_calibration)
        return self.handler(visit, site, qw, new, act)


def lower(
    state: QState,
    handler: SiteHandler,
    *,
    mode: str = "simulate",
    quantized_params: bool = False,
    integer_chains: bool = False,
    grams: Mapping[str, np.ndarray] | None = None,
    source: Program | None = None,
    verify_weights: bool = False,
) -> tuple[Program, Engine]:
    """Rewrite the float program (``source``, default the state's) through the engine's rules
    (``rewrite`` re-traces it). ``integer_chains`` (realize) runs planned pass-through equations
    on int8 codes; ``grams`` (calibrate) re-quantizes those layers' weights with GPTQ. With params
    (``state.params``) the result takes QArrays at the planned leaves when ``quantized_params``
    (always in realize), float params otherwise. ``verify_weights``: a constant weight must be
    the one its layer's codes were made from (a function traced again at other shapes)."""
    source = state.source if source is None else source
    chains = plan_chains(source, state) if integer_chains else {}
    samples = sample_chains(source, state, chains)
    engine = Engine(
        state, handler, chains, grams, mode=mode, verify_weights=verify_weights, samples=samples
    )
    try:
        if state.params is None:
            out = rewrite(source, engine.rules(), scope="quantize")
        else:
            quantized = quantized_params or mode == "realize"
            in_tree, specs, paths = param_signature(source, state, quantized)
            closed = retrace(
                source,
                engine.rules(),
                specs,
                lambda flat: engine.take_inputs(source_inputs(state, in_tree, flat, quantized)),
                scope="quantize",
                coerce=engine.coerce,
                done=engine.release,
            )
            out = source.with_jaxpr(closed, in_tree=in_tree, in_paths=paths)
    except RewriteError as e:
        raise_cause(e)
        raise
    if engine.kv_on and not engine.kv_caches:
        raise QuantizeError(
            "quantize: QConfig(kv_cache=True) found no KV cache: it looks for a lax.scan that "
            "params enter (a decode loop) with a float carry the body writes with "
            "lax.dynamic_update_slice (whole vectors along the last axis) and returns. Pass the "
            "weights as params and write the cache with lax.dynamic_update_slice, or drop kv_cache."
        )
    return out, engine


def param_signature(
    source: Program, state: QState, quantized: bool
) -> tuple[Any, list[Any], tuple[str, ...]]:
    """``(in_tree, flat input specs, input paths)`` of the program with params: QArray specs at
    the planned leaves when ``quantized``, else the float program's own."""
    spec = state.params
    assert spec is not None  # only programs traced with params have a param signature
    flat = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in source.jaxpr.in_avals]
    args, kwargs = jax.tree.unflatten(source.in_tree, flat)
    leaves: list[Any] = flat[spec.start : spec.start + spec.count]
    if quantized:
        leaves = [state.leaves[i].spec() if i in state.leaves else x for i, x in enumerate(leaves)]
    args = (*args[: spec.argnum], jax.tree.unflatten(spec.tree, leaves), *args[spec.argnum + 1 :])
    with_paths, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    return in_tree, [x for _, x in with_paths], tuple(path_str(p) for p, _ in with_paths)


def source_inputs(state: QState, in_tree: Any, flat: Any, quantized: bool) -> list[Any]:
    """The float program's input values for a call with ``in_tree``: param leaves as WeightRefs
    (QArrays seen as QViews), everything else as given."""
    spec = state.params
    assert spec is not None  # only programs traced with params have params to wrap
    args, kwargs = jax.tree.unflatten(in_tree, list(flat))
    leaves = jax.tree.leaves(args[spec.argnum], is_leaf=is_qarray)
    refs = [
        WeightRef(i, QView.of(x))
        if isinstance(x, QArray)
        else WeightRef(i, x)
        if not quantized and float_leaf(x)
        else x
        for i, x in enumerate(leaves)
    ]
    before = jax.tree.leaves(args[: spec.argnum])
    after = jax.tree.leaves((args[spec.argnum + 1 :], kwargs))
    return [*before, *refs, *after]


def raise_cause(e: BaseException) -> None:
    """Re-raise a QuantizeError that a walker rule raised (the walker wraps rule errors)."""
    cause = e.__cause__
    while cause is not None:
        if isinstance(cause, QuantizeError):
            raise cause.with_traceback(None) from None
        cause = cause.__cause__


_WIDE = ("dot_general", "conv_general_dilated")
"""Layers whose simulated form computes 16-bit float operands in float32 (``preferred_element_type``)."""


def _half(v: Any) -> bool:
    dtype = getattr(v, "dtype", None) or getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and np.dtype(dtype).name in ("bfloat16", "float16")


def simulate_handler(state: QState) -> SiteHandler:
    def handle(visit: Visit, site: Site, qw: QWeight | None, invals: list[Any], act: Any) -> Any:
        wi = site.weight_index
        new = list(invals)
        scheme = site.activations
        # A 16-bit float layer computes in float32, rounded once at the end, as realize does
        # (its integer sums are exact): fake-quantized values rounded to bfloat16 are not.
        narrow = any(_half(v) for v in (*invals, *visit.eqn.outvars))
        wide = narrow and scheme is not None and site.primitive in _WIDE
        if qw is not None:  # (None: the weight is a quantized param's value already)
            w = invals[wi]  # (wide: its codes times scales not rounded to 16 bits, as realize)
            w_fq = fake_quant_weight(w.astype(np.float32) if wide else w, qw, site)
            new[wi] = w_fq.astype(jnp.float32 if wide else jnp.asarray(w).dtype)
        elif wide:
            new[wi] = jnp.asarray(invals[wi]).astype(jnp.float32)
        if scheme is not None:
            a = invals[1 - wi]
            if not jnp.issubdtype(a.dtype, jnp.inexact) or wide:  # (an integer input of a
                a = a.astype(jnp.float32)  # mixed dot: quantized as its float value, as realize)
            scale, zp = act if act is not None else act_qparams(a, scheme, site, None)
            new[1 - wi] = fake_quant_act(a, scale, zp, scheme, site)
        y = visit.bind(*new, preferred_element_type=jnp.float32) if wide else visit.bind(*new)
        out = state.act.get(site.name + ":out")
        if state.config.requantize == "fixed_point" and out is not None and scheme is not None:
            y = fake_quant_act(y, np.float32(out.scale), np.float32(out.zero_point), scheme, site)
        check = scheme is not None and state.config.nan_rows
        bad = nonfinite_rows(visit, site, invals[1 - wi]) if check else None
        y = poison_rows(y, bad)
        return y.astype(shaped_aval(visit.eqn.outvars[0]).dtype) if wide else y

    return handle


def _read_caches(invals: tuple[Any, ...]) -> tuple[Any, ...]:
    """Operands with any int8 KV cache read (dequantized): what a rule that does not write it
    sees."""
    return tuple(v.dequantize() if isinstance(v, KVCache) else v for v in invals)


def _kv_arrays(kv: KVCache) -> dict[str, Any]:
    """An int8 KV cache as the arrays a loop carries or slices."""
    return {"codes": kv.codes, "scale": kv.scale}


def _operand_scale(x: Any, axes: tuple[int, ...], scheme: Scheme) -> Any:
    """A symmetric scale of ``x`` reduced over ``axes`` (kept as size-1 dims): ``max|x| /
    qmax``, 1 where the values are all 0, non-finite where they are."""
    m = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True)
    return jnp.where(m == 0, jnp.float32(1), m * reciprocal(scheme.qrange[1]))


def _tensor_scale(x: Any, axes: tuple[int, ...], scheme: Scheme) -> Any:
    """One scale for all of ``x``, from its rows (over ``axes``) that hold no NaN or Inf, laid
    out per row like :func:`_operand_scale`'s: NaN at the rows that hold them, so that only
    those rows' outputs are NaN, as in float (a NaN in one sample spoiled the whole batch)."""
    bad = jnp.any(~jnp.isfinite(x), axis=axes, keepdims=True)
    s = _operand_scale(jnp.where(bad, jnp.zeros((), x.dtype), x), tuple(range(x.ndim)), scheme)
    return s + jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(0))


def _to_output(
    s: Any,
    contracted: Any,
    order: list[int],
    trailing: int = 0,
    inner: tuple[int, int] | None = None,
) -> Any:
    """An operand's per-row scale laid out against a dot_general's output (batch dims, then the
    left operand's free dims, then the right's): its contracted dims dropped, the others put
    in ``order``, and size-1 dims for the other operand's free dims (``trailing`` after them,
    or ``inner = (batch, count)`` between the batch dims and them)."""
    kept = [d for d in range(s.ndim) if d not in contracted]
    s = jnp.transpose(s.reshape([s.shape[d] for d in kept]), [kept.index(d) for d in order])
    shape = list(s.shape)
    if inner is not None:
        shape[inner[0] : inner[0]] = [1] * inner[1]
    return s.reshape(shape + [1] * trailing)


def _plain_index(index: Any) -> Any:
    """A cond's branch index as lax.switch takes it."""
    return jnp.asarray(index).astype(jnp.int32)


def _neutral_stats(shapes: Mapping[str, Any]) -> dict[str, Any]:
    """Statistics that pooling leaves unchanged, shaped like ``shapes``: an empty range, no
    counts, zero second moments (a loop that runs no iteration, a branch not taken)."""
    out: dict[str, Any] = {}
    for k, v in shapes.items():
        if isinstance(v, Mapping):
            fill = {"min": jnp.inf, "max": -jnp.inf}
            out[k] = {s: jnp.full(a.shape, fill.get(s, 0), a.dtype) for s, a in v.items()}
        else:
            out[k] = jnp.zeros(v.shape, v.dtype)
    return out


def _stacked_keys(table: Mapping[str, Any], length: int) -> list[str]:
    """The names that ``table`` holds for every iteration of a loop of ``length`` (``name@0``
    ... ``name@{length-1}``, and no more)."""
    counts: dict[str, int] = {}
    for k in table:
        name, sep, i = k.rpartition("@")
        if sep and i.isdigit():
            counts[name] = max(counts.get(name, 0), int(i) + 1)
    return [
        k
        for k, n in counts.items()
        if n == length and all(f"{k}@{i}" in table for i in range(length))
    ]
