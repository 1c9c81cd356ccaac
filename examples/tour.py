"""A tour of jaxq's foundation on real data: trace a CNN, run passes, read names and layouts.

Trains a small CNN on scikit-learn's digits (shipped with the package, no download) in seconds,
traces it into a jaxq Program, runs a pipeline of passes under instruments (timing, a numeric
check on real images, well-formedness), and shows the result is an ordinary JAX function.

Run: python examples/tour.py
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import jax
import numpy as np

import jaxq
from jaxq import transform as T

sys.path.insert(0, str(Path(__file__).parent))
import digits  # noqa: E402
from digits import cnn  # noqa: E402


def main() -> None:
    data = digits.load()
    x_test, y_test = data.x_test, data.y_test
    t0 = time.perf_counter()
    params = digits.train("cnn", data)
    acc = digits.accuracy(jax.jit(functools.partial(cnn, params)), x_test, y_test)
    print(f"trained CNN in {time.perf_counter() - t0:.1f}s; float test accuracy {acc:.4f}")

    program = jaxq.trace(cnn, params, x_test[:64])
    print(f"\ntraced: {program!r}")

    pipeline = T.Sequential([T.identity(), T.name_expressions(), T.infer_layouts()], name="tour")
    timing = T.PassTiming()
    checks = [T.NumericCheck(params, x_test[:64], rtol=0, atol=0), T.WellFormed()]
    with T.PassContext(instruments=[timing, *checks]):
        program = pipeline(program)
    print("\npasses (numerics checked bit-exact on 64 real test images after each):")
    print(timing)

    print("\nequations with layouts (first 12):")
    for e in list(program.equations())[:12]:
        print(f"  {e.name:<38} {e.primitive:<22} in={e.in_layouts} out={e.out_layouts}")

    fun = program.as_fun()
    logits = jax.jit(fun)(params, x_test[:64])
    same = np.array_equal(np.asarray(logits), np.asarray(jax.jit(cnn)(params, x_test[:64])))
    print(f"\njit(program.as_fun()) equals jit(cnn) bit for bit: {same}")
    single = jaxq.trace(cnn, params, x_test[:1]).as_fun()  # a Program is specialised to its shapes
    per_example = jax.vmap(single, in_axes=(None, 0))(params, x_test[:64, None])
    print(f"vmap of a batch-1 program over 64 images: output {per_example.shape}")
    hlo = jax.jit(fun).lower(params, x_test[:64]).as_text(debug_info=True)
    print(f"stable names in XLA metadata: {'CNN/Conv_1/conv_general_dilated' in hlo}")
    print("\nIR (first 14 lines):")
    print("\n".join(str(program).splitlines()[:14]))


if __name__ == "__main__":
    main()
