"""jaxq: a functional compiler toolkit whose IR is JAX's jaxpr."""

from jaxq import annotate as annotate
from jaxq import partition as partition
from jaxq import transform as transform
from jaxq._nnx import module_scopes as module_scopes
from jaxq._offload import OffloadedFunction as OffloadedFunction
from jaxq._offload import OffloadWarning as OffloadWarning
from jaxq._offload import offload as offload
from jaxq._program import Equation as Equation
from jaxq._program import Program as Program
from jaxq._program import TraceError as TraceError
from jaxq._program import trace as trace
from jaxq._serialize import LoadedProgram as LoadedProgram
from jaxq._serialize import LoadError as LoadError
from jaxq._serialize import load as load
from jaxq._sharding import constant_shardings as constant_shardings
from jaxq._sharding import split_constants as split_constants
from jaxq._taps import intermediates as intermediates
from jaxq._timing import Timing as Timing
from jaxq._timing import TimingTable as TimingTable
from jaxq._timing import compare_timing as compare_timing
from jaxq.partition import build as build
from jaxq.quantize import QArray as QArray
from jaxq.quantize import QConfig as QConfig
from jaxq.quantize import QuantizedFunction as QuantizedFunction
from jaxq.quantize import Rule as Rule
from jaxq.quantize import Scheme as Scheme
from jaxq.quantize import quantize as quantize  # a function, and the namespace of its passes
from jaxq.quantize._shard import param_shardings as param_shardings

__version__ = "0.1.0"
