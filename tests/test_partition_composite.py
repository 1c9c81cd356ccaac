"""merge_composite: the pattern language, table order, overlaps, escapes, and composites given to
a compiler by name prefix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxq
from jaxq import partition as P
from jaxq.partition import is_constant, is_op, wildcard
from jaxq.transform import NumericCheck, PassContext, Sequential, WellFormed

X = np.random.default_rng(0).standard_normal((1, 6, 6, 2)).astype(np.float32)
K = (np.random.default_rng(1).standard_normal((3, 3, 2, 4)) * 0.3).astype(np.float32)
B = np.linspace(-1, 1, 4).astype(np.float32)


@pytest.fixture(autouse=True)
def _clean():
    yield
    P.unregister_compiler("dnnl")


def conv(x):
    return jax.lax.conv_general_dilated(
        x, K, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def conv_bias_relu_pattern():
    c = is_op("conv_general_dilated")(wildcard(), wildcard())
    bias = is_op("add")(c, is_op("broadcast_in_dim")(is_constant()))
    return bias.optional(lambda p: is_op("max")(p, is_constant()))


def composites(prog):
    return [
        (e.params["name"], [x.primitive.name for x in e.params["jaxpr"].jaxpr.eqns])
        for e in prog.jaxpr.jaxpr.eqns
        if e.primitive.name == "jit"
    ]


def run(f, patterns, *args):
    prog = jaxq.trace(f, *args)
    with PassContext(instruments=[WellFormed(), NumericCheck(*args, rtol=0, atol=0)]):
        return P.merge_composite(patterns)(prog)


def test_conv_bias_relu_with_optional_relu():
    #   x   K           x   K
    #    \ /             \ /
    #    conv  B         conv  B
    #      \  /            \  /
    #      add   0   -->   add     (no relu: the optional part is absent)
    #        \  /
    #        max
    def f(x):
        y = jnp.maximum(conv(x) + B, 0.0)
        z = conv(y[..., :2]) + B
        return z

    out = run(f, [("dnnl.conv_bias_relu", conv_bias_relu_pattern())], X)
    assert composites(out) == [
        ("dnnl.conv_bias_relu", ["conv_general_dilated", "broadcast_in_dim", "add", "max"]),
        ("dnnl.conv_bias_relu", ["conv_general_dilated", "broadcast_in_dim", "add"]),
    ]


def test_alternatives_and_table_order():
    act = is_op("tanh")(wildcard()) | is_op("logistic")(wildcard())

    def f(x):
        return jax.nn.sigmoid(jnp.tanh(x) * 2.0)

    out = run(f, [("A.act", act)], X)
    assert [n for n, _ in composites(out)] == ["A.act", "A.act"]
    # the first pattern claims the tanh; the second, larger one can no longer match
    scale = is_op("mul")(is_op("tanh")(wildcard()), is_constant())
    out = run(f, [("A.act", act), ("A.scale", scale)], X)
    assert [n for n, _ in composites(out)] == ["A.act", "A.act"]
    out = run(f, [("A.scale", scale), ("A.act", act)], X)
    assert [n for n, _ in composites(out)] == ["A.scale", "A.act"]


def test_overlapping_matches_the_latest_root_wins():
    #   a0 -> a1 -> a2 ; pattern add(add(*, *), *): roots tried from the end, so {a1, a2} match and
    #   a0 is left alone (it would overlap)
    pat = is_op("add")(is_op("add")(wildcard(), wildcard()), wildcard())

    def f(x, y):
        return ((x + y) + y) + y

    out = run(f, [("A.add2", pat)], X, X)
    assert composites(out) == [("A.add2", ["add", "add"])]
    assert [e.primitive.name for e in out.jaxpr.jaxpr.eqns] == ["add", "jit"]


def test_interior_value_used_outside_is_rejected():
    pat = is_op("add")(is_op("sin")(wildcard()), wildcard())

    def escapes(x):
        s = jnp.sin(x)
        return s + x, s

    def ok(x):
        return jnp.sin(x) + x

    assert composites(run(escapes, [("A.p", pat)], X)) == []
    assert composites(run(ok, [("A.p", pat)], X)) == [("A.p", ["sin", "add"])]


def test_diamond_requires_the_same_value():
    # TVM PR 5552: one pattern node used twice must match one value
    r = is_op("sin")(wildcard())
    pat = is_op("add")(r, r)

    def same(x):
        s = jnp.sin(x)
        return s + s

    def different(x, y):
        return jnp.sin(x) + jnp.sin(y)

    assert composites(run(same, [("A.d", pat)], X)) == [("A.d", ["sin", "add"])]
    assert composites(run(different, [("A.d", pat)], X, X)) == []


def test_check_and_params_restrict_matches():
    pat = is_op("add")(wildcard(), wildcard())

    def f(x, i):
        return x + x, i + i

    only_float = [("A.add", pat, lambda m: m.root.out_avals[0].dtype == jnp.float32)]
    out = run(f, only_float, X, np.ones(3, np.int32))
    assert len(composites(out)) == 1
    pat = is_op("reduce_sum", axes=(1,))(wildcard())
    out = run(lambda x: (x.sum(axis=1), x.sum(axis=2)), [("A.sum1", pat)], X)
    assert len(composites(out)) == 1


def test_composite_is_assigned_by_name_prefix_and_reaches_the_codegen():
    P.register_op_support("dnnl", "tanh")

    def f(x):
        return jnp.tanh(jnp.maximum(conv(x) + B, 0.0)) - 1.0

    prog = jaxq.trace(f, X)
    out = Sequential(
        [
            P.merge_composite([("dnnl.conv_bias_relu", conv_bias_relu_pattern())]),
            P.annotate_target(["dnnl"]),
            P.merge_compiler_regions(),
            P.partition_graph(),
        ]
    )(prog)
    (r,) = P.regions(out)
    assert (r.compiler, r.primitives) == ("dnnl", ("dnnl.conv_bias_relu", "tanh"))
    assert r.num_inputs == 1 and len(r.jaxpr.consts) == 2  # K and B bound into the region
    seen = []

    def dnnl_codegen(region):  # a stand-in external codegen: sees the composite, runs with XLA
        seen.extend(e.params.get("name") for e in region.jaxpr.jaxpr.eqns)
        return jax.jit(region.as_fun())

    P.register_backend("dnnl", dnnl_codegen)
    try:
        got = P.build(out)(X)
    finally:
        P.unregister_backend("dnnl")
    assert seen == ["dnnl.conv_bias_relu", None]
    np.testing.assert_allclose(got, f(X), rtol=1e-5, atol=1e-6)


def test_bad_pattern_tables():
    with pytest.raises(TypeError, match="rooted at an operation"):
        P.merge_composite([("A.w", wildcard())])
    with pytest.raises(TypeError, match=r"\(name, pattern\)"):
        P.merge_composite([is_op("add")()])
    with pytest.raises(TypeError, match="expected a pattern"):
        is_op("add")(1.0)


def test_is_constant_sees_a_broadcast_bias():
    """``conv(x) + b`` adds ``b`` broadcast: ``is_constant()`` matches it as the docstring's
    pattern writes it, and the broadcast stays outside the composite."""
    pat = is_op("add")(is_op("conv_general_dilated")(wildcard(), wildcard()), is_constant())
    out = run(lambda x: conv(x) + B, [("dnnl.conv_bias", pat)], X)
    assert composites(out) == [("dnnl.conv_bias", ["conv_general_dilated", "add"])]
    not_constant = run(lambda x: conv(x) + x[..., :1], [("dnnl.conv_bias", pat)], X)
    assert composites(not_constant) == []
