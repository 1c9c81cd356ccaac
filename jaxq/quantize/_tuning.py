"""Which integer lowering realize picks, per XLA build: kernel facts measured per jaxlib version.

realize chooses, per layer, between XLA:CPU's int8 x int8 -> int32 kernels and exact integer sums
carried in float32 (bit-exact while they stay below 2**24). Which one is faster is a measured fact
about one XLA build, not about jaxq: the same s8 dot (256 x 1024 x 1024) takes 0.7x of f32's time
on jax 0.10.2 and 0.33x on 0.12, and kernels that are slow in one build may not be in the next.
``benchmarks/bench_kernels.py`` measures the facts on the running jaxlib and prints the entry they
imply. The CPU matters too: x86 processors with VNNI run int8 dots and convolutions faster,
relative to float, than those without (AVX2). This table holds one entry per version for each, and
of the entries for this CPU, the newest not newer than the running jax is used (the oldest for
older versions). A GPU has an entry of its own (``GPU``).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxq import _compat as C
from jaxq import _cpu
from jaxq.transform import PassContext, register_config


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Thresholds of realize's lowering choices (all measured on XLA:CPU, see the module doc)."""

    float_carry_max_rows: int
    """Matmuls with at most this many activation rows carry their exact integer sums in f32
    instead of running the s8 kernel (0: never)."""
    s8_conv_min_channels: int
    """Channels-last convolutions run the s8 kernel when their input or output channels reach
    this; narrower ones carry their sums in f32 (measured: 16 -> 16 and 16 -> 8 run 3-7x slower
    in s8 than in f32, 32 -> 16 and 4 -> 32 do not)."""
    s8_pooled_conv_min_channels: int = 17
    """The same for a convolution whose output reaches a max pooling through elementwise ops (a
    bias, ReLU): XLA:CPU fuses a float convolution with such an epilogue and pooling into one
    kernel, which the s8 convolution's int32 output does not get (measured on jax 0.10.2, batch
    256: 32 -> 32 with its pooling 1.45x float's time in s8, 0.93x carried in f32)."""
    pool_codes: bool = False
    """Max pooling between a convolution and the next quantized layer runs on int8 codes (else in
    float, before the next layer quantizes the pooled tensor: XLA:CPU fuses it with the
    convolution's epilogue: bench_quantize's CNN at batch 256 on jax 0.12 went from 1.17x to
    1.46x of float's speed)."""
    s8_pad_single_row: bool = True
    """A one-row matmul that does not carry f32 sums runs the s8 kernel on its row twice (some
    builds widen a one-row s8 dot to s32)."""
    conv_taps_max: int = 16
    """Convolutions with at most this many products per output (kernel positions x input channels,
    e.g. a 3x3 kernel on one channel) run as shifted slices times weight rows in one fused loop."""
    s8_conv: bool = True
    """The platform has an int8 x int8 -> int32 convolution. XLA:GPU has none (it widens the
    operands to s32, which cuDNN does not convolve: the program fails to compile), so there every
    convolution carries its exact integer sums in f32, in input-channel chunks whose sums stay
    below 2**24, added in int32."""
    weights_in_turn: bool = True
    """Each layer converts (or unpacks) its weight param only once the activation it multiplies
    is computed (an ``optimization_barrier``): XLA:CPU on jax 0.12 otherwise converts every
    layer's weight first and holds them all (weight-only W8, eight 1024 x 1024 layers at batch
    1: 32 MiB of temporaries and 0.16x float's speed, against 4 MiB and 0.93x). jax 0.10.2's XLA
    drops the barrier, so it changes nothing there."""
    weight_pieces: int = 128
    """Matmuls whose output is smaller than their weight (few rows) and that multiply a float
    dequantized weight (weight-only, or grouped scales) dequantize it this many contracted rows
    at a time in a loop, in cache, instead of writing the whole float weight out on every call
    (0: whole). ``bench_kernels.py --pieces-only`` (two weight-only 2048 -> 8192 -> 2048 blocks,
    jax 0.12): at 1, 8 and 64 rows 3.4x, 1.6x and 1.5x float's time whole, 0.98x, 0.42x and 0.97x
    in pieces of 128 (64 and 256 within noise of it); on 0.10.2, 6.8x, 2.7x and 2.1x against
    0.84x, 0.48x and 1.04x. A lone layer shows no difference."""
    conv_im2col_bytes: tuple[int, int] = (256 << 10, 4 << 20)
    """Channels-last int8 convolutions (one group, no input dilation) whose windows' codes,
    side by side, take this many bytes (from, to) run as one s8 dot on them (im2col) instead of
    XLA's s8 convolution ((0, 0): never). Measured on a 2-core AVX2 machine, interleaved, f32
    time over int8 time, int8 codes in and int32 sums out: 256 x 8 x 8, 3 x 3, 16 -> 32 (2.4 MB
    of windows) 1.27x as an s8 convolution, 1.97x as a dot on jax 0.12 (1.11x, 1.41x on
    0.10.2); 32 -> 64 1.16x, 1.18x (1.18x, 1.87x); 16 -> 16, whose s8 convolution takes 7x f32's
    time, 1.05x as a dot (1.09x); 8 x 28 x 28, 128 -> 128 (7 MB) 1.38x, 1.35x (1.13x, 1.23x);
    32 x 56 x 56, 64 -> 64 (58 MB) 1.32x, 0.55x (1.14x, 0.87x). In the digits CNN at batch 256
    on jax 0.12, 0.95x float's speed against 0.83x; at batch 1 the windows' slices cost more
    than they save (bench_quantize's CNN 0.87x against 1.01x), hence the lower bound."""
    s8_dot: bool = True
    """The platform's int8 x int8 -> int32 dot gives exact sums. XLA:GPU's did not for some
    shapes (jax 0.11.2 on an H200: a contraction of 3 run by cuBLAS, an 18 x 16 x 8 dot fused
    into a Triton GEMM), so there the sums of every int8 dot are carried in f32 as well, in
    chunks of the contracted axis."""


