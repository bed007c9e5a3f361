"""Triton implementations of the stages in `serval.stages`: same names, signatures and numerics.

grouped_gemm: the four expert GEMMs (one persistent grouped-GEMM kernel with constexpr
epilogues); weight_grad: the grouped weight gradients over the token axis; rows: gather /
combine / sum_slots; warp_specialized: a Gluon ping-pong variant of the grouped GEMM (sm_90, Triton
3.6; runs the down dgrad); cooperative: a Gluon cooperative gate/up + SwiGLU whose loader gathers x's rows
(runs the forward up to H = 4096); swiglu: the SwiGLU math of their epilogues; common: what they share.
"""

from . import grouped_gemm
from .common import INTERPRET
from .grouped_gemm import down, down_dgrad_swiglu, gate_up_dgrad, gate_up_swiglu
from .rows import combine, gather, sum_slots
from .weight_grad import down_weight_grad, gate_up_weight_grad

__all__ = [
    "check_supported",
    "combine",
    "down",
    "down_dgrad_swiglu",
    "down_weight_grad",
    "gate_up_dgrad",
    "gate_up_swiglu",
    "gate_up_weight_grad",
    "gather",
    "pulls_in_gemm",
    "pushes_from_epilogue",
    "sum_slots",
    "supports",
]


def pushes_from_epilogue() -> bool:
    """Whether down / gate_up_dgrad write their rows into the EP owners' slots themselves (`push_to`):
    grouped_gemm.PUSH_FROM_EPILOGUE."""
    return grouped_gemm.PUSH_FROM_EPILOGUE


def pulls_in_gemm() -> bool:
    """Whether gate_up_swiglu pulls its rows from the EP owners' buffers itself (`pull_from`):
    grouped_gemm.PULL_PROGRAMS > 0 communication programs inside the GEMM."""
    return grouped_gemm.PULL_PROGRAMS > 0


def supports(feature_dims) -> bool:
    """Whether the kernels take this problem: under the interpreter any shape; on the GPU, feature
    dimensions (H, I, Is) that are multiples of 8. On the H200 (2026-11-29) a bf16 layer with H=24,
    I=20 hit an illegal instruction that was not run down; every aligned shape checked was right."""
    return INTERPRET or all(d % 8 == 0 for d in feature_dims)


def check_supported(device, feature_dims) -> None:
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"serval.kernels: Config(backend='triton') needs CUDA tensors (or TRITON_INTERPRET=1), "
                         f"got tensors on {device}")
    if not supports(feature_dims):
        raise ValueError(f"serval.kernels: feature dimensions (H, I[, Is]) = {tuple(feature_dims)} must be "
                         "multiples of 8 on the GPU; use Config(backend='auto') or 'torch' for other shapes")
