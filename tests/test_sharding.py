"""Constants as arguments, and sharding them along output channels on a mesh of 4 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxq

rng = np.random.default_rng(0)
W = rng.integers(-127, 128, (6, 8), dtype=np.int8)  # an int8 weight, IO
SCALE = rng.uniform(0.01, 0.02, 8).astype(np.float32)  # per-output-channel
BIAS = rng.standard_normal(8).astype(np.float32)
K = rng.standard_normal((3, 3, 2, 4)).astype(np.float32)  # HWIO
KB = rng.standard_normal(4).astype(np.float32)
ODD = rng.standard_normal((6, 3)).astype(np.float32)  # 3 output channels: not divisible by 2


def model(x, img):
    q = jnp.clip(jnp.round(x / 0.05), -127, 127).astype(jnp.int8)
    acc = lax.dot_general(q, W, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * SCALE + BIAS
    z = (
        lax.conv_general_dilated(img, K, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        + KB
    )
    return y, z, x @ ODD


X = rng.standard_normal((4, 6)).astype(np.float32)
IMG = rng.standard_normal((4, 5, 5, 2)).astype(np.float32)


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def test_split_constants_computes_the_same():
    prog = jaxq.trace(model, X, IMG)
    fun, consts = jaxq.split_constants(prog)
    assert len(consts) == len(prog.jaxpr.consts)
    want = jax.jit(prog.as_fun())(X, IMG)
    got = jax.jit(fun)(consts, X, IMG)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_weights_and_per_channel_vectors_shard_along_output_channels(mesh):
    prog = jaxq.trace(model, X, IMG)
    shardings = jaxq.constant_shardings(prog, mesh, "model")
    specs = {tuple(np.shape(c)): s.spec for c, s in zip(prog.jaxpr.consts, shardings, strict=True)}
    assert specs[(6, 8)] == PartitionSpec(None, "model")  # int8 weight: O
    assert specs[(8,)] == PartitionSpec("model")  # its scale and bias go with it
    assert specs[(3, 3, 2, 4)] == PartitionSpec(None, None, None, "model")  # HWIO: O
    assert specs[(4,)] == PartitionSpec("model")  # conv bias along the output channels
    assert specs[(6, 3)] == PartitionSpec(None, None)  # 3 channels do not split over 2 devices
    with pytest.raises(ValueError, match="mesh has no axis 'tensor'"):
        jaxq.constant_shardings(prog, mesh, "tensor")


def test_sharded_weights_and_data_parallel_inputs_give_the_same_outputs(mesh):
    prog = jaxq.trace(model, X, IMG)
    fun, consts = jaxq.split_constants(prog)
    shardings = jaxq.constant_shardings(prog, mesh, "model")
    placed = [jax.device_put(c, s) for c, s in zip(consts, shardings, strict=True)]
    w = next(c for c in placed if c.shape == (6, 8))
    assert len({shard.device for shard in w.addressable_shards}) == 4
    assert w.addressable_shards[0].data.shape == (6, 4)  # each device holds half the channels
    data = NamedSharding(mesh, PartitionSpec("data"))
    x, img = jax.device_put(X, data), jax.device_put(IMG, data)
    got = jax.jit(fun)(placed, x, img)
    want = jax.jit(prog.as_fun())(X, IMG)
    # The int8 dot is exact in int32, but the float rescale acc * SCALE + BIAS is compiled per
    # program: XLA may fuse it into one multiply-add (one rounding) in the sharded program and not
    # in the other (jax 0.12 does), so the two may differ by one rounding of the product.
    q = np.clip(np.round(X / np.float32(0.05)), -127, 127).astype(np.int32)
    product = (q @ W.astype(np.int32)).astype(np.float32) * SCALE
    one_rounding = np.finfo(np.float32).eps * np.abs(product).max()
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=one_rounding)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5)
    assert got[0].sharding.spec[0] == "data"  # batch stays split over the data axis
