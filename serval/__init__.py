"""serval: a deterministic mixture-of-experts training layer (Triton kernels under a PyTorch API).

Layout (each module's docstring says what it owns; docs/DESIGN.md has the full table):
    api.py          serval.moe: autograd, custom ops, input validation
    module.py       serval.MoE: the nn.Module (router + routed experts + shared expert)
    config.py       serval.Config: the tuning knobs
    plan.py         KernelPlan: the engine and tiles of every GEMM stage, chosen by a pure function
    schedule.py     the routing schedule that drives every stage
    functional.py   the lower layer: workspace, forward, backward, recompute
    stages.py       every stage in torch ops (the portable path; the kernels' contract)
    kernels/        the same stages as Triton and Gluon kernels, one module per engine
    precision.py    the FP8 precisions: what is quantized where, what is kept for backward
    overlap.py      the EP overlap as pure functions: MoK's minibatch rule, the cost model
    transport/      moving rows between EP ranks; peers.py: peer-row addressing
    ops.py          FP8 block quantization (quantize, dequantize, mxfp8_quantize)
    reference.py    the numerics oracle in plain PyTorch
    __main__.py     python -m serval: the demo
"""

from . import functional, ops, reference
from .api import moe, quantize_expert_weights
from .config import Config
from .module import MoE

__all__ = ["moe", "quantize_expert_weights", "MoE", "Config", "functional", "ops", "reference"]
__version__ = "0.1.0"
