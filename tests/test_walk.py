"""The shared walker: identity rewrites are exact, inputs are never mutated, results are well-formed,
and rules see every equation, nested ones included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from strategies import programs

import jaxq
from jaxq import transform as T
from jaxq._compat import check_jaxpr
from jaxq._walk import RewriteError


def _snapshot(prog):
    """Everything a mutation could touch: the printed jaxpr and the identity of every equation."""
    return (
        str(prog.jaxpr),
        [id(e.eqn) for e in prog.equations()],
        [id(c) for c in prog.jaxpr.consts],
    )


def _same_outputs(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@given(programs())
def test_identity_rewrite_is_exact_well_formed_and_does_not_mutate(rp):
    prog = jaxq.trace(rp.fun, *rp.args)
    before = _snapshot(prog)
    out = T.identity()(prog)
    assert _snapshot(prog) == before
    check_jaxpr(out.jaxpr.jaxpr)
    _same_outputs(jax.jit(out.as_fun())(*rp.args), jax.jit(prog.as_fun())(*rp.args))
    assert [e.primitive for e in out.equations()] == [e.primitive for e in prog.equations()]


@given(programs())
def test_every_builtin_pass_keeps_programs_well_formed_and_exact(rp):
    prog = jaxq.trace(rp.fun, *rp.args)
    before = _snapshot(prog)
    pipeline = T.Sequential([T.name_expressions(), T.infer_layouts(), T.identity()])
    with T.PassContext(instruments=[T.WellFormed(), T.NumericCheck(*rp.args, rtol=0, atol=0)]):
        out = pipeline(prog)
    assert _snapshot(prog) == before
    assert [e.name for e in out.equations()] == [e.name for e in prog.equations()]


def test_rules_see_nested_equations_and_can_replace_them():
    def f(x):
        y = jax.jit(lambda u: jnp.sin(u))(x)
        y = jax.lax.scan(lambda c, r: (c, jnp.sin(r)), 0.0, y)[1]
        return jax.lax.cond(True, jnp.sin, jnp.cos, y)

    prog = jaxq.trace(f, np.ones((2, 3), np.float32))
    seen = []

    def sin_to_cos(visit, x):
        seen.append(visit.name)
        return jnp.cos(x)

    out = jaxq.transform.rewrite(prog, {"sin": sin_to_cos})
    assert seen == ["jit/sin", "scan/sin", "cond/branch1/sin"]
    assert "sin" not in [e.primitive for e in out.equations()]
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(out(x), jnp.cos(jnp.cos(jnp.cos(x))), rtol=1e-6)


def test_rules_can_rebind_with_new_params_and_keep_names():
    def f(x):
        with jax.named_scope("Block"):
            return jnp.sum(x, axis=0)

    x = np.arange(9, dtype=np.float32).reshape(3, 3)
    prog = T.name_expressions()(jaxq.trace(f, x))
    out = jaxq.transform.rewrite(prog, {"reduce_sum": lambda v, x: v.bind(x, axes=(1,))})
    np.testing.assert_array_equal(out(x), x.sum(1))
    assert [e.name for e in out.equations()] == ["Block/reduce_sum"]
    assert out.equation("Block/reduce_sum").params["axes"] == (1,)


def test_rule_error_names_the_equation():
    prog = jaxq.trace(lambda x: jnp.exp(x) + 1, np.ones(3, np.float32))

    def broken(visit, x):
        raise ValueError("boom")

    with pytest.raises(
        T.RewriteError, match=r"rule for exp failed at equation 'exp': ValueError: boom"
    ):
        jaxq.transform.rewrite(prog, {"exp": broken})


def test_remat_body_that_gains_constants_is_rebuilt():
    prog = jaxq.trace(lambda x: jax.checkpoint(lambda u: jnp.sin(u) * 2)(x), np.ones(3, np.float32))
    table = np.arange(3, dtype=np.float32)
    out = jaxq.transform.rewrite(prog, {"sin": lambda v, x: jnp.sin(x) + table})
    x = np.ones(3, np.float32)
    np.testing.assert_allclose(out(x), (np.sin(x) + table) * 2, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda u: out(u).sum())(x), 2 * np.cos(x), rtol=1e-6)


def test_map_equations_rebuilds_structurally_without_retracing():
    prog = jaxq.trace(lambda x: jax.jit(lambda u: u * 2 + 1)(x), np.ones(3, np.float32))
    seen = []
    out = jaxq.transform.map_equations(prog, lambda eqn, path, name: seen.append((path, name)))
    assert seen == [((0, "jaxpr", 0), "jit/mul"), ((0, "jaxpr", 1), "jit/add"), ((0,), "jit")]
    check_jaxpr(out.jaxpr.jaxpr)
    np.testing.assert_array_equal(out(np.ones(3, np.float32)), np.full(3, 3, np.float32))


@pytest.mark.parametrize(
    "f",
    [
        lambda x: jnp.linalg.solve(x @ x.T + 3 * jnp.eye(3), x[:, 0]),  # custom_linear_solve
        lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1,
        lambda x: jax.grad(lambda u: jnp.sum(jax.nn.gelu(u) * jnp.sort(u, axis=0)))(x),
        lambda x: jax.vmap(lambda r: jax.lax.fori_loop(0, 2, lambda i, c: c + r, r))(x),
        lambda x: x + jax.random.normal(jax.random.key(0), x.shape),
        lambda x: (jax.lax.linalg.qr(x)[0], jnp.cumsum(x, 0), jax.nn.softmax(x)),
    ],
    ids=["linear_solve", "pure_callback", "grad", "vmap_fori", "prng", "linalg"],
)
def test_walker_handles_library_constructs(f):
    x = np.arange(9, dtype=np.float32).reshape(3, 3) / 10 + 1
    prog = jaxq.trace(f, x)
    pipeline = T.Sequential([T.identity(), T.name_expressions(), T.infer_layouts()])
    with T.PassContext(instruments=[T.WellFormed(), T.NumericCheck(x, rtol=0, atol=0)]):
        out = pipeline(prog)
    assert [e.primitive for e in out.equations()] == [e.primitive for e in prog.equations()]


def test_interpret_evaluates_through_rules_inside_jit_and_visit_inline_flattens_calls():
    prog = jaxq.trace(lambda x: jax.jit(lambda u: jnp.sin(u) * 2)(x) + 1, np.ones(3, np.float32))
    seen = []

    def record(visit, x):
        seen.append(visit.name)
        return jnp.cos(x)

    rules = {"sin": record, "jit": lambda visit, x: visit.inline(x)}
    out = jax.jit(lambda x: T.interpret(prog, rules, x)[0])(np.zeros(3, np.float32))
    np.testing.assert_allclose(out, np.full(3, 3.0))  # cos(0) * 2 + 1
    assert seen == ["jit/sin"]
    inlined = T.rewrite(prog, {"jit": lambda visit, x: visit.inline(x)})
    assert [e.primitive for e in inlined.equations()] == ["sin", "mul", "add"]
    with pytest.raises(T.RewriteError, match="not a call equation"):
        T.rewrite(prog, {"add": lambda visit, x, y: visit.inline(x, y)})


def test_a_rule_that_changes_an_equations_type_is_an_error():
    prog = jaxq.trace(lambda x: jnp.sum(x, axis=0) + 1.0, np.ones((2, 3), np.float32))
    with pytest.raises(RewriteError, match=r"returned float32\[2\].*produces (f32|float32)\[3\]"):
        jaxq.transform.rewrite(prog, {"reduce_sum": lambda v, x: v.bind(x, axes=(1,))})
    with pytest.raises(RewriteError, match=r"returned int32\[3\]"):
        jaxq.transform.rewrite(prog, {"reduce_sum": lambda v, x: v.bind(x).astype(jnp.int32)})
    with pytest.raises(RewriteError, match=r"returned a list; reduce_sum has one output"):
        jaxq.transform.rewrite(prog, {"reduce_sum": lambda v, x: [v.bind(x)]})
    with pytest.raises(RewriteError, match=r"reduce_sum at 'reduce_sum' returned None.*return"):
        jaxq.transform.rewrite(prog, {"reduce_sum": lambda v, x: None})
