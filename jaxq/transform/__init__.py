"""Passes and the machinery to compose and instrument them."""

from jaxq._walk import RewriteError as RewriteError
from jaxq._walk import Visit as Visit
from jaxq._walk import interpret as interpret
from jaxq._walk import map_equations as map_equations
from jaxq._walk import rewrite as rewrite
from jaxq.transform._basic import fold_constants as fold_constants
from jaxq.transform._basic import identity as identity
from jaxq.transform._basic import infer_layouts as infer_layouts
from jaxq.transform._basic import name_expressions as name_expressions
from jaxq.transform._basic import strip_annotations as strip_annotations
from jaxq.transform._instruments import NumericCheck as NumericCheck
from jaxq.transform._instruments import PassError as PassError
from jaxq.transform._instruments import PassTiming as PassTiming
from jaxq.transform._instruments import PrintIR as PrintIR
from jaxq.transform._instruments import WellFormed as WellFormed
from jaxq.transform._loops import unroll_loops as unroll_loops
from jaxq.transform._pass import FunctionPass as FunctionPass
from jaxq.transform._pass import Pass as Pass
from jaxq.transform._pass import PassContext as PassContext
from jaxq.transform._pass import Sequential as Sequential
from jaxq.transform._pass import program_pass as program_pass
from jaxq.transform._pass import register_config as register_config
