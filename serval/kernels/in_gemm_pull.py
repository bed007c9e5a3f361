"""The dispatch inside a GEMM: communication programs that pull the GEMM's A rows from the owners' token
buffers while the other programs compute, M-tile by M-tile.

At expert parallelism the gate/up GEMM (x's rows) and the down dgrad (d_y's rows) (`triton_gemm`,
PULL_PROGRAMS > 0) give their first `KernelPlan.pull_programs` / `dgrad_pull_programs` programs to the pull.
Each pulls M-tile after M-tile (in the order the compute programs take them) into the [R, K] A buffer and
publishes it with a flag (a proxy fence first, since the compute programs read the rows with TMA, the async
proxy; then a release store). A compute program waits for its tile's flag (acquire) before its K loop, so the
pull runs under the GEMM instead of before it.

Flags hold the call's epoch (a device counter bumped before each launch), so they are never reset and a
CUDA graph can replay the launch. Every wait is bounded: past about 10 s the program traps (the CUDA context
is lost, as when a transport barrier times out): an error, never a hang. Under the interpreter it also prints
the M-tile; on the GPU it does not, since a printf anywhere in the GEMM would serialize its wgmma. Every
program is resident at once (one per SM) and the pull programs have the lowest ids, so no wait blocks a
program that the awaited one needs. Under the interpreter programs run in id order, so the pull programs
finish before any compute program starts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import peers
from ..peers import PeerTokens
from . import quantize


class Pull(NamedTuple):
    """What the GEMM needs to pull its own rows: where the owners' tokens are, how many programs pull and
    how many columns a step, and the flags (int32 [>= M-tiles]) and epoch (int32 [1]) of `serval.values.new_pull_flags`.
    quant_block > 0 (mxfp8): A gets the rows E8M0 round-tripped (`pull_tiles`), and raw_rows, if given (a
    contiguous buffer shaped as A), the rows as pulled."""

    source: PeerTokens
    programs: int
    block_c: int
    flags: torch.Tensor
    epoch: torch.Tensor
    quant_block: int = 0
    raw_rows: torch.Tensor | None = None


class PullTables(NamedTuple):
    """The pull's runtime arguments in a kernel: the owners' token buffers (an int64 address per rank) holding
    slots_per_rank = N * top_k sources each, the flags and the epoch, and raw (`Pull.raw_rows`) or None."""

    table: torch.Tensor
    slots_per_rank: int
    top_k: int
    flags: torch.Tensor
    epoch: torch.Tensor
    raw: torch.Tensor | None


class PullSteps(NamedTuple):
    """The pull's constexprs: PROGRAMS pull programs, BLOCK_C columns a step, ALIGNED 16-byte rows (`PeerTokens`),
    QUANT_BLOCK (mxfp8 round trip, 0: none), PROXY_FENCE (the compute programs read A through TMA) and
    PRINT_TIMEOUTS (a wait that times out says which M-tile: see `wait_until`)."""

    PROGRAMS: int
    BLOCK_C: int
    ALIGNED: bool
    QUANT_BLOCK: int
    PROXY_FENCE: bool
    PRINT_TIMEOUTS: bool


def step_columns(block_c: int, quant_block: int, k: int) -> int:
    """Columns a pull program moves a step: block_c, at most K's next power of two; with a round trip (quant_block,
    mxfp8) two whole blocks (wider steps spill registers on sm_90a)."""
    return 2 * quant_block if quant_block else min(block_c, triton.next_power_of_2(k))


def kernel_arguments(pull: Pull, k: int, num_programs: int, num_m_tiles: int, proxy_fence: bool,
                     print_timeouts: bool) -> tuple[PullTables, PullSteps]:
    """The pull's (PullTables, PullSteps) in a launch of num_programs programs (at least one computes) whose A has
    k columns and num_m_tiles M-tiles; bumps the epoch on the device: once per launch."""
    if pull.flags.numel() < num_m_tiles:
        raise ValueError(f"pull flags: {pull.flags.numel()} flags for {num_m_tiles} M-tiles")
    pull.epoch.add_(1)
    source = pull.source
    tables = PullTables(source.table, source.num_tokens * source.top_k, source.top_k, pull.flags, pull.epoch,
                        pull.raw_rows)
    steps = PullSteps(max(1, min(pull.programs, num_programs - 1)), step_columns(pull.block_c, pull.quant_block, k),
                      source.aligned, pull.quant_block, proxy_fence, print_timeouts)
    return tables, steps


@triton.jit
def pull_tiles(pull, a, row_source_ptr, epoch, num_m_tiles, K, BLOCK_M: tl.constexpr, P: tl.constexpr):
    """A communication program: M-tiles p, p + P.PROGRAMS, ... of A (`gemm_tile.Rows`) pulled from the owners' token
    buffers (`PullTables`; zeros on padding rows), each published with flag = epoch once all its rows are stored.
    P.QUANT_BLOCK > 0 (mxfp8: `fused_pass`, and the staged GEMMs' pulls): A gets the rows quantized in
    (1, QUANT_BLOCK) E8M0 blocks and dequantized (`quantize.e8m0_round_trip`; BLOCK_C a multiple of the block),
    and pull.raw (A's layout), where given, the rows as pulled."""
    PROGRAMS: tl.constexpr = P.PROGRAMS
    BLOCK_C: tl.constexpr = P.BLOCK_C
    ALIGNED: tl.constexpr = P.ALIGNED
    QUANT_BLOCK: tl.constexpr = P.QUANT_BLOCK
    PROXY_FENCE: tl.constexpr = P.PROXY_FENCE
    for m_tile in range(tl.program_id(0), num_m_tiles, PROGRAMS):
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        source = tl.load(row_source_ptr + rows).to(tl.int64)
        valid = source >= 0
        peer = peers.peer_rows(pull.table, tl.where(valid, source, 0), valid, pull.slots_per_rank, K, pull.top_k,
                               True, ALIGNED, a.ptr.dtype.element_ty)
        for c0 in range(0, K, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            values = tl.load(peer[:, None] + cols[None, :], mask=valid[:, None] & (cols < K)[None, :], other=0.0)
            offsets = rows.to(tl.int64)[:, None] * a.stride + cols[None, :]
            if QUANT_BLOCK > 0:
                if pull.raw is not None:
                    tl.store(pull.raw + offsets, values, mask=(cols < K)[None, :])
                values = quantize.e8m0_round_trip(values, QUANT_BLOCK)
            tl.store(a.ptr + offsets, values, mask=(cols < K)[None, :])
        if PROXY_FENCE:  # the compute programs read these rows with TMA (the async proxy): order them for it
            tl.inline_asm_elementwise("fence.proxy.async.global;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()  # every thread's stores are done before the flag's release
        tl.atomic_xchg(pull.flags + m_tile, epoch, sem="release", scope="gpu")


# spins of about a microsecond each: a wait gives up after ~10 s
MAX_SPINS = tl.constexpr(1 << 23)


@triton.jit
def wait_until(flag_ptr, target, tile, MESSAGE: tl.constexpr, PRINT: tl.constexpr):
    """Wait (bounded) until the int32 flag at flag_ptr holds at least `target` (an acquire: what was stored before
    the release that made it so is visible after); past MAX_SPINS trap, with PRINT printing MESSAGE and `tile` first.

    The int32 atomic_add of 0 is an acquire load of the flag (Triton compiles it to ld.acquire.gpu), not an
    accumulation: no floating-point value is ever summed atomically. The print is a printf, a function call, and a
    call anywhere in a kernel makes ptxas serialize every wgmma of it (sm_90a: "C7510 ... wgmma pipeline crossing
    function boundary at a function call"): a kernel that must keep its wgmma pipelined passes PRINT=False (and
    only traps). Also `fused_pass`'s wait for the first GEMM's rows."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < MAX_SPINS):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        if PRINT:
            tl.device_print(MESSAGE, tile)
        tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_for_rows(flag_ptr, epoch, m_tile, PRINT: tl.constexpr):
    """Wait (bounded) until a communication program has published M-tile m_tile of this call; PRINT: say which
    M-tile before the trap (the GEMMs pass it under the interpreter only: see `wait_until`)."""
    wait_until(flag_ptr, epoch, m_tile, "serval: timed out waiting for the pulled rows of M-tile ", PRINT)
