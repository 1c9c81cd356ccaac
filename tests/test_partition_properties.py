"""Properties on random programs with random support sets: partitioning keeps the numbers exactly,
the result is well-formed and acyclic, and every supported equation ends up in a region of a
compiler that supports it (the first in the list)."""

import collections

import hypothesis.strategies as st
import jax
import numpy as np
from hypothesis import given
from strategies import programs

import jaxq
from jaxq import partition as P
from jaxq._compat import check_jaxpr
from jaxq.partition._support import is_supported
from jaxq.transform import PassContext, Sequential, WellFormed

POOL = (
    "sin", "cos", "tanh", "abs", "neg", "mul", "add", "sub", "max", "min", "dot_general",
    "conv_general_dilated", "reshape", "transpose", "reduce_sum", "reduce_max",
    "broadcast_in_dim", "div", "scan", "cond", "while", "integer_pow", "exp", "gt",
)  # fmt: skip


@st.composite
def support_sets(draw):
    a = draw(st.sets(st.sampled_from(POOL)))
    b = draw(st.sets(st.sampled_from(POOL)))
    return sorted(a), sorted(b)


def _register(sets):
    for c in ("A", "B"):
        P.unregister_compiler(c)
    for c, prims in zip(("A", "B"), sets, strict=True):
        P.register_op_support(c, "__none__")  # a compiler may support nothing at all
        for p in prims:
            P.register_op_support(c, p)


def _exact(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@given(programs(max_ops=10), support_sets(), st.booleans())
def test_partitioning_random_programs(rp, sets, merge):
    _register(sets)
    try:
        prog = jaxq.trace(rp.fun, *rp.args)
        top = prog.jaxpr.jaxpr.eqns
        owner = [next((c for c in ("A", "B") if is_supported(c, e)), None) for e in top]
        passes = [P.annotate_target(["A", "B"])]
        if merge:
            passes.append(P.merge_compiler_regions())
        with PassContext(instruments=[WellFormed()]):  # after every pass, not only the last
            out = Sequential([*passes, P.partition_graph()])(prog)
        check_jaxpr(out.jaxpr.jaxpr)  # well-formed, so the regions were extracted without a cycle
        text = str(out.jaxpr)
        assert "compiler_begin" not in text and "compiler_end" not in text
        _exact(jax.jit(out.as_fun())(*rp.args), jax.jit(prog.as_fun())(*rp.args))

        # every supported equation is in a region of the first compiler supporting it; nothing
        # unsupported is
        want = collections.Counter(
            (c, e.primitive.name) for c, e in zip(owner, top, strict=True) if c
        )
        got = collections.Counter()
        regs = P.regions(out)
        for r in regs:
            for e in r.jaxpr.jaxpr.eqns:
                got[(r.compiler, e.primitive.name)] += 1
        assert got == want
        in_regions = {r.index for r in regs}
        left = [
            e.primitive.name
            for i, e in enumerate(out.jaxpr.jaxpr.eqns)
            if i not in in_regions and any(is_supported(c, e) for c in ("A", "B"))
        ]
        assert left == []
        if not merge:  # without merging, one region per supported equation
            assert len(regs) == sum(want.values())
        # the regions run on the host backend too, where it has numpy rules
        fn = P.build(out, backends={"A": "xla", "B": "xla"})
        _exact(fn(*rp.args), jax.jit(prog.as_fun())(*rp.args))
    finally:
        for c in ("A", "B"):
            P.unregister_compiler(c)


@given(programs(max_ops=8, ops=("unary", "binary", "dot", "transpose", "center")), st.data())
def test_placement_random_programs(rp, data):
    from jaxq.annotate import on_device

    devices = [data.draw(st.sampled_from(["cpu:0", "cpu:1", "cpu:2", "cpu:3"])) for _ in range(3)]

    def placed(*xs):
        out = rp.fun(*xs)
        leaves = jax.tree.leaves(out)
        return [on_device(v, devices[k % 3]) for k, v in enumerate(leaves)]

    prog = P.plan_devices()(jaxq.trace(placed, *rp.args))
    check_jaxpr(prog.jaxpr.jaxpr)
    got = P.build(prog)(*rp.args)
    want = jax.tree.leaves(jax.jit(rp.fun)(*rp.args))
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.devices() == {jax.devices("cpu")[int(devices[k % 3][-1])]}
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
