"""Regressions from adversarial use: results that used to be silently wrong are now right or a
clear error (the quantization ones are in test_quantize_nonfinite.py and test_quantize_params.py)."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax import lax
from strategies import examples

import jaxq
from jaxq import partition as P
from jaxq.transform import Sequential, program_pass

INT_OPS = {
    "div": lax.div,
    "rem": lax.rem,
    "shift_left": lax.shift_left,
    "shift_right_logical": lax.shift_right_logical,
    "shift_right_arithmetic": lax.shift_right_arithmetic,
    "add": lax.add,
    "mul": lax.mul,
    "max": lax.max,
}


@pytest.fixture(autouse=True)
def _clean():
    yield
    for c in ("ints", "ort_ints", "bad"):
        P.unregister_compiler(c)
        P.unregister_backend(c)


def on_host(f, *args):
    for name in INT_OPS:
        P.register_op_support("ints", name)
    prog = jaxq.trace(f, *args)
    parts = Sequential(
        [P.annotate_target(["ints"]), P.merge_compiler_regions(), P.partition_graph()]
    )(prog)
    assert P.regions(parts), "the integer ops should form a host region"
    return P.build(parts, backends={"ints": "host"})


def test_host_integer_division_truncates_like_xla():
    x = np.array([-7, 7, -7, 5], np.int32)
    y = np.array([2, -2, -2, 3], np.int32)
    run = on_host(lambda a, b: lax.div(a, b), x, y)
    np.testing.assert_array_equal(np.asarray(run(x, y)), [-3, -3, 3, 1])  # was [-4, -4, 3, 1]


def test_host_int8_dots_accumulate_in_int32_like_xla():
    P.register_op_support("ints", "dot_general")
    x = np.full((2, 64), 100, np.int8)
    w = np.full((64, 3), -90, np.int8)
    f = lambda a, b: lax.dot(a, b, preferred_element_type=jnp.int32)
    run = on_host(f, x, w)
    np.testing.assert_array_equal(np.asarray(run(x, w)), np.asarray(jax.jit(f)(x, w)))  # -576000


@st.composite
def int_programs(draw):
    dtype = draw(st.sampled_from([np.int8, np.int32]))
    n = draw(st.integers(1, 6))
    info = np.iinfo(dtype)
    ints = st.integers(int(info.min), int(info.max))
    x = np.array(draw(st.lists(ints, min_size=n, max_size=n)), dtype)
    y = np.array(draw(st.lists(ints, min_size=n, max_size=n)), dtype)
    ops = draw(st.lists(st.sampled_from(sorted(INT_OPS)), min_size=1, max_size=4))

    def f(a, b):
        for op in ops:
            a = INT_OPS[op](a, b)
        return a

    return f, x, y, ops


ORT_OPS = {"div", "add", "mul", "max"}  # what jaxq's ONNX export takes of these, on int32


def on_onnxruntime(f, *args):
    for name in ORT_OPS:
        P.register_op_support("ort_ints", name)
    parts = Sequential(
        [P.annotate_target(["ort_ints"]), P.merge_compiler_regions(), P.partition_graph()]
    )(jaxq.trace(f, *args))
    return P.build(parts, backends={"ort_ints": "onnxruntime"})


@settings(max_examples=examples(30), deadline=None)
@given(int_programs())
def test_random_integer_programs_on_the_host_equal_xla_bit_for_bit(case):
    f, x, y, ops = case
    want = np.asarray(jax.jit(f)(x, y))
    np.testing.assert_array_equal(np.asarray(on_host(f, x, y)(x, y)), want)
    # ONNX Runtime too, where it runs these ops (int32) and no division traps the CPU (by 0, or
    # INT_MIN by -1 from an intermediate): divisors other than 0 and -1
    ort = set(ops) <= ORT_OPS and x.dtype == np.int32 and not np.isin(y, (0, -1)).any()
    if ort:
        pytest.importorskip("onnxruntime")
        np.testing.assert_array_equal(np.asarray(on_onnxruntime(f, x, y)(x, y)), want)


def test_build_checks_what_a_backend_returns():
    P.register_op_support("bad", "tanh")
    x = np.ones((2, 4), np.float32)
    prog = jaxq.trace(lambda a: jnp.tanh(a), x)
    parts = Sequential(
        [P.annotate_target(["bad"]), P.merge_compiler_regions(), P.partition_graph()]
    )(prog)
    wrong = {
        "transposed": lambda *a: [jnp.tanh(a[0]).T],
        "int32": lambda *a: [jnp.tanh(a[0]).astype(jnp.int32)],
        "extra": lambda *a: [jnp.tanh(a[0]), jnp.tanh(a[0])],
        "reshaped": lambda *a: [jnp.tanh(a[0]).reshape(4, 2)],
    }
    for result in wrong.values():
        P.register_backend("bad", lambda region, result=result: result)
        for jit in (False, True):
            with pytest.raises(P.BackendError, match=r"region .*declares"):
                jax.block_until_ready(P.build(parts, jit=jit)(x))


def test_sequential_names_the_pass_that_raised():
    @program_pass(name="breaks")
    def breaks(program):
        raise ValueError("something inside")

    prog = jaxq.trace(jnp.sin, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="something inside") as info:
        Sequential([jaxq.transform.identity(), breaks])(prog)
    assert "(raised by jaxq pass 'breaks')" in info.value.__notes__


def _model(x):
    return jnp.tanh(x @ np.full((3, 3), 0.5, np.float32))


def _save_here(path):
    return jaxq.trace(_model, np.ones((2, 3), np.float32)).save(path)


def test_saved_files_are_reproducible_private_and_keep_permissions(tmp_path):
    import os
    import stat

    a = _save_here(tmp_path / "a.jaxq")
    program = jaxq.trace(_model, np.ones((2, 3), np.float32))  # traced from another line
    b = program.save(tmp_path / "b.jaxq")
    data = a.read_bytes()
    assert data == b.read_bytes()  # the same model, saved from two call sites
    assert str(tmp_path).encode() not in data and b"test_reliability" not in data
    import zlib

    from safetensors.numpy import load_file

    blob = zlib.decompress(load_file(str(a))["jaxq.program"].tobytes())
    assert b"test_reliability" not in blob and os.getcwd().encode() not in blob
    os.chmod(a, 0o644)
    _save_here(a)
    assert stat.S_IMODE(a.stat().st_mode) == 0o644  # saving over it kept its permissions
    np.testing.assert_array_equal(
        np.asarray(jaxq.load(a)(np.ones((2, 3), np.float32))),
        np.asarray(_model(np.ones((2, 3), np.float32))),
    )


def test_typed_prng_keys_pass_through_quantize():
    w = np.full((4, 3), 0.5, np.float32)

    def f(p, x, key):
        return (x + 0.01 * jax.random.normal(key, x.shape)) @ p["w"]

    x, key = np.ones((2, 4), np.float32), jax.random.key(0)
    qf = jaxq.quantize(f, {"w": w}, calibration=[(x, key)], progress=False)
    want = np.asarray(f({"w": w}, x, key))
    assert np.abs(np.asarray(qf(x, key)) - want).max() < 0.05 * np.abs(want).max()


def test_a_backend_failing_at_run_time_under_jit_names_its_region():
    from jaxq.partition._backends import callback_runner

    def fails(*args):
        raise RuntimeError("device lost")

    P.register_op_support("bad", "tanh")
    P.register_backend("bad", lambda region: callback_runner(region, fails))
    x = np.ones((2, 4), np.float32)
    prog = jaxq.trace(lambda a: jnp.tanh(a) + 1.0, x)
    parts = Sequential(
        [P.annotate_target(["bad"]), P.merge_compiler_regions(), P.partition_graph()]
    )(prog)
    (region,) = [r.name for r in P.regions(parts)]
    for jit in (False, True):
        with pytest.raises(Exception, match=rf"{region}.*device lost"):
            jax.block_until_ready(P.build(parts, jit=jit)(x))


def test_onnxruntime_integer_region_equals_xla_including_wraparound():
    pytest.importorskip("onnxruntime")
    x = np.array([-7, 7, -7, 5, 2**31 - 1, -(2**31)], np.int32)
    y = np.array([2, -2, -2, 3, 3, -3], np.int32)

    def f(a, b):
        return lax.max(lax.mul(lax.div(a, b), b), lax.add(a, b))

    got = np.asarray(on_onnxruntime(f, x, y)(x, y))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(f)(x, y)))
    np.testing.assert_array_equal(got, np.asarray(on_host(f, x, y)(x, y)))
