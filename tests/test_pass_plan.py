"""The pass plan (`serval.pass_plan`): one decision per call, from the Config, the kernel plan, the precision and the
workspace, and its printable form."""

import dataclasses
import types

import pytest
import torch

import serval
from serval import pass_plan, stages
from serval.kernels import KernelStages
from serval.plan import KernelPlan

from conftest import CUDA

# where the kernels run: the GPU, else the CPU through Triton's interpreter (conftest sets it there)
DEVICE = "cuda" if CUDA else "cpu"


def _plan(config, *, ep_size=1, ring_rows=0, capacity_rows=0, inter=128, shared=False):
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    w_gate = torch.zeros(2, inter, 64, dtype=torch.bfloat16, device=DEVICE)
    workspace = None
    if ep_size > 1:  # what the plan reads of an EP workspace
        workspace = types.SimpleNamespace(transport=object(), ep_size=ep_size, ring_rows=ring_rows,
                                          capacity_rows=capacity_rows)
    shared_weights = None
    if shared:
        shared_weights = tuple(torch.zeros(*size, device=DEVICE) for size in ((32, 64), (32, 64), (64, 32)))
    return pass_plan.plan_pass(config, x, w_gate, shared_weights, workspace)


def test_torch_stages_run_staged_and_gathered():
    plan = _plan(serval.Config(backend="torch"))
    assert plan.ops is stages and plan.recipe is None and plan.ep_size == 1
    for direction in (plan.forward, plan.backward):
        assert (direction.strategy, direction.rows_in, direction.rows_out) == ("staged", "gathered", "stored")
    text = str(plan)
    assert "routed experts in bfloat16 on the torch stages, EP=1" in text and "forward: staged" in text


def kernel_config(precision="bf16", **plan):
    return serval.Config(backend="triton", precision=precision, block_m=128, kernel_plan=KernelPlan(**plan))


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_fused_passes_take_the_shared_expert_into_the_launch(precision):
    plan = _plan(kernel_config(precision, fused_forward=True, fused_backward=True), shared=True)
    assert isinstance(plan.ops, KernelStages)
    assert plan.forward.strategy == plan.backward.strategy == "fused"
    assert plan.forward.shared_in_launch and plan.backward.shared_in_launch
    assert "the shared expert's tiles in the routed launch" in str(plan)


def test_fp8_blockwise_runs_staged_and_moves_rows_around_its_gemms():
    plan = _plan(kernel_config("fp8_blockwise", fused_forward=True, pull_programs=8), ep_size=2, ring_rows=1024,
                 capacity_rows=1024)
    assert plan.forward == pass_plan.Direction("staged", "staged", "pulled", "pushed", False)
    assert "x's rows pulled, o's rows pushed" in str(plan)


def test_expert_parallel_rows_by_the_gemms_and_the_ring():
    config = kernel_config("mxfp8", pull_programs=8)
    plan = _plan(config, ep_size=4, ring_rows=512, capacity_rows=4096)
    assert plan.forward == pass_plan.Direction("streamed", "staged", "pulled by the GEMM", "pushed by the GEMM",
                                               False)
    assert plan.backward.rows_in == "pulled" and plan.ring_rows == 512
    assert "EP=4, ring of 512 rows" in str(plan) and "streamed, each window staged" in str(plan)
    whole = _plan(config, ep_size=4, ring_rows=4096, capacity_rows=4096)  # the ring holds the worst case
    assert whole.forward.strategy == "staged" and whole.ring_rows == 0


def test_mxfp8_backward_fuses_only_whole_blocks():
    plan = _plan(kernel_config("mxfp8", fused_backward=True), inter=48)  # d_gate_up's 32-blocks straddle gate|up
    assert plan.backward.strategy == "staged"
    assert _plan(kernel_config("mxfp8", fused_backward=True), inter=64).backward.strategy == "fused"


def test_the_kernels_pass_quantizes_with_the_kernels():
    """An FP8 pass on the kernels quantizes with the quantizer kernels (on the CPU too, in the interpreter); on the
    torch stages, as the tensors' device says."""
    assert _plan(kernel_config("mxfp8")).recipe.quantize_backend == "triton"
    assert _plan(kernel_config("fp8_blockwise")).recipe.quantize_backend == "triton"
    assert _plan(serval.Config(backend="torch", precision="mxfp8")).recipe.quantize_backend == "auto"


def test_comm_sms_leave_compute_sms():
    pass_plan._check_comm_sms(serval.Config(comm_sms_forward=131), 132)
    with pytest.raises(ValueError, match="comm_sms_backward must be below the GPU's 132 SMs"):
        pass_plan._check_comm_sms(serval.Config(comm_sms_backward=132), 132)


def test_plan_is_frozen():
    plan = _plan(serval.Config(backend="torch"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.forward = plan.backward
