"""Tuning knobs of the serval MoE layer (`serval.Config`), validated on construction.

A Config changes speed and memory, never the function computed (bitwise: every engine and tile choice gives
the same bits, `serval.plan`; in the CPU interpreter a plan's block_k is the one exception). Knobs that
select numerics (`precision`) or the row layout (`block_m`) are part of the
determinism contract: the same Config gives bitwise-identical results.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from .plan import KernelPlan

PRECISIONS = ("bf16", "mxfp8", "fp8_blockwise")
BACKENDS = ("auto", "triton", "torch")


@dataclasses.dataclass(frozen=True)
class Config:
    """How the MoE layer runs.

    precision: the routed experts' GEMMs in "bf16", "mxfp8" (MoK's recipe: E4M3 with a power-of-two scale per
        32 elements) or "fp8_blockwise" (E4M3 with fp32 scales per 1 x 128 activation and 128 x 128 weight
        blocks; needs I % 128 == 0); see `serval.precision`. The shared expert stays in x's dtype.
    backend: "auto" picks the Triton kernels on CUDA and the torch-op path elsewhere;
        "triton" / "torch" force one (on CPU the Triton kernels run only under TRITON_INTERPRET=1, whose
        interpreter needs numpy, which the `test` extra installs).
    block_m: rows per expert segment alignment = the M tile of every grouped GEMM.
    recompute: keep only the inputs for backward and recompute the gate/up GEMM there.
    comm_sms_forward / comm_sms_backward: at expert parallelism, on the kernels, in bf16 and mxfp8 (whose pull
        programs quantize and dequantize the rows they pull, as the staged pass does after its pull): how many
        programs (one per SM) of the gate/up GEMM (forward: x's rows) / of the down dgrad (backward: d_y's rows, which
        then serve the down weight gradient too) pull the GEMM's rows from the owners' token buffers while the
        others compute, M-tile by M-tile (the dispatch inside the GEMM, `serval.kernels.in_gemm_pull`; the
        backward's second pull, x's rows for the gate/up weight gradient, stays staged); 0: the transport's
        pull kernel runs before the GEMM (the staged path); None: the kernel plan's choice
        (`KernelPlan.pull_programs` / `dgrad_pull_programs`, 0 by default: docs/DESIGN.md says why). Below the
        GPU's SM count (a ValueError at the call otherwise: the other SMs compute).
        Nothing to move at EP=1, on the torch stages or in a staged fp8_blockwise pass (whose rows are pulled,
        then quantized to E4M3): no effect there. A fused pass (`KernelPlan.fused_forward` / `fused_backward`,
        bf16 or mxfp8) always pulls its own rows: there None and 0 mean `serval.plan.FUSED_COMM_SMS` (8, the
        EP cost model's choice). Never changes results (a backward that pulls in the down dgrad runs it on the
        Triton engine, which gives the ping-pong engine's bits, d_router_weights included: `serval.plan`).
    minibatch_size: rows per compute/communication overlap step, a multiple of block_m: in a GEMM that pulls
        its rows (comm_sms_* > 0), the compute programs take every output tile of one minibatch's rows before
        the next minibatch's (while that one arrives); in a fused pass, the minibatch of its task order (EP=1
        included: the second GEMM's tiles of a minibatch follow the first GEMM's of the next); None: MoK's rule,
        two full waves of tiles on the compute SMs (`serval.plan.layer_minibatch_rows`). No effect elsewhere.
        Never changes results.
    macrobatch_size: at expert parallelism, the size of the macrobatch ring in tokens: the routed rows a rank
        computes stream through a fixed buffer of macrobatch_size * top_k rows (rounded up to whole block_m
        tiles), window after window in row order (`serval.schedule.windows`), so a rank that receives more rows
        than the ring holds takes them in several rounds: nothing is dropped, whatever the routing skew. None:
        capacity_multiplier x the rank's balanced load, plus its experts' padding. The forward keeps the
        first window's gate/up pre-activations (all of them under a balanced routing); the backward
        recomputes the others' from re-pulled rows. On the kernels, in every precision; the torch stages take
        every row at once (the worst case: every routed row of the group on this rank).
        Never changes results: the weight gradients carry each expert's fp32 sums from one window to the next.
    capacity_multiplier: the macrobatch ring's size when macrobatch_size is None, as a multiple of the
        balanced load (a rank's own N * top_k rows).
    kernel_plan: the engine and tiles of every GEMM stage on the kernel backend (`serval.plan.KernelPlan`);
        None: `serval.plan.choose_plan` picks them for the shape and the device. Changes speed, not results.
    debug: check the expert ids at once on CUDA too, with a host sync: a ValueError in the call that
        passed them, instead of NaN outputs for that step and a ValueError in a later call.
    peer_timeout_s: at expert parallelism, how long a rank waits for the others at each of the transport's
        barriers before it gives up. On CPU (gloo) a RuntimeError then names the ranks that did not arrive;
        on CUDA torch's signal-pad barrier prints the rank and traps (the CUDA context is lost: the process
        has to restart). A rank that stops or skips a layer call is an error on the others, never a hang.
        The waits inside the kernels (a compute program for its pulled rows) give up after about 10 s.

    Frozen and hashable: the layer's custom ops carry a Config as an interned id (`serval.api`), so
    every field must be hashable.
    """

    precision: Literal["bf16", "mxfp8", "fp8_blockwise"] = "bf16"
    backend: Literal["auto", "triton", "torch"] = "auto"
    block_m: int = 128
    recompute: bool = False
    comm_sms_forward: int | None = None
    comm_sms_backward: int | None = None
    minibatch_size: int | None = None
    macrobatch_size: int | None = None
    capacity_multiplier: float = 2.0
    debug: bool = False
    kernel_plan: KernelPlan | None = None
    peer_timeout_s: float = 300.0

    def __post_init__(self):
        if self.kernel_plan is not None and not isinstance(self.kernel_plan, KernelPlan):
            raise TypeError(f"Config.kernel_plan must be None or a serval.plan.KernelPlan, got "
                            f"{type(self.kernel_plan).__name__}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Config.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"Config.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not _is_int(self.block_m) or self.block_m not in (16, 32, 64, 128, 256):
            raise ValueError(f"Config.block_m must be one of 16, 32, 64, 128, 256, got {self.block_m!r}")
        if self.precision != "bf16":
            from .precision import RECIPES  # here, not at the top: serval.precision imports the stages

            block = RECIPES[self.precision].block
            if self.block_m % block:
                raise ValueError(f"Config.block_m must be a multiple of {block} for precision={self.precision!r} "
                                 f"(a {block}-row block along tokens must not span two experts), got {self.block_m}")
        for name in ("recompute", "debug"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Config.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("comm_sms_forward", "comm_sms_backward"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):  # below the GPU's SMs: checked per call
                raise ValueError(f"Config.{name} must be None or an int >= 0, got {value!r}")
        if self.minibatch_size is not None and (not _is_int(self.minibatch_size) or self.minibatch_size <= 0
                                                or self.minibatch_size % self.block_m):
            raise ValueError(
                f"Config.minibatch_size must be None or a positive multiple of block_m={self.block_m}, got "
                f"{self.minibatch_size!r}"
            )
        if self.macrobatch_size is not None and (not _is_int(self.macrobatch_size) or self.macrobatch_size <= 0):
            raise ValueError(f"Config.macrobatch_size must be None or a positive int, got {self.macrobatch_size!r}")
        multiplier = self.capacity_multiplier
        if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or not 1.0 <= multiplier < math.inf:
            raise ValueError(f"Config.capacity_multiplier must be a finite number >= 1.0, got {multiplier!r}")
        timeout = self.peer_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0.001 <= timeout < math.inf:
            raise ValueError(f"Config.peer_timeout_s must be a finite number of seconds >= 0.001, got {timeout!r}")
        config_id(self)


# Config -> id and back: the layer's custom ops take plain scalars, so they carry a Config as an int. A Config is
# registered when it is made, so that a torch.compile'd call that is its first use only reads the table (the ops'
# fake implementations read it while the graph is traced, before Dynamo applies a traced registration). Each
# distinct Config lives as long as the process, like a compiled kernel.
_CONFIG_IDS: dict[Config, int] = {}
_CONFIGS: list[Config] = []


def config_id(config: Config) -> int:
    """The id of `config` in the table the custom ops read (registered here if it is not yet: an unpickled
    Config skips __post_init__)."""
    ident = _CONFIG_IDS.get(config)
    if ident is None:
        ident = _CONFIG_IDS[config] = len(_CONFIGS)
        _CONFIGS.append(config)
    return ident


def config_by_id(ident: int) -> Config:
    return _CONFIGS[ident]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# the Config of a call that passes none: made (so registered) at import, not inside a torch.compile'd call
DEFAULT_CONFIG = Config()
