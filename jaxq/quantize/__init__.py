"""Quantization: schemes as data, the annotate / calibrate / realize passes, quantized params.

``jaxq.quantize`` is a function (see :func:`jaxq.quantize._api.quantize`)::

    qf = jaxq.quantize(model.apply, params, calibration=[(x,) for x in batches])
    y = jax.jit(qf.apply)(qf.params, x)   # int8 x int8 -> int32 code; weights are arguments
    print(qf.report())                    # what was quantized, and how

and a namespace: the three phases are passes, usable alone on a Program (``jaxq.quantize`` is
exactly their ``Sequential``)::

    q = jaxq.quantize
    pipeline = jaxq.transform.Sequential(
        [q.annotate(cfg, params_argnum=0), q.calibrate([(params, x) for x in batches]), q.realize()]
    )
    program = pipeline(jaxq.trace(model.apply, params, x))
"""

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from jaxq.quantize import _tuning
from jaxq.quantize._annotate import annotate as annotate
from jaxq.quantize._api import QuantizedFunction as QuantizedFunction
from jaxq.quantize._api import quantize as _quantize
from jaxq.quantize._calibrate import calibrate as calibrate
from jaxq.quantize._config import QConfig as QConfig
from jaxq.quantize._config import Rule as Rule
from jaxq.quantize._config import Scheme as Scheme
from jaxq.quantize._qarray import QArray as QArray
from jaxq.quantize._realize import realize as realize
from jaxq.quantize._report import LayerReport as LayerReport
from jaxq.quantize._report import Report as Report
from jaxq.quantize._sensitivity import SensitivityResult as SensitivityResult
from jaxq.quantize._sensitivity import sensitivity as sensitivity
from jaxq.quantize._state import QuantizeError as QuantizeError
from jaxq.quantize._tuning import Tuning as Tuning
from jaxq.quantize._tuning import tuning as tuning

NAMESPACE = {
    "annotate": annotate,
    "calibrate": calibrate,
    "realize": realize,
    "sensitivity": sensitivity,
    "QConfig": QConfig,
    "Rule": Rule,
    "Scheme": Scheme,
    "QArray": QArray,
    "QuantizedFunction": QuantizedFunction,
    "QuantizeError": QuantizeError,
    "Report": Report,
    "LayerReport": LayerReport,
    "SensitivityResult": SensitivityResult,
    "Tuning": Tuning,
    "tuning": tuning,
}
"""What ``jaxq.quantize.<name>`` reaches besides the call itself."""


class Quantize(Protocol):
    """The type of ``jaxq.quantize``: the function, and the namespace of its passes."""

    def __call__(
        self,
        f: Callable[..., Any],
        params: Any = None,
        *,
        calibration: Iterable[Any] | None = None,
        config: QConfig | None = None,
        mode: str = "realize",
        weight_argnums: int | Iterable[int] = (),
        example_args: tuple[Any, ...] | None = None,
        progress: bool = True,
        max_batches: int | None = None,
    ) -> QuantizedFunction: ...

    annotate: Callable[..., Any]
    calibrate: Callable[..., Any]
    realize: Callable[..., Any]
    sensitivity: Callable[..., Any]
    QConfig: type[QConfig]
    Rule: type[Rule]
    Scheme: type[Scheme]
    QArray: type[QArray]
    QuantizedFunction: type[QuantizedFunction]
    QuantizeError: type[QuantizeError]
    Report: type[Report]
    LayerReport: type[LayerReport]
    SensitivityResult: type[SensitivityResult]
    Tuning: type[Tuning]
    tuning: Callable[..., _tuning.Tuning]


for _name, _value in NAMESPACE.items():
    setattr(_quantize, _name, _value)
quantize: Quantize = _quantize  # type: ignore[assignment]  # (the attributes were set above)
