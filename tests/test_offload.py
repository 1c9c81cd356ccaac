"""jaxq.offload: realized integer code handed to ONNX Runtime through jaxq's own partitioner.

The integer kernels are exact: an int8 x int8 -> int32 dot or convolution in ONNX Runtime
(MatMulInteger / ConvInteger on activations shifted into uint8) equals XLA's bit for bit. The
float ops between layers (bias, activations, the float rescale) round in each runtime's own way,
so an offloaded function matches the XLA-realized one to within a few activation steps (here:
exactly for the ReLU models, within 2% of the output range where tanh-GELU is in between).
"""

import builtins
import functools
import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax
from strategies import examples

import jaxq
from jaxq.partition._onnx import export_onnx, onnx_codegen

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)


def run_onnx(f, *args):
    """``f`` exported whole to ONNX and run in ONNX Runtime (outside jit)."""
    return [np.asarray(y) for y in onnx_codegen(jaxq.trace(f, *args))(*args)]


def codes(rng, shape, dtype=np.int8):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, size=shape).astype(dtype)


@settings(max_examples=examples(25), deadline=None)
@given(
    st.integers(1, 5),  # rows
    st.integers(1, 40),  # contracted
    st.integers(1, 9),  # columns
    st.booleans(),  # a batch axis
    st.booleans(),  # weights transposed ([out, in], x @ w.T)
    st.sampled_from([np.int8, np.uint8]),  # activation codes
    st.integers(0, 2**16),
)
@pytest.mark.xla_cpu
def test_int8_dots_equal_xla_bit_for_bit(m, k, n, batched, transposed, a_dtype, seed):
    rng = np.random.default_rng(seed)
    b = (3,) if batched else ()
    x, w = codes(rng, (*b, m, k), a_dtype), codes(rng, (*b, n, k) if transposed else (*b, k, n))
    contract = ((x.ndim - 1,), (w.ndim - 1 if transposed else w.ndim - 2,))
    batch = ((0,), (0,)) if batched else ((), ())

    def f(x, w):
        return lax.dot_general(x, w, (contract, batch), preferred_element_type=jnp.int32)

    (got,) = run_onnx(f, x, w)
    np.testing.assert_array_equal(got, np.asarray(jax.jit(f)(x, w)))


def test_int8_dots_whose_uint8_products_pass_int16_in_pairs(monkeypatch):
    """x86 without VNNI sums pairs of uint8 x int8 products in int16 with saturation
    (193 * 82 + 243 * 114 = 43528 came out 32767: 8243, not 19004): there the weights are
    shifted into uint8 too (the route pinned here, as on such a machine)."""
    from jaxq.partition import _onnx

    monkeypatch.setattr(_onnx, "_u8s8_exact", lambda: False)
    x, w = np.array([[-7, 3, 65, 115]], np.int8), np.array([[-120], [-92], [82], [114]], np.int8)
    f = lambda x, w: lax.dot_general(
        x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )
    (got,) = run_onnx(f, x, w)
    np.testing.assert_array_equal(got, [[19004]])


