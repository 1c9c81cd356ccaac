"""BYOC partitioning: TVM's AnnotateTarget / MergeCompilerRegions / PartitionGraph tests re-created on
jaxprs (graphs drawn in ASCII; O = supported, X = not supported), plus bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxq
from jaxq import partition as P
from jaxq import transform as T
from jaxq._compat import check_jaxpr
from jaxq.annotate import compiler_begin, compiler_end
from jaxq.transform import NumericCheck, PassContext, Sequential, WellFormed


@pytest.fixture(autouse=True)
def _compilers():
    yield
    for c in ("A", "B", "test"):
        P.unregister_compiler(c)


def support(compiler, *prims):
    for p in prims:
        P.register_op_support(compiler, p)


def pipeline(*compilers, **kw):
    return Sequential(
        [P.annotate_target(list(compilers)), P.merge_compiler_regions(), P.partition_graph(**kw)]
    )


def partition(f, args, *compilers, **kw):
    prog = jaxq.trace(f, *args)
    with PassContext(instruments=[WellFormed(), NumericCheck(*args, rtol=0, atol=0)]):
        out = pipeline(*compilers, **kw)(prog)
    check_jaxpr(out.jaxpr.jaxpr)
    return out


def summary(prog):
    return [(r.compiler, r.primitives, r.num_inputs, r.num_outputs) for r in P.regions(prog)]


def ones(*shape, n=1):
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal(shape).astype(np.float32) for _ in range(n))


def test_diamond_graph_with_fanouts():
    #        O1                 O1
    #       /  \               /            \
    #      O2   X     -->     O2      +      X
    #       \  /                \           /
    #        O3                  O3
    # O1 -> X -> O3 leaves the compiler, so O3 may not join {O1, O2}: two regions, the first with
    # two results (O2 for O3, O1 for X).
    support("test", "sin", "cos", "add")

    def f(data):
        o1 = jnp.sin(data)
        o2 = jnp.cos(o1)
        x = jnp.tanh(o1)
        return o2 + x

    out = partition(f, ones(10, 10), "test")
    assert summary(out) == [("test", ("sin", "cos"), 1, 2), ("test", ("add",), 2, 1)]
    assert [r.name for r in P.regions(out)] == ["test_f_0", "test_f_1"]


def test_rfc_example_graph_refuses_the_merge_that_would_make_a_cycle():
    # The example of the BYOC RFC ("improved graph partitioning algorithm"); + is supported, - not.
    #
    #  in1 in2  in3 in4        in5 in6
    #    \ /      \ /            \ /
    #    n0+      n1+  in7        n3-
    #       \    /       \       /
    #        n2+          n4-  -
    #          \          /
    #           n5+ ------         in8
    #          /    \             /
    #  in9   n7+     ----------  n6-
    #     \  /                  /
    #      (n7)                /
    #         \               /
    #          n8+ -----------      in10
    #            \                 /
    #             n9+ ------------
    #
    # n8 cannot join {n0, n1, n2, n5, n7}: n5 -> n6 (-) -> n8 would leave the region and come back.
    support("test", "add")

    def f(i1, i2, i3, i4, i5, i6, i7, i8, i9, i10):
        n0 = i1 + i2
        n1 = i3 + i4
        n2 = n0 + n1
        n3 = i5 - i6
        n4 = i7 - n3
        n5 = n2 + n4
        n6 = i8 - n5
        n7 = i9 + n5
        n8 = n6 + n7
        return i10 + n8

    out = partition(f, ones(10, 10, n=10), "test")
    assert summary(out) == [("test", ("add",) * 5, 6, 2), ("test", ("add",) * 2, 3, 1)]
    assert [e.primitive for e in out.equations() if e.path[:1] == e.path] == [
        "sub",
        "sub",
        "jit",
        "sub",
        "jit",
    ]


def test_siblings_that_share_only_inputs_stay_apart():
    #        x
    #      /   \
    #     O1   O2        two regions: nothing but the input is shared
    #      \   /
    #        X
    support("A", "sin", "cos")

    def f(x):
        return jnp.sin(x) - jnp.cos(x)

    out = partition(f, ones(4), "A")
    assert summary(out) == [("A", ("sin",), 1, 1), ("A", ("cos",), 1, 1)]


def test_shared_input_is_one_parameter():
    #   x ---> O1 ---> O2          one region, one parameter for x used by both
    #    \____________/
    support("A", "sin", "mul")

    def f(x):
        return jnp.sin(x) * x

    out = partition(f, ones(4), "A")
    assert summary(out) == [("A", ("sin", "mul"), 1, 1)]


def test_multiple_outputs_of_one_region():
    #        x
    #        |
    #        O1 (sin)
    #       /  \
    #   O2 cos  X tanh -> out2      one region {sin, cos}, results cos (out1) and sin (for tanh)
    support("A", "sin", "cos")

    def f(x):
        s = jnp.sin(x)
        return jnp.cos(s), jnp.tanh(s)

    out = partition(f, ones(3, 3), "A")
    assert summary(out) == [("A", ("sin", "cos"), 1, 2)]
    np.testing.assert_array_equal(out(*ones(3, 3))[0], jnp.cos(jnp.sin(ones(3, 3)[0])))


def test_tuple_outputs_of_one_equation():
    # sort of two operands is one equation with a tuple of results; both leave the region
    support("A", "sort", "add")

    def f(x, y):
        a, b = jax.lax.sort((x, y), num_keys=1)
        return a + b, b

    out = partition(f, ones(8, n=2), "A")
    assert summary(out) == [("A", ("sort", "add"), 2, 2)]


def test_constants_are_bound_into_the_region_by_default():
    # TVM PR 5409: constants must not be passed between partitions.
    support("A", "dot_general", "add", "broadcast_in_dim")
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = np.arange(3, dtype=np.float32)

    def f(x):
        return x @ w + b

    bound = partition(f, ones(2, 4), "A")
    (r,) = P.regions(bound)
    assert (r.num_inputs, len(r.jaxpr.consts)) == (1, 2)
    passed = partition(f, ones(2, 4), "A", bind_constants=False)
    (r,) = P.regions(passed)
    assert (r.num_inputs, len(r.jaxpr.consts)) == (3, 0)
    np.testing.assert_array_equal(bound(*ones(2, 4)), passed(*ones(2, 4)))


def test_two_compilers_first_in_list_wins():
    #   sin(A) -> cos(B) -> sin(A)      three regions; both compilers support sin, the first wins
    support("A", "sin")
    support("B", "cos", "sin")

    def f(x):
        return jnp.sin(jnp.cos(jnp.sin(x)))

    out = partition(f, ones(3), "A", "B")
    assert [(c, p) for c, p, _, _ in summary(out)] == [
        ("A", ("sin",)),
        ("B", ("cos",)),
        ("A", ("sin",)),
    ]
    out = partition(f, ones(3), "B", "A")
    assert [(c, p) for c, p, _, _ in summary(out)] == [("B", ("sin", "cos", "sin"))]


def test_annotate_target_is_rerunnable():
    support("A", "sin", "add")
    support("B", "cos", "add")

    def f(x, y):
        return jnp.cos(jnp.sin(x) + y) + jnp.cos(y)

    prog = jaxq.trace(f, *ones(3, n=2))
    once = P.annotate_target(["A", "B"])(prog)
    twice = P.annotate_target(["B"])(P.annotate_target(["A"])(prog))
    assert str(once.jaxpr) == str(twice.jaxpr)
    assert str(P.annotate_target(["A", "B"])(once).jaxpr) == str(once.jaxpr)  # idempotent
    assert "compiler=A" in str(once.jaxpr) and "compiler=B" in str(once.jaxpr)


def test_the_whole_pipeline_is_rerunnable():
    """A partitioned program through the pipeline again is unchanged: an extracted region is
    not wrapped in a new one (it was, as a supported nested call)."""
    support("A", "sin", "add")

    def f(x, y):
        return jnp.cos(jnp.sin(x) + y)

    once = partition(f, ones(3, n=2), "A")
    twice = pipeline("A")(once)
    assert summary(twice) == summary(once) == [("A", ("sin", "add"), 2, 1)]
    assert str(twice.jaxpr) == str(once.jaxpr)


def test_equations_keep_their_names_through_regions_and_placement():
    """A region or device segment only groups equations: Dense_0/add became
    Dense_0/dot_general/jit/Dense_0/add (the call took its first equation's name)."""
    support("A", "dot_general", "add", "tanh")
    w, x = ones(3, 4)[0], ones(2, 3)[0]

    def f(w, x):
        with jax.named_scope("Dense_0"):
            h = jnp.tanh(x @ w + 1.0)
        return jnp.cumsum(h, 1)

    prog = T.name_expressions()(jaxq.trace(f, w, x))
    before = [e.name for e in prog.equations()]
    assert before == ["Dense_0/dot_general", "Dense_0/add", "Dense_0/tanh", "jit", "jit/cumsum"]
    parts = pipeline("A")(prog)
    assert [e.name for e in parts.equations()] == ["A_f_0", *before]
    assert parts.equation("Dense_0/add").path == (0, "jaxpr", 1)
    placed = P.plan_devices(default="cpu:0")(parts)
    assert [e.name for e in placed.equations()] == ["f_cpu_0_0", "A_f_0", *before]
    assert [e.name for e in T.name_expressions()(placed).equations()] == [
        "f_cpu_0_0",
        "A_f_0",
        *before,
    ]


def test_region_is_a_named_function_in_stablehlo_and_annotations_are_gone():
    support("A", "sin", "cos")

    def f(x):
        return jnp.cos(jnp.sin(x)) * 2.0

    out = partition(f, ones(3), "A")
    text = str(out.jaxpr)
    assert "compiler_begin" not in text and "compiler_end" not in text
    hlo = jax.jit(out.as_fun()).lower(*ones(3)).as_text()
    assert "@A_f_0" in hlo


def test_predicate_sees_dtype_and_shape():
    @P.register_op_support("A", "add")
    def big_f32(rec):
        return rec.in_avals[0].dtype == jnp.float32 and rec.out_avals[0].size >= 4

    def f(x, i):
        return x + x, i + i, x[:2] + x[:2]

    out = partition(f, (ones(4)[0], np.arange(4, dtype=np.int32)), "A")
    assert summary(out) == [("A", ("add",), 1, 1)]


def test_predicates_see_stable_names_paths_and_layouts():
    """An op-support predicate and a composite pattern's ``where`` get the equation as
    ``Program.equations()`` shows it (they got the primitive name, no path and no layouts)."""
    seen = []

    @P.register_op_support("A", "dot_general")
    def second_layer(rec):
        seen.append((rec.name, rec.path, rec.in_layouts))
        return rec.name.startswith("Dense_1/")

    def f(x, w):
        with jax.named_scope("Dense_0"):
            x = jnp.tanh(x @ w)
        with jax.named_scope("Dense_1"):
            return jax.jit(lambda a: a @ w)(x)  # (nested: its path goes through the jit)

    w = np.ones((3, 3), np.float32)
    prog = T.infer_layouts()(jaxq.trace(f, np.ones((2, 3), np.float32), w))
    out = P.partition_graph()(P.annotate_target(["A"])(prog))
    names = [n for n, _, _ in seen]
    assert names == ["Dense_0/dot_general", "Dense_1/jit/dot_general"], seen
    assert seen[0][1:] == ((0,), ("NC", "IO")) and seen[1][1][1:] == ("jaxpr", 0)
    assert [r.primitives for r in P.regions(out)] == [("jit",)]
    picked = []
    pattern = P.is_op("tanh", where=lambda e: picked.append(e.name) or True)(P.wildcard())
    P.merge_composite([("A.act", pattern)])(prog)
    assert picked == ["Dense_0/tanh"]


def test_nested_call_is_supported_only_when_everything_inside_is():
    support("A", "sin", "mul")

    def f(x):
        y = jax.jit(lambda u: jnp.sin(u) * u)(x)  # all supported -> one unit in the region
        return jax.jit(lambda u: jnp.cos(u) * u)(y)  # cos is not -> stays out

    out = partition(f, ones(3), "A")
    assert summary(out) == [("A", ("jit",), 1, 1)]


def test_manual_annotations_make_one_region():
    def f(x, y):
        a, b = compiler_begin(x, "A"), compiler_begin(y, "A")
        return compiler_end(jnp.sin(a) * b + 1.0, "A")

    support("A")
    prog = jaxq.trace(f, *ones(3, n=2))
    out = P.partition_graph()(prog)
    assert summary(out) == [("A", ("sin", "mul", "add"), 2, 1)]


def test_merge_across_control_flow_is_refused():
    # TVM's if-else test (PR 15211): the cond is one unit the compiler does not support.
    #
    #   data -> add0 (O) -> sub0 (X) ----.
    #             |  \                     v
    #             |   `---------------> cond (X) -> erf (O) -> add (O) -> out
    #             `---------------------------------------------^
    #
    # add0 reaches the final add through sub0 and cond, so they must stay apart.
    support("A", "add", "erf", "logistic")

    def f(data):
        add0 = data + data
        sub0 = add0 - data
        eq = jnp.sum(add0) == jnp.sum(sub0)
        ife = jax.lax.cond(eq, jax.nn.sigmoid, jax.nn.sigmoid, jnp.where(eq, add0, sub0))
        return add0 + jax.scipy.special.erf(ife)

    out = partition(f, ones(1, 32), "A")
    assert summary(out) == [("A", ("add",), 1, 1), ("A", ("erf", "add"), 2, 1)]


def test_default_target_never_reaches_codegen():
    # TVM PR 5195: unsupported equations are not a region of some "default" compiler
    support("A", "sin")

    def f(x):
        return jnp.cos(jnp.sin(x)) + 1.0

    out = partition(f, ones(3), "A")
    assert [r.compiler for r in P.regions(out)] == ["A"]
    assert [e.primitive.name for e in out.jaxpr.jaxpr.eqns] == ["jit", "cos", "add"]


def test_merge_is_idempotent_and_annotate_alone_gives_one_region_per_equation():
    support("test", "add")

    def f(a, b, c, d):
        n0 = a + b
        n1 = n0 - c
        return (n0 + d) + n1

    prog = P.annotate_target(["test"])(jaxq.trace(f, *ones(3, n=4)))
    once = P.merge_compiler_regions()(prog)
    assert str(P.merge_compiler_regions()(once).jaxpr) == str(once.jaxpr)
    assert len(P.regions(P.partition_graph()(prog))) == 3
    assert summary(P.partition_graph()(once)) == [
        ("test", ("add", "add"), 3, 2),
        ("test", ("add",), 2, 1),
    ]


def test_control_flow_needs_registration_and_full_support():
    def f(x):
        body = lambda c: (c[0] + 1, jnp.sin(c[1]) * 2.0)  # noqa: E731
        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    support("A", "sin", "mul")
    prog = jaxq.trace(f, *ones(3))
    assert P.regions(pipeline("A")(prog)) == []  # while is not registered
    support("A", "while", "add", "lt")
    assert [r.primitives for r in P.regions(pipeline("A")(prog))] == [("while",)]
    P.unregister_compiler("A")
    support("A", "while", "add", "lt", "sin")  # mul missing inside the body
    assert P.regions(pipeline("A")(prog)) == []


# -- bad input ---------------------------------------------------------------------------------------


def test_a_misspelled_primitive_is_warned_about():
    """register_op_support('A', 'dot_genral') and rewrite(p, {'tanhh': ...}) matched nothing,
    silently; a name of a primitive of one's own, far from JAX's, stays quiet."""
    with pytest.warns(
        UserWarning, match=r"no primitive is named 'dot_genral'; did you mean 'dot_general'"
    ):
        support("A", "dot_genral")
    prog = jaxq.trace(jnp.tanh, np.ones(3, np.float32))
    with pytest.warns(UserWarning, match=r"rewrite: .* 'tanhh'; did you mean 'tanh'"):
        T.rewrite(prog, {"tanhh": lambda visit, x: x})
    support("A", "my_fused_kernel")  # (filterwarnings=error: no warning)


def test_an_annotation_cannot_be_registered_as_supported():
    """Registering simulated_quantize was accepted and never had an effect: annotations stay
    between regions."""
    with pytest.raises(ValueError, match="'simulated_quantize' is a jaxq annotation"):
        P.register_op_support("A", "simulated_quantize")


def test_unknown_compiler_is_a_clear_error():
    with pytest.raises(P.UnknownCompilerError, match="unknown compiler 'nope'"):
        P.annotate_target(["nope"])


def test_end_without_begin_names_the_equation():
    def f(x):
        return compiler_end(jnp.sin(x), "A")

    prog = jaxq.trace(f, *ones(3))
    with pytest.raises(
        P.AnnotationError, match=r"unbalanced.*compiler_end for 'A'.*'compiler_end'"
    ):
        P.partition_graph()(prog)


def test_mismatched_begin_and_end():
    def f(x):
        return compiler_end(jnp.sin(compiler_begin(x, "A")), "B")

    prog = jaxq.trace(f, *ones(3))
    with pytest.raises(P.AnnotationError, match="mismatched.*'B'.*'A'"):
        P.merge_compiler_regions()(prog)


def test_value_escaping_a_region_without_end():
    def f(x):
        s = jnp.sin(compiler_begin(x, "A"))
        return compiler_end(s, "A"), jnp.cos(s)

    prog = jaxq.trace(f, *ones(3))
    with pytest.raises(
        P.AnnotationError, match=r"'cos'.*inside a region for 'A'.*program's outputs"
    ):
        P.partition_graph()(prog)


def test_begin_missing_on_an_operand():
    def f(x, y):
        return compiler_end(compiler_begin(x, "A") * y, "A")

    prog = jaxq.trace(f, *ones(3, n=2))
    with pytest.raises(P.AnnotationError, match=r"'mul'.*without compiler_begin"):
        P.partition_graph()(prog)


def test_a_region_reading_its_own_results_is_split_where_it_reads_them():
    #   begin -> sin -> end -> cos(outside) -> begin -> mul -> end   all one region by hand:
    #   the region would need cos's result, which needs the region's own result. The mul reads
    #   sin's value as if it had left through compiler_end and entered again: two regions.
    def f(x):
        b = compiler_begin(x, "A")
        s = jnp.sin(b)
        c = jnp.cos(compiler_end(s, "A"))
        return compiler_end(s * compiler_begin(c, "A"), "A")

    (x,) = ones(3)
    prog = jaxq.trace(f, x)
    for passes in ([P.partition_graph()], [P.merge_compiler_regions(), P.partition_graph()]):
        out = T.Sequential(passes)(prog)
        assert [(r.primitives, r.num_inputs) for r in P.regions(out)] == [
            (("sin",), 1),
            (("mul",), 2),
        ]
        np.testing.assert_array_equal(np.asarray(out(x)), np.asarray(f(x)))


def test_the_gradient_of_an_annotated_function_partitions_into_forward_and_backward_regions():
    # (the backward pass reads the forward region's residuals, which JAX makes without an end)
    def f(x, w):
        y = jnp.tanh(compiler_begin(x, "A") @ compiler_begin(w, "A"))
        return jnp.sum(compiler_end(y, "A") ** 2)

    x, w = np.ones((2, 3), np.float32), np.full((3, 4), 0.1, np.float32)
    g = jax.grad(f, argnums=(0, 1))
    prog = jaxq.trace(g, x, w)
    for passes in ([P.partition_graph()], [P.merge_compiler_regions(), P.partition_graph()]):
        out = T.Sequential(passes)(prog)
        forward, backward = P.regions(out)
        assert "tanh" in forward.primitives and backward.primitives.count("dot_general") == 2
        for got, want in zip(out(x, w), g(x, w), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_a_jit_decorated_function_is_partitioned_like_the_function():
    """``jaxq.trace(jax.jit(f), x)`` is f's body, not one opaque call: hand-written regions
    inside are extracted (they were left in place), with the names f gives them."""

    def hand(x):
        a = compiler_begin(x, "hand")
        return jnp.cumsum(compiler_end(jnp.tanh(a) * 2, "hand"), 0)

    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    plain = P.partition_graph()(jaxq.trace(hand, x))
    jitted = P.partition_graph()(jaxq.trace(jax.jit(hand), x))
    assert [r.primitives for r in P.regions(jitted)] == [r.primitives for r in P.regions(plain)]
    assert [e.name for e in jitted.equations()] == [e.name for e in plain.equations()]
    assert not any(e.primitive.startswith("compiler_") for e in jitted.equations())
    np.testing.assert_array_equal(np.asarray(jitted(x)), np.asarray(hand(x)))


def test_region_annotations_inside_a_nested_call_are_warned_about():
    """Regions are top-level equations: hand-written boundaries inside a jit body made nothing,
    silently."""

    def f(x):
        inner = lambda v: compiler_end(jnp.tanh(compiler_begin(v, "A")), "A")
        return jax.jit(inner)(x) * 2

    with pytest.warns(UserWarning, match=r"inside nested calls or loops \(\['jit/compiler_begin'"):
        out = P.partition_graph()(jaxq.trace(f, ones(3)[0]))
    assert P.regions(out) == []
