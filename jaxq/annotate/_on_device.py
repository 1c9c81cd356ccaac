"""`on_device`: mark the device a value's computation should run on."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from ._identity import annotate_tangents, as_array, identity_annotation

on_device_p = identity_annotation("on_device")
# The derivative of work placed on a device is placed there too.
annotate_tangents(on_device_p)


def canonical_device(device: jax.Device | str, who: str = "on_device") -> str:
    """Normalise `device` to `"platform:index"`, the index counting within `jax.devices(platform)`.

    A string, not a `jax.Device`, is what the primitive carries: it is hashable, prints in jaxprs
    and means the same thing in a process that has not created the device object yet.
    """
    if isinstance(device, jax.Device):
        return f"{device.platform}:{jax.devices(device.platform).index(device)}"
    if not isinstance(device, str):
        raise TypeError(f"{who}: device must be a jax.Device or a string; got {device!r}")
    platform, _, index = device.lower().partition(":")
    try:
        devices = jax.devices(platform)
        i = int(index) if index else 0
    except (RuntimeError, ValueError):
        devices, i = [], -1
    if not 0 <= i < len(devices):
        available = ", ".join(f"{d.platform}:{k}" for k, d in enumerate(jax.devices()))
        raise ValueError(f"{who}: device must be one of {available}; got {device!r}")
    # The device's own platform name, so "cuda:0" and "gpu:0" give the same param.
    return f"{devices[i].platform}:{i}"


def on_device(x: ArrayLike, device: jax.Device | str) -> jnp.ndarray:
    """Return `x`, marking that its computation runs on `device` (e.g. `"cpu:1"` or a `jax.Device`).

    Placement is carried out by a later pass; the annotation itself moves nothing.
    """
    return on_device_p.bind(as_array(x, "on_device"), device=canonical_device(device))
