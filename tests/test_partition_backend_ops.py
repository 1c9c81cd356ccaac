"""backend_ops: what a backend says it runs is what it runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxq
from jaxq import partition as P
from jaxq.transform import Sequential

X = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
W = (np.random.default_rng(1).standard_normal((3, 3)) * 0.5).astype(np.float32)


@pytest.fixture(autouse=True)
def _clean():
    yield
    for name in ("claims", "mine"):
        P.unregister_compiler(name)
        P.unregister_backend(name)


def partitioned(f, compiler, *args):
    pipeline = Sequential(
        [P.annotate_target([compiler]), P.merge_compiler_regions(), P.partition_graph()]
    )
    return pipeline(jaxq.trace(f, *(args or (X,))))


def run_claimed(backend, f, *args):
    """``f`` partitioned for a compiler claiming what ``backend`` runs, built there, run."""
    P.register_backend_support("claims", backend)  # (unregistered by _clean)
    parts = partitioned(f, "claims", *args)
    return parts, jax.jit(jaxq.build(parts, backends={"claims": backend}))(*args)


def test_table_backends_list_sorted_names_with_the_calls_they_inline():
    for backend in ("host", "onnxruntime"):
        ops = P.backend_ops(backend)
        assert ops is not None and list(ops) == sorted(set(ops))
        assert {"dot_general", "add", "tanh", "jit", "custom_jvp_call"} <= set(ops)
    assert "shift_left" in P.backend_ops("host") and "erf" not in P.backend_ops("host")
    assert "erf" in P.backend_ops("onnxruntime")


def test_xla_and_backends_you_register_have_no_table():
    assert P.backend_ops("xla") is None
    P.register_backend("mine", P.xla_backend())
    assert P.backend_ops("mine") is None


def test_an_unknown_backend_is_an_error_naming_the_known_ones():
    with pytest.raises(P.UnknownBackendError, match="'nope'.*registered: .*host"):
        P.backend_ops("nope")


def test_the_table_belongs_to_the_codegen_not_to_the_name():
    from jaxq.partition._backends import host_codegen

    P.register_backend("host", P.xla_backend())  # "host" now runs something else
    try:
        assert P.backend_ops("host") is None
    finally:
        P.register_backend("host", host_codegen)
    assert P.backend_ops("host") is not None


@pytest.mark.parametrize("backend", ["host", "onnxruntime"])
def test_a_compiler_claiming_exactly_what_a_backend_runs_builds_on_it(backend):
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    for op in P.backend_ops(backend):
        P.register_op_support("claims", op)

    def f(x):
        h = jnp.tanh(x @ W) * 2.0 - 1.0
        return jnp.cumsum(jnp.maximum(h, 0.0), axis=1)  # cumsum is in no table: stays with XLA

    parts = partitioned(f, "claims")
    (region,) = P.regions(parts)
    assert set(region.primitives) <= set(P.backend_ops(backend))
    run = jaxq.build(parts, backends={"claims": backend})
    np.testing.assert_allclose(run(X), f(X), rtol=1e-5, atol=1e-5)


def test_a_primitive_a_backend_does_not_list_fails_to_build_on_it():
    pytest.importorskip("onnxruntime")
    P.register_op_support("claims", "erf")  # ONNX Runtime lists it, the host backend does not

    def f(x):
        return jnp.sin(lax.erf(x))

    parts = partitioned(f, "claims")
    with pytest.raises(P.BackendError, match="erf"):
        jaxq.build(parts, backends={"claims": "host"})
    run = jaxq.build(parts, backends={"claims": "onnxruntime"})
    np.testing.assert_allclose(run(X), f(X), rtol=1e-5, atol=1e-5)


def test_claiming_what_a_backend_runs_includes_its_conditions():
    """ONNX Runtime lists conv_general_dilated, but not with input dilation (a transposed
    convolution): claimed with the backend's own conditions, that one stays with XLA."""
    pytest.importorskip("onnxruntime")
    k = np.random.default_rng(1).normal(size=(3, 3, 2, 2)).astype(np.float32)
    img = np.random.default_rng(2).normal(size=(1, 5, 5, 2)).astype(np.float32)
    dn = ("NHWC", "HWIO", "NHWC")

    def f(x):
        up = lax.conv_general_dilated(
            x, k, (1, 1), ((1, 1), (1, 1)), lhs_dilation=(2, 2), dimension_numbers=dn
        )
        return jnp.tanh(lax.conv_general_dilated(up, k, (1, 1), "SAME", dimension_numbers=dn))

    claimed = P.register_backend_support("claims", "onnxruntime")
    assert "conv_general_dilated" in claimed and "jit" not in claimed
    parts = P.partition_graph()(
        P.merge_compiler_regions()(P.annotate_target(["claims"])(jaxq.trace(f, img)))
    )
    assert [r.primitives for r in P.regions(parts)] == [("conv_general_dilated", "tanh")]
    run = jaxq.build(parts, backends={"claims": "onnxruntime"})
    np.testing.assert_allclose(run(img), f(img), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="no fixed table"):
        P.register_backend_support("claims", "xla")
    # (ONNX Runtime's Neg has no unsigned kernel: claimed, the model failed to open at build)
    a = np.array([1, 0, 200], np.uint8)
    parts = P.partition_graph()(P.annotate_target(["claims"])(jaxq.trace(lambda a: -a, a)))
    assert P.regions(parts) == []
    np.testing.assert_array_equal(jaxq.build(parts, backends={"claims": "onnxruntime"})(a), -a)


