"""An ``nn.scan`` layer stack offloaded: the loop left with XLA against it unrolled into ONNX Runtime.

A flax linen transformer (6 pre-LN blocks, width 256, 4 heads, 32 tokens) whose blocks run as one
``nn.scan`` over stacked params, the way big JAX models keep their layers. ONNX Runtime cannot run
a loop: with ``jaxq.offload(qf, max_unroll=0)`` the scan stays with XLA (only what is outside it
is offloaded), with the default the scan is unrolled (``jaxq.transform.unroll_loops``) and every
layer joins the ONNX Runtime region. Variants are called round by round on the same inputs
(paired speed-ups over float XLA); accuracy is the cosine of each output to float's.

Set up: pip install -e '.[onnx]' flax
Run:    python benchmarks/bench_scan_stack.py [--rounds 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxq


def model() -> Any:
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=256)(h, h)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(256)(nn.gelu(nn.Dense(1024)(h))), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            scan = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=6
            )
            return scan()(x, None)[0]

    return Stack()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    m, rng = model(), np.random.default_rng(0)
    data = lambda b: jnp.asarray(rng.standard_normal((b, 32, 256)), jnp.float32)
    x = data(16)
    params = m.init(jax.random.PRNGKey(0), x)
    calib = [(data(16),) for _ in range(4)]
    qf = jaxq.quantize(m.apply, params, calibration=calib, progress=False)
    apply, qapply = jax.jit(m.apply), jax.jit(qf.apply)
    variants = {
        "float XLA": lambda x: apply(params, x),
        "W8A8 XLA": lambda x: qapply(qf.params, x),
        "W8A8 -> ORT, scan left to XLA": jax.jit(jaxq.offload(qf, max_unroll=0)),
        "W8A8 -> ORT, unrolled": jax.jit(jaxq.offload(qf)),
    }
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxq.OffloadWarning)  # (the scan, where it stays)
        for batch in (16, 1):
            xb = x[:batch]
            ref = np.asarray(variants["float XLA"](xb)).ravel()
            table = jaxq.compare_timing(variants, xb, rounds=args.rounds * (1 if batch > 1 else 5))
            for t in table.rows:
                y = np.asarray(variants[t.name](xb)).ravel()
                cos = float(y @ ref / np.linalg.norm(y) / np.linalg.norm(ref))
                row = {"batch": batch, "variant": t.name, "ms": t.ms, "speedup": t.speedup}
                rows.append({**row, "interval": list(t.interval), "cosine": cos})
    print(f"nn.scan transformer (6 blocks, 256 wide, 32 tokens), jax {jax.__version__}; speed-up:")
    print("median per-round float XLA time / variant time (95% interval), round by round")
    print(f"{'batch':>5}  {'variant':<31}{'ms':>8}{'speed-up':>20}{'cosine':>10}")
    for r in rows:
        lo, hi = r["interval"]
        speed = f"{r['speedup']:.2f}x ({lo:.2f}-{hi:.2f})"
        print(f"{r['batch']:>5}  {r['variant']:<31}{r['ms']:8.2f}{speed:>20}{r['cosine']:10.5f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
