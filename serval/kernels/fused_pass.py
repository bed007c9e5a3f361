"""One pass of the routed experts' two GEMMs in one persistent launch, at expert parallelism with the dispatch
(pull) and the combine (push) in the same launch: the fused layer kernel's building block. This module holds the
kernel; `fused_launch` checks the arguments and launches it.

    pass       first GEMM (F)                                second GEMM (S)
    forward    gate/up + SwiGLU: x rows [R, H] -> gate_up,  h  down: h -> o [R, H] (at EP pushed to the owners)
    backward   down dgrad + SwiGLU backward: d_y rows [R, H]  gate/up dgrad: d_gate_up -> d_x rows [R, H]
               -> d_gate_up [R, 2I], rw * h, d_rw partials     (at EP pushed to the owners)

`fused_pass_kernel` runs every F tile and every S tile of a pass through `gemm_tile.gemm_tile`, in the variants
the staged stages run (`Pass.FIRST`, `Pass.SECOND`), so the results are bit for bit those of the two staged
launches with the same tiles. Its tasks come in `task_order`'s order; at EP its first programs pull the rows of
F's A (`in_gemm_pull`), and the S tiles push their rows to the owners. With a shared expert (a one-expert group
over the N tokens, rows = tokens) its own task order, the same function on its M-tiles, comes first: its rows
need no pull, so at EP its tiles fill the time while the routed rows arrive. An expert group is an `ExpertGroup`
bundle: its two GEMMs' `gemm_tile.Operands`, its schedule's tables, and (backward) the SwiGLU backward's inputs.

Counter. Programs take task ids from an int32 counter with `tl.atomic_add` (integer atomics only; nothing
floating-point is ever accumulated atomically): a program holds two ids, the task it runs and the next one, taken
when the task starts so that the counter's round trip overlaps it; it stops at the first id past the last task
(a launch draws at most tasks + 2 * programs ids).

Flags. An F tile, once its outputs are stored (pointer stores), fences them for the async proxy (S reads them
through TMA), waits for its warps (`tl.debug_barrier`) and adds 1 to its M-tile's int32 flag with release semantics
(the shared expert's M-tiles have theirs after the routed capacity's). An S tile first waits (acquire) until its
M-tile's flag reaches n_first: all F N-tiles of that M-tile have stored their columns. The wait is bounded
(`in_gemm_pull.wait_until`): after about 10 s the program traps, an error instead of a hang, and with
PRINT_TIMEOUTS prints the M-tile first (off on the GPU by default: a printf is a function call, and a call
anywhere in the kernel makes ptxas serialize all its wgmma instructions).

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

mxfp8 (`Variant.QUANT_BLOCK` 32 with `Outputs.deq`): the operands are bf16 values the caller quantized and
dequantized along K; the first GEMM's epilogue also stores its output's E8M0 round trip (forward h along I, backward
d_gate_up along 2I: blocks within a row), which the second GEMM reads, and at EP the pull programs round-trip the
rows they pull (the backward keeping them as pulled too): the bits of the staged mxfp8 passes, the same rows moved.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import in_gemm_pull
from .gemm_tile import Operands, ScheduleTables, SwigluBackwardInputs, Tile, Variant, descriptors, gemm_tile
from .task_order import task_coords

CLEAR_BLOCK = tl.constexpr(1024)  # flags a program zeroes a step


class SyncTables(NamedTuple):
    """`serval.values.Sync` as the kernel takes it: with the flags' row length."""

    counters: torch.Tensor
    flags: torch.Tensor
    num_flags: int
    epoch: torch.Tensor


class ExpertGroup(NamedTuple):
    """One expert group's part of a launch (the routed experts, or the shared expert): its first and second GEMM
    (the second's A is what the first writes: h forward, d_gate_up backward, or their round trip), its schedule's
    tables (with the packed index) and, backward, the SwiGLU backward's inputs (else None)."""

    first: Operands
    second: Operands
    sched: ScheduleTables
    swiglu_bwd: SwigluBackwardInputs | None


