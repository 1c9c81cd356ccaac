"""The optional ONNX Runtime backend: regions are exported to ONNX and really run in ONNX Runtime."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxq
from jaxq import partition as P
from jaxq.transform import Sequential

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

X = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
W = (np.random.default_rng(1).standard_normal((4, 3)) * 0.5).astype(np.float32)
B = np.linspace(-1, 1, 3).astype(np.float32)

OPS = ("dot_general", "add", "mul", "tanh", "broadcast_in_dim", "max", "exp", "reduce_sum",
       "custom_jvp_call", "div", "transpose", "sub", "integer_pow")  # fmt: skip


@pytest.fixture(autouse=True)
def _clean():
    for p in OPS:
        P.register_op_support("A", p)
    yield
    P.unregister_compiler("A")
    P.unregister_backend("spy")


def model(x):
    h = jax.nn.relu(x @ W + B)  # relu is a custom_jvp call: inlined by the exporter
    y = jnp.tanh(h) * 2.0 - h**2
    s = jnp.exp(y - y.max(axis=1, keepdims=True))  # reduce_max is not supported: a second region
    return (s / s.sum(axis=1, keepdims=True)).T, jnp.cos(y)


def partitioned():
    prog = jaxq.trace(model, X)
    return Sequential([P.annotate_target(["A"]), P.merge_compiler_regions(), P.partition_graph()])(
        prog
    )


@pytest.mark.xla_cpu
@pytest.mark.parametrize("crossing", ["ffi", "pure_callback"])
def test_regions_run_in_onnxruntime(crossing, monkeypatch):
    from jaxq.partition import _ort_ffi
    from jaxq.partition._onnx import onnx_codegen

    if crossing == "pure_callback":  # where the C++ crossing does not build
        monkeypatch.setattr(_ort_ffi, "library", lambda: None)
    elif _ort_ffi.library() is None:
        pytest.skip("the FFI crossing does not build here (no C++ compiler?)")
    made = []

    def spy(region):
        run = onnx_codegen(region)
        made.append(run)
        return run

    P.register_backend("spy", spy)
    prog = partitioned()
    regs = P.regions(prog)
    assert len(regs) == 2
    fn = P.build(prog, backends={"A": "spy"})
    got = fn(X)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(model(X)), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # each region was exported and ran once in its own ONNX Runtime session
    assert [r.calls() for r in made] == [1, 1]
    if crossing == "ffi":  # (an eager call on CPU arrays crossed there: no Python session)
        assert not any("session" in vars(r) for r in made)
    assert all(r.session.get_providers() == ["CPUExecutionProvider"] for r in made)
    ops = {n.op_type for r in made for n in r.model.graph.node}
    assert {"MatMul", "Tanh", "Max", "Reshape", "ReduceSum", "Transpose"} <= ops
    assert "Expand" not in ops  # (each broadcast feeds an op that broadcasts by itself)
    assert all(r.crossing == crossing for r in made)
    # jittable: XLA calls ONNX Runtime on its own buffers, or through a host callback
    primitive = "ffi_call" if crossing == "ffi" else "pure_callback"
    traced = str(jax.make_jaxpr(fn)(X))
    assert primitive in traced
    if crossing == "ffi":
        # the FFI handler reads host memory: registered for XLA:CPU only, so a program lowered
        # for another platform (a GPU) crosses through a host callback instead
        assert "platform_index" in traced and "pure_callback" in traced
        lowered = jax.jit(fn).lower(X).as_text()
        assert "jaxq_ort_run" in lowered and "callback" not in lowered
    jax.jit(fn)(X)
    assert [r.calls() for r in made] == [2, 2]
    batch = np.stack([X, 2 * X])  # vmap: one call per element
    got, want = jax.vmap(fn)(batch), jax.vmap(model)(batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert [r.calls() for r in made] == [4, 4]

    def loss(f, x):
        a, b = f(x)
        return jnp.sum(a * a) + jnp.sum(b)

    # jax.grad: values from ONNX Runtime, derivatives from the regions' jaxprs, in XLA
    value, grad = jax.jit(jax.value_and_grad(lambda x: loss(fn, x)))(X)
    want_value, want_grad = jax.value_and_grad(lambda x: loss(model, x))(X)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    assert [r.calls() for r in made] == [5, 5]


def test_registered_onnxruntime_backend_and_export():
    prog = partitioned()
    fn = P.build(prog, backends={"A": "onnxruntime"})
    for g, w in zip(jax.tree.leaves(fn(X)), jax.tree.leaves(model(X)), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    onnx_model = P.export_onnx(P.regions(prog)[0].program())
    assert onnx_model.graph.name == P.regions(prog)[0].name
    assert [i.name for i in onnx_model.graph.input] == ["in0"]


def test_export_onnx_of_a_region_not_called_says_to_call_it():
    """RegionInfo.program is a method: export_onnx(r.program) failed with "'function' object
    has no attribute 'jaxpr'"."""
    (region, *_) = P.regions(partitioned())
    with pytest.raises(TypeError, match=r"expects a jaxq.Program.*got method \(call it"):
        P.export_onnx(region.program)


def test_unexportable_region_is_named_and_can_fall_back():
    P.register_op_support("A", "cumsum")
    prog = Sequential([P.annotate_target(["A"]), P.partition_graph()])(
        jaxq.trace(lambda x: jnp.cumsum(x, axis=0) + 1.0, X)
    )
    with pytest.raises(P.BackendError, match=r"region 'A_lambda_0'.*cumsum"):
        P.build(prog, backends={"A": "onnxruntime"})
    with pytest.warns(P.BackendFallbackWarning, match="A_lambda_0"):
        fn = P.build(prog, backends={"A": "onnxruntime"}, fallback="xla")
    np.testing.assert_allclose(fn(X), jnp.cumsum(X, axis=0) + 1.0, rtol=1e-6)


