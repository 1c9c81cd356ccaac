"""Program: tracing, evaluation, the calling convention, printing, and errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from strategies import programs

import jaxq


def mlp(params, x):
    with jax.named_scope("MLP"):
        for i, (w, b) in enumerate(params):
            with jax.named_scope(f"Dense_{i}"):
                x = jnp.tanh(x @ w + b)
    return {"out": x, "sum": x.sum()}


PARAMS = [
    (np.ones((3, 4), np.float32) * 0.1, np.zeros(4, np.float32)),
    (np.ones((4, 2), np.float32) * 0.2, np.ones(2, np.float32)),
]
X = np.arange(6, dtype=np.float32).reshape(2, 3)


def test_trace_and_call_keeps_pytree_signature():
    prog = jaxq.trace(mlp, PARAMS, X)
    got = prog(PARAMS, X)
    want = mlp(PARAMS, X)
    assert set(got) == {"out", "sum"}
    np.testing.assert_array_equal(got["out"], want["out"])
    np.testing.assert_array_equal(got["sum"], want["sum"])


def test_kwargs_and_shape_dtype_structs():
    f = lambda x, *, scale: x * scale
    prog = jaxq.trace(f, jax.ShapeDtypeStruct((2, 3), jnp.float32), scale=np.float32(2.0))
    np.testing.assert_array_equal(prog(X, scale=np.float32(3.0)), X * 3)


def test_as_fun_under_jit_vmap_grad_and_export():
    prog = jaxq.trace(lambda w, x: jnp.sum(jnp.sin(x @ w)), PARAMS[0][0], X[0])
    f = prog.as_fun()
    w = PARAMS[0][0]
    np.testing.assert_allclose(jax.jit(f)(w, X[0]), jnp.sum(jnp.sin(X[0] @ w)), rtol=1e-6)
    np.testing.assert_allclose(
        jax.vmap(f, in_axes=(None, 0))(w, X), jnp.sum(jnp.sin(X @ w), axis=1), rtol=1e-6
    )
    g = jax.grad(f)(w, X[0])
    g_ref = jax.grad(lambda w, x: jnp.sum(jnp.sin(x @ w)))(w, X[0])
    np.testing.assert_allclose(g, g_ref, rtol=1e-6)
    exported = jax.export.export(jax.jit(f))(w, X[0])
    back = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(back.call(w, X[0]), jax.jit(f)(w, X[0]))


def test_wrong_shapes_and_dtypes_list_expected_and_got():
    prog = jaxq.trace(mlp, PARAMS, X)
    with pytest.raises(TypeError) as info:
        prog(PARAMS, np.zeros((5, 3), np.int32))
    msg = str(info.value)
    assert "args[1]: expected float32[2,3], got int32[5,3]" in msg
    assert "trace it again" in msg


def test_wrong_structure_is_a_clear_error():
    prog = jaxq.trace(mlp, PARAMS, X)
    with pytest.raises(TypeError, match="different structure"):
        prog(PARAMS[:1], X)


def test_a_jitted_functions_static_argument_gets_a_hint():
    f = jax.jit(lambda x, n: x * n, static_argnums=1)
    with pytest.raises(jaxq.TraceError, match=r"Non-hashable(.|\n)*Bind it instead"):
        jaxq.trace(f, X, 3)


def test_python_scalars_are_accepted_for_scalar_inputs():
    prog = jaxq.trace(lambda x, s: x * s, X, np.float32(2))
    np.testing.assert_array_equal(prog(X, 2.0), X * 2)
    np.testing.assert_array_equal(prog(X, 2), X * 2)  # an int where a float was traced, as JAX
    assert np.isinf(prog(np.abs(X) + 1, float("inf"))).all()  # Inf itself is a float value


@pytest.mark.parametrize(
    ("example", "given"),
    [(3, 2.5), (True, 7), (1.5, 1e40), (3, 2**40), (2.5, 1j), (3.0, True)],
)
def test_python_scalars_that_jax_would_not_convert_are_refused(example, given):
    """A Python scalar converts as JAX promotes it; anything else is an error, never a silently
    truncated, saturated or overflowed value (int 2 for 2.5, 1 for 7, Inf for 1e40)."""
    prog = jaxq.trace(lambda x, n: x * n, X, example)
    with pytest.raises(TypeError, match=r"args\[1\]: expected .* got Python"):
        prog(X, given)


def test_outputs_are_arrays_also_when_an_input_or_a_literal():
    """As under jit: a passed-through numpy input and a literal output come back as arrays (they
    came back as the caller's own numpy array and JAX's internal TypedInt / TypedFloat)."""
    prog = jaxq.trace(lambda x: (x, 3, 2.5), X)
    out = prog(X)
    assert all(isinstance(y, jax.Array) for y in out), [type(y) for y in out]
    assert out[1].dtype == jnp.int32 and float(out[2]) == 2.5


def test_untraceable_function_says_why_and_how_to_fix():
    def branchy(x):
        if x.sum() > 0:  # Python control flow on a traced value
            return x
        return -x

    with pytest.raises(jaxq.TraceError, match="lax.cond"):
        jaxq.trace(branchy, X)


def test_non_array_argument_suggests_partial():
    with pytest.raises(TypeError, match="functools.partial"):
        jaxq.trace(lambda x, mode: x, X, "fast")
    prog = jaxq.trace(functools.partial(lambda x, mode: x * 2, mode="fast"), X)
    np.testing.assert_array_equal(prog(X), X * 2)


def test_equations_are_recursive_and_named():
    def f(x):
        y = jax.jit(lambda u: jnp.sin(u) + 1.0)(x)
        return jax.lax.cond(y.sum() > 0, lambda u: u * 2, lambda u: u - 1, y)

    prog = jaxq.trace(f, X)
    names = [e.name for e in prog.equations()]
    assert names == [
        "jit",
        "jit/sin",
        "jit/add",
        "reduce_sum",
        "gt",
        "convert_element_type",
        "cond",
        "cond/branch0/sub",
        "cond/branch1/mul",
    ]
    rec = next(e for e in prog.equations() if e.name == "jit/sin")
    assert rec.primitive == "sin" and rec.path == (0, "jaxpr", 0)
    assert rec.in_layouts == (None,) and rec.out_layouts == (None,)
    assert len(prog) == len(names)
    assert prog.equation("cond/branch1/mul").primitive == "mul"
    with pytest.raises(KeyError, match="no equation named"):
        prog.equation("nope")


def test_str_shows_names_types_and_nested_bodies():
    prog = jaxq.trace(mlp, PARAMS, X)
    text = str(prog)
    assert text.startswith("program(")
    assert "# MLP/Dense_0/dot_general" in text
    assert "# MLP/Dense_1/tanh" in text
    assert "float32[2,4]" in text
    assert "<jaxq.Program" in repr(prog)


@given(programs())
def test_random_programs_trace_and_evaluate_like_the_function(rp):
    prog = jaxq.trace(rp.fun, *rp.args)
    got_all = jax.jit(prog.as_fun())(*rp.args)
    for got, want in zip(
        jax.tree.leaves(got_all), jax.tree.leaves(jax.jit(rp.fun)(*rp.args)), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_intermediates_returns_named_values_compiled():
    prog = jaxq.trace(mlp, PARAMS, X)
    got = jaxq.intermediates(prog, ["MLP/Dense_0/dot_general", "MLP/Dense_1/tanh"], PARAMS, X)
    h = X @ PARAMS[0][0]
    np.testing.assert_allclose(got["MLP/Dense_0/dot_general"], h, rtol=1e-6)
    np.testing.assert_allclose(got["MLP/Dense_1/tanh"], mlp(PARAMS, X)["out"], rtol=1e-6)
    with pytest.raises(KeyError, match="no equation named"):
        jaxq.intermediates(prog, ["MLP/nope"], PARAMS, X)
    one = jaxq.intermediates(prog, "MLP/Dense_1/tanh", PARAMS, X)  # (one name: not its letters)
    np.testing.assert_array_equal(one["MLP/Dense_1/tanh"], got["MLP/Dense_1/tanh"])
    nested = jaxq.trace(lambda x: jax.jit(jnp.sin)(x), X)
    with pytest.raises(ValueError, match="inside nested jaxprs"):
        jaxq.intermediates(nested, ["jit/sin"], X)
    printing = jaxq.trace(lambda x: (jax.debug.print("{}", x), x * 2)[1], X)
    with pytest.raises(ValueError, match=r"\['debug_print'\] have no result to tap"):
        jaxq.intermediates(printing, ["debug_print"], X)


def test_copying_a_program_gives_the_program():
    """``copy.deepcopy`` (a config dict holding a Program, say) failed on the jaxpr's
    tracebacks; a Program is immutable, so a copy is the program itself."""
    import copy

    prog = jaxq.trace(lambda x: jnp.sin(x) * 2.0, jnp.ones(3))
    box = copy.deepcopy({"program": prog})
    assert box["program"] is prog and copy.copy(prog) is prog


def test_a_program_keeps_the_values_of_numpy_arrays_it_closed_over():
    # (tracing keeps them by reference: changing the user's array must not change the program)
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    x = np.ones((2, 3), np.float32)
    prog = jaxq.trace(lambda x: x @ w + 1.0, x)
    want = np.asarray(prog(x))
    w[:] = 0.0
    np.testing.assert_array_equal(np.asarray(prog(x)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(prog.as_fun())(x)), want)
    _, consts = jaxq.split_constants(prog)
    assert not any(np.shares_memory(c, w) for c in consts)
