"""Pass, program_pass, Sequential, PassContext and the built-in instruments."""

import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import examples

import jaxq
from jaxq import transform as T
from jaxq.transform import _pass as pass_module

X = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
PROG = jaxq.trace(lambda x: jnp.sin(x) * 2 + 1, X)


def _sin_to_cos():
    return T.program_pass(
        lambda p: T.rewrite(p, {"sin": lambda v, x: jnp.cos(x)}), name="sin_to_cos", opt_level=1
    )


def test_program_pass_as_decorator_and_function():
    @T.program_pass
    def noop(program):
        return program

    @T.program_pass(name="tagged", opt_level=3, required=True)
    def tagged(program):
        return program.replace(meta={"tag": 1})

    assert isinstance(noop, T.Pass) and noop.name == "noop" and noop.opt_level == 0
    assert (tagged.name, tagged.opt_level, tagged.required) == ("tagged", 3, True)
    assert tagged(PROG).meta == {"tag": 1}
    assert PROG.meta == {}


def test_sequential_is_a_pass_with_len_iter_and_slicing():
    a, b, c = T.identity(), _sin_to_cos(), T.name_expressions()
    seq = T.Sequential([a, b, c], name="pipe")
    assert isinstance(seq, T.Pass) and len(seq) == 3 and list(seq) == [a, b, c]
    assert seq[1] is b
    head = seq[:2]
    assert isinstance(head, T.Sequential) and list(head) == [a, b]
    nested = T.Sequential([seq[:1], seq[1:]])
    np.testing.assert_allclose(nested(PROG)(X), np.cos(X) * 2 + 1, rtol=1e-6)
    assert "cos" in [e.primitive for e in seq(PROG).equations()]


def test_sequential_rejects_non_passes_by_name():
    with pytest.raises(TypeError, match=r"item 1 is .* not a Pass \(a function\? wrap it"):
        T.Sequential([T.identity(), lambda p: p])
    with pytest.raises(TypeError, match="item 0 is 3 of type int, not a Pass"):
        T.Sequential([3])
    with pytest.raises(TypeError, match=r"a pass factory\? call it: name_expressions\(...\)"):
        T.Sequential([T.name_expressions, T.infer_layouts()])


def test_pass_rejects_non_programs():
    with pytest.raises(TypeError, match="expects a jaxq.Program; got function"):
        T.identity()(lambda x: x)


def test_opt_level_and_disabled_skip_passes():
    p = _sin_to_cos()
    prims = lambda prog: [e.primitive for e in prog.equations()]
    with T.PassContext(opt_level=0):
        assert "sin" in prims(p(PROG))
    with T.PassContext(opt_level=1):
        assert "cos" in prims(p(PROG))
        with T.PassContext(opt_level=1, disabled=["sin_to_cos"]):  # nests; innermost wins
            assert "sin" in prims(p(PROG))
        assert "cos" in prims(p(PROG))
    assert "cos" in prims(p(PROG))  # default context has opt_level=2


def test_disabling_a_required_pass_is_an_error():
    req = T.program_pass(lambda p: p, name="must", required=True)
    with T.PassContext(disabled=["must"]), pytest.raises(ValueError, match="'must' is required"):
        req(PROG)
    with T.PassContext(opt_level=-1):  # required passes ignore opt_level
        assert req(PROG) is PROG


@pytest.fixture
def own_configs(monkeypatch):
    """Options a test declares are gone afterwards."""
    monkeypatch.setattr(pass_module, "_CONFIGS", dict(pass_module._CONFIGS))


def test_config_is_visible_to_passes(own_configs):
    seen = {}
    T.register_config("tests.k", int, "a test's option")

    @T.program_pass
    def reads_config(program):
        seen.update(T.PassContext.current().config)
        return program

    with T.PassContext(config={"tests.k": 1}):
        reads_config(PROG)
    assert seen == {"tests.k": 1}
    assert T.PassContext.list_configs()["tests.k"] == "int: a test's option"


