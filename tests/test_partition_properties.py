"""Properties on random programs with random support sets: partitioning keeps the numbers exactly,
the result is well-formed and acyclic, and every supported equation ends up in a region of a
compiler that supports it (the first in the list)."""

import collections

import hypothesis.strategies as st
import jax
import numpy as np
from hypothesis import example, given
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


UNARY = {"sin": jax.numpy.sin, "tanh": jax.numpy.tanh, "cos": jax.numpy.cos}
BINARY = {"add": jax.numpy.add, "mul": jax.numpy.multiply}


@st.composite
def dags(draw):
    """A random DAG of elementwise ops: ``(op, operand, operand or None)`` per value, reading
    earlier values (value 0 is the input)."""
    plan = []
    for i in range(draw(st.integers(4, 30))):
        op = draw(st.sampled_from(sorted(UNARY) + sorted(BINARY)))
        b = draw(st.integers(0, i)) if op in BINARY else None
        plan.append((op, draw(st.integers(0, i)), b))
    return plan


# (merged, regions 12 and 22 of compiler "ca" formed a cycle with a merged region of "cb":
# "cb"'s group took a new parent after its descendants had taken their restriction sets)
_CYCLE = [
    ("tanh", 0, None), ("sin", 1, None), ("mul", 2, 1), ("mul", 3, 0), ("tanh", 4, None),
    ("cos", 2, None), ("mul", 2, 4), ("add", 4, 5), ("sin", 7, None), ("sin", 0, None),
    ("cos", 2, None), ("mul", 6, 10), ("mul", 12, 8), ("add", 4, 1), ("cos", 2, None),
    ("sin", 3, None), ("mul", 1, 10), ("cos", 13, None), ("add", 10, 7), ("mul", 9, 1),
    ("mul", 10, 12), ("mul", 2, 5),
]  # fmt: skip


@given(dags())
@example(_CYCLE)
def test_merging_regions_of_random_dags_never_makes_a_cycle(plan):
    def f(x):
        v = [x]
        for op, a, b in plan:
            v.append(UNARY[op](v[a]) if b is None else BINARY[op](v[a], v[b]))
        return v[len(v) // 2], v[-1]

    _register((["sin", "add"], ["tanh", "mul"]))  # (cos: neither)
    try:
        x = np.linspace(-0.9, 0.8, 5, dtype=np.float32)
        prog = jaxq.trace(f, x)
        passes = [P.annotate_target(["A", "B"]), P.merge_compiler_regions(), P.partition_graph()]
        out = Sequential(passes)(prog)
        check_jaxpr(out.jaxpr.jaxpr)
        _exact(out.as_fun()(x), prog.as_fun()(x))
    finally:
        for c in ("A", "B"):
            P.unregister_compiler(c)