def test_ffi_crossing_names_what_onnxruntime_rejects():
    from jaxq.partition import _ort_ffi

    lib = _ort_ffi.library()
    if lib is None:
        pytest.skip("the FFI crossing does not build here (no C++ compiler?)")
    with pytest.raises(RuntimeError, match="ONNX Runtime could not open the model: .*"):
        _ort_ffi.Session(lib, "r", b"not an onnx model", ["in0"], ["out0"])


def test_attention_products_export_as_batched_matmuls():
    """``Q K^T`` and ``P V`` with leading batch axes (batch, head) become one MatMul each on the
    4-D operands, with no reshapes (ONNX Runtime then fuses the key's transpose and the scale)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 5, 4)).astype(np.float32) for _ in range(3))

    def attention(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 2.0
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    P.register_op_support("A", "reduce_max")
    P.register_op_support("A", "stop_gradient")
    prog = Sequential([P.annotate_target(["A"]), P.merge_compiler_regions(), P.partition_graph()])(
        jaxq.trace(attention, q, k, v)
    )
    (region,) = P.regions(prog)
    ops = [n.op_type for n in P.export_onnx(region.program()).graph.node]
    assert ops.count("MatMul") == 2 and "Reshape" not in ops, ops
    fn = P.build(prog, backends={"A": "onnxruntime"})
    np.testing.assert_allclose(fn(q, k, v), attention(q, k, v), rtol=1e-5, atol=1e-6)


def exported_ops(f, *args):
    """The op types of ``f`` exported whole for ONNX Runtime, and what ONNX Runtime computes."""
    P.register_backend_support("ort", "onnxruntime")
    try:
        passes = [P.annotate_target(["ort"]), P.merge_compiler_regions(), P.partition_graph()]
        prog = Sequential(passes)(jaxq.trace(f, *args))
        (region,) = P.regions(prog)
        ops = [n.op_type for n in P.export_onnx(region.program()).graph.node]
        return ops, jaxq.build(prog, backends={"ort": "onnxruntime"})(*args)
    finally:
        P.unregister_compiler("ort")


def test_a_broadcast_that_only_adds_unit_axes_is_one_reshape():
    """``x.max(-1, keepdims=True)`` broadcasts ``[B, T]`` to ``[B, T, 1]``: a Reshape, with no
    Expand to the shape it already has (an extra copy in ONNX Runtime)."""
    x = np.random.default_rng(3).normal(size=(2, 5, 8)).astype(np.float32)
    f = lambda x: (x - x.max(-1, keepdims=True)) * 2.0
    ops, got = exported_ops(f, x)
    assert "Expand" not in ops and ops.count("Reshape") == 1, ops
    np.testing.assert_array_equal(np.asarray(got), np.asarray(f(x)))


@pytest.mark.xla_cpu
def test_identities_export_without_a_node():
    """``checkpoint_name`` (a remat policy's tag) had no rule: it split an offloaded region."""
    from jax.ad_checkpoint import checkpoint_name

    f = lambda x: jnp.tanh(checkpoint_name(x * 2.0, "act")) + lax.stop_gradient(x)  # noqa: E731
    ops, got = exported_ops(f, X)
    assert ops == exported_ops(lambda x: jnp.tanh(x * 2.0) + x, X)[0], ops
    np.testing.assert_array_equal(np.asarray(got), np.asarray(f(X)))


@pytest.mark.parametrize(
    "axis, keepdims, n", [(-1, True, 8), (-1, False, 8), (1, True, 8), (-1, True, 0)]
)
def test_a_mean_over_the_last_axis_is_one_reduce_mean(axis, keepdims, n):
    """``x.mean(-1)`` (a layer norm's centering) is one ``ReduceMean``, not ``ReduceSum``,
    ``Reshape`` and ``Div``; a mean over another axis keeps those, and so does a mean over an
    empty axis (NaN, where ``ReduceMean`` gives 0)."""
    x = np.random.default_rng(4).normal(size=(2, 5, n)).astype(np.float32)
    f = lambda x: jnp.mean(x, axis, keepdims=keepdims) * 2.0
    ops, got = exported_ops(f, x)
    last = axis == -1 and n > 0
    assert ("ReduceMean" in ops) == last and ("ReduceSum" in ops) != last, ops
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(f)(x)), rtol=1e-6, atol=1e-7)
    assert np.isnan(np.asarray(got)).all() == (n == 0)


@pytest.mark.parametrize(
    "f",
    [
        lambda a: (jnp.ones((3, 4)) * a[:, None]).sum(1),
        lambda a: (jnp.broadcast_to(a[:, None], (3, 4)) + jnp.ones((3, 4))).sum(1),
        lambda a: jnp.broadcast_to(a[:, None], (3, 4)) * 2,
    ],
    ids=["ones_times_column", "broadcast_plus_ones", "broadcast_times_literal"],
)
def test_an_op_whose_operands_are_all_broadcasts_gets_its_full_shape(f):
    """A broadcast is left to the op that reads it (ONNX's elementwise ops broadcast), except
    where every operand would be left so: ``ones((3, 4)) * a[:, None]`` computed a [3, 1]
    product, summed to ``a`` instead of ``4 a``."""
    a = np.arange(1, 4, dtype=np.float32)
    _, got = exported_ops(f, a)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(f(a)))