def test_config_options_are_declared_and_typed(own_configs):
    """A misspelled option was ignored in silence: the pass read its default. Now the context
    refuses it, naming the nearest declared one, and refuses values of the wrong type."""
    with pytest.raises(
        ValueError,
        match=r"unknown config option 'quantize\.tunning'; did you "
        r"mean 'quantize\.tuning'\?.*register_config",
    ):
        T.PassContext(config={"quantize.tunning": None})
    with pytest.raises(ValueError, match="unknown config option 'k'; the options are "):
        T.PassContext(config={"k": 1})
    with pytest.raises(
        TypeError, match=r"'quantize\.calibrate\.percentile' takes a value of type float; got bool"
    ):
        T.PassContext(config={"quantize.calibrate.percentile": True})
    with pytest.raises(
        TypeError, match="'quantize.tuning' takes a value of type Tuning [|] None; got str"
    ):
        T.PassContext(config={"quantize.tuning": "gpu"})
    assert {"quantize.tuning", "quantize.calibrate.method", "quantize.calibrate.percentile"} <= set(
        T.PassContext.list_configs()
    )
    T.register_config("tests.flag", bool, "a flag")
    assert T.PassContext(config={"tests.flag": True}).config == {"tests.flag": True}
    with pytest.raises(TypeError, match="takes a value of type bool; got int 1"):
        T.PassContext(config={"tests.flag": 1})
    with pytest.raises(TypeError, match="type_ must be a type"):
        T.register_config("tests.bad", "int", "not a type")
    assert T.PassContext(config={"quantize.calibrate.percentile": 99}).config  # (int for float)
    T.register_config("tests.size", int | None, "a size, or None for the default")
    assert T.PassContext.list_configs()["tests.size"].startswith("int | None: ")
    assert T.PassContext(config={"tests.size": None}).config == {"tests.size": None}
    with pytest.raises(TypeError, match="takes a value of type int [|] None; got str"):
        T.PassContext(config={"tests.size": "8"})
    T.register_config("tests.size", int | None, "reworded")  # (the same type: its line changes)
    with pytest.raises(
        ValueError,
        match=r"'quantize\.tuning' is declared already, taking "
        r"Tuning \| None .*a name of its own",
    ):
        T.register_config("quantize.tuning", int, "another pass's idea of it")


def test_pass_timing_and_print_ir():
    timing, buf = T.PassTiming(), io.StringIO()
    with T.PassContext(instruments=[timing, T.PrintIR(before=True, after=True, file=buf)]):
        T.Sequential([T.identity(), T.name_expressions()])(PROG)
    assert [name for name, _ in timing.records] == ["identity", "name_expressions"]
    assert all(t >= 0 for _, t in timing.records)
    table = str(timing)
    assert "identity" in table and "total" in table
    text = buf.getvalue()
    assert "--- before identity" in text and "--- after name_expressions" in text
    assert "# mul" in text


def test_numeric_check_names_the_pass_that_changed_numbers():
    bad = T.program_pass(
        lambda p: T.rewrite(p, {"mul": lambda v, x, y: x * y * 1.01}), name="bad_pass"
    )
    with T.PassContext(instruments=[T.NumericCheck(X)]):
        T.identity()(PROG)  # fine
        with pytest.raises(T.PassError, match=r"pass 'bad_pass' changed the numbers of output 0"):
            T.Sequential([T.identity(), bad])(PROG)


def test_numeric_check_compares_prng_keys_by_their_bits():
    def step(key, x):  # (it raised numpy's "PRNGKey dtype cannot be converted" TypeError)
        key, sub = jax.random.split(key)
        return key, x + jax.random.normal(sub, x.shape)

    key = jax.random.key(0)
    prog = jaxq.trace(step, key, X)
    with T.PassContext(instruments=[T.NumericCheck(key, X)]):
        T.identity()(prog)
        flip = lambda p: T.rewrite(p, {"random_split": lambda v, k, **_: jax.random.split(k)[::-1]})
        with pytest.raises(T.PassError, match="output 0"):
            T.program_pass(flip, name="flip")(prog)