@pytest.mark.parametrize("backend", ["host", "onnxruntime"])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int32])
def test_float_to_integer_casts_saturate_like_xla(backend, dtype):
    """numpy wraps (300.7 -> 44 in int8) and ONNX Runtime gives INT_MIN for NaN and Inf; both
    backends convert as XLA does: NaN is 0, out of range saturates, the rest truncates."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    P.register_op_support("claims", "mul")
    P.register_op_support("claims", "convert_element_type")
    x = np.array([300.7, -300.7, np.inf, -np.inf, np.nan, 5e9, -5e9, 2.7, -2.7, 0.5], np.float32)
    f = lambda v: (v * 1.0).astype(dtype)
    parts = Sequential(
        [P.annotate_target(["claims"]), P.merge_compiler_regions(), P.partition_graph()]
    )(jaxq.trace(f, x))
    assert len(P.regions(parts)) == 1
    got = jaxq.build(parts, backends={"claims": backend})(x)
    np.testing.assert_array_equal(got, jax.jit(f)(x))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_host_runs_16_bit_float_dots_it_claims(dtype):
    """numpy's einsum has no bfloat16: the host backend sums 16-bit floats in float32 and rounds
    once, as XLA:CPU does (it failed inside the callback, after build had accepted it)."""
    P.register_backend_support("claims", "host")
    a, b = X.astype(dtype), W.astype(dtype)
    f = lambda a, b: jnp.tanh(a @ b) + a[:, :1]
    parts = Sequential(
        [P.annotate_target(["claims"]), P.merge_compiler_regions(), P.partition_graph()]
    )(jaxq.trace(f, a, b))
    assert len(P.regions(parts)) == 1
    got = jaxq.build(parts, backends={"claims": "host"})(a, b)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.float32(got), np.float32(f(a, b)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", ["host", "onnxruntime"])
def test_checkpointed_calls_a_backend_claims_run_there(backend):
    """jax.checkpoint computes its body outside differentiation; the table backends claimed it
    (a pure call) and then failed to build it ("no numpy rule for ['remat2']")."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    P.register_backend_support("claims", backend)
    f = lambda x: jax.checkpoint(lambda a: jnp.sin(a) * jnp.tanh(a @ W))(x) + 1.0
    parts = partitioned(f, "claims")
    (region,) = P.regions(parts)
    assert region.primitives[0] in ("checkpoint", "remat2")
    run = jaxq.build(parts, backends={"claims": backend})
    np.testing.assert_allclose(run(X), f(X), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["host", "onnxruntime"])
