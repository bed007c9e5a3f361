"""
Benchmark MoE layer implementations side by side on one GPU (EP=1).

Implementations (same inputs, same function, gradients by autograd):
  serval            serval.moe with serval.Config(): on the GPU its kernels, each GEMM stage as the
                    serval.plan.KernelPlan that serval.plan.choose_plan picks for the shape and the GPU says;
                    on the CPU its torch-op stages
  serval PRECISION  serval.moe with Config(precision=PRECISION), for each FP8 precision in --precisions (recorded as
                    impl "serval" with that "precision"; timed when within 0.1 of the bf16 reference); with
                    --fp8-weights both also as impl "serval (weights once per step)": the expert weights quantized
                    once (serval.quantize_expert_weights) and passed in, as gradient accumulation does per step
  serval (NAME)     serval.moe with the Config of --variant "NAME: ..." (below); on the CPU, "backend=triton"
                    runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, set when there is no GPU)
  torch_grouped_mm  plain PyTorch: sort, gather, torch._grouped_mm, SiLU*up, _grouped_mm, fixed-order combine
  hf_loop           the per-expert Python loop most model code uses (index_add_, syncs)
  sonicmoe          SonicMoE 0.1.2.post1 (Dao AI Lab), moe_general_routing_inputs with our ids and weights
  torch_fp8_rowwise torchao's fp8 rowwise MoE training recipe (our code), FP8 MoE training as torch users have it:
                    torch_grouped_mm with fwd + dgrad in torch._scaled_grouped_mm (row-scaled e4m3), wgrad in bf16
  cublas_blockwise  serval's fp8_blockwise numerics (DeepSeek-V3: 1x128 activations, 128x128 weights) from cuBLAS:
                    torch_grouped_mm with F.scaled_mm per expert for all three GEMMs (a loop, a host sync per layer)
  (the FP8 baselines: CUDA only; recorded with precision fp8_rowwise / fp8_blockwise, timed when within 0.1)

Examples:
  python benchmarks/bench_layer.py --tiny --impls serval,torch_grouped_mm,hf_loop   # CPU smoke test, seconds
  python benchmarks/bench_layer.py --impls serval,torch_grouped_mm,hf_loop --plot
  python benchmarks/bench_layer.py --shapes kimi-k2 --impls serval --variant "triton dgrad: down_dgrad_engine=triton"
  source benchmarks/install_sonicmoe.sh && python benchmarks/bench_layer.py --shapes kimi-k2,qwen3-30b-a3b \
      --impls serval,sonicmoe,torch_grouped_mm                                    # all side by side
  python benchmarks/bench_layer.py --impls serval,torch_grouped_mm,torch_fp8_rowwise,cublas_blockwise \
      --precisions bf16,mxfp8,fp8_blockwise                                       # the FP8 layers side by side
SonicMoE's first call on each shape compiles and autotunes its GEMMs (minutes per shape, so a 10-minute
device call takes two or three shapes with it); --sonic-configs caps its autotuning (default 3 configs per GEMM).

Variants (--variant, repeatable): "NAME: FIELD=VALUE; FIELD=VALUE; ...", VALUE a Python literal or a bare word.
FIELD names a field of serval.plan.KernelPlan, set (dataclasses.replace) in the plan that choose_plan picks for
the shape (FIELD.SUB reaches into one of its TileConfig / GluonConfig values: gate_up_tiles.num_stages=4), or a
field of serval.Config (block_m=64, recompute=True). E.g. "triton dgrad: down_dgrad_engine=triton". A plan
changes speed, never results.

Inputs: the shapes of docs/CONTRACT.md (benchmarks/shapes.py), bf16 tokens and weights (weights scaled by
fan_in^-1/2), fp32 router weights (softmax), balanced routing (every expert N*k/E rows +-1, every token k
distinct experts), seeded. Scope "routed": the routed experts; "layer": plus the shared expert (Is = I).

Correctness first: each implementation's y (pass fwd) or y, d_x, d_router_weights and d_w_gate (fwdbwd) are
compared with torch_grouped_mm's (relative error ||a-b||/||b||; this first call also compiles and autotunes);
above --tol (FP8: max(--tol, 0.1)) it is not timed (ms None, error "mismatch").

Timing protocol (CUDA), per (implementation, pass): --warmup calls, then about --soak seconds (default 2) of
back-to-back calls, then --iters timed calls (CUDA events around each, no sync in between); ms is their median,
host_ms the median host time to enqueue one call onto an idle GPU (perf_counter around it; 5 calls before the
soak, each after a sync). Where host_ms reaches 0.9 x ms the host cannot keep the GPU busy and the GPU waits
between calls: the line is marked "host-bound", its ms is the host's pace more than the kernels'.
An H200 runs these GEMMs at its 700 W power cap, where the SM clock settles at 1410-1520 MHz instead of its
idle 1980 (BENCHMARKS.md, Method): timed without the soak, whichever implementation runs right after an idle
moment gets a faster GPU. The same protocol times a dense bf16 torch.matmul (8192^3), the ceiling of the table
and plot. On the CPU: --warmup calls, then the median of --iters calls (perf_counter), no soak.
"fwd" times the training forward (autograd on); "fwdbwd" times forward + torch.autograd.grad for x,
router_weights and every weight.

FLOPs as docs/CONTRACT.md counts them: forward = 6 * (N + N*k) * H * I for scope "layer" (the shared expert's N
rows, Is = I), 6 * N*k * H * I for "routed"; backward = 2 x forward, so "fwdbwd" counts 3 x forward.
TFLOP/s = FLOPs / ms.

Each record appended to --out: {shape, impl, precision, settings, scope, pass, ms, host_ms, tflops, saved_mem_gib,
peak_mem_gib, rel_err, rel_errs, error, soak_s, sm_clock_mhz, power_w, date, gpu, torch, triton}. settings: a
variant's settings (None otherwise); host_ms: CUDA only; rel_err: the largest of rel_errs. saved_mem_gib: memory the autograd graph holds after
one forward, minus y; peak_mem_gib: peak of one timed call above the memory allocated before it (CUDA only).
sm_clock_mhz, power_w: medians of nvidia-smi samples over the timed calls (None without nvidia-smi).
"""