@pytest.mark.parametrize("where", ["all", "some"])
def test_numeric_check_names_values_a_pass_made_nan(where):
    x = np.linspace(-1, 1, 6, dtype=np.float32)
    prog = jaxq.trace(lambda x: jnp.exp(x) + 1.0, x)
    nan = (
        (lambda a: jnp.exp(a) * jnp.nan)
        if where == "all"
        else (lambda a: jnp.where(a > 0.5, jnp.nan, jnp.exp(a)))
    )
    made_nan = T.program_pass(lambda p: T.rewrite(p, {"exp": lambda v, a: nan(a)}), name="nan")
    first, count = ((0,), 6) if where == "all" else ((4,), 2)
    with (
        T.PassContext(instruments=[T.NumericCheck(x)]),
        pytest.raises(
            T.PassError,
            match=rf"{count} value\(s\) became or stopped being NaN or Inf, first at index "
            + re.escape(str(first))
            + r".*after np.float32\(nan\)",
        ),
    ):
        made_nan(prog)


def test_well_formed_catches_an_ill_typed_jaxpr():
    def corrupt(eqn, path, name):
        # re-use the input variable as the output of a sin: the jaxpr now assigns a variable twice
        return [eqn.replace(outvars=list(eqn.invars))] if eqn.primitive.name == "sin" else None

    breaker = T.program_pass(lambda p: T.map_equations(p, corrupt), name="breaker")
    with (
        T.PassContext(instruments=[T.WellFormed()]),
        pytest.raises(T.PassError, match="pass 'breaker' produced an ill-formed jaxpr"),
    ):
        breaker(PROG)


def test_a_pass_that_changes_the_calling_convention_is_named():
    """with_jaxpr took a jaxpr of another arity (the Program then failed with pytree or zip
    errors when called), and WellFormed passed one whose outputs changed shape."""
    x = np.linspace(-1, 1, 4, dtype=np.float32)
    prog = jaxq.trace(lambda x: jnp.sin(x) * 2, x)
    two_outputs = T.program_pass(
        lambda p: p.with_jaxpr(jax.make_jaxpr(lambda x: (x, x))(x)), name="two_outputs"
    )
    with pytest.raises(ValueError, match=r"takes 1 input\(s\) and returns 2, .* has 1 and 1"):
        two_outputs(prog)
    halved = T.program_pass(
        lambda p: p.with_jaxpr(jax.make_jaxpr(lambda x: x[:2])(x)), name="halved"
    )
    with (
        T.PassContext(instruments=[T.WellFormed()]),
        pytest.raises(T.PassError, match=r"'halved' changed .* outputs from \['float32\[4\]'\]"),
    ):
        halved(prog)


def test_strip_annotations_removes_identities_and_honours_keep():
    from jaxq import annotate as A

    def f(x):
        y = A.compiler_begin(x, "dnnl")
        y = A.compiler_end(jnp.sin(y), "dnnl")
        y = A.on_device(A.stop_fusion(y) * 2, "cpu:1")
        y = A.cast_hint(y, jnp.int8)
        return A.simulated_quantize(y, 0.1)

    prog = jaxq.trace(f, X)
    prims = lambda p: [e.primitive for e in p.equations()]
    stripped = T.strip_annotations(barriers=True)(prog)
    assert prims(stripped) == ["sin", "mul", "simulated_quantize"]
    kept = T.strip_annotations(keep=["on_device"])(prog)  # fusion barriers stay by default
    assert prims(kept) == ["sin", "stop_fusion", "mul", "on_device", "simulated_quantize"]
    assert prims(T.strip_annotations(keep="on_device")(prog)) == prims(kept)  # (one name)
    np.testing.assert_array_equal(stripped(X), prog(X))
    with pytest.raises(ValueError, match=r"unknown annotation\(s\) \['on_devise'\]"):
        T.strip_annotations(keep=["on_devise"])


def test_passes_rewrite_a_nested_jit_that_closes_over_a_constant():
    """jax 0.11+ keeps a nested jit's constants in its body; re-binding it must keep them too
    (this failed on 0.12 for every rewrite, and so after any partition_graph with weights)."""
    from jaxq import partition as P

    const = np.arange(X.shape[-1], dtype=np.float32)
    f = lambda x: jax.jit(lambda v: jnp.sin(v) * 2 + const)(x)
    prog = jaxq.trace(f, X)
    for p in (T.identity(), T.strip_annotations(), T.fold_constants(), T.name_expressions()):
        np.testing.assert_array_equal(p(prog)(X), f(X))
    for prim in ("sin", "mul", "add"):
        P.register_op_support("test_njc", prim)
    parts = T.Sequential([P.annotate_target(["test_njc"]), P.partition_graph()])(prog)
    np.testing.assert_array_equal(T.strip_annotations()(parts)(X), f(X))


