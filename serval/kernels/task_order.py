"""The order in which a fused pass's programs take its tiles: the task order, decoded on the device (`task_coords`;
tests/test_fused_pass.py states it in Python and checks the decode against it), and the minibatch it is cut into
(`minibatch_m_tiles`).

A fused pass (`fused_pass`) runs two GEMMs in one launch: the first (F) makes what the second (S) reads. With
M_used M-tiles (read on the device), F has M_used * n_first tiles and S M_used * n_second. The M-tiles are cut into
minibatches of MB M-tiles (the last one may be shorter); F(b) is minibatch b's F tiles, S(b) its S tiles, and the
order is

    F(0), F(1), S(0), F(2), S(1), ..., F(nb - 1), S(nb - 2), S(nb - 1)

so an S tile depends only on earlier tasks and, one minibatch of F work having run in between, usually finds its
rows ready. Within F(b) / S(b) the tiles are in the staged kernel's order with GROUP_M (at most MB; MB a multiple
of it, so minibatches start on M-group boundaries; `common.tile_coords` on the GEMM's own tile numbering): each
GEMM's tiles are taken in exactly the order of its staged launch with that M-group, and the fused order
interleaves the two sequences minibatch by minibatch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..plan import minibatch_rows as mok_minibatch_rows
from . import common

@triton.jit
def task_coords(task, num_m_tiles, n_first, n_second, MB: tl.constexpr, GROUP_M: tl.constexpr):
    """(is_second, m_tile, n_tile) of task id `task` < num_m_tiles * (n_first + n_second): entry `task` of the order
    in the module docstring, is_second whether it is a tile of the second GEMM."""
    num_minibatches = tl.cdiv(num_m_tiles, MB)
    first_len = n_first * tl.minimum(num_m_tiles, MB)  # F(0)
    pair = MB * (n_first + n_second)  # F(j) + S(j - 1) for 1 <= j < num_minibatches (F of the last may be shorter)
    u = tl.maximum(task - first_len, 0)
    j = tl.maximum(tl.minimum(u // pair + 1, num_minibatches - 1), 1)
    r = u - (j - 1) * pair
    first_len_j = n_first * tl.minimum(num_m_tiles - j * MB, MB)  # F(j)
    in_first = task < first_len
    after_pairs = r >= first_len_j + MB * n_second  # S(num_minibatches - 1), after the last pair
    # one minibatch only: F(0), S(0)
    is_second = (~in_first) & ((num_minibatches == 1) | (r >= first_len_j))
    minibatch = tl.where(in_first, 0,
                         tl.where(num_minibatches == 1, 0,
                                  tl.where(r < first_len_j, j, tl.where(after_pairs, num_minibatches - 1, j - 1))))
    local = tl.where(in_first, task,
                     tl.where(num_minibatches == 1, u,
                              tl.where(r < first_len_j, r,
                                       tl.where(after_pairs, r - first_len_j - MB * n_second, r - first_len_j))))
    n_tiles = tl.where(is_second, n_second, n_first)
    m_tile, n_tile = common.tile_coords(minibatch * MB * n_tiles + local, num_m_tiles, n_tiles, GROUP_M)
    return is_second, m_tile, n_tile


def minibatch_m_tiles(minibatch_rows: int | None, hidden: int, inter: int, block_m: int, most_m_tiles: int,
                      first_block_n: int, second_block_n: int, group_m: int, compute_sms: int) -> tuple[int, int]:
    """(MB, GROUP_M) of a fused pass: M-tiles per minibatch, minibatch_rows // block_m (at least 1), or with None
    MoK's rule on the compute SMs (`serval.plan.minibatch_rows` over the two GEMMs' tiles per M-tile: the first
    GEMM's I / first_block_n, the second's H / second_block_n); the staged launch's M-group within it (at most MB,
    group_m: the first GEMM's); MB rounded up to whole M-groups, so minibatches start on group boundaries, and at
    most most_m_tiles (one minibatch for every M-tile of the pass's largest expert group)."""
    if minibatch_rows is None:
        minibatch_rows = mok_minibatch_rows([common.cdiv(inter, first_block_n), common.cdiv(hidden, second_block_n)],
                                            max(1, compute_sms), block_m)
    mb = max(1, min(minibatch_rows // block_m, most_m_tiles))
    group = min(group_m, mb)
    return min(-(-mb // group) * group, most_m_tiles), group
