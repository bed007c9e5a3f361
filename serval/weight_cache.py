"""The routed experts' weights in an FP8 precision's form, made once per version of the weights.

An FP8 precision's GEMMs read the expert weights quantized (`serval.precision.ExpertWeights`). Quantizing them in
every call costs a pass over E * I * H per weight, which gradient accumulation repeats for every micro-batch of an
optimizer step. `serval.moe` therefore keeps the quantized form of the weights it was last called with, keyed by
where the weights live (storage, offset, shape, strides, dtype) and validated by their autograd version counters:
an optimizer step updates a parameter in place, which bumps its version (views share it: the halves of a joined
gate/up weight, a DTensor's local shard), so the next call quantizes again. A stale copy is never read. One entry per
set of weights, replaced when the weights change, dropped when their storage is freed.

What the version counter cannot see: writes through `.data` (`p.data.copy_(...)`: a tensor that shares the storage
but not the version counter). Code that updates weights that way passes `expert_weights=` itself
(`serval.quantize_expert_weights`), or calls `clear()`.
Not used while torch.compile traces (Python state the graph cannot hold) nor while a CUDA graph is captured (a
quantization captured into the graph replays, and must write the graph's own buffers): those calls quantize in the
call, as before.
"""

from __future__ import annotations

import weakref

import torch

from . import precision

_Key = tuple
_ENTRIES: dict[_Key, tuple[tuple[int, ...], list[weakref.ref], precision.ExpertWeights]] = {}


def _place(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def usable() -> bool:
    """Whether this call may read and fill the cache (not while torch.compile traces or a CUDA graph is
    captured)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def expert_weights(recipe: precision.Recipe, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> precision.ExpertWeights:
    """`precision.expert_weights(recipe, w_gate, w_up, w_down)` of the weights as they are now: the cached copy if
    these weights have not changed since it was made, else made now (and kept in place of the old one)."""
    weights = (w_gate, w_up, w_down)
    key = (recipe.name, *(_place(w) for w in weights))
    versions = tuple(w._version for w in weights)
    entry = _ENTRIES.get(key)
    if entry is not None and entry[0] == versions and all(ref() is not None for ref in entry[1]):
        return entry[2]
    _ENTRIES.pop(key, None)  # the old copy goes before the new one is made (peak memory)
    _drop_freed()
    with torch.no_grad():
        made = precision.expert_weights(recipe, *(w.detach() for w in weights))
    _ENTRIES[key] = (versions, [weakref.ref(w.untyped_storage()) for w in weights], made)
    return made


def _drop_freed() -> None:
    for key in [key for key, (_, refs, _) in _ENTRIES.items() if any(ref() is None for ref in refs)]:
        del _ENTRIES[key]


def clear() -> None:
    """Forget every cached copy (after updating expert weights in a way their version counters do not see)."""
    _ENTRIES.clear()
