"""The forward's two expert GEMMs in one persistent launch, at expert parallelism with the dispatch (pull) and the
combine (push) in the same launch: the first piece of the fused layer kernel.

What this module owns: `_fused_forward_kernel`, which runs every gate/up + SwiGLU tile and every down tile of the
forward in one persistent grid (at EP its first programs pull x's rows, and the down tiles push o's rows to their
owners: see `fused_forward`); its task order (`task_order`, the pure-Python
statement of it, and `_task_coords`, its device-side decode); its synchronisation state (`Sync`, `new_sync`); and
the host function `fused_forward`. The per-tile work (K loop + epilogue) is `triton_gemm._gemm_tile`, the same
function the staged grouped GEMM calls, in its "swiglu_fwd" and "store" variants with W_NK: the results are bit for
bit those of `triton_gemm.gate_up_swiglu` followed by `triton_gemm.down` with the same TileConfigs.

Tasks. With M_used = expert_offsets[E] // BLOCK_M M-tiles (read on the device: no host sync), the gate/up GEMM has
M_used * n_gu tiles (n_gu = ceil(I / gate_up block_n)) and down M_used * n_dn (n_dn = ceil(H / down block_n)). The
M-tiles are cut into minibatches of MB = minibatch_rows // BLOCK_M M-tiles (the last one may be shorter); GU(b) is
minibatch b's gate/up tiles, DN(b) its down tiles, and the task order is

    GU(0), GU(1), DN(0), GU(2), DN(1), ..., GU(nb - 1), DN(nb - 2), DN(nb - 1)

so a down tile depends only on earlier tasks, and, one minibatch of gate/up work having run in between, usually
finds its h ready. Within GU(b) / DN(b) the tiles are in the staged kernel's order with GROUP_M = the gate/up
config's group_m (at most MB; MB is rounded up to a multiple of it, so minibatches start on M-group boundaries;
`common.tile_coords` on the GEMM's own tile numbering): each GEMM's tiles are taken in exactly the order of its
staged launch with that M-group, and the fused order interleaves the two sequences minibatch by minibatch.

Counter. Programs take task ids from an int32 counter with `tl.atomic_add` (integer atomics only; nothing
floating-point is ever accumulated atomically): a program holds two ids, the task it runs and the next one, taken
when the task starts so that the counter's round trip overlaps it; it stops at the first id past the last task
(a launch draws at most tasks + 2 * programs ids).

Flags. A gate/up tile, once its gate_up and h columns are stored (pointer stores), fences them for the async proxy
(down reads h through TMA), waits for its warps (`tl.debug_barrier`) and adds 1 to its M-tile's int32 flag with
release semantics. A down tile first waits (acquire) until its M-tile's flag reaches n_gu: all gate/up N-tiles of
that M-tile have stored their h. The wait is bounded (`in_gemm_pull.wait_until`): after about 10 s the program traps,
an error instead of a hang, and with `debug_waits` prints the M-tile first (off by default: a printf is a function
call, and a call anywhere in the kernel makes ptxas serialize all its wgmma instructions).

Epochs, nothing reset between launches. `Sync.epoch` (int32 [1]) is bumped on the device before each launch (a
stream-ordered `add_`, captured with the launch in a CUDA graph). Launch e uses counter `counters[e % 2]` and flags
`flags[e % 2]`, all zero when it starts, and zeroes `counters[(e + 1) % 2]` and `flags[(e + 1) % 2]`: launch e - 1
used them and has finished (stream order), launch e + 1 will use them and has not started. The host never resets
anything, a CUDA graph replays (each replay bumps the epoch and so alternates the parity), and nothing overflows:
the counter and the flags restart from zero every other launch (a launch draws fewer than 2^31 ids: checked on the
host) and only the epoch's parity matters (`epoch & 1` stays right when the int32 epoch wraps). One `Sync` serves one
stream: launches that share it must run one after another (no programmatic dependent launch, no second stream).

Deadlock freedom. Ids are handed out in increasing order, and a task waits only on earlier tasks (a down tile of
M-tile m on gate/up tiles of m, all earlier in the order); gate/up tasks never wait. A program's next id is larger
than its current one and becomes current as soon as the current finishes, so the earliest unfinished task is always
some program's current task, and everything it waits on is earlier, hence finished: it completes, and by induction
the launch progresses whether or not every program is resident. In Triton's CPU interpreter programs run one after
another: program 0 takes every task in order (so no wait ever blocks) and the others find the counter exhausted.

Constraints: both TileConfigs must give the same BLOCK_M (min(block_m, schedule.block_m)); one launch has one
num_warps and num_stages, the gate/up config's (the down tiles compile with them: checked for the plan's Hopper
tiles, 128 x 128 x 64 dual-accumulator gate/up and 128 x 256 x 64 down, 8 warps, 3 stages). The gate/up tiles store
h with pointer stores whatever `epi_tma_stores` says (their release then covers them with one proxy fence); the
down tiles follow their config. `flatten` of either config and the down config's `group_m` do not apply (the
task loop is a while loop over ids; one M-group serves both GEMMs). Operands: bf16, fp16 or fp32, one dtype, as the staged GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..overlap import layer_minibatch_rows
from ..plan import TileConfig
from ..peers import PeerSlots
from ..schedule import Schedule, packed_index
from . import common, in_gemm_pull
from .triton_gemm import _check, _descriptors, _gemm_tile, _tma_compatible

GATE_UP, DOWN = 0, 1  # the GEMM of a task, as `task_order` and `_task_coords` name it

CLEAR_BLOCK = tl.constexpr(1024)  # flags a program zeroes a step


# ---------------------------------------------------------------- the task order


def _tile_coords(tile_id: int, num_m_tiles: int, num_n_tiles: int, group_m: int) -> tuple[int, int]:
    """`common.tile_coords` in Python (the same arithmetic, for `task_order`)."""
    tiles_per_group = group_m * num_n_tiles
    first_m = (tile_id // tiles_per_group) * group_m
    group_size = min(num_m_tiles - first_m, group_m)
    return first_m + (tile_id % tiles_per_group) % group_size, (tile_id % tiles_per_group) // group_size


def task_order(num_m_tiles: int, n_tiles_gate_up: int, n_tiles_down: int, minibatch_m_tiles: int,
               group_m: int | None = None) -> list[tuple[int, int, int]]:
    """The fused forward's tasks in the order programs take them: [(gemm, m_tile, n_tile)], gemm GATE_UP or DOWN.

    GU(0), GU(1), DN(0), GU(2), DN(1), ..., GU(nb - 1), DN(nb - 2), DN(nb - 1), where GU(b) / DN(b) are the gate/up
    and down tiles of minibatch b (M-tiles [b * MB, min((b + 1) * MB, num_m_tiles)), MB = minibatch_m_tiles), each
    in its GEMM's staged tile order with GROUP_M = group_m (default MB; MB must be a multiple of it unless one
    minibatch holds every M-tile). `_task_coords` decodes a task id to the same triple."""
    for name, value in (("num_m_tiles", num_m_tiles), ("n_tiles_gate_up", n_tiles_gate_up),
                        ("n_tiles_down", n_tiles_down), ("minibatch_m_tiles", minibatch_m_tiles)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "num_m_tiles" else 1):
            raise ValueError(f"task_order: {name} must be an int >= {0 if name == 'num_m_tiles' else 1}, got {value!r}")
    mb = minibatch_m_tiles
    group = mb if group_m is None else group_m
    if not isinstance(group, int) or isinstance(group, bool) or group < 1 or (mb % group and mb < num_m_tiles):
        raise ValueError(f"task_order: group_m must be an int >= 1 dividing minibatch_m_tiles={mb} (unless one "
                         f"minibatch holds all {num_m_tiles} M-tiles), got {group_m!r}")
    num_minibatches = -(-num_m_tiles // mb)

    def tiles(gemm, b):
        n = n_tiles_gate_up if gemm == GATE_UP else n_tiles_down
        size = min(num_m_tiles - b * mb, mb)
        return [(gemm, *_tile_coords(b * mb * n + i, num_m_tiles, n, group)) for i in range(size * n)]

    if num_minibatches == 0:
        return []
    order = tiles(GATE_UP, 0)
    for b in range(1, num_minibatches):
        order += tiles(GATE_UP, b) + tiles(DOWN, b - 1)
    return order + tiles(DOWN, num_minibatches - 1)


@triton.jit
def _task_coords(task, num_m_tiles, n_gu, n_dn, MB: tl.constexpr, GROUP_M: tl.constexpr):
    """(is_down, m_tile, n_tile) of task id `task` < num_m_tiles * (n_gu + n_dn): `task_order`'s entry `task`."""
    num_minibatches = tl.cdiv(num_m_tiles, MB)
    first_len = n_gu * tl.minimum(num_m_tiles, MB)  # GU(0)
    pair = MB * (n_gu + n_dn)  # GU(j) + DN(j - 1) for 1 <= j < num_minibatches (GU of the last may be shorter)
    u = tl.maximum(task - first_len, 0)
    j = tl.maximum(tl.minimum(u // pair + 1, num_minibatches - 1), 1)
    r = u - (j - 1) * pair
    gu_len = n_gu * tl.minimum(num_m_tiles - j * MB, MB)  # GU(j)
    in_first = task < first_len
    after_pairs = r >= gu_len + MB * n_dn  # DN(num_minibatches - 1), after the last pair
    # one minibatch only: GU(0), DN(0)
    is_down = (~in_first) & ((num_minibatches == 1) | (r >= gu_len))
    minibatch = tl.where(in_first, 0,
                         tl.where(num_minibatches == 1, 0,
                                  tl.where(r < gu_len, j, tl.where(after_pairs, num_minibatches - 1, j - 1))))
    local = tl.where(in_first, task,
                     tl.where(num_minibatches == 1, u,
                              tl.where(r < gu_len, r, tl.where(after_pairs, r - gu_len - MB * n_dn, r - gu_len))))
    n_tiles = tl.where(is_down, n_dn, n_gu)
    m_tile, n_tile = common.tile_coords(minibatch * MB * n_tiles + local, num_m_tiles, n_tiles, GROUP_M)
    return is_down, m_tile, n_tile


@triton.jit
def _task_order_kernel(out_ptr, num_m_tiles, n_gu, n_dn, MB: tl.constexpr, GROUP_M: tl.constexpr):
    """Testing: out[t] = (is_down, m_tile, n_tile) of every task id t, as the fused kernel decodes it."""
    for task in range(0, num_m_tiles * (n_gu + n_dn)):
        is_down, m_tile, n_tile = _task_coords(task, num_m_tiles, n_gu, n_dn, MB, GROUP_M)
        tl.store(out_ptr + 3 * task, is_down.to(tl.int32))
        tl.store(out_ptr + 3 * task + 1, m_tile)
        tl.store(out_ptr + 3 * task + 2, n_tile)


def device_task_order(num_m_tiles: int, n_tiles_gate_up: int, n_tiles_down: int, minibatch_m_tiles: int,
                      group_m: int | None = None, device="cpu") -> list[tuple[int, int, int]]:
    """`task_order` as the kernel decodes it on the device (`_task_coords`): for tests."""
    num_tasks = num_m_tiles * (n_tiles_gate_up + n_tiles_down)
    out = torch.full((max(num_tasks, 1), 3), -1, dtype=torch.int32, device=device)
    _task_order_kernel[(1,)](out, num_m_tiles, n_tiles_gate_up, n_tiles_down, MB=minibatch_m_tiles,
                             GROUP_M=minibatch_m_tiles if group_m is None else group_m)
    return [tuple(row) for row in out[:num_tasks].tolist()]


# ---------------------------------------------------------------- the kernel


@triton.jit
def _fused_forward_kernel(
    # A: x's rows [R, H]; the schedule
    a_ptr, num_rows, row_source_ptr, tile_expert_ptr, expert_offsets_ptr, num_experts, sched_block_m, packed_ptr,
    # weights: w_gate, w_up [E, I, H], w_down [E, H, I]
    w_gate_ptr, w_up_ptr, w_down_ptr,
    # outputs: gate_up packed [num_packed, 2I], h [R, I], o [R, H]
    gate_up_ptr, h_ptr, o_ptr,
    HIDDEN, INTER, swiglu_limit,
    # Sync: counters int32 [2], flags int32 [2, num_flags], epoch int32 [1]
    counters_ptr, flags_ptr, num_flags, epoch_ptr,
    # PULL_PROGRAMS (EP): the owners' token buffers (an int64 address per rank), flags per M-tile, the epoch
    top_k, pull_table_ptr, pull_slots_per_rank, pull_flags_ptr, pull_epoch_ptr,
    # PUSH (EP): the owners' slot buffers [slots_per_rank, H] (an int64 address per rank)
    push_table_ptr, push_slots_per_rank,
    BLOCK_M: tl.constexpr, GU_BLOCK_N: tl.constexpr, GU_BLOCK_K: tl.constexpr, GU_EPI_SPLIT: tl.constexpr,
    DN_BLOCK_N: tl.constexpr, DN_BLOCK_K: tl.constexpr, DN_EPI_SPLIT: tl.constexpr, DN_EPI_TMA_STORES: tl.constexpr,
    MB: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    HAS_LIMIT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, PROXY_FENCE: tl.constexpr,
    PRINT_TIMEOUTS: tl.constexpr, PULL_PROGRAMS: tl.constexpr, PULL_ALIGNED: tl.constexpr,
    PULL_BLOCK_C: tl.constexpr, PUSH: tl.constexpr, PUSH_ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    parity = tl.load(epoch_ptr) & 1
    counter = counters_ptr + parity
    flags = flags_ptr + parity * num_flags
    # zero what launch e + 1 will use (launch e - 1 used it and has finished)
    other_flags = flags_ptr + (1 - parity) * num_flags
    for start in range(pid * CLEAR_BLOCK, num_flags, NUM_PROGRAMS * CLEAR_BLOCK):
        offsets = start + tl.arange(0, CLEAR_BLOCK)
        tl.store(other_flags + offsets, tl.zeros((CLEAR_BLOCK,), dtype=tl.int32), mask=offsets < num_flags)
    if pid == 0:
        tl.store(counters_ptr + (1 - parity), 0)

    # used tiles only: the count lives on the device, no host sync
    num_m_tiles = tl.load(expert_offsets_ptr + num_experts) // BLOCK_M
    n_gu = tl.cdiv(INTER, GU_BLOCK_N)
    n_dn = tl.cdiv(HIDDEN, DN_BLOCK_N)
    num_tasks = num_m_tiles * (n_gu + n_dn)

    gu_descs = _descriptors(a_ptr, HIDDEN, num_rows, w_gate_ptr, w_up_ptr, gate_up_ptr, 2 * INTER, h_ptr,
                            num_experts, INTER, HIDDEN, BLOCK_M, GU_BLOCK_N, GU_BLOCK_K, GU_BLOCK_N // GU_EPI_SPLIT,
                            True, False, "swiglu_fwd", False, USE_TMA)
    dn_descs = _descriptors(h_ptr, INTER, num_rows, w_down_ptr, w_down_ptr, o_ptr, HIDDEN, o_ptr,
                            num_experts, HIDDEN, INTER, BLOCK_M, DN_BLOCK_N, DN_BLOCK_K, DN_BLOCK_N // DN_EPI_SPLIT,
                            True, False, "store", PUSH, USE_TMA)

    if PULL_PROGRAMS > 0:  # EP: the first programs pull x's rows, M-tile by M-tile, in the order tasks need them
        pull_epoch = tl.load(pull_epoch_ptr)
        if pid < PULL_PROGRAMS:
            in_gemm_pull.pull_tiles(pull_table_ptr, row_source_ptr, a_ptr, HIDDEN, pull_flags_ptr, pull_epoch,
                                    num_m_tiles, pull_slots_per_rank, top_k, HIDDEN, BLOCK_M, PULL_BLOCK_C,
                                    PULL_PROGRAMS, PULL_ALIGNED, PROXY_FENCE)
    else:
        pull_epoch = 0
    # pull programs take no task ids: they start past the last one
    task = num_tasks
    if pid >= PULL_PROGRAMS:
        task = tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
    while task < num_tasks:
        # the next id is taken now, so the counter's round trip runs under this task (ids stay increasing per
        # program: the earliest unfinished task is always some program's current one, so no wait can deadlock)
        next_task = tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
        is_down, m_tile, n_tile = _task_coords(task, num_m_tiles, n_gu, n_dn, MB, GROUP_M)
        if is_down:
            # h of this M-tile: every gate/up N-tile has stored its columns (acquire)
            in_gemm_pull.wait_until(flags + m_tile, n_gu, m_tile,
                                    "serval: fused forward timed out waiting for the h of M-tile ", PRINT_TIMEOUTS)
            _gemm_tile(dn_descs, m_tile, n_tile, n_dn,
                       h_ptr, INTER, num_rows, row_source_ptr, push_table_ptr, push_slots_per_rank,
                       tile_expert_ptr, sched_block_m, w_down_ptr, w_down_ptr, o_ptr, HIDDEN, o_ptr,
                       packed_ptr, o_ptr, o_ptr, o_ptr, HIDDEN, INTER, swiglu_limit,
                       BLOCK_M, DN_BLOCK_N, DN_BLOCK_K, True, False, "store", HAS_LIMIT, USE_TMA, UPCAST,
                       DN_EPI_SPLIT, USE_TMA and DN_EPI_TMA_STORES, PUSH, PUSH_ALIGNED)
        else:
            if PULL_PROGRAMS > 0:  # x's rows of this M-tile have been pulled (acquire)
                in_gemm_pull.wait_until(pull_flags_ptr + m_tile, pull_epoch, m_tile,
                                        "serval: fused forward timed out waiting for the pulled rows of M-tile ",
                                        PRINT_TIMEOUTS)
            _gemm_tile(gu_descs, m_tile, n_tile, n_gu,
                       a_ptr, HIDDEN, num_rows, row_source_ptr, o_ptr, 0,
                       tile_expert_ptr, sched_block_m, w_gate_ptr, w_up_ptr, gate_up_ptr, 2 * INTER, h_ptr,
                       packed_ptr, o_ptr, o_ptr, o_ptr, INTER, HIDDEN, swiglu_limit,
                       BLOCK_M, GU_BLOCK_N, GU_BLOCK_K, True, False, "swiglu_fwd", HAS_LIMIT, USE_TMA, UPCAST,
                       GU_EPI_SPLIT, False, False, False)
            if PROXY_FENCE:  # the down tiles read h with TMA (the async proxy): order the pointer stores for it
                tl.inline_asm_elementwise("fence.proxy.async.global;", "=r", [], dtype=tl.int32, is_pure=False,
                                          pack=1)
            tl.debug_barrier()  # every warp's stores are done before the release
            tl.atomic_add(flags + m_tile, 1, sem="release", scope="gpu")
        task = next_task


# ---------------------------------------------------------------- host side


class Sync(NamedTuple):
    """The fused forward's synchronisation state (see the module docstring), allocated once by `new_sync` and
    reused by every launch: counters int32 [2] (task ids of even / odd epochs), flags int32 [2, num_flags] (per
    M-tile, even / odd epochs), epoch int32 [1]."""

    counters: torch.Tensor
    flags: torch.Tensor
    epoch: torch.Tensor


def new_sync(num_m_tiles: int, device) -> Sync:
    """Zeros for launches of up to `num_m_tiles` M-tiles (schedule.capacity // block_m): allocate once, before any
    CUDA graph capture, and reuse; launches never need it reset."""
    if not isinstance(num_m_tiles, int) or isinstance(num_m_tiles, bool) or num_m_tiles < 0:
        raise ValueError(f"new_sync: num_m_tiles must be an int >= 0, got {num_m_tiles!r}")
    return Sync(torch.zeros(2, dtype=torch.int32, device=device),
                torch.zeros(2, max(num_m_tiles, 1), dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device))


def minibatch_m_tiles(minibatch_rows: int | None, hidden: int, inter: int, block_m: int, capacity_m_tiles: int,
                      gate_up_block_n: int, down_block_n: int, device, pull_programs: int = 0) -> int:
    """M-tiles per minibatch: minibatch_rows // block_m (at least 1), or with None MoK's rule on the SMs that
    compute (all but the pull programs; `serval.overlap.layer_minibatch_rows` on these tiles); at most the
    capacity's M-tiles (one minibatch)."""
    if minibatch_rows is None:
        compute_sms = max(1, common.num_sms(device.index) - pull_programs)
        minibatch_rows = layer_minibatch_rows(hidden, inter, compute_sms, block_m,
                                              gate_up_tile_n=gate_up_block_n, down_tile_n=down_block_n)
    return max(1, min(minibatch_rows // block_m, capacity_m_tiles))


def _check_tiles(name: str, tiles) -> None:
    if not isinstance(tiles, TileConfig):
        raise TypeError(f"fused_forward: {name} must be a serval.plan.TileConfig, got {type(tiles).__name__}")
    if tiles.epi_split not in (1, 2, 4) or tiles.block_n % tiles.epi_split:
        raise ValueError(f"fused_forward: {name}.epi_split must be 1, 2 or 4 and divide block_n {tiles.block_n}, "
                         f"got {tiles.epi_split}")


def _check_sync(sync, num_m_tiles: int, device) -> None:
    if not isinstance(sync, Sync):
        raise TypeError(f"fused_forward: sync must be a fused_forward.Sync (new_sync), got {type(sync).__name__}")
    shapes = {"counters": (2,), "flags": (2, sync.flags.shape[-1] if sync.flags.dim() == 2 else -1), "epoch": (1,)}
    for field, shape in shapes.items():
        t = getattr(sync, field)
        if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
            raise ValueError(f"fused_forward: sync.{field} must be a contiguous int32 {list(shape)} tensor on {device} "
                             f"(new_sync), got {t.dtype} {list(t.shape)} on {t.device}")
    if sync.flags.shape[1] < num_m_tiles:
        raise ValueError(f"fused_forward: sync.flags holds {sync.flags.shape[1]} M-tiles per epoch, the schedule has "
                         f"{num_m_tiles} (capacity // block_m): allocate it with new_sync(capacity // block_m)")


def fused_forward(a_rows: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  schedule: Schedule, swiglu_limit: float | None, gate_up_tiles: TileConfig, down_tiles: TileConfig,
                  use_tma: bool, minibatch_rows: int | None, sync: Sync, *, pull: in_gemm_pull.Pull | None = None,
                  push_to: PeerSlots | None = None, debug_waits: bool = False):
    """Gate/up + SwiGLU and down in one persistent launch: (gate_up, h, o), bit for bit
    `triton_gemm.gate_up_swiglu(a_rows, w_gate, w_up, schedule, swiglu_limit, gate_up_tiles, use_tma)` followed by
    `triton_gemm.down(h, w_down, schedule, down_tiles, use_tma)`.

    a_rows [R, H]: the schedule's rows of x (R = schedule.capacity; padding rows zero, as `rows.gather` leaves
    them); w_gate, w_up [E, I, H], w_down [E, H, I]; all one dtype (bf16, fp16 or fp32), on one device.
    swiglu_limit: None or a float (SwiGLU's clamp). gate_up_tiles / down_tiles: each GEMM's tiles (one BLOCK_M;
    num_warps and num_stages are gate_up_tiles'). use_tma: TMA where the operands allow it. minibatch_rows: rows
    per minibatch of the task order (whole M-tiles, at least one; None: MoK's rule on all SMs). sync: `new_sync`
    (flags for at least capacity // BLOCK_M M-tiles), reused across calls; the call bumps its epoch on the device.
    debug_waits: a down tile whose wait times out prints its M-tile before it traps; without, it only traps (the
    printf is a call, which makes ptxas serialize every wgmma of the kernel: see `in_gemm_pull.wait_until`).

    At expert parallelism, the dispatch and the combine join the launch. pull: the first `pull.programs`
    programs pull x's rows from the owners' token buffers into a_rows (then a contiguous buffer whose contents are
    not read before), M-tile by M-tile, publishing each with a flag the gate/up tiles wait for (`in_gemm_pull`);
    they take no tasks. push_to: each down row goes straight into its owner's slot row_source[r], as
    `triton_gemm.down(..., push_to=)` writes it, and o is not made. The launch then holds every SM (the pull
    programs must run beside the compute programs).

    Returns gate_up [num_packed, 2I] (packed rows, kept for backward), h = SwiGLU(gate, up) [R, I] and
    o = h @ w_down[e].T [R, H] (None with push_to), in the operands' dtype; rows past the used M-tiles are not
    written.
    """
    _check(a_rows, w_gate, w_up, w_down)
    for name, t in (("a_rows", a_rows), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if t.dim() != (2 if name == "a_rows" else 3):
            raise ValueError(f"fused_forward: {name} must be {'2' if name == 'a_rows' else '3'}-D, got {list(t.shape)}")
        if t.device != a_rows.device:
            raise ValueError(f"fused_forward: {name} is on {t.device}, a_rows on {a_rows.device}")
    num_experts, inter, hidden = w_gate.shape
    if tuple(w_up.shape) != tuple(w_gate.shape):
        raise ValueError(f"fused_forward: w_up must be [E, I, H] = {list(w_gate.shape)} as w_gate, "
                         f"got {list(w_up.shape)}")
    if tuple(w_down.shape) != (num_experts, hidden, inter):
        raise ValueError(f"fused_forward: w_down must be [E, H, I] = {[num_experts, hidden, inter]}, "
                         f"got {list(w_down.shape)}")
    if num_experts != schedule.num_experts:
        raise ValueError(f"fused_forward: the weights hold {num_experts} experts, the schedule {schedule.num_experts}")
    if tuple(a_rows.shape) != (schedule.capacity, hidden):
        raise ValueError(f"fused_forward: a_rows must be [schedule.capacity, H] = {[schedule.capacity, hidden]}, "
                         f"got {list(a_rows.shape)}")
    if swiglu_limit is not None and (isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float))):
        raise ValueError(f"fused_forward: swiglu_limit must be None or a float, got {swiglu_limit!r}")
    if minibatch_rows is not None and (not isinstance(minibatch_rows, int) or isinstance(minibatch_rows, bool)
                                       or minibatch_rows < 1):
        raise ValueError(f"fused_forward: minibatch_rows must be None or an int >= 1, got {minibatch_rows!r}")
    _check_tiles("gate_up_tiles", gate_up_tiles)
    _check_tiles("down_tiles", down_tiles)
    block_m = min(gate_up_tiles.block_m, schedule.block_m)
    if min(down_tiles.block_m, schedule.block_m) != block_m:
        raise ValueError(f"fused_forward: gate_up_tiles and down_tiles must have one block_m (after min with the "
                         f"schedule's {schedule.block_m}), got {gate_up_tiles.block_m} and {down_tiles.block_m}")
    if schedule.block_m % block_m:
        raise ValueError(f"fused_forward: tile rows {block_m} must divide the schedule's block_m {schedule.block_m}")
    capacity_m_tiles = schedule.capacity // block_m
    _check_sync(sync, capacity_m_tiles, a_rows.device)

    if pull is not None:
        if not a_rows.is_contiguous():
            raise ValueError("fused_forward: with pull, a_rows is the buffer the pull fills: it must be contiguous")
        if pull.source.cols != hidden or pull.source.dtype != a_rows.dtype:
            raise ValueError(f"fused_forward: pull.source holds [{pull.source.cols}] {pull.source.dtype} tokens, "
                             f"a_rows [{hidden}] {a_rows.dtype} rows")
        if pull.flags.numel() < capacity_m_tiles or pull.programs < 1:
            raise ValueError(f"fused_forward: pull needs programs >= 1 and a flag per M-tile ({capacity_m_tiles}), "
                             f"got {pull.programs} programs and {pull.flags.numel()} flags")
    if push_to is not None and (push_to.cols != hidden or push_to.dtype != a_rows.dtype):
        raise ValueError(f"fused_forward: push_to holds [{push_to.cols}] {push_to.dtype} slots, o has [{hidden}] "
                         f"{a_rows.dtype} rows")
    a_rows, w_gate, w_up, w_down = a_rows.contiguous(), w_gate.contiguous(), w_up.contiguous(), w_down.contiguous()
    dtype, device = a_rows.dtype, a_rows.device
    gate_up = common.empty((schedule.num_packed, 2 * inter), dtype, device)
    h = common.empty((schedule.capacity, inter), dtype, device)
    o = common.empty((schedule.capacity, hidden), dtype, device) if push_to is None else h  # h: a placeholder
    if use_tma:
        use_tma = _tma_compatible((w_gate, 0), (w_up, 0), (w_down, 0), (a_rows, 0), (h, 0), (o, 0))
    if use_tma and not common.INTERPRET:
        common.install_tma_allocator()

    n_gu = triton.cdiv(inter, gate_up_tiles.block_n)
    n_dn = triton.cdiv(hidden, down_tiles.block_n)
    max_tasks = capacity_m_tiles * (n_gu + n_dn)
    num_programs = max(1, min(common.num_sms(device.index), max_tasks))
    pull_programs, pull_args, pull_block_c = 0, (0, h, 0, h, h), 16
    if pull is not None:
        num_programs = common.num_sms(device.index)  # every program resident at once, the pull programs first
        pull_programs = max(1, min(pull.programs, num_programs - 1))
        pull.epoch.add_(1)
        pull_args = (pull.source.top_k, pull.source.table, pull.source.num_tokens * pull.source.top_k, pull.flags,
                     pull.epoch)
        pull_block_c = min(pull.block_c, triton.next_power_of_2(hidden))
    if max_tasks + 2 * num_programs >= 2**31:
        raise ValueError(f"fused_forward: {max_tasks} tasks do not fit the int32 task counter")
    mb = minibatch_m_tiles(minibatch_rows, hidden, inter, block_m, capacity_m_tiles, gate_up_tiles.block_n,
                           down_tiles.block_n, device, pull_programs)
    # the staged launch's M-group inside each minibatch (weight and row tiles shared in L2 by the programs working
    # at once); minibatches start on group boundaries
    group_m = min(gate_up_tiles.group_m, mb)
    mb = min(-(-mb // group_m) * group_m, max(capacity_m_tiles, 1))
    sync.epoch.add_(1)
    _fused_forward_kernel[(num_programs,)](
        a_rows, schedule.capacity, schedule.row_source, schedule.tile_expert, schedule.expert_offsets,
        schedule.num_experts, schedule.block_m, packed_index(schedule),
        w_gate, w_up, w_down, gate_up, h, o,
        hidden, inter, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        sync.counters, sync.flags, sync.flags.shape[1], sync.epoch,
        *pull_args, push_to.table if push_to is not None else h, push_to.num_slots if push_to is not None else 0,
        BLOCK_M=block_m, GU_BLOCK_N=gate_up_tiles.block_n, GU_BLOCK_K=gate_up_tiles.block_k,
        GU_EPI_SPLIT=gate_up_tiles.epi_split, DN_BLOCK_N=down_tiles.block_n, DN_BLOCK_K=down_tiles.block_k,
        DN_EPI_SPLIT=down_tiles.epi_split, DN_EPI_TMA_STORES=down_tiles.epi_tma_stores,
        MB=mb, GROUP_M=group_m, NUM_PROGRAMS=num_programs,
        HAS_LIMIT=swiglu_limit is not None, USE_TMA=use_tma, UPCAST=common.INTERPRET,
        PROXY_FENCE=use_tma and not common.INTERPRET, PRINT_TIMEOUTS=debug_waits or common.INTERPRET,
        PULL_PROGRAMS=pull_programs, PULL_ALIGNED=pull is not None and pull.source.aligned, PULL_BLOCK_C=pull_block_c,
        PUSH=push_to is not None, PUSH_ALIGNED=push_to is not None and push_to.aligned,
        num_warps=gate_up_tiles.num_warps, num_stages=gate_up_tiles.num_stages,
    )
    return gate_up, h, (o if push_to is None else None)