class Pass(NamedTuple):
    """The launch's constexprs: the two GEMMs' variants and tiles (one BLOCK_M; the first GEMM's with pointer
    stores: its release covers them with one proxy fence), the task order's minibatch (MB M-tiles) and M-group,
    the programs, PROXY_FENCE (the second GEMM reads the first's rows through TMA), PRINT_TIMEOUTS, and HAS_SHARED:
    whether the shared expert's group is given (Triton 3.6 cannot compare a bundle holding None fields with None)."""

    FIRST: Variant
    SECOND: Variant
    FIRST_TILE: Tile
    SECOND_TILE: Tile
    MB: int
    GROUP_M: int
    NUM_PROGRAMS: int
    PROXY_FENCE: bool
    PRINT_TIMEOUTS: bool
    HAS_SHARED: bool


@triton.jit
def _used_m_tiles(sched, BLOCK_M: tl.constexpr):
    """The group's M-tiles that hold rows: read on the device, no host sync."""
    return tl.load(sched.expert_offsets + sched.num_experts) // BLOCK_M


@triton.jit
def fused_pass_kernel(routed, shared, sync, pull, push, swiglu_limit, P: tl.constexpr, PULL: tl.constexpr):
    """Every F and S tile of `routed` (an `ExpertGroup`), and of `shared` before them where given, in task order;
    sync: `Sync`; pull (`in_gemm_pull.PullTables`, PULL its `PullSteps`): the first PULL.PROGRAMS programs pull F's
    A rows of the routed experts; push (`gemm_tile.PushTo`): the routed S tiles push their rows."""
    FIRST: tl.constexpr = P.FIRST
    SECOND: tl.constexpr = P.SECOND
    FIRST_TILE: tl.constexpr = P.FIRST_TILE
    SECOND_TILE: tl.constexpr = P.SECOND_TILE
    BLOCK_M: tl.constexpr = FIRST_TILE.BLOCK_M
    FIRST_BLOCK_N: tl.constexpr = FIRST_TILE.BLOCK_N
    SECOND_BLOCK_N: tl.constexpr = SECOND_TILE.BLOCK_N
    MB: tl.constexpr = P.MB
    GROUP_M: tl.constexpr = P.GROUP_M
    NUM_PROGRAMS: tl.constexpr = P.NUM_PROGRAMS
    PROXY_FENCE: tl.constexpr = P.PROXY_FENCE
    PRINT_TIMEOUTS: tl.constexpr = P.PRINT_TIMEOUTS
    HAS_SHARED: tl.constexpr = P.HAS_SHARED

    pid = tl.program_id(0)
    parity = tl.load(sync.epoch) & 1
    counter = sync.counters + parity
    flags = sync.flags + parity * sync.num_flags
    # zero what launch e + 1 will use (launch e - 1 used it and has finished)
    other_flags = sync.flags + (1 - parity) * sync.num_flags
    for start in range(pid * CLEAR_BLOCK, sync.num_flags, NUM_PROGRAMS * CLEAR_BLOCK):
        offsets = start + tl.arange(0, CLEAR_BLOCK)
        tl.store(other_flags + offsets, tl.zeros((CLEAR_BLOCK,), dtype=tl.int32), mask=offsets < sync.num_flags)
    if pid == 0:
        tl.store(sync.counters + (1 - parity), 0)

    num_m_tiles = _used_m_tiles(routed.sched, BLOCK_M)
    n_first = tl.cdiv(routed.first.n_out, FIRST_BLOCK_N)
    n_second = tl.cdiv(routed.second.n_out, SECOND_BLOCK_N)
    num_tasks = num_m_tiles * (n_first + n_second)
    first_descs = descriptors(routed.first, routed.sched, None, FIRST, FIRST_TILE)
    second_descs = descriptors(routed.second, routed.sched, push, SECOND, SECOND_TILE)
    if HAS_SHARED:  # the shared expert's tasks come first: they need no pulled rows, so they fill the pull's time
        sh_num_m_tiles = _used_m_tiles(shared.sched, BLOCK_M)
        sh_n_first = tl.cdiv(shared.first.n_out, FIRST_BLOCK_N)
        num_shared_tasks = sh_num_m_tiles * (sh_n_first + n_second)
        sh_flags_offset = routed.first.a.num_rows // BLOCK_M  # after the routed capacity's M-tiles
        sh_first_descs = descriptors(shared.first, shared.sched, None, FIRST, FIRST_TILE)
        sh_second_descs = descriptors(shared.second, shared.sched, None, SECOND, SECOND_TILE)
        num_tasks += num_shared_tasks

    if PULL is not None:  # EP: the first programs pull A's rows, M-tile by M-tile, in the order tasks need them
        PULL_PROGRAMS: tl.constexpr = PULL.PROGRAMS
        pull_epoch = tl.load(pull.epoch)
        if pid < PULL_PROGRAMS:
            in_gemm_pull.pull_tiles(pull, routed.first.a, routed.sched.row_source, pull_epoch, num_m_tiles,
                                    routed.first.k, BLOCK_M, PULL)
    else:
        PULL_PROGRAMS: tl.constexpr = 0
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
            is_second, m_tile, n_tile = task_coords(tl.where(is_shared, task, task - num_shared_tasks),
                                                    tl.where(is_shared, sh_num_m_tiles, num_m_tiles),
                                                    tl.where(is_shared, sh_n_first, n_first), n_second, MB, GROUP_M)
            flag = flags + tl.where(is_shared, sh_flags_offset + m_tile, m_tile)
            first_n_tiles = tl.where(is_shared, sh_n_first, n_first)
        else:
            is_routed: tl.constexpr = True
            is_second, m_tile, n_tile = task_coords(task, num_m_tiles, n_first, n_second, MB, GROUP_M)
            flag = flags + m_tile
            first_n_tiles = n_first
        is_first = ~is_second
        if is_second:
            # the first GEMM's output of this M-tile: every first-GEMM N-tile has stored its columns (acquire)
            in_gemm_pull.wait_until(flag, first_n_tiles, m_tile,
                                    "serval: fused pass timed out waiting for the first GEMM's M-tile ",
                                    PRINT_TIMEOUTS)
        # the tile bodies in sibling branches, not nested ones: Triton's shared-memory allocator then reuses one
        # pipeline's buffers for all of them (nested, it kept two at once)
        if HAS_SHARED:  # the shared expert's rows stay here: stored, never pulled or pushed
            if is_second & is_shared:
                gemm_tile(sh_second_descs, m_tile, n_tile, shared.second, shared.sched, None, None, swiglu_limit,
                          SECOND, SECOND_TILE)
            if is_first & is_shared:
                gemm_tile(sh_first_descs, m_tile, n_tile, shared.first, shared.sched, shared.swiglu_bwd, None,
                          swiglu_limit, FIRST, FIRST_TILE)
        if is_second & is_routed:
            gemm_tile(second_descs, m_tile, n_tile, routed.second, routed.sched, None, push, swiglu_limit, SECOND,
                      SECOND_TILE)
        if is_first & is_routed:
            if PULL is not None:  # A's rows of this M-tile have been pulled (acquire)
                in_gemm_pull.wait_until(pull.flags + m_tile, pull_epoch, m_tile,
                                        "serval: fused pass timed out waiting for the pulled rows of M-tile ",
                                        PRINT_TIMEOUTS)
            gemm_tile(first_descs, m_tile, n_tile, routed.first, routed.sched, routed.swiglu_bwd, None, swiglu_limit,
                      FIRST, FIRST_TILE)
        if is_first:
            if PROXY_FENCE:  # the second GEMM reads these rows with TMA (the async proxy): order the stores for it
                tl.inline_asm_elementwise("fence.proxy.async.global;", "=r", [], dtype=tl.int32, is_pure=False,
                                          pack=1)
            tl.debug_barrier()  # every warp's stores are done before the release
            tl.atomic_add(flag, 1, sem="release", scope="gpu")
        task = next_task
