"""Backends, build and device placement: regions really run where they are sent."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxq
from jaxq import partition as P
from jaxq.annotate import on_device
from jaxq.transform import Sequential


@pytest.fixture(autouse=True)
def _clean():
    yield
    for c in ("A", "B", "boom"):
        P.unregister_compiler(c)
        P.unregister_backend(c)


def partitioned(f, args, *compilers):
    prog = jaxq.trace(f, *args)
    return Sequential(
        [P.annotate_target(list(compilers)), P.merge_compiler_regions(), P.partition_graph()]
    )(prog)


X = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
W = (np.random.default_rng(1).standard_normal((3, 3)) * 0.5).astype(np.float32)


def mlp(x):
    h = jnp.tanh(x @ W)
    return jnp.cos(h) + h * 2.0


@pytest.fixture
def mlp_program():
    for p in ("dot_general", "tanh", "mul", "add"):
        P.register_op_support("A", p)
    return partitioned(mlp, (X,), "A")


@pytest.mark.parametrize("backend", ["host", "xla"])
def test_build_runs_regions_on_their_backend(mlp_program, backend):
    assert [r.compiler for r in P.regions(mlp_program)] == ["A", "A"]
    fn = P.build(mlp_program, backends={"A": backend})
    np.testing.assert_allclose(fn(X), mlp(X), rtol=1e-5, atol=1e-6)
    assert fn.jittable
    traced = str(jax.make_jaxpr(fn)(X))
    assert ("pure_callback" in traced) == (backend == "host")


def test_host_backend_really_calls_the_host(mlp_program, monkeypatch):
    from jaxq.partition import _backends

    calls = []
    real = _backends.eval_host
    monkeypatch.setattr(_backends, "eval_host", lambda *a: calls.append(1) or real(*a))
    fn = P.build(mlp_program, backends={"A": "host"})
    fn(X)
    assert len(calls) == 2  # one per region


def test_a_registered_codegen_gets_the_region_program(mlp_program):
    seen = []

    def codegen(region):
        seen.append((region.name, [e.primitive for e in region.equations()]))
        run = jax.jit(region.as_fun())
        return lambda *args: run(*args)

    P.register_backend("A", codegen)
    fn = P.build(mlp_program)
    np.testing.assert_allclose(fn(X), mlp(X), rtol=1e-6)
    assert seen == [
        ("A_mlp_0", ["dot_general", "tanh", "mul"]),  # cos (unsupported) splits off the add
        ("A_mlp_1", ["add"]),
    ]


def test_build_of_a_function_says_to_trace_it():
    with pytest.raises(TypeError, match=r"build: expects a jaxq.Program; got function.*jaxq.trace"):
        P.build(mlp)


def test_unknown_backend_names_region_and_fix(mlp_program):
    with pytest.raises(P.UnknownBackendError, match=r"unknown backend 'A' for region 'A_mlp_0'"):
        P.build(mlp_program)
    with pytest.raises(P.UnknownBackendError, match="'nope'"):
        P.build(mlp_program, backends={"A": "nope"})
    # a misspelled backend: the fix maps the region's compiler, and the close name is offered
    with pytest.raises(
        P.UnknownBackendError, match=r"Did you mean 'onnxruntime'\?.*backends=\{'A': 'xla'\}"
    ):
        P.build(mlp_program, backends={"A": "onnxruntme"})


def test_backends_key_that_names_no_region_is_warned(mlp_program):
    """A misspelled compiler in ``backends`` would otherwise be ignored silently (the region then
    runs on the backend registered under its own compiler's name)."""
    P.register_backend("A", P.xla_backend())
    with pytest.warns(UserWarning, match=r"backends names \['a'\].*compilers are \['A'\].*'A'"):
        fn = P.build(mlp_program, backends={"a": "host"})
    np.testing.assert_allclose(fn(X), mlp(X), rtol=1e-6)


def test_backend_that_raises_names_the_region_or_falls_back(mlp_program):
    def broken(region):
        raise RuntimeError("no kernel for this")

    P.register_backend("A", broken)
    with pytest.raises(P.BackendError, match=r"region 'A_mlp_0'.*no kernel for this"):
        P.build(mlp_program)
    with pytest.warns(P.BackendFallbackWarning, match="A_mlp_") as record:
        fn = P.build(mlp_program, fallback="xla")
    assert ["A_mlp_0" in str(w.message) for w in record] == [True, False]
    assert {w.filename for w in record} == {__file__}  # (the line that called build)
    np.testing.assert_allclose(fn(X), mlp(X), rtol=1e-6)


def test_backend_failing_at_run_time_names_the_region(mlp_program):
    def flaky(region):
        def run(*args):
            raise ValueError("device lost")

        return run

    P.register_backend("A", flaky)
    fn = P.build(mlp_program, jit=False)
    with pytest.raises(P.BackendError, match=r"failed to run region 'A_mlp_0'.*device lost"):
        fn(X)
    fn = P.build(mlp_program, jit=False, fallback="xla")
    with pytest.warns(P.BackendFallbackWarning) as record:
        np.testing.assert_allclose(fn(X), mlp(X), rtol=1e-6)
    assert {w.filename for w in record} == {__file__}


def test_a_runner_returning_one_array_is_told_to_return_a_sequence(mlp_program):
    """It was told it "returned 4 result(s)" (the array's rows)."""
    P.register_backend("A", lambda region: lambda *args: jnp.zeros((4, 3)))
    with pytest.raises(P.BackendError, match=r"returned one array .* a sequence"):
        P.build(mlp_program, jit=False)(X)


def test_an_unpartitioned_program_is_built_with_a_warning():
    """Annotated and merged but not partitioned: its ops ran with XLA, and the codegen was
    never called, without a word."""
    P.register_op_support("A", "tanh")
    annotated = Sequential([P.annotate_target(["A"]), P.merge_compiler_regions()])(
        jaxq.trace(mlp, X)
    )
    with pytest.warns(
        UserWarning, match=r"compiler_begin annotations for \['A'\].*partition_graph"
    ):
        fn = P.build(annotated, backends={"A": "host"})
    np.testing.assert_allclose(fn(X), mlp(X), rtol=1e-6)


def test_host_backend_refuses_what_it_cannot_run():
    P.register_op_support("A", "cumsum")
    prog = partitioned(lambda x: jnp.cumsum(x, axis=0), (X,), "A")
    with pytest.raises(P.BackendError, match=r"host backend cannot run region.*cumsum"):
        P.build(prog, backends={"A": "host"})


def test_xla_backend_on_a_chosen_device(mlp_program):
    fn = P.build(mlp_program, backends={"A": P.xla_backend("cpu:3")})
    assert not fn.jittable
    np.testing.assert_allclose(fn(X), mlp(X), rtol=1e-6)


def test_multi_output_region_runs_on_the_host():
    # TVM #9036: a region with several results must not crash the executor
    P.register_op_support("A", "sin")
    P.register_op_support("A", "cos")

    def f(x):
        s = jnp.sin(x)
        return jnp.cos(s), jnp.tanh(s)

    prog = partitioned(f, (X,), "A")
    assert [r.num_outputs for r in P.regions(prog)] == [2]
    for jit in (True, False):
        got = P.build(prog, backends={"A": "host"}, jit=jit)(X)
        for g, w in zip(got, f(X), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


# -- device placement -------------------------------------------------------------------------------


def placed(x):
    a = on_device(jnp.sin(x) * 2.0, "cpu:2")  # sin, mul on cpu:2
    b = on_device(jnp.cos(a), "cpu:1")  # cos on cpu:1, a copied there
    return a + 1.0, b, x * 3.0  # add follows its operand (cpu:2); x * 3 stays on cpu:0


@pytest.mark.xla_cpu
def test_plan_devices_makes_segments_and_explicit_copies():
    prog = P.plan_devices(default="cpu:0")(jaxq.trace(placed, X))
    eqns = prog.jaxpr.jaxpr.eqns
    kinds = [e.params.get("name", e.primitive.name) for e in eqns]
    assert kinds == [
        "device_put",
        "placed_cpu_2_0",
        "device_put",
        "placed_cpu_1_1",
        "placed_cpu_0_2",
    ]
    devices = [e.params["devices"][0].id for e in eqns if e.primitive.name == "device_put"]
    assert devices == [2, 1]
    assert "on_device" not in str(prog.jaxpr)
    seg = {
        e.params["name"]: [x.primitive.name for x in e.params["jaxpr"].jaxpr.eqns]
        for e in eqns
        if "name" in e.params
    }
    assert seg["placed_cpu_2_0"] == ["sin", "mul", "add"]
    for got, want in zip(prog(X), placed(X), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.xla_cpu
def test_placed_program_runs_on_the_requested_devices():
    prog = P.plan_devices(default="cpu:0")(jaxq.trace(placed, X))
    a1, b, x3 = P.build(prog)(X)
    devs = jax.devices("cpu")
    assert a1.devices() == {devs[2]}
    assert b.devices() == {devs[1]}
    assert x3.devices() == {devs[0]}
    for got, want in zip((a1, b, x3), placed(X), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with pytest.raises(P.BackendError, match="placed on devices by plan_devices, so it runs"):
        jax.jit(P.build(prog))(X)  # (JAX's "incompatible devices" error, before)


@pytest.mark.xla_cpu
def test_a_program_without_annotations_runs_on_the_default_device():
    """plan_devices(default=...) returned a program with no on_device as it was (device 0)."""
    prog = P.plan_devices(default="cpu:1")(jaxq.trace(mlp, X))
    out = P.build(prog)(X)
    assert out.devices() == {jax.devices("cpu")[1]}
    np.testing.assert_allclose(out, mlp(X), rtol=1e-6)
    assert P.plan_devices()(program := jaxq.trace(mlp, X)) is program  # (no default: as it is)


def test_on_device_inside_a_call_or_loop_is_reported():
    """Placement is per top-level equation: on_device inside a jit or a scan body was ignored
    without a word."""

    def in_jit(x):
        return jax.jit(lambda v: on_device(jnp.sin(v), "cpu:1"))(x)

    def in_scan(x):
        return jax.lax.scan(lambda c, _: (on_device(jnp.sin(c), "cpu:1"), None), x, length=3)[0]

    for f in (in_jit, in_scan):
        with pytest.warns(UserWarning, match=r"1 on_device annotation\(s\) inside nested"):
            P.plan_devices()(jaxq.trace(f, X))


def test_on_device_of_an_input_is_a_copy():
    prog = P.plan_devices(default="cpu:0")(jaxq.trace(lambda x: on_device(x, "cpu:3"), X))
    (out,) = jax.tree.leaves(P.build(prog)(X))
    assert out.devices() == {jax.devices("cpu")[3]}
    np.testing.assert_array_equal(out, X)


def test_placement_with_regions_on_a_backend(mlp_program, monkeypatch):
    from jaxq.partition import _backends

    calls = []
    real = _backends.eval_host
    monkeypatch.setattr(_backends, "eval_host", lambda *a: calls.append(1) or real(*a))

    def f(x):
        return on_device(mlp(x), "cpu:1")

    prog = P.plan_devices(default="cpu:0")(partitioned(f, (X,), "A"))
    assert [r.name for r in P.regions(prog)] == ["A_f_0", "A_f_1"]  # inside the segment
    out = P.build(prog, backends={"A": "host"})(X)
    assert len(calls) == 2
    assert out.devices() == {jax.devices("cpu")[1]}
    np.testing.assert_allclose(out, mlp(X), rtol=1e-5, atol=1e-6)


def test_a_numpy_runner_under_jit_gets_told_how_to_run_eagerly(mlp_program):
    """A codegen whose runner calls numpy sees traced values under build's jax.jit: the error
    says how to mark it eager, and marked so it runs."""

    def numpy_codegen(region):
        ref = jax.jit(region.as_fun())

        def run(*flat):
            return [np.asarray(o) for o in jax.tree.leaves(ref(*[np.asarray(a) for a in flat]))]

        return run

    with pytest.raises(P.BackendError, match=r"run\.jittable = False"):
        P.build(mlp_program, backends={"A": numpy_codegen})(X)

    def eager_codegen(region):
        run = numpy_codegen(region)
        run.jittable = False
        return run

    fn = P.build(mlp_program, backends={"A": eager_codegen})
    np.testing.assert_allclose(fn(X), mlp(X), rtol=1e-5, atol=1e-6)
    # (jax.jit of the eager function: a raw TracerArrayConversionError from inside build)
    with pytest.raises(P.BackendError, match=r"runs eagerly .* call it outside jax\.jit"):
        jax.jit(fn)(X)


def test_regions_on_other_backends_differentiate_like_their_jaxpr(mlp_program):
    """A backend computes values (a numpy interpreter, jax.pure_callback, ONNX Runtime have no
    JVP); jax.grad / jax.jvp / vmap of grad take the region's jaxpr's derivatives from XLA."""

    def loss(x):
        return jnp.sum(mlp(x) ** 2)

    want = jax.grad(loss)(X)
    eager = P.build(mlp_program, backends={"A": "host"}, jit=False)
    for fn in (P.build(mlp_program, backends={"A": "host"}), eager):
        got = jax.grad(lambda x, fn=fn: jnp.sum(fn(x) ** 2))(X)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    got = jax.jit(jax.grad(lambda x: jnp.sum(eager(x) ** 2)))(X)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    xs = np.stack([X, X * 2])
    each = jax.vmap(jax.grad(lambda x: jnp.sum(eager(x) ** 2)))(xs)
    np.testing.assert_allclose(each, jax.vmap(jax.grad(loss))(xs), rtol=1e-5, atol=1e-6)
    _, t = jax.jvp(eager, (X,), (np.ones_like(X),))
    np.testing.assert_allclose(t, jax.jvp(mlp, (X,), (np.ones_like(X),))[1], rtol=1e-5)

    def scaled(x, i):  # (an integer input and output: float0 tangents)
        return x * i[:, None].astype(jnp.float32), i * 2

    for p in ("mul", "convert_element_type", "broadcast_in_dim"):
        P.register_op_support("B", p)
    i = np.array([2, 0, 1, 3], np.int32)
    prog = partitioned(scaled, (X, i), "B")
    assert [r.compiler for r in P.regions(prog)] == ["B", "B"]  # (float and int products)
    fn = P.build(prog, backends={"B": "host"})
    g = jax.grad(lambda x: jnp.sum(fn(x, i)[0] ** 2))(X)
    np.testing.assert_array_equal(g, jax.grad(lambda x: jnp.sum(scaled(x, i)[0] ** 2))(X))
