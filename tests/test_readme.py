"""The README's API example runs as written, on the default device (CUDA if present, else CPU)."""

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_api_example_runs():
    api_section = README.read_text().split("## The API", 1)[1].split("\n## ", 1)[0]
    (block,) = python_blocks(api_section)
    namespace = {}
    exec(compile(block, f"{README}:The API", "exec"), namespace)
    y, x, block_module = namespace["y"], namespace["x"], namespace["block"]
    assert y.shape == x.shape and torch.isfinite(y.float()).all()
    assert all(namespace[name].grad is not None for name in ("x", "router_weights", "w_gate", "w_up", "w_down"))
    assert all(p.grad is not None for p in block_module.parameters())


def test_readme_points_at_the_contract_in_the_repository():
    text = README.read_text()
    assert "SPEC.md" not in text and "../shared" not in text
    assert "docs/CONTRACT.md" in text