def test_fold_constants_evaluates_small_constant_subexpressions_only():
    scale = np.float32(0.5) * np.ones((1, 3), np.float32)
    big = np.arange(12 * 3, dtype=np.int8).reshape(12, 3)

    def f(x):
        s = jnp.asarray(scale) * 2.0 + 1.0  # constants only, 3 elements: folded
        w = jnp.asarray(big).astype(jnp.float32)  # constants only, 36 elements: kept
        return jnp.tanh(x @ w[:3] * s)

    prog = jaxq.trace(f, X)
    before = [e.primitive for e in prog.equations()]
    folded = T.fold_constants(max_elements=8)(prog)
    prims = [e.primitive for e in folded.equations()]
    assert prims.count("mul") == before.count("mul") - 1 and "add" not in prims
    assert "convert_element_type" in prims  # (the 36-element result stays computed)
    assert [e.primitive for e in prog.equations()] == before  # the input program is unchanged
    np.testing.assert_array_equal(folded(X), prog(X))
    everything = T.fold_constants(max_elements=10**6)(prog)
    assert "convert_element_type" not in [e.primitive for e in everything.equations()]
    np.testing.assert_array_equal(everything(X), prog(X))
    with pytest.raises(ValueError, match="max_elements"):
        T.fold_constants(-1)


def test_fold_constants_keeps_annotations_on_constants():
    """Annotations mean something to later passes (placement, fusion barriers, quantization
    sites): folding evaluates what feeds them and keeps them (it dropped all four)."""
    from jaxq import annotate as A

    w0 = np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3)

    def f(x):
        w = A.simulated_quantize(jnp.asarray(w0) * 2.0, 0.05, kind="weight")
        w = A.stop_fusion(A.on_device(A.cast_hint(w, "int8"), "cpu:0"))
        return x @ w

    prog = jaxq.trace(f, X)
    folded = T.fold_constants()(prog)
    assert [e.primitive for e in folded.equations()] == [
        "simulated_quantize",
        "cast_hint",
        "on_device",
        "stop_fusion",
        "dot_general",
    ]
    np.testing.assert_array_equal(folded(X), prog(X))
    assert A.is_annotation("on_device") and not A.is_annotation("mul")


@pytest.mark.parametrize("which", [np.True_, np.False_, np.array([True, False, True])])
def test_fold_constants_picks_the_case_a_constant_predicate_selects(which):
    # (jnp.var's where(n - ddof > 0, var, nan), inlined: the choice is known before the values)
    f = lambda x: jax.lax.select_n(jnp.asarray(which), jnp.sin(x), x * 2.0)
    x = np.linspace(-1, 1, 3).astype(np.float32)
    folded = T.fold_constants()(jaxq.trace(f, x))
    prims = [e.primitive for e in folded.equations()]
    uniform = np.ndim(which) == 0
    assert ("select_n" in prims) != uniform
    np.testing.assert_array_equal(folded(x), f(x))


def test_fold_constants_runs_on_loops_whose_bodies_hold_constant_subexpressions():
    # (on jax 0.12 a scan body is re-bound without constants of its own: folding an array there
    # raised RewriteError, which broke jaxq.offload of every nn.scan layer stack)
    def f(x):
        step = lambda h, _: (h * jnp.full(3, 2.0) + jnp.asarray(np.float32(1)) * 3.0, None)
        return jax.lax.scan(step, x, None, length=4)[0] * (jnp.ones(3) * 2.0)

    x = np.linspace(-1, 1, 3).astype(np.float32)
    prog = jaxq.trace(f, x)
    folded = T.fold_constants()(prog)
    np.testing.assert_array_equal(folded(x), f(x))
    top = [e.primitive for e in folded.equations() if len(e.path) == 1]
    assert top.count("mul") == 1  # (outside the loop the constant product still folds)


