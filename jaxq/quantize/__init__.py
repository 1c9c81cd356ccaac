"""Quantization: schemes as data, and the annotate / calibrate / realize passes.

``jaxq.quantize`` is both this package and a function::

    qf = jaxq.quantize(functools.partial(model.apply, params), calibration=[(x,) for x in batches])
    qf(x)                 # int8 x int8 -> int32 code; jax.jit / jax.vmap work
    print(qf.report())    # what was quantized, and how

The three phases are passes, usable alone on a Program::

    q = jaxq.quantize
    pipeline = jaxq.transform.Sequential([q.annotate(cfg), q.calibrate(data), q.realize()])
    program = pipeline(jaxq.trace(f, x))
"""

import sys as _sys
import types as _types

from jaxq.quantize._annotate import annotate as annotate
from jaxq.quantize._api import LayerReport as LayerReport
from jaxq.quantize._api import QuantizedFunction as QuantizedFunction
from jaxq.quantize._api import Report as Report
from jaxq.quantize._api import quantize as quantize
from jaxq.quantize._calibrate import calibrate as calibrate
from jaxq.quantize._config import QConfig as QConfig
from jaxq.quantize._config import Rule as Rule
from jaxq.quantize._config import Scheme as Scheme
from jaxq.quantize._lower import QuantizeError as QuantizeError
from jaxq.quantize._realize import realize as realize
from jaxq.quantize._sensitivity import SensitivityResult as SensitivityResult
from jaxq.quantize._sensitivity import sensitivity as sensitivity


class _CallableModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003
        return quantize(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