@settings(max_examples=examples(25), deadline=None)
@given(
    st.sampled_from([("NHWC", "HWIO", "NHWC"), ("NCHW", "OIHW", "NCHW")]),
    st.tuples(st.integers(1, 3), st.integers(1, 3)),  # kernel
    st.tuples(st.integers(1, 2), st.integers(1, 2)),  # strides
    st.tuples(st.integers(1, 2), st.integers(1, 2)),  # kernel dilation
    st.sampled_from(["SAME", "VALID", ((1, 0), (0, 2))]),
    st.sampled_from([1, 2]),  # feature groups
    st.integers(0, 2**16),
)
@pytest.mark.xla_cpu
def test_int8_convolutions_equal_xla_bit_for_bit(dn, ks, strides, dil, pad, groups, seed):
    # (padded positions: 0 in XLA; the zero point of the uint8-shifted codes in ONNX Runtime)
    rng = np.random.default_rng(seed)
    x = codes(rng, (2, 7, 6, 4))  # NHWC
    w = codes(rng, (*ks, 4 // groups, 6))  # HWIO
    x = np.transpose(x, ["NHWC".index(c) for c in dn[0]])
    w = np.transpose(w, ["HWIO".index(c) for c in dn[1]])

    def f(x, w):
        return lax.conv_general_dilated(
            x, w, strides, pad, rhs_dilation=dil, dimension_numbers=dn,
            feature_group_count=groups, preferred_element_type=jnp.int32,
        )  # fmt: skip

    (got,) = run_onnx(f, x, w)
    np.testing.assert_array_equal(got, np.asarray(jax.jit(f)(x, w)))


@pytest.mark.parametrize("bound", [64, 65])
@pytest.mark.parametrize("a_dtype", [np.int8, np.uint8])
@pytest.mark.xla_cpu
def test_seven_bit_weights_keep_the_uint8_by_int8_kernels_exactly(monkeypatch, bound, a_dtype):
    """Constant weight codes in [-64, 64] stay int8 where the kernels sum pairs in int16 (a pair
    is at most 2 * 255 * 64 = 32640): the worst case here, largest activations against weights
    at the bound, pairs of equal sign. One code beyond it is shifted into uint8 instead."""
    from jaxq.partition import _onnx

    monkeypatch.setattr(_onnx, "_u8s8_exact", lambda: False)
    top = np.iinfo(a_dtype).max
    x = np.full((3, 16), top, a_dtype)
    x[1, ::2] = np.iinfo(a_dtype).min
    w = np.tile(np.array([[bound], [-bound]], np.int8), (8, 5))
    w[:, 0] = bound
    w[:, 1] = -min(bound, 64)

    def f(x):
        return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)

    (got,) = run_onnx(f, x)
    np.testing.assert_array_equal(got, np.asarray(jax.jit(f)(x)))
    model = export_onnx(jaxq.trace(f, x))
    weights = [t for t in model.graph.initializer if tuple(t.dims) == w.shape]
    assert [t.data_type for t in weights] == [3 if bound == 64 else 2]  # INT8 / UINT8


def test_the_ops_realize_writes_export_exactly():
    x = RNG.normal(size=(4, 6, 6, 3)).astype(np.float32) * 3
    x[1, 2, 3, 0] = np.nan
    x[0, 0, 0, 0] = 2.5  # ties round to even
    x[0, 0, 0, 1] = -0.5

    def f(x):
        q = jnp.clip(jnp.round(x / 0.5) - 3, -128, 127).astype(jnp.int8)
        pooled = lax.reduce_window(q, np.int8(-128), lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        padded = lax.pad(q, np.int8(5), ((0, 0, 0), (1, 2, 0), (0, 1, 0), (0, 0, 0)))
        bad = jnp.any(~jnp.isfinite(x), axis=(1, 2, 3))
        both = jnp.concatenate([q, q], axis=3)[:, ::2, 1:5, :]
        return pooled, padded, bad, both, lax.clamp(np.int8(-3), q, np.int8(4)), jnp.round(x)

    for got, want in zip(run_onnx(f, x), jax.jit(f)(x), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))


@pytest.mark.parametrize("idiom", ["sum", "max"])
@pytest.mark.parametrize("width, check", [(40, "ReduceSum"), (1100, "MatMul")])
def test_nan_rows_come_out_nan_in_onnx_runtime_and_zero_elsewhere(idiom, width, check):
    # realize's NaN row sum(x * 0) (max|x| * 0 in older programs: ONNX Runtime's ReduceMax skips
    # NaN) is written as |sum(x * 0)|, or x @ zeros for a wide row: NaN exactly where the row
    # holds NaN or Inf, +0 elsewhere, all-negative rows too
    rows = 240 if width > 1000 else 6  # (x @ zeros for a wide row in a large tensor)
    x = -np.abs(RNG.normal(size=(rows, width))).astype(np.float32)
    x[1, 7], x[2, 3], x[3, width - 1] = np.nan, np.inf, -np.inf
    x[4, :] = np.nan
    row = {
        "sum": lambda x: jnp.sum(x * np.float32(0), axis=1, keepdims=True),
        "max": lambda x: jnp.max(jnp.abs(x), axis=1, keepdims=True) * np.float32(0),
    }[idiom]
    f = lambda x, y: y + row(x)
    y = np.full((rows, 3), -0.0, np.float32)
    (got,), ops = run_onnx_ops(f, x, y)
    assert check in ops and "ReduceMax" not in ops
    fine = np.delete(got, [1, 2, 3, 4], axis=0)
    assert np.isnan(got[1:5]).all() and not np.isnan(fine).any()
    np.testing.assert_array_equal(np.signbit(fine), False)  # (-0 + +0 is +0)
    if idiom == "sum":  # (XLA:CPU's max of a row this wide drops NaN itself)
        np.testing.assert_array_equal(got, np.asarray(jax.jit(f)(x, y)))


@pytest.mark.parametrize("approximate, kernel", [(False, "Gelu"), (True, "FastGelu")])
def test_gelu_is_one_fused_kernel_within_float_rounding(approximate, kernel):
    x = RNG.normal(size=(16, 40)).astype(np.float32) * 4
    x[0, :4] = [np.nan, np.inf, -np.inf, -30.0]
    f = lambda x: jax.nn.gelu(x, approximate=approximate) + 1.0
    (got,), ops = run_onnx_ops(f, x)
    want = np.asarray(jax.jit(f)(x))
    assert kernel in ops and not ops & {"Erf", "Tanh", "Mul"}
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


def test_softmax_is_one_kernel_within_float_rounding():
    x = RNG.normal(size=(3, 4, 40)).astype(np.float32) * 4
    x[0, 0, 3], x[0, 1, 5], x[0, 2], x[1, 0, 2] = np.nan, np.inf, -np.inf, -np.inf
    f = lambda x: jax.nn.softmax(x, axis=-1) * 2
    (got,), ops = run_onnx_ops(f, x)
    want = np.asarray(jax.jit(f)(x))
    assert "Softmax" in ops and not ops & {"Exp", "ReduceMax", "Div"}
    assert np.isnan(want[0, :3]).all() and not np.isnan(want[0, 3:]).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def layer_norm(x, scale, bias, eps=1e-12):  # (as BERT-style JAX code writes it)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * scale + bias


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_is_one_kernel_within_float_rounding(affine):
    scale, bias = RNG.normal(size=(2, 48)).astype(np.float32)
    x = (RNG.normal(size=(3, 5, 48)) * 3 + 100).astype(np.float32)  # (a mean far from 0)
    x[0, 0, 3], x[0, 1, 4], x[0, 2, 5], x[1, 0] = np.nan, np.inf, -np.inf, 7.0  # (7: var 0)
    f = lambda x: layer_norm(x, scale, bias) if affine else layer_norm(x, 1.0, 0.0)
    (got,), ops = run_onnx_ops(f, x)
    want = np.asarray(jax.jit(f)(x))
    assert "LayerNormalization" in ops and not ops & {"Sqrt", "Reciprocal"}
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("rows", [15, 40])
def test_a_layer_norm_times_constant_columns_is_a_second_layer_norm(rows):
    """SmoothQuant's factors multiply a layer norm's output that a residual sum also reads: in
    a tensor of few rows (a sentence), the product is one more ``LayerNormalization`` of the same
    centered input, with the factors in its scale and bias, instead of a ``Mul`` pass (in larger
    ones the multiply is the cheaper pass)."""
    scale, bias, c = RNG.normal(size=(3, 48)).astype(np.float32)
    x = (RNG.normal(size=(rows // 5, 5, 48)) * 3 + 100).astype(np.float32)
    x[0, 0, 3], x[1, 0] = np.nan, 7.0

    def f(x):
        h = layer_norm(x, scale, bias)
        return h + x, h * c

    run = onnx_codegen(jaxq.trace(f, x))
    got = [np.asarray(y) for y in run(x)]
    ops = [n.op_type for n in run.model.graph.node]
    folded = rows <= 32
    assert ops.count("LayerNormalization") == 1 + folded and ("Mul" in ops) != folded, ops
    for g, w in zip(got, jax.jit(f)(x), strict=True):
        w = np.asarray(w)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


def test_a_jitted_block_called_twice_is_exported_from_what_holds_at_each_call():
    """A jitted function called twice inlines the same body twice: its layer norm matched at the
    first call (constant scale) and not at the second (the scale an input), whose product with
    constant columns must not be built from the first call's layer norm."""
    cols, const_scale = np.arange(1, 9, dtype=np.float32), np.full(8, 2.0, np.float32)

    @jax.jit
    def block(x, s):
        d = x - x.mean(-1, keepdims=True)
        y = d * lax.rsqrt((d * d).mean(-1, keepdims=True) + 1e-5) * s
        return y * cols, y + x

    def f(x, s):
        a = block(x, const_scale)
        return block(a[1] * a[1], s)[0]

    x = RNG.normal(size=(4, 8)).astype(np.float32)
    s = np.full(8, 0.5, np.float32)
    run = onnx_codegen(jaxq.trace(f, x, s))
    (got,) = run(x, s)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(f)(x, s)), rtol=1e-5, atol=1e-5)


@pytest.mark.xla_cpu
def test_constant_columns_folded_past_float32_stay_a_multiply():
    """Scale and bias times the columns overflow float32 where XLA's ``(y * s + b) * c`` does
    not everywhere: the multiply stays."""
    n = 8
    scale, bias, c = (np.full(n, v, np.float32) for v in (1e30, -1e30, 1e9))

    def f(x):
        return layer_norm(x, scale, bias, 1e-5) * c, layer_norm(x, scale, bias, 1e-5) + x

    x = np.array([[1, -1] * 4], np.float32)
    run = onnx_codegen(jaxq.trace(f, x))
    got, want = np.asarray(run(x)[0]), np.asarray(jax.jit(f)(x)[0])
    assert "Mul" in {n.op_type for n in run.model.graph.node}
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("affine", [True, False])
def test_flax_layer_norm_is_one_kernel_within_float_rounding(affine):
    # (Flax computes the variance as max(E[x^2] - mean^2, 0) and multiplies its scale into the
    # rsqrt first; ONNX Runtime's centered variance is the exact one where Flax's cancels)
    nn = pytest.importorskip("flax.linen")
    ln = nn.LayerNorm(use_scale=affine, use_bias=affine)
    x = (RNG.normal(size=(3, 5, 48)) * 3 + 100).astype(np.float32)  # (a mean far from 0)
    params = jax.tree.map(
        lambda p: p + RNG.normal(size=p.shape).astype(np.float32), ln.init(jax.random.PRNGKey(0), x)
    )
    x[0, 0, 3], x[0, 1, 4], x[0, 2, 5], x[1, 0] = np.nan, np.inf, -np.inf, 7.0  # (7: var 0)
    f = lambda x: ln.apply(params, x)
    (got,), ops = run_onnx_ops(f, x)
    assert "LayerNormalization" in ops and not ops & {"Sqrt", "Reciprocal", "Max"}
    want = np.asarray(jax.jit(f)(x))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    x64 = x.astype(np.float64)  # (the exact layer norm, NaN rows aside)
    with np.errstate(invalid="ignore"):  # (Inf - Inf in the rows that are NaN anyway)
        d = x64 - x64.mean(-1, keepdims=True)
        exact = d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-6)
    if affine:
        exact = exact * params["params"]["scale"] + params["params"]["bias"]
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], exact[finite], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(want[finite], exact[finite], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("scales", ["head", "column", "one"])
@pytest.mark.parametrize("bias", [False, True])
def test_multi_head_projections_fuse_like_dense_layers(scales, bias):
    # (Flax's DenseGeneral / MultiHeadDotProductAttention: [d, heads, head_dim] weights, scales
    # per head or per column, a [heads, head_dim] bias)
    rng = np.random.default_rng(1)
    x, w = codes(rng, (2, 3, 16), np.int8), codes(rng, (16, 4, 8))
    term = (5 * w.astype(np.int32).sum(0, keepdims=True))[None]  # (activation zero point 5)
    shape = {"head": (1, 1, 4, 1), "column": (1, 1, 4, 8), "one": ()}[scales]
    s = rng.uniform(1e-3, 1e-2, size=shape).astype(np.float32)
    b = rng.normal(size=(4, 8)).astype(np.float32)
    xf = rng.normal(size=(2, 3, 1, 1)).astype(np.float32)
    xf[1, 2] = np.nan  # (a NaN row still reaches its outputs)

    def f(x, xf):
        acc = lax.dot_general(x, w, (((2,), (0,)), ((), ())), preferred_element_type=jnp.int32)
        y = (acc - term).astype(jnp.float32) * s + xf * np.float32(0)
        return y + b if bias else y

    (got,), ops = run_onnx_ops(f, x, xf)
    assert "MatMulIntegerToFloat" in ops and "MatMulInteger" not in ops
    want = np.asarray(jax.jit(f)(x, xf))
    if bias:  # (XLA:CPU contracts y * s + b into one FMA; ONNX Runtime rounds twice)
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("per_column", [True, False])
def test_weights_on_the_left_fuse_like_dense_layers(per_column):
    # (Equinox's Linear computes w @ x per example: under vmap, dot_general(w, x) is [out, rows],
    # rescaled per row of it, then transposed)
    rng = np.random.default_rng(2)
    w, x = codes(rng, (6, 16)), codes(rng, (5, 16), np.uint8)
    term = (3 * w.astype(np.int32).sum(1, keepdims=True)).astype(np.int32)  # ([out, 1])
    s = rng.uniform(1e-3, 1e-2, size=(6, 1) if per_column else ()).astype(np.float32)
    b = rng.normal(size=6).astype(np.float32)
    xf = rng.normal(size=(1, 5)).astype(np.float32)
    xf[0, 3] = np.nan  # (a NaN row of the input: a NaN column of w @ x)

    def f(x, xf):
        acc = lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
        y = (acc - term).astype(jnp.float32) * s + xf * np.float32(0)
        return y.T + b

    (got,), ops = run_onnx_ops(f, x, xf)
    assert "MatMulIntegerToFloat" in ops and "MatMulInteger" not in ops
    np.testing.assert_array_equal(got, np.asarray(jax.jit(f)(x, xf)))


def test_an_equinox_style_layer_norm_before_a_dense_layer_is_one_kernel():
    # (Equinox's LayerNorm: a mean, jnp.var (its own mean again, and a where on n - ddof), the
    # variance floored at 0, then weight * out + bias; its Linear: w @ x under vmap)
    def f(params, x):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.maximum(0.0, jnp.var(x, -1, keepdims=True))
        h = params["weight"] * ((x - mean) * lax.rsqrt(var + 1e-5)) + params["bias"]
        return jax.vmap(lambda r: params["w"] @ r)(h)

    params = {
        "weight": RNG.normal(size=16).astype(np.float32),
        "bias": RNG.normal(size=16).astype(np.float32),
        "w": RNG.normal(size=(8, 16)).astype(np.float32),
    }
    x = RNG.normal(size=(6, 16)).astype(np.float32)
    qf = jaxq.quantize(f, params, calibration=[(x,)], progress=False)
    fast = jaxq.offload(qf)
    got = np.asarray(fast(x))
    (region,) = fast.regions(x)
    ops = {n.op_type for n in export_onnx(region.program()).graph.node}
    assert {"LayerNormalization", "MatMulIntegerToFloat"} <= ops
    assert not {"Where", "Sqrt", "Max", "MatMulInteger"} & ops
    want = np.asarray(qf(x))
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def test_a_flax_scanned_transformer_offloads_into_onnx_runtimes_fused_kernels():
    # (a model written with Flax's own layers, as users write them: its projections, layer norms
    # and GELU meet ONNX Runtime's fused kernels, and its stacked weights are initializers)
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)(h, h)
            return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))), None

    stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
    model = stack()
    x = RNG.normal(size=(3, 4, 16)).astype(np.float32)
    params = model.init(jax.random.PRNGKey(0), x, None)
    apply = lambda p, x: model.apply(p, x, None)[0]
    qf = jaxq.quantize(apply, params, calibration=[(x,)], progress=False)
    fast = jaxq.offload(qf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing stays with XLA)
        got = np.asarray(jax.jit(fast)(x))
    (region,) = fast.regions(x)
    ops = [n.op_type for n in export_onnx(region.program()).graph.node]
    assert ops.count("MatMulIntegerToFloat") == 12 and ops.count("LayerNormalization") == 4
    assert not {"MatMulInteger", "Slice", "Sqrt"} & set(ops)
    want = np.asarray(qf(x))
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def run_onnx_ops(f, *args):
    """Like run_onnx, and the op types of the exported model (one export, one session)."""
    run = onnx_codegen(jaxq.trace(f, *args))
    return [np.asarray(y) for y in run(*args)], {n.op_type for n in run.model.graph.node}


