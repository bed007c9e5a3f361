"""The CUDA transport: torch symmetric memory, Triton kernels on peer pointers, torch's bounded barrier.

Every rank of the group allocates the same buffers with `symm_mem.empty` and maps every
peer's copy (`symm_mem.rendezvous`); a kernel then reads or writes a peer's rows through
a plain pointer, over NVLink, like local memory. Two buffers per (C, dtype):

* the *token* buffer [N, C] behind `pull`: each rank copies its tokens in, and every rank
  reads the rows it needs from the owners' buffers;
* the *slot* buffer [N * k, C] behind `push`: every rank writes its rows straight into the
  owners' slots, and each owner then reads its own slots.

Both kernels are plain row copies: one program per (block of rows, block of columns),
16-byte vectors along C, the peer chosen per row from a table of base addresses (an int64
tensor, one entry per rank). The table is all the kernels know about the ranks, so the
same kernels run on P "virtual ranks" in one process (the table holds local tensors'
data_ptr()s), under TRITON_INTERPRET=1 on the CPU as well: that is how the tests drive them.

Ordering between ranks is torch's signal-pad barrier (`_SymmetricMemory.barrier`): a one-block
kernel on the current stream that, for every peer, sets our flag in the peer's signal pad
(compare-and-swap 0 -> 1, release, system scope) and waits for the peer's flag in ours
(1 -> 0, acquire). Both waits are bounded by `timeout_ms`: past it torch's kernel prints a
"[FATAL] SymmetricMemory::barrier: rank r failed to ..." line and traps, so the next CUDA call
of the process raises (a sticky launch failure; the CUDA context is lost, as it should be when
a peer is gone or the ranks have desynchronised): an error, never a hang. The late peer then
times out in turn. Without a multicast mapping torch takes this signal-pad path (never
multimem); multicast is switched off before the first allocation and checked absent after
every rendezvous. Nothing here syncs the host with the device after a
buffer exists, so `pull` and `push` can be captured in CUDA graphs (allocate, i.e. call each
once, before capture).

Determinism: every slot is written by exactly one row of one rank (the schedule's sources
are a partition of all (token, slot) pairs), so the writes never race and need no atomics.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from .. import peers
from ..kernels import common
from ..peers import PeerSlots, PeerTokens

# NVLink multicast (NVLS) is never used by serval; torch reads this when it allocates.
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

# Generous: processes that time-slice one GPU in tests see millisecond-long waits, and a rank
# may legitimately lag its peers by seconds (data loading, checkpointing) before a layer.
DEFAULT_TIMEOUT_MS = 300_000

# 512 columns x 16 rows = 8192 elements per program (16 KB in bf16): many 16-byte loads in
# flight per SM; narrow rows (d_router_weights, C = 1) take taller blocks instead.
MAX_BLOCK_C = 512
BLOCK_ELEMENTS = 8192
MAX_BLOCK_R = 1024


# ----------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------

@triton.jit
def _pull_kernel(table_ptr, row_source_ptr, rows_ptr, num_rows, cols, slots_per_rank, top_k,
                 ELEM_BYTES: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """rows[r] = owner's token buffer[token(r)], zeros where row_source[r] = -1."""
    if ALIGNED:
        # cols is a whole number of 16-byte vectors (host-checked); rewritten so that Triton sees it too
        # and keeps the column mask uniform over each vector (else it falls back to 2-byte accesses)
        cols = cols // (16 // ELEM_BYTES) * (16 // ELEM_BYTES)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < num_rows
    col_ok = (c < cols)[None, :]
    source = tl.load(row_source_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    valid = source >= 0
    source = tl.where(valid, source, 0)
    peer = peers.peer_rows(table_ptr, source, valid, slots_per_rank, cols, top_k,
                            True, ALIGNED, rows_ptr.dtype.element_ty)
    values = tl.load(peer[:, None] + c[None, :], mask=valid[:, None] & col_ok, other=0.0)
    tl.store(rows_ptr + rows.to(tl.int64)[:, None] * cols + c[None, :], values, mask=row_ok[:, None] & col_ok)


@triton.jit
def _push_kernel(table_ptr, row_source_ptr, rows_ptr, stride_rows, num_rows, cols, slots_per_rank,
                 ELEM_BYTES: tl.constexpr, ALIGNED: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """owner's slot buffer[local source(r)] = rows[r] for every row with a source; padding rows write nothing."""
    if ALIGNED:
        cols = cols // (16 // ELEM_BYTES) * (16 // ELEM_BYTES)  # as in _pull_kernel
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = (c < cols)[None, :]
    source = tl.load(row_source_ptr + rows, mask=rows < num_rows, other=-1).to(tl.int64)
    valid = source >= 0
    source = tl.where(valid, source, 0)
    mask = valid[:, None] & col_ok
    values = tl.load(rows_ptr + rows.to(tl.int64)[:, None] * stride_rows + c[None, :], mask=mask)
    peer = peers.peer_rows(table_ptr, source, valid, slots_per_rank, cols, 1,
                            False, ALIGNED, rows_ptr.dtype.element_ty)
    tl.store(peer[:, None] + c[None, :], values, mask=mask)


# ----------------------------------------------------------------------------------------
# Launchers: the data movement alone, on any pointer table (tests use local tensors as ranks)
# ----------------------------------------------------------------------------------------

def _blocks(cols: int) -> tuple[int, int]:
    block_c = min(MAX_BLOCK_C, triton.next_power_of_2(max(cols, 1)))
    block_r = max(16, min(MAX_BLOCK_R, BLOCK_ELEMENTS // block_c))
    return block_r, block_c


def vector_aligned(addresses, cols: int, element_size: int) -> bool:
    """Whether 16-byte accesses are safe on buffers [*, cols] at these base addresses."""
    return (cols * element_size) % 16 == 0 and all(int(a) % 16 == 0 for a in addresses)


def pull_rows(table: torch.Tensor, row_source: torch.Tensor, num_tokens: int, top_k: int, cols: int,
              dtype: torch.dtype, *, aligned: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [R, cols]: row r = token row token(r) of rank owner(r)'s buffer [num_tokens, cols] at
    table[owner] (zeros where row_source is -1). One launch; the buffers must be stable meanwhile.
    out: a contiguous [R, cols] buffer of `dtype` to pull into (a ring reused across calls)."""
    row_source = row_source.contiguous()
    num_rows = row_source.shape[0]
    if out is not None and (tuple(out.shape) != (num_rows, cols) or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"pull_rows: out must be a contiguous [{num_rows}, {cols}] {dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    rows = common.empty((num_rows, cols), dtype, row_source.device) if out is None else out
    block_r, block_c = _blocks(cols)
    grid = (common.cdiv(num_rows, block_r), common.cdiv(cols, block_c))
    if num_rows and cols:
        _pull_kernel[grid](table, row_source, rows, num_rows, cols, num_tokens * top_k, top_k,
                           ELEM_BYTES=rows.element_size(), ALIGNED=aligned,
                           BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return rows


def push_rows(table: torch.Tensor, rows: torch.Tensor, row_source: torch.Tensor, num_slots: int, *,
              aligned: bool) -> None:
    """Write row r into slot (row_source[r] % num_slots) of rank owner(r)'s slot buffer
    [num_slots, cols] at table[owner]; rows with source -1 write nothing. One launch."""
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    row_source = row_source.contiguous()
    num_rows, cols = rows.shape
    block_r, block_c = _blocks(cols)
    grid = (common.cdiv(num_rows, block_r), common.cdiv(cols, block_c))
    if num_rows and cols:
        _push_kernel[grid](table, row_source, rows, rows.stride(0), num_rows, cols, num_slots,
                           ELEM_BYTES=rows.element_size(), ALIGNED=aligned,
                           BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)


# ----------------------------------------------------------------------------------------
# The transport
# ----------------------------------------------------------------------------------------

class _PeerBuffer:
    """One symmetric buffer: this rank's tensor, its handle, and the peers' base addresses."""

    def __init__(self, shape, dtype, device, group, rank):
        from torch.distributed import _symmetric_memory as symm_mem

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.local = symm_mem.empty(shape, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.local, group)
        if getattr(self.handle, "multicast_ptr", 0):
            # torch's barrier would then take its multimem path
            raise RuntimeError("serval: symmetric memory came with an NVLink multicast mapping; serval never "
                               "uses multicast: set TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before the first allocation")
        if not hasattr(self.handle, "barrier"):
            raise RuntimeError("serval: this torch's symmetric memory handle has no barrier(channel, timeout_ms)")
        # buffer_ptrs are the peers' allocation bases (mapped here); torch's memory pool may place a tensor
        # at an offset inside its allocation, and nothing forces that offset to match across ranks, so
        # every rank tells the others its own (one small collective, at allocation only).
        bases = list(self.handle.buffer_ptrs)
        offset = torch.tensor([self.local.data_ptr() - bases[rank]], dtype=torch.int64, device=device)
        offsets = torch.empty(len(bases), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(offsets, offset, group=group)
        self.addresses = [base + off for base, off in zip(bases, offsets.tolist())]
        assert self.addresses[rank] == self.local.data_ptr()
        self.table = torch.tensor(self.addresses, dtype=torch.int64, device=device)
        self.aligned = vector_aligned(self.addresses, shape[1], self.local.element_size())


class SymmetricMemoryTransport:
    """`Transport` over torch symmetric memory (CUDA). See the module docstring.

    group: the EP process group (None: the default group); num_tokens (N) and top_k (k) per rank;
    timeout_ms bounds every barrier wait; channel picks the signal-pad slots the barriers use (give
    transports that may run concurrently on different streams different channels).
    """

    def __init__(self, group, num_tokens: int, top_k: int, device, *, timeout_ms: int = DEFAULT_TIMEOUT_MS,
                 channel: int = 0):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"SymmetricMemoryTransport needs a CUDA device, got {device}")
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive: every barrier wait is bounded")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.num_tokens = int(num_tokens)
        self.top_k = int(top_k)
        self.timeout_ms = int(timeout_ms)
        self.channel = int(channel)
        self._buffers: dict[tuple, _PeerBuffer] = {}

    # -- buffers and barriers ------------------------------------------------------------

    def _buffer(self, role: str, rows: int, cols: int, dtype: torch.dtype) -> _PeerBuffer:
        """The (role, shape, dtype) buffer, allocated collectively on first use: every rank must make
        the same sequence of first calls (they do: the layer runs the same stages everywhere)."""
        key = (role, rows, cols, dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"serval: the {role} buffer [{rows}, {cols}] {dtype} is first needed inside CUDA "
                                   "graph capture; run the layer once before capturing")
            buffer = _PeerBuffer((rows, cols), dtype, self.device, self.group, self.rank)
            self._buffers[key] = buffer
        return buffer

    def _barrier(self, buffer: _PeerBuffer) -> None:
        """Every rank's work queued before this point (on its current stream) is done and visible to
        work queued after it on any rank. Bounded by timeout_ms (a timeout traps: see module docstring)."""
        if self.world_size > 1:
            buffer.handle.barrier(channel=self.channel, timeout_ms=self.timeout_ms)

    # -- the Transport interface -----------------------------------------------------------

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[P * M, ...]: every rank's `t` [M, ...] (the same M everywhere), concatenated in rank order. Over
        symmetric memory (a copy into this rank's buffer, a barrier, one pull of every rank's rows, a barrier),
        so no host sync whatever the group's backend (a gloo group's all_gather syncs on CUDA tensors)."""
        flat = t.detach().reshape(t.shape[0], -1) if t.dim() > 1 else t.detach().reshape(-1, 1)
        rows, cols = flat.shape
        buffer = self._buffer("gather", rows, cols, flat.dtype)
        buffer.local.copy_(flat)
        self._barrier(buffer)  # every rank's rows are in place
        every_row = torch.arange(self.world_size * rows, device=self.device, dtype=torch.int32)
        out = pull_rows(buffer.table, every_row, rows, 1, cols, flat.dtype, aligned=buffer.aligned)
        self._barrier(buffer)  # every reader is done: the next gather may overwrite the buffers
        return out.view(self.world_size * t.shape[0], *t.shape[1:])

    def pull(self, tokens: torch.Tensor, row_source: torch.Tensor) -> torch.Tensor:
        """tokens [N, C] -> rows [R, C]: rows[r] = owner(r)'s tokens[token(r)]; zeros where row_source is -1."""
        row_source = row_source.to(self.device)
        return self.pull_into(lambda source: pull_rows(source.table, row_source, source.num_tokens, source.top_k,
                                                       source.cols, source.dtype, aligned=source.aligned), tokens)

    def pull_into(self, consume, tokens: torch.Tensor, *, role: str = "tokens"):
        """See `serval.transport.Transport.pull_into`: consume(PeerTokens) runs between the two barriers."""
        num_tokens, cols = tokens.shape
        if num_tokens != self.num_tokens:
            raise ValueError(f"pull: tokens has {num_tokens} rows, the transport was built for N = {self.num_tokens}")
        buffer = self._buffer(role, num_tokens, cols, tokens.dtype)
        buffer.local.copy_(tokens.detach())
        self._barrier(buffer)  # every owner's tokens are in place
        result = consume(PeerTokens(buffer.table, num_tokens, self.top_k, cols, tokens.dtype, buffer.aligned))
        self._barrier(buffer)  # every reader is done: the next pull may overwrite the buffers
        return result

    def push(self, rows: torch.Tensor, row_source: torch.Tensor, *, complete: bool = False,
             copy: bool = True) -> torch.Tensor:
        """rows [R, C] -> slots [N * k, C]: rows go to the owners' slots (token * k + slot); returns this
        rank's slots once every peer's rows have landed (a slot no row wrote is zero).

        complete=True: the caller knows every slot of every rank is written (a full schedule, as the
        layer's always is), so the zero fill is skipped. copy=False returns the slot buffer itself,
        valid until the next push of the same [C, dtype] on this transport (a new copy otherwise).
        """
        num_rows, cols = rows.shape
        if row_source.shape[0] != num_rows:
            raise ValueError(f"push: {num_rows} rows but {row_source.shape[0]} row sources")
        if not complete:
            self._buffer("slots", self.num_tokens * self.top_k, cols, rows.dtype).local.zero_()
        rows, row_source = rows.detach(), row_source.to(self.device)
        slots = self.push_from(lambda target: push_rows(target.table, rows, row_source, target.num_slots,
                                                        aligned=target.aligned), cols, rows.dtype)
        return slots.clone() if copy else slots

    def read_rows(self, source: PeerTokens, row_source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """See `serval.transport.Transport.read_rows` (the pull kernel)."""
        return pull_rows(source.table, row_source, source.num_tokens, source.top_k, source.cols, source.dtype,
                         aligned=source.aligned, out=out)

    def write_rows(self, rows: torch.Tensor, row_source: torch.Tensor, target: PeerSlots) -> None:
        """See `serval.transport.Transport.write_rows` (the push kernel)."""
        push_rows(target.table, rows, row_source, target.num_slots, aligned=target.aligned)

    def push_from(self, write, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """See `serval.transport.Transport.push_from`: write(PeerSlots) runs between the two barriers."""
        num_slots = self.num_tokens * self.top_k
        buffer = self._buffer("slots", num_slots, cols, dtype)
        # every owner has finished reading the previous push's slots (and zeroed them: stream order)
        self._barrier(buffer)
        write(PeerSlots(buffer.table, num_slots, cols, dtype, buffer.aligned))
        self._barrier(buffer)  # every peer's rows have landed in our slots
        return buffer.local
