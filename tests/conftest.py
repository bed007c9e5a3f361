"""Test setup: Triton's CPU interpreter where there is no GPU, NaN-poisoned kernel outputs, shared helpers.

The environment must be set before triton or serval is imported.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SERVAL_POISON_OUTPUTS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
requires_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                          reason="Triton kernels on CPU tensors need the interpreter")


def make_routing(num_tokens, num_experts, top_k, *, kind="random", device="cpu", dtype=torch.float32, seed=0):
    """(router_weights [N, k], topk_ids [N, k]) with k distinct experts per token.

    kind: "random"; "skewed" (every token's first slot on expert 0); "empty" (only the first
    k + 1 experts used; requires num_experts > top_k + 1 to leave some empty); "one" (k = 1, all on expert 0).
    """
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if kind == "skewed":
        scores[:, 0] = 2.0
    elif kind == "empty":
        scores[:, top_k + 1:] = -1.0
    elif kind == "one":
        scores[:, 0] = 2.0
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.1
    return weights.to(device=device, dtype=dtype), ids.to(device)


def make_layer(num_tokens, hidden, inter, num_experts, *, shared_inter=0, device="cpu", dtype=torch.float32,
               seed=0, scale=1.0):
    """x and weights for one layer, scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) * scale / fan_in ** 0.5).to(device=device, dtype=dtype)

    x = torch.randn(num_tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    weights = [rand(num_experts, inter, hidden, fan_in=hidden), rand(num_experts, inter, hidden, fan_in=hidden),
               rand(num_experts, hidden, inter, fan_in=inter)]
    shared = None
    if shared_inter:
        shared = (rand(shared_inter, hidden, fan_in=hidden), rand(shared_inter, hidden, fan_in=hidden),
                  rand(hidden, shared_inter, fan_in=shared_inter))
    return x, weights, shared


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# The Gluon engines' cases (tests/test_gluon_pingpong.py, test_gluon_cooperative.py): several tiles per consumer and
# N-tiles; a partial last N-tile (inter 200, hidden 320); empty experts; k = 1 on one expert; one token
GLUON_CASES = {
    "several tiles": dict(num_tokens=300, top_k=2, num_experts=3, hidden=256, inter=384),
    "partial tiles": dict(num_tokens=97, top_k=4, num_experts=8, hidden=320, inter=200),
    "one expert": dict(num_tokens=150, top_k=1, num_experts=4, hidden=128, inter=256, skew=True),
    "one token": dict(num_tokens=1, top_k=2, num_experts=4, hidden=128, inter=128),
    "rows of 8 mod 16": dict(num_tokens=130, top_k=2, num_experts=3, hidden=136, inter=136),  # 16-byte rows only
}


def cuda_topk(num_tokens, top_k, num_experts, skew, generator):
    """[N, k] expert ids on the GPU: random distinct, or (skew) every token on experts 0..k-1, the rest empty."""
    if skew:
        return torch.arange(top_k, device="cuda").expand(num_tokens, top_k)
    return torch.rand(num_tokens, num_experts, generator=generator, device="cuda").topk(top_k, dim=1).indices


def cuda_layer_step():
    """A bf16 training step of serval.moe on the GPU (512 tokens, H 256, I 128, 8 experts, k 2, a shared
    expert): step(config=None) returns (y, every input's gradient)."""
    import serval

    x, (wg, wu, wd), shared = make_layer(512, 256, 128, 8, shared_inter=128, device="cuda", dtype=torch.bfloat16)
    rw, ids = make_routing(512, 8, 2, device="cuda")
    d_y = torch.randn_like(x)

    def step(config=None):
        # fresh leaves each step: autograd syncs a gradient to the stream its leaf's accumulator was
        # made on, and one made on the default stream outside a capture breaks the capture
        leaves = [t.detach().requires_grad_() for t in (x, rw, wg, wu, wd, *shared)]
        y = serval.moe(leaves[0], leaves[1], ids, *leaves[2:5], tuple(leaves[5:]), config=config)
        return (y, *torch.autograd.grad(y, leaves, d_y))

    return step


def check_sync_free_and_graph_replay(step, eager):
    """step() runs no host sync (torch's sync debug mode raises on one), and a CUDA-graph capture of it
    replays to `eager`, its eager result, bit for bit."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))