@settings(max_examples=examples(25), deadline=None)
@given(
    st.sampled_from([1.0, 1.37, 0.61]),  # scale: mantissa
    st.integers(-8, 3),  # scale: exponent
    st.integers(-20, 20),  # zero point
    st.sampled_from([np.int8, np.uint8]),
    st.sampled_from(["clamp", "min_max", "max_min", "clip"]),
    st.booleans(),  # through int32 (realize's route for some backends)
    st.integers(0, 2**16),
)
def test_realize_quantize_is_one_quantize_linear_with_the_same_codes(
    mantissa, exponent, zp, dtype, clamp, wide, seed
):
    rng = np.random.default_rng(seed)
    scale = np.float32(mantissa * 2.0**exponent)
    info = np.iinfo(dtype)
    zp = int(np.clip(zp + (128 if dtype == np.uint8 else 0), info.min, info.max))
    x = (rng.normal(size=(5, 7)) * 100 * scale).astype(np.float32)
    x[0, 3] = scale * np.float32(1e9)  # (saturates)
    x[0, :3] = scale * np.array([0.5, 1.5, -2.5], np.float32)  # (ties, or near them)
    x[1, :2] = [np.inf, -np.inf]

    def f(x, s):  # (as realize writes it; the scale an argument, as a QArray's is)
        r = lax.round(x * (1 / s), lax.RoundingMethod.TO_NEAREST_EVEN) + np.float32(zp)
        lo, hi = np.float32(info.min), np.float32(info.max)
        r = {"clamp": lambda: lax.clamp(lo, r, hi), "min_max": lambda: lax.min(lax.max(r, lo), hi),
             "max_min": lambda: lax.max(lax.min(r, hi), lo),
             "clip": lambda: jnp.clip(r, int(lo), int(hi))}[clamp]()  # fmt: skip
        return (r.astype(jnp.int32) if wide else r).astype(dtype)

    s = scale
    (got,), ops = run_onnx_ops(f, x, s)
    np.testing.assert_array_equal(got, np.asarray(jax.jit(f)(x, s)))
    assert "QuantizeLinear" in ops and "Round" not in ops


