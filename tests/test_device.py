"""Realized integer programs on a GPU compute what they compute on the CPU (skipped
where JAX's default backend is not a GPU, as in CI). XLA:GPU's int8 dot gave wrong sums for some
shapes and it has no int8 convolution, so realize carries the sums in f32 chunks there
(``Tuning.s8_dot`` / ``s8_conv``); these models hit both, and the shapes that failed."""

import jax
import numpy as np
import pytest
from jax import lax

import jaxq.quantize as Q
from jaxq.quantize import QConfig, Scheme
from jaxq.transform import PassContext

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a GPU as JAX's default backend"
)
RNG = np.random.default_rng(0)
DN = ("NHWC", "HWIO", "NHWC")


def normal(*shape, scale=1.0):
    return (RNG.normal(size=shape) * scale).astype(np.float32)


def dense(p, x):
    h = jax.nn.gelu(x @ p["w1"])  # 1100 wide: two chunks
    return (h @ p["w2"]) @ p["w3"]  # a contraction of 3 (cuBLAS gave wrong sums)


def cnn(p, x):
    h = jax.nn.relu(lax.conv_general_dilated(x, p["k1"], (1, 1), "SAME", dimension_numbers=DN))
    h = lax.conv_general_dilated(h, p["k2"], (1, 1), "SAME", dimension_numbers=DN)
    h = lax.conv_general_dilated(
        jax.nn.relu(h), p["k3"], (1, 1), "SAME", dimension_numbers=DN, feature_group_count=2
    )
    return h.reshape(h.shape[0], -1) @ p["w"]


def attention(p, x):
    q, k = x @ p["wq"], x @ p["wk"]
    return jax.nn.softmax(q @ k.transpose(0, 2, 1)) @ x


CASES = {
    "dense": (
        dense,
        {"w1": normal(1100, 3, scale=0.05), "w2": normal(3, 3), "w3": normal(3, 4)},
        [normal(18, 1100) for _ in range(2)],
        QConfig(),
    ),
    "cnn": (
        cnn,
        {
            "k1": normal(3, 3, 3, 16, scale=0.3),
            "k2": normal(3, 3, 16, 160, scale=0.1),
            "k3": normal(3, 3, 80, 8, scale=0.05),
            "w": normal(6 * 6 * 8, 5, scale=0.1),
        },
        [normal(2, 6, 6, 3) for _ in range(2)],
        QConfig(dynamic=True),
    ),
    "attention": (
        attention,
        {"wq": normal(16, 16, scale=0.3), "wk": normal(16, 16, scale=0.3)},
        [normal(2, 6, 16) for _ in range(2)],
        QConfig(attention=Scheme(granularity="token")),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_realized_programs_compute_on_the_device_what_they_compute_on_the_cpu(case):
    f, params, data, cfg = CASES[case]
    cpu = jax.devices("cpu")[0]
    qf = Q(f, params, calibration=[(x,) for x in data], config=cfg, progress=False)
    here = np.asarray(jax.jit(qf.apply)(qf.params, data[0]))  # (float parts: f32, conftest)
    with PassContext(config={"quantize.tuning": Q.tuning(platform="cpu")}):
        there = jax.jit(qf.apply)(jax.device_put(qf.params, cpu), jax.device_put(data[0], cpu))
    assert not Q.tuning().s8_dot  # (the GPU's route)
    np.testing.assert_allclose(here, np.asarray(there), rtol=1e-5, atol=1e-5 * np.abs(here).max())
