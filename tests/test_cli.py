"""`python -m serval`: a bad option is one line saying what to change and exit code 2; --version; a tiny demo."""

import subprocess
import sys

import pytest
import torch

import serval
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
