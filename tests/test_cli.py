"""`python -m serval`: a bad option is one line saying what to change and exit code 2; --version; a tiny demo."""

import subprocess
import sys

import pytest
import torch

import serval
import serval.__main__ as cli
from serval.__main__ import build_parser, main


def cli_error(capsys, argv):
    """(exit code, stderr) of main(argv), which must exit through SystemExit."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["demo", "--steps", "-1"], "--steps: expected a positive integer, got -1"),
    (["demo", "--tokens", "0"], "--tokens: expected a positive integer, got 0"),
    (["demo", "--hidden", "x"], "--hidden: expected a positive integer, got 'x'"),
    (["demo", "--experts", "0"], "--experts"),
    (["demo", "--top-k", "9"], "--top-k: must be at most --experts (8), got 9"),
    (["demo", "--top-k", "3", "--experts", "2"], "--top-k: must be at most --experts (2), got 3"),
    (["demo", "--lr", "0"], "--lr: expected a positive finite number"),
    (["demo", "--log-every", "0"], "--log-every"),
    (["demo", "--seed", "-3"], "--seed: expected an integer >= 0"),
    (["demo", "--device", "tpu"], "--device: expected cpu, cuda or cuda:<index>"),
    (["demo", "--precision", "fp8_blockwise", "--inter", "96"], "--inter: precision='fp8_blockwise' needs"),
    ([], "COMMAND"),
])
def test_bad_option_is_one_line_and_exit_code_2(capsys, argv, expected):
    code, err = cli_error(capsys, argv)
    assert code == 2
    assert expected in err
    assert err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda(capsys):
    code, err = cli_error(capsys, ["demo", "--device", "cuda"])
    assert code == 2 and "--device: 'cuda': no CUDA device is available here" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"serval {serval.__version__}"


def test_every_option_has_help():
    parser = build_parser()
    parsers = [parser] + [p for action in parser._actions if isinstance(action.choices, dict)
                          for p in action.choices.values()]
    for p in parsers:
        for action in p._actions:
            assert action.help, f"{p.prog}: {action.option_strings or action.dest} has no help text"


def test_tiny_demo(capsys):
    assert main(["demo", "--device", "cpu", "--steps", "2", "--tokens", "16", "--hidden", "16", "--inter", "16",
                 "--experts", "4", "--top-k", "2", "--log-every", "1"]) == 0
    out = capsys.readouterr().out
    assert "step    2" in out and "losses yes, trained weights yes" in out


def test_module_entry_point_error_is_one_line():
    """The real `python -m serval` process: exit code 2 and one line on stderr, no traceback."""
    result = subprocess.run([sys.executable, "-m", "serval", "demo", "--steps", "0"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--steps" in result.stderr


TINY = ["demo", "--device", "cpu", "--steps", "2", "--tokens", "16", "--hidden", "16", "--inter", "16", "--experts", "4",
        "--top-k", "2", "--log-every", "1"]


def test_demo_says_what_runs(capsys):
    """On the CPU the bf16 precision trains in fp32, routed experts included: the first line and the pass plan say
    so."""
    assert main(TINY) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "on cpu (fp32 weights and activations, routed experts in fp32)" in lines[0], lines[0]
    # each run prints its pass plan (serval.functional.plan_pass), which names the experts' numerics too
    assert "serval pass plan: routed experts in float32 on the torch stages, EP=1" in lines[2], lines[2]


def test_diverged_demo_compares_bits_and_exits_3(capsys):
    """Two NaN runs with the same bits are bitwise identical (NaN != NaN as values); the divergence is reported
    and the exit code is 3, which the help documents."""
    assert main(TINY + ["--lr", "1e308"]) == cli.EXIT_DIVERGED == 3
    out = capsys.readouterr().out
    assert "losses yes, trained weights yes" in out
    assert "training diverged: the loss is not finite from step" in out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "3: identical, but training diverged" in " ".join(capsys.readouterr().out.split())


def test_same_bits():
    nan = torch.tensor([float("nan"), 1.0])
    assert cli.same_bits(nan, nan.clone()) and not torch.equal(nan, nan.clone())
    assert not cli.same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, other bits
    assert not cli.same_bits(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert cli.same_loss_bits([float("nan"), 0.5], [float("nan"), 0.5])
    assert not cli.same_loss_bits([0.5], [0.25])


def test_demo_that_does_not_fit_is_refused_in_one_line(capsys, monkeypatch):
    code, err = cli_error(capsys, ["demo", "--device", "cpu", "--hidden", "100000", "--inter", "100000"])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "the demo needs up to" in err and "GiB available" in err
    monkeypatch.setattr(cli, "available_memory_bytes", lambda device: 2 ** 30)
    code, err = cli_error(capsys, ["demo", "--device", "cpu", "--hidden", "20000", "--inter", "20000"])
    assert code == 2 and err.count("\n") == 1 and "and cpu has 1.0 GiB available" in err, err


def test_memory_estimate_grows_with_every_size():
    def estimate(*options):
        return cli.demo_memory_bytes(build_parser().parse_args(["demo", "--device", "cpu", *options]))
    base = estimate()
    for option in ("--hidden", "--inter", "--experts", "--tokens"):
        assert estimate(option, "1024") > base, option
    assert cli.available_memory_bytes("cpu") > 0


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to "
                 "allocate 80000000000 bytes.\nmore lines"),
])
def test_allocation_error_is_one_line_and_exit_code_2(capsys, monkeypatch, error):
    def demo(args):
        raise error
    monkeypatch.setattr(cli, "demo", demo)
    assert main(TINY) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: out of memory on cpu" in err and "more lines" not in err, err


def test_other_runtime_errors_are_not_taken_for_memory(monkeypatch):
    def demo(args):
        raise RuntimeError("a bug")
    monkeypatch.setattr(cli, "demo", demo)
    with pytest.raises(RuntimeError, match="a bug"):
        main(TINY)


def test_module_entry_point_refuses_a_demo_that_does_not_fit():
    result = subprocess.run([sys.executable, "-m", "serval", "demo", "--device", "cpu", "--hidden", "100000",
                             "--inter", "100000"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "the demo needs up to" in result.stderr, result.stderr
