"""Partitioning for external compilers (TVM's bring-your-own-codegen flow) and device placement.

register_op_support("dnnl", "dot_general")          # what each compiler supports
pipeline = Sequential([annotate_target(["dnnl"]),     # one region per supported equation
                       merge_compiler_regions(),      # merge neighbours, never a cycle
                       partition_graph()])            # each region -> jit named dnnl_main_0
fn = build(pipeline(program), backends={"dnnl": "host"})
"""

from jaxq.partition._annotate_target import annotate_target as annotate_target
from jaxq.partition._backends import BackendError as BackendError
from jaxq.partition._backends import UnknownBackendError as UnknownBackendError
from jaxq.partition._backends import register_backend as register_backend
from jaxq.partition._backends import registered_backends as registered_backends
from jaxq.partition._backends import unregister_backend as unregister_backend
from jaxq.partition._backends import xla_backend as xla_backend
from jaxq.partition._build import BackendFallbackWarning as BackendFallbackWarning
from jaxq.partition._build import build as build
from jaxq.partition._composite import Match as Match
from jaxq.partition._composite import Pattern as Pattern
from jaxq.partition._composite import is_constant as is_constant
from jaxq.partition._composite import is_op as is_op
from jaxq.partition._composite import merge_composite as merge_composite
from jaxq.partition._composite import wildcard as wildcard
from jaxq.partition._merge import merge_compiler_regions as merge_compiler_regions
from jaxq.partition._onnx import OrtRegion as OrtRegion
from jaxq.partition._onnx import export_onnx as export_onnx
from jaxq.partition._ops import backend_ops as backend_ops
from jaxq.partition._ops import register_backend_support as register_backend_support
from jaxq.partition._partition_graph import RegionInfo as RegionInfo
from jaxq.partition._partition_graph import partition_graph as partition_graph
from jaxq.partition._partition_graph import regions as regions
from jaxq.partition._placement import plan_devices as plan_devices
from jaxq.partition._regions import AnnotationError as AnnotationError
from jaxq.partition._regions import PartitionError as PartitionError
from jaxq.partition._support import UnknownCompilerError as UnknownCompilerError
from jaxq.partition._support import register_op_support as register_op_support
from jaxq.partition._support import registered_compilers as registered_compilers
from jaxq.partition._support import unregister_compiler as unregister_compiler
