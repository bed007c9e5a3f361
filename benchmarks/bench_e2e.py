"""
End-to-end training steps of transformers MoE models on one GPU: transformers' experts implementations against
serval's (`serval.integrations.transformers`), the whole step timed (forward, loss, backward, AdamW).

Models (built from configs, random init, no download), with the real PER-LAYER sizes and few layers:
  qwen3-30b-a3b     Qwen3-MoE: hidden 2048, 128 experts of 768, top-8, softmax + norm_topk_prob, 32 heads / 4 kv
                    heads of 128, q/k norms; 4 layers
  olmoe-1b-7b       OLMoE-1B-7B: hidden 2048, 64 experts of 1024, top-8, softmax without norm_topk_prob, 16 heads
                    / 16 kv heads of 128, q/k norms; 4 layers. (OlmoeConfig's defaults are OLMoE-1B-7B's except
                    intermediate_size, 2048 there and 1024 in the published config: set here.)
  deepseek-v3-like  DeepSeek-V3's layer (DeepseekV3Config): hidden 7168, routed experts of 2048 plus one shared
                    expert, sigmoid scores + correction bias (zeros at init, as the model initializes it),
                    group-limited top-8 (n_group 8, topk_group 4), routed_scaling_factor 2.5, MLA (128 heads,
                    q_lora 1536, kv_lora 512, qk 128 + 64 rope, v 128), YaRN rope as published; but 32 routed
                    experts instead of 256 and 2 layers, every one MoE (first_k_dense_replace 0), so that bf16
                    weights + AdamW + activations fit on one H200 (the estimate is printed)
The vocabulary is cut to 32768 (--vocab) in every model: the embedding and LM head are not per-layer sizes.
--layers and --experts override the defaults. Every config sets output_router_logits False (no aux loss: the
configs' default) and sdpa attention.

Implementations (--impls): grouped_mm (transformers' default), eager (its per-expert loop: slow, for the smaller
models and few steps), batched_mm, serval (serval.integrations.transformers.use_serval with
serval.Config(precision=P) for each P in --precisions: record field precision; the others record "bf16"), and
sonicmoe: SonicMoE's package called directly (sonicmoe.functional.moe_general_routing_inputs, as transformers'
integrations/sonicmoe.py calls the hub build, unreachable here) through an experts function registered under a
name of its own; skipped with the reason when `import sonicmoe` fails (benchmarks/install_sonicmoe.sh installs it).
Its first call autotunes and compiles for minutes per shape: give it a call of its own.

Each (model, impl, precision) record: the model built on the GPU from --seed (same seed, same weights for every
implementation), bf16 parameters, torch AdamW (fused on CUDA), random token ids from --seed + 1 (one batch per
step, the same batches for every implementation), labels = the inputs. --warmup steps untimed (Triton's
compilation), then --steps timed: CUDA events around each step, no sync in between; step_ms is their median,
tokens_per_s = tokens / step_ms; peak_mem_gib = torch.cuda.max_memory_allocated() over the timed steps (reset when
they start), weights, gradients and optimizer state included. Then two more steps, each a full training step:
  moe_share   one step with CUDA events around every MoE layer's routed-experts call, forward and backward: a
              forward pre-hook and hook on the experts module record events before and after the call, and
              identity autograd functions on the call's inputs (hidden states, routing weights) and its output
              record events when the backward reaches them (the output's: the experts' backward starts; the
              inputs': it has given the gradients of x, the routing weights and every expert weight). moe_share
              = (sum of the experts' forward + backward intervals) / the whole step's interval (events around
              forward, backward and optimizer step). It covers the routed experts only: routing (the router's
              GEMM, softmax / sigmoid, top-k), the shared expert and the attention are outside. The intervals
              are on the GPU's timeline, so they include the GPU's idle time inside the experts' calls (eager's
              host syncs). moe_fwd_ms, moe_bwd_ms: the two sums.
  kernels     one step under torch.profiler: the top 12 CUDA kernels by total time (names cut to 100
              characters: head..tail, ms, calls) and the total of every kernel (kernels_total_ms, below the step
              time where the GPU waits on the host); on the CPU the top ops by self CPU time.
losses: every step's loss in order (warm-up, timed, the two extra steps). An error (e.g. out of memory) becomes
the record's "error" and the run goes on with the next one.

--determinism: with torch.use_deterministic_algorithms(True) (CUBLAS_WORKSPACE_CONFIG=:4096:8 set before CUDA
starts; sdpa picks its backend under that mode as torch decides), each of --impls
(default grouped_mm,serval; serval in bf16) trains --steps (default 20) steps twice on one model (default
qwen3-30b-a3b), each run from a fresh model and optimizer from --seed: "identical" is torch.equal of the two runs'
loss tensors; an error (a non-deterministic op raises) is recorded with its message instead.

Output: records MERGED into --out (default benchmarks/results/h200_e2e.json): a record replaces the one with the
same (kind, model, impl, precision), the others are kept, so several calls build one file. --chart [PATH] draws
tokens/s per model and implementation from the file (speedup over grouped_mm annotated; default PATH: --out with
.png), --report-only measures nothing. The table of the whole file is printed last. Every record: date, gpu,
torch, triton, transformers, serval_commit (git, when the checkout has .git), tokens, batch, seq, layers, config.

H200 runs, two calls of about 3-4 minutes each (times from trial runs at fewer layers and steps): the GPU
image's transformers is older, so install the 5.23 wheel first (.whl/ carried); --out under $OUT so the file comes
back, starting from the repository's file so that the calls merge into it (PYTHONUNBUFFERED=1: progress lines
as they are printed):
  pip install -q --no-index --no-deps --target /tmp/tf .whl/transformers-5.23.0-py3-none-any.whl
  export PYTHONPATH=/tmp/tf PYTHONUNBUFFERED=1; cp benchmarks/results/h200_e2e.json $OUT/ 2>/dev/null
  python benchmarks/bench_e2e.py --models qwen3-30b-a3b,olmoe-1b-7b --impls grouped_mm,serval,eager \
      --out $OUT/h200_e2e.json                                                          # call 1
  python benchmarks/bench_e2e.py --models deepseek-v3-like --out $OUT/h200_e2e.json && \
      python benchmarks/bench_e2e.py --determinism --out $OUT/h200_e2e.json --chart     # call 2
  source benchmarks/install_sonicmoe.sh && python benchmarks/bench_e2e.py --models qwen3-30b-a3b \
      --impls sonicmoe --out $OUT/h200_e2e.json --chart              # where SonicMoE's wheels are: its own call
The timed steps follow the warm-up directly, with no soak at the 700 W power cap (bench_layer.py's --soak): at
0.1-0.4 s per step the SM clock may still be settling in the first timed steps; --warmup lengthens the run-in.
CPU smoke test (seconds; tiny sizes, fp32, the same code path; results in the temp folder unless --out):
  python benchmarks/bench_e2e.py --smoke --impls grouped_mm,serval --precisions bf16
"""

