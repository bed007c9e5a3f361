"""The MoK-style lower layer: workspace, schedule, and the forward / backward passes as plain functions.

`serval.moe` (autograd) is a thin wrapper over this module; use it directly to
own the schedule (build it once, reuse it across layers that share a routing),
to keep or drop the forward context, or to drive recomputation yourself:

    schedule = functional.build_schedule(topk_ids, num_experts)
    y, ctx = functional.forward(x, router_weights, schedule, w_gate, w_up, w_down)
    grads = functional.backward(d_y, ctx, x, router_weights, w_gate, w_up, w_down)

Expert parallelism (EP = P ranks, expert e on rank e // E_local): pass the
workspace of the group (`get_workspace(..., group=pg)`) and the rank's schedule
from `build_ep_schedule`; the rows a rank computes are then pulled from their
owners (dispatch) and the results pushed back into the owners' slots (combine),
and the same for d_y and d_x in backward (see `serval.transport`); on the kernels
in bf16 the rows stream through the macrobatch ring (`serval.macrobatch`).

What is kept for backward (`ForwardContext`): the schedule (int32, O(N*k)) and
the gate/up pre-activations of the routed experts in packed rows (no padding:
[N*k, 2I] at EP=1; at EP the rank's rows, or the first window's where the pass
streams through the macrobatch ring) and [N, 2Is] of the shared expert,
in the input dtype; at EP also the group's router weights
[P*N, k] fp32. Expert outputs, h = SwiGLU(gate, up) and the gathered tokens are
NOT kept: backward recomputes h from the pre-activations and regathers (pulls)
tokens from `x`. With `Config(recompute=True)` the pre-activations are not kept
either (`recompute_forward_context` rebuilds them at the cost of the gate/up GEMM).

Each pass runs its stages on one backend: `serval.kernels` (Triton) or
`serval.stages` (torch ops); see `Config.backend`.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import itertools
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import macrobatch, precision, stages, weight_layout
from . import schedule as schedule_module
from .config import Config
from .schedule import (Schedule, capacity_rows, dense_schedule, ep_capacity_rows, local_schedule,
                       slot_schedule)

if dist.is_available():
    # torch.distributed.nn.functional evaluates `group.WORLD` into ten functions' default arguments when it is
    # imported, and torch imports it on the first call of any custom op (through torch._dynamo). Imported after
    # init_process_group, it would hold the default group past destroy_process_group, and gloo aborts the process
    # ("terminate called without an active exception") when interpreter teardown frees the group at last. Imported
    # here, with serval, before the caller makes a group, it holds None.
    import torch.distributed.nn.functional  # noqa: F401

__all__ = [
    "Workspace", "ErrorFlags", "get_workspace", "create_workspace", "workspace_by_id", "build_schedule",
    "build_ep_schedule", "gather_routing", "ep_schedule",
    "dense_schedule", "ForwardContext", "Grads", "forward", "backward", "recompute_forward_context",
    "select_backend",
]


# ---------------------------------------------------------------- workspace

_WORKSPACES: dict[int, "Workspace"] = {}
_workspace_ids = itertools.count()


class ErrorFlags:
    """Errors found on the device by steps that must not sync, reported by a later call.

    A step that finds an error (expert ids out of range) adds its
    device-side flag to a per-kind counter on the device and copies the counters, non_blocking,
    into pinned host memory; `pending` reads that host copy (no sync) and says whether steps the
    GPU has finished since the last report had an error. Counters, not sticky bits, so that once
    an error is reported the next good step runs (no reset that could race an in-flight copy).
    On a CPU device the copies are plain (synchronous) ones; the logic is the same.
    """

    EXPERT_IDS = 0

    def __init__(self, device):
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"serval.moe: the error flags of {device} are allocated by the first call on that device, "
                "which is inside a CUDA graph capture here: run the layer once (eagerly) before capturing")
        self.device = device
        self.counts = torch.zeros(1, dtype=torch.int64, device=device)
        self.host = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.reported = [0]

    def record(self, kind: int, flag: torch.Tensor) -> None:
        """Count a step's device bool `flag` under `kind` (no sync); a later `pending(kind)` sees it."""
        self.counts[kind].add_(flag.to(torch.int64))
        self.host.copy_(self.counts, non_blocking=True)

    def pending(self, kind: int) -> bool:
        """Whether a step the GPU has finished flagged `kind` since the last time this returned True
        (reads pinned host memory: no sync; a step still in flight is seen by a later call)."""
        seen = int(self.host[kind])
        if seen > self.reported[kind]:
            self.reported[kind] = seen
            return True
        return False


@dataclasses.dataclass(frozen=True, eq=False)
class Workspace:
    """Everything sized once from the problem, never from the routing.

    capacity_rows: rows of this rank's schedule: the worst case of any routing (at EP, every routed row
    of the group on this rank's experts), so nothing is ever dropped.
    ring_rows: at EP, the macrobatch ring: the rows one window of a streamed pass computes
    (`Config.macrobatch_size`; `serval.schedule.windows`); equal to capacity_rows where nothing streams.
    transport: at EP, the peer buffers and the protocol that moves rows (`serval.transport`);
    created collectively, which is why a workspace is created once and cached.
    errors: at EP, the flags of errors that steps found without a host sync (`ErrorFlags`).
    pull_flags: at EP, the per-M-tile flags (int32, one per 16 rows of the ring: enough for any tile height)
    and the epoch counter (int32 [1]) of a gate/up GEMM that pulls its own rows (`KernelPlan.pull_programs`,
    `serval.kernels.in_gemm_pull`); allocated here, before any CUDA graph capture, and never reset.
    ring_buffers: the macrobatch ring's row buffers (`ring`), made on first use and kept.
    """

    num_tokens: int
    top_k: int
    hidden: int
    num_experts: int  # global
    experts_per_rank: int
    block_m: int
    device: torch.device
    capacity_rows: int
    rank: int = 0
    ep_size: int = 1
    transport: object = None
    id: int = -1
    errors: ErrorFlags | None = None
    pull_flags: tuple[torch.Tensor, torch.Tensor] | None = None
    ring_rows: int = 0
    ring_buffers: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not self.ring_rows:
            object.__setattr__(self, "ring_rows", self.capacity_rows)

    def ring(self, role: str, like: torch.Tensor) -> torch.Tensor:
        """The macrobatch ring's buffer for `role` ("x", "d_y": the rows a streamed pass pulls before its GEMM),
        [ring_rows, like.shape[1]] in like's dtype and device: made on its first use and kept, so every call and
        every window reuses the same memory (its contents never outlive a call: the backward pulls its rows
        again). Calls that share a workspace run one after another on one stream, as its transport's do."""
        key = (role, like.shape[1], like.dtype, like.device)
        if key not in self.ring_buffers:
            self.ring_buffers[key] = torch.empty(self.ring_rows, like.shape[1], dtype=like.dtype, device=like.device)
        return self.ring_buffers[key]


