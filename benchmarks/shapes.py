"""The benchmark shapes of docs/CONTRACT.md ("Benchmark shapes"), defined once for every script here and in tools/.

SHAPES: one GPU, EP=1. EP_SHAPES: expert parallelism, the first four shapes with their real expert counts
(E global; each of P ranks holds E / P) and TOKENS_PER_GPU tokens per rank. TINY_SHAPES / EP_TINY_SHAPES: the
--tiny smoke tests on the CPU (feature dimensions multiples of 8: torch._grouped_mm wants 16-byte strides;
EP_TINY_SHAPES' E divisible by 2, 4 and 8).
"""

from typing import NamedTuple


class Shape(NamedTuple):
    hidden: int  # H
    inter: int  # I, and Is of the shared expert
    experts: int  # E (at EP: global)
    top_k: int  # k
    tokens: int  # N (at EP: per GPU)
    shared: bool  # has a shared expert


SHAPES = {
    "kimi-k2": Shape(7168, 2048, 12, 8, 4096, True),
    "glm-5": Shape(6144, 2048, 16, 8, 8192, True),
    "qwen3.5-397b": Shape(4096, 1024, 20, 10, 5120, True),
    "deepseek-v4-pro": Shape(7168, 3072, 12, 6, 4096, True),
    "qwen3-30b-a3b": Shape(2048, 768, 128, 8, 16384, False),
}

EP_EXPERTS = {"kimi-k2": 384, "glm-5": 256, "qwen3.5-397b": 512, "deepseek-v4-pro": 384}
TOKENS_PER_GPU = 4096
EP_SHAPES = {name: SHAPES[name]._replace(experts=experts, tokens=TOKENS_PER_GPU)
             for name, experts in EP_EXPERTS.items()}

TINY_SHAPES = {
    "tiny-a": Shape(64, 32, 4, 2, 48, True),
    "tiny-b": Shape(32, 16, 8, 3, 42, False),  # N*k/E = 15.75: experts get 15 or 16 rows
}
EP_TINY_SHAPES = {
    "tiny-a": Shape(64, 32, 16, 4, 48, True),
    "tiny-b": Shape(32, 16, 8, 3, 42, False),
}