@pytest.mark.xla_cpu
def test_a_quantize_by_a_constant_scale_rounds_near_ties_as_xla():
    """Realize quantizes ``x * (1 / s)``; QuantizeLinear divides. At near-ties the two round
    apart (x / s = 85.49999 is 85, x * (1 / s) 86), so the exporter multiplies by the same
    reciprocal, a constant or computed from a scale given at run time."""
    s = np.float32(0.0123)
    k = np.arange(-128, 127, dtype=np.float32)
    near = np.float32((k + 0.5) * s)[:, None]
    steps = np.array([-2, -1, 0, 1, 2])  # (ulps around each half-way point)
    x = near + steps * np.spacing(near)
    x = x.astype(np.float32).reshape(1, -1)
    assert (np.round(x / s) != np.round(x * (np.float32(1) / s))).any()  # (ties that differ)

    def f(x, scale):
        r = lax.round(x * (1 / scale), lax.RoundingMethod.TO_NEAREST_EVEN) + np.float32(3)
        return lax.clamp(np.float32(-128), r, np.float32(127)).astype(jnp.int8)

    for fn, args in ((lambda x: f(x, s), (x,)), (f, (x, s))):  # (1 / s constant; computed)
        (got,), ops = run_onnx_ops(fn, *args)
        np.testing.assert_array_equal(got, np.asarray(jax.jit(fn)(*args)))
        assert "QuantizeLinear" in ops and "Round" not in ops

    def g(x, scale, row):  # (a division by a broadcast value, computed at run time or not;
        x = x.reshape(-1, 5)  # by a value only reshaped, x[:1] / row, XLA divides)
        return x / scale, x / row, x[:1] / row, x / s, x / (x + 1)

    row = np.full(5, s, np.float32)
    got = run_onnx(g, x, s, row)
    for a, b in zip(got, jax.jit(g)(x, s, row), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


@settings(max_examples=examples(25), deadline=None)
@given(
    st.integers(1, 6),  # rows
    st.integers(1, 40),  # contracted
    st.integers(1, 9),  # columns
    st.sampled_from([np.int8, np.uint8]),  # activation codes
    st.integers(-40, 40),  # activation zero point c (the term subtracted: c * column sums)
    st.booleans(),  # scales per column (else one)
    st.sampled_from(["none", "nan_row", "nan_row_bias", "bias"]),
    st.booleans(),  # a zero-point term that is not c * column sums: not fused
    st.booleans(),  # a leading axis ([2, rows, k] x [k, n], as a dense layer on tokens)
    st.integers(0, 2**16),
)
@pytest.mark.xla_cpu
def test_rescaled_int8_dots_fuse_into_one_kernel_with_the_same_floats(
    m, k, n, a_dtype, c, per_column, tail, wrong, lead, seed
):
    rng = np.random.default_rng(seed)
    rows = (2, m) if lead else (m,)
    x, w = codes(rng, (*rows, k), a_dtype), codes(rng, (k, n))
    x.reshape(-1, k)[0, 0] = np.iinfo(a_dtype).max  # (extremes)
    cols = w.astype(np.int32).sum(0, keepdims=True)
    term = (c * cols + (1 if wrong else 0)).astype(np.int32)
    scales = rng.uniform(1e-4, 1e-1, size=(1, n) if per_column else ()).astype(np.float32)
    bias = rng.normal(size=n).astype(np.float32)
    xf = rng.normal(size=(*rows, 3)).astype(np.float32)
    xf[..., -1, 0] = np.nan  # (a NaN row: the poison must still reach its output row)

    def f(x, xf):
        dn = (((x.ndim - 1,), (0,)), ((), ()))
        acc = lax.dot_general(x, w, dn, preferred_element_type=jnp.int32)
        y = (acc - term).astype(jnp.float32) * scales
        if tail.startswith("nan_row"):
            y = y + jnp.max(jnp.abs(xf), axis=-1, keepdims=True) * np.float32(0)
        return y + bias if tail.endswith("bias") else y

    (got,), ops = run_onnx_ops(f, x, xf)
    want = np.asarray(jax.jit(f)(x, xf))
    if tail == "bias":  # XLA:CPU contracts y * s + b into one FMA; ONNX Runtime rounds twice
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    else:  # as realize writes it (the NaN row between): the same floats
        np.testing.assert_array_equal(got, want)
    zp_fits = 0 <= c + (128 if a_dtype == np.int8 else 0) <= 255
    fused = "MatMulIntegerToFloat" in ops
    assert fused == (zp_fits and not (wrong and cols.any()))


@pytest.mark.xla_cpu
@settings(max_examples=examples(20), deadline=None)
@given(
    st.integers(1, 5),  # input channels
    st.integers(1, 6),  # output channels
    st.integers(1, 3),  # kernel
    st.integers(1, 2),  # stride
    st.sampled_from(["SAME", "VALID"]),
    st.integers(-30, 30),  # activation zero point c
    st.integers(-30, 30),  # the next layer's zero point
    st.sampled_from(["pad", "border"]),  # padding with c first (params), or a border term
    st.booleans(),  # a NaN row (realize's, as when the float input held NaN)
    st.booleans(),  # an inference BatchNorm after the layer, (z - mean) * k + beta
    st.integers(0, 2**16),
)
def test_requantizing_convolutions_are_one_qlinearconv_within_one_step(
    c_in, c_out, k, stride, padding, c, zp, form, nan_row, batch_norm, seed
):
    rng = np.random.default_rng(seed)
    x, w = codes(rng, (3, 6, 5, c_in)), codes(rng, (k, k, c_in, c_out))
    x[0, 0, 0, 0] = -128  # (extremes: the uint8 shift must not wrap)
    xf = rng.normal(size=(3, 1, 1, 4)).astype(np.float32)
    xf[1, 0, 0, 1] = np.nan if nan_row else 0.0
    y = rng.uniform(1e-4, 1e-2, size=(1, 1, 1, c_out)).astype(np.float32)
    gain = rng.uniform(0.5, 2.0, size=c_out).astype(np.float32) if batch_norm else np.ones(1)
    s = np.float32((y * gain).max() * rng.uniform(1.0, 30.0))  # (y * gain / s <= 1)
    b = rng.normal(size=c_out).astype(np.float32) * 8 * s
    mean, beta = (rng.normal(size=(2, c_out)) * 4 * s).astype(np.float32)
    dn = ("NHWC", "HWIO", "NHWC")
    conv = functools.partial(
        lax.conv_general_dilated, window_strides=(stride, stride), dimension_numbers=dn,
        preferred_element_type=jnp.int32,
    )  # fmt: skip
    pads = lax.padtype_to_pads(x.shape[1:3], (k, k), (stride, stride), padding)
    if form == "pad":  # as realize writes a params-style layer: padded with c, one term
        term = c * w.astype(np.int32).sum((0, 1, 2)).reshape(1, 1, 1, -1)
    else:  # a closure-style one: c times the weights over each window's real positions
        term = c * np.asarray(conv(np.ones((1, *x.shape[1:]), np.int32), w.astype(np.int32),
                                   padding=pads))  # fmt: skip

    def f(x, xf):
        if form == "pad":
            cfg = [(0, 0, 0), *((lo, hi, 0) for lo, hi in pads), (0, 0, 0)]
            acc = conv(lax.pad(x, np.int8(c), cfg), w, padding="VALID")
        else:
            acc = conv(x, w, padding=pads)
        z = (acc - term).astype(jnp.float32) * y
        z = z + jnp.max(jnp.abs(xf), axis=(1, 2, 3), keepdims=True) * np.float32(0)
        z = z + b
        if batch_norm:  # (folded into QLinearConv's scales and bias)
            z = (z - mean) * gain + beta
        q = lax.round(z * (1 / s), lax.RoundingMethod.TO_NEAREST_EVEN) + np.float32(zp)
        q = jnp.clip(q, -128, 127).astype(jnp.int8)
        bad = jnp.any(~jnp.isfinite(z), axis=(1, 2, 3))
        return jnp.maximum(q, np.int8(zp)), bad  # (ReLU on the codes, and the NaN rows)

    want = [np.asarray(v) for v in jax.jit(f)(x, xf)]
    (got, bad), ops = run_onnx_ops(f, x, xf)
    assert "QLinearConv" in ops and "ConvInteger" not in ops and "MatMulInteger" not in ops
    np.testing.assert_array_equal(bad, want[1])
    fine = ~want[1]  # (a NaN row's codes are overridden downstream)
    assert np.abs(got[fine].astype(np.int32) - want[0][fine]).max(initial=0) <= 1
    exact = onnx_codegen(jaxq.trace(f, x, xf), exact=True)
    assert "QLinearConv" not in {n.op_type for n in exact.model.graph.node}
    got, bad = (np.asarray(v) for v in exact(x, xf))
    np.testing.assert_array_equal(bad, want[1])
    np.testing.assert_array_equal(got[fine], want[0][fine])


# ---- offloading quantized functions ---------------------------------------------------------------


def mlp(params, x, act=jax.nn.relu):
    for i, (w, b) in enumerate(params):
        with jax.named_scope(f"Dense_{i}"):
            x = x @ w + b
            x = act(x) if i < len(params) - 1 else x
    return x


def cnn(params, x):
    for i in range(2):
        with jax.named_scope(f"Conv_{i}"):
            y = lax.conv_general_dilated(x, params[f"c{i}"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
            x = jax.nn.relu(y)
    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    with jax.named_scope("Dense"):
        return x.reshape(x.shape[0], -1) @ params["d"]


def mlp_params(rng, sizes=(24, 48, 10)):
    return [
        ((rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), np.zeros(b, np.float32) + 0.1)
        for a, b in zip(sizes, sizes[1:], strict=False)
    ]


@functools.cache
def quantized_mlp(act_name="relu"):
    act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu}[act_name]
    params = mlp_params(RNG)
    f = functools.partial(mlp, act=act)
    batches = [(RNG.normal(size=(16, 24)).astype(np.float32),) for _ in range(3)]
    return f, params, jaxq.quantize(f, params, calibration=batches, progress=False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_float_inputs_stay_with_xla_where_the_exporter_cannot_take_them(dtype):
    """The exporter writes float32 constants: 16-bit float equations stay with XLA, warned,
    and the rest runs offloaded (ONNX Runtime refused the mixed model: "bound to different
    types (tensor(float) and tensor(bfloat16))")."""
    f, params, qf = quantized_mlp()
    x = RNG.normal(size=(4, 24)).astype(dtype)
    fast = jaxq.offload(qf)
    with pytest.warns(jaxq.OffloadWarning, match="stay with XLA"):
        got = np.asarray(fast(x), np.float32)
    np.testing.assert_allclose(got, np.asarray(qf(x), np.float32), rtol=2e-2, atol=2e-2)


def test_the_gradient_of_an_offloaded_function_says_integer_code_has_none():
    f, params, qf = quantized_mlp()
    fast, x = jaxq.offload(qf), RNG.normal(size=(3, 24)).astype(np.float32)
    with pytest.raises(jaxq.quantize.QuantizeError, match="integer code has no derivative"):
        jax.grad(lambda x: jnp.sum(fast(x)))(x)  # (JAX's error about the FFI call, before)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(fast))(x[:, None])[:, 0]), qf(x))


def test_an_offloaded_function_keeps_the_params_it_was_made_with():
    """The weights are the backend's constants: every input shape runs the params ``qf`` had
    when offload was called (a shape built after ``qf.params`` changed ran the new ones)."""
    f, params, _ = quantized_mlp()
    cal = [(RNG.normal(size=(8, 24)).astype(np.float32),)]
    qf = jaxq.quantize(f, params, calibration=cal, progress=False)
    fast, x = jaxq.offload(qf), RNG.normal(size=(6, 24)).astype(np.float32)
    before = np.asarray(qf(x))
    qf.params = qf.quantize_params(jax.tree.map(lambda a: a * 2, params))
    np.testing.assert_array_equal(np.asarray(fast(x)), before)
    np.testing.assert_array_equal(np.asarray(fast(x[:3])), before[:3])
    np.testing.assert_array_equal(np.asarray(jaxq.offload(qf)(x)), np.asarray(qf(x)))


def test_a_realized_mlp_runs_in_one_onnx_region_as_xla_computes_it():
    f, params, qf = quantized_mlp()
    fast = jaxq.offload(qf)
    x = RNG.normal(size=(9, 24)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every equation runs in ONNX Runtime: no OffloadWarning
        (region,) = fast.regions(x)
    assert region.compiler == "onnxruntime" and "dot_general" in region.primitives
    np.testing.assert_array_equal(np.asarray(fast(x)), np.asarray(qf(x)))
    np.testing.assert_array_equal(np.asarray(jax.jit(fast)(x)), np.asarray(qf(x)))
    v = jax.vmap(fast)(x[:, None])  # the callback's vmap rule: one call per example
    np.testing.assert_array_equal(np.asarray(v)[:, 0], np.asarray(qf(x)))
    # the weights are bound into the ONNX model as 8-bit initializers (prepacked once): int8,
    # or shifted into uint8 where the uint8 x int8 kernels saturate (x86 without VNNI)
    run = onnx_codegen(region.program())
    int8_inits = {tuple(t.dims) for t in run.model.graph.initializer if t.data_type in (2, 3)}
    assert {(24, 48), (48, 10)} <= int8_inits
    assert [i.name for i in run.session.get_inputs()] == ["in0"]  # the activations only
    ops = {n.op_type for n in run.model.graph.node}
    # quantize -> one QuantizeLinear; int8 dot, zero-point term, rescale and bias -> one
    # MatMulIntegerToFloat (ONNX Runtime's fused kernel); no float matmul left
    assert {"QuantizeLinear", "MatMulIntegerToFloat"} <= ops
    assert not ops & {"MatMul", "MatMulInteger", "Round", "Div"}
    # standard ONNX only (for other runtimes): MatMulInteger and the rescale as ops, same result
    std = export_onnx(region.program(), onnxruntime_ops=False)
    assert {n.domain for n in std.graph.node} == {""}
    assert {"QuantizeLinear", "MatMulInteger"} <= {n.op_type for n in std.graph.node}
    sess = ort.InferenceSession(std.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"in0": x})
    np.testing.assert_array_equal(y, np.asarray(qf(x)))


def test_an_onnx_runtime_without_the_fused_kernel_gets_standard_ops(monkeypatch):
    # (older releases took one scale per MatMulIntegerToFloat: probed once per process)
    from jaxq.partition import _onnx

    assert _onnx._fused_kernels_run()  # the installed one runs them, as the exporter writes them
    f, params, qf = quantized_mlp()
    x = RNG.normal(size=(5, 24)).astype(np.float32)
    (region,) = jaxq.offload(qf).regions(x)
    monkeypatch.setattr(_onnx, "_fused_kernels_run", lambda: False)
    run = onnx_codegen(region.program())
    assert "MatMulIntegerToFloat" not in {n.op_type for n in run.model.graph.node}
    np.testing.assert_array_equal(np.asarray(run(x)[0]), np.asarray(qf(x)))


@settings(max_examples=examples(6), deadline=None)
@given(
    st.booleans(),  # asymmetric activations (zero-point terms)
    st.booleans(),  # asymmetric weights
    st.sampled_from(["tensor", "channel"]),
    st.integers(1, 6),  # batch
    st.integers(0, 2**16),
)
def test_offloaded_relu_mlps_equal_xla_realize(asym, wasym, granularity, batch, seed):
    # ReLU between layers: the only float ops are the rescale and the bias, rounded alike
    rng = np.random.default_rng(seed)
    params = mlp_params(rng, (8, 12, 3))
    cfg = jaxq.QConfig(
        weights=jaxq.Scheme(granularity=granularity, symmetric=not wasym),
        activations=jaxq.Scheme(symmetric=not asym),
    )
    calib = [(rng.normal(size=(8, 8)).astype(np.float32),)]
    qf = jaxq.quantize(mlp, params, calibration=calib, config=cfg, progress=False)
    x = rng.normal(size=(batch + 3, 8)).astype(np.float32) * 1.5  # (some clip)
    x[[-3, -2, -1], rng.integers(0, 8, 3)] = [np.nan, np.inf, -np.inf]  # rows that come out NaN
    got, want = np.asarray(jaxq.offload(qf)(x)), np.asarray(qf(x))
    assert np.isnan(want[-3:]).all() and not np.isnan(want[:-3]).any()
    np.testing.assert_array_equal(got, want)


def test_float_ops_between_layers_round_differently_within_the_stated_bound():
    f, params, qf = quantized_mlp("gelu")
    x = RNG.normal(size=(32, 24)).astype(np.float32)
    got, want = np.asarray(jaxq.offload(qf)(x)), np.asarray(qf(x))
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()


def test_a_dense_layer_per_position_after_a_convolution_reads_its_nan_rows_per_sample():
    # (a time-series conv, then a dense layer on each step: ONNX Runtime failed to reshape the
    # conv's per-sample NaN row [4, 1] to the dense layer's per-step rows [4, 6])
    def f(p, x):
        y = lax.conv_general_dilated(
            x, p["k"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
        )
        return jax.nn.relu(y) @ p["w"]

    params = {"k": RNG.normal(size=(3, 2, 4)).astype(np.float32),
              "w": RNG.normal(size=(4, 3)).astype(np.float32)}  # fmt: skip
    xs = [RNG.normal(size=(4, 6, 2)).astype(np.float32) for _ in range(2)]
    qf = jaxq.quantize(f, params, calibration=[(x,) for x in xs], progress=False)
    x = xs[0].copy()
    x[1, 2, 0] = np.nan  # (sample 1 is NaN throughout, as realize computes it)
    want = np.asarray(qf(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(jaxq.offload(qf))(x)), want)
    assert np.isnan(want[1]).all() and not np.isnan(want[[0, 2, 3]]).any()


@pytest.mark.xla_cpu
def test_a_realized_cnn_offloads_with_its_convolutions_and_pooling():
    rng = np.random.default_rng(1)
    params = {
        "c0": (rng.normal(size=(3, 3, 2, 20)) * 0.3).astype(np.float32),
        "c1": (rng.normal(size=(3, 3, 20, 24)) * 0.1).astype(np.float32),
        "d": (rng.normal(size=(4 * 4 * 24, 5)) * 0.05).astype(np.float32),
    }
    x = rng.normal(size=(3, 8, 8, 2)).astype(np.float32)
    qf = jaxq.quantize(cnn, params, calibration=[(x,)], progress=False)
    fast, exact = jaxq.offload(qf), jaxq.offload(qf, exact=True)
    (region,) = fast.regions(x)
    assert {"conv_general_dilated", "reduce_window_max", "dot_general"} <= set(region.primitives)
    want = np.asarray(qf(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(exact)(x)), want)
    # (QLinearConv's requantize: a code one step from realize's moves the output a little)
    got = np.asarray(jax.jit(fast)(x))
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    x[1, 2, 3, 0] = np.nan  # (a NaN row still comes out NaN, through the fused layers)
    assert np.array_equal(np.isnan(np.asarray(fast(x))), np.isnan(np.asarray(qf(x))))
    # the later layers' NaN checks are the first one's NaN row, reshaped: one reduction in all
    ops = [n.op_type for n in export_onnx(region.program()).graph.node]
    assert ops.count("ReduceSum") == 1 and not {"IsNaN", "Where", "ReduceMax"} & set(ops)


@pytest.mark.parametrize(
    "window, strides, padding",
    [((2, 2), (2, 2), "VALID"), ((3, 3), (1, 1), "SAME"), ((3, 2), (2, 1), ((1, 1), (0, 1)))],
)
def test_sum_pooling_exports_within_float_rounding_of_the_sum(window, strides, padding):
    x = RNG.normal(size=(2, 7, 6, 3)).astype(np.float32)
    dims, steps = (1, *window, 1), (1, *strides, 1)
    pads = padding if isinstance(padding, str) else ((0, 0), *padding, (0, 0))
    pool = lambda x: lax.reduce_window(x, 0.0, lax.add, dims, steps, pads)
    (got,), want = run_onnx(pool, x), np.asarray(pool(x))
    # (each runtime sums the k terms of a window in its own order; ONNX Runtime's mean is then
    # multiplied by k: a few roundings of the terms' magnitude, not of the possibly small sum)
    k, eps = np.prod(window), np.finfo(np.float32).eps
    assert np.all(np.abs(got - want) <= 2 * k * eps * np.asarray(pool(np.abs(x))))


@pytest.mark.parametrize(
    "dims, steps, padding, shape",
    [
        ((1, 1, 2, 2, 1), (1, 1, 2, 2, 1), "VALID", (2, 3, 6, 6, 1)),  # (Equinox's, vmapped)
        ((1, 3, 3), (1, 2, 2), ((0, 0), (1, 1), (1, 1)), (4, 7, 7)),  # (one sample, CHW)
    ],
    ids=["three_unpooled_axes", "one_unpooled_axis"],
)
def test_max_pooling_with_other_than_two_unpooled_axes_exports(dims, steps, padding, shape):
    """(Equinox's MaxPool2d under vmap pools a 5-D array: it stayed with XLA and split the
    offloaded model in two regions.) The unpooled axes, merged, are ONNX's N and C."""
    x = RNG.normal(size=shape).astype(np.float32)
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, dims, steps, padding)
    (got,) = run_onnx(pool, x)
    np.testing.assert_array_equal(got, np.asarray(pool(x)))


def test_a_realized_cnn_with_average_pooling_offloads_as_one_region():
    def net(p, x):
        dn = ("NHWC", "HWIO", "NHWC")
        y = jax.nn.relu(lax.conv_general_dilated(x, p["c"], (1, 1), "SAME", dimension_numbers=dn))
        y = lax.reduce_window(y, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
        return y.reshape(y.shape[0], -1) @ p["d"]

    rng = np.random.default_rng(2)
    params = {
        "c": (rng.normal(size=(3, 3, 4, 8)) * 0.3).astype(np.float32),
        "d": (rng.normal(size=(4 * 4 * 8, 5)) * 0.1).astype(np.float32),
    }
    x = rng.normal(size=(3, 8, 8, 4)).astype(np.float32)
    qf = jaxq.quantize(net, params, calibration=[(x,)], progress=False)
    exact = jaxq.offload(qf, exact=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing stays with XLA)
        (region,) = exact.regions(x)
    assert "reduce_window_sum" in region.primitives
    np.testing.assert_array_equal(np.asarray(jax.jit(exact)(x)), np.asarray(qf(x)))


def test_nan_rows_known_from_an_earlier_layer_are_not_checked_again():
    # LN -> dense -> GELU -> dense -> + residual -> LN -> dense: the second dense's input holds NaN
    # or Inf exactly in the rows realize's NaN row made NaN after the first (its sums are
    # bounded); a layer norm's output is bounded where finite (summed without x * 0, once); the
    # residual sum and the second layer norm have the rows of what they read
    rng = np.random.default_rng(3)
    w0, w1, w2 = (rng.normal(size=(3, 24, 24)) / 5).astype(np.float32)
    (s0, b0), (s1, b1) = rng.normal(size=(2, 2, 24)).astype(np.float32)

    def block(params, x):
        w0, w1, w2 = params
        h = layer_norm(x, s0, b0)
        with jax.named_scope("Dense_0"):
            y = jax.nn.gelu(h @ w0 + 0.1, approximate=False)
        with jax.named_scope("Dense_1"):
            h = layer_norm(h + y @ w1, s1, b1)
        with jax.named_scope("Dense_2"):
            return h @ w2

    x = rng.normal(size=(12, 24)).astype(np.float32)
    qf = jaxq.quantize(block, (w0, w1, w2), calibration=[(x,)], progress=False)
    fast = jaxq.offload(qf)
    x[1, 2], x[3, 4], x[5, 5], x[7] = np.nan, np.inf, -np.inf, 3e38
    got, want = np.asarray(jax.jit(fast)(x)), np.asarray(qf(x))
    assert np.isnan(want[[1, 3, 5]]).all() and not np.isnan(want[8:]).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fine = ~np.isnan(want)
    assert np.abs(got[fine] - want[fine]).max() <= 0.05 * np.abs(want[fine]).max()
    (region,) = fast.regions(x)
    model = export_onnx(region.program())

    def readers(op):
        made = [n for n in model.graph.node if n.op_type == op]
        return [sorted(n.op_type for n in model.graph.node if m.output[0] in n.input) for m in made]

    # (each quantize is x * (1 / s) into a QuantizeLinear)
    assert readers("Gelu") == [["Mul"]]  # (no NaN check reads it)
    first, second = readers("LayerNormalization")
    assert first == ["Add", "Mul", "ReduceSum"]  # (the residual, and no x * 0)
    assert second == ["Mul"]


def test_a_nan_row_read_by_several_layers_is_written_once():
    # Q, K and V of one input (as in attention): one NaN row, |sum(x * 0)|, added as it is to
    # each layer's output (realize's reshape, |.| and * 0 of it per layer write nothing more)
    rng = np.random.default_rng(4)
    ws = tuple((rng.normal(size=(3, 16, 16)) / 4).astype(np.float32))

    def qkv(params, x):
        q, k, v = (x @ w for w in params)
        return q * k + v

    x = rng.normal(size=(6, 16)).astype(np.float32)
    qf = jaxq.quantize(qkv, ws, calibration=[(x,)], progress=False)
    fast = jaxq.offload(qf)
    x[2, 3], x[4, 0] = np.nan, np.inf
    want = np.asarray(qf(x))
    assert np.isnan(want[[2, 4]]).all() and not np.isnan(want[[0, 1, 3, 5]]).any()
    np.testing.assert_array_equal(np.asarray(jax.jit(fast)(x)), want)
    (region,) = fast.regions(x)
    nodes = export_onnx(region.program()).graph.node
    ops = [n.op_type for n in nodes]
    assert ops.count("MatMulIntegerToFloat") == 3
    assert ops.count("ReduceSum") == 1 and ops.count("Abs") == 1
    poisons = set()
    for out in (n.output[0] for n in nodes if n.op_type == "MatMulIntegerToFloat"):
        (reader,) = [n for n in nodes if out in n.input]
        while reader.op_type == "Reshape":  # (realize's own layout of the product)
            out = reader.output[0]
            (reader,) = [n for n in nodes if out in n.input]
        assert reader.op_type == "Add"
        poisons |= set(reader.input) - {out}
    assert len(poisons) == 1  # (one row, the same for all three)


def test_what_onnx_runtime_cannot_run_stays_with_xla_and_is_named():
    def f(params, x):
        with jax.named_scope("Dense_0"):
            h = jax.nn.relu(x @ params["w"])
        return jnp.cumsum(h, axis=1)  # no ONNX rule

    params = {"w": RNG.normal(size=(8, 6)).astype(np.float32)}
    x = RNG.normal(size=(4, 8)).astype(np.float32)
    qf = jaxq.quantize(f, params, calibration=[(x,)], progress=False)
    fast = jaxq.offload(qf)
    with pytest.warns(
        jaxq.OffloadWarning, match=r"1 equation.*XLA.*\(no ONNX rule for cumsum: (jit/)?cumsum\)"
    ) as c:
        y = fast(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(qf(x)), rtol=1e-6, atol=1e-6)
    assert len(fast.regions(x)) == 1  # (built once per shape: no second warning)
    with pytest.warns(jaxq.OffloadWarning) as under_jit:  # (a new shape, traced by jit)
        jax.jit(fast)(x[:2])
    # both point at the line that called, not inside jaxq or JAX's tracing
    assert [w.filename for w in (*c, *under_jit)] == [__file__, __file__]


def test_a_scanned_layer_stack_offloads_unrolled_in_one_region():
    # (lax.scan has no ONNX rule: offload unrolls it, each layer with its own slice of the
    # stacked codes and scales; on jax 0.12 this model once raised RewriteError)
    def f(params, x):  # (per-layer outputs too: unrolled, jnp.stack's primitive joins them)
        body = lambda h, w: (h + jax.nn.relu(h @ w),) * 2
        h, hs = jax.lax.scan(body, x, params["stack"])
        with jax.named_scope("Head"):
            return h @ params["head"], hs

    params = {  # (layers too large for fold_constants to fold a slice of the stack)
        "stack": (RNG.normal(size=(3, 72, 72)) * 0.05).astype(np.float32),
        "head": RNG.normal(size=(72, 4)).astype(np.float32),
    }
    x = RNG.normal(size=(5, 72)).astype(np.float32)
    qf = jaxq.quantize(f, params, calibration=[(x,)], progress=False)
    fast = jaxq.offload(qf, exact=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing stays with XLA)
        y = jax.jit(fast)(x)
    (region,) = fast.regions(x)
    assert region.primitives.count("dot_general") == 4 and "stack" in region.primitives
    for got, want in zip(y, qf(x), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # each layer's codes are an initializer of their own (ONNX Runtime prepacks them), not a
    # Slice of the stack run on every call
    model = export_onnx(region.program())
    assert "Slice" not in {n.op_type for n in model.graph.node}
    looped = jaxq.offload(qf, exact=True, max_unroll=2)  # (3 layers: the loop stays with XLA)
    with pytest.warns(
        jaxq.OffloadWarning, match=r"1 equation.*XLA.*\(no ONNX rule for scan: scan\)"
    ):
        np.testing.assert_array_equal(np.asarray(looped(x)[0]), np.asarray(qf(x)[0]))


def test_bad_input_is_named():
    f, params, qf = quantized_mlp()
    with pytest.raises(TypeError, match="QuantizedFunction jaxq.quantize returns; got partial"):
        jaxq.offload(f)
    batches = [(RNG.normal(size=(4, 24)).astype(np.float32),)]
    sim = jaxq.quantize(f, params, calibration=batches, mode="simulate", progress=False)
    with pytest.raises(ValueError, match="mode 'simulate'.*qf.realize"):
        jaxq.offload(sim)
    for backend in ("xla", "host"):
        with pytest.raises(ValueError, match=f"'{backend}' is not one whose integer kernels"):
            jaxq.offload(qf, backend)
    with pytest.raises(ValueError, match="max_unroll must be an int >= 0; got -1"):
        jaxq.offload(qf, max_unroll=-1)


def test_without_onnxruntime_the_error_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_ort(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ort)
    with pytest.raises(ImportError, match=r"pip install 'jaxq\[onnx\]'"):
        jaxq.offload(quantized_mlp()[2])