_PROBLEM_FIELDS = ("num_tokens (x.shape[0])", "top_k (topk_ids.shape[1])", "hidden (x.shape[1])",
                   "num_experts (w_gate.shape[0] * group size)", "dtype (x.dtype)")
_DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float64)  # the dtype field's codes


def _check_same_problem(group, problem: tuple, device: torch.device, timeout_s: float) -> None:
    """ValueError on every rank of `group` unless every rank passed the same problem sizes and dtype.

    One all-gather of a small int64 tensor (gloo or NCCL; a host sync, once per workspace), so
    that ranks that disagree fail together with a clear error instead of mismatching the
    collectives that follow (which aborts gloo processes and hangs NCCL ones). On a gloo group a
    barrier bounded by `timeout_s` (Config.peer_timeout_s) on every rank comes first: a rank that never
    gets here (its own inputs failed a check) is a RuntimeError on the others, not a wait as long as
    the process group's timeout."""
    if dist.get_backend(group) == "gloo":
        from .transport.cpu import bounded_barrier

        try:
            bounded_barrier(group, datetime.timedelta(seconds=timeout_s))
        except RuntimeError as error:
            raise RuntimeError(
                f"serval.moe: rank {dist.get_rank(group)} of the EP group waited {timeout_s:g} s "
                f"(Config.peer_timeout_s) for the other ranks to set up the layer's workspace; a rank did not "
                f"call the layer (or its inputs failed a check) ({error})") from error
    problem = problem[:-1] + (_DTYPES.index(problem[-1]),)
    tensor_device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":  # NCCL moves CUDA tensors only
        tensor_device = device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(problem, dtype=torch.int64, device=tensor_device)
    every = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(every, mine, group=group)
    every = [tuple(t.tolist()) for t in every]
    every = [p[:-1] + (str(_DTYPES[p[-1]]).replace("torch.", ""),) for p in every]
    differ = [f"{name}: {[p[i] for p in every]}" for i, name in enumerate(_PROBLEM_FIELDS)
              if len({p[i] for p in every}) > 1]
    if differ:
        raise ValueError("serval.moe: every rank of the EP group must pass the same problem sizes and dtype, but "
                         "they differ across the ranks (by rank): " + "; ".join(differ))


