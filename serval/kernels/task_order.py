"""The order in which a fused pass's programs take its tiles: the task order, stated in Python (`task_order`) and
decoded on the device (`task_coords`), and the minibatch it is cut into (`minibatch_m_tiles`).

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

FIRST, SECOND = 0, 1  # the GEMM of a task (forward: gate/up, down; backward: down dgrad, gate/up dgrad)


def _tile_coords(tile_id: int, num_m_tiles: int, num_n_tiles: int, group_m: int) -> tuple[int, int]:
    """`common.tile_coords` in Python (the same arithmetic, for `task_order`)."""
    tiles_per_group = group_m * num_n_tiles
    first_m = (tile_id // tiles_per_group) * group_m
    group_size = min(num_m_tiles - first_m, group_m)
    return first_m + (tile_id % tiles_per_group) % group_size, (tile_id % tiles_per_group) // group_size


def task_order(num_m_tiles: int, n_tiles_first: int, n_tiles_second: int, minibatch_m_tiles: int,
               group_m: int | None = None) -> list[tuple[int, int, int]]:
    """A fused pass's tasks in the order programs take them: [(gemm, m_tile, n_tile)], gemm FIRST or SECOND.

    F(0), F(1), S(0), F(2), S(1), ..., F(nb - 1), S(nb - 2), S(nb - 1), where F(b) / S(b) are the first and second
    GEMM's tiles of minibatch b (M-tiles [b * MB, min((b + 1) * MB, num_m_tiles)), MB = minibatch_m_tiles), each
    in its GEMM's staged tile order with GROUP_M = group_m (default MB; MB must be a multiple of it unless one
    minibatch holds every M-tile). `task_coords` decodes a task id to the same triple."""
    for name, value in (("num_m_tiles", num_m_tiles), ("n_tiles_first", n_tiles_first),
                        ("n_tiles_second", n_tiles_second), ("minibatch_m_tiles", minibatch_m_tiles)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "num_m_tiles" else 1):
            raise ValueError(f"task_order: {name} must be an int >= {0 if name == 'num_m_tiles' else 1}, got {value!r}")
    mb = minibatch_m_tiles
    group = mb if group_m is None else group_m
    if not isinstance(group, int) or isinstance(group, bool) or group < 1 or (mb % group and mb < num_m_tiles):
        raise ValueError(f"task_order: group_m must be an int >= 1 dividing minibatch_m_tiles={mb} (unless one "
                         f"minibatch holds all {num_m_tiles} M-tiles), got {group_m!r}")
    num_minibatches = -(-num_m_tiles // mb)

    def tiles(gemm, b):
        n = n_tiles_first if gemm == FIRST else n_tiles_second
        size = min(num_m_tiles - b * mb, mb)
        return [(gemm, *_tile_coords(b * mb * n + i, num_m_tiles, n, group)) for i in range(size * n)]

    if num_minibatches == 0:
        return []
    order = tiles(FIRST, 0)
    for b in range(1, num_minibatches):
        order += tiles(FIRST, b) + tiles(SECOND, b - 1)
    return order + tiles(SECOND, num_minibatches - 1)


@triton.jit
def task_coords(task, num_m_tiles, n_first, n_second, MB: tl.constexpr, GROUP_M: tl.constexpr):
    """(is_second, m_tile, n_tile) of task id `task` < num_m_tiles * (n_first + n_second): `task_order`'s entry
    `task`."""
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
