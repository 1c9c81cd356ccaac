"""Identity annotations, the registry, and errors of the wrappers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import jaxq.annotate as A
import jaxq.partition

# One function per identity annotation, built once so jitted versions are reused across examples.
IDENTITY_FUNS = {
    "on_device": lambda x: A.on_device(x, "cpu:1"),
    "compiler_begin": lambda x: A.compiler_begin(x, "dnnl"),
    "compiler_end": lambda x: A.compiler_end(x, "dnnl"),
    "stop_fusion": A.stop_fusion,
    "cast_hint": lambda x: A.cast_hint(x, "int8"),
}
JITTED = {name: jax.jit(f) for name, f in IDENTITY_FUNS.items()}
VMAPPED = {name: jax.jit(jax.vmap(f)) for name, f in IDENTITY_FUNS.items()}
DTYPES = {"float32": jnp.float32, "int32": jnp.int32, "bfloat16": jnp.bfloat16, "bool": jnp.bool_}


def _random_array(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype == "int32":
        return rng.integers(-1000, 1000, shape, dtype=np.int32)
    return rng.normal(size=shape).astype(DTYPES[dtype])


shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
seeds = st.integers(0, 2**32 - 1)


@given(
    name=st.sampled_from(sorted(IDENTITY_FUNS)),
    shape=shapes,
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=seeds,
)
def test_identity_eager_jit_vmap(name, shape, dtype, seed):
    x = jnp.asarray(_random_array(seed, (3, *shape), dtype))
    for y in (IDENTITY_FUNS[name](x), JITTED[name](x), VMAPPED[name](x)):
        assert y.dtype == x.dtype and y.shape == x.shape
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@given(
    name=st.sampled_from(sorted(IDENTITY_FUNS)),
    shape=shapes,
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=seeds,
)
def test_identity_gradients(name, shape, dtype, seed):
    f = IDENTITY_FUNS[name]
    x = jnp.asarray(_random_array(seed, (2, *shape), dtype))
    c = jnp.asarray(_random_array(seed + 1, (2, *shape), dtype))

    def loss(x, c):
        return jnp.sum(f(x) * c)

    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(x, c)), np.asarray(c))
    per_example = jax.jit(jax.vmap(jax.grad(loss)))(x, c)
    np.testing.assert_array_equal(np.asarray(per_example), np.asarray(c))


@pytest.mark.parametrize("name", sorted(IDENTITY_FUNS))
def test_identity_annotations_transpose_as_the_identity(name):
    """``jax.linear_transpose`` through each (cast_hint had no transpose rule)."""
    f = IDENTITY_FUNS[name]
    x, ct = jnp.ones(3), jnp.arange(3.0)
    (got,) = jax.linear_transpose(lambda v: f(v) * 2.0, x)(ct)
    np.testing.assert_array_equal(got, ct * 2.0)


def _prims(jaxpr) -> list[str]:
    return [e.primitive.name for e in jaxpr.jaxpr.eqns]


def test_tangents_are_annotated_where_the_annotation_should_hold():
    x = jnp.ones(3)
    for name in ("on_device", "stop_fusion"):
        grad = jax.make_jaxpr(jax.grad(lambda x, f=IDENTITY_FUNS[name]: jnp.sum(f(x))))(x)
        assert _prims(grad).count(name) == 2, grad  # the primal and the cotangent
    grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(A.cast_hint(x, "int8"))))(x)
    assert _prims(grad).count("cast_hint") == 1, grad  # a cotangent is not stored as int8


def test_compiler_region_transposes_to_a_region():
    def f(x):
        return jnp.sum(A.compiler_end(jnp.sin(A.compiler_begin(x, "dnnl")), "dnnl"))

    prims = _prims(jax.make_jaxpr(jax.grad(f))(jnp.ones(3)))
    backward = prims[prims.index("reduce_sum") + 1 :]
    region = [p for p in backward if p.startswith("compiler_")]
    # The cotangent enters the region where the primal left it, so the boundaries swap.
    assert region == ["compiler_begin", "compiler_end"], prims


def test_params_print_in_jaxpr():
    def f(x):
        x = A.compiler_begin(x, "dnnl")
        x = A.on_device(x, jax.devices("cpu")[2])
        x = A.cast_hint(x, jnp.int8)
        return A.compiler_end(x, "dnnl")

    text = str(jax.make_jaxpr(f)(jnp.ones(3)))
    for fragment in (
        "compiler_begin[compiler=dnnl]",
        "on_device[device=cpu:2]",
        "cast_hint[dtype=int8]",
        "compiler_end[compiler=dnnl]",
    ):
        assert fragment in text, text


@pytest.mark.parametrize(
    ("device", "canonical"),
    [("cpu", "cpu:0"), ("cpu:3", "cpu:3"), ("CPU:1", "cpu:1"), (None, "cpu:2")],
)
def test_on_device_canonical_param(device, canonical):
    device = jax.devices("cpu")[2] if device is None else device
    (eqn,) = jax.make_jaxpr(lambda x: A.on_device(x, device))(1.0).jaxpr.eqns
    assert eqn.params == {"device": canonical}


def test_stop_fusion_lowers_to_optimization_barrier():
    def f(x):
        return jnp.exp(A.stop_fusion(jnp.sin(x)))

    assert "stablehlo.optimization_barrier" in jax.jit(f).lower(jnp.ones(4)).as_text()
    plain = jax.jit(lambda x: jnp.exp(A.on_device(jnp.sin(x), "cpu"))).lower(jnp.ones(4))
    assert "optimization_barrier" not in plain.as_text()


def test_export_round_trip():
    def f(x):
        x = A.compiler_begin(A.on_device(x, "cpu:1"), "dnnl")
        x = A.stop_fusion(jnp.tanh(x)) * 2
        return A.cast_hint(A.compiler_end(x, "dnnl"), "int8")

    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    exported = jax.export.export(jax.jit(f))(x)
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_array_equal(np.asarray(restored.call(x)), np.asarray(jax.jit(f)(x)))


def test_registry():
    ops = A.registry()
    assert [op.name for op in ops] == [
        "on_device",
        "simulated_quantize",
        "compiler_begin",
        "compiler_end",
        "stop_fusion",
        "cast_hint",
    ]
    levels = {op.name: op.level for op in ops}
    assert levels["cast_hint"] == "experimental"
    assert all(level in ("stable", "experimental") for level in levels.values())
    for op in ops:
        assert op.primitive.name == op.name
        assert op.summary and "\n" not in op.summary
        assert A.is_annotation(op.primitive)
    assert not A.is_annotation(lax.add_p)
    assert {p.name for p in A.IDENTITY_ANNOTATIONS} == {
        "on_device",
        "compiler_begin",
        "compiler_end",
        "stop_fusion",
        "cast_hint",
    }
    assert A.simulated_quantize_p not in A.IDENTITY_ANNOTATIONS


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: A.on_device(1.0, "cpu:4"), ValueError, "on_device: device must be one of"),
        (lambda: A.on_device(1.0, "tpu:0"), ValueError, "on_device: device must be one of"),
        (lambda: A.on_device(1.0, "cpu:x"), ValueError, "on_device: device must be one of"),
        (lambda: A.on_device(1.0, 0), TypeError, "on_device: device must be a jax.Device"),
        (lambda: jaxq.partition.xla_backend("tpu:0"), ValueError, "xla_backend: device must be"),
        (
            lambda: A.compiler_begin(1.0, ""),
            ValueError,
            "compiler_begin: compiler must be a non-empty string; got ''",
        ),
        (
            lambda: A.compiler_end(1.0, None),
            TypeError,
            "compiler_end: compiler must be a non-empty string; got None",
        ),
        (lambda: A.cast_hint(1.0, "int9"), TypeError, "cast_hint: dtype must be a numpy dtype"),
        (lambda: A.cast_hint(1.0, None), TypeError, "cast_hint: dtype must be a numpy dtype"),
        (lambda: A.compiler_begin(1.0, "a.b"), ValueError, "compiler_begin: compiler must not"),
        # a container is not stacked into one array (it was, silently)
        (lambda: A.stop_fusion((1.0, 2.0)), TypeError, "stop_fusion: expected one array, got a"),
        (lambda: A.on_device([1.0], "cpu:0"), TypeError, "on_device: expected one array, got a"),
        (lambda: A.cast_hint({"a": 1.0}, "int8"), TypeError, "cast_hint: expected one array"),
        (lambda: A.compiler_begin((1.0,), "c"), TypeError, "compiler_begin: expected one array"),
        (lambda: A.simulated_quantize([1.0], 0.1), TypeError, "simulated_quantize: expected one"),
    ],
)
def test_bad_arguments(call, error, message):
    with pytest.raises(error, match=f"^{message}"):
        call()
