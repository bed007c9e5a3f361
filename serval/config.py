"""Tuning knobs of the serval MoE layer (`serval.Config`), validated on construction.

A Config changes speed and memory, never the function computed. Knobs that
select numerics (`precision`) or the row layout (`block_m`) are part of the
determinism contract: the same Config gives bitwise-identical results.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

PRECISIONS = ("bf16", "mxfp8")
BACKENDS = ("auto", "triton", "torch")


@dataclasses.dataclass(frozen=True)
class Config:
    """How the MoE layer runs.

    precision: "bf16" (built) or "mxfp8" (accepted here; the layer raises until its kernels exist).
    backend: "auto" picks the Triton kernels on CUDA and the torch-op path elsewhere;
        "triton" / "torch" force one (the Triton kernels also run under TRITON_INTERPRET=1 on CPU).
    block_m: rows per expert segment alignment = the M tile of every grouped GEMM.
    recompute: keep only the inputs for backward and recompute the gate/up GEMM there.
    comm_sms_forward / comm_sms_backward, minibatch_size (rows per compute/communication overlap step, a
        multiple of block_m), macrobatch_size (tokens per macrobatch, None: the whole batch): for the fused
        persistent EP kernel, validated and not read yet (the communication programs that exist, inside the
        gate/up GEMM, are set by `serval.kernels.grouped_gemm.PULL_PROGRAMS`).
    capacity_multiplier: expert-parallel receive capacity, as a multiple of the balanced load.
    debug: run host-side value checks (expert id range) that synchronise with the device.
    """

    precision: Literal["bf16", "mxfp8"] = "bf16"
    backend: Literal["auto", "triton", "torch"] = "auto"
    block_m: int = 128
    recompute: bool = False
    comm_sms_forward: int = 20
    comm_sms_backward: int = 20
    minibatch_size: int = 1024
    macrobatch_size: int | None = None
    capacity_multiplier: float = 2.0
    debug: bool = False

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"Config.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"Config.backend must be one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.block_m, int) or self.block_m not in (16, 32, 64, 128, 256):
            raise ValueError(f"Config.block_m must be one of 16, 32, 64, 128, 256, got {self.block_m!r}")
        for name in ("comm_sms_forward", "comm_sms_backward"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 128:
                raise ValueError(f"Config.{name} must be an int in [0, 128], got {value!r}")
        if not isinstance(self.minibatch_size, int) or self.minibatch_size <= 0 or self.minibatch_size % self.block_m:
            raise ValueError(
                f"Config.minibatch_size must be a positive multiple of block_m={self.block_m}, got {self.minibatch_size!r}"
            )
        if self.macrobatch_size is not None and (not isinstance(self.macrobatch_size, int) or self.macrobatch_size <= 0):
            raise ValueError(f"Config.macrobatch_size must be None or a positive int, got {self.macrobatch_size!r}")
        if not isinstance(self.capacity_multiplier, (int, float)) or not self.capacity_multiplier >= 1.0:
            raise ValueError(f"Config.capacity_multiplier must be a number >= 1.0, got {self.capacity_multiplier!r}")
