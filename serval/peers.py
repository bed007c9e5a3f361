"""Peer-row addressing: where a row of another rank's token or slot buffer lives.

The transports (`serval.transport`) own the peer buffers and hand their addresses to whatever moves rows
over them: their own copy kernels, and the GEMMs that pull their A rows or push their output rows
themselves (`serval.kernels`). Both sides use this leaf module, so neither imports the other.

A table is an int64 tensor with one base address per rank, on the rows' device. A row's global source is
``(owner * N + token) * k + slot = owner * slots_per_rank + local source`` (`serval.schedule`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class PeerTokens(NamedTuple):
    """Where a consumer of `Transport.pull_into` reads: token t of rank p's token buffer
    [num_tokens, cols] (dtype) starts at address table[p] + t * cols * itemsize; aligned as in PeerSlots."""

    table: torch.Tensor
    num_tokens: int
    top_k: int
    cols: int
    dtype: torch.dtype
    aligned: bool


class PeerSlots(NamedTuple):
    """Where a producer of `Transport.push_from` writes: slot s of rank p's slot buffer [num_slots, cols]
    (dtype) starts at address table[p] + s * cols * itemsize.
    aligned: every base and the row pitch are 16-byte aligned (vector stores are safe)."""

    table: torch.Tensor
    num_slots: int
    cols: int
    dtype: torch.dtype
    aligned: bool


def push_keywords(target: PeerSlots | None) -> dict:
    """The push_to keyword of a stage GEMM that writes its rows into the owners' slots (`target`), none where it
    stores them (the torch stages take no push_to)."""
    return {} if target is None else {"push_to": target}


@triton.jit
def peer_rows(table_ptr, source, valid, slots_per_rank, row_elements, top_k,
              BY_TOKEN: tl.constexpr, ALIGNED: tl.constexpr, DTYPE: tl.constexpr):
    """Typed pointer to the start of each row's peer row: the owner's token row (BY_TOKEN: a [N, C] token
    buffer) or slot row (a [N * k, C] slot buffer). Rows with `valid` False read address 0 (the caller
    masks them off)."""
    owner = source // slots_per_rank
    local = source % slots_per_rank
    if BY_TOKEN:
        local = local // top_k
    base = tl.load(table_ptr + owner, mask=valid, other=0).to(tl.pointer_type(DTYPE))
    pointer = base + local * row_elements
    if ALIGNED:
        # loaded addresses carry no alignment facts; this one lets Triton emit 16-byte vector accesses
        # (the host checked every base and the row pitch)
        pointer = tl.multiple_of(pointer, 16)
    return pointer
