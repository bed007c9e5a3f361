"""The layer's workspace: everything sized once from the problem, never from the routing, and cached per problem.

A `Workspace` holds the worst-case row capacity of a rank's schedule, at expert parallelism the transport (peer
buffers, created collectively) with its error flags, in-GEMM pull flags and macrobatch ring buffers. The custom
ops carry workspaces as ids (`workspace_by_id`).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import itertools

import torch
import torch.distributed as dist

from .config import Config
from .schedule import capacity_rows, ep_capacity_rows
from .values import new_pull_flags

__all__ = ["Workspace", "ErrorFlags", "create_workspace", "get_workspace", "workspace_by_id"]

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
                       errors=ErrorFlags(device), pull_flags=new_pull_flags(ring // 16 + 1, device), ring_rows=ring)
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
