"""One pass of the routed experts' two GEMMs in one persistent launch, at expert parallelism with the dispatch
(pull) and the combine (push) in the same launch: the fused layer kernel's building block.

    pass       first GEMM (F)                                second GEMM (S)
    forward    gate/up + SwiGLU: x rows [R, H] -> gate_up,  h  down: h -> o [R, H] (at EP pushed to the owners)
    backward   down dgrad + SwiGLU backward: d_y rows [R, H]  gate/up dgrad: d_gate_up -> d_x rows [R, H]
               -> d_gate_up [R, 2I], rw * h, d_rw partials     (at EP pushed to the owners)

What this module owns: `_fused_pass_kernel`, which runs every F tile and every S tile of a pass in one persistent
grid (constexpr BACKWARD picks the pass; at EP its first programs pull the rows of F's A, and the S tiles push
their rows to the owners); its task order (`task_order`, the pure-Python statement of it, and `_task_coords`, its
device-side decode); its synchronisation state (`Sync`, `new_sync`); and the host functions `fused_forward` and
`fused_backward`. The per-tile work (K loop + epilogue) is `triton_gemm._gemm_tile`, the same function the staged
grouped GEMM calls, in the staged stages' variants ("swiglu_fwd" / "store" with W_NK forward; "swiglu_bwd" /
"store" with K_SPLIT backward): the results are bit for bit those of the two staged launches with the same
TileConfigs (`triton_gemm.gate_up_swiglu` then `down`; `down_dgrad_swiglu_partials` then `gate_up_dgrad`).

Tasks. With M_used = expert_offsets[E] // BLOCK_M M-tiles (read on the device: no host sync), F has M_used * n_first
tiles (n_first = ceil(I / F's block_n)) and S M_used * n_second (n_second = ceil(H / S's block_n)). The M-tiles
are cut into minibatches of MB = minibatch_rows // BLOCK_M M-tiles (the last one may be shorter); F(b) is
minibatch b's F tiles, S(b) its S tiles, and the task order is

    F(0), F(1), S(0), F(2), S(1), ..., F(nb - 1), S(nb - 2), S(nb - 1)

so an S tile depends only on earlier tasks, and, one minibatch of F work having run in between, usually finds its
rows ready. With a shared expert (`SharedExpert`, a one-expert group over the N tokens, rows = tokens) its own task
order, the same function on its M-tiles and its first GEMM's N-tiles (one MB for both groups), comes first: its rows
need no pull, so at EP its tiles fill the time while the routed rows arrive, and its F and S tiles run the same tile
bodies on its own operands, bit for bit its two staged launches. Within F(b) / S(b) the tiles are in the staged
kernel's order with GROUP_M = F's config's group_m (at most MB; MB is rounded up to a multiple of it, so minibatches
start on M-group boundaries; `common.tile_coords` on the GEMM's own tile numbering): each GEMM's tiles are taken in
exactly the order of its staged launch with that M-group, and the fused order interleaves the two sequences
minibatch by minibatch.

Counter. Programs take task ids from an int32 counter with `tl.atomic_add` (integer atomics only; nothing
floating-point is ever accumulated atomically): a program holds two ids, the task it runs and the next one, taken
when the task starts so that the counter's round trip overlaps it; it stops at the first id past the last task
(a launch draws at most tasks + 2 * programs ids).

Flags. An F tile, once its outputs are stored (pointer stores), fences them for the async proxy (S reads them
through TMA), waits for its warps (`tl.debug_barrier`) and adds 1 to its M-tile's int32 flag with release semantics
(the shared expert's M-tiles have theirs after the routed capacity's). An S tile first waits (acquire) until its
M-tile's flag reaches n_first: all F N-tiles of that M-tile have stored their columns. The wait is bounded
(`in_gemm_pull.wait_until`): after about 10 s the program traps, an error instead of a hang, and with `debug_waits`
prints the M-tile first (off by default: a printf is a function call, and a call anywhere in the kernel makes ptxas
serialize all its wgmma instructions).

Epochs, nothing reset between launches. `Sync.epoch` (int32 [1]) is bumped on the device before each launch (a
stream-ordered `add_`, captured with the launch in a CUDA graph). Launch e uses counter `counters[e % 2]` and flags
`flags[e % 2]`, all zero when it starts, and zeroes `counters[(e + 1) % 2]` and `flags[(e + 1) % 2]`: launch e - 1
used them and has finished (stream order), launch e + 1 will use them and has not started. The host never resets
anything, a CUDA graph replays (each replay bumps the epoch and so alternates the parity), and nothing overflows:
the counter and the flags restart from zero every other launch (a launch draws fewer than 2^31 ids: checked on the
host) and only the epoch's parity matters (`epoch & 1` stays right when the int32 epoch wraps). One `Sync` serves one
stream: launches that share it must run one after another (no programmatic dependent launch, no second stream);
a forward and a backward launch may share it.

Deadlock freedom. Ids are handed out in increasing order, and a task waits only on earlier tasks (an S tile of
M-tile m on F tiles of m, all earlier in the order, the shared expert's on its own); F tasks wait only for pulled
rows, which programs that take no tasks publish. A program's next id is larger than its current one and becomes
current as soon as the current finishes, so the earliest unfinished task is always some program's current task, and
everything it waits on is earlier, hence finished: it completes, and by induction the launch progresses whether or
not every program is resident. In Triton's CPU interpreter programs run one after another: program 0 takes every
task in order (so no wait ever blocks) and the others find the counter exhausted.

mxfp8 (quant_block 32, constexpr QUANT_BLOCK): the operands are bf16 values the caller quantized and dequantized
along K; the first GEMM's epilogue also stores its output's E8M0 round trip (forward h along I, backward d_gate_up
along 2I: blocks within a row), which the second GEMM reads, and at EP the pull programs round-trip the rows they
pull (the backward keeping them as pulled too): the bits of the staged mxfp8 passes, the same rows moved.

Constraints: both TileConfigs must give the same BLOCK_M (min(block_m, schedule.block_m)); one launch has one
num_warps and num_stages: the forward's gate/up config's, the backward's gate/up dgrad config's (the other GEMM's
tiles compile with them: checked for the plan's Hopper tiles). F stores with pointer stores whatever
`epi_tma_stores` says (its release then covers them with one proxy fence); S follows its config. `flatten` of
either config and S's `group_m` do not apply (the task loop is a while loop over ids; one M-group serves both
GEMMs). Operands: bf16, fp16 or fp32, one dtype, as the staged GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..overlap import minibatch_rows as mok_minibatch_rows
from ..plan import TileConfig
from ..peers import PeerSlots
from ..schedule import Schedule, packed_index
from . import common, in_gemm_pull
from .triton_gemm import (_check, _descriptors, _gemm_tile, _tma_compatible, check_d_rw_chunks, new_d_rw_partial,
                          weights_in_place)

FIRST, SECOND = 0, 1  # the GEMM of a task (forward: gate/up, down; backward: down dgrad, gate/up dgrad)

CLEAR_BLOCK = tl.constexpr(1024)  # flags a program zeroes a step
QUANT_BLOCK = 32  # quant_block of the mxfp8 passes: elements per E8M0 scale (`serval.precision`'s "mxfp8")


# ---------------------------------------------------------------- the task order


def _tile_coords(tile_id: int, num_m_tiles: int, num_n_tiles: int, group_m: int) -> tuple[int, int]:
    """`common.tile_coords` in Python (the same arithmetic, for `task_order`)."""
    tiles_per_group = group_m * num_n_tiles
    first_m = (tile_id // tiles_per_group) * group_m
    group_size = min(num_m_tiles - first_m, group_m)
    return first_m + (tile_id % tiles_per_group) % group_size, (tile_id % tiles_per_group) // group_size


def task_order(num_m_tiles: int, n_tiles_first: int, n_tiles_second: int, minibatch_m_tiles: int,
               group_m: int | None = None) -> list[tuple[int, int, int]]:
    """A fused pass's tasks in the order programs take them: [(gemm, m_tile, n_tile)], gemm FIRST or SECOND.

    F(0), F(1), S(0), F(2), S(1), ..., F(nb - 1), S(nb - 2), S(nb - 1), where F(b) / S(b) are the first and second
    GEMM's tiles of minibatch b (M-tiles [b * MB, min((b + 1) * MB, num_m_tiles)), MB = minibatch_m_tiles), each
    in its GEMM's staged tile order with GROUP_M = group_m (default MB; MB must be a multiple of it unless one
    minibatch holds every M-tile). `_task_coords` decodes a task id to the same triple."""
    for name, value in (("num_m_tiles", num_m_tiles), ("n_tiles_first", n_tiles_first),
                        ("n_tiles_second", n_tiles_second), ("minibatch_m_tiles", minibatch_m_tiles)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "num_m_tiles" else 1):
            raise ValueError(f"task_order: {name} must be an int >= {0 if name == 'num_m_tiles' else 1}, got {value!r}")
    mb = minibatch_m_tiles
    group = mb if group_m is None else group_m
    if not isinstance(group, int) or isinstance(group, bool) or group < 1 or (mb % group and mb < num_m_tiles):
        raise ValueError(f"task_order: group_m must be an int >= 1 dividing minibatch_m_tiles={mb} (unless one "
                         f"minibatch holds all {num_m_tiles} M-tiles), got {group_m!r}")
    num_minibatches = -(-num_m_tiles // mb)

    def tiles(gemm, b):
        n = n_tiles_first if gemm == FIRST else n_tiles_second
        size = min(num_m_tiles - b * mb, mb)
        return [(gemm, *_tile_coords(b * mb * n + i, num_m_tiles, n, group)) for i in range(size * n)]

    if num_minibatches == 0:
        return []
    order = tiles(FIRST, 0)
    for b in range(1, num_minibatches):
        order += tiles(FIRST, b) + tiles(SECOND, b - 1)
    return order + tiles(SECOND, num_minibatches - 1)


@triton.jit
def _task_coords(task, num_m_tiles, n_first, n_second, MB: tl.constexpr, GROUP_M: tl.constexpr):
    """(is_second, m_tile, n_tile) of task id `task` < num_m_tiles * (n_first + n_second): `task_order`'s entry
    `task`."""
    num_minibatches = tl.cdiv(num_m_tiles, MB)
    first_len = n_first * tl.minimum(num_m_tiles, MB)  # F(0)
    pair = MB * (n_first + n_second)  # F(j) + S(j - 1) for 1 <= j < num_minibatches (F of the last may be shorter)
    u = tl.maximum(task - first_len, 0)
    j = tl.maximum(tl.minimum(u // pair + 1, num_minibatches - 1), 1)
    r = u - (j - 1) * pair
    first_len_j = n_first * tl.minimum(num_m_tiles - j * MB, MB)  # F(j)
    in_first = task < first_len
    after_pairs = r >= first_len_j + MB * n_second  # S(num_minibatches - 1), after the last pair
    # one minibatch only: F(0), S(0)
    is_second = (~in_first) & ((num_minibatches == 1) | (r >= first_len_j))
    minibatch = tl.where(in_first, 0,
                         tl.where(num_minibatches == 1, 0,
                                  tl.where(r < first_len_j, j, tl.where(after_pairs, num_minibatches - 1, j - 1))))
    local = tl.where(in_first, task,
                     tl.where(num_minibatches == 1, u,
                              tl.where(r < first_len_j, r,
                                       tl.where(after_pairs, r - first_len_j - MB * n_second, r - first_len_j))))
    n_tiles = tl.where(is_second, n_second, n_first)
    m_tile, n_tile = common.tile_coords(minibatch * MB * n_tiles + local, num_m_tiles, n_tiles, GROUP_M)
    return is_second, m_tile, n_tile


@triton.jit
def _task_order_kernel(out_ptr, num_m_tiles, n_first, n_second, MB: tl.constexpr, GROUP_M: tl.constexpr):
    """Testing: out[t] = (is_second, m_tile, n_tile) of every task id t, as the fused kernel decodes it."""
    for task in range(0, num_m_tiles * (n_first + n_second)):
        is_second, m_tile, n_tile = _task_coords(task, num_m_tiles, n_first, n_second, MB, GROUP_M)
        tl.store(out_ptr + 3 * task, is_second.to(tl.int32))
        tl.store(out_ptr + 3 * task + 1, m_tile)
        tl.store(out_ptr + 3 * task + 2, n_tile)


def device_task_order(num_m_tiles: int, n_tiles_first: int, n_tiles_second: int, minibatch_m_tiles: int,
                      group_m: int | None = None, device="cpu") -> list[tuple[int, int, int]]:
    """`task_order` as the kernel decodes it on the device (`_task_coords`): for tests."""
    num_tasks = num_m_tiles * (n_tiles_first + n_tiles_second)
    out = torch.full((max(num_tasks, 1), 3), -1, dtype=torch.int32, device=device)
    _task_order_kernel[(1,)](out, num_m_tiles, n_tiles_first, n_tiles_second, MB=minibatch_m_tiles,
                             GROUP_M=minibatch_m_tiles if group_m is None else group_m)
    return [tuple(row) for row in out[:num_tasks].tolist()]


# ---------------------------------------------------------------- the kernel


@triton.jit
def _fused_pass_kernel(
    # A of the first GEMM: rows [R, H] (forward x's, backward d_y's); the schedule
    a_ptr, num_rows, row_source_ptr, tile_expert_ptr, expert_offsets_ptr, num_experts, sched_block_m, packed_ptr,
    # weights: the first GEMM's two (forward w_gate, w_up [E, I, H]; backward w_down [E, H, I] twice) and the
    # second's (forward w_down twice; backward w_gate, w_up); each pair's expert stride (rows dense)
    w_first0_ptr, w_first1_ptr, w_second0_ptr, w_second1_ptr, stride_w_first, stride_w_second,
    # the first GEMM's outputs: c (forward the packed gate_up [num_packed, 2I], backward d_gate_up [R, 2I]) and h
    # [R, I] (forward h, backward rw * h); the second's: o [R, H] (forward o, backward d_x's rows)
    c_ptr, h_ptr, o_ptr,
    # backward: the kept gate_up [num_packed, 2I] (packed), router weights fp32 [N * k] by source, the router-weight
    # gradient's row partials fp32 [R, ceil(I / 16)]
    gate_up_ptr, router_weights_ptr, d_rw_partial_ptr,
    # QUANT_BLOCK > 0 (mxfp8): the first GEMM's output the second reads, quantized and dequantized (forward h
    # [R, I], backward d_gate_up [R, 2I]); the second GEMM's A
    deq_ptr,
    HIDDEN, INTER, swiglu_limit,
    # Sync: counters int32 [2], flags int32 [2, num_flags], epoch int32 [1]
    counters_ptr, flags_ptr, num_flags, epoch_ptr,
    # PULL_PROGRAMS (EP): the owners' token buffers (an int64 address per rank), flags per M-tile, the epoch; with
    # QUANT_BLOCK the pull programs write A's rows round-tripped, and with KEEP_PULLED the rows as pulled into
    # pulled_ptr [R, H]
    top_k, pull_table_ptr, pull_slots_per_rank, pull_flags_ptr, pull_epoch_ptr, pulled_ptr,
    # PUSH (EP): the owners' slot buffers [slots_per_rank, H] (an int64 address per rank)
    push_table_ptr, push_slots_per_rank,
    # HAS_SHARED: the shared expert's two GEMMs, as the routed ones with one expert: its rows (forward x's,
    # backward d_y's [Rs, H]: rows = tokens, never moved), its dense schedule's M-tiles, row sources, tile experts,
    # block_m and packed index, its weights ([1, Is, H] / [1, H, Is]), outputs, (backward) kept gate_up, router
    # weights (ones) and row partials; its M-tiles' flags start at sh_flags_offset
    sh_a_ptr, sh_num_rows, sh_num_m_tiles, sh_row_source_ptr, sh_tile_expert_ptr, sh_block_m, sh_packed_ptr,
    sh_w_first0_ptr, sh_w_first1_ptr, sh_w_second0_ptr, sh_w_second1_ptr, sh_c_ptr, sh_h_ptr, sh_o_ptr,
    sh_gate_up_ptr, sh_router_weights_ptr, sh_d_rw_partial_ptr, SH_INTER, sh_flags_offset,
    BACKWARD: tl.constexpr,
    BLOCK_M: tl.constexpr, FIRST_BLOCK_N: tl.constexpr, FIRST_BLOCK_K: tl.constexpr, FIRST_EPI_SPLIT: tl.constexpr,
    SECOND_BLOCK_N: tl.constexpr, SECOND_BLOCK_K: tl.constexpr, SECOND_EPI_SPLIT: tl.constexpr,
    SECOND_EPI_TMA_STORES: tl.constexpr,
    MB: tl.constexpr, GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    HAS_LIMIT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, PROXY_FENCE: tl.constexpr,
    PRINT_TIMEOUTS: tl.constexpr, PULL_PROGRAMS: tl.constexpr, PULL_ALIGNED: tl.constexpr,
    PULL_BLOCK_C: tl.constexpr, PUSH: tl.constexpr, PUSH_ALIGNED: tl.constexpr, HAS_SHARED: tl.constexpr,
    QUANT_BLOCK: tl.constexpr, KEEP_PULLED: tl.constexpr,
):
    # the pass's two GEMMs as `triton_gemm._gemm_tile` variants (the staged stages' own arguments)
    FIRST_EPILOGUE: tl.constexpr = "swiglu_bwd" if BACKWARD else "swiglu_fwd"
    W_NK: tl.constexpr = False if BACKWARD else True  # weights [E, N, K] (forward) or [E, K, N] (backward)
    # the second GEMM reads the first's output: forward h [R, I]; backward d_gate_up [R, 2I], K = I a half
    # (in mxfp8 its E8M0 round trip, which the first GEMM's tiles store beside it)
    if QUANT_BLOCK > 0:
        second_a_ptr = deq_ptr
    elif BACKWARD:
        second_a_ptr = c_ptr
    else:
        second_a_ptr = h_ptr
    stride_second_a = 2 * INTER if BACKWARD else INTER

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
    n_first = tl.cdiv(INTER, FIRST_BLOCK_N)
    n_second = tl.cdiv(HIDDEN, SECOND_BLOCK_N)
    num_tasks = num_m_tiles * (n_first + n_second)

    first_descs = _descriptors(a_ptr, HIDDEN, num_rows, w_first0_ptr, w_first1_ptr, stride_w_first, c_ptr, 2 * INTER,
                               h_ptr,
                               num_experts, INTER, HIDDEN, BLOCK_M, FIRST_BLOCK_N, FIRST_BLOCK_K,
                               FIRST_BLOCK_N // FIRST_EPI_SPLIT, W_NK, False, FIRST_EPILOGUE, False, USE_TMA)
    second_descs = _descriptors(second_a_ptr, stride_second_a, num_rows, w_second0_ptr, w_second1_ptr,
                                stride_w_second, o_ptr,
                                HIDDEN, o_ptr, num_experts, HIDDEN, INTER, BLOCK_M, SECOND_BLOCK_N, SECOND_BLOCK_K,
                                SECOND_BLOCK_N // SECOND_EPI_SPLIT, W_NK, BACKWARD, "store", PUSH, USE_TMA)
    if HAS_SHARED:  # the shared expert's tasks come first: they need no pulled rows, so they fill the pull's time
        sh_n_first = tl.cdiv(SH_INTER, FIRST_BLOCK_N)
        num_shared_tasks = sh_num_m_tiles * (sh_n_first + n_second)
        sh_second_a_ptr = sh_c_ptr if BACKWARD else sh_h_ptr
        sh_stride_second_a = 2 * SH_INTER if BACKWARD else SH_INTER
        sh_first_descs = _descriptors(sh_a_ptr, HIDDEN, sh_num_rows, sh_w_first0_ptr, sh_w_first1_ptr, 0, sh_c_ptr,
                                      2 * SH_INTER, sh_h_ptr, 1, SH_INTER, HIDDEN, BLOCK_M, FIRST_BLOCK_N,
                                      FIRST_BLOCK_K, FIRST_BLOCK_N // FIRST_EPI_SPLIT, W_NK, False, FIRST_EPILOGUE,
                                      False, USE_TMA)
        sh_second_descs = _descriptors(sh_second_a_ptr, sh_stride_second_a, sh_num_rows, sh_w_second0_ptr,
                                       sh_w_second1_ptr, 0, sh_o_ptr, HIDDEN, sh_o_ptr, 1, HIDDEN, SH_INTER, BLOCK_M,
                                       SECOND_BLOCK_N, SECOND_BLOCK_K, SECOND_BLOCK_N // SECOND_EPI_SPLIT, W_NK,
                                       BACKWARD, "store", False, USE_TMA)
        num_tasks += num_shared_tasks

    if PULL_PROGRAMS > 0:  # EP: the first programs pull A's rows, M-tile by M-tile, in the order tasks need them
        pull_epoch = tl.load(pull_epoch_ptr)
        if pid < PULL_PROGRAMS:
            in_gemm_pull.pull_tiles(pull_table_ptr, row_source_ptr, a_ptr, HIDDEN, pull_flags_ptr, pull_epoch,
                                    num_m_tiles, pull_slots_per_rank, top_k, HIDDEN, pulled_ptr, BLOCK_M,
                                    PULL_BLOCK_C, PULL_PROGRAMS, PULL_ALIGNED, PROXY_FENCE, QUANT_BLOCK, KEEP_PULLED)
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
        if HAS_SHARED:  # ids [0, num_shared_tasks): the shared expert's task order; then the routed experts'
            is_shared = task < num_shared_tasks
            is_routed = ~is_shared
            is_second, m_tile, n_tile = _task_coords(tl.where(is_shared, task, task - num_shared_tasks),
                                                     tl.where(is_shared, sh_num_m_tiles, num_m_tiles),
                                                     tl.where(is_shared, sh_n_first, n_first), n_second, MB, GROUP_M)
            flag = flags + tl.where(is_shared, sh_flags_offset + m_tile, m_tile)
            first_n_tiles = tl.where(is_shared, sh_n_first, n_first)
        else:
            is_routed: tl.constexpr = True
            is_second, m_tile, n_tile = _task_coords(task, num_m_tiles, n_first, n_second, MB, GROUP_M)
            flag = flags + m_tile
            first_n_tiles = n_first
        is_first = ~is_second
        if is_second:
            # the first GEMM's output of this M-tile: every first-GEMM N-tile has stored its columns (acquire)
            in_gemm_pull.wait_until(flag, first_n_tiles, m_tile,
                                    "serval: fused pass timed out waiting for the first GEMM's M-tile ",
                                    PRINT_TIMEOUTS)
        # the tile bodies in sibling branches, not nested ones: Triton's shared-memory allocator then reuses one
        # pipeline's buffers for all of them (nested, it kept two at once). First-GEMM tiles store with pointer
        # stores (EPI_TMA_STORES False): the release below covers them with one proxy fence.
        if HAS_SHARED:  # the shared expert's rows stay here: stored, never pulled or pushed
            if is_second & is_shared:
                _gemm_tile(sh_second_descs, m_tile, n_tile,
                           sh_second_a_ptr, sh_stride_second_a, sh_num_rows, sh_row_source_ptr, push_table_ptr, 0,
                           sh_tile_expert_ptr, sh_block_m, sh_w_second0_ptr, sh_w_second1_ptr, 0, sh_o_ptr, HIDDEN,
                           sh_o_ptr, sh_packed_ptr, sh_o_ptr, sh_o_ptr, sh_o_ptr, sh_o_ptr, HIDDEN, SH_INTER,
                           swiglu_limit, BLOCK_M, SECOND_BLOCK_N, SECOND_BLOCK_K, W_NK, BACKWARD, "store", HAS_LIMIT,
                           USE_TMA, UPCAST, SECOND_EPI_SPLIT, USE_TMA and SECOND_EPI_TMA_STORES, False, False, 0)
            if is_first & is_shared:
                _gemm_tile(sh_first_descs, m_tile, n_tile,
                           sh_a_ptr, HIDDEN, sh_num_rows, sh_row_source_ptr, sh_o_ptr, 0,
                           sh_tile_expert_ptr, sh_block_m, sh_w_first0_ptr, sh_w_first1_ptr, 0, sh_c_ptr, 2 * SH_INTER,
                           sh_h_ptr, sh_packed_ptr, sh_gate_up_ptr, sh_router_weights_ptr, sh_d_rw_partial_ptr,
                           sh_o_ptr, SH_INTER, HIDDEN, swiglu_limit, BLOCK_M, FIRST_BLOCK_N, FIRST_BLOCK_K, W_NK,
                           False, FIRST_EPILOGUE, HAS_LIMIT, USE_TMA, UPCAST, FIRST_EPI_SPLIT, False, False, False, 0)
        if is_second & is_routed:
            _gemm_tile(second_descs, m_tile, n_tile,
                       second_a_ptr, stride_second_a, num_rows, row_source_ptr, push_table_ptr, push_slots_per_rank,
                       tile_expert_ptr, sched_block_m, w_second0_ptr, w_second1_ptr, stride_w_second, o_ptr, HIDDEN,
                       o_ptr,
                       packed_ptr, o_ptr, o_ptr, o_ptr, o_ptr, HIDDEN, INTER, swiglu_limit,
                       BLOCK_M, SECOND_BLOCK_N, SECOND_BLOCK_K, W_NK, BACKWARD, "store", HAS_LIMIT, USE_TMA, UPCAST,
                       SECOND_EPI_SPLIT, USE_TMA and SECOND_EPI_TMA_STORES, PUSH, PUSH_ALIGNED, 0)
        if is_first & is_routed:
            if PULL_PROGRAMS > 0:  # A's rows of this M-tile have been pulled (acquire)
                in_gemm_pull.wait_until(pull_flags_ptr + m_tile, pull_epoch, m_tile,
                                        "serval: fused pass timed out waiting for the pulled rows of M-tile ",
                                        PRINT_TIMEOUTS)
            _gemm_tile(first_descs, m_tile, n_tile,
                       a_ptr, HIDDEN, num_rows, row_source_ptr, o_ptr, 0,
                       tile_expert_ptr, sched_block_m, w_first0_ptr, w_first1_ptr, stride_w_first, c_ptr, 2 * INTER,
                       h_ptr,
                       packed_ptr, gate_up_ptr, router_weights_ptr, d_rw_partial_ptr, deq_ptr, INTER, HIDDEN,
                       swiglu_limit, BLOCK_M, FIRST_BLOCK_N, FIRST_BLOCK_K, W_NK, False, FIRST_EPILOGUE, HAS_LIMIT,
                       USE_TMA, UPCAST, FIRST_EPI_SPLIT, False, False, False, QUANT_BLOCK)
        if is_first:
            if PROXY_FENCE:  # the second GEMM reads these rows with TMA (the async proxy): order the stores for it
                tl.inline_asm_elementwise("fence.proxy.async.global;", "=r", [], dtype=tl.int32, is_pure=False,
                                          pack=1)
            tl.debug_barrier()  # every warp's stores are done before the release
            tl.atomic_add(flag, 1, sem="release", scope="gpu")
        task = next_task


# ---------------------------------------------------------------- host side


class Sync(NamedTuple):
    """The fused forward's synchronisation state (see the module docstring), allocated once by `new_sync` and
    reused by every launch: counters int32 [2] (task ids of even / odd epochs), flags int32 [2, num_flags] (per
    M-tile, even / odd epochs), epoch int32 [1]."""

    counters: torch.Tensor
    flags: torch.Tensor
    epoch: torch.Tensor


class SharedExpert(NamedTuple):
    """The shared expert's part of a fused pass: its two GEMMs' tiles join the launch's tasks, before the routed
    ones (they need no pulled rows: at EP they fill the time while the routed rows arrive). schedule:
    `schedule.dense_schedule(N, block_m)` (the routed schedule's block_m: rows = tokens, never moved); rows
    [Rs, H]: its rows of x (forward) or d_y (backward), Rs = schedule.capacity, padding rows zero
    (`rows.gather`); w_gate, w_up [1, Is, H] and w_down [1, H, Is] (a one-expert group); gate_up: backward only,
    the forward's packed pre-activations [N, 2Is]."""

    rows: torch.Tensor
    schedule: Schedule
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    gate_up: torch.Tensor | None = None


class _SharedLaunch(NamedTuple):
    """A checked SharedExpert with the pass's buffers for it (`_launch`)."""

    rows: torch.Tensor
    schedule: Schedule
    inter: int
    w_first: tuple[torch.Tensor, torch.Tensor]
    w_second: tuple[torch.Tensor, torch.Tensor]
    c: torch.Tensor
    h: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor | None = None
    router_weights: torch.Tensor | None = None
    d_rw_partial: torch.Tensor | None = None


def new_sync(num_m_tiles: int, device) -> Sync:
    """Zeros for launches of up to `num_m_tiles` M-tiles (schedule.capacity // block_m, plus the shared expert's
    schedule's with one): allocate once, before any CUDA graph capture, and reuse; launches never need it reset."""
    if not isinstance(num_m_tiles, int) or isinstance(num_m_tiles, bool) or num_m_tiles < 0:
        raise ValueError(f"new_sync: num_m_tiles must be an int >= 0, got {num_m_tiles!r}")
    return Sync(torch.zeros(2, dtype=torch.int32, device=device),
                torch.zeros(2, max(num_m_tiles, 1), dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device))


def minibatch_m_tiles(minibatch_rows: int | None, hidden: int, inter: int, block_m: int, capacity_m_tiles: int,
                      first_block_n: int, second_block_n: int, device, pull_programs: int = 0) -> int:
    """M-tiles per minibatch: minibatch_rows // block_m (at least 1), or with None MoK's rule on the SMs that
    compute (all but the pull programs; `serval.overlap.minibatch_rows` over the two GEMMs' tiles per M-tile: the
    first GEMM's I / first_block_n, the second's H / second_block_n); at most the capacity's M-tiles (one
    minibatch)."""
    if minibatch_rows is None:
        compute_sms = max(1, common.num_sms(device.index) - pull_programs)
        minibatch_rows = mok_minibatch_rows([common.cdiv(inter, first_block_n), common.cdiv(hidden, second_block_n)],
                                            compute_sms, block_m)
    return max(1, min(minibatch_rows // block_m, capacity_m_tiles))


def _check_tiles(what: str, name: str, tiles) -> None:
    if not isinstance(tiles, TileConfig):
        raise TypeError(f"{what}: {name} must be a serval.plan.TileConfig, got {type(tiles).__name__}")
    if tiles.epi_split not in (1, 2, 4) or tiles.block_n % tiles.epi_split:
        raise ValueError(f"{what}: {name}.epi_split must be 1, 2 or 4 and divide block_n {tiles.block_n}, "
                         f"got {tiles.epi_split}")


def _check_sync(what: str, sync, num_m_tiles: int, device) -> None:
    if not isinstance(sync, Sync):
        raise TypeError(f"{what}: sync must be a fused_pass.Sync (new_sync), got {type(sync).__name__}")
    shapes = {"counters": (2,), "flags": (2, sync.flags.shape[-1] if sync.flags.dim() == 2 else -1), "epoch": (1,)}
    for field, shape in shapes.items():
        t = getattr(sync, field)
        if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
            raise ValueError(f"{what}: sync.{field} must be a contiguous int32 {list(shape)} tensor on {device} "
                             f"(new_sync), got {t.dtype} {list(t.shape)} on {t.device}")
    if sync.flags.shape[1] < num_m_tiles:
        raise ValueError(f"{what}: sync.flags holds {sync.flags.shape[1]} M-tiles per epoch, the schedules have "
                         f"{num_m_tiles} (capacity // block_m, the shared expert's included): allocate it with "
                         f"new_sync({num_m_tiles})")


def _check_weights(what: str, a_rows, schedule: Schedule, w_gate, w_up, w_down, a_name: str) -> tuple[int, int]:
    """(I, H) of the layer, or ValueError / TypeError naming the argument that is off."""
    _check(a_rows, w_gate, w_up, w_down)
    for name, t in ((a_name, a_rows), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        ndim = 2 if name == a_name else 3
        if t.dim() != ndim:
            raise ValueError(f"{what}: {name} must be {ndim}-D, got {list(t.shape)}")
        if t.device != a_rows.device:
            raise ValueError(f"{what}: {name} is on {t.device}, {a_name} on {a_rows.device}")
    num_experts, inter, hidden = w_gate.shape
    if tuple(w_up.shape) != tuple(w_gate.shape):
        raise ValueError(f"{what}: w_up must be [E, I, H] = {list(w_gate.shape)} as w_gate, got {list(w_up.shape)}")
    if tuple(w_down.shape) != (num_experts, hidden, inter):
        raise ValueError(f"{what}: w_down must be [E, H, I] = {[num_experts, hidden, inter]}, "
                         f"got {list(w_down.shape)}")
    if num_experts != schedule.num_experts:
        raise ValueError(f"{what}: the weights hold {num_experts} experts, the schedule {schedule.num_experts}")
    if tuple(a_rows.shape) != (schedule.capacity, hidden):
        raise ValueError(f"{what}: {a_name} must be [schedule.capacity, H] = {[schedule.capacity, hidden]}, "
                         f"got {list(a_rows.shape)}")
    return inter, hidden


def _check_shared(what: str, shared, a_rows, hidden: int, block_m: int, backward: bool) -> int:
    """The shared expert's Is, or ValueError / TypeError naming the argument that is off."""
    if not isinstance(shared, SharedExpert):
        raise TypeError(f"{what}: shared must be None or a fused_pass.SharedExpert, got {type(shared).__name__}")
    rows, schedule = shared.rows, shared.schedule
    for name in ("rows", "w_gate", "w_up", "w_down") + (("gate_up",) if backward else ()):
        t = getattr(shared, name)
        if not isinstance(t, torch.Tensor) or t.dtype != a_rows.dtype or t.device != a_rows.device:
            raise ValueError(f"{what}: shared.{name} must be a {a_rows.dtype} tensor on {a_rows.device}, got "
                             + (f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__))
    if schedule.num_experts != 1 or schedule.block_m % block_m or schedule.capacity < 1:
        raise ValueError(f"{what}: shared.schedule must be a dense_schedule(N, block_m) with block_m a multiple of "
                         f"the tile rows {block_m}, got {schedule.num_experts} experts, capacity {schedule.capacity}, "
                         f"block_m {schedule.block_m}")
    if tuple(rows.shape) != (schedule.capacity, hidden):
        raise ValueError(f"{what}: shared.rows must be [shared.schedule.capacity, H] = {[schedule.capacity, hidden]}, "
                         f"got {list(rows.shape)}")
    if shared.w_gate.dim() != 3 or shared.w_gate.shape[0] != 1 or shared.w_gate.shape[2] != hidden:
        raise ValueError(f"{what}: shared.w_gate must be [1, Is, H] (H = {hidden}), got {list(shared.w_gate.shape)}")
    inter = shared.w_gate.shape[1]
    for name, shape in (("w_up", (1, inter, hidden)), ("w_down", (1, hidden, inter))) + (
            (("gate_up", (schedule.num_packed, 2 * inter)),) if backward else ()):
        if tuple(getattr(shared, name).shape) != shape:
            raise ValueError(f"{what}: shared.{name} must be {list(shape)}, got {list(getattr(shared, name).shape)}")
    return inter


def _check_quant_block(what: str, quant_block, a_rows, inter: int, first_name: str, first: TileConfig,
                       backward: bool) -> None:
    """ValueError unless quant_block is 0, or an mxfp8 block the launch can quantize in its epilogues: whole blocks
    per epilogue chunk, and (backward) per half of d_gate_up."""
    if not isinstance(quant_block, int) or isinstance(quant_block, bool) or quant_block not in (0, QUANT_BLOCK):
        raise ValueError(f"{what}: quant_block must be 0 or {QUANT_BLOCK} (mxfp8), got {quant_block!r}")
    if quant_block == 0:
        return
    if a_rows.dtype != torch.bfloat16:
        raise ValueError(f"{what}: quant_block needs bf16 operands, got {a_rows.dtype}")
    if (first.block_n // first.epi_split) % quant_block:
        raise ValueError(f"{what}: with quant_block {quant_block}, {first_name}'s epilogue chunks (block_n "
                         f"{first.block_n} // epi_split {first.epi_split}) must be a multiple of {quant_block} columns")
    if backward and inter % quant_block:
        raise ValueError(f"{what}: with quant_block {quant_block}, I = {inter} must be a multiple of it (a block of "
                         f"d_gate_up must not straddle its gate and up halves)")


def _check_launch(what: str, a_rows, schedule: Schedule, hidden: int, swiglu_limit, minibatch_rows, tiles: dict,
                  sync, pull, push_to, a_name: str, shared, backward: bool, inter: int = 0,
                  quant_block: int = 0) -> tuple[int, int | None]:
    """The launch's BLOCK_M and the shared expert's Is (None without one), or ValueError / TypeError naming the
    argument that is off. tiles: {name: TileConfig} of the first and the second GEMM."""
    if swiglu_limit is not None and (isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float))):
        raise ValueError(f"{what}: swiglu_limit must be None or a float, got {swiglu_limit!r}")
    if minibatch_rows is not None and (not isinstance(minibatch_rows, int) or isinstance(minibatch_rows, bool)
                                       or minibatch_rows < 1):
        raise ValueError(f"{what}: minibatch_rows must be None or an int >= 1, got {minibatch_rows!r}")
    for name, t in tiles.items():
        _check_tiles(what, name, t)
    (first_name, first), (second_name, second) = tiles.items()
    _check_quant_block(what, quant_block, a_rows, inter, first_name, first, backward)
    block_m = min(first.block_m, schedule.block_m)
    if min(second.block_m, schedule.block_m) != block_m:
        raise ValueError(f"{what}: {first_name} and {second_name} must have one block_m (after min with the "
                         f"schedule's {schedule.block_m}), got {first.block_m} and {second.block_m}")
    if schedule.block_m % block_m:
        raise ValueError(f"{what}: tile rows {block_m} must divide the schedule's block_m {schedule.block_m}")
    capacity_m_tiles = schedule.capacity // block_m
    shared_inter = None if shared is None else _check_shared(what, shared, a_rows, hidden, block_m, backward)
    shared_m_tiles = 0 if shared is None else shared.schedule.capacity // block_m
    _check_sync(what, sync, capacity_m_tiles + shared_m_tiles, a_rows.device)
    if pull is not None:
        if not a_rows.is_contiguous():
            raise ValueError(f"{what}: with pull, {a_name} is the buffer the pull fills: it must be contiguous")
        if pull.source.cols != hidden or pull.source.dtype != a_rows.dtype:
            raise ValueError(f"{what}: pull.source holds [{pull.source.cols}] {pull.source.dtype} tokens, "
                             f"{a_name} [{hidden}] {a_rows.dtype} rows")
        if pull.flags.numel() < capacity_m_tiles or pull.programs < 1:
            raise ValueError(f"{what}: pull needs programs >= 1 and a flag per M-tile ({capacity_m_tiles}), "
                             f"got {pull.programs} programs and {pull.flags.numel()} flags")
    if push_to is not None and (push_to.cols != hidden or push_to.dtype != a_rows.dtype):
        raise ValueError(f"{what}: push_to holds [{push_to.cols}] {push_to.dtype} slots, the second GEMM makes "
                         f"[{hidden}] {a_rows.dtype} rows")
    return block_m, shared_inter


def _launch(*, backward: bool, a_rows, w_first, w_second, c, h, o, schedule: Schedule, hidden: int, inter: int,
            swiglu_limit, first_tiles: TileConfig, second_tiles: TileConfig, launch_tiles: TileConfig,
            use_tma: bool, minibatch_rows, sync: Sync, pull, push_to, debug_waits: bool, block_m: int,
            tma_operands, gate_up=None, router_weights=None, d_rw_partial=None, shared: _SharedLaunch | None = None,
            deq=None, quant_block: int = 0, pulled=None):
    """One launch of `_fused_pass_kernel` (arguments checked by the callers); launch_tiles: whose num_warps and
    num_stages the launch takes; deq: with quant_block, the second GEMM's A (the first's output round-tripped);
    pulled: with quant_block and pull, where the pull programs keep the rows as pulled (a_rows gets them
    round-tripped). w_first, w_second: each GEMM's two weights, rows dense (`triton_gemm.weights_in_place`), one
    expert stride a pair."""
    device = a_rows.device
    stride_w_first, stride_w_second = (weights_in_place(*pair)[1] for pair in (w_first, w_second))
    if use_tma:
        use_tma = _tma_compatible(*tma_operands)
    if use_tma and not common.INTERPRET:
        common.install_tma_allocator()
    capacity_m_tiles = schedule.capacity // block_m
    n_first = common.cdiv(inter, first_tiles.block_n)
    n_second = common.cdiv(hidden, second_tiles.block_n)
    max_tasks = capacity_m_tiles * (n_first + n_second)
    shared_m_tiles = 0
    shared_args = (h, 0, 0, h, h, 0, h, h, h, h, h, h, h, h, h, h, h, 0, 0)  # placeholders: no shared expert
    if shared is not None:
        shared_m_tiles = shared.schedule.capacity // block_m
        max_tasks += shared_m_tiles * (common.cdiv(shared.inter, first_tiles.block_n) + n_second)
        shared_args = (shared.rows, shared.rows.shape[0], shared_m_tiles, shared.schedule.row_source,
                       shared.schedule.tile_expert, shared.schedule.block_m, packed_index(shared.schedule),
                       *shared.w_first, *shared.w_second, shared.c, shared.h, shared.o,
                       *(t if t is not None else h for t in (shared.gate_up, shared.router_weights,
                                                             shared.d_rw_partial)),
                       shared.inter, capacity_m_tiles)
    num_programs = max(1, min(common.num_sms(device.index), max_tasks))
    pull_programs, pull_args, pull_block_c = 0, (0, h, 0, h, h, h), 16
    if pull is not None:
        num_programs = common.num_sms(device.index)  # every program resident at once, the pull programs first
        pull_programs = max(1, min(pull.programs, num_programs - 1))
        pull.epoch.add_(1)
        pull_args = (pull.source.top_k, pull.source.table, pull.source.num_tokens * pull.source.top_k, pull.flags,
                     pull.epoch, pulled if pulled is not None else h)
        pull_block_c = in_gemm_pull.step_columns(pull.block_c, quant_block, hidden)
    if max_tasks + 2 * num_programs >= 2**31:
        raise ValueError(f"fused pass: {max_tasks} tasks do not fit the int32 task counter")
    # one minibatch size for both expert groups; clamped only where one minibatch holds every M-tile of both
    most_m_tiles = max(capacity_m_tiles, shared_m_tiles, 1)
    mb = minibatch_m_tiles(minibatch_rows, hidden, inter, block_m, most_m_tiles, first_tiles.block_n,
                           second_tiles.block_n, device, pull_programs)
    # the staged launch's M-group inside each minibatch (weight and row tiles shared in L2 by the programs working
    # at once); minibatches start on group boundaries
    group_m = min(first_tiles.group_m, mb)
    mb = min(-(-mb // group_m) * group_m, most_m_tiles)
    sync.epoch.add_(1)
    _fused_pass_kernel[(num_programs,)](
        a_rows, schedule.capacity, schedule.row_source, schedule.tile_expert, schedule.expert_offsets,
        schedule.num_experts, schedule.block_m, packed_index(schedule),
        *w_first, *w_second, stride_w_first, stride_w_second, c, h, o,
        gate_up if gate_up is not None else h, router_weights if router_weights is not None else h,
        d_rw_partial if d_rw_partial is not None else h, deq if deq is not None else h,
        hidden, inter, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        sync.counters, sync.flags, sync.flags.shape[1], sync.epoch,
        *pull_args, push_to.table if push_to is not None else h, push_to.num_slots if push_to is not None else 0,
        *shared_args,
        BACKWARD=backward,
        BLOCK_M=block_m, FIRST_BLOCK_N=first_tiles.block_n, FIRST_BLOCK_K=first_tiles.block_k,
        FIRST_EPI_SPLIT=first_tiles.epi_split, SECOND_BLOCK_N=second_tiles.block_n,
        SECOND_BLOCK_K=second_tiles.block_k, SECOND_EPI_SPLIT=second_tiles.epi_split,
        SECOND_EPI_TMA_STORES=second_tiles.epi_tma_stores,
        MB=mb, GROUP_M=group_m, NUM_PROGRAMS=num_programs,
        HAS_LIMIT=swiglu_limit is not None, USE_TMA=use_tma, UPCAST=common.INTERPRET,
        PROXY_FENCE=use_tma and not common.INTERPRET, PRINT_TIMEOUTS=debug_waits or common.INTERPRET,
        PULL_PROGRAMS=pull_programs, PULL_ALIGNED=pull is not None and pull.source.aligned, PULL_BLOCK_C=pull_block_c,
        PUSH=push_to is not None, PUSH_ALIGNED=push_to is not None and push_to.aligned, HAS_SHARED=shared is not None,
        QUANT_BLOCK=quant_block, KEEP_PULLED=pulled is not None,
        num_warps=launch_tiles.num_warps, num_stages=launch_tiles.num_stages,
    )


def fused_forward(a_rows: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  schedule: Schedule, swiglu_limit: float | None, gate_up_tiles: TileConfig, down_tiles: TileConfig,
                  use_tma: bool, minibatch_rows: int | None, sync: Sync, *, pull: in_gemm_pull.Pull | None = None,
                  push_to: PeerSlots | None = None, shared: SharedExpert | None = None, quant_block: int = 0,
                  debug_waits: bool = False):
    """Gate/up + SwiGLU and down in one persistent launch: (gate_up, h, o, shared_out), bit for bit
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

    shared: the shared expert's gate/up + SwiGLU and down join the launch (`SharedExpert` with x's rows; its tasks
    first), bit for bit the same two staged launches on its dense schedule.

    quant_block = 32 (mxfp8, bf16 operands that the caller has quantized and dequantized along K: a_rows and the
    weights): the down GEMM reads h quantized along I in blocks of 32 with E8M0 scales and dequantized (the gate/up
    tiles' epilogue makes it beside h), as the staged mxfp8 forward's `down(quantize(h)...)`; the routed GEMMs
    only (the shared expert stays in bf16); gate_up_tiles' epilogue chunks a multiple of 32 columns. With pull the
    token buffers hold x as it is and the pull programs round-trip each pulled row into a_rows (row blocks: the
    same bits as rows quantized after the pull).

    Returns gate_up [num_packed, 2I] (packed rows, kept for backward), h = SwiGLU(gate, up) [R, I], o = h @
    w_down[e].T [R, H] (None with push_to) and shared_out: None, or the shared expert's (gate_up [N, 2Is], h [Rs,
    Is], o [Rs, H]) on its schedule's Rs rows; in the operands' dtype; rows past the used M-tiles are not written.
    """
    what = "fused_forward"
    inter, hidden = _check_weights(what, a_rows, schedule, w_gate, w_up, w_down, "a_rows")
    block_m, shared_inter = _check_launch(what, a_rows, schedule, hidden, swiglu_limit, minibatch_rows,
                                          {"gate_up_tiles": gate_up_tiles, "down_tiles": down_tiles}, sync, pull,
                                          push_to, "a_rows", shared, backward=False, inter=inter,
                                          quant_block=quant_block)
    a_rows = a_rows.contiguous()
    (w_gate, w_up), _ = weights_in_place(w_gate, w_up)
    w_down = weights_in_place(w_down)[0][0]
    dtype, device = a_rows.dtype, a_rows.device
    gate_up = common.empty((schedule.num_packed, 2 * inter), dtype, device)
    h = common.empty((schedule.capacity, inter), dtype, device)
    o = common.empty((schedule.capacity, hidden), dtype, device) if push_to is None else h  # h: a placeholder
    h_deq = common.empty((schedule.capacity, inter), dtype, device) if quant_block else None
    tma_operands = ((w_gate, 0), (w_up, 0), (w_down, 0), (a_rows, 0), (h, 0), (o, 0)) + (
        ((h_deq, 0),) if quant_block else ())
    launch_shared = None
    if shared is not None:
        rows_s, capacity_s = shared.rows.contiguous(), shared.schedule.capacity
        w_shared = tuple(w.contiguous() for w in (shared.w_gate, shared.w_up, shared.w_down))
        launch_shared = _SharedLaunch(
            rows_s, shared.schedule, shared_inter, w_shared[:2], (w_shared[2], w_shared[2]),
            common.empty((shared.schedule.num_packed, 2 * shared_inter), dtype, device),
            common.empty((capacity_s, shared_inter), dtype, device), common.empty((capacity_s, hidden), dtype, device))
        tma_operands += ((rows_s, 0), *((w, 0) for w in w_shared), (launch_shared.h, 0), (launch_shared.o, 0))
    _launch(backward=False, a_rows=a_rows, w_first=(w_gate, w_up), w_second=(w_down, w_down), c=gate_up, h=h, o=o,
            schedule=schedule, hidden=hidden, inter=inter, swiglu_limit=swiglu_limit, first_tiles=gate_up_tiles,
            second_tiles=down_tiles, launch_tiles=gate_up_tiles, use_tma=use_tma, minibatch_rows=minibatch_rows,
            sync=sync, pull=pull, push_to=push_to, debug_waits=debug_waits, block_m=block_m,
            tma_operands=tma_operands, shared=launch_shared, deq=h_deq, quant_block=quant_block)
    shared_out = None if shared is None else (launch_shared.c, launch_shared.h, launch_shared.o)
    return gate_up, h, (o if push_to is None else None), shared_out


def fused_backward(d_y_rows: torch.Tensor, w_down: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   gate_up: torch.Tensor, router_weights: torch.Tensor, schedule: Schedule,
                   swiglu_limit: float | None, dgrad_tiles: TileConfig, gate_up_dgrad_tiles: TileConfig,
                   use_tma: bool, minibatch_rows: int | None, sync: Sync, *, pull: in_gemm_pull.Pull | None = None,
                   push_to: PeerSlots | None = None, shared: SharedExpert | None = None, quant_block: int = 0,
                   debug_waits: bool = False):
    """The down dgrad with its SwiGLU backward and the gate/up dgrad in one persistent launch:
    (d_gate_up, h_weighted, d_rw_partial, d_x_rows, shared_out), bit for bit
    `triton_gemm.down_dgrad_swiglu_partials(d_y_rows, w_down, gate_up, router_weights, schedule, swiglu_limit,
    dgrad_tiles, use_tma)` followed by `triton_gemm.gate_up_dgrad(d_gate_up, w_gate, w_up, schedule,
    gate_up_dgrad_tiles, use_tma)`.

    d_y_rows [R, H]: the schedule's rows of d_y, unscaled (padding rows zero); w_down [E, H, I], w_gate, w_up
    [E, I, H]; gate_up [num_packed, 2I]: the forward's packed pre-activations; all one dtype. router_weights fp32
    [N * k] by source (at EP the group's). The other arguments as `fused_forward`'s, with dgrad_tiles and
    gate_up_dgrad_tiles the two GEMMs' tiles (one BLOCK_M; num_warps and num_stages are gate_up_dgrad_tiles':
    the larger tile, whose shared memory bounds the stages). pull (EP): the first programs pull d_y's rows into
    d_y_rows, which the gate/up-dgrad-independent down weight gradient then reads too; push_to (EP): d_x's rows
    go straight into their owners' slots and d_x_rows is not made. shared: the shared expert's two dgrads join the
    launch (`SharedExpert` with d_y's rows and the forward's gate_up; its tasks first; router weights 1), bit for
    bit the same two staged launches on its dense schedule. quant_block = 32 (mxfp8, d_y_rows and the weights
    quantized and dequantized along K by the caller, gate_up the dequantized kept pre-activations): the gate/up
    dgrad reads d_gate_up quantized along 2I in blocks of 32 (E8M0) and dequantized, made by the dgrad tiles'
    epilogue beside d_gate_up, as the staged mxfp8 backward; routed GEMMs only; I and dgrad_tiles' epilogue
    chunks multiples of 32. With pull the token buffers hold d_y as it is: d_y_rows gets the rows as pulled (which
    the weight gradients quantize along tokens) and the dgrad reads them round-tripped by the pull programs.

    Returns d_gate_up [R, 2I], h_weighted = rw * h [R, I], the router-weight gradient's row partials fp32
    [R, ceil(I / 16)] (`triton_gemm.sum_partials` reduces them), d_x_rows [R, H] (None with push_to) and
    shared_out: None, or the shared expert's (d_gate_up [Rs, 2Is], h [Rs, Is], d_x [Rs, H]) on its schedule's Rs
    rows; rows past the used M-tiles are not written.
    """
    what = "fused_backward"
    inter, hidden = _check_weights(what, d_y_rows, schedule, w_gate, w_up, w_down, "d_y_rows")
    _check(d_y_rows, gate_up)
    if tuple(gate_up.shape) != (schedule.num_packed, 2 * inter):
        raise ValueError(f"{what}: gate_up must be [num_packed, 2I] = {[schedule.num_packed, 2 * inter]} (the "
                         f"forward's packed rows), got {list(gate_up.shape)}")
    if router_weights.dtype != torch.float32 or router_weights.dim() != 1 or router_weights.device != d_y_rows.device:
        raise ValueError(f"{what}: router_weights must be a 1-D float32 tensor (by source) on {d_y_rows.device}, "
                         f"got {router_weights.dtype} {list(router_weights.shape)} on {router_weights.device}")
    block_m, shared_inter = _check_launch(what, d_y_rows, schedule, hidden, swiglu_limit, minibatch_rows,
                                          {"dgrad_tiles": dgrad_tiles, "gate_up_dgrad_tiles": gate_up_dgrad_tiles},
                                          sync, pull, push_to, "d_y_rows", shared, backward=True, inter=inter,
                                          quant_block=quant_block)
    check_d_rw_chunks(f"{what}: dgrad_tiles", dgrad_tiles.block_n, dgrad_tiles.epi_split)
    d_y_rows = d_y_rows.contiguous()
    (w_gate, w_up), _ = weights_in_place(w_gate, w_up)
    w_down = weights_in_place(w_down)[0][0]
    dtype, device = d_y_rows.dtype, d_y_rows.device
    num_rows = schedule.capacity
    d_gate_up = common.empty((num_rows, 2 * inter), dtype, device)
    h_weighted = common.empty((num_rows, inter), dtype, device)
    d_rw_partial = new_d_rw_partial(num_rows, inter, device)
    d_x_rows = common.empty((num_rows, hidden), dtype, device) if push_to is None else h_weighted  # a placeholder
    d_gate_up_deq = common.empty((num_rows, 2 * inter), dtype, device) if quant_block else None
    # mxfp8 at EP: the pull programs keep the rows as pulled in d_y_rows and write the dgrad's A round-tripped
    a_rows = common.empty((num_rows, hidden), dtype, device) if quant_block and pull is not None else d_y_rows
    tma_operands = ((w_gate, 0), (w_up, 0), (w_down, 0), (a_rows, 0), (d_gate_up, 0), (d_gate_up, inter),
                    (h_weighted, 0), (d_x_rows, 0)) + (((d_gate_up_deq, 0), (d_gate_up_deq, inter)) if quant_block
                                                       else ())
    launch_shared = None
    if shared is not None:  # router weights 1: the shared expert's rows are unweighted
        rows_s, capacity_s = shared.rows.contiguous(), shared.schedule.capacity
        w_gate_s, w_up_s, w_down_s = (w.contiguous() for w in (shared.w_gate, shared.w_up, shared.w_down))
        launch_shared = _SharedLaunch(
            rows_s, shared.schedule, shared_inter, (w_down_s, w_down_s), (w_gate_s, w_up_s),
            common.empty((capacity_s, 2 * shared_inter), dtype, device),
            common.empty((capacity_s, shared_inter), dtype, device), common.empty((capacity_s, hidden), dtype, device),
            shared.gate_up.contiguous(), torch.ones(capacity_s, dtype=torch.float32, device=device),
            new_d_rw_partial(capacity_s, shared_inter, device))
        tma_operands += ((rows_s, 0), (w_gate_s, 0), (w_up_s, 0), (w_down_s, 0), (launch_shared.c, 0),
                         (launch_shared.c, shared_inter), (launch_shared.h, 0), (launch_shared.o, 0))
    _launch(backward=True, a_rows=a_rows, w_first=(w_down, w_down), w_second=(w_gate, w_up), c=d_gate_up,
            h=h_weighted, o=d_x_rows, schedule=schedule, hidden=hidden, inter=inter, swiglu_limit=swiglu_limit,
            first_tiles=dgrad_tiles, second_tiles=gate_up_dgrad_tiles, launch_tiles=gate_up_dgrad_tiles,
            use_tma=use_tma, minibatch_rows=minibatch_rows, sync=sync, pull=pull, push_to=push_to,
            debug_waits=debug_waits, block_m=block_m, tma_operands=tma_operands,
            gate_up=gate_up.contiguous(), router_weights=router_weights.contiguous(), d_rw_partial=d_rw_partial,
            shared=launch_shared, deq=d_gate_up_deq, quant_block=quant_block,
            pulled=d_y_rows if a_rows is not d_y_rows else None)
    shared_out = None if shared is None else (launch_shared.c, launch_shared.h, launch_shared.o)
    return d_gate_up, h_weighted, d_rw_partial, (d_x_rows if push_to is None else None), shared_out
