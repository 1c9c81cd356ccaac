"""name_expressions and infer_layouts: expected names and layouts on small known graphs."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from jax import lax
from strategies import programs

import jaxq
from jaxq import transform as T


def cnn(params, x):
    with jax.named_scope("CNN"):
        for i, (k, b) in enumerate(params):
            with jax.named_scope(f"Conv_{i}"):
                x = lax.conv_general_dilated(
                    x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
                x = jax.nn.relu(x + b)
        with jax.named_scope("Dense_0"):
            x = x.mean(axis=(1, 2))
            x = x @ np.ones((x.shape[-1], 3), np.float32) + 1.0
            x = x + 2.0
    return x


P = [
    (np.ones((3, 3, 1, 4), np.float32) * 0.1, np.zeros(4, np.float32)),
    (np.ones((3, 3, 4, 2), np.float32) * 0.1, np.zeros(2, np.float32)),
]
X = np.ones((2, 5, 5, 1), np.float32)


def test_names_follow_scopes_with_suffixes_only_where_needed():
    names = [e.name for e in jaxq.trace(cnn, P, X).equations()]
    assert "CNN/Conv_0/conv_general_dilated" in names
    assert "CNN/Conv_1/conv_general_dilated" in names
    assert "CNN/Dense_0/dot_general" in names
    assert "CNN/Dense_0/add" in names and "CNN/Dense_0/add_1" in names
    assert "CNN/Dense_0/add_2" not in names or names.count("CNN/Dense_0/add_2") == 1
    assert len(names) == len(set(names))


@given(programs())
def test_names_are_unique_and_deterministic(rp):
    a = [e.name for e in jaxq.trace(rp.fun, *rp.args).equations()]
    b = [e.name for e in jaxq.trace(rp.fun, *rp.args).equations()]
    assert a == b
    assert len(a) == len(set(a))
    named = T.name_expressions()(jaxq.trace(rp.fun, *rp.args))
    assert [e.name for e in named.equations()] == a
    assert [e.name for e in T.name_expressions()(named).equations()] == a  # idempotent


def test_baked_names_survive_rewrites_that_insert_equations():
    f = lambda x: (x + 1.0) + 2.0
    prog = jaxq.trace(f, np.ones(3, np.float32))
    assert [e.name for e in prog.equations()] == ["add", "add_1"]
    insert = lambda p: T.rewrite(p, {"add": lambda v, x, y: v.bind(x * 1.0 + 0.0, y)})
    once = [e.name for e in insert(prog).equations()]
    # unbaked names are positional: the second add's helpers are numbered after the first's
    assert once == [
        "add/rewrite/mul",
        "add/rewrite/add",
        "add",
        "add/rewrite/mul_1",
        "add/rewrite/add_1",
        "add_1",
    ]
    # baked names are exactly stable, however often equations are inserted around them
    baked = insert(insert(T.name_expressions()(prog)))
    named = {e.name: e.primitive for e in baked.equations()}
    assert named["add"] == "add" and named["add_1"] == "add"
    assert "add_1/rewrite/add" in named and "add_1/rewrite/mul" in named
    assert len(named) == 2 + 2 * 2 + 2 * 2 * 2


def test_names_reach_xla_op_metadata():
    prog = T.name_expressions()(jaxq.trace(cnn, P, X))
    hlo = jax.jit(prog.as_fun()).lower(P, X).as_text(debug_info=True)
    assert "CNN/Dense_0/add_1" in hlo
    assert "CNN/Conv_1/conv_general_dilated" in hlo


def _layouts_by_name(prog):
    return {e.name: (e.in_layouts, e.out_layouts) for e in T.infer_layouts()(prog).equations()}


def test_conv_layouts_nhwc_hwio_and_bias_and_dense():
    lay = _layouts_by_name(jaxq.trace(cnn, P, X))
    assert lay["CNN/Conv_0/conv_general_dilated"] == (("NHWC", "HWIO"), ("NHWC",))
    # the bias is broadcast along the channel axis: its layout comes backwards from the add
    assert lay["CNN/Conv_0/broadcast_in_dim"][0] == ("C",)
    assert lay["CNN/Conv_0/add"] == (("NHWC", "NHWC"), ("NHWC",))
    assert lay["CNN/Dense_0/reduce_sum"] == (("NHWC",), ("NC",))
    assert lay["CNN/Dense_0/dot_general"] == (("NC", "IO"), ("NO",))


def test_conv_layouts_nchw_oihw_and_weight_through_transpose():
    def f(x, k, w):
        y = lax.conv_general_dilated(
            x, k, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        return y.reshape(y.shape[0], -1) @ w.T

    x, k, w = (
        np.ones((1, 2, 4, 4), np.float32),
        np.ones((3, 2, 3, 3), np.float32),
        np.ones((5, 12), np.float32),
    )
    prog = T.infer_layouts()(jaxq.trace(f, x, k, w))
    invars = prog.jaxpr.jaxpr.invars
    assert [prog.layouts.get(v) for v in invars] == ["NCHW", "OIHW", "OI"]
    reshape = next(e for e in prog.equations() if e.primitive == "reshape")
    assert reshape.out_layouts == ("NC",)  # from the dot, not from merging C, H and W
    assert reshape.in_layouts == ("NCHW",)


def test_layouts_flow_into_nested_calls_and_survive_rewrites():
    def f(x, w):
        return jax.jit(lambda a, b: jnp.tanh(a @ b))(x, w)

    prog = T.infer_layouts()(
        jaxq.trace(f, np.ones((2, 3), np.float32), np.ones((3, 4), np.float32))
    )
    assert [prog.layouts.get(v) for v in prog.jaxpr.jaxpr.invars] == ["NC", "IO"]
    tanh = prog.equation("jit/tanh")
    assert tanh.in_layouts == ("NO",)
    again = T.identity()(prog)  # layouts are recomputed for the new jaxpr
    assert again.equation("jit/tanh").out_layouts == ("NO",)


def test_layouts_flow_through_scan_while_and_cond_bodies():
    """Each construct links its operands to its body's inputs by its own convention (a scan's
    constants and carry, a while's body constants after the condition's, a cond's operands after
    the index): a matmul's layouts in the body must reach the right outer value."""
    n = np.ones((2, 3), np.float32)
    w = np.ones((3, 3), np.float32)

    def scan(x, w, xs):
        return lax.scan(lambda c, xi: (jnp.tanh(c @ w), xi), x, xs)[0]

    def while_(limit, x, w):
        return lax.while_loop(lambda s: s[0] < limit, lambda s: (s[0] + 1, s[1] @ w), (0, x))[1]

    def cond(p, x, w):
        return lax.cond(p, lambda a, b: a @ b, lambda a, b: jnp.tanh(a @ b), x, w)

    cases = [
        (scan, (n, w, np.ones((4, 5), np.float32)), ["NC", "IO", None]),
        (while_, (3, n, w), [None, "NC", "IO"]),
        (cond, (True, n, w), [None, "NC", "IO"]),
    ]
    for f, args, want in cases:
        prog = T.infer_layouts()(jaxq.trace(f, *args))
        got = [prog.layouts.get(v) for v in prog.jaxpr.jaxpr.invars]
        assert got == want, f.__name__