@settings(max_examples=examples(20), deadline=None)
@given(st.integers(0, 4), st.integers(0, 3), st.booleans(), st.integers(0, 5))
def test_unroll_loops_computes_the_same_without_loops(length, inner, reverse, max_length):
    # integer arithmetic: any evaluation order gives the same numbers, so equality is exact
    w = np.arange(6, dtype=np.int32).reshape(2, 3)

    def f(c0, xs):
        def step(c, x):
            c = c * 3 + x.sum() + jnp.asarray(w).sum()
            inner_ys = jax.lax.scan(lambda a, b: (a + b, a * b), c, jnp.arange(inner))[1]
            return c % 1000, (x * c, inner_ys)

        return jax.lax.scan(step, c0, xs, reverse=reverse)

    c0, xs = np.int32(2), np.arange(length * 4, dtype=np.int32).reshape(length, 4)
    prog = jaxq.trace(f, c0, xs)
    before = [e.primitive for e in prog.equations()]
    out = T.unroll_loops(max_length)(prog)
    assert [e.primitive for e in prog.equations()] == before  # (the input is unchanged)
    scans = [e for e in out.equations() if e.primitive == "scan"]
    assert bool(scans) == (length > max_length or (length > 0 and inner > max_length))
    for got, want in zip(jax.tree.leaves(out(c0, xs)), jax.tree.leaves(f(c0, xs)), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_unroll_loops_names_each_iteration_and_checks_its_argument():
    def f(x, ws):
        with jax.named_scope("Stack"):
            return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    x, ws = np.ones((2, 3), np.float32), np.ones((2, 3, 3), np.float32) * 0.1
    out = T.unroll_loops()(T.name_expressions()(jaxq.trace(f, x, ws)))
    names = [e.name for e in out.equations() if e.primitive == "dot_general"]
    assert names == ["Stack/scan@0/dot_general", "Stack/scan@1/dot_general"]
    np.testing.assert_allclose(out(x, ws), f(x, ws), rtol=1e-6)
    with pytest.raises(ValueError, match="max_length"):
        T.unroll_loops(-1)


def test_unroll_loops_gives_each_iteration_its_own_constant_of_a_stacked_constant():
    # (a stacked weight bound into the program: a backend must see each layer's weight as a
    # constant, not a slice of the stack computed at run time)
    ws = jnp.arange(2 * 3 * 3, dtype=jnp.float32).reshape(2, 3, 3) / 10  # (a jax Array)
    f = lambda x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]
    x = np.ones((2, 3), np.float32)
    out = T.unroll_loops()(jaxq.trace(f, x))
    prims = [e.primitive for e in out.equations()]
    assert prims.count("dot_general") == 2 and not {"slice", "squeeze", "dynamic_slice"} & set(
        prims
    )
    layers = [c for c in out.jaxpr.consts if np.shape(c) == (3, 3)]
    for got, want in zip(layers, ws, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(out(x), f(x), rtol=1e-6)


def test_pass_context_checks_its_arguments_and_names_a_misspelled_pass():
    p = _sin_to_cos()
    with (
        pytest.warns(UserWarning, match=r"no pass named 'sin_to_cso' ran .* sin_to_cos"),
        T.PassContext(disabled=["sin_to_cso"]),
    ):
        assert "cos" in [e.primitive for e in p(PROG).equations()]
    with pytest.raises(TypeError, match="opt_level must be an int; got '2'"):
        T.PassContext(opt_level="2")
    with pytest.raises(TypeError, match=r"got the class PassTiming \(pass PassTiming\(\.\.\.\)\)"):
        T.PassContext(instruments=[T.PassTiming])
    with pytest.raises(TypeError, match="instrument 42 has none of the hooks"):
        T.PassContext(instruments=[42])
    with pytest.raises(
        TypeError, match=r"instruments must be a sequence .* instruments=\[\.\.\.\]"
    ):
        T.PassContext(instruments=T.PassTiming())  # (one instrument, not in a list)
    with pytest.raises(TypeError, match="config must be a mapping"):
        T.PassContext(config=[1])


def test_a_slice_of_a_sequential_is_named_as_written():
    """(``pipeline[:2]`` was named ``sequential[None:2]``, and ``[::2]`` lost its step.)"""
    seq = T.Sequential([T.identity(), T.name_expressions(), T.infer_layouts()])
    assert [seq[s].name for s in (slice(None, 2), slice(1, None), slice(None, None, 2))] == [
        "sequential[:2]",
        "sequential[1:]",
        "sequential[::2]",
    ]
    assert [p.name for p in seq[::2].passes] == ["identity", "infer_layouts"]
