"""An int8 KV cache: a decode loop's cache carried as int8 codes with one scale per position and
head (``QConfig(kv_cache=True)``).

A cache is a carry of a ``lax.scan`` that the body writes with ``lax.dynamic_update_slice`` (the
keys or values of the current step) and returns: the pattern of every KV-cache decode loop. Inside
the body it is a :class:`KVCache`; the write quantizes only the update (each vector along the last
axis, a head's keys or values at one position, gets its own symmetric scale), every other use reads
the dequantized cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxq import _compat as C
from jaxq.quantize._arith import codes, range_to_qparams
from jaxq.quantize._config import Scheme

SCHEME = Scheme(symmetric=True, narrow_range=True)
"""The cache's scheme: int8, symmetric, codes in [-127, 127]."""


@dataclasses.dataclass(frozen=True)
class KVCache:
    """A cache inside a decode loop's body: ``codes * scale`` in ``dtype``."""

    codes: jax.Array  # int8, the cache's shape
    scale: jax.Array  # float32, the cache's shape with its last axis 1
    dtype: Any

    @classmethod
    def of(cls, x: Any) -> KVCache:
        codes, scale = quantize_rows(x)
        return cls(codes, scale, jnp.asarray(x).dtype)

    def dequantize(self) -> jax.Array:
        return (self.codes.astype(jnp.float32) * self.scale).astype(self.dtype)

    def update(self, new: Any, starts: list[Any]) -> KVCache:
        """``lax.dynamic_update_slice(cache, new, starts)`` on the codes and scales."""
        codes, scale = quantize_rows(new)
        return KVCache(
            lax.dynamic_update_slice(self.codes, codes, starts),
            lax.dynamic_update_slice(self.scale, scale, [*starts[:-1], jnp.zeros_like(starts[-1])]),
            self.dtype,
        )


def quantize_rows(x: Any) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 codes of ``x`` with one scale per vector along the last axis, with the
    quantize arithmetic of every scheme (all-zero vectors, such as unwritten cache positions, get
    scale 1; NaN or Inf makes the scale NaN, so the vector reads back as NaN)."""
    xf = jnp.asarray(x).astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    scale, zp = range_to_qparams(-amax, amax, SCHEME)
    return codes(xf, scale, zp, SCHEME).astype(jnp.int8), scale + amax * 0


def cache_carries(body: Any, n_consts: int, n_carry: int) -> list[int]:
    """The carries of a scan body that it writes with ``dynamic_update_slice`` and returns (the
    written cache is the new carry), directly or through an inner scan that takes the cache as
    ``xs`` (a layer stack, one cache per layer) and writes each slice."""
    jaxpr = C.as_closed(body).jaxpr
    return [c for c in range(n_carry) if _written(jaxpr, n_consts + c, c)]


def _written(jaxpr: Any, i: int, o: int) -> bool:
    """Whether output ``o`` of ``jaxpr`` is its float input ``i`` with whole vectors written in
    (an integer buffer, e.g. of token ids, is never a cache: its values are not scaled)."""
    var, out = jaxpr.invars[i], jaxpr.outvars[o]
    if not jnp.issubdtype(var.aval.dtype, jnp.floating):
        return False
    producers = {id(v): (e, k) for e in jaxpr.eqns for k, v in enumerate(e.outvars)}
    hit = producers.get(id(out))
    if hit is None:
        return False
    e, k = hit
    if e.primitive.name == "dynamic_update_slice" and e.invars[0] is var:
        cache, new = (v.aval.shape for v in e.invars[:2])
        return bool(cache) and new[-1] == cache[-1]  # whole vectors written (a scale each)
    if e.primitive.name == "scan":
        n_consts, n_carry = C.scan_counts(e.params)
        operands = [j for j, v in enumerate(e.invars) if v is var]
        inner = C.as_closed(e.params[C.SCAN_BODY]).jaxpr
        return k >= n_carry and any(
            j >= n_consts + n_carry and _written(inner, j, k) for j in operands
        )
    return False
