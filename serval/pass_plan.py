"""`PassPlan`: how one call of the layer runs its forward and backward, decided once and passed down as a value.

`plan_pass` resolves, at the start of a call, everything the levels below it would otherwise ask again: the stage
implementations (`select_backend`: the torch stages or the kernels bound to a `KernelPlan`), the precision recipe,
and for each pass (`Direction`)

* its strategy: "staged" (one launch per GEMM stage), "fused" (the pass's two routed GEMMs in one launch,
  `KernelPlan.fused_forward` / `fused_backward`) or "streamed" (at EP, the routed rows through the macrobatch
  ring window by window, `serval.macrobatch`; each window staged or fused as `window` says);
* where its first GEMM's rows come from (`rows_in`): "gathered" through the schedule (EP=1), "pulled" from
  their owners into a buffer first, or "pulled by the GEMM" (its pull programs read the owners' buffers);
* where its last GEMM's rows go (`rows_out`): "stored" (EP=1, summed in slot order here), "pushed" into the
  owners' slots after the GEMM, or "pushed by the GEMM" (its epilogue writes the owners' slots);
* whether the shared expert's GEMMs join the routed launch (`shared_in_launch`).

`str(plan)` says what a call will do, for users and for bug reports; `serval.functional` and
`serval.macrobatch` branch on these fields only. The plan is a pure function of the Config, the problem's sizes,
dtype and device, and the workspace, so the forward and the backward of one call get the same plan.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import torch

from . import precision, stages
from .config import Config
from .peers import PeerTokens

STAGED, FUSED, STREAMED = "staged", "fused", "streamed"
GATHERED, PULLED, PULLED_BY_GEMM = "gathered", "pulled", "pulled by the GEMM"
STORED, PUSHED, PUSHED_BY_GEMM = "stored", "pushed", "pushed by the GEMM"

__all__ = ["PassPlan", "Direction", "RowsFrom", "plan_pass", "select_backend"]


@dataclasses.dataclass(frozen=True)
class Direction:
    """How one pass (forward or backward) runs its routed experts (see the module docstring). `window`: the
    strategy of each window where the pass is streamed, else equal to `strategy`."""

    strategy: Literal["staged", "fused", "streamed"]
    window: Literal["staged", "fused"]
    rows_in: Literal["gathered", "pulled", "pulled by the GEMM"]
    rows_out: Literal["stored", "pushed", "pushed by the GEMM"]
    shared_in_launch: bool

    @property
    def fused(self) -> bool:
        """Whether the pass's (or each window's) two routed GEMMs run as one launch."""
        return self.window == FUSED


@dataclasses.dataclass(frozen=True)
class PassPlan:
    """One call's decisions (see the module docstring). ops: `serval.stages` or `serval.kernels.KernelStages`;
    recipe: the FP8 recipe (`serval.precision.Recipe`), None in bf16; dtype: the tokens' (the routed experts compute
    in it where there is no recipe); ep_size: the EP group's size; ring_rows: the rows of one streamed window (0 where
    nothing streams)."""

    ops: object
    recipe: precision.Recipe | None
    dtype: torch.dtype
    ep_size: int
    forward: Direction
    backward: Direction
    ring_rows: int = 0

    def __str__(self) -> str:
        engine = "torch stages" if self.ops is stages else f"kernels ({_engines(self.ops.plan)})"
        numerics = str(self.dtype).removeprefix("torch.") if self.recipe is None else self.recipe.name
        lines = [f"serval pass plan: routed experts in {numerics} on the {engine}, EP={self.ep_size}"
                 + (f", ring of {self.ring_rows} rows" if self.ring_rows else "")]
        for name, d in (("forward", self.forward), ("backward", self.backward)):
            how = d.strategy if d.strategy != STREAMED else f"streamed, each window {d.window}"
            first, last = (("x", "o"), ("d_y", "d_x"))[name == "backward"]
            lines.append(f"  {name}: {how}; {first}'s rows {d.rows_in}, {last}'s rows {d.rows_out}"
                         + ("; the shared expert's tiles in the routed launch" if d.shared_in_launch else ""))
        return "\n".join(lines)


class RowsFrom(NamedTuple):
    """Where a GEMM stage's A rows come from, as the stage's keywords (`kwargs`): gathered through the schedule
    from the tokens (nothing set), already pulled (`rows`), or read from the owners by its pull programs
    (`peers`, with the workspace's `flags`)."""

    rows: torch.Tensor | None = None
    peers: PeerTokens | None = None
    flags: tuple | None = None

    def kwargs(self) -> dict:
        if self.peers is not None:
            return {"pull_from": self.peers, "pull_flags": self.flags}
        return {} if self.rows is None else {"a_rows": self.rows}

    @property
    def pull(self) -> dict | None:
        """The pull programs' keywords, None unless the GEMM pulls its rows itself."""
        return None if self.peers is None else {"pull_from": self.peers, "pull_flags": self.flags}


def _engines(plan) -> str:
    names = [plan.gate_up_engine, plan.down_engine, plan.down_dgrad_engine, plan.gate_up_dgrad_engine]
    text = "gate/up {}, down {}, down dgrad {}, gate/up dgrad {}".format(*names)
    if plan.pull_programs or plan.dgrad_pull_programs:
        text += f"; pull programs {plan.pull_programs} forward, {plan.dgrad_pull_programs} backward"
    return text


def select_backend(config: Config, x: torch.Tensor, w_gate: torch.Tensor, shared=None):
    """The stage implementations for this call: the torch-op stages (`serval.stages`) or the kernels
    (`serval.kernels.KernelStages`, run as `config.kernel_plan` says, or the plan chosen for x; with
    `config.comm_sms_forward` / `comm_sms_backward` as its pull programs and `minibatch_size` as its
    minibatch where they are set).

    Config.backend "auto" takes the kernels for bf16 on CUDA when every feature dimension (H, I, Is) is a
    multiple of 8, i.e. 16-byte rows (16 for fp8_blockwise: 16-byte E4M3 rows); other shapes take the torch
    stages (see `serval.kernels.supports`). ValueError where a comm_sms knob leaves no SM of x's GPU to compute.
    """
    if config.backend == "torch":
        return stages
    from . import kernels

    dims = (x.shape[1], w_gate.shape[1]) + (() if shared is None else (shared[0].shape[0],))
    if config.backend == "triton":
        kernels.check_supported(x.device, dims, config.precision, x.dtype)
    elif not (x.is_cuda and x.dtype == torch.bfloat16 and kernels.supports(dims, config.precision)):
        return stages
    if x.is_cuda:
        from .kernels.common import num_sms

        _check_comm_sms(config, num_sms(x.device.index))
    plan = config.kernel_plan or kernels.plan_for(x)
    for knob, field in (("comm_sms_forward", "pull_programs"), ("comm_sms_backward", "dgrad_pull_programs"),
                        ("minibatch_size", "minibatch_rows")):
        if getattr(config, knob) is not None:  # the contract's knobs over the plan's fields (see Config)
            plan = dataclasses.replace(plan, **{field: getattr(config, knob)})
    return kernels.KernelStages(plan)


def _check_comm_sms(config: Config, sms: int) -> None:
    for name in ("comm_sms_forward", "comm_sms_backward"):
        value = getattr(config, name)
        if value is not None and value >= sms:
            raise ValueError(f"Config.{name} must be below the GPU's {sms} SMs (the others compute), got {value}")


def plan_pass(config: Config, x: torch.Tensor, w_gate: torch.Tensor, shared=None, workspace=None) -> PassPlan:
    """The `PassPlan` of a call with tokens x [N, H], routed weights w_gate [E, I, H] (for I), the shared
    expert's weights or None, and the workspace (None at EP=1 without one)."""
    ops = select_backend(config, x, w_gate, shared)
    recipe = precision.recipe_of(config.precision)
    if recipe is not None and ops is not stages:
        recipe = _quantized_by_kernels(recipe)
    return _plan(ops, recipe, x.dtype, w_gate.shape[1], shared is not None,
                 None if workspace is None or workspace.transport is None else workspace)


@functools.lru_cache(maxsize=None)
def _quantized_by_kernels(recipe: precision.Recipe) -> precision.Recipe:
    """The recipe a pass on the kernels runs: its quantizations by the quantizer kernels, on the CPU too (made once
    per recipe, not per call)."""
    return dataclasses.replace(recipe, quantize_backend="triton")


def _plan(ops, recipe, dtype: torch.dtype, inter: int, has_shared: bool, workspace) -> PassPlan:
    ep = workspace is not None
    # at EP, on stages whose weight gradients carry sums across windows, when the ring holds fewer rows than the
    # worst case: the rows stream through the ring
    streamed = ep and getattr(ops, "takes_windows", False) and workspace.ring_rows < workspace.capacity_rows
    directions = []
    for backward in (False, True):
        fused = (ops.fuses_backward if backward else ops.fuses_forward) and _fuses(recipe, inter, backward)
        # a recipe whose GEMMs run in FP8 (fp8_blockwise) pulls its rows first and pushes the rows its GEMM made
        bf16_engines = recipe is None or not recipe.fp8_gemm
        gemm_pulls = fused or (bf16_engines and (ops.pulls_in_dgrad if backward else ops.pulls_in_gemm))
        gemm_pushes = fused or (bf16_engines and ops.pushes_from_epilogue)
        directions.append(Direction(
            strategy=STREAMED if streamed else FUSED if fused else STAGED,
            window=FUSED if fused else STAGED,
            rows_in=(PULLED_BY_GEMM if gemm_pulls else PULLED) if ep else GATHERED,
            rows_out=(PUSHED_BY_GEMM if gemm_pushes else PUSHED) if ep else STORED,
            shared_in_launch=has_shared and fused))
    return PassPlan(ops, recipe, dtype, workspace.ep_size if ep else 1, *directions,
                    ring_rows=workspace.ring_rows if streamed else 0)


def _fuses(recipe, inter: int, backward: bool) -> bool:
    """Whether a pass in this precision can run as one fused launch: bf16; mxfp8, whose backward's d_gate_up
    blocks along 2I must not straddle its halves (I a multiple of the block); not fp8_blockwise."""
    if recipe is None:
        return True
    return recipe.fused_passes and not (backward and inter % recipe.block)
