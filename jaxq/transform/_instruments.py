"""Built-in pass instruments: timing, IR printing, numeric checking, well-formedness."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import jax
import numpy as np

from jaxq import _compat as C
from jaxq._program import Program


class PassError(Exception):
    """An instrument found a pass that broke the program; the message names the pass."""


class PassTiming:
    """Wall time of every pass run in the context. ``str(timing)`` is a table; ``.records`` the data.

    Attributes:
      records: ``(pass name, seconds)`` for every pass run, in order.
    """

    def __init__(self) -> None:
        self.records: list[tuple[str, float]] = []
        self._start: list[float] = []

    def run_before_pass(self, p: Any, program: Program) -> None:
        self._start.append(time.perf_counter())

    def run_after_pass(self, p: Any, before: Program, after: Program) -> None:
        self.records.append((p.name, time.perf_counter() - self._start.pop()))

    def summary(self) -> str:
        """A table of milliseconds and share per pass, with the total (also ``str(timing)``)."""
        total = sum(t for _, t in self.records) or 1e-12
        width = max([len(n) for n, _ in self.records] + [4])
        lines = [f"{'pass':<{width}}  {'ms':>10}  {'%':>6}"]
        for name, t in self.records:
            lines.append(f"{name:<{width}}  {t * 1e3:>10.2f}  {100 * t / total:>5.1f}%")
        lines.append(f"{'total':<{width}}  {total * 1e3:>10.2f}")
        return "\n".join(lines)

    __str__ = summary


class PrintIR:
    """Print the program before and/or after each pass."""

    def __init__(
        self, before: bool = False, after: bool = True, file: TextIO | None = None
    ) -> None:
        self.before, self.after, self.file = before, after, file

    def run_before_pass(self, p: Any, program: Program) -> None:
        if self.before:
            print(f"--- before {p.name}\n{program}", file=self.file or sys.stdout)

    def run_after_pass(self, p: Any, before: Program, after: Program) -> None:
        if self.after:
            print(f"--- after {p.name}\n{after}", file=self.file or sys.stdout)


class NumericCheck:
    """Run the program before and after every pass on example arguments; raise :class:`PassError`
    naming the pass and the first output that diverges."""

    def __init__(
        self, *example_args: Any, rtol: float = 1e-5, atol: float = 1e-6, **example_kwargs: Any
    ) -> None:
        self.args, self.kwargs = example_args, example_kwargs
        self.rtol, self.atol = rtol, atol
        self._cache: dict[int, tuple[Program, Any]] = {}

    def _outputs(self, program: Program) -> list[np.ndarray]:
        hit = self._cache.get(id(program))
        if hit is not None and hit[0] is program:
            return hit[1]
        out = jax.tree.leaves(jax.jit(program.as_fun())(*self.args, **self.kwargs))
        key = lambda o: jax.dtypes.issubdtype(o.dtype, jax.dtypes.prng_key)
        out = [np.asarray(jax.random.key_data(o) if key(o) else o) for o in out]  # (keys: bits)
        self._cache = {id(program): (program, out)}
        return out

    def run_after_pass(self, p: Any, before: Program, after: Program) -> None:
        ref, got = self._outputs(before), self._outputs(after)
        if len(ref) != len(got):
            raise PassError(
                f"pass {p.name!r} changed the number of outputs: {len(ref)} -> {len(got)}"
            )
        for i, (r, g) in enumerate(zip(ref, got, strict=True)):
            if r.shape != g.shape or r.dtype != g.dtype:
                raise PassError(
                    f"pass {p.name!r} changed output {i} from {r.dtype}{list(r.shape)} to "
                    f"{g.dtype}{list(g.shape)}"
                )
            bad = ~np.isclose(g, r, rtol=self.rtol, atol=self.atol, equal_nan=True)
            if bad.any():
                # a value that became (or stopped being) NaN or Inf first: it has no |diff|
                odd = bad & ~(np.isfinite(g) & np.isfinite(r))
                if odd.any():
                    idx = tuple(int(k) for k in np.argwhere(odd)[0])
                    what = f"{int(odd.sum())} value(s) became or stopped being NaN or Inf, first"
                else:
                    diff = np.where(bad, np.abs(g.astype(np.float64) - r.astype(np.float64)), -1)
                    idx = tuple(int(k) for k in np.unravel_index(int(np.argmax(diff)), diff.shape))
                    what = f"max |diff| {float(diff[idx]):.3g}"
                raise PassError(
                    f"pass {p.name!r} changed the numbers of output {i}: {what} at index {idx} "
                    f"(before {r[idx]!r}, after {g[idx]!r}; rtol={self.rtol}, atol={self.atol}). "
                    "Bisect the pipeline with seq[:k] to see the IR around it."
                )


class WellFormed:
    """Type-check the jaxpr (``check_jaxpr``, nested jaxprs included) after every pass, and
    check that it keeps the calling convention (the inputs' and outputs' types, unless the pass
    changed the pytree structure with them, as realize does for quantized params)."""

    def run_after_pass(self, p: Any, before: Program, after: Program) -> None:
        try:
            C.check_jaxpr(after.jaxpr.jaxpr)
        except Exception as e:
            raise PassError(f"pass {p.name!r} produced an ill-formed jaxpr: {e}") from e
        for side, tree, avals in (
            ("inputs", "in_tree", "in_avals"),
            ("outputs", "out_tree", "out_avals"),
        ):
            was, now = ([a.str_short() for a in getattr(q.jaxpr, avals)] for q in (before, after))
            if getattr(before, tree) == getattr(after, tree) and was != now:
                raise PassError(
                    f"pass {p.name!r} changed the program's {side} from {was} to {now}: "
                    "callers pass and read the traced types"
                )
