"""A user's script, type-checked by CI with mypy: the public API as users call it."""

import jax
import numpy as np

import jaxq
from jaxq.quantize import Report
from jaxq.transform import Sequential


def mlp(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x @ params["w"] + params["b"]


params = {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)}
x = np.ones((2, 4), np.float32)
qf: jaxq.QuantizedFunction = jaxq.quantize(mlp, params, calibration=[(x,)], config=jaxq.QConfig())
y = jax.jit(qf.apply)(qf.params, x)
qp = qf.quantize_params(params)
report: Report = qf.report(sample=(x,))
pipeline = Sequential(
    [jaxq.quantize.annotate(jaxq.QConfig(), params_argnum=0), jaxq.quantize.realize()]
)
cfg = jaxq.quantize.QConfig(weights=jaxq.quantize.Scheme(bits=4), activations=None)