import argparse
import ast
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Config(backend="triton") runs in the CPU interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's serval
from shapes import SHAPES, TINY_SHAPES  # noqa: E402

IMPLS = ["serval", "torch_grouped_mm", "hf_loop", "sonicmoe", "torch_fp8_rowwise", "cublas_blockwise"]
FP8_BASELINES = {"torch_fp8_rowwise": "fp8_rowwise", "cublas_blockwise": "fp8_blockwise"}  # impl: its precision
PRECISIONS = ["bf16", "mxfp8", "fp8_blockwise"]
E4M3_MAX = 448.0
FP8_TOL = 0.1  # an FP8 layer is timed when within this of the bf16 reference (MoK's acceptance: sum|diff|/sum|ref|)
SCOPES = ["routed", "layer"]
PASSES = ["fwd", "fwdbwd"]
GIB = 2**30

# -----------------------------------------------------------------------------
# inputs


def balanced_routing(N, E, k, gen, device):
    """topk_ids [N, k]: k distinct experts per token, every expert gets N*k/E rows (+-1).
    Row-major round robin over a random order of the tokens: the token at position i of the
    order gets experts (i*k + j) % E for slot j, so its k experts are distinct when k <= E."""
    order = torch.randperm(N, generator=gen, device=device)
    slots = torch.arange(N * k, device=device).view(N, k) % E
    ids = torch.empty(N, k, dtype=torch.int64, device=device)
    ids[order] = slots
    return ids


def make_inputs(shape, device, seed=0):
    H, I, E, k, N, _ = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *size, scale=1.0: (torch.randn(*size, generator=gen, device=device) * scale).to(torch.bfloat16)
    return dict(
        shape=shape,
        x=randn(N, H),
        router_weights=torch.randn(N, k, generator=gen, device=device).softmax(-1),
        topk_ids=balanced_routing(N, E, k, gen, device),
        w_gate=randn(E, I, H, scale=H**-0.5),
        w_up=randn(E, I, H, scale=H**-0.5),
        w_down=randn(E, H, I, scale=I**-0.5),
        ws_gate=randn(I, H, scale=H**-0.5),
        ws_up=randn(I, H, scale=H**-0.5),
        ws_down=randn(H, I, scale=I**-0.5),
        dy=randn(N, H),
    )


def make_params(inp, scope):
    """The differentiable tensors, fresh leaves, canonical layout; shared expert only for scope 'layer'."""
    names = ["x", "router_weights", "w_gate", "w_up", "w_down"]
    if scope == "layer":
        names += ["ws_gate", "ws_up", "ws_down"]
    return {n: inp[n].detach().clone().requires_grad_() for n in names}


def shared_of(p):
    return (p["ws_gate"], p["ws_up"], p["ws_down"]) if "ws_gate" in p else None


def shared_mlp(x, shared):
    ws_gate, ws_up, ws_down = shared
    return F.linear(F.silu(F.linear(x, ws_gate)) * F.linear(x, ws_up), ws_down)


def flops(shape, scope, pass_):
    """docs/CONTRACT.md's count: forward 6 * rows * H * I, rows = N*k routed (+ N shared-expert rows, Is = I, for
    scope "layer"): three GEMMs of 2 * H * I per row; backward 2 x forward, so fwdbwd 3 x forward."""
    H, I, E, k, N, _ = shape
    rows = N * k + (N if scope == "layer" else 0)
    forward = 6 * rows * H * I
    return forward + (2 * forward if pass_ == "fwdbwd" else 0)


# -----------------------------------------------------------------------------
# implementations: impl(p, topk_ids) -> y [N, H] bf16, p from make_params (or prepare_<impl>)


