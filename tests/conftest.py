"""Strict, deterministic test environment (model: equinox/tests/conftest.py)."""

import os

# Four simulated CPU devices for placement and sharding tests; must be set before jax starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402
from strategies import examples  # noqa: E402

hypothesis.settings.register_profile(
    "jaxq",
    derandomize=True,
    database=None,
    max_examples=examples(20),
    deadline=None,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxq"))


import jax  # noqa: E402
import pytest  # noqa: E402

from jaxq.quantize import tuning  # noqa: E402
from jaxq.transform import PassContext  # noqa: E402

if jax.default_backend() != "cpu":
    # The suite's tolerances are IEEE float32 facts; GPUs round f32 matmul operands to TF32 by
    # default (docs/quantize.md), which moves simulated results by about 1e-3.
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _xla_cpu(request):
    """Tests marked ``xla_cpu`` compare with XLA:CPU's own kernels or choices: on a machine whose
    default backend is another, they run on its CPU device with the CPU tuning entry."""
    if request.node.get_closest_marker("xla_cpu") is None or jax.default_backend() == "cpu":
        yield
        return
    with (
        jax.default_device(jax.devices("cpu")[0]),
        PassContext(config={"quantize.tuning": tuning(platform="cpu")}),
    ):
        yield
