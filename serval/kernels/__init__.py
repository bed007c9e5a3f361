"""The layer's stages as GPU kernels (Triton, and Gluon on Hopper), with the names, signatures and numerics
of `serval.stages`, bound to a `serval.plan.KernelPlan` (`KernelStages`).

One module per engine or job:
    gemm_stages.py        the four expert GEMM stages, each routed to the engine its plan names
    gemm_tile.py          one output tile of a grouped GEMM (K loop, epilogues) and its argument bundles
    triton_gemm.py        the Triton persistent grouped GEMM: every stage, every device, the interpreter
    gluon_cooperative.py  Gluon cooperative 128 x 256 GEMM (sm_90, Triton 3.6): gate/up, down, gate/up dgrad
    gluon_pingpong.py     Gluon ping-pong GEMM (sm_90, Triton 3.6): the down dgrad + SwiGLU backward
    gluon_common.py       the Gluon version gate, descriptors and helpers both Gluon engines use
    in_gemm_pull.py       communication programs inside the gate/up GEMM and the down dgrad (EP pulls under the GEMM)
    fused_pass.py         a pass's two routed GEMMs (and at EP its pull and push) in one persistent launch
    fused_launch.py       the fused pass's host side: checks, buffers, bundles, launch
    task_order.py         the fused pass's task order and minibatch
    weight_grad.py        the grouped weight gradients over the token axis
    fp8_gemm.py           block-scaled FP8 grouped GEMM and weight gradient (Triton; Gluon on Hopper)
    gluon_fp8.py          Gluon cooperative FP8 GEMM, the scales applied per 128-K step (sm_90, Triton 3.6)
    quantize.py           FP8 quantization (serval.ops.quantize on the GPU)
    rows.py               gather, combine and slot sums (memory-bound row passes)
    swiglu.py             the SwiGLU math of every epilogue
    swiglu_rows.py        the SwiGLU forward and backward as row passes, outputs also row-quantized (the FP8 path)
    common.py             interpreter, target, TMA allocator, SM count, output allocation, tile order
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..plan import GLUON_VERSIONS, KernelPlan, choose_plan
from . import fp8_gemm, gemm_stages, swiglu_rows
from .common import INTERPRET, target
from .rows import combine, gather, sum_slots
from .weight_grad import down_weight_grad, gate_up_weight_grad

__all__ = ["KernelStages", "check_supported", "plan_for", "supports"]


class KernelStages:
    """`serval.stages`' interface on the kernels, every GEMM stage run as `plan` says."""

    # down and the gate/up dgrad write their rows into the EP owners' slots themselves (`push_to`)
    pushes_from_epilogue = True
    # the weight gradients carry fp32 sums across windows of rows (`serval.values.WgradWindow`): at EP a pass
    # streams its rows through the macrobatch ring (`serval.macrobatch`)
    takes_windows = True

    def __init__(self, plan: KernelPlan):
        self.plan = plan

    @property
    def pulls_in_gemm(self) -> bool:
        """Whether gate_up_swiglu pulls its rows from the EP owners' buffers itself (`pull_from`)."""
        return self.plan.pull_programs > 0

    @property
    def fuses_forward(self) -> bool:
        """Whether the forward's routed GEMMs run as one launch (`gate_up_down`, KernelPlan.fused_forward)."""
        return self.plan.fused_forward

    @property
    def fuses_backward(self) -> bool:
        """Whether the backward's routed dgrads run as one launch (`down_dgrad_gate_up_dgrad`,
        KernelPlan.fused_backward)."""
        return self.plan.fused_backward

    @property
    def pulls_in_dgrad(self) -> bool:
        """Whether down_dgrad_swiglu pulls d_y's rows from the EP owners' buffers itself (`pull_from`)."""
        return self.plan.dgrad_pull_programs > 0

    gather = staticmethod(gather)
    combine = staticmethod(combine)
    sum_slots = staticmethod(sum_slots)
    gate_up_weight_grad = staticmethod(gate_up_weight_grad)
    down_weight_grad = staticmethod(down_weight_grad)
    swiglu_fp8 = staticmethod(swiglu_rows.swiglu_fp8)
    swiglu_backward_fp8 = staticmethod(swiglu_rows.swiglu_backward_fp8)

    def gate_up_swiglu(self, *args, **kwargs):
        return gemm_stages.gate_up_swiglu(*args, plan=self.plan, **kwargs)

    def down(self, *args, **kwargs):
        return gemm_stages.down(*args, plan=self.plan, **kwargs)

    def gate_up_down(self, *args, **kwargs):
        return gemm_stages.gate_up_down(*args, plan=self.plan, **kwargs)

    def down_dgrad_swiglu(self, *args, **kwargs):
        return gemm_stages.down_dgrad_swiglu(*args, plan=self.plan, **kwargs)

    def gate_up_dgrad(self, *args, **kwargs):
        return gemm_stages.gate_up_dgrad(*args, plan=self.plan, **kwargs)

    def down_dgrad_gate_up_dgrad(self, *args, **kwargs):
        return gemm_stages.down_dgrad_gate_up_dgrad(*args, plan=self.plan, **kwargs)

    @staticmethod
    def fp8_grouped_gemm(a, b, schedule):
        """`serval.stages.fp8_grouped_gemm` on the block-scaled FP8 kernels."""
        return fp8_gemm.grouped_gemm(a.data, a.scale, b.data, b.scale, schedule)

    @staticmethod
    def fp8_weight_grad(a, b, schedule, out=None, window=None):
        """`serval.stages.fp8_weight_grad` on the block-scaled FP8 kernels; `window` as the bf16 weight gradients
        take it (`serval.values.WgradWindow`, one output)."""
        return fp8_gemm.weight_grad(a.data, a.scale, b.data, b.scale, schedule, window=window, out=out)


