"""The one home of serval's tuning: `KernelPlan`, which engine and which tiles run each GEMM stage of the layer, as
one frozen value; and every other tile table of the kernels, each a pure function of the shapes and the target:
the weight gradients' (`wgrad_config`), the block-scaled FP8 GEMMs' (`fp8_triton_tiles`, `fp8_gluon_config`), the
FP8 quantizer's (`quantize_tiles`), and the overlap at expert parallelism (MoK's minibatch rule, `minibatch_rows`,
and the fused passes' communication SMs, `FUSED_COMM_SMS`). docs/DESIGN.md sums up the choices and the evidence.

A plan is chosen by `choose_plan`, a pure function of the problem (hidden size, dtype) and of where it
runs (`Target`: device capability, Triton release, interpreter), and is passed down to every kernel
call; nothing in serval reads a module-level switch. A test or a benchmark that wants another variant
builds its own plan (`dataclasses.replace(choose_plan(...), ...)`) and passes it as
`Config(kernel_plan=...)` or to the stage functions directly.

A plan changes speed, not results: every engine computes each GEMM output element with the same K order and
rounding, so any plan gives the bits of any other for y, d_x and every weight gradient (`tests/test_kernels_*`
check it), and d_router_weights, a per-row fp32 sum over the I columns that each engine and tile splits
differently, is summed by all of them in one order (`kernels/swiglu.py`: a fixed tree per 16 columns, then the
groups in column order), so a down dgrad's epilogue chunk (block_n // epi_split) is a multiple of 16 columns.
Under the CPU interpreter block_k changes the rounding (its emulated dot rounds once per K step).

Engines (one module each in `serval/kernels/`):
* "triton": `triton_gemm`, the persistent Triton grouped GEMM; runs every stage, on every device
  (and under the CPU interpreter); the fallback wherever another engine does not take the operands.
* "cooperative": `gluon_cooperative`, a warp-specialised Gluon GEMM on cooperative 128 x 256 tiles
  (sm_90, Triton 3.6): down and the gate/up dgrad; for gate/up + SwiGLU, its loader gathers x's rows
  itself (EP=1, no gather pass).
* "pingpong": `gluon_pingpong`, a warp-specialised Gluon GEMM whose two consumer warp groups take
  alternate tiles (sm_90, Triton 3.6): the down dgrad, its SwiGLU-backward epilogue beside the MMAs.

This module imports neither Triton nor the kernels, so `serval.Config` can hold a plan.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Sequence
from typing import Literal

import torch

# The Triton releases whose Gluon API the Gluon engines are written and checked against.
GLUON_VERSIONS = ("3.6",)

STAGES = ("gate_up_swiglu", "down", "down_dgrad_swiglu", "gate_up_dgrad")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the Triton grouped GEMM (block_n is per accumulator)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8  # GROUP_M M-tiles sweep the N-tiles together: concurrent SMs share weight tiles in L2
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = True  # let the pipeliner overlap one tile's epilogue with the next tile's loads
    epi_split: int = 1  # the epilogue in column chunks of block_n // epi_split (1, 2 or 4): fewer live registers
    epi_tma_stores: bool = True  # the epilogue's row-aligned stores by TMA (else pointer stores)


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    """One launch configuration of a Gluon engine (its tile shape is the engine's own)."""

    stages: int  # depth of the shared-memory ring of (A, W) K-tiles
    epi_split: int  # the epilogue in this many column chunks
    group_m: int  # tile order, as TileConfig.group_m


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the kernels run: what `choose_plan` needs to know about it."""

    capability: tuple[int, int] | None  # CUDA compute capability; None: no GPU (the interpreter)
    triton_version: str  # "major.minor"
    interpret: bool  # TRITON_INTERPRET=1: kernels run on the CPU

    @property
    def gluon(self) -> bool:
        """Whether the Gluon engines run here: an sm_90 GPU and a Triton release in GLUON_VERSIONS."""
        return (not self.interpret and self.capability is not None and self.capability[0] == 9
                and self.triton_version in GLUON_VERSIONS)

    @property
    def tma(self) -> bool:
        return not self.interpret and self.capability is not None and self.capability[0] >= 9


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The engine and tiles of each GEMM stage, and the in-GEMM dispatch (see the module docstring).

    gate_up_engine "cooperative" applies where the stage gathers x's rows itself (EP=1); rows that were
    pulled first (EP) run on the Triton GEMM. `*_tiles` configure the Triton GEMM, used wherever the stage
    runs there (its engine, or the fallback). `use_tma`: the Triton GEMM reads and writes through TMA
    descriptors where the operands allow it (else pointer loads and stores).
    `pull_programs` > 0: at expert parallelism the gate/up GEMM's first `pull_programs` programs pull its
    rows from the owners' token buffers, `pull_block_c` columns a step, while the others compute
    (`serval.kernels.in_gemm_pull`); 0: the transport's pull kernel runs before the GEMM.
    `dgrad_pull_programs` > 0: the same for the backward's down dgrad, pulling d_y's rows (on the Triton
    engine); the pulled rows then serve the down weight gradient too. `minibatch_rows`: in a GEMM with pull
    programs, the rows whose every output tile the compute programs take before the next rows' (the tile
    order's M-group, so one minibatch computes while the next arrives); None: MoK's rule, two full waves of
    tiles on the compute SMs (`serval.plan.layer_minibatch_rows`).
    `fused_forward`: in bf16 and mxfp8 the forward's routed gate/up and down GEMMs run as one persistent launch
    (`serval.kernels.fused_pass`, the Triton tiles above, minibatch_rows its task order's minibatch; mxfp8: the
    gate/up tiles also round-trip h through its E8M0 blocks for down; fp8_blockwise runs staged); at EP its
    first `pull_programs` programs (0: `serval.plan.FUSED_COMM_SMS`, the cost model's 8) pull x's rows and its
    down tiles push o's rows into the owners' slots: dispatch, experts and combine in one launch; the shared
    expert's two GEMMs join it, their tiles first (at EP: in the first macrobatch window's launch). Off by default
    (docs/DESIGN.md, "The plan's choices": slower than the staged launches at EP=1, not yet timed at EP).
    `fused_backward`: the same for the backward's down dgrad (with the SwiGLU backward) and gate/up dgrad: one
    launch on the Triton tiles above (mxfp8 where I % 32 == 0: d_gate_up round-tripped for the gate/up dgrad); at
    EP its first `dgrad_pull_programs` programs (0: FUSED_COMM_SMS) pull d_y's
    rows and its gate/up dgrad tiles push d_x's rows into the owners' slots; the shared expert's two dgrads join it,
    their tiles first. Off by default, as fused_forward.
    """

    gate_up_engine: Literal["triton", "cooperative"] = "triton"
    down_engine: Literal["triton", "cooperative"] = "triton"
    down_dgrad_engine: Literal["triton", "pingpong"] = "triton"
    gate_up_dgrad_engine: Literal["triton", "cooperative"] = "triton"
    gate_up_tiles: TileConfig = TileConfig(128, 128, 64, flatten=False, epi_tma_stores=False)
    down_tiles: TileConfig = TileConfig(128, 256, 64, epi_split=2)
    down_dgrad_tiles: TileConfig = TileConfig(128, 128, 64, num_stages=4, epi_split=4, epi_tma_stores=False)
    gate_up_dgrad_tiles: TileConfig = TileConfig(128, 256, 64, flatten=False)
    cooperative_gather: GluonConfig = GluonConfig(stages=3, epi_split=4, group_m=8)
    cooperative_store: GluonConfig = GluonConfig(stages=4, epi_split=4, group_m=8)
    pingpong: GluonConfig = GluonConfig(stages=4, epi_split=8, group_m=4)
    use_tma: bool = True
    pull_programs: int = 0
    dgrad_pull_programs: int = 0
    pull_block_c: int = 256
    minibatch_rows: int | None = None
    fused_forward: bool = False
    fused_backward: bool = False

    def __post_init__(self):
        engines = {"gate_up_engine": ("triton", "cooperative"), "down_engine": ("triton", "cooperative"),
                   "down_dgrad_engine": ("triton", "pingpong"), "gate_up_dgrad_engine": ("triton", "cooperative")}
        for name, allowed in engines.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"KernelPlan.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("pull_programs", "dgrad_pull_programs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"KernelPlan.{name} must be an int >= 0, got {value!r}")
        if self.minibatch_rows is not None and (not isinstance(self.minibatch_rows, int)
                                                or isinstance(self.minibatch_rows, bool) or self.minibatch_rows < 1):
            raise ValueError(f"KernelPlan.minibatch_rows must be None or an int >= 1, got {self.minibatch_rows!r}")
        for name in ("fused_forward", "fused_backward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KernelPlan.{name} must be a bool, got {getattr(self, name)!r}")

    def tiles(self, stage: str) -> TileConfig:
        """The Triton GEMM's tiles for one of STAGES."""
        return {"gate_up_swiglu": self.gate_up_tiles, "down": self.down_tiles,
                "down_dgrad_swiglu": self.down_dgrad_tiles, "gate_up_dgrad": self.gate_up_dgrad_tiles}[stage]