TABLE: tuple[tuple[tuple[int, ...], bool, Tuning], ...] = (
    # (jax version measured on, VNNI, its entry), 2-core x86, by benchmarks/bench_kernels.py.
    # Convolutions: 16 -> 16 and 16 -> 8 run 3-7x slower in s8 than f32 on both versions, 32 -> 16
    # and 4 -> 32 do not. Followed by a max pooling, the f32 sums fuse with it and are faster at
    # every measured width on 0.10.2; on 0.12 s8 still is from 17 channels with VNNI. Without
    # VNNI (an AVX2 EPYC) on 0.12, 16 -> 32 with its pooling took 1.35-1.39x float's time in s8
    # and 0.96-0.99x in f32 sums, 32 -> 64 1.05x and 0.91x, 64 -> 64 0.80x and 0.89x: lone
    # layers put the threshold at 33 or 65 alike, whole models at 65 (bench_quantize's CNN,
    # 32 -> 64, at batch 256: 0.94x float's speed against 0.82x in s8; the main job's CNN,
    # 16 -> 32, 1.07-1.09x against 0.95-0.97x). One-row matmuls: the three routes are within
    # +-10% of each other in whole models at batch 1 (dispatch dominates), except that
    # duplicating the row cost 1.9x in a 64-512-512-10 MLP with biases and constant weights on
    # both versions: f32 sums, on both.
    (
        (0, 10, 2),
        True,
        Tuning(float_carry_max_rows=1, s8_conv_min_channels=17, s8_pooled_conv_min_channels=65),
    ),
    (
        (0, 12, 0),
        True,
        Tuning(float_carry_max_rows=1, s8_conv_min_channels=17, s8_pooled_conv_min_channels=17),
    ),
    (
        (0, 10, 2),
        False,
        Tuning(float_carry_max_rows=1, s8_conv_min_channels=17, s8_pooled_conv_min_channels=65),
    ),
    (
        (0, 12, 0),
        False,
        Tuning(float_carry_max_rows=1, s8_conv_min_channels=17, s8_pooled_conv_min_channels=65),
    ),
)


GPU = Tuning(
    float_carry_max_rows=0,
    s8_conv_min_channels=0,
    s8_pad_single_row=False,
    s8_conv=False,
    s8_dot=False,
    weight_pieces=0,
)
"""The entry on a GPU (any jax version). ``s8_conv`` and ``s8_dot`` are facts (seen on an H100 and
an H200 with jax 0.11.2); the rest is not measured (the one-row routes above work around XLA:CPU
kernels)."""


register_config(
    "quantize.tuning",
    Tuning | None,
    "realize's lowering choices (an entry measured on another machine; default: the table's "
    "entry for the running jax)",
)


def current_tuning() -> Tuning:
    """What realize uses: ``PassContext(config={"quantize.tuning": Tuning(...)})`` where given
    (an entry measured on another machine), else the table's entry for the running jax."""
    given = PassContext.current().config.get("quantize.tuning")
    return tuning() if given is None else given


def tuning(
    version: tuple[int, ...] | None = None, platform: str | None = None, vnni: bool | None = None
) -> Tuning:
    """The entry for ``version`` (default: the running jax) on ``platform`` (default: JAX's
    default backend, where realize's program will run): :data:`GPU` on ``"gpu"``, else of the
    entries measured with (``vnni``; default: whether this CPU has it, assumed where it cannot
    be told) or without VNNI, the newest measured on a version not newer than ``version``, or the
    oldest for older versions."""
    if (jax.default_backend() if platform is None else platform) == "gpu":
        return GPU
    v = C.JAX_VERSION if version is None else tuple(version)
    with_vnni = (_cpu.x86_vnni() is not False) if vnni is None else vnni
    entries = [(measured_on, t) for measured_on, vn, t in TABLE if vn == with_vnni]
    entry = entries[0][1]
    for measured_on, t in entries:
        if measured_on <= v:
            entry = t
    return entry
