"""
Predict one rank's time at EP = P (default 8) for the staged path, NCCL all_to_all + grouped GEMMs and the fused
kernel (`serval.overlap`), from figures measured on one and two H200s; no GPU needed.

Inputs (benchmarks/results/):
  h200_layer.json       EP=1, the contract's single-GPU shapes: serval's and torch grouped_mm's routed fwd and
                        fwd+bwd rates (the newest of each); the compute rate at that many rows per expert
  h200x2_ep.json        EP=2, the multi-GPU shapes: serval's staged forward by stage (schedule, dispatch,
                        gate/up, down + combine) and fwd+bwd total; nccl_a2a's fwd and fwd+bwd totals
  h200x2_ceilings.json  EP=2: NCCL all_to_all and the pull with c communication SMs (c = 4 .. 64), GB/s per rank
  h200_fused_forward.json, h200_fused_passes.json
                        EP=1: the fused kernel's compute against the staged path's (forward GEMMs; the layer's
                        fwd and fwd+bwd, staged and with both passes fused)
How the rates are derived (each an assumption the EP=8 run must check):
  * compute (no communication), forward: EP=2's gate/up + down stages minus the combine push (its bytes at the
    EP=2 push ceiling); backward: that times the backward/forward rate ratio at EP=1. At EP=P the rate is
    interpolated in log(rows per expert) between EP=2's and the EP=1 shape's rows per expert (more rows per
    expert, fuller tiles); beyond EP=1's it is EP=1's.
  * the staged transfers: the rate that makes the model give EP=2's measured fwd+bwd total.
  * NCCL: the all_to_all ceiling at the rank's row count; torch's compute: the rate that makes the model give
    EP=2's measured nccl_a2a fwd+bwd total, scaled to EP=P as serval's compute.
  * the link rates at EP=P per rank are EP=2's (an NVSwitch host gives every GPU the same NVLink bandwidth to
    all peers together; not measured at P > 2).
  * the fused kernel computes at its EP=1 ratio to the staged path: forward, its GEMMs' (fused at MoK's minibatch
    against the two staged launches, the newest run); backward, the layer's backward (fwd+bwd less fwd) staged over
    with both passes fused, all four from one run; shapes not measured take the mean of those that were.

  python tools/ep_cost_model.py                   # EP=8 (and EP=2 against what was measured)
  python tools/ep_cost_model.py --ep 4 --out /tmp/ep4.json
"""

import argparse
import datetime
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from shapes import EP_SHAPES, SHAPES  # noqa: E402

from serval import overlap  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def load(name):
    return json.load(open(os.path.join(RESULTS, name)))


def newest(records, **match):
    found = [r for r in records if all(r.get(k) == v for k, v in match.items()) and r.get("ms")]
    return max(found, key=lambda r: r["date"]) if found else None


def interpolate(rows, rows_a, rate_a, rows_b, rate_b):
    """The rate at `rows` per expert, linear in log(rows) between two measured points, held beyond them."""
    if rows <= min(rows_a, rows_b):
        return rate_a if rows_a < rows_b else rate_b
    if rows >= max(rows_a, rows_b):
        return rate_a if rows_a > rows_b else rate_b
    t = (math.log(rows) - math.log(rows_a)) / (math.log(rows_b) - math.log(rows_a))
    return rate_a + t * (rate_b - rate_a)


def model_inputs(name, layer, ep2, ceilings):
    """Rates of one shape at EP=2 and the EP=1 anchor: {compute_ep2, compute_ep1, rows_ep1, ...}."""
    spec = SHAPES[name]
    shape = EP_SHAPES[name]
    p2 = overlap.Problem(shape.tokens, shape.top_k, shape.hidden, shape.inter, shape.experts, 2)
    fwd = newest(ep2, shape=name, impl="serval", scope="routed", **{"pass": "fwd"})
    stages = fwd["stage_ms"]
    pushes = [r["gbps"] for r in ceilings if r["impl"] == "push" and r["mode"] == "all"]
    push_gbps = max(pushes)
    compute_fwd_ms = stages["gate_up"] + stages["down_combine"] - p2.transfer_bytes() / (push_gbps * 1e6)
    ep1_fwd = newest(layer, shape=name, impl="serval", scope="routed", **{"pass": "fwd"})
    ep1_all = newest(layer, shape=name, impl="serval", scope="routed", **{"pass": "fwdbwd"})
    bwd_over_fwd = (2 * ep1_fwd["ms"] / (ep1_all["ms"] - ep1_fwd["ms"]))  # backward rate / forward rate at EP=1
    rate_fwd_ep2 = p2.flops(False) / (compute_fwd_ms * 1e9)
    torch_fwd = newest(layer, shape=name, impl="torch_grouped_mm", scope="routed", **{"pass": "fwd"})
    torch_all = newest(layer, shape=name, impl="torch_grouped_mm", scope="routed", **{"pass": "fwdbwd"})
    return dict(
        rows_ep2=p2.rows_per_expert, rate_fwd_ep2=rate_fwd_ep2, rate_bwd_ep2=rate_fwd_ep2 * bwd_over_fwd,
        rows_ep1=spec.tokens * spec.top_k / spec.experts, rate_fwd_ep1=ep1_fwd["tflops"],
        rate_bwd_ep1=ep1_fwd["tflops"] * bwd_over_fwd, schedule_ms=stages["schedule"],
        torch_ratio=(torch_fwd["tflops"] / ep1_fwd["tflops"], torch_all["tflops"] / ep1_all["tflops"]),
        ep2_serval_ms=newest(ep2, shape=name, impl="serval", scope="routed", **{"pass": "fwdbwd"})["ms"],
        ep2_nccl_ms=newest(ep2, shape=name, impl="nccl_a2a", scope="routed", **{"pass": "fwdbwd"})["ms"])


