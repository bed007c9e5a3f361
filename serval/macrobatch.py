"""The macrobatch ring: an expert-parallel pass's routed experts streamed through a fixed buffer, window by window.

At expert parallelism a rank computes every routed row the group sends to its experts, however skewed the
routing: its schedule holds the worst case (`Workspace.capacity_rows`: every routed row of the group), and
its rows go through the kernels in windows of `Workspace.ring_rows` rows (`Config.macrobatch_size`,
`serval.schedule.windows`), in row order. A window pulls its rows from their owners into one ring buffer,
runs the expert GEMMs on them and pushes its outputs into the owners' slots, all inside one pull phase and
one push phase of the transport. A window past the used rows has no tiles, so its launches exit at once:
the host launches the fixed worst-case number of windows and never syncs.

Results are those of one pass over all the rows, bit for bit: each window's tiles are the same tiles, and
the weight gradients carry each expert's fp32 K sums from one window to the next, in ascending row order
(`serval.kernels.weight_grad.WgradWindow`; two carry buffers, used in turn).

Memory: the [ring_rows, *] buffers of one window, the weight gradients' carries (fp32, two [2I, H] and two
[H, I]) and, kept from the forward for the backward, the first window's gate/up pre-activations (every row
under a routing that fits the ring); the backward recomputes the other windows' from re-pulled x rows.

mxfp8 (`recipe`) streams the same way: its GEMMs are the BF16 ones on operands quantized and dequantized along
each GEMM's K (rows: window-local) and its weight gradients' along-tokens blocks lie whole in a window (windows
start on block_m boundaries, a multiple of the block), so each window's quantizations are those of one pass over
all the rows; the forward keeps the first window's `precision.Kept` (gate/up and h quantized), the backward
recomputes the others'. fp8_blockwise's FP8 weight gradients take no windows: it takes every row at once.

Runs on the kernel stages (`serval.kernels.KernelStages`); `serval.functional` calls it.
"""

from __future__ import annotations

import torch

from . import precision, stages
from .ops import dequantize
from .peers import PeerTokens
from .schedule import Schedule, Window, slot_schedule, windows


def streams(ops, recipe, workspace) -> bool:
    """Whether a pass streams its routed rows through the ring: at EP, in bf16 or mxfp8 (BF16 GEMMs), on stages
    whose weight gradients take windows, when the ring holds fewer rows than the worst case."""
    return ((recipe is None or not recipe.fp8_gemm) and workspace is not None and workspace.transport is not None
            and getattr(ops, "takes_windows", False) and workspace.ring_rows < workspace.capacity_rows)


def _fuses(ops, recipe, inter: int, backward: bool) -> bool:
    return (ops.fuses_backward if backward else ops.fuses_forward) and precision.fuses(recipe, inter, backward)