def routed_moe(p, topk_ids, recipe=None):
    """torch_grouped_mm's layer: sort the (token, slot) rows by expert, gather, gate/up GEMMs, SiLU*up, down GEMM,
    fixed-order combine. Each routed GEMM a @ w[e]^T (over expert e's rows) runs as torch._grouped_mm in bf16, or
    with an Fp8Recipe through Fp8GroupedLinear."""
    x, rw = p["x"], p["router_weights"]
    (N, k), E = topk_ids.shape, p["w_gate"].shape[0]
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)  # rows grouped by expert, token order inside
    experts = torch.arange(1, E + 1, device=x.device)
    offs = torch.searchsorted(sorted_ids, experts).to(torch.int32)  # row end of each expert (no sync, unlike bincount)
    if recipe is None:
        def gemm(a, w):
            return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    else:
        counts = offs.diff(prepend=offs.new_zeros(1)).tolist() if recipe.host_counts else None  # syncs

        def gemm(a, w):
            return Fp8GroupedLinear.apply(a, w, offs, counts, recipe)
    xs = x[order // k]
    gate = gemm(xs, p["w_gate"])
    up = gemm(xs, p["w_up"])
    out = gemm(F.silu(gate) * up, p["w_down"])
    # fixed-order combine: un-permute to [N, k, H], weight, sum over the k slots in fp32
    inv = torch.empty_like(order)
    inv[order] = torch.arange(N * k, device=order.device)
    y = (out[inv].view(N, k, -1).float() * rw.unsqueeze(-1)).sum(1)
    if shared_of(p):
        y = y + shared_mlp(x, shared_of(p)).float()
    return y.to(x.dtype)


def torch_grouped_mm(p, topk_ids):
    return routed_moe(p, topk_ids)


def torch_fp8_rowwise(p, topk_ids):
    """torch_grouped_mm with each routed GEMM an Fp8GroupedLinear of FP8_ROWWISE, what torchao's fp8 rowwise MoE
    training does (our own code): forward y = a @ w^T and dgrad d_a = d_y @ w in FP8, torch._scaled_grouped_mm
    (one fp32 scale per row of a / d_y and per output row of w / w^T, i.e. per row / per column of w); wgrad
    d_w = d_y^T a in bf16, torch._grouped_mm 2d x 2d (a kept in bf16). No host sync. Shared expert: bf16."""
    return routed_moe(p, topk_ids, FP8_ROWWISE)


def cublas_blockwise(p, topk_ids):
    """torch_grouped_mm with each routed GEMM an Fp8GroupedLinear of FP8_BLOCKWISE, the DeepSeek-V3 recipe through
    cuBLAS: one F.scaled_mm per expert for the forward, the dgrad (1x128 blocks of a / d_y, 128x128 of w / w^T)
    and the wgrad (1x128 blocks of d_y^T and a^T, along the expert's rows), all FP8, fp32 scales. The loop over
    experts needs their row counts on the host: one .tolist() sync per layer call, as a user's loop has. K and N
    multiples of 128, else ValueError (recorded as the impl's error). Shared expert: bf16."""
    return routed_moe(p, topk_ids, FP8_BLOCKWISE)


# FP8 baselines: plain torch, no serval. Scales fp32 = amax / 448 of the row or block, e4m3fn saturated at +-448.


class Fp8Recipe(NamedTuple):
    mm: Callable  # (a [R, K], w [E, N, K] any strides, offs, counts) -> a @ w[e]^T over each expert's rows, bf16
    wgrad: Callable  # (d_y [R, N], a [R, K], offs, counts) -> d_w [E, N, K], bf16
    host_counts: bool  # mm / wgrad need the experts' row counts on the host (`counts`: a .tolist() sync per layer)


class Fp8GroupedLinear(torch.autograd.Function):
    """y = a @ w[e]^T over expert e's rows of a (rows grouped by expert, offs: their ends), in FP8 by a recipe:
    forward recipe.mm(a, w); backward d_a = recipe.mm(d_y, w^T) (w^T's rows quantized: w's columns) and
    d_w = recipe.wgrad(d_y, a). Keeps a and w as given (bf16); each GEMM quantizes its own operands."""

    @staticmethod
    def forward(ctx, a, w, offs, counts, recipe):
        ctx.save_for_backward(a, w, offs)
        ctx.counts, ctx.recipe = counts, recipe
        return recipe.mm(a, w, offs, counts)

    @staticmethod
    def backward(ctx, d_y):
        a, w, offs = ctx.saved_tensors
        d_y = d_y.contiguous()
        d_a = ctx.recipe.mm(d_y, w.transpose(-2, -1), offs, ctx.counts) if ctx.needs_input_grad[0] else None
        d_w = ctx.recipe.wgrad(d_y, a, offs, ctx.counts) if ctx.needs_input_grad[1] else None
        return d_a, d_w, None, None, None


def to_e4m3(t, amax):
    """(t / s as float8_e4m3fn, saturated at +-448; s = amax / 448 in fp32), amax broadcast against t."""
    s = amax.float().clamp_min(1e-12) / E4M3_MAX
    return (t.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def rowwise_mm(a, w, offs, counts):
    """torch._scaled_grouped_mm: a scaled per row, w per output row (one fp32 scale per row of w[e])."""
    qa, sa = to_e4m3(a, a.abs().amax(-1, keepdim=True))
    qw, sw = to_e4m3(w, w.abs().amax(-1, keepdim=True))
    return torch._scaled_grouped_mm(qa.contiguous(), qw.contiguous().transpose(-2, -1), sa.view(-1),
                                    sw.squeeze(-1).contiguous(), offs=offs, out_dtype=torch.bfloat16)


def grouped_wgrad_bf16(d_y, a, offs, counts):
    """d_w[e] = d_y_e^T a_e in bf16: torch._grouped_mm 2d x 2d grouped along K (the rows), the call of its backward."""
    return torch._grouped_mm(d_y.t(), a, offs=offs)


def blocks_1x128(t):
    """t [M, K] (any strides, K a multiple of 128) -> (e4m3 [M, K] contiguous, fp32 scale [M, K/128])."""
    b = t.unflatten(-1, (-1, 128))
    q, s = to_e4m3(b, b.abs().amax(-1, keepdim=True))
    return q.flatten(-2).contiguous(), s.squeeze(-1)


def blocks_128x128(w):
    """w [E, N, K] (any strides, N and K multiples of 128) -> (e4m3 [E, N, K] contiguous, fp32 scale
    [E, N/128, round_up(K/128, 4)]: scaled_mm's BlockWise128x128 wants the K blocks padded to a multiple of 4)."""
    b = w.unflatten(2, (-1, 128)).unflatten(1, (-1, 128))  # [E, N/128, 128, K/128, 128]
    q, s = to_e4m3(b, b.abs().amax((2, 4), keepdim=True))
    s = s[:, :, 0, :, 0]
    return q.reshape(w.shape).contiguous(), F.pad(s, (0, -s.shape[-1] % 4), value=1.0).contiguous()


def pad_rows(t, multiple):
    """t [M, ...] with zero rows appended up to a multiple of `multiple` (e4m3 through its bytes)."""
    pad = -t.shape[0] % multiple
    if not pad:
        return t
    if t.dtype == torch.float8_e4m3fn:
        return F.pad(t.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
    return F.pad(t, (0, 0, 0, pad))


def outer_major(scale):
    """A [M, K/128] scale with strides (1, M), as scaled_mm's BlockWise1x128 wants."""
    return scale.t().contiguous().t()


def blockwise_mm(a, w, offs, counts):
    """F.scaled_mm per expert (cuBLAS): a in 1x128 blocks, w in 128x128 blocks. An expert's rows are zero-padded to
    a multiple of 4 (a copy, where not): its 1x128 scales' leading dimension 16-byte aligned, reportedly needed."""
    if a.shape[1] % 128 or w.shape[1] % 128:
        raise ValueError(f"cublas_blockwise: GEMM dims {w.shape[1]} x {a.shape[1]} are not multiples of 128")
    qa, sa = blocks_1x128(a)
    qw, sw = blocks_128x128(w)
    outs, lo = [], 0
    for e, m in enumerate(counts):
        if m:
            x, s = pad_rows(qa[lo:lo + m], 4), pad_rows(sa[lo:lo + m], 4)
            outs.append(F.scaled_mm(x, qw[e].t(), outer_major(s), F.ScalingType.BlockWise1x128, sw[e].t(),
                                    F.ScalingType.BlockWise128x128)[:m])
        lo += m
    return torch.cat(outs)


def blockwise_wgrad(d_y, a, offs, counts):
    """d_w[e] = d_y_e^T a_e per expert with F.scaled_mm, both operands in 1x128 blocks along the expert's rows
    (the reduction; zero-padded to a multiple of 128): DeepSeek-V3's 128x1 tiles of the backward's activations."""
    outs, lo = [], 0
    for m in counts:
        if not m:
            outs.append(a.new_zeros(d_y.shape[1], a.shape[1]))
            continue
        (qg, sg), (qx, sx) = (blocks_1x128(pad_rows(t[lo:lo + m], 128).t()) for t in (d_y, a))
        outs.append(F.scaled_mm(qg, qx.t(), outer_major(sg), F.ScalingType.BlockWise1x128, outer_major(sx),
                                F.ScalingType.BlockWise1x128))
        lo += m
    return torch.stack(outs)


FP8_ROWWISE = Fp8Recipe(rowwise_mm, grouped_wgrad_bf16, host_counts=False)
FP8_BLOCKWISE = Fp8Recipe(blockwise_mm, blockwise_wgrad, host_counts=True)


def hf_loop(p, topk_ids):
    x, rw = p["x"], p["router_weights"]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(p["w_gate"].shape[0]):
        tok, slot = torch.where(topk_ids == e)  # syncs
        if tok.numel() == 0:
            continue
        v = x[tok]
        h = F.silu(v @ p["w_gate"][e].T) * (v @ p["w_up"][e].T)
        y.index_add_(0, tok, (h @ p["w_down"][e].T).float() * rw[tok, slot, None])
    if shared_of(p):
        y = y + shared_mlp(x, shared_of(p)).float()
    return y.to(x.dtype)


def serval_impl(settings=(), weights_once_per_step=False):
    """serval.moe with the Config of a variant's settings (`variant_config`; none: the default), built once
    per (H, dtype, device), outside the timed calls. weights_once_per_step (an FP8 precision): the expert
    weights quantized by `serval.quantize_expert_weights` when they change (their storage or version: once per
    optimizer step in training), so the timed calls, like a step's further micro-batches, reuse them. Without
    it an FP8 call quantizes its weights itself: serval's weight cache (`serval.weight_cache`, which would keep
    them across the timed calls, as the weights do not change here) is emptied before each call, as an optimizer
    step between calls would."""
    import serval
    import serval.weight_cache

    configs, made = {}, {}

    def impl(p, topk_ids):
        x = p["x"]
        key = (x.shape[1], x.dtype, x.device)
        if key not in configs:
            configs[key] = variant_config(settings, x)
        config = configs[key]
        expert_weights = None
        if weights_once_per_step:
            weights = (p["w_gate"], p["w_up"], p["w_down"])
            version = tuple((w.data_ptr(), w._version) for w in weights)
            if made.get("version") != version:
                made["version"] = version
                made["weights"] = serval.quantize_expert_weights(*(w.detach() for w in weights), config.precision)
            expert_weights = made["weights"]
        elif config.precision != "bf16":
            serval.weight_cache.clear()
        return serval.moe(x, p["router_weights"], topk_ids, p["w_gate"], p["w_up"], p["w_down"], shared=shared_of(p),
                          config=config, expert_weights=expert_weights)

    return impl


def sonicmoe(p, topk_ids):
    # SonicMoE's entry point for precomputed routing: flat (token, expert, score) triples, token ids
    # sorted ascending. w1 is (2I, H, E) over an [E, 2I, H] tensor, gate/up rows interleaved
    # (row 2i gate_i, row 2i+1 up_i: its default layout); w2 is (H, I, E) over our [E, H, I] w_down.
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_general_routing_inputs

    x = p["x"]
    (N, k), E = topk_ids.shape, p["w_down"].shape[0]
    token_idx = torch.arange(N, dtype=torch.int32, device=x.device).repeat_interleave(k)
    y, _ = moe_general_routing_inputs(
        x, p["router_weights"].view(-1), token_idx, topk_ids.flatten().to(torch.int32),
        p["w_gate_up"].permute(1, 2, 0), None, p["w_down"].permute(1, 2, 0), None,
        E, torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU,
    )
    if shared_of(p):
        y = y + shared_mlp(x, shared_of(p))
    return y


def prepare_sonicmoe(p):
    """Convert our weights once, outside timing: w_gate, w_up [E, I, H] -> w_gate_up [E, 2I, H] interleaved."""
    q = {n: t for n, t in p.items() if n not in ("w_gate", "w_up")}
    E, I, H = p["w_gate"].shape
    q["w_gate_up"] = torch.stack([p["w_gate"], p["w_up"]], dim=2).reshape(E, 2 * I, H).detach().requires_grad_()
    return q


def w_gate_grad(grads):
    if "w_gate" in grads:
        return grads["w_gate"]
    return grads["w_gate_up"].unflatten(1, (-1, 2))[:, :, 0]  # sonicmoe's interleaved layout


def cap_quack_autotuning(n):
    """SonicMoE's GEMMs (quack) autotune over ~10-20 configs per kernel and shape, compiling each
    (minutes per shape). quack has no setting for this, so wrap each autotuner's config pruning to
    keep n configs spread over the valid list (from cooperative 256-row tiles to ping-pong 128-row ones)."""
    import quack.gemm_interface as gi
    from quack.autotuner import Autotuner

    def spread(configs):
        if len(configs) <= n:
            return configs
        return [configs[round(i * (len(configs) - 1) / max(n - 1, 1))] for i in range(n)]

    for tuner in vars(gi).values():
        if isinstance(tuner, Autotuner):
            prune = tuner.early_config_prune or (lambda configs, nargs, **kw: configs)
            tuner.early_config_prune = lambda configs, nargs, _prune=prune, **kw: spread(_prune(configs, nargs, **kw))


def load_impl(name, device, args):
    """(impl, prepare) or None with a message when it cannot run here."""
    try:
        if name == "serval":
            return serval_impl(), None
        if name == "sonicmoe":
            if device.type != "cuda":
                print("skip sonicmoe: needs CUDA")
                return None
            import sonicmoe as _  # noqa: F401

            cap_quack_autotuning(args.sonic_configs)
            return sonicmoe, prepare_sonicmoe
        if name in FP8_BASELINES and device.type != "cuda":
            print(f"skip {name}: needs CUDA (torch's FP8 GEMMs; sm_90)")
            return None
    except Exception as e:  # ImportError, or a broken install of its dependencies
        print(f"skip {name}: import failed: {type(e).__name__}: {e}")
        return None
    return {"torch_grouped_mm": torch_grouped_mm, "hf_loop": hf_loop, "torch_fp8_rowwise": torch_fp8_rowwise,
            "cublas_blockwise": cublas_blockwise}[name], None


# -----------------------------------------------------------------------------
# variants: a serval.Config, and in it a serval.plan.KernelPlan (see the module docstring)


def parse_variant(text):
    """'NAME: a=1; b.c=x' -> ('NAME', [('a', 1), ('b.c', 'x')]): values are Python literals, else bare words."""
    name, colon, body = text.partition(":")
    if not colon or not name.strip() or not body.strip():
        raise ValueError(f"variant {text!r}: expected 'NAME: FIELD=VALUE; ...'")
    settings = []
    for setting in filter(str.strip, body.split(";")):
        path, eq, value = setting.partition("=")
        if not eq or not path.strip():
            raise ValueError(f"variant {name.strip()!r}: setting {setting.strip()!r} is not FIELD=VALUE")
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            value = value.strip()
        settings.append((path.strip(), value))
    return name.strip(), settings


def replaced(obj, path, value):
    """The frozen dataclass obj with field `path` ('a' or 'a.b': into the dataclass held in field a) set to value;
    the dataclasses along the path are copied (dataclasses.replace, so each one validates its fields)."""
    head, _, rest = path.partition(".")
    fields = [f.name for f in dataclasses.fields(obj)]
    if head not in fields:
        raise ValueError(f"{type(obj).__name__} has no field {head!r} (fields: {', '.join(fields)})")
    if rest:
        inner = getattr(obj, head)
        if not dataclasses.is_dataclass(inner):
            raise ValueError(f"{type(obj).__name__}.{head} is {inner!r}, not a dataclass: no field {rest!r} in it")
        value = replaced(inner, rest, value)
    return dataclasses.replace(obj, **{head: value})


def variant_plan(settings, plan):
    """`plan` (a serval.plan.KernelPlan) with the settings."""
    for path, value in settings:
        plan = replaced(plan, path, value)
    return plan


def parse_variants(parser, texts, device):
    """[(NAME, settings)] of the --variant texts, each checked against serval.Config and KernelPlan's fields
    (a parser error, before anything runs, for a malformed text or an unknown field)."""
    variants = []
    for text in texts:
        try:
            name, settings = parse_variant(text)
            variant_config(settings, torch.zeros(1, 8, dtype=torch.bfloat16, device=device))
        except (ValueError, TypeError) as e:
            parser.error(f"--variant {text!r}: {e}")
        variants.append((name, settings))
    return variants


def variant_config(settings, x):
    """The serval.Config that serval.moe runs a variant with on tokens x: KernelPlan fields set in the plan
    serval.moe would pick for x (serval.kernels.plan_for, i.e. serval.plan.choose_plan), the other settings
    in the Config. No settings: serval.Config() (the plan left to serval.moe)."""
    import serval
    from serval.plan import KernelPlan

    plan_fields = {f.name for f in dataclasses.fields(KernelPlan)}
    config_fields = {f.name for f in dataclasses.fields(serval.Config)} - {"kernel_plan"}
    for path, _ in settings:
        if path.split(".")[0] not in plan_fields | config_fields:
            raise ValueError(f"setting {path!r}: not a field of serval.plan.KernelPlan "
                             f"({', '.join(sorted(plan_fields))}) or of serval.Config "
                             f"({', '.join(sorted(config_fields))})")
    plan_settings = [(path, value) for path, value in settings if path.split(".")[0] in plan_fields]
    config = serval.Config()
    if plan_settings:
        from serval import kernels

        config = replaced(config, "kernel_plan", variant_plan(plan_settings, kernels.plan_for(x)))
    for path, value in settings:
        if path.split(".")[0] in config_fields:
            config = replaced(config, path, value)
    return config


# -----------------------------------------------------------------------------
# measuring


HOST_CALLS = 5  # calls whose host time gives a record's host_ms
HOST_BOUND = 0.9  # host_ms / ms from which a timed call is marked host-bound (the GPU waited between calls)


class Timing(NamedTuple):
    ms: float  # median milliseconds of one call: CUDA events on the GPU, perf_counter on the CPU
    host_ms: float | None  # CUDA, host_calls > 0: median host milliseconds to enqueue one call onto an idle GPU


def time_ms(fn, warmup, iters, device, soak_s=0.0):
    """Median milliseconds of fn() over iters calls, after warmup calls (`time_calls`' ms, no host calls)."""
    return time_calls(fn, warmup, iters, device, soak_s).ms


def time_calls(fn, warmup, iters, device, soak_s=0.0, host_calls=0) -> Timing:
    """Median milliseconds of fn() over iters calls, after warmup calls, and (CUDA, host_calls > 0) the median
    host time to enqueue one call onto an idle GPU over host_calls more, each after a sync.

    soak_s (CUDA): before the timed calls, keep the GPU busy with fn() for about that many seconds, with
    no sync between the soak and the timed calls. An H200 runs GEMM-heavy work at its 700 W cap: the SM
    clock starts at 1980 MHz and settles at 1410-1520 MHz within about a second of sustained load
    (BENCHMARKS.md, Method), so a short burst after idle measures a GPU that training never sees. Every
    implementation is timed in that settled state.
    """
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return Timing(statistics.median(times), None)
    # the host's pace apart, before the soak: each call enqueued onto an idle GPU (behind the soak, a full launch
    # queue would hold the host to the GPU's pace)
    host = []
    for _ in range(host_calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    if soak_s > 0:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        for _ in range(int(soak_s * 1e3 / max(start.elapsed_time(end), 1e-3))):
            fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:  # no sync in between: the GPU queue stays full
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return Timing(statistics.median(start.elapsed_time(end) for start, end in events),
                  statistics.median(host) if host else None)


class GpuMonitor:
    """SM clock and board power, sampled every 100 ms by `nvidia-smi` in the background (if present).

    window(seconds) gives the medians over the last `seconds` (at least 0.5) before now: called right
    after a timed loop's final sync, the clock and power the loop (and the end of its soak) ran at.
    The GPU is named by torch's device index, which is nvidia-smi's unless CUDA_VISIBLE_DEVICES reorders.
    """

    def __init__(self, device):
        self.proc = None
        if device.type != "cuda" or not shutil.which("nvidia-smi"):
            return
        self.file = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--id={torch.cuda.current_device() if device.index is None else device.index}",
             "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=self.file, stderr=subprocess.DEVNULL)

    def window(self, seconds):
        if self.proc is None:
            return None, None
        time.sleep(0.25)  # let the sample that covers the loop's end arrive
        self.file.seek(0)
        now, clocks, powers, seconds = time.time(), [], [], max(seconds, 0.5)
        for line in self.file.read().splitlines():
            try:
                stamp, clock, power = (f.strip() for f in line.split(","))
                t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                if now - 0.25 - seconds <= t <= now - 0.25:
                    clocks.append(float(clock))
                    powers.append(float(power))
            except ValueError:  # a partial line or "[N/A]"
                continue
        return (statistics.median(clocks), statistics.median(powers)) if clocks else (None, None)

    def close(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()


def dense_matmul_record(args, device, info, monitor, n=8192):
    """The ceiling under the same protocol: torch.matmul of two bf16 [n, n] matrices."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = time_ms(lambda: a @ b, args.warmup, args.iters, device, args.soak)
    clock, power = monitor.window(ms * args.iters / 1e3)
    rec = dict(shape=f"dense-{n}", impl="torch.matmul", scope="dense", **{"pass": "fwd"}, ms=ms,
               tflops=2 * n**3 / (ms * 1e-3) / 1e12, soak_s=args.soak, sm_clock_mhz=clock, power_w=power, **info)
    print(f"dense bf16 matmul {n}^3: {ms:.3f} ms {rec['tflops']:.1f} TFLOP/s" +
          (f" at {clock:.0f} MHz, {power:.0f} W" if clock else ""))
    return [rec]


def memory_gib(impl, p, topk_ids, fn):
    """(memory kept for backward, peak memory of one fn() call above the inputs), GiB."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = impl(p, topk_ids)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    del y
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return saved / GIB, (torch.cuda.max_memory_allocated() - base) / GIB


def run_and_grads(impl, p, topk_ids, dy):
    y = impl(p, topk_ids)
    grads = torch.autograd.grad(y, list(p.values()), dy)
    return y.detach(), dict(zip(p.keys(), grads))


def reference(impl, inp, scope, passes):
    """What every implementation is checked against: impl's y, and its gradients when fwdbwd is asked for."""
    p = make_params(inp, scope)
    if "fwdbwd" in passes:
        return run_and_grads(impl, p, inp["topk_ids"], inp["dy"])
    with torch.no_grad():
        return impl(p, inp["topk_ids"]), None


def rel_err(a, b, chunk=1 << 26):
    """||a - b|| / ||b||, in fp32 chunks of a and b summed in fp64: whole fp32 copies of one rank's weight
    gradients (deepseek-v4-pro at EP=2: 15.75 GiB each) ran a 140 GB GPU out of memory."""
    diff_sq = torch.zeros((), dtype=torch.float64, device=a.device)
    ref_sq = torch.zeros((), dtype=torch.float64, device=a.device)
    for a_part, b_part in zip(a.reshape(-1).split(chunk), b.reshape(-1).split(chunk)):
        b_part = b_part.float()
        diff_sq += (a_part.float() - b_part).square().sum(dtype=torch.float64)
        ref_sq += b_part.square().sum(dtype=torch.float64)
    return (diff_sq.sqrt() / ref_sq.sqrt().clamp_min(1e-30)).item()


def compare(out, ref):
    """Relative errors of (y, grads) against the reference's."""
    (y, g), (y_ref, g_ref) = out, ref
    errs = {"y": rel_err(y, y_ref)}
    if g is not None:
        errs["d_x"] = rel_err(g["x"], g_ref["x"])
        errs["d_rw"] = rel_err(g["router_weights"], g_ref["router_weights"])
        errs["d_w_gate"] = rel_err(w_gate_grad(g), w_gate_grad(g_ref))
    return errs


# -----------------------------------------------------------------------------
# reporting


def env_info(device):
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=gpu,
                torch=torch.__version__, triton=triton_version)


def load_records(path):
    return json.load(open(path)) if os.path.exists(path) else []


def save_records(records, path):
    """Append to the JSON list at path; called after each implementation, so a killed run keeps its results."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    old = load_records(path)
    with open(path, "w") as f:
        json.dump(old + records, f, indent=1)


def latest(records):
    """The newest record of each (shape, impl, precision, scope, pass) measured on the GPU of the newest record."""
    gpu = records[-1]["gpu"]
    newest = {}
    for r in records:
        if r["gpu"] == gpu:
            newest[(r["shape"], r["impl"], r.get("precision", "bf16"), r["scope"], r["pass"])] = r
    return list(newest.values())


def panels(records):
    """(pass, scope) pairs present, fwdbwd routed first."""
    order = [(ps, sc) for ps in reversed(PASSES) for sc in SCOPES]
    return [ps_sc for ps_sc in order if any((r["pass"], r["scope"]) == ps_sc for r in records)]


def grid(records, ps, sc):
    """shapes, impls and {(shape, impl): TFLOP/s} of one panel."""
    rs = [r for r in records if (r["pass"], r["scope"]) == (ps, sc)]
    shapes = list(dict.fromkeys(r["shape"] for r in rs))
    impls = list(dict.fromkeys(impl_label(r) for r in rs))
    return shapes, impls, {(r["shape"], impl_label(r)): r["tflops"] for r in rs}


def impl_label(record):
    """The implementation as tables and charts name it: serval's FP8 precisions as "serval mxfp8" (the FP8
    baselines by their names)."""
    precision = record.get("precision", "bf16")
    return record["impl"] if precision == "bf16" or record["impl"] in FP8_BASELINES else f"{record['impl']} {precision}"


def print_table(records):
    for r in records:
        if r["scope"] == "dense" and r["tflops"]:
            print(f"ceiling, same protocol: {r['impl']} {r['shape']} {r['tflops']:.0f} TFLOP/s"
                  + (f" at {r['sm_clock_mhz']:.0f} MHz, {r['power_w']:.0f} W" if r.get("sm_clock_mhz") else ""))
    for ps, sc in panels(records):
        shapes, impls, tf = grid(records, ps, sc)
        print(f"\nTFLOP/s, {ps} {sc} ({records[0]['gpu']})")
        width = max(18, *(len(i) + 2 for i in impls))
        print(f"{'shape':<16}" + "".join(f"{i:>{width}}" for i in impls))
        for s in shapes:
            cells = [tf.get((s, i)) for i in impls]
            print(f"{s:<16}" + "".join(f"{c:>{width}.4g}" if c is not None else f"{'-':>{width}}" for c in cells))


def plot(records, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot")
        return
    keys = panels(records)
    all_impls = sorted({impl_label(r) for r in records})  # one colour per implementation across panels
    ceiling = next((r for r in reversed(records) if r["scope"] == "dense" and r["tflops"]), None)
    fig, axes = plt.subplots(len(keys), 1, figsize=(12, 3.6 * len(keys)), squeeze=False)
    for ax, (ps, sc) in zip(axes[:, 0], keys):
        shapes, impls, tf = grid(records, ps, sc)
        width = 0.8 / len(impls)
        for j, impl in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(shapes))]
            values = [tf.get((s, impl)) or 0.0 for s in shapes]
            bars = ax.bar(xs, values, width, label=impl, color=f"C{all_impls.index(impl)}")
            ax.bar_label(bars, labels=[f"{v:.3g}" if v else "not run" for v in values], fontsize=7)
        if ceiling:
            ax.axhline(ceiling["tflops"], color="gray", linestyle="--", linewidth=1,
                       label=f"{ceiling['impl']} {ceiling['shape']}")
        ax.set_xticks(range(len(shapes)), shapes)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{ps}, {sc} ({records[0]['gpu']})")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# -----------------------------------------------------------------------------


def check(impl, p, topk_ids, dy, ref):
    """Relative errors of one implementation against the reference outputs `ref` = (y, grads or None)."""
    if ref[1] is not None:
        return compare(run_and_grads(impl, p, topk_ids, dy), ref)
    with torch.no_grad():
        return compare((impl(p, topk_ids), None), ref)


def pass_fn(impl, p, topk_ids, dy, ps):
    """What one timed call runs: the training forward (autograd records the graph, as in training),
    or forward + the gradients of every input."""
    if ps == "fwd":
        return lambda: impl(p, topk_ids)
    return lambda: torch.autograd.grad(impl(p, topk_ids), list(p.values()), dy)


def bench_impl(name, impl, prepare, settings, precision, inp, ref, shape_name, scope, passes, args, device, info,
               monitor):
    """Check one implementation against the reference (its first call also compiles and autotunes),
    then time each pass. Returns its records (settings: a variant's, recorded; precision: of the routed experts,
    serval's from --precisions, the FP8 baselines' (FP8_BASELINES), "bf16" for every other implementation;
    within FP8_TOL of the bf16 reference where not bf16)."""
    shape = inp["shape"]
    topk_ids, dy = inp["topk_ids"], inp["dy"]
    p = make_params(inp, scope)
    p = prepare(p) if prepare else p
    tag = f"{shape_name:<16} {scope:<6} {name:<17}"
    # "serval mxfp8" is impl serval, precision mxfp8; "serval mxfp8 (weights once per step)" impl "serval (weights
    # once per step)"; the FP8 baselines keep their names
    label = name.replace(f" {precision}", "") if precision != "bf16" else name
    tol = max(args.tol, FP8_TOL) if precision != "bf16" else args.tol
    settings = [f"{path}={value!r}" for path, value in settings] if settings is not None else None
    records = [dict(shape=shape_name, impl=label, precision=precision, settings=settings, scope=scope, **{"pass": ps},
                    ms=None, host_ms=None, tflops=None,
                    saved_mem_gib=None, peak_mem_gib=None, rel_err=None, rel_errs=None, error=None, soak_s=args.soak,
                    sm_clock_mhz=None, power_w=None, **info)
               for ps in passes]
    try:
        errs = check(impl, p, topk_ids, dy, ref)
    except Exception as e:
        print(f"{tag} FAILED: {type(e).__name__}: {e}")
        for rec in records:
            rec["error"] = f"{type(e).__name__}: {e}"
        return records
    err = max(errs.values())
    print(f"{tag} rel_err " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    for rec in records:
        ps = rec["pass"]
        rec["rel_err"], rec["rel_errs"] = err, errs
        if not err <= tol:
            print(f"{tag} {ps:<6} MISMATCH (rel_err {err:.2e} > tol {tol}): not timed")
            rec["error"] = "mismatch"
            continue
        fn = pass_fn(impl, p, topk_ids, dy, ps)
        try:
            rec["ms"], rec["host_ms"] = time_calls(fn, args.warmup, args.iters, device, args.soak, HOST_CALLS)
            rec["sm_clock_mhz"], rec["power_w"] = monitor.window(rec["ms"] * args.iters / 1e3)
            rec["tflops"] = flops(shape, scope, ps) / (rec["ms"] * 1e-3) / 1e12
            mem = f"  {rec['sm_clock_mhz']:5.0f} MHz {rec['power_w']:4.0f} W" if rec["sm_clock_mhz"] else ""
            if device.type == "cuda":
                rec["saved_mem_gib"], rec["peak_mem_gib"] = memory_gib(impl, p, topk_ids, fn)
                mem += f"  saved {rec['saved_mem_gib']:6.2f} GiB  peak {rec['peak_mem_gib']:6.2f} GiB"
            bound = "  host-bound" if rec["host_ms"] is not None and rec["host_ms"] >= HOST_BOUND * rec["ms"] else ""
            print(f"{tag} {ps:<6} {rec['ms']:9.3f} ms {rec['tflops']:7.1f} TFLOP/s{mem}{bound}")
        except Exception as e:  # e.g. out of memory: keep going with the next one
            print(f"{tag} {ps:<6} FAILED: {type(e).__name__}: {e}")
            rec["error"] = f"{type(e).__name__}: {e}"
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--scopes", default=",".join(SCOPES))
    parser.add_argument("--passes", default=",".join(PASSES))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--soak", type=float, default=2.0,
                        help="seconds of sustained load before each timed loop (CUDA; 0: time a burst)")
    parser.add_argument("--tol", type=float, default=3e-2, help="largest rel. error vs torch_grouped_mm that is timed")
    parser.add_argument("--sonic-configs", type=int, default=3, help="autotuning configs per SonicMoE (quack) GEMM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON list to append to (default: benchmarks/results/"
                        "h200_layer.json; with --tiny: bench_layer_tiny.json in the temp folder)")
    parser.add_argument("--plot", nargs="?", const="", default=None, help="PNG path (default: --out with .png)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, seconds (on the CPU where there is no GPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--report-only", action="store_true", help="measure nothing: table (and --plot) of --out")
    parser.add_argument("--precisions", default="bf16",
                        help=f"comma-separated precisions of serval's routed experts ({', '.join(PRECISIONS)}): each "
                             "other than bf16 runs too, recorded as impl serval with that precision")
    parser.add_argument("--fp8-weights", choices=("per-call", "both"), default="per-call",
                        help="per-call: serval's FP8 precisions quantize the expert weights in every call; both: "
                             "also as impl 'serval (weights once per step)', the weights quantized once and passed "
                             "as expert_weights (gradient accumulation: once per optimizer step)")
    parser.add_argument("--variant", action="append", default=[],
                        help="'NAME: FIELD=VALUE; ...': serval with these KernelPlan / Config fields, too, as impl "
                             "'serval (NAME)' (see above)")
    args = parser.parse_args()
    if args.out is None:
        args.out = os.path.join(tempfile.gettempdir(), "bench_layer_tiny.json") if args.tiny else \
            "benchmarks/results/h200_layer.json"

    device = torch.device(args.device)
    variants = parse_variants(parser, args.variant, device)
    table = TINY_SHAPES if args.tiny else SHAPES
    shape_names = args.shapes.split(",") if args.shapes else list(table)
    scopes, passes = args.scopes.split(","), args.passes.split(",")
    for given, known in [(shape_names, table), (args.impls.split(","), IMPLS), (scopes, SCOPES), (passes, PASSES)]:
        if set(given) - set(known):
            parser.error(f"unknown {sorted(set(given) - set(known))}; known: {', '.join(known)}")
    precisions = args.precisions.split(",")
    if set(precisions) - set(PRECISIONS):
        unknown = sorted(set(precisions) - set(PRECISIONS))
        parser.error(f"--precisions: unknown {unknown}; known: {', '.join(PRECISIONS)}")
    impls = {} if args.report_only else {n: (*impl, None, FP8_BASELINES.get(n, "bf16"))  # precision: bf16, or FP8
                                         for n in args.impls.split(",") if (impl := load_impl(n, device, args))}
    if not args.report_only:  # serval's other precisions, then the variants, right after serval's default
        names = list(impls)
        at = names.index("serval") + 1 if "serval" in names else len(names)
        runs = [(f"serval {p}", (serval_impl((("precision", p),)), None, None, p)) for p in precisions if p != "bf16"]
        if args.fp8_weights == "both":
            runs += [(f"serval {p} (weights once per step)",
                      (serval_impl((("precision", p),), weights_once_per_step=True), None, None, p))
                     for p in precisions if p != "bf16"]
        runs += [(f"serval ({label})", (serval_impl(settings), None, settings, "bf16")) for label, settings in variants]
        impls = dict([(n, impls[n]) for n in names[:at]] + runs + [(n, impls[n]) for n in names[at:]])
    info = env_info(device)
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}; impls: {', '.join(impls)}")
    monitor = GpuMonitor(device)
    if impls and device.type == "cuda":
        save_records(dense_matmul_record(args, device, info, monitor), args.out)

    for shape_name in shape_names if impls else []:
        inp = make_inputs(table[shape_name], device, args.seed)
        for scope in scopes:
            if scope == "layer" and not inp["shape"][-1]:
                continue  # no shared expert: layer == routed
            ref = reference(torch_grouped_mm, inp, scope, passes)
            for name, (impl, prepare, settings, precision) in impls.items():
                save_records(bench_impl(name, impl, prepare, settings, precision, inp, ref, shape_name, scope, passes,
                                        args, device, info, monitor), args.out)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del ref
        del inp
    monitor.close()

    # report all of --out (newest of each, GPU of the newest record): e.g. a serval run and a sonicmoe run together
    records = latest(load_records(args.out)) if os.path.exists(args.out) else []
    print(f"\n{args.out}: {len(records)} latest records")
    if args.plot is not None and records:
        plot(records, args.plot or os.path.splitext(args.out)[0] + ".png")
    print_table(records)


if __name__ == "__main__":
    main()
