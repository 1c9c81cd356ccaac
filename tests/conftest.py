"""Strict, deterministic test environment (model: equinox/tests/conftest.py)."""

import os

# Four simulated CPU devices for placement and sharding tests; must be set before jax starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "jaxq",
    derandomize=True,
    database=None,
    max_examples=20,
    deadline=None,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jaxq"))
