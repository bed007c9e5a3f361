"""Triton implementations of the stages in `serval.stages`: same names, signatures and numerics.

grouped_gemm: the four expert GEMMs (one persistent grouped-GEMM kernel with constexpr
epilogues); weight_grad: the grouped weight gradients over the token axis; rows: gather /
combine / sum_slots. `row_weights` is a tiny indexing op and stays the torch stage.
"""

from ..stages import row_weights
from .grouped_gemm import down, down_dgrad_swiglu, gate_up_dgrad, gate_up_swiglu
from .rows import combine, gather, sum_slots
from .weight_grad import down_weight_grad, gate_up_weight_grad

__all__ = [
    "combine",
    "down",
    "down_dgrad_swiglu",
    "down_weight_grad",
    "gate_up_dgrad",
    "gate_up_swiglu",
    "gate_up_weight_grad",
    "gather",
    "row_weights",
    "sum_slots",
]
