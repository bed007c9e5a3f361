"""serval: a deterministic mixture-of-experts training layer (Triton kernels under a PyTorch API).

Layout (each module's docstring says what it owns):
    api.py          serval.moe: autograd, custom ops, input validation
    module.py       serval.MoE: the nn.Module (router + routed experts + shared expert)
    config.py       serval.Config: the tuning knobs
    schedule.py     the routing schedule that drives every stage
    functional.py   the lower layer: workspace, forward, backward, recompute
    stages.py       every stage in torch ops (the portable path; the kernels' contract)
    kernels/        the same stages as Triton kernels
    ops.py          standalone ops (MXFP8 quantisation)
    reference.py    the numerics oracle in plain PyTorch
"""

from . import functional, ops, reference
from .api import moe, quantize_expert_weights
from .config import Config
from .module import MoE

__all__ = ["moe", "quantize_expert_weights", "MoE", "Config", "functional", "ops", "reference"]
__version__ = "0.1.0"
