"""Communication/compute overlap of the expert-parallel layer, as pure functions of sizes and measured rates: a cost
model of one rank's pass that predicts the staged path, NCCL all_to_all + grouped GEMMs, and the fused persistent
kernel (communication SMs beside compute SMs, minibatch by minibatch, MoK's rule: `serval.plan.minibatch_rows`) at
any EP size without several GPUs. No GPU: `tools/ep_cost_model.py` feeds it measured figures.

Per rank at EP = P with N tokens, k slots, balanced routing: the rank computes N*k rows, a fraction (P-1)/P of
which come from (and go back to) other ranks. A forward moves two row sets (dispatch: x's rows pulled in;
combine: o's rows pushed out), a backward three (d_y's rows and x's rows pulled again, d_x's rows pushed out),
each f * N*k * H * 2 bytes in bf16; the forward runs 6 * N*k * H * I FLOPs, the backward twice that.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from .plan import layer_minibatch_rows

FORWARD_TRANSFERS = 2  # x's rows in, o's rows out
BACKWARD_TRANSFERS = 3  # d_y's rows in, x's rows in again, d_x's rows out

@dataclasses.dataclass(frozen=True)
class Problem:
    """One rank's share of an EP layer: N tokens per rank, k, H, I, E experts in all, P ranks."""

    tokens: int
    top_k: int
    hidden: int
    inter: int
    experts: int
    ep: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def rows_per_expert(self) -> float:
        return self.rows * self.ep / self.experts

    def transfer_bytes(self) -> float:
        """Bytes of one row set that cross the links, per rank (bf16 rows)."""
        return (self.ep - 1) / self.ep * self.rows * self.hidden * 2

    def flops(self, backward: bool) -> float:
        return (12 if backward else 6) * self.rows * self.hidden * self.inter


@dataclasses.dataclass(frozen=True)
class Rates:
    """Measured rates the model runs on.

    compute_tflops: the rank's expert GEMMs (and their row passes) with no communication, at its rows per expert,
        (forward, backward).
    staged_gbps: what the staged path's pull and push kernels reach, bytes of one row set per second per rank.
    nccl_gbps: NCCL all_to_all per rank; nccl_compute_tflops: torch's grouped GEMMs and permutes, (fwd, bwd).
    comm_gbps: what `c` communication SMs pulling or pushing rows reach, {c: GB/s}, per rank.
    num_sms: SMs of the GPU; schedule_ms: building the schedule (not overlapped).
    contention: how much slower the compute SMs run while rows move (HBM shared with the transfers): measured
        0.11 at EP=2 on kimi-k2 (gate/up tiles 113 us while the in-GEMM pull ran, 102 after;
        docs/reports/2026-11-29-ep-two-h200.md).
    fused_compute_ratio: the fused kernel's compute rate over the staged path's, (forward, backward), with no
        communication (measured at EP=1: its GEMMs run on the Triton tiles, the staged ones on the Gluon
        engines).
    """

    compute_tflops: tuple[float, float]
    staged_gbps: float
    nccl_gbps: float
    nccl_compute_tflops: tuple[float, float]
    comm_gbps: Mapping[int, float]
    num_sms: int = 132
    schedule_ms: float = 0.27
    contention: float = 0.11
    fused_compute_ratio: tuple[float, float] = (1.0, 1.0)


def staged_ms(problem: Problem, rates: Rates, backward: bool) -> float:
    """Today's path: the schedule, then each transfer and the experts one after another."""
    transfers = BACKWARD_TRANSFERS if backward else FORWARD_TRANSFERS
    comm = transfers * problem.transfer_bytes() / (rates.staged_gbps * 1e6)
    compute = problem.flops(backward) / (rates.compute_tflops[backward] * 1e9)
    return (0.0 if backward else rates.schedule_ms) + comm + compute


def nccl_ms(problem: Problem, rates: Rates, backward: bool) -> float:
    """NCCL all_to_all of the rows, then torch's grouped GEMMs, one after another."""
    transfers = BACKWARD_TRANSFERS if backward else FORWARD_TRANSFERS
    comm = transfers * problem.transfer_bytes() / (rates.nccl_gbps * 1e6)
    return comm + problem.flops(backward) / (rates.nccl_compute_tflops[backward] * 1e9)


def fused_ms(problem: Problem, rates: Rates, backward: bool, comm_sms: int, minibatch: int) -> float:
    """The fused kernel: comm_sms SMs move rows while the rest compute, minibatch by minibatch. The compute runs at
    `rates.fused_compute_ratio` of the staged rate and slows by the SMs it gives up and by `rates.contention`
    while the transfers run; the transfers run at what comm_sms SMs reach; the longer of the two sets the pace,
    plus the first minibatch's arrival (nothing to compute yet) and the last one's departure (nothing left)."""
    transfers = BACKWARD_TRANSFERS if backward else FORWARD_TRANSFERS
    link = rates.comm_gbps[comm_sms] * 1e6  # bytes per ms
    comm = transfers * problem.transfer_bytes() / link
    compute = problem.flops(backward) / (rates.compute_tflops[backward] * rates.fused_compute_ratio[backward] * 1e9)
    compute *= rates.num_sms / (rates.num_sms - comm_sms)
    compute *= 1 + rates.contention * min(1.0, comm / compute)
    share = min(1.0, minibatch / problem.rows)
    edges = 2 * share * problem.transfer_bytes() / link
    return (0.0 if backward else rates.schedule_ms) + max(compute, comm) + edges


def best_fused(problem: Problem, rates: Rates, backward: bool, block_m: int = 128):
    """(ms, comm_sms, minibatch rows) of the fastest fused configuration over the measured comm-SM counts, each
    with its minibatch by `layer_minibatch_rows`."""
    best = None
    for comm_sms in sorted(rates.comm_gbps):
        minibatch = layer_minibatch_rows(problem.hidden, problem.inter, rates.num_sms - comm_sms, block_m)
        ms = fused_ms(problem, rates, backward, comm_sms, minibatch)
        if best is None or ms < best[0]:
            best = (ms, comm_sms, minibatch)
    return best
