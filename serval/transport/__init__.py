"""Moving rows between the ranks of an expert-parallel group: the transport interface.

Every movement of the MoE layer is one of two primitives over the schedule's
`row_source` (global sources, ``source = (rank * N + token) * k + slot``; -1 = padding):

* ``pull(tokens [N, C], row_source [R]) -> rows [R, C]``: each rank reads, for each of
  its rows, the source token's row from the owner's buffer (zeros on padding rows).
  Forward dispatch pulls x; backward reverse-combine pulls d_y.
* ``push(rows [R, C], row_source [R]) -> slots [N * k, C]``: each rank writes each of its
  rows into the owner's slot ``token * k + slot``; the call returns this rank's own slots
  once every peer's writes have landed. Forward combine pushes expert outputs (the
  owner then sums its k slots in slot order); backward reverse-dispatch pushes d_x rows
  and d_router_weights.
* ``pull_into(consume, tokens) -> consume's result``: the same exchange for a consumer that reads the
  rows from the owners' buffers itself: ``consume(PeerTokens)`` runs between the two barriers of a pull.
  The gate/up GEMM takes it as `pull_from` (`serval.kernels.in_gemm_pull`).
* ``push_from(write, cols, dtype) -> slots``: the same exchange for a producer that writes its rows
  into the owners' slots itself: ``write(PeerSlots)`` gets the table of every rank's slot buffer
  address, between the two barriers of a push. The Triton GEMMs that make the expert outputs and
  the d_x rows take it as `push_to` and store each row to its owner's slot from their epilogue
  (`serval.kernels.triton_gemm`, PUSH), so those rows never pass through memory in between.

A slot is written by exactly one row of one rank, so pushes never collide and need no
atomics; the owner's fixed-order sum over its slots keeps results bitwise identical.

Implementations: `cpu.SharedMemoryTransport` (gloo groups: peer buffers are files in
/dev/shm mapped by every rank, barriers are gloo barriers) and `symm.SymmetricMemoryTransport`
(CUDA: torch symmetric memory, Triton kernels on peer pointers, signal-pad barriers with
bounded waits; no NVLink multicast).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..peers import PeerSlots, PeerTokens

__all__ = ["PeerSlots", "PeerTokens", "Transport", "split_source"]


class Transport(Protocol):
    """One per (process group, workspace): knows N (tokens per rank) and k; owns the peer buffers,
    allocated collectively on first use for each (role, shape, dtype) and reused afterwards."""

    rank: int
    world_size: int
    num_tokens: int
    top_k: int

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[P * N, ...]: every rank's `t` [N, ...], concatenated in rank order."""

    def pull(self, tokens: torch.Tensor, row_source: torch.Tensor) -> torch.Tensor:
        """tokens [N, C] -> rows [R, C]: rows[r] = owner(r)'s tokens[token(r)]; zeros where row_source is -1."""

    def push(self, rows: torch.Tensor, row_source: torch.Tensor, *, complete: bool = False,
             copy: bool = True) -> torch.Tensor:
        """rows [R, C] -> slots [N * k, C]: rows go to the owners' slots (token * k + slot); returns this
        rank's slots once every peer's rows have landed (a slot no row wrote is zero).

        complete=True: the group's rows write every slot of every rank (the layer's schedule does), so the
        zero fill is skipped. copy=False: the transport's slot buffer itself, valid until the next push of
        the same [C, dtype] (every rank's next push starts with a barrier that waits for work queued before
        it, so a consumer queued first is safe)."""

    def pull_into(self, consume: Callable[[PeerTokens], object], tokens: torch.Tensor, *, role: str = "tokens"):
        """pull for a consumer that reads the rows itself: once every owner's tokens [N, C] are in its
        buffer, returns consume(PeerTokens); the buffers stay untouched until every rank's consumer is done.
        role: which token buffers: two pulls of the same shape that are open at once (one consumer inside the
        other's) need different roles."""

    def read_rows(self, source: PeerTokens, row_source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Inside `pull_into`'s consume: the rows row_source [R] names, read from the owners' token buffers
        (`source`) into `out` [R, C] (a slice of the macrobatch ring); returns out."""

    def write_rows(self, rows: torch.Tensor, row_source: torch.Tensor, target: PeerSlots) -> None:
        """Inside `push_from`'s write: rows [R, C] written into their owners' slots (`target`); rows whose
        source is -1 write nothing."""

    def push_from(self, write: Callable[[PeerSlots], None], cols: int, dtype: torch.dtype) -> torch.Tensor:
        """push(complete=True, copy=False) for a producer that writes the rows itself: once every owner is
        done with its slots, write(PeerSlots) writes every (token, slot) of the group exactly once, into
        the owners' slot buffers; returns this rank's slots once every peer's writes have landed."""


def split_source(row_source: torch.Tensor, num_tokens: int, top_k: int):
    """(owner rank, local token, slot, local source = token * k + slot) of each row; -1 rows give owner -1."""
    source = row_source.to(torch.int64)
    valid = source >= 0
    source = source.clamp(min=0)
    owner = torch.where(valid, source // (num_tokens * top_k), -1)
    local_source = source % (num_tokens * top_k)
    return owner, local_source // top_k, local_source % top_k, local_source