def fused_ratios(names, layer, fused_forward, fused_passes):
    """{shape: (forward, backward)}: the fused kernel's compute rate over the staged path's at EP=1."""
    measured = {}
    for name in names:
        fwd = bwd = None
        staged = newest(fused_forward, shape=name, impl="staged")
        fused = staged and newest(fused_forward, shape=name, impl="fused", minibatch="mok", date=staged["date"])
        if fused:
            fwd = staged["ms"] / fused["ms"]
        # backward = fwd+bwd - fwd, the staged layer and the one with both passes fused, of one run
        fused_all = newest(fused_passes, shape=name, impl="serval (fused passes)", scope="routed",
                           **{"pass": "fwdbwd"})
        if fused_all:
            run = dict(shape=name, scope="routed", date=fused_all["date"])
            fused_fwd = newest(fused_passes, impl="serval (fused passes)", **run, **{"pass": "fwd"})
            staged_all = newest(fused_passes, impl="serval", **run, **{"pass": "fwdbwd"})
            staged_fwd = newest(fused_passes, impl="serval", **run, **{"pass": "fwd"})
            if fused_fwd and staged_all and staged_fwd:
                bwd = (staged_all["ms"] - staged_fwd["ms"]) / (fused_all["ms"] - fused_fwd["ms"])
        measured[name] = (fwd, bwd)
    means = [sum(v) / len(v) if v else 1.0 for v in ([r[i] for r in measured.values() if r[i]] for i in (0, 1))]
    return {name: tuple(r[i] or means[i] for i in (0, 1)) for name, r in measured.items()}


def rates_at(inputs, problem, ceilings, staged_gbps, nccl_gbps, nccl_scale, fused_ratio):
    rows = problem.rows_per_expert
    fwd = interpolate(rows, inputs["rows_ep2"], inputs["rate_fwd_ep2"], inputs["rows_ep1"], inputs["rate_fwd_ep1"])
    bwd = interpolate(rows, inputs["rows_ep2"], inputs["rate_bwd_ep2"], inputs["rows_ep1"], inputs["rate_bwd_ep1"])
    comm = {}
    for r in ceilings:  # the communication programs' sweep, all ranks moving at once, the best row width
        if r["impl"].startswith("comm") and r["mode"] == "all":
            c = int(r["impl"][4:])
            comm[c] = max(comm.get(c, 0.0), r["gbps"])
    return overlap.Rates(compute_tflops=(fwd, bwd), staged_gbps=staged_gbps, nccl_gbps=nccl_gbps,
                         nccl_compute_tflops=(fwd * nccl_scale[0], bwd * nccl_scale[1]), comm_gbps=comm,
                         schedule_ms=inputs["schedule_ms"], fused_compute_ratio=fused_ratio)