# Hopper, bf16 (the tiles: Triton's persistent TMA GEMM at 128 x 256 x 64, 8 warps, 3 stages reaches cuBLAS
# there; gate/up holds two accumulators (gate, up), so 128 x 128 each; the dgrad's SwiGLU-backward epilogue
# needs 4 column chunks to fit its registers). KernelPlan's defaults are these tiles.
_HOPPER = KernelPlan()

# fp32 operands on the GPU: exact fp32 dots on the FMA units, for checks, not speed; small tiles compile
# without spills.
_FP32_TILES = TileConfig(32, 64, 16, num_warps=4, num_stages=2, flatten=False)

# The CPU interpreter: small tiles, so that tests on tiny shapes cross partial N and K tiles.
_INTERPRET_TILES = TileConfig(32, 32, 32, group_m=2)

# gate/up + SwiGLU on the cooperative engine (its loader gathering x) up to this hidden size; above it the
# separate gather pass + Triton GEMM is the faster pair (the gathering loader's cost grows with K).
COOPERATIVE_GATE_UP_MAX_HIDDEN = 4096


def choose_plan(hidden: int, dtype: torch.dtype, target: Target) -> KernelPlan:
    """The plan for a layer of hidden size `hidden` in `dtype` on `target`: a pure function, no timing
    (a choice made by timing could change between runs; the plan may not change results, but it is
    fixed anyway so that runs are reproducible in speed as well)."""
    if target.interpret:
        return dataclasses.replace(
            _HOPPER, use_tma=False, gate_up_tiles=_INTERPRET_TILES, down_tiles=_INTERPRET_TILES,
            down_dgrad_tiles=dataclasses.replace(_INTERPRET_TILES, epi_split=2), gate_up_dgrad_tiles=_INTERPRET_TILES)
    if dtype == torch.float32:
        return dataclasses.replace(_HOPPER, use_tma=target.tma, gate_up_tiles=_FP32_TILES, down_tiles=_FP32_TILES,
                                   down_dgrad_tiles=_FP32_TILES, gate_up_dgrad_tiles=_FP32_TILES)
    plan = dataclasses.replace(_HOPPER, use_tma=target.tma)
    if target.gluon and dtype == torch.bfloat16:
        plan = dataclasses.replace(
            plan, down_engine="cooperative", gate_up_dgrad_engine="cooperative", down_dgrad_engine="pingpong",
            gate_up_engine="cooperative" if hidden <= COOPERATIVE_GATE_UP_MAX_HIDDEN else "triton")
    return plan