def _pull(source: PeerTokens, row_source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The rows row_source names, from the owners' token buffers, into `out` (a slice of the ring)."""
    from .transport.symm import pull_rows  # the Triton pull kernel (the interpreter's too, on CPU tables)

    return pull_rows(source.table, row_source, source.num_tokens, source.top_k, source.cols, source.dtype,
                     aligned=source.aligned, out=out)


def _ring(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows, cols, dtype=like.dtype, device=like.device)


def forward(ops, x, w_gate, w_up, w_down, schedule: Schedule, swiglu_limit, workspace, shared=None, recipe=None):
    """The routed experts of a forward at EP, streamed.

    x [N, H]; w_gate, w_up [E_local, I, H]; w_down [E_local, H, I] (mxfp8: as its forward GEMMs read them,
    `precision.dequantized_weights`); schedule: the rank's (worst-case capacity). shared: on stages that fuse
    the forward (`gate_up_down`), the shared expert's (x, weights, dense schedule), whose tiles join the first
    window's launch. recipe: None (bf16) or mxfp8's. Returns (what the first window keeps: bf16 its gate_up
    [window 0's num_packed, 2I], mxfp8 its `precision.Kept`; this rank's slots [N*k, H] of o once every rank has
    pushed, their slot schedule, the shared expert's outputs from the first launch or None)."""
    transport = workspace.transport
    parts = windows(schedule, workspace.ring_rows)
    x_ring = _ring(parts[0].schedule.capacity, x.shape[1], x)
    first, shared_out = [], [None]
    fused = _fuses(ops, recipe, w_gate.shape[1], backward=False)
    quant_block = 0 if recipe is None else recipe.block

    def write(target):
        def consume(source):
            for window in parts:
                s = window.schedule
                if fused:  # pull (mxfp8: round-tripped by the pull programs), both GEMMs and push in one launch
                    gate_up, h, _, made = ops.gate_up_down(x, w_gate, w_up, w_down, s, swiglu_limit,
                                                           pull_from=source, pull_flags=workspace.pull_flags,
                                                           push_to=target, shared=None if first else shared,
                                                           quant_block=quant_block)
                    if not first:
                        shared_out[0] = made
                else:
                    if ops.pulls_in_gemm and recipe is None:
                        gate_up, h = ops.gate_up_swiglu(x, w_gate, w_up, s, swiglu_limit, pull_from=source,
                                                        pull_flags=workspace.pull_flags)
                    else:
                        x_rows = _pull(source, s.row_source, x_ring[: s.capacity])
                        a_rows = x_rows if recipe is None else recipe.rows(x_rows)[1]
                        gate_up, h = ops.gate_up_swiglu(x, w_gate, w_up, s, swiglu_limit, a_rows=a_rows)
                    ops.down(h if recipe is None else recipe.rows(h)[1], w_down, s, push_to=target)
                if not first:
                    first.append(gate_up if recipe is None else precision.keep(recipe, gate_up, h))
        transport.pull_into(consume, x)

    slots = transport.push_from(write, w_down.shape[1], x.dtype)
    return first[0], slots, slot_schedule(transport.num_tokens, transport.top_k, slots.device), shared_out[0]


def _carry(window: Window, index: int, carries: torch.Tensor, outs: tuple[torch.Tensor, ...]):
    """The weight gradient's window arguments: window `index` reads carry index % 2 and writes the other."""
    from .kernels.weight_grad import WgradWindow

    return WgradWindow(window.expert_phase, carries[index % 2], carries[(index + 1) % 2], outs)


def backward(ops, d_y, x, row_router_weights, schedule: Schedule, gate_up_first, w_gate, w_up, w_down,
             swiglu_limit, workspace, weight_grads: bool, shared=None, recipe=None, gemm_weights=None):
    """The routed experts of a backward at EP, streamed (the forward's windows, in the same order).

    d_y, x [N, H]; row_router_weights: the group's [P*N, k]; gate_up_first: what the forward's first window kept
    (bf16 its pre-activations, mxfp8 its `precision.Kept`), or None (recomputed, as every later window's are).
    shared: on stages that fuse the backward, the shared expert's (d_y, weights, dense schedule, gate_up), whose
    dgrads join the first window's launch. recipe: None (bf16) or mxfp8's, whose GEMMs read gemm_weights =
    (gate_w, up_w forward; down_t, gate_t, up_t dgrads) (`precision.dequantized_weights`). Returns (this rank's slots [N*k, H] of d_x once every rank has pushed, their slot
    schedule, d_rw_rows fp32 [capacity], d_w_gate, d_w_up, d_w_down, the shared expert's dgrads from the first
    launch or None; the weight gradients None without weight_grads)."""
    transport = workspace.transport
    parts = windows(schedule, workspace.ring_rows)
    num_experts, inter, hidden = w_gate.shape
    fused = _fuses(ops, recipe, inter, backward=True)
    gate_w, up_w, down_t, gate_t, up_t = gemm_weights if recipe is not None else (w_gate, w_up, w_down, w_gate, w_up)
    ring_rows = parts[0].schedule.capacity
    x_ring, d_y_ring = _ring(ring_rows, hidden, x), _ring(ring_rows, hidden, d_y)
    d_rw_rows = torch.empty(schedule.capacity, dtype=torch.float32, device=x.device)
    d_w_gate = d_w_up = d_w_down = None
    shared_out = [None]
    if weight_grads:
        d_w_gate, d_w_up = (torch.empty(num_experts, inter, hidden, dtype=x.dtype, device=x.device) for _ in "gu")
        d_w_down = torch.empty(num_experts, hidden, inter, dtype=x.dtype, device=x.device)
        carry_gate_up = torch.empty(2, 2 * inter, hidden, dtype=torch.float32, device=x.device)
        carry_down = torch.empty(2, hidden, inter, dtype=torch.float32, device=x.device)

    def step(index: int, window: Window, d_y_source: PeerTokens, x_source: PeerTokens, target):
        s = window.schedule
        x_rows = _pull(x_source, s.row_source, x_ring[: s.capacity])
        kept = gate_up_first if index == 0 else None
        if kept is None:  # recomputed from the re-pulled rows (mxfp8: as the forward quantized them)
            gate_up, h = ops.gate_up_swiglu(x, gate_w, up_w, s, swiglu_limit,
                                            a_rows=x_rows if recipe is None else recipe.rows(x_rows)[1])
            kept = gate_up if recipe is None else precision.keep(recipe, gate_up, h)
        gate_up = kept if recipe is None else dequantize(kept.gate_up, x.dtype)
        d_y_rows = d_y_ring[: s.capacity]
        pull = dict(pull_from=d_y_source, pull_flags=workspace.pull_flags)
        if fused:  # pull of d_y (mxfp8: round-tripped by the pull programs), both dgrads and push of d_x in one launch
            d_gate_up, h_weighted, d_rw, _, made = ops.down_dgrad_gate_up_dgrad(
                d_y_rows, down_t, gate_t, up_t, gate_up, row_router_weights, s, swiglu_limit, push_to=target,
                shared=None if index else shared, quant_block=0 if recipe is None else recipe.block, **pull)
            if index == 0:
                shared_out[0] = made
        else:
            if not ops.pulls_in_dgrad or recipe is not None:
                _pull(d_y_source, s.row_source, d_y_rows)
                pull = {}
            d_gate_up, h_weighted, d_rw = ops.down_dgrad_swiglu(
                d_y_rows if recipe is None else recipe.rows(d_y_rows)[1], down_t, gate_up, row_router_weights, s,
                swiglu_limit, **pull)
            ops.gate_up_dgrad(d_gate_up if recipe is None else recipe.rows(d_gate_up)[1], gate_t, up_t, s,
                              push_to=target)
        d_rw_rows[window.start: window.start + s.capacity] = d_rw
        if weight_grads:
            down_window = _carry(window, index, carry_down, (d_w_down,))
            gate_up_window = _carry(window, index, carry_gate_up, (d_w_gate, d_w_up))
            if recipe is None:
                ops.down_weight_grad(d_y_rows, h_weighted, s, window=down_window)
                ops.gate_up_weight_grad(d_gate_up, x, s, x_rows=x_rows, window=gate_up_window)
            else:  # the operands quantized along tokens, window by window
                precision.expert_weight_grads(ops, recipe, d_y, d_y_rows, x, x_rows, d_gate_up, kept,
                                              stages.row_weights(row_router_weights, s).float(), s, inter,
                                              windows=(down_window, gate_up_window))

    def write(target):
        def with_d_y(d_y_source):
            def with_x(x_source):
                for index, window in enumerate(parts):
                    step(index, window, d_y_source, x_source, target)
            transport.pull_into(with_x, x, role="x")  # x and d_y are published at once: two token buffers
        transport.pull_into(with_d_y, d_y)

    slots = transport.push_from(write, hidden, d_y.dtype)
    return (slots, slot_schedule(transport.num_tokens, transport.top_k, slots.device), d_rw_rows,
            d_w_gate, d_w_up, d_w_down, shared_out[0])
