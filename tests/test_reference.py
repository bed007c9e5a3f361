"""The oracle itself: serval.reference.moe against an independent per-token loop, and gradcheck."""

import torch

from conftest import make_layer, make_routing
from serval import reference


def loop_moe(x, router_weights, topk_ids, w_gate, w_up, w_down, shared, swiglu_limit):
    """The contract's formula (docs/CONTRACT.md), one token and one slot at a time."""
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        v = x[t]
        if shared is not None:
            ws_gate, ws_up, ws_down = shared
            gate, up = ws_gate @ v, ws_up @ v
            if swiglu_limit is not None:  # the shared expert is clamped too
                gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
            y[t] += ws_down @ (torch.nn.functional.silu(gate) * up)
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate, up = w_gate[e] @ v, w_up[e] @ v
            if swiglu_limit is not None:
                gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
            y[t] += router_weights[t, j] * (w_down[e] @ (torch.nn.functional.silu(gate) * up))
    return y


def test_reference_matches_loop():
    for limit, shared_inter in ((None, 0), (0.5, 6)):
        x, (wg, wu, wd), shared = make_layer(9, 12, 8, 5, shared_inter=shared_inter, dtype=torch.float64)
        rw, ids = make_routing(9, 5, 3, dtype=torch.float64)
        y = reference.moe(x, rw, ids, wg, wu, wd, shared, swiglu_limit=limit)
        torch.testing.assert_close(y, loop_moe(x, rw, ids, wg, wu, wd, shared, limit), rtol=1e-12, atol=1e-12)


def test_reference_gradcheck():
    x, (wg, wu, wd), shared = make_layer(5, 6, 4, 3, shared_inter=3, dtype=torch.float64)
    rw, ids = make_routing(5, 3, 2, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (x, rw, wg, wu, wd, *shared)]

    def f(x, rw, wg, wu, wd, *shared):
        return reference.moe(x, rw, ids, wg, wu, wd, shared, swiglu_limit=0.8)

    assert torch.autograd.gradcheck(f, inputs)