# ---------------------------------------------------------------- the overlap at expert parallelism

# The communication SMs of a fused pass at EP where none are set (Config.comm_sms_* None or 0): the EP cost model's
# choice, forward and backward, for every contract EP shape at EP = 8 (`serval.overlap`,
# benchmarks/results/ep_model_predictions.json); not yet timed on several GPUs.
FUSED_COMM_SMS = 8


def minibatch_rows(n_tiles_per_gemm: Sequence[int], compute_sms: int, block_m: int, *, waves: int = 2) -> int:
    """MoK's rule: the fewest whole M-tiles of rows for which every expert GEMM of the pass has at least `waves`
    full waves of tiles on the compute SMs, so a minibatch keeps them all busy while the next one arrives.

    n_tiles_per_gemm: each GEMM's output tiles per M-tile (its N / tile width); returns rows (a multiple of
    block_m)."""
    if compute_sms < 1 or block_m < 1 or waves < 1 or not n_tiles_per_gemm or min(n_tiles_per_gemm) < 1:
        raise ValueError(f"minibatch_rows: positive sizes expected, got n_tiles_per_gemm={list(n_tiles_per_gemm)}, "
                         f"compute_sms={compute_sms}, block_m={block_m}, waves={waves}")
    m_tiles = max(math.ceil(waves * compute_sms / n) for n in n_tiles_per_gemm)
    return m_tiles * block_m