def calibrate(inputs, ceilings):
    """(staged GB/s, NCCL GB/s, torch/serval compute scale (fwd, bwd)) that reproduce EP=2's measured totals."""
    name = inputs["name"]
    shape = EP_SHAPES[name]
    p2 = overlap.Problem(shape.tokens, shape.top_k, shape.hidden, shape.inter, shape.experts, 2)
    compute = p2.flops(False) / (inputs["rate_fwd_ep2"] * 1e9) + p2.flops(True) / (inputs["rate_bwd_ep2"] * 1e9)
    transfers = (overlap.FORWARD_TRANSFERS + overlap.BACKWARD_TRANSFERS) * p2.transfer_bytes()
    staged_gbps = transfers / ((inputs["ep2_serval_ms"] - inputs["schedule_ms"] - compute) * 1e6)
    nccl = sorted((r["rows"], r["gbps"]) for r in ceilings if r["impl"] == "nccl_a2a")
    nccl_gbps = min(nccl, key=lambda rg: abs(rg[0] - p2.rows / 2))[1]  # the ceiling at the rows each rank sends
    torch_compute = inputs["ep2_nccl_ms"] - transfers / (nccl_gbps * 1e6)
    scale = compute / torch_compute  # torch's rate over serval's, both passes together
    return staged_gbps, nccl_gbps, (scale, scale)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ep", type=int, default=8)
    parser.add_argument("--shapes", default=",".join(EP_SHAPES))
    parser.add_argument("--out", default=os.path.join(RESULTS, "ep_model_predictions.json"))
    args = parser.parse_args()
    layer, ep2, ceilings = load("h200_layer.json"), load("h200x2_ep.json"), load("h200x2_ceilings.json")
    ratios = fused_ratios(SHAPES, layer, load("h200_fused_forward.json"), load("h200_fused_passes.json"))
    records = []
    print(f"{'shape':<16}{'EP':>3}{'pass':>8}{'staged':>9}{'nccl':>9}{'fused':>9}{'comm SMs':>10}{'minibatch':>10}"
          f"{'compute':>9}{'hidden':>8}{'fused/nccl':>11}   (ms per rank; EP=2 measured: staged, nccl)")
    for name in args.shapes.split(","):
        inputs = dict(model_inputs(name, layer, ep2, ceilings), name=name)
        staged_gbps, nccl_gbps, nccl_scale = calibrate(inputs, ceilings)
        shape = EP_SHAPES[name]
        for ep in sorted({2, args.ep}):
            problem = overlap.Problem(shape.tokens, shape.top_k, shape.hidden, shape.inter, shape.experts, ep)
            rates = rates_at(inputs, problem, ceilings, staged_gbps, nccl_gbps, nccl_scale, ratios[name])
            total = {"staged": 0.0, "nccl": 0.0, "fused": 0.0, "compute": 0.0, "comm_staged": 0.0}
            choice = {}
            for backward in (False, True):
                pass_name = "bwd" if backward else "fwd"
                ms, comm_sms, minibatch = overlap.best_fused(problem, rates, backward)
                choice[pass_name] = dict(comm_sms=comm_sms, minibatch_rows=minibatch)
                total["fused"] += ms
                total["staged"] += overlap.staged_ms(problem, rates, backward)
                total["nccl"] += overlap.nccl_ms(problem, rates, backward)
                total["compute"] += problem.flops(backward) / (rates.compute_tflops[backward] * 1e9)
                transfers = overlap.BACKWARD_TRANSFERS if backward else overlap.FORWARD_TRANSFERS
                total["comm_staged"] += transfers * problem.transfer_bytes() / (rates.staged_gbps * 1e6)
            hidden = 1 - (total["fused"] - total["compute"] - rates.schedule_ms) / total["comm_staged"]
            measured = f"{inputs['ep2_serval_ms']:.2f}, {inputs['ep2_nccl_ms']:.2f}" if ep == 2 else ""
            print(f"{name:<16}{ep:>3}{'fwdbwd':>8}{total['staged']:>9.2f}{total['nccl']:>9.2f}{total['fused']:>9.2f}"
                  f"{choice['fwd']['comm_sms']:>6}/{choice['bwd']['comm_sms']:<3}{choice['fwd']['minibatch_rows']:>10}"
                  f"{total['compute']:>9.2f}{hidden:>8.0%}{total['nccl'] / total['fused']:>10.2f}x   {measured}")
            flops = problem.flops(False) + problem.flops(True)
            records.append(dict(shape=name, ep=ep, pass_="fwdbwd", staged_ms=total["staged"], nccl_ms=total["nccl"],
                                fused_ms=total["fused"], compute_ms=total["compute"], comm_hidden=hidden,
                                fused_tflops=flops / (total["fused"] * 1e9),
                                nccl_tflops=flops / (total["nccl"] * 1e9), choice=choice,
                                rates=dict(compute_tflops=rates.compute_tflops, staged_gbps=staged_gbps,
                                           nccl_gbps=nccl_gbps, nccl_compute_tflops=rates.nccl_compute_tflops,
                                           comm_gbps=rates.comm_gbps, fused_compute_ratio=rates.fused_compute_ratio),
                                measured_ep2=dict(staged_ms=inputs["ep2_serval_ms"], nccl_ms=inputs["ep2_nccl_ms"])
                                if ep == 2 else None,
                                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")))
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