import os
import sys

if "--determinism" in sys.argv:  # cuBLAS reads it when CUDA starts: before torch can start it
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():  # serval's Triton kernels, where asked for, run in the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's serval

MODELS = ["qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v3-like"]
IMPLS = ["grouped_mm", "eager", "batched_mm", "serval", "sonicmoe"]
PRECISIONS = ["bf16", "mxfp8", "fp8_blockwise"]
SONIC_NAME = "bench_e2e_sonicmoe"  # our experts function's name: transformers' own "sonicmoe" loads from the hub
GIB = 2**30
TOP_KERNELS = 12


# -----------------------------------------------------------------------------
# models


def model_config(name, layers, experts, vocab, seq, smoke):
    """The transformers config of a model (module docstring); smoke: the same families at hidden 64, 4 experts."""
    import transformers

    common = dict(vocab_size=vocab, max_position_embeddings=max(seq, 4096), output_router_logits=False,
                  tie_word_embeddings=False, use_cache=False, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)  # OLMoE's ids lie outside the reduced vocabulary; no padding in random ids
    if name == "qwen3-30b-a3b":
        sizes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2) if smoke else \
            dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
        if experts:
            sizes["num_experts"] = experts
        return transformers.Qwen3MoeConfig(**common, **sizes, num_hidden_layers=layers or (2 if smoke else 4),
                                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                           rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e6})
    if name == "olmoe-1b-7b":
        sizes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32,
                     num_experts=4, num_experts_per_tok=2) if smoke else \
            dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024,
                 num_experts=64, num_experts_per_tok=8)
        if experts:
            sizes["num_experts"] = experts
        return transformers.OlmoeConfig(**common, **sizes, num_hidden_layers=layers or (2 if smoke else 4),
                                        norm_topk_prob=False, clip_qkv=None, rms_norm_eps=1e-5,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if name == "deepseek-v3-like":
        sizes = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32,
                     n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=16,
                     kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16) if smoke else \
            dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, moe_intermediate_size=2048,
                 n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4, q_lora_rank=1536,
                 kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
        if experts:
            sizes["n_routed_experts"] = experts
        yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        return transformers.DeepseekV3Config(**common, **sizes, num_hidden_layers=layers or 2,
                                             intermediate_size=4 * sizes["hidden_size"], n_shared_experts=1,
                                             first_k_dense_replace=0, routed_scaling_factor=2.5,
                                             norm_topk_prob=True, rms_norm_eps=1e-6,
                                             rope_parameters=None if smoke else yarn)
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def config_summary(cfg):
    """The sizes a record is measured at, one flat dict."""
    deepseek = cfg.model_type == "deepseek_v3"
    summary = dict(model_type=cfg.model_type, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                   vocab=cfg.vocab_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                   experts=cfg.n_routed_experts if deepseek else cfg.num_experts, top_k=cfg.num_experts_per_tok,
                   expert_intermediate=cfg.moe_intermediate_size if hasattr(cfg, "moe_intermediate_size")
                   else cfg.intermediate_size, norm_topk_prob=cfg.norm_topk_prob)
    if deepseek:
        summary.update(attention="mla", shared_experts=cfg.n_shared_experts, n_group=cfg.n_group,
                       topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                       routing="sigmoid + correction bias, group-limited", q_lora_rank=cfg.q_lora_rank,
                       kv_lora_rank=cfg.kv_lora_rank, qk_head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                       v_head_dim=cfg.v_head_dim)
    else:
        summary.update(attention="gqa", head_dim=getattr(cfg, "head_dim", None) or
                       cfg.hidden_size // cfg.num_attention_heads, shared_experts=0, routing="softmax")
    return summary


def build_model(cfg, device, dtype, seed):
    """The causal LM of cfg on device, every parameter initialized from seed (transformers' init), train mode."""
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def memory_estimate(cfg, tokens, dtype):
    """GiB, before building: the parameters counted on the meta device, times 4 (weight, gradient, AdamW's two
    states, all in the parameters' dtype); the tensors the routed experts keep for backward in grouped_mm
    (rows R = tokens * k: gathered x [R, H], gate/up [R, 2I], silu(gate) and its product [R, I] each, the down
    output [R, H]); the logits and the loss's fp32 copy and gradient; a rough count of the attention block's kept
    tensors (norms, projections, q / k / v, the attention output). The peak adds transient buffers."""
    import transformers

    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())
    b = torch.finfo(dtype).bits // 8
    s = config_summary(cfg)
    H, I, k = s["hidden"], s["expert_intermediate"], s["top_k"]
    routed = tokens * k * (2 * H + 4 * I) * b
    if s["attention"] == "mla":
        heads = s["heads"]
        attention = tokens * b * (6 * H + 3 * heads * s["qk_head_dim"] + 2 * heads * s["v_head_dim"]
                                  + heads * (cfg.qk_nope_head_dim + s["v_head_dim"])
                                  + 2 * (cfg.q_lora_rank + cfg.kv_lora_rank))
        attention += tokens * (H + 4 * I) * b  # the shared expert
    else:
        q_dim, kv_dim = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
        attention = tokens * b * (6 * H + 6 * q_dim + 6 * kv_dim)
    logits = tokens * s["vocab"] * (b + 8)
    est = dict(params_b=params / 1e9, weights_grads_adamw=4 * params * b / GIB,
               routed_kept=s["layers"] * routed / GIB, attention_kept_rough=s["layers"] * attention / GIB,
               logits_loss=logits / GIB)
    est["total"] = sum(v for key, v in est.items() if key != "params_b")
    return {key: round(v, 2) for key, v in est.items()}