def layer_minibatch_rows(hidden: int, inter: int, compute_sms: int, block_m: int = 128, *,
                         gate_up_tile_n: int = 128, down_tile_n: int = 256) -> int:
    """`minibatch_rows` for the forward's two GEMMs on serval's tiles: gate/up + SwiGLU writes gate_up_tile_n
    columns of h per tile (the cooperative engine's 128 x 256 [gate | up] tile), down down_tile_n of o."""
    return minibatch_rows([math.ceil(inter / gate_up_tile_n), math.ceil(hidden / down_tile_n)], compute_sms,
                          block_m)


# ---------------------------------------------------------------- the weight gradients' tiles


@dataclasses.dataclass(frozen=True)
class WgradConfig:
    """One tile shape of the grouped weight-gradient kernel (`serval.kernels.weight_grad`). block_k must divide the
    schedule's block_m (a K step never crosses experts)."""

    block_p: int
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int
    group_p: int = 8  # GROUP_P P-tiles sweep the Q-tiles together: concurrent programs reuse A and B strips in L2
    epilogue_subtile: bool = False  # store the [BP, BQ] tile as two [BP, BQ/2] halves (less shared memory)
    flatten: bool = False  # one pipelined loop over all K steps of all tiles (no bubble between tiles)


# Named configs for Hopper (bf16): 128x256x64 / 8 warps / 3 stages is the tile at which Triton's persistent
# TMA GEMM reaches cuBLAS there; the others are alternatives a benchmark can name. All compile for sm_90 with
# Triton 3.6 without spills (shared memory: 213 KB for 128x256 / 3 stages, 229 KB for 4 stages with the split
# epilogue, of 227 KiB).
WGRAD_CONFIGS = types.MappingProxyType({
    "128x256": WgradConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True),
    "128x256-nested": WgradConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=False),
    "128x256s": WgradConfig(128, 256, 64, num_warps=8, num_stages=4, epilogue_subtile=True, flatten=True),
    "256x128": WgradConfig(256, 128, 64, num_warps=8, num_stages=3, flatten=True),
    "128x128": WgradConfig(128, 128, 64, num_warps=8, num_stages=4, flatten=True),
})


def _pow2_at_most(n: int, cap: int, floor: int = 16) -> int:
    return max(floor, min(cap, 1 << max(0, n - 1).bit_length()))


