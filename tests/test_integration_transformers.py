"""serval as transformers' experts implementation ("serval") against transformers' own, on tiny random models (CPU).

Each model family whose experts serval computes (Qwen3-MoE, Qwen2-MoE with its gated shared expert, OLMoE, Mixtral,
DeepSeek-V3 with group-limited routing and a shared expert) gives the loss and every parameter's gradient of the
default `grouped_mm` within fp32 rounding; the joined gate_up_proj is read and its gradient written in place (no
copy of either); experts serval does not compute (GPT-OSS, another activation) are refused by name; the FP8
precisions quantize the weights once per optimizer step with no help; expert parallelism through transformers'
own `DistributedConfig(ep_implementation="serval")` on two gloo processes.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from serval.integrations import TRANSFORMERS_MIN

transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN)

import serval  # noqa: E402
from serval.integrations import transformers as serval_transformers  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _configs():
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(**TINY, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
                                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        "qwen2_moe": transformers.Qwen2MoeConfig(**TINY, intermediate_size=48, moe_intermediate_size=24,
                                                 shared_expert_intermediate_size=40, num_experts=8,
                                                 num_experts_per_tok=2),
        "olmoe": transformers.OlmoeConfig(**TINY, intermediate_size=24, num_experts=8, num_experts_per_tok=2),
        "mixtral": transformers.MixtralConfig(**TINY, head_dim=8, intermediate_size=24, num_local_experts=4,
                                              num_experts_per_tok=2),
        "deepseek_v3": transformers.DeepseekV3Config(
            **TINY, intermediate_size=48, moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=0, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5),
    }


def tiny_model(name, dtype=torch.float32, seed=0):
    """A transformers causal LM of the family `name` with every parameter random (the router too, so that the
    routing is not uniform) and a random DeepSeek-V3 correction bias."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_configs()[name]).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
        for name_, buffer in model.named_buffers():
            if "e_score_correction_bias" in name_:
                buffer.normal_(0, 0.1)
    return model


def loss_and_grads(model, tokens):
    loss = model(input_ids=tokens, labels=tokens).loss
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3"])
def test_model_matches_transformers_experts(name):
    model = tiny_model(name)
    tokens = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(model, tokens)
    serval_transformers.use_serval(model)
    assert model.config._experts_implementation == "serval"
    loss_serval, grads_serval = loss_and_grads(model, tokens)
    assert rel(loss_serval, loss) < 1e-6
    for g, g_ref in zip(grads_serval, grads):
        assert rel(g, g_ref) < 1e-5


def test_from_config_with_experts_implementation_and_config():
    """The one line: experts_implementation="serval" at model init; use_serval's Config reaches every call."""
    config = _configs()["qwen3_moe"]
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="serval")
    assert model.config._experts_implementation == "serval"
    chosen = serval.Config(block_m=32, backend="torch")
    serval_transformers.use_serval(model, chosen)
    seen = []
    real_moe = serval_transformers.moe

    def spy(*args, **kwargs):
        seen.append(kwargs["config"])
        return real_moe(*args, **kwargs)

    serval_transformers.moe = spy
    try:
        model(input_ids=torch.randint(0, 64, (1, 5)))
    finally:
        serval_transformers.moe = real_moe
    assert seen == [chosen] * config.num_hidden_layers


