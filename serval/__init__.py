"""serval: a deterministic mixture-of-experts training layer (Triton kernels under a PyTorch API).

Layout (each module's docstring says what it owns; docs/DESIGN.md has the full table):
    api.py          serval.moe: autograd, custom ops, input validation
    module.py       serval.MoE: the nn.Module (router + routed experts + shared expert)
    routing.py      token-choice routing as pure functions, the aux loss and the aux-loss-free bias update
    config.py       serval.Config: the tuning knobs
    plan.py         KernelPlan: the engine and tiles of every GEMM stage, chosen by a pure function
    schedule.py     the routing schedule that drives every stage
    functional.py   the lower layer: workspace, forward, backward, recompute
    stages.py       every stage in torch ops (the portable path; the kernels' contract)
    kernels/        the same stages as Triton and Gluon kernels, one module per engine
    precision.py    the FP8 precisions: what is quantized where, what is kept for backward
    weight_layout.py  the expert weights as held (joined gate/up or two tensors), read and written in place
    weight_cache.py   the FP8 expert weights made once per version of the weights
    integrations/   serval inside transformers and torchtitan (optional; imports its library)
    overlap.py      the EP overlap as pure functions: MoK's minibatch rule, the cost model
    transport/      moving rows between EP ranks; peers.py: peer-row addressing
    ops.py          FP8 block quantization (quantize, dequantize, mxfp8_quantize)
    reference.py    the numerics oracle in plain PyTorch
    __main__.py     python -m serval: the demo
"""

from . import functional, ops, reference, routing
from .api import moe, quantize_expert_weights
from .config import Config
from .module import MoE
from .routing import RouterOutput, load_balancing_loss, update_correction_bias

__all__ = ["moe", "quantize_expert_weights", "MoE", "Config", "RouterOutput", "load_balancing_loss",
           "update_correction_bias", "functional", "ops", "reference", "routing"]
__version__ = "0.1.0"