# -----------------------------------------------------------------------------
# implementations


def sonicmoe_experts(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts call on SonicMoE's package: flat (token, expert, score) triples, token ids ascending;
    w1 (2I, H, E) over gate_up_proj [E, 2I, H], w2 (H, I, E) over down_proj [E, H, I]: no copy."""
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import moe_general_routing_inputs

    T, k = top_k_index.shape
    token_idx = torch.arange(T, dtype=torch.int32, device=hidden_states.device).repeat_interleave(k)
    layout = {"concat_layout": True} if sonic_takes_concat() else {}  # else prepare_sonicmoe interleaved the rows
    y, _ = moe_general_routing_inputs(
        hidden_states, top_k_weights.reshape(-1).float(), token_idx, top_k_index.reshape(-1).to(torch.int32),
        self.gate_up_proj.permute(1, 2, 0), None, self.down_proj.permute(1, 2, 0), None, self.num_experts,
        torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU, **layout)
    return y.to(hidden_states.dtype)


def sonic_takes_concat():
    """Whether the installed SonicMoE reads gate/up rows concatenated (transformers' layout): newer releases
    take concat_layout=True; 0.1.2.post1 reads them interleaved only."""
    from sonicmoe.functional import moe_general_routing_inputs

    return "concat_layout" in inspect.signature(moe_general_routing_inputs).parameters


def prepare_sonicmoe(model):
    """Where SonicMoE reads interleaved gate/up rows only (row 2i gate_i, 2i+1 up_i), reorder every experts
    module's gate_up_proj rows once, in place: the same function of the same weights, no copy per call."""
    if sonic_takes_concat():
        return "concatenated (concat_layout=True)"
    with torch.no_grad():
        for w in experts_weights(model):
            E, I2, H = w.shape
            w.copy_(w.view(E, 2, I2 // 2, H).transpose(1, 2).reshape(E, I2, H))
    return "interleaved once at build"


def experts_weights(model):
    return [m.gate_up_proj for m in experts_modules(model)]


def experts_modules(model):
    """The modules transformers dispatches to an experts implementation (@use_experts_implementation)."""
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]


def load_impl(name):
    """None, or the reason the implementation cannot run here (printed, no record)."""
    if name != "sonicmoe":
        return None
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import sonicmoe as _  # noqa: F401
        from transformers.integrations import moe as transformers_moe

        import bench_layer

        bench_layer.cap_quack_autotuning(3)  # its autotuning compiles every config: minutes per shape otherwise
        transformers_moe.ALL_EXPERTS_FUNCTIONS.register(SONIC_NAME, sonicmoe_experts)
    except Exception as e:  # ImportError, or a broken install of its dependencies
        return f"import failed: {type(e).__name__}: {e}"
    return None


def set_impl(model, impl, precision):
    """Run model's experts on impl; returns a note for the record (sonicmoe: its weight layout)."""
    if impl == "serval":
        import serval
        import serval.integrations.transformers as serval_transformers

        serval_transformers.use_serval(model, serval.Config(precision=precision))
        return None
    if impl == "sonicmoe":
        note = prepare_sonicmoe(model)
        model.set_experts_implementation(SONIC_NAME)
        return note
    model.set_experts_implementation(impl)
    return None


# -----------------------------------------------------------------------------
# the step and its measurements


def train_step(model, optimizer, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


class _Mark(torch.autograd.Function):
    """Identity on tensors whose backward records `event` when the gradient reaches them (once for all)."""

    @staticmethod
    def forward(ctx, event, *tensors):
        ctx.event = event
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.event.record()
        return (None, *grads)


class ExpertsTimer:
    """CUDA events around every experts call of a model, forward and backward (module docstring, moe_share)."""

    def __init__(self, model):
        self.calls = []  # [fwd start, fwd end, bwd start, bwd end] per call
        self.handles = []
        for m in experts_modules(model):
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args):
        hidden_states, top_k_index, top_k_weights = args  # every model here calls experts(x, ids, weights)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        self.calls.append(events)
        events[0].record()
        hidden_states, top_k_weights = _Mark.apply(events[3], hidden_states, top_k_weights)
        return hidden_states, top_k_index, top_k_weights

    def _post(self, module, args, output):
        events = self.calls[-1]
        events[1].record()
        (output,) = _Mark.apply(events[2], output)
        return output

    def sums_ms(self):
        """(forward ms, backward ms) over the calls; after a synchronize."""
        return (sum(e[0].elapsed_time(e[1]) for e in self.calls), sum(e[2].elapsed_time(e[3]) for e in self.calls))

    def remove(self):
        for h in self.handles:
            h.remove()


def timed_steps(model, optimizer, batches, cuda):
    """(losses, ms per step): CUDA events around each step, no sync in between (perf_counter on the CPU)."""
    losses, marks = [], []
    for ids in batches:
        if cuda:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:
            marks.append(time.perf_counter())
        losses.append(train_step(model, optimizer, ids))
    if cuda:
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
        torch.cuda.synchronize()
        return losses, [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    marks.append(time.perf_counter())
    return losses, [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]


def moe_share_step(model, optimizer, ids):
    """One step with the experts timed (CUDA): (loss, moe_share, experts' forward ms, backward ms, step ms)."""
    timer = ExpertsTimer(model)
    try:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = train_step(model, optimizer, ids)
        end.record()
        torch.cuda.synchronize()
        fwd, bwd = timer.sums_ms()
        step = start.elapsed_time(end)
    finally:
        timer.remove()
    return loss, (fwd + bwd) / step, fwd, bwd, step


def profiled_step(model, optimizer, ids, cuda):
    """One step under torch.profiler: (loss, top kernels [{name, ms, calls}], every kernel's ms, what was counted).
    CUDA: the device's kernels, memcpys and memsets (user annotations left out), summed by name; CPU: the ops by
    self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")  # one step, one cycle: nothing lost
        with profile(activities=activities) as prof:
            loss = train_step(model, optimizer, ids)
            if cuda:
                torch.cuda.synchronize()
    totals = {}
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation:
                ms, calls = totals.get(e.name, (0.0, 0))
                totals[e.name] = (ms + e.time_range.elapsed_us() / 1e3, calls + 1)
        what = "CUDA kernels, memcpy and memset (device time)"
    else:
        totals = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}
        what = "CPU ops (self CPU time)"
    top = sorted(totals.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    kernels = [dict(name=short(name), ms=round(ms, 3), calls=calls) for name, (ms, calls) in top]
    return loss, kernels, round(sum(ms for ms, _ in totals.values()), 3), what


def short(name, width=100):
    """A kernel name cut to width: its head and its tail (a template's functor, a tile shape), joined by '..'."""
    return name if len(name) <= width else f"{name[:width - 32]}..{name[-30:]}"


def make_batches(n, batch, seq, vocab, seed, device):
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return torch.randint(0, vocab, (n, batch, seq), generator=gen, device=device)


def run_record(kind, name, cfg, impl, precision, args, device, info):
    """One record of kind "throughput" or "determinism" (module docstring); an error is recorded, never raised.
    The measuring function's frame holds the model and optimizer: gone when it returns or raises, then freed."""
    record = base_record(kind, name, impl, precision, cfg, args, info)
    t0 = time.perf_counter()
    try:
        (measure_throughput if kind == "throughput" else measure_determinism)(record, cfg, args, device)
    except Exception as e:  # e.g. out of memory: record it, go on with the next one
        record["error"] = f"{type(e).__name__}: {e}"[:2000]
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def measure_throughput(record, cfg, args, device):
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    model = build_model(cfg, device, args.dtype, args.seed)
    record["note"] = set_impl(model, record["impl"], record["precision"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
    batches = make_batches(args.warmup + args.steps + 2, args.batch, args.seq, cfg.vocab_size, args.seed, device)
    record["build_s"] = round(time.perf_counter() - t0, 2)
    losses, warm_s = [], []
    for ids in batches[:args.warmup]:
        t = time.perf_counter()
        losses.append(train_step(model, optimizer, ids))
        if cuda:
            torch.cuda.synchronize()
        warm_s.append(time.perf_counter() - t)
    record["warmup_s"] = [round(s, 3) for s in warm_s]
    per_step = warm_s[-1] if warm_s else 0.0  # the last warm-up step: compiled by then, unless it was the only one
    print(f"  {tag(record)}: built in {record['build_s']:.1f} s, warm-up {sum(warm_s):.1f} s (first step "
          f"{warm_s[0] if warm_s else 0:.1f} s); about {(args.steps + 2) * per_step + 2:.0f} s more "
          f"({args.steps} timed steps + 2 at ~{per_step * 1e3:.0f} ms{', at most' if len(warm_s) < 2 else ''})",
          flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    timed, ms = timed_steps(model, optimizer, batches[args.warmup:args.warmup + args.steps], cuda)
    losses += timed
    record["step_ms_all"] = [round(m, 3) for m in ms]
    record["step_ms"] = statistics.median(ms)
    record["tokens_per_s"] = args.tokens / (record["step_ms"] / 1e3)
    if cuda:
        record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        loss, record["moe_share"], record["moe_fwd_ms"], record["moe_bwd_ms"], record["instrumented_step_ms"] = \
            moe_share_step(model, optimizer, batches[-2])
        losses.append(loss)
    else:
        losses.append(train_step(model, optimizer, batches[-2]))  # the same steps, no events on the CPU
    loss, record["kernels"], record["kernels_total_ms"], record["kernels_of"] = \
        profiled_step(model, optimizer, batches[-1], cuda)
    losses.append(loss)
    record["losses"] = torch.stack(losses).float().tolist()


def measure_determinism(record, cfg, args, device):
    """Two runs of --steps steps from --seed, a fresh model and optimizer each; identical: torch.equal of the
    two runs' loss tensors."""
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    runs = []
    for run in range(2):
        model = build_model(cfg, device, args.dtype, args.seed)
        set_impl(model, record["impl"], record["precision"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda)
        batches = make_batches(args.steps, args.batch, args.seq, cfg.vocab_size, args.seed, device)
        runs.append(torch.stack([train_step(model, optimizer, ids) for ids in batches]))
        del model, optimizer, batches
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        print(f"  {tag(record)}: run {run + 1} of 2 done at {time.perf_counter() - t0:.0f} s", flush=True)
    record["identical"] = torch.equal(runs[0], runs[1])
    record["max_abs_diff"] = (runs[0].float() - runs[1].float()).abs().max().item()
    record["losses"], record["losses_run2"] = runs[0].float().tolist(), runs[1].float().tolist()


# -----------------------------------------------------------------------------
# records


def env_info(device):
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=gpu, torch=torch.__version__,
                triton=triton_version, transformers=transformers.__version__, serval_commit=commit)


def base_record(kind, name, impl, precision, cfg, args, info):
    return dict(kind=kind, model=name, impl=impl, precision=precision, tokens=args.tokens, batch=args.batch,
                seq=args.seq, layers=cfg.num_hidden_layers, dtype=str(args.dtype).replace("torch.", ""),
                steps=args.steps, warmup=args.warmup if kind == "throughput" else None, seed=args.seed,
                lr=args.lr, tokens_per_s=None, step_ms=None, peak_mem_gib=None, moe_share=None, losses=None,
                error=None, config=config_summary(cfg), **info)


def key(record):
    return record["kind"], record["model"], record["impl"], record["precision"]


def load_records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def merge_records(records, path):
    """Write path's records with these merged in: each replaces the one of its key (kind, model, impl,
    precision), the others are kept in their order; called after each record, so a killed call keeps its own."""
    new = {key(r): r for r in records}
    old = [r for r in load_records(path) if key(r) not in new]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(old + records, f, indent=1)
    os.replace(path + ".tmp", path)  # a call killed while writing leaves the previous file


def tag(record):
    return f"{record['model']} {label(record)}"


def label(record):
    return record["impl"] if record["impl"] != "serval" else f"serval {record['precision']}"


def speedups(records):
    """{key: tokens/s over grouped_mm's of the same model}, where both were measured."""
    base = {r["model"]: r["tokens_per_s"] for r in records if r["impl"] == "grouped_mm" and r["tokens_per_s"]}
    return {key(r): r["tokens_per_s"] / base[r["model"]] for r in records
            if r["tokens_per_s"] and r["model"] in base}


def print_table(records):
    throughput = [r for r in records if r["kind"] == "throughput"]
    up = speedups(throughput)
    columns = ("tokens/s", 11), ("step ms", 10), ("peak GiB", 10), ("moe share", 11), ("x grouped_mm", 14)
    print(f"\n{'model':<18}{'impl':<22}" + "".join(f"{c:>{w}}" for c, w in columns) if throughput else "")
    for r in throughput:
        if r["error"]:
            print(f"{r['model']:<18}{label(r):<22}  error: {r['error'][:70]}")
            continue
        share = f"{r['moe_share']:.1%}" if r["moe_share"] is not None else "-"
        peak = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        x = f"{up[key(r)]:.2f}x" if key(r) in up else "-"
        print(f"{r['model']:<18}{label(r):<22}{r['tokens_per_s']:>11.0f}{r['step_ms']:>10.1f}{peak:>10}{share:>11}"
              f"{x:>14}")
    for r in records:
        if r["kind"] == "determinism":
            result = f"error: {r['error'][:80]}" if r["error"] else \
                f"{'bitwise identical' if r['identical'] else 'DIFFER'} (max |diff| {r['max_abs_diff']:.3g})"
            print(f"determinism {r['model']} {label(r)}, {r['steps']} steps twice: {result}")


def chart(records, path):
    """tokens/s per model (one panel each) and implementation, speedup over grouped_mm on each bar."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no chart")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = [r for r in records if r["kind"] == "throughput" and r["tokens_per_s"]]
    models = list(dict.fromkeys(r["model"] for r in throughput))
    if not models:
        print("no throughput records: no chart")
        return
    up = speedups(throughput)
    labels = sorted({label(r) for r in throughput})  # one colour per implementation across panels
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = [r for r in throughput if r["model"] == model]
        bars = ax.bar(range(len(rs)), [r["tokens_per_s"] for r in rs],
                      color=[f"C{labels.index(label(r))}" for r in rs])
        ax.bar_label(bars, labels=[f"{r['tokens_per_s'] / 1e3:.1f}k" + (f"\n{up[key(r)]:.2f}x" if key(r) in up
                                                                         else "") for r in rs], fontsize=8)
        ax.set_xticks(range(len(rs)), [label(r) for r in rs], rotation=20, fontsize=8)
        c = rs[0]["config"]
        ax.set_title(f"{model}\n{c['layers']} layers, {rs[0]['tokens']} tokens/step", fontsize=9)
        ax.set_ylabel("tokens/s (training step)")
        ax.margins(y=0.2)
    fig.suptitle(f"End-to-end training step, {throughput[0]['gpu']} (x: over grouped_mm)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# -----------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)} (default: all; "
                        "--determinism: qwen3-30b-a3b)")
    parser.add_argument("--impls", default=None, help=f"comma-separated, of {', '.join(IMPLS)} "
                        "(default grouped_mm,serval)")
    parser.add_argument("--precisions", default=None, help=f"serval's, of {', '.join(PRECISIONS)} "
                        "(default bf16,fp8_blockwise; --determinism: bf16)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; deepseek-v3-like 2)")
    parser.add_argument("--experts", type=int, default=None, help="routed experts (default: the model's)")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (batch = tokens / seq)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --determinism: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (Triton compiles)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--determinism", action="store_true", help="the determinism check instead (docstring)")
    parser.add_argument("--out", default=None, help="JSON to merge into (default benchmarks/results/h200_e2e.json; "
                        "--smoke: bench_e2e_smoke.json in the temp folder)")
    parser.add_argument("--chart", nargs="?", const="", default=None, help="PNG (default: --out with .png)")
    parser.add_argument("--report-only", action="store_true", help="measure nothing: the table (and --chart)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 16 tokens, 2 steps (fp32 on the CPU): "
                        "seconds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.models = (args.models or ("qwen3-30b-a3b" if args.determinism else ",".join(MODELS))).split(",")
    args.impls = (args.impls or "grouped_mm,serval").split(",")
    args.precisions = (args.precisions or ("bf16" if args.determinism else "bf16,fp8_blockwise")).split(",")
    for given, known, what in [(args.models, MODELS, "model"), (args.impls, IMPLS, "impl"),
                               (args.precisions, PRECISIONS, "precision")]:
        if set(given) - set(known):
            parser.error(f"unknown {what} {sorted(set(given) - set(known))}; known: {', '.join(known)}")
    if args.smoke:
        args.tokens, args.seq, args.vocab = 16, 8, 128
        args.steps = args.steps or 2
        args.warmup = min(args.warmup, 1)
    args.steps = args.steps or (20 if args.determinism else 10)
    if args.tokens % args.seq:
        parser.error(f"--tokens {args.tokens} is not a multiple of --seq {args.seq}")
    args.batch = args.tokens // args.seq
    # fp32 on the CPU's smoke test: the implementations agree within fp32 rounding there
    args.dtype = torch.float32 if args.smoke and args.device == "cpu" else torch.bfloat16
    if args.out is None:
        args.out = os.path.join(tempfile.gettempdir(), "bench_e2e_smoke.json") if args.smoke else \
            os.path.join(ROOT, "benchmarks", "results", "h200_e2e.json")
    return args


def main():
    args = parse_args()
    device = torch.device(args.device)
    if args.determinism:
        torch.use_deterministic_algorithms(True)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # bench_layer, for SonicMoE's autotuning cap
    if not args.report_only:
        info = env_info(device)
        print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}, transformers {info['transformers']}, "
              f"serval {info['serval_commit']}; {args.tokens} tokens per step ({args.batch} x {args.seq}), vocab "
              f"{args.vocab} (reduced: the LM head is not a per-layer size), {args.dtype}"
              + (", deterministic algorithms" if args.determinism else ""), flush=True)
        runs = []
        for impl in args.impls:
            reason = load_impl(impl)
            if reason:
                print(f"skip {impl}: {reason}", flush=True)
                continue
            runs += [(impl, p) for p in (args.precisions if impl == "serval" else ["bf16"])]
        for name in args.models:
            cfg = model_config(name, args.layers, args.experts, args.vocab, args.seq, args.smoke)
            est = memory_estimate(cfg, args.tokens, args.dtype)
            print(f"{name}: {config_summary(cfg)}\n  memory estimate, GiB: {est}", flush=True)
            for impl, precision in runs:
                record = run_record("determinism" if args.determinism else "throughput", name, cfg, impl,
                                    precision, args, device, info)
                record["mem_estimate_gib"] = est
                merge_records([record], args.out)
                result = f"ERROR {record['error'][:300]}" if record["error"] else \
                    (f"identical={record['identical']}" if args.determinism else
                     f"{record['tokens_per_s']:.0f} tokens/s, {record['step_ms']:.1f} ms/step")
                print(f"  {tag(record)}: {result} ({record['wall_s']:.0f} s)", flush=True)
    records = load_records(args.out)
    print(f"\n{args.out}: {len(records)} records")
    if args.chart is not None and records:
        chart(records, args.chart or os.path.splitext(args.out)[0] + ".png")
    print_table(records)


if __name__ == "__main__":
    main()
