"""Timing variants of one computation the way that survives a noisy machine: interleaved.

"Float first, then int8" on a shared machine can be off by 3x (load from elsewhere falls on one
variant only). :func:`compare_timing` calls every variant once per round, round after round, on
the same inputs, and reports each one's median time and the median of its per-round time ratio to
the first variant, with a bootstrap interval: two calls of one round ran under the same load, so
their ratio is what a re-run reproduces. Each round calls the variants in a fresh random order: in
a fixed order, the variant called first ran measurably slower (a function timed against itself
came out 1.01x-1.5x "faster", with intervals excluding 1).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
    """One variant's timing."""

    name: str
    """The variant's name (a key of the mapping given to :func:`compare_timing`)."""
    ms: float
    """Median time of one call, in milliseconds."""
    speedup: float
    """Median over rounds of (first variant's time / this variant's time): above 1 is faster."""
    interval: tuple[float, float]
    """Bootstrap 95% interval of ``speedup`` (the rounds resampled)."""
    times: tuple[float, ...]
    """Every call's time in seconds, in round order."""


@dataclasses.dataclass(frozen=True)
class TimingTable:
    """What :func:`compare_timing` measured: one :class:`Timing` per variant, the first the
    baseline. ``print()`` it for a table; ``table["int8"]`` is one row."""

    rows: tuple[Timing, ...]
    """The variants in the order given."""

    def __getitem__(self, name: str) -> Timing:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no variant {name!r}; variants: {[r.name for r in self.rows]}")

    def __str__(self) -> str:
        width = max(len(r.name) for r in self.rows)
        lines = [f"{'variant':<{width}}  {'median ms':>10}  {'speed-up (95% interval)':>24}"]
        for r in self.rows:
            lo, hi = r.interval
            lines.append(
                f"{r.name:<{width}}  {r.ms:>10.3f}  {r.speedup:>8.2f}x ({lo:.2f}-{hi:.2f})"
            )
        base = self.rows[0].name
        lines.append(f"(speed-up: median per-round {base} time / variant time; calls interleaved)")
        return "\n".join(lines)


def compare_timing(
    variants: Mapping[str, Callable[..., Any]],
    *args: Any,
    rounds: int = 30,
    warmup: int = 2,
    seed: int = 0,
) -> TimingTable:
    """Time every variant on ``args``, interleaved: each round calls each variant once, in a
    random order (the first variant given is the baseline of the speed-ups), waiting for its
    result.

    Example::

        table = jaxq.compare_timing(
            {"float": lambda x: f_jit(params, x), "int8": lambda x: q_jit(qf.params, x)}, x
        )
        print(table)                        # median ms and paired speed-up of each variant
        table["int8"].speedup

    Args:
      variants: name -> function of ``args``; jit them first (compile time is not timed, but
        ``warmup`` calls are made before timing).
      rounds: how many calls of each variant are timed.
      seed: of each round's call order and of the bootstrap resampling.
    """
    if not variants:
        raise ValueError("compare_timing: give at least one variant (name -> function)")
    if rounds < 1:
        raise ValueError(f"compare_timing: rounds must be >= 1; got {rounds}")
    fns = dict(variants)
    for f in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(f(*args))
    times: dict[str, list[float]] = {k: [] for k in fns}
    rng = np.random.default_rng(seed)
    names = list(fns)
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            t0 = time.perf_counter()
            jax.block_until_ready(fns[names[i]](*args))
            times[names[i]].append(time.perf_counter() - t0)
    base = np.asarray(times[names[0]])
    picks = rng.integers(0, rounds, size=(1000, rounds))
    rows = []
    for k, ts in times.items():
        ratios = base / np.asarray(ts)
        lo, hi = np.percentile(np.median(ratios[picks], axis=1), [2.5, 97.5])
        rows.append(
            Timing(
                k,
                1e3 * statistics.median(ts),
                float(np.median(ratios)),
                (float(lo), float(hi)),
                tuple(ts),
            )
        )
    return TimingTable(tuple(rows))
