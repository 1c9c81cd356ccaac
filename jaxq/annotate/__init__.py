"""Annotation primitives: values marked with placement, quantization, regions and fusion barriers.

TVM Relay's annotation namespace as real JAX primitives, so annotations survive tracing, `jit`,
`vmap`, `grad` and `jax.export`, and passes read them from the jaxpr.
"""

from ._cast_hint import cast_hint as cast_hint
from ._cast_hint import cast_hint_p as cast_hint_p
from ._compiler_region import (
    compiler_begin as compiler_begin,
)
from ._compiler_region import (
    compiler_begin_p as compiler_begin_p,
)
from ._compiler_region import (
    compiler_end as compiler_end,
)
from ._compiler_region import (
    compiler_end_p as compiler_end_p,
)
from ._on_device import on_device as on_device
from ._on_device import on_device_p as on_device_p
from ._registry import (
    IDENTITY_ANNOTATIONS as IDENTITY_ANNOTATIONS,
)
from ._registry import (
    AnnotationOp as AnnotationOp,
)
from ._registry import (
    is_annotation as is_annotation,
)
from ._registry import (
    registry as registry,
)
from ._simulated_quantize import (
    quant_range as quant_range,
)
from ._simulated_quantize import (
    simulated_quantize as simulated_quantize,
)
from ._simulated_quantize import (
    simulated_quantize_p as simulated_quantize_p,
)
from ._stop_fusion import stop_fusion as stop_fusion
from ._stop_fusion import stop_fusion_p as stop_fusion_p