def plan_for(x: torch.Tensor) -> KernelPlan:
    """The plan `choose_plan` picks for tokens x [N, H] on x's device (and, once per process, a warning when
    a Hopper GPU runs without the Gluon engines because of the Triton release)."""
    device_target = target(x.device.index if x.is_cuda else None)
    if device_target.capability is not None and device_target.capability[0] == 9 and not device_target.gluon:
        _warn_no_gluon(device_target.triton_version)
    return choose_plan(x.shape[1], x.dtype, device_target)


@functools.lru_cache(maxsize=None)
def _warn_no_gluon(triton_version: str) -> None:
    warnings.warn(f"serval: Triton {triton_version} runs every GEMM on the Triton engine; the faster Gluon engines "
                  f"for Hopper need Triton {' or '.join(GLUON_VERSIONS)} (pip install 'triton=="
                  f"{GLUON_VERSIONS[-1]}.*')", RuntimeWarning, stacklevel=3)


def supports(feature_dims, precision: str = "bf16") -> bool:
    """Whether the kernels take this problem: under the interpreter any shape; on the GPU, feature dimensions
    (H, I, Is) that are multiples of 8 (16-byte rows). fp8_blockwise everywhere: multiples of 16 (16-byte E4M3
    rows, the FP8 GEMMs' K)."""
    if precision == "fp8_blockwise":
        return all(d % 16 == 0 for d in feature_dims)
    return INTERPRET or all(d % 8 == 0 for d in feature_dims)


def check_supported(device, feature_dims, precision: str = "bf16", dtype: torch.dtype | None = None) -> None:
    """ValueError unless Config(backend='triton') can run here: the device, the feature sizes, the dtype."""
    if dtype is not None and dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"serval.kernels: Config(backend='triton') runs bf16 or fp32 tensors, got "
                         f"{str(dtype).replace('torch.', '')}; use Config(backend='auto') or 'torch' for it")
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"serval.kernels: Config(backend='triton') needs CUDA tensors (or TRITON_INTERPRET=1), "
                         f"got tensors on {device}")
    if not supports(feature_dims, precision):
        multiple = 16 if precision == "fp8_blockwise" else 8
        raise ValueError(f"serval.kernels: feature dimensions (H, I[, Is]) = {tuple(feature_dims)} must be "
                         f"multiples of {multiple} for the kernels here; use Config(backend='auto') or 'torch' "
                         "for other shapes")