def test_joined_weight_read_and_written_in_place():
    """The kernels (here in Triton's interpreter) read gate_up_proj and write its gradient in place: no copy, cat
    or clone of an expert weight in the step, and the gradient is one [E, 2I, H] tensor."""
    model = tiny_model("qwen3_moe")
    serval_transformers.use_serval(model, serval.Config(backend="triton", block_m=16))
    experts = model.model.layers[0].mlp.experts
    weight_shapes = {tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape),
                     (experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[1] // 2, experts.gate_up_proj.shape[2])}
    tokens = torch.randint(0, 64, (1, 7))
    with torch.profiler.profile(record_shapes=True) as prof:
        model(input_ids=tokens, labels=tokens).loss.backward()
    copies = [(e.name, e.input_shapes) for e in prof.events()
              if e.name in ("aten::copy_", "aten::cat", "aten::clone", "aten::contiguous", "aten::slice_backward",
                            "aten::_to_copy")
              and any(tuple(s) in weight_shapes for s in e.input_shapes if isinstance(s, (list, tuple)))]
    assert not copies, copies
    grad = experts.gate_up_proj.grad
    assert grad.shape == experts.gate_up_proj.shape and grad.is_contiguous()


def test_older_transformers_is_refused_by_name():
    """An older transformers (without the interfaces serval registers with) is an ImportError at import that says
    which version is needed and how to get it, not a missing submodule deep in transformers."""
    with pytest.raises(ImportError, match=r"needs transformers>=5\.23 .*found 5\.0\.0: pip install 'serval\[trans"):
        serval_transformers.check_transformers_version("5.0.0")
    serval_transformers.check_transformers_version(transformers.__version__)


@pytest.mark.parametrize("name,reason", [("gpt_oss", "has_bias"), ("gelu", "activation")])
def test_unsupported_experts_are_refused(name, reason):
    if name == "gpt_oss":
        model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(
            **TINY, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))
    else:
        config = _configs()["qwen3_moe"]
        config.hidden_act = "gelu"
        model = transformers.AutoModelForCausalLM.from_config(config)
    before = model.config._experts_implementation
    with pytest.raises(ValueError, match=reason):
        serval_transformers.use_serval(model)
    assert model.config._experts_implementation == before  # nothing changed
    model.set_experts_implementation("serval")  # set behind use_serval's back: the call refuses
    with pytest.raises(ValueError, match=reason):
        model(input_ids=torch.randint(0, 64, (1, 5)))


def test_fp8_weights_quantized_once_per_step(monkeypatch):
    """fp8_blockwise through the hook: two micro-batches, an optimizer step, two more: the expert weights are
    quantized once per layer per step (the cache keyed by their version), and the results are those of
    quantizing in every call."""
    config = transformers.Qwen3MoeConfig(**{**TINY, "hidden_size": 128}, head_dim=32, intermediate_size=64,
                                         moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    serval_transformers.use_serval(model, serval.Config(precision="fp8_blockwise", backend="torch"))
    calls = []
    real = serval.precision.expert_weights
    monkeypatch.setattr(serval.precision, "expert_weights", lambda *a: calls.append(1) or real(*a))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    losses = []
    for step in range(2):
        for micro in tokens:
            loss = model(input_ids=micro[None], labels=micro[None]).loss
            loss.backward()
            losses.append(loss.detach())
        assert len(calls) == (step + 1) * config.num_hidden_layers
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(torch.stack(losses)).all()
    # with the cache (the weights changed: quantized again) and without it (quantized in the call): the same bits
    cached = model(input_ids=tokens, labels=tokens).loss.detach()
    assert len(calls) == 3 * config.num_hidden_layers
    monkeypatch.setattr(serval.weight_cache, "usable", lambda: False)
    assert torch.equal(model(input_ids=tokens, labels=tokens).loss.detach(), cached)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ep_worker(rank, world_size, path, port):
    """One rank of transformers' EP (ep_size 2 over the data-parallel ranks, FSDP for the rest) with serval moving
    the rows: the loss of the rank's batch and the gradients (averaged over the ranks, as FSDP does) equal those of
    one process with transformers' own experts."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        from transformers.distributed import DistributedConfig

        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, experts_implementation="serval",
            distributed_config=DistributedConfig(ep_size=world_size, fsdp_size=world_size, ep_implementation="serval"))
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokens = torch.randint(0, 64, (2 * world_size, 9), generator=torch.Generator().manual_seed(5))
        batches = tokens.chunk(world_size)
        loss = model(input_ids=batches[rank], labels=batches[rank]).loss
        loss.backward()
        losses = [reference(input_ids=b, labels=b).loss for b in batches]
        assert rel(loss.detach(), losses[rank].detach()) < 1e-6
        (sum(losses) / world_size).backward()
        references = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            assert rel(grad, references[name].grad) < 1e-5, name
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_parallel_through_transformers(tmp_path):
    pytest.importorskip("accelerate")  # transformers' distributed loading needs it
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    mp.spawn(ep_worker, args=(2, str(tmp_path), _free_port()), nprocs=2, join=True)


def test_expert_parallel_implementation_is_registered():
    from transformers.distributed.expert_parallel import EPImplementationInterface

    assert EPImplementationInterface()["serval"] is serval_transformers.ServalEP
    assert "serval" in transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS
