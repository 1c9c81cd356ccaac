"""jaxq: a functional compiler toolkit whose IR is JAX's jaxpr."""

from jaxq import transform as transform
from jaxq._program import Equation as Equation
from jaxq._program import Program as Program
from jaxq._program import TraceError as TraceError
from jaxq._program import trace as trace
from jaxq._serialize import LoadedProgram as LoadedProgram
from jaxq._serialize import LoadError as LoadError
from jaxq._serialize import load as load

__version__ = "0.1.0"