def wgrad_config(p_out: int, q: int, block_m: int, interpret: bool, down: bool = False) -> WgradConfig:
    """The weight gradient's tiles for outputs [p_out, q] (a function of the shapes only); down: the w_down
    gradient, which takes the 4-stage split-store variant where the others take 128x256 (faster for it). Under the
    interpreter small tiles: its cost is per op, and small tiles exercise the masks on tiny shapes."""
    if interpret:
        bp, bq = _pow2_at_most(p_out, 32), _pow2_at_most(q, 32)
        return WgradConfig(bp, bq, min(16, block_m), num_warps=4, num_stages=2, group_p=2, flatten=True)
    if p_out >= 128 and q >= 256:
        return WGRAD_CONFIGS["128x256s" if down else "128x256"]
    if p_out >= 128 and q >= 128:
        return WGRAD_CONFIGS["128x128"]
    bp, bq = _pow2_at_most(p_out, 128), _pow2_at_most(q, 128)
    return WgradConfig(bp, bq, 64, num_warps=4, num_stages=4, flatten=True)


# ---------------------------------------------------------------- the block-scaled FP8 GEMMs' tiles


@dataclasses.dataclass(frozen=True)
class Fp8TritonTiles:
    """The Triton FP8 grouped GEMM's launch (`serval.kernels.fp8_gemm`; BLOCK_K is one 128-wide scale block)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def fp8_triton_tiles(segment: Literal["rows", "k"], interpret: bool) -> Fp8TritonTiles:
    """On a GPU (checked for sm_90 with Triton 3.6, ptxas: no spills): "rows" (the row-grouped GEMMs) 128 x 128 x 128,
    8 warps, 3 stages (229 registers, 96 KB); "k" (the weight gradient) 64 x 128 x 128, 4 warps, 4 stages (248
    registers; its per-column weight scales cost registers, 128 x 128 spilled). Under the interpreter small tiles
    (its cost is per op; small tiles exercise the masks and the per-column weight scales)."""
    if interpret:
        return Fp8TritonTiles(32, 32, 4, 1)
    if segment == "rows":
        return Fp8TritonTiles(128, 128, 8, 3)
    return Fp8TritonTiles(64, 128, 4, 4)


@dataclasses.dataclass(frozen=True)
class Fp8GluonConfig:
    """A launch configuration of the Gluon FP8 engine (`serval.kernels.gluon_fp8`, tile 128 x block_n x 128; the
    engine checks that its stages fit the shared memory)."""

    block_n: int = 128  # 64 or 128: 128 keeps 64 acc + 64 partial fp32 per consumer thread
    stages: int = 6  # ring depth: a stage is 16 KB of A + block_n x 128 B of weights
    group_m: int = 8  # tile order, as TileConfig.group_m
    epi_split: int = 4  # the epilogue in this many column chunks (16-byte pointer stores)

    def __post_init__(self):
        if self.block_n not in (64, 128):
            raise ValueError(f"Fp8GluonConfig.block_n must be 64 or 128, got {self.block_n}")
        if self.stages < 2:
            raise ValueError(f"Fp8GluonConfig.stages must be at least 2, got {self.stages}")


def fp8_gluon_config(n: int, weight_grad: bool = False) -> Fp8GluonConfig:
    """128-wide N tiles (the widest whose 64 + 64 fp32 registers fit a consumer), 64 for outputs no wider than
    64. The row-grouped GEMMs take as many stages as fit 227 KB beside ~8 KB of epilogue scratch (6 of 33 KB,
    8 of 24.8 KB); the weight gradient 4 (its K loops are one expert's rows, a few dozen steps: a deeper ring
    does not pay there)."""
    if n <= 64:
        return Fp8GluonConfig(block_n=64, stages=4 if weight_grad else 8)
    return Fp8GluonConfig(block_n=128, stages=4 if weight_grad else 6)


def quantize_tiles(block: tuple[int, int]) -> tuple[int, int, int]:
    """(TILE_R, TILE_C, num_warps) of the FP8 quantizer (`serval.kernels.quantize`) for a block shape: the fastest
    of a sweep on the H200 over the FP8 layer's own calls; 2K-16K elements a program, rows of >= 64 bytes on both
    sides of a transposed store."""
    rows, cols = block
    if rows == 1:
        return (64, 32, 2) if cols == 32 else (32, 128, 4)
    if cols == 1:
        return (32, 64, 2) if rows == 32 else (128, 64, 4)
    return (32, 32, 2) if rows == 32 else (128, 128, 4)