def test_gradients_run_on_the_table_backends(backend):
    """JAX adds up cotangents with add_any: a region of a gradient failed to build on both
    ("no numpy rule for ['add_any']", "no rule for ['add_any']")."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    g = jax.grad(lambda x: jnp.sum(jnp.sin(x) * jnp.tanh(x @ W)))
    parts, got = run_claimed(backend, g, X)
    assert any("add_any" in r.primitives for r in P.regions(parts))
    np.testing.assert_allclose(got, g(X), rtol=1e-5, atol=1e-6)


def _pool_padded(x):
    return lax.reduce_window(
        x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 1, 1), ((0, 0), (0, 0), (2, 0), (0, 0))
    )


_I16 = np.array([[3, -7, 5], [1, 2, -3]], np.int16)
_I32 = np.array([7, -7, 9, 4], np.int32)


@pytest.mark.parametrize(
    "f, args",
    [
        (lambda x: lax.clamp(1.0, x, -1.0), (np.linspace(-2, 2, 5).astype(np.float32),)),
        (lambda a, b: lax.div(a, b) + 1, (_I32, np.array([2, 3, 0, 1], np.int32))),
        (_pool_padded, (np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4),)),
        (lambda x: jnp.maximum(x, 0) + 1, (_I16,)),
        (lambda x: jnp.sum(x, axis=1, dtype=jnp.int8), (_I16.astype(np.int8),)),
        (lambda x: (x < ~x) | x, (np.array([True, False]),)),
        (lambda x: jnp.pad(x, ((1, 1), (0, 2))) * 2, (_I16,)),
        (lambda x: x.astype(jnp.int4).astype(jnp.int32) * 2, (_I32,)),
        (lambda x: lax.reduce_max(x, (0,)) + 1, (np.zeros((0, 3), np.float32),)),
        (lambda z: z * z + 1, (np.array([1 + 2j, -3j], np.complex64),)),
    ],
    ids=["clamp_lo_above_hi", "int_div_by_zero", "pool_padded_by_a_window", "max_int16",
         "sum_int8", "lt_bool", "pad_int16", "int4", "max_of_nothing", "complex"],
)  # fmt: skip
def test_what_onnx_runtime_is_claimed_for_runs_as_xla_does(f, args):
    """Each of these was claimed for ONNX Runtime and then failed to open (int16 Max, int8
    ReduceSum, bool Less, MaxPool padded by its window, int16 Pad, a Cast to int4, complex
    Mul), failed at
    run time (integer division by 0, which XLA defines), or ran wrong (a clamp whose bounds
    cross gave lo; XLA gives hi)."""
    pytest.importorskip("onnxruntime")
    _, got = run_claimed("onnxruntime", f, *args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(f)(*args)))


def test_a_split_runs_in_onnx_runtime():
    """``jnp.split`` (query / key / value, gates) is one ``Split``: it broke regions before."""
    pytest.importorskip("onnxruntime")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = lambda x: jnp.concatenate(jnp.split(x + 1, [1], axis=1)[::-1], axis=1) * 2
    parts, got = run_claimed("onnxruntime", f, x)
    assert [r.primitives for r in P.regions(parts)] == [("add", "split", "concatenate", "mul")]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(f)(x)))


@pytest.mark.xla_cpu
def test_a_clipped_cast_to_int8_feeding_an_int8_dot_truncates_as_xla():
    """A float clipped into int8's range and cast (not rounded first) feeds an int8 dot: the
    exporter took the clipped floats for whole numbers and shifted them into uint8 by a Cast
    that floors, so -0.066 * 30 became -2 where XLA truncates to -1."""
    pytest.importorskip("onnxruntime")
    x = np.array([[0.063, -0.066], [0.32, 0.052], [-0.27, 0.18], [2.57, -2.57]], np.float32)

    def f(x):
        q = jnp.clip(x * 30.0, -100, 100).astype(jnp.int8)
        dn = (((1,), (0,)), ((), ()))
        return lax.dot_general(q, jnp.eye(2, dtype=jnp.int8), dn, preferred_element_type=jnp.int32)

    P.register_backend_support("claims", "onnxruntime")
    try:
        passes = [P.annotate_target(["claims"]), P.merge_compiler_regions(), P.partition_graph()]
        parts = jaxq.transform.Sequential(passes)(jaxq.trace(f, x))
        assert [r.primitives[-1] for r in P.regions(parts)] == ["dot_general"]
        got = jax.jit(jaxq.build(parts, backends={"claims": "onnxruntime"}))(x)
    finally:
        P.unregister_compiler("claims")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(f)(x)))


@pytest.mark.parametrize("backend", ["onnxruntime", "xla"])
def test_a_region_whose_results_nobody_reads_builds(backend):
    """JAX keeps an unused ``x[0]`` in the jaxpr; partitioned, it is a region with no outputs,
    which ONNX Runtime refused to open. Nothing reads it, so nothing runs."""
    pytest.importorskip("onnxruntime")

    def f(x):
        _unused = x[0]
        return x + 1.0

    x = np.ones((2, 3), np.float32)
    P.register_backend_support("claims", "onnxruntime")
    try:
        passes = [P.annotate_target(["claims"]), P.merge_compiler_regions(), P.partition_graph()]
        parts = jaxq.transform.Sequential(passes)(jaxq.trace(f, x))
        assert 0 in [r.num_outputs for r in P.regions(parts)]
        got = jaxq.build(parts, backends={"claims": backend})(x)
    finally:
        P.unregister_compiler("claims")
    np.testing.assert_array_equal(np.asarray(got), x + 1.0)


@pytest.mark.parametrize(
    "f, x",
    [
        (lambda x: lax.shift_right_arithmetic(x, jnp.full_like(x, 1)), np.array([255, 128, 7], np.uint8)),
        (lambda x: lax.shift_right_arithmetic(x, jnp.full_like(x, 9)), np.array([255, 128, 7], np.uint8)),
        (lambda x: lax.reduce_max(x, (0,)), np.zeros((0, 3), np.float32)),
        (lambda x: lax.reduce_min(x, (0,)), np.zeros((0, 3), np.int32)),
        (lambda x: lax.reduce_max(x, (1,)), np.zeros((2, 0), np.bool_)),
        (lambda x: x / (x + 3), np.array([1, 2, 3, -4], jnp.bfloat16)),
        (lambda x: lax.rem(x, x - x), np.array([1, 2, 3, -4], jnp.bfloat16)),
    ],
    ids=["sra_uint8", "sra_uint8_out_of_range", "max_of_nothing", "min_of_nothing", "any_of_nothing",
         "bf16_div", "bf16_rem_by_0"],
)  # fmt: skip
def test_what_the_host_backend_is_claimed_for_runs_as_xla_does(f, x):
    """numpy's ``>>`` of an unsigned int is a logical shift (XLA's arithmetic one fills with the
    top bit: 255 >> 1 is 255), numpy's max of nothing raises (XLA gives -inf, INT_MAX...), and
    numpy does not count bfloat16 as floating (its division was an integer one)."""
    parts, got = run_claimed("host", f, x)
    assert P.regions(parts)
    want = np.asarray(jax.jit(f)(x))
    assert got.dtype == want.dtype  # (compared as float64: numpy's NaN test skips bfloat16)
    np.testing.assert_array_equal(np.float64(got), np.float64(want))


@pytest.mark.parametrize(
    "y, x",
    [
        (5, np.array([3, 100, -100, 128], np.int32)),  # (wraps past 2**31, as in XLA)
        (5, np.array([1, 2, -3], np.int8)),
        (7, np.array([1, 2, 3], np.uint16)),
        (7, np.linspace(-1.7, 2.3, 9, dtype=np.float32)),
        (-3, np.linspace(0.3, 2.3, 9, dtype=np.float32)),
    ],
)
def test_onnx_runtime_integer_powers_are_xlas(y, x):
    """ONNX Pow saturated int32 overflow (XLA wraps) and had no 8- or 16-bit kernels; the
    exporter now multiplies as XLA does (square and multiply), so floats round alike too."""
    pytest.importorskip("onnxruntime")
    f = lambda a: lax.integer_pow(a, y)
    parts, got = run_claimed("onnxruntime", f, x)
    assert P.regions(parts)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(f)(x)))