def create_workspace(num_tokens: int, top_k: int, hidden: int, num_experts: int, *, device=None,
                     config: Config | None = None, group=None, dtype: torch.dtype | None = None) -> Workspace:
    """A new workspace for N tokens per rank, k slots, hidden size H and E experts in all, for tokens of
    `dtype` (collective over `group` when it has more than one rank: the ranks first check that they all
    passed the same sizes and dtype, a ValueError on every rank otherwise; see `get_workspace` for the
    cached one)."""
    config = config or Config()
    device = torch.device(device or "cpu")
    ep_size = 1 if group is None else group.size()
    if ep_size > 1:
        _check_same_problem(group, (num_tokens, top_k, hidden, num_experts, dtype), device, config.peer_timeout_s)
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} must be divisible by the EP group size {ep_size}")
    experts_per_rank = num_experts // ep_size
    ident = next(_workspace_ids)
    if ep_size == 1:
        ws = Workspace(num_tokens, top_k, hidden, num_experts, experts_per_rank, config.block_m, device,
                       capacity_rows(num_tokens * top_k, num_experts, config.block_m), id=ident)
    else:
        from .kernels.in_gemm_pull import new_flags

        if device.type == "cuda":
            from .transport.symm import SymmetricMemoryTransport

            transport = SymmetricMemoryTransport(group, num_tokens, top_k, device,
                                                 timeout_ms=max(1, round(config.peer_timeout_s * 1000)))
        else:
            from .transport.cpu import SharedMemoryTransport

            transport = SharedMemoryTransport(group, num_tokens, top_k, timeout_s=config.peer_timeout_s)
        capacity = capacity_rows(ep_size * num_tokens * top_k, experts_per_rank, config.block_m)
        if config.macrobatch_size is None:  # a balanced routing's rows and padding in one window
            ring = ep_capacity_rows(num_tokens, top_k, ep_size, experts_per_rank, config.block_m,
                                    config.capacity_multiplier)
        else:
            ring = min(capacity, config.block_m * -(-config.macrobatch_size * top_k // config.block_m))
        ws = Workspace(num_tokens, top_k, hidden, num_experts, experts_per_rank, config.block_m, device, capacity,
                       rank=transport.rank, ep_size=ep_size, transport=transport, id=ident,
                       errors=ErrorFlags(device), pull_flags=new_flags(ring // 16 + 1, device), ring_rows=ring)
    _WORKSPACES[ident] = ws
    return ws


@functools.lru_cache(maxsize=None)  # never evicted: the custom ops find workspaces by id, so each stays registered
def _cached_workspace(num_tokens, top_k, hidden, num_experts, device, config, group, dtype):
    return create_workspace(num_tokens, top_k, hidden, num_experts, device=device, config=config, group=group,
                            dtype=dtype)


def get_workspace(num_tokens: int, top_k: int, hidden: int, num_experts: int, *, device=None,
                  config: Config | None = None, group=None, dtype: torch.dtype | None = None) -> Workspace:
    """The workspace for this problem, created on first use and cached for the process (one per distinct
    problem and Config: a token count that varies from step to step reuses its earlier workspaces)."""
    return _cached_workspace(num_tokens, top_k, hidden, num_experts, torch.device(device or "cpu"),
                             config or Config(), group, dtype)


@atexit.register
def _release_workspaces() -> None:
    """Drop every cached workspace at interpreter exit. A workspace holds its process group (and its transport):
    kept alive past `dist.destroy_process_group`, the group would be destroyed during interpreter teardown, where
    gloo's threads abort the process ("terminate called without an active exception"), at random."""
    _cached_workspace.cache_clear()
    _WORKSPACES.clear()


def workspace_by_id(ident: int) -> Workspace:
    """The workspace with this id (the custom ops carry workspaces as ids)."""
    return _WORKSPACES[ident]


def gather_routing(topk_ids: torch.Tensor, router_weights: torch.Tensor, workspace: Workspace):
    """The group's routing at EP: (topk_ids [P*N, k] int64, router_weights [P*N, k]), all-gathered in rank order.
    The ids go as int64 whatever integer dtype each rank passed, so ranks may differ there."""
    transport = workspace.transport
    return transport.all_gather(topk_ids.to(torch.int64)), transport.all_gather(router_weights)


def ep_schedule(all_ids: torch.Tensor, workspace: Workspace) -> Schedule:
    """This rank's schedule from the group's expert ids [P*N, k] (in [0, E)) (see `build_ep_schedule`)."""
    group_schedule = schedule_module.build_schedule(all_ids, workspace.num_experts, workspace.block_m)
    # the workspace's capacity is the worst case: no routing overflows it
    return local_schedule(group_schedule, workspace.rank, workspace.experts_per_rank, workspace.capacity_rows)[0]


def build_ep_schedule(topk_ids: torch.Tensor, router_weights: torch.Tensor, workspace: Workspace):
    """This rank's schedule at EP: all-gather the group's routing, build the schedule of the whole
    group (identical on every rank) and keep this rank's experts' rows, every one of them.

    Returns (schedule, the group's router weights [P*N, k]).
    """
    all_ids, all_router_weights = gather_routing(topk_ids, router_weights, workspace)
    return ep_schedule(all_ids, workspace), all_router_weights


def build_schedule(topk_ids: torch.Tensor, num_experts: int, block_m: int = 128) -> Schedule:
    """The routing schedule of `topk_ids` [N, k] (global expert ids of an integer dtype, each in [0, num_experts))
    with rows padded per expert to block_m (`serval.schedule.build_schedule`), its arguments checked first; the
    ids' range on CPU only (a value check on CUDA would sync the host: there the caller keeps them in range)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a 2-D tensor [N, k], got "
                         f"{tuple(topk_ids.shape) if isinstance(topk_ids, torch.Tensor) else type(topk_ids).__name__}")
    if topk_ids.dtype == torch.bool or topk_ids.is_floating_point() or topk_ids.is_complex():
        raise TypeError(f"topk_ids must hold integer expert ids, got {str(topk_ids.dtype).replace('torch.', '')}")
    for name, value in (("num_experts", num_experts), ("block_m", block_m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if topk_ids.device.type == "cpu" and topk_ids.numel() and not bool(
            ((topk_ids >= 0) & (topk_ids < num_experts)).all()):
        raise ValueError(f"topk_ids must hold expert ids in [0, {num_experts}) (num_experts), got values from "
                         f"{int(topk_ids.min())} to {int(topk_ids.max())}")
    return schedule_module.build_schedule(topk_ids, num_experts, block_m)


def _check_schedule(schedule: Schedule, x, router_weights, w_gate, workspace) -> None:
    """ValueError unless `schedule` was built for these inputs (at EP=1: N, k and E; at EP: k)."""
    want = (("top_k", schedule.top_k, router_weights.shape[1], "router_weights.shape[1]"),)
    if workspace is None:
        want += (("num_tokens", schedule.num_tokens, x.shape[0], "x.shape[0]"),
                 ("num_experts", schedule.num_experts, w_gate.shape[0], "w_gate.shape[0]"))
    for name, have, expected, source in want:
        if have != expected:
            raise ValueError(f"schedule was built for {name} = {have}, but {source} = {expected}: build it from these "
                             f"inputs' topk_ids")


# ---------------------------------------------------------------- passes

def select_backend(config: Config, x: torch.Tensor, w_gate: torch.Tensor, shared=None):
    """The stage implementations for this call: the torch-op stages (`serval.stages`) or the kernels
    (`serval.kernels.KernelStages`, run as `config.kernel_plan` says, or the plan chosen for x; with
    `config.comm_sms_forward` / `comm_sms_backward` as its pull programs and `minibatch_size` as its
    minibatch where they are set).

    Config.backend "auto" takes the kernels for bf16 on CUDA when every feature dimension (H, I, Is) is a
    multiple of 8, i.e. 16-byte rows (16 for fp8_blockwise: 16-byte E4M3 rows); other shapes take the torch
    stages (see `serval.kernels.supports`).
    """
    if config.backend == "torch":
        return stages
    from . import kernels

    dims = (x.shape[1], w_gate.shape[1]) + (() if shared is None else (shared[0].shape[0],))
    if config.backend == "triton":
        kernels.check_supported(x.device, dims, config.precision, x.dtype)
    elif not (x.is_cuda and x.dtype == torch.bfloat16 and kernels.supports(dims, config.precision)):
        return stages
    plan = config.kernel_plan or kernels.plan_for(x)
    for knob, field in (("comm_sms_forward", "pull_programs"), ("comm_sms_backward", "dgrad_pull_programs"),
                        ("minibatch_size", "minibatch_rows")):
        if getattr(config, knob) is not None:  # the contract's knobs over the plan's fields (see Config)
            plan = dataclasses.replace(plan, **{field: getattr(config, knob)})
    return kernels.KernelStages(plan)


@dataclasses.dataclass
class ForwardContext:
    """What backward needs beyond the layer's inputs (see the module docstring)."""

    schedule: Schedule
    shared_schedule: Schedule | None
    gate_up: torch.Tensor | None  # [num_packed, 2I] routed pre-activations, packed rows (None: recompute)
    shared_gate_up: torch.Tensor | None  # [N, 2Is]
    swiglu_limit: float | None
    all_router_weights: torch.Tensor | None = None  # EP: the group's router weights [P*N, k]
    kept: precision.Kept | None = None  # FP8 precisions: what the routed experts keep (gate_up is None then)


class Grads(NamedTuple):
    """The layer's gradients; a weight gradient is None where `backward` was told not to make it."""

    x: torch.Tensor
    router_weights: torch.Tensor
    w_gate: torch.Tensor | None
    w_up: torch.Tensor | None
    w_down: torch.Tensor | None
    shared: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None


def _shared_weights(shared):
    """The shared expert as a one-expert group: [1, Is, H], [1, Is, H], [1, H, Is]."""
    return tuple(w.unsqueeze(0) for w in shared)


def _transport(workspace: Workspace | None):
    return None if workspace is None else workspace.transport


def _rows_in(ops, tokens, schedule: Schedule, transport):
    """The schedule's rows of a token tensor [N, C]: gathered here (EP=1) or pulled from their owners."""
    return ops.gather(tokens, schedule) if transport is None else transport.pull(tokens, schedule.row_source)


def _rows_out(rows, schedule: Schedule, transport):
    """Where each token's k rows are read from for the slot-order sums: (rows, schedule) at EP=1;
    at EP, this rank's slot buffer after every rank pushed its rows into their owners' slots. The group's
    schedule writes every slot (no zero fill needed), and the caller sums the slots right away,
    before the next push can reuse the buffer (no copy needed)."""
    if transport is None:
        return rows, schedule
    slots = transport.push(rows, schedule.row_source, complete=True, copy=False)
    return slots, slot_schedule(transport.num_tokens, transport.top_k, rows.device)


def _gemm_out(ops, gemm, cols: int, dtype, schedule: Schedule, transport):
    """`_rows_out` of the rows a stage GEMM makes, gemm(**push) -> [R, cols]: where the backend can, the
    GEMM's epilogue writes them straight into the owners' slots (`push_from`; the rows are never
    materialised), else they are made, then pushed."""
    if transport is not None and ops.pushes_from_epilogue:
        slots = transport.push_from(lambda target: gemm(push_to=target), cols, dtype)
        return slots, slot_schedule(transport.num_tokens, transport.top_k, slots.device)
    return _rows_out(gemm(), schedule, transport)


def _shared_gate_up(ops, x, shared, shared_schedule, swiglu_limit):
    """The shared expert's pre-activations [N, 2Is] and h (None, None without one)."""
    if shared is None:
        return None, None
    ws_gate, ws_up, _ = _shared_weights(shared)
    return ops.gate_up_swiglu(x, ws_gate, ws_up, shared_schedule, swiglu_limit)


def _gate_up(ops, x, w_gate, w_up, shared, schedule, shared_schedule, swiglu_limit, workspace):
    """Pre-activations and h of the routed experts and of the shared expert. At EP the GEMM pulls its rows
    from the owners itself where the backend can (`pull_into`), else they are pulled first."""
    transport = _transport(workspace)
    if transport is not None and ops.pulls_in_gemm:
        gate_up, h = transport.pull_into(
            lambda source: ops.gate_up_swiglu(x, w_gate, w_up, schedule, swiglu_limit, pull_from=source,
                                              pull_flags=workspace.pull_flags), x)
    else:  # at EP=1 the stage gathers x's rows itself (a gather pass, or its GEMM's loader)
        x_rows = None if transport is None else transport.pull(x, schedule.row_source)
        gate_up, h = ops.gate_up_swiglu(x, w_gate, w_up, schedule, swiglu_limit, a_rows=x_rows)
    return (gate_up, h, *_shared_gate_up(ops, x, shared, shared_schedule, swiglu_limit))


def _fused_experts(ops, x, w_gate, w_up, w_down, schedule: Schedule, swiglu_limit, workspace, shared=None,
                   quant_block: int = 0):
    """gate_up, h and the combine's (rows, schedule) of the routed experts from one launch (`gate_up_down`,
    KernelPlan.fused_forward), and the shared expert's outputs made in it (`gate_up_down`'s shared_out; None
    without `shared`). At EP its programs pull x's rows from the owners, compute, and push o's rows into the
    owners' slots: the launch runs inside both transport phases (slots free, tokens published). mxfp8: x and
    the weights are the dequantized operands (`precision.fused_forward_operands`), quant_block its block."""
    transport = _transport(workspace)
    if transport is None:
        gate_up, h, o, shared_out = ops.gate_up_down(x, w_gate, w_up, w_down, schedule, swiglu_limit, shared=shared,
                                                     quant_block=quant_block)
        return gate_up, h, o, schedule, shared_out
    made = {}

    def write(target):
        def consume(source):
            made["gate_up"], made["h"], _, made["shared"] = ops.gate_up_down(
                x, w_gate, w_up, w_down, schedule, swiglu_limit, pull_from=source, pull_flags=workspace.pull_flags,
                push_to=target, shared=shared, quant_block=quant_block)
        transport.pull_into(consume, x)

    slots = transport.push_from(write, w_down.shape[1], x.dtype)
    return (made["gate_up"], made["h"], slots, slot_schedule(transport.num_tokens, transport.top_k, slots.device),
            made["shared"])


def forward(x, router_weights, schedule: Schedule, w_gate, w_up, w_down, shared=None, *,
            config: Config | None = None, swiglu_limit: float | None = None,
            shared_schedule: Schedule | None = None, workspace: Workspace | None = None,
            all_router_weights: torch.Tensor | None = None,
            expert_weights: precision.ExpertWeights | None = None) -> tuple[torch.Tensor, ForwardContext]:
    """y = shared(x) + routed experts combined in slot order; returns (y, what backward needs).

    At EP: `workspace` of the group, `schedule` and `all_router_weights` from `build_ep_schedule`.
    The routed experts run in `config.precision` (`serval.precision`), the shared expert in x's dtype;
    expert_weights: in an FP8 precision, the weights already in its GEMMs' form (`precision.expert_weights`).
    """
    config = config or Config()
    _check_schedule(schedule, x, router_weights, w_gate, workspace)
    recipe = precision.recipe_of(config.precision)
    ops = select_backend(config, x, w_gate, shared)
    transport = _transport(workspace)
    if shared is not None:
        shared_schedule = shared_schedule or dense_schedule(x.shape[0], schedule.block_m, x.device)
    shared_out = None
    if recipe is not None:
        precision.check_inputs(recipe, x.dtype, w_gate.shape[1], schedule.block_m)
        if config.debug:
            for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
                precision.check_finite(name, t)
    streamed = macrobatch.streams(ops, recipe, workspace)
    fuses = ops.fuses_forward and precision.fuses(recipe, w_gate.shape[1], backward=False)
    fused = fuses and not streamed
    # in a fused launch the shared expert's tiles join the routed ones (first: they need no pulled rows)
    fused_shared = None
    if shared is not None and fuses:
        fused_shared = (x, *_shared_weights(shared), shared_schedule)
    kept = None
    if streamed:  # the routed rows through the macrobatch ring, window by window; gate_up: the first window's
        made = None if recipe is None else precision.gemm_weights(recipe, w_gate, w_up, w_down, expert_weights,
                                                                  ("gate_up", "down"))
        gate_up, token_rows, token_schedule, shared_made = macrobatch.forward(
            ops, x, w_gate, w_up, w_down, schedule, swiglu_limit, workspace, shared=fused_shared, recipe=recipe,
            made=made)
        if recipe is not None:  # FP8: the first window's Kept
            kept, gate_up = gate_up, None
    elif fused and recipe is not None:  # mxfp8: the launch reads the dequantized operands, keeps as the staged path
        gate_up, h, token_rows, token_schedule, shared_made = _fused_experts(
            ops, *precision.fused_forward_operands(recipe, x, w_gate, w_up, w_down, expert_weights,
                                                   at_ep=transport is not None), schedule,
            swiglu_limit, workspace, shared=fused_shared, quant_block=recipe.block)
        kept, gate_up = precision.keep(recipe, gate_up, h), None
    elif fused:
        gate_up, h, token_rows, token_schedule, shared_made = _fused_experts(
            ops, x, w_gate, w_up, w_down, schedule, swiglu_limit, workspace, shared=fused_shared)
    elif recipe is None:
        gate_up, h, shared_gate_up, shared_h = _gate_up(ops, x, w_gate, w_up, shared, schedule, shared_schedule,
                                                        swiglu_limit, workspace)
    else:
        if transport is not None and precision.pulls_in_gemm(ops, recipe, backward=False):  # the GEMM pulls x's rows
            out, kept = transport.pull_into(lambda source: precision.forward(
                ops, recipe, x, None, w_gate, w_up, w_down, schedule, swiglu_limit, expert_weights,
                pull=dict(pull_from=source, pull_flags=workspace.pull_flags)), x)
        else:
            x_rows = None if transport is None else transport.pull(x, schedule.row_source)
            out, kept = precision.forward(ops, recipe, x, x_rows, w_gate, w_up, w_down, schedule, swiglu_limit,
                                          expert_weights)
        gate_up = None
        shared_gate_up, shared_h = _shared_gate_up(ops, x, shared, shared_schedule, swiglu_limit)
    shared_o = None  # [Rs, H]
    if (streamed or fused) and shared_made is not None:  # the shared expert's outputs from the fused launch
        shared_gate_up, _, shared_o = shared_made
    elif streamed or fused:
        shared_gate_up, shared_h = _shared_gate_up(ops, x, shared, shared_schedule, swiglu_limit)
    if shared is not None:
        if shared_o is None:
            shared_o = ops.down(shared_h, _shared_weights(shared)[2], shared_schedule)
        shared_out = shared_o[: x.shape[0]]
    if recipe is None and not (fused or streamed):
        token_rows, token_schedule = _gemm_out(ops, lambda **push: ops.down(h, w_down, schedule, **push),
                                               w_down.shape[1], h.dtype, schedule, transport)
    elif not (fused or streamed) and recipe is not None:
        token_rows, token_schedule = _rows_out(out, schedule, transport)
    y = ops.combine(token_rows, router_weights, token_schedule, shared_out)
    keep = not config.recompute
    ctx = ForwardContext(schedule, shared_schedule, gate_up if keep else None,
                         shared_gate_up if keep else None, swiglu_limit, all_router_weights,
                         kept if keep else None)
    return y, ctx


def kept_rows(config: Config, x, w_gate, shared, workspace: Workspace | None, capacity: int,
              num_sources: int) -> tuple[int, int]:
    """(packed rows, rows) of what a forward keeps of the routed experts (the custom op's fake implementation sizes
    its outputs with them): a schedule's num_packed (`Schedule.num_packed`: the pre-activations) and capacity (an
    FP8 precision's h along tokens), for the whole schedule of `capacity` rows and `num_sources` (token, slot)
    pairs, or for the first window where the pass streams through the ring."""
    if macrobatch.streams(select_backend(config, x, w_gate, shared), precision.recipe_of(config.precision),
                          workspace):
        capacity = workspace.ring_rows
    return min(capacity, num_sources), capacity


def recompute_forward_context(ctx: ForwardContext, x, w_gate, w_up, shared=None, *,
                              config: Config | None = None, workspace: Workspace | None = None,
                              expert_weights: precision.ExpertWeights | None = None) -> ForwardContext:
    """Fill in what a `Config(recompute=True)` forward did not keep (from the forward's x and weights). A pass
    that streams through the macrobatch ring (`serval.macrobatch`) recomputes the routed experts' pre-activations
    in its backward, window by window: here only the shared expert's."""
    config = config or Config()
    _check_shared(ctx, shared)
    recipe = precision.recipe_of(config.precision)
    if ctx.gate_up is not None or ctx.kept is not None:
        return ctx
    ops = select_backend(config, x, w_gate, shared)
    if macrobatch.streams(ops, recipe, workspace):
        if shared is None or ctx.shared_gate_up is not None:
            return ctx
        return dataclasses.replace(ctx, shared_gate_up=_shared_gate_up(ops, x, shared, ctx.shared_schedule,
                                                                       ctx.swiglu_limit)[0])
    if recipe is None:
        gate_up, _, shared_gate_up, _ = _gate_up(ops, x, w_gate, w_up, shared, ctx.schedule, ctx.shared_schedule,
                                                 ctx.swiglu_limit, workspace)
        return dataclasses.replace(ctx, gate_up=gate_up, shared_gate_up=shared_gate_up)
    transport = _transport(workspace)
    x_rows = None if transport is None else transport.pull(x, ctx.schedule.row_source)
    _, kept = precision.forward(ops, recipe, x, x_rows, w_gate, w_up, None, ctx.schedule, ctx.swiglu_limit,
                                expert_weights)
    shared_gate_up, _ = _shared_gate_up(ops, x, shared, ctx.shared_schedule, ctx.swiglu_limit)
    return dataclasses.replace(ctx, kept=kept, shared_gate_up=shared_gate_up)


def _check_shared(ctx: ForwardContext, shared) -> None:
    """ValueError unless the shared expert is passed exactly when the forward had one."""
    if (ctx.shared_schedule is None) != (shared is None):
        had = "had none" if ctx.shared_schedule is None else "had one"
        raise ValueError(f"shared: the forward {had}; pass the shared expert's weights exactly as to the forward")


def _fused_dgrads(ops, d_y, row_router_weights, schedule: Schedule, gate_up, w_gate, w_up, w_down, swiglu_limit,
                  workspace, shared=None, quant_block: int = 0):
    """(d_y_rows, d_gate_up, h_weighted, d_rw_rows, (d_x rows, their schedule), shared_made) from one launch
    (`down_dgrad_gate_up_dgrad`, KernelPlan.fused_backward; shared_made: the shared expert's dgrads from the same
    launch, its `shared_out`, None without `shared`). At EP its programs pull d_y's rows from the owners into
    d_y_rows (which the down weight gradient reads next), compute, and push d_x's rows into the owners' slots:
    the launch runs inside both transport phases (slots free, tokens published). mxfp8: d_y, gate_up and the
    weights as `precision.fused_backward_operands` makes them, quant_block its block (at EP d_y_rows are then the
    rows as pulled, which the launch round-trips for the dgrad)."""
    transport = _transport(workspace)
    if transport is None:
        d_y_rows = ops.gather(d_y, schedule)
        d_gate_up, h_weighted, d_rw_rows, d_x_rows, shared_made = ops.down_dgrad_gate_up_dgrad(
            d_y_rows, w_down, w_gate, w_up, gate_up, row_router_weights, schedule, swiglu_limit, shared=shared,
            quant_block=quant_block)
        return d_y_rows, d_gate_up, h_weighted, d_rw_rows, (d_x_rows, schedule), shared_made
    d_y_rows = torch.empty(schedule.capacity, d_y.shape[1], dtype=d_y.dtype, device=d_y.device)
    made = {}

    def write(target):
        def consume(source):
            made["d_gate_up"], made["h_weighted"], made["d_rw_rows"], _, made["shared"] = \
                ops.down_dgrad_gate_up_dgrad(d_y_rows, w_down, w_gate, w_up, gate_up, row_router_weights, schedule,
                                             swiglu_limit, pull_from=source, pull_flags=workspace.pull_flags,
                                             push_to=target, shared=shared, quant_block=quant_block)
        transport.pull_into(consume, d_y)

    slots = transport.push_from(write, w_gate.shape[2], d_y.dtype)
    return (d_y_rows, made["d_gate_up"], made["h_weighted"], made["d_rw_rows"],
            (slots, slot_schedule(transport.num_tokens, transport.top_k, slots.device)), made["shared"])


def _shared_after_fused_dgrads(ops, x, shared_made, shared_schedule: Schedule, weight_grads: bool):
    """The rest of the shared expert's backward once its dgrads ran in the routed experts' fused launch
    (shared_made: its d_y_rows, d_gate_up, h and d_x rows on its dense schedule): (d_x [N, H], (d_ws_gate,
    d_ws_up, d_ws_down), None without weight_grads), each computed as `_expert_backward` computes it."""
    d_y_rows, d_gate_up, h, d_x_rows = shared_made
    d_w_down = ops.down_weight_grad(d_y_rows, h, shared_schedule) if weight_grads else None
    d_x = ops.sum_slots(d_x_rows, shared_schedule, None)
    d_w_gate = d_w_up = None
    if weight_grads:
        d_w_gate, d_w_up = ops.gate_up_weight_grad(d_gate_up, x, shared_schedule,
                                                   x_rows=ops.gather(x, shared_schedule))
    return d_x, tuple(None if g is None else g[0] for g in (d_w_gate, d_w_up, d_w_down))


def _expert_backward(ops, d_y, x, router_weights, row_router_weights, schedule, gate_up, w_gate, w_up, w_down,
                     swiglu_limit, workspace, shared_d_x=None, weight_grads=True, fused_shared=None,
                     shared_weight_grads=True):
    """One expert group's backward: (d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, shared_grads); the weight
    gradients None without `weight_grads` (their GEMMs do not run; at EP the pull of x's rows still does, so that
    every rank makes the same transport calls whatever its weights require). fused_shared: on stages that fuse
    the backward, the shared expert's (d_y, weights, dense schedule, gate_up), whose dgrads then join the launch;
    its d_x joins the slot sum and shared_grads are its weight gradients (`_shared_after_fused_dgrads`); without
    it, shared_grads is None and shared_d_x (or nothing) joins the sum.

    Ordered so that each [R, *] buffer dies as soon as its last use is done (d_y rows and rw * h
    after the down weight gradient, d_x rows after their slot sum; at EP with the kernels they are
    never made: the GEMM pushes them): the peak holds about two of them.
    """
    transport = _transport(workspace)
    d_x_rows = None
    shared_grads = None
    if ops.fuses_backward:  # both dgrads in one launch: d_x's rows come with the others
        d_y_rows, d_gate_up, h_weighted, d_rw_rows, d_x_rows, shared_made = _fused_dgrads(
            ops, d_y, row_router_weights, schedule, gate_up, w_gate, w_up, w_down, swiglu_limit, workspace,
            fused_shared)
        if shared_made is not None:
            shared_d_x, shared_grads = _shared_after_fused_dgrads(ops, x, shared_made, fused_shared[4],
                                                                  shared_weight_grads)
    elif transport is not None and ops.pulls_in_dgrad:  # the dgrad's programs pull d_y's rows into d_y_rows
        d_y_rows = torch.empty(schedule.capacity, d_y.shape[1], dtype=d_y.dtype, device=d_y.device)
        d_gate_up, h_weighted, d_rw_rows = transport.pull_into(
            lambda source: ops.down_dgrad_swiglu(d_y_rows, w_down, gate_up, row_router_weights, schedule,
                                                 swiglu_limit, pull_from=source, pull_flags=workspace.pull_flags), d_y)
    else:
        d_y_rows = _rows_in(ops, d_y, schedule, transport)
        d_gate_up, h_weighted, d_rw_rows = ops.down_dgrad_swiglu(d_y_rows, w_down, gate_up, row_router_weights,
                                                                 schedule, swiglu_limit)
    d_w_down = ops.down_weight_grad(d_y_rows, h_weighted, schedule) if weight_grads else None
    del d_y_rows, h_weighted
    if d_x_rows is None:
        d_x_rows = _gemm_out(ops, lambda **push: ops.gate_up_dgrad(d_gate_up, w_gate, w_up, schedule, **push),
                             w_gate.shape[2], d_gate_up.dtype, schedule, transport)
    d_x = ops.sum_slots(*d_x_rows, shared_d_x)
    del d_x_rows
    d_router_weights = _router_weight_grad(d_rw_rows, router_weights, schedule, transport)
    d_w_gate = d_w_up = None
    if weight_grads or transport is not None:
        x_rows = _rows_in(ops, x, schedule, transport)
    if weight_grads:  # in the weights' layout: the halves of one tensor for a joined gate/up weight
        d_w_gate, d_w_up = ops.gate_up_weight_grad(d_gate_up, x, schedule, x_rows=x_rows,
                                                   out=weight_layout.grad_buffers(w_gate, w_up))
    return d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, shared_grads


def backward(d_y, ctx: ForwardContext, x, router_weights, w_gate, w_up, w_down, shared=None, *,
             config: Config | None = None, workspace: Workspace | None = None,
             expert_weights: precision.ExpertWeights | None = None, weight_grads: bool = True,
             shared_weight_grads: bool = True) -> Grads:
    """Gradients of the layer for output gradient d_y [N, H]; see `Grads` (expert_weights: as in `forward`).
    weight_grads / shared_weight_grads False: the routed / shared experts' weight gradients are None and their
    GEMMs do not run (frozen experts)."""
    config = config or Config()
    ops = select_backend(config, x, w_gate, shared)
    transport = _transport(workspace)
    # recompute_forward_context checks the shared expert is passed as to the forward
    ctx = recompute_forward_context(ctx, x, w_gate, w_up, shared, config=config, workspace=workspace,
                                    expert_weights=expert_weights)
    d_y = d_y.contiguous()
    row_router_weights = router_weights if transport is None else ctx.all_router_weights
    recipe = precision.recipe_of(config.precision)
    streamed = macrobatch.streams(ops, recipe, workspace)
    # (a streamed pass under recompute keeps nothing: its backward recomputes every window)
    if (recipe is None and ctx.kept is not None) or (
            recipe is not None and ctx.kept is None and (ctx.gate_up is not None or not streamed)):
        made = "bf16" if ctx.kept is None else "an FP8 precision"
        raise ValueError(f"serval.functional.backward: the forward context was made in {made}, not "
                         f"{config.precision}: pass the Config of the forward")
    shared_d_x = shared_grads = fused_shared = None
    fuses = ops.fuses_backward and precision.fuses(recipe, w_gate.shape[1], backward=True)
    if shared is not None and fuses:  # its dgrads join the routed fused launch
        fused_shared = (d_y, *_shared_weights(shared), ctx.shared_schedule, ctx.shared_gate_up)
    elif shared is not None:  # the shared expert: every local token once, rows = tokens, never moved
        ones = torch.ones(x.shape[0], 1, device=x.device, dtype=router_weights.dtype)
        shared_d_x, _, *shared_grads, _ = _expert_backward(
            ops, d_y, x, ones, ones, ctx.shared_schedule, ctx.shared_gate_up, *_shared_weights(shared),
            ctx.swiglu_limit, None, weight_grads=shared_weight_grads)
        shared_grads = tuple(None if g is None else g[0] for g in shared_grads)
    if recipe is not None and config.debug:
        precision.check_finite("d_y", d_y)
    if streamed:  # the gate/up weights in the forward's form too: the later windows recompute the pre-activations
        made = None if recipe is None else precision.gemm_weights(recipe, w_gate, w_up, w_down, expert_weights,
                                                                  ("gate_up", "down_t", "gate_up_t"))
        slots, slot_sched, d_rw_rows, d_w_gate, d_w_up, d_w_down, shared_made = macrobatch.backward(
            ops, d_y, x, row_router_weights, ctx.schedule, ctx.gate_up if recipe is None else ctx.kept, w_gate, w_up,
            w_down, ctx.swiglu_limit, workspace, weight_grads, shared=fused_shared, recipe=recipe, made=made)
        if shared_made is not None:
            shared_d_x, shared_grads = _shared_after_fused_dgrads(ops, x, shared_made, ctx.shared_schedule,
                                                                  shared_weight_grads)
        d_x = ops.sum_slots(slots, slot_sched, shared_d_x)
        d_router_weights = _router_weight_grad(d_rw_rows, router_weights, ctx.schedule, transport)
    elif recipe is None:
        d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, fused_shared_grads = _expert_backward(
            ops, d_y, x, router_weights, row_router_weights, ctx.schedule, ctx.gate_up, w_gate, w_up, w_down,
            ctx.swiglu_limit, workspace, shared_d_x, weight_grads, fused_shared, shared_weight_grads)
        shared_grads = fused_shared_grads or shared_grads
    elif fuses:  # mxfp8: both dgrads in one launch on the dequantized operands, the weight gradients as staged
        schedule = ctx.schedule
        d_y_in, down_t, gate_t, up_t, gate_up = precision.fused_backward_operands(
            recipe, d_y, ctx.kept, w_gate, w_up, w_down, expert_weights, at_ep=transport is not None)
        d_y_rows, d_gate_up, _, d_rw_rows, d_x_rows, shared_made = _fused_dgrads(
            ops, d_y_in, row_router_weights, schedule, gate_up, gate_t, up_t, down_t, ctx.swiglu_limit, workspace,
            fused_shared, quant_block=recipe.block)
        del d_y_in, gate_up
        if shared_made is not None:
            shared_d_x, shared_grads = _shared_after_fused_dgrads(ops, x, shared_made, ctx.shared_schedule,
                                                                  shared_weight_grads)
        d_x = ops.sum_slots(*d_x_rows, shared_d_x)
        del d_x_rows
        d_router_weights = _router_weight_grad(d_rw_rows, router_weights, schedule, transport)
        # the weight gradients quantize d_y's and x's own rows along tokens: at EP=1 read through the schedule; at EP
        # d_y's as the launch pulled them, x's pulled now (by every rank, whatever its weights need)
        x_rows = None
        if transport is None:
            d_y_rows = None
        else:
            x_rows = transport.pull(x, schedule.row_source)
        d_w_gate = d_w_up = d_w_down = None
        if weight_grads:
            row_rw = stages.row_weights(row_router_weights, schedule).float()
            d_w_gate, d_w_up, d_w_down = precision.expert_weight_grads(ops, recipe, d_y, d_y_rows, x, x_rows, d_gate_up,
                                                                       ctx.kept, row_rw, schedule, w_gate, w_up)
    else:
        schedule = ctx.schedule
        pulls = transport is not None and precision.pulls_in_gemm(ops, recipe, backward=True)
        x_rows = d_y_rows = None
        if transport is not None:
            x_rows = transport.pull(x, schedule.row_source)
            d_y_rows = d_y.new_empty(schedule.capacity, d_y.shape[1]) if pulls else transport.pull(d_y,
                                                                                                   schedule.row_source)

        def experts_backward(d_y_pull=None):
            return precision.backward(ops, recipe, d_y, d_y_rows, x, x_rows, ctx.kept, row_router_weights, w_gate,
                                      w_up, w_down, schedule, ctx.swiglu_limit, expert_weights, weight_grads,
                                      d_y_pull=d_y_pull)
        if pulls:  # the down dgrad pulls d_y's rows (into d_y_rows, as pulled)
            d_x_rows, d_rw_rows, d_w_gate, d_w_up, d_w_down = transport.pull_into(
                lambda source: experts_backward(dict(pull_from=source, pull_flags=workspace.pull_flags)), d_y)
        else:
            d_x_rows, d_rw_rows, d_w_gate, d_w_up, d_w_down = experts_backward()
        d_x = ops.sum_slots(*_rows_out(d_x_rows, schedule, transport), shared_d_x)
        del d_x_rows
        d_router_weights = _router_weight_grad(d_rw_rows, router_weights, schedule, transport)
    return Grads(d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, shared_grads)


def _router_weight_grad(d_rw_rows, router_weights, schedule: Schedule, transport):
    """d_router_weights [N, k] from the rows' gradients [R] (fp32): each source's row, moved to its owner."""
    d_rw_slots, slots = _rows_out(d_rw_rows[:, None], schedule, transport)
    return d_rw_slots[slots.source_row.to(torch.int64), 0].to(router_weights.dtype)
