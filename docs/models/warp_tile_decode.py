"""Model of `decode_tile_warp` (csrc/kernels/sm90_common.cuh): the warp-wide expert search of a grouped-GEMM tile.

The tile list is expert-major: expert e owns tiles [tile_offset[e] * nb, tile_offset[e + 1] * nb), where
tile_offset is the exclusive prefix sum of the experts' token blocks (non-decreasing, tile_offset[0] = 0; empty
experts repeat a value). A tile's expert is the last e with tile_offset[e] * nb <= tile. The kernel finds it with
rounds of 32 lanes probing every stride-th entry of the remaining range: the probes that hold form a prefix (the
offsets never decrease), so the ballot's population count names the last one, and the range shrinks to one stride.
This script mirrors the kernel's arithmetic lane by lane and compares it with a binary search; run directly it
checks random tables and prints the largest number of rounds seen.
"""
from __future__ import annotations

import random

LANES = 32


def binary_search(tile_offset, num_experts, nb, tile):
    lo, hi = 0, num_experts - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tile_offset[mid] * nb <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


def warp_search(tile_offset, num_experts, nb, tile):
    """Returns (expert, rounds); asserts the prefix property the ballot count relies on."""
    lo, n, rounds = 0, num_experts, 0
    while n > 1:
        stride = (n + LANES - 1) // LANES
        probes = [lane * stride < n and tile_offset[lo + lane * stride] * nb <= tile for lane in range(LANES)]
        below = sum(probes) - 1
        assert below >= 0 and all(probes[:below + 1]) and not any(probes[below + 1:]), "ballot is not a prefix"
        lo += below * stride
        n = min(stride, n - below * stride)
        rounds += 1
    return lo, rounds


def random_table(rnd: random.Random, num_experts: int):
    blocks = [rnd.choice([0, 0, 1, 2, 5]) if rnd.random() < 0.7 else 0 for _ in range(num_experts)]
    if sum(blocks) == 0:
        blocks[rnd.randrange(num_experts)] = 1
    offsets = [0]
    for b in blocks:
        offsets.append(offsets[-1] + b)
    return offsets


def check(num_tables: int = 1000, seed: int = 0) -> int:
    """Every probed tile of random tables (1 to 4,000 experts, empty experts, 1-28 weight blocks): the warp
    search finds the binary search's expert. Returns the most rounds seen."""
    rnd = random.Random(seed)
    most = 0
    for _ in range(num_tables):
        e = rnd.choice([1, 2, 3, 7, 31, 32, 33, 64, 255, 256, 384, 1000, 1024, 1025, 4000])
        offsets = random_table(rnd, e)
        nb = rnd.choice([1, 2, 16, 28])
        for tile in rnd.sample(range(offsets[-1] * nb), min(40, offsets[-1] * nb)):
            expert, rounds = warp_search(offsets, e, nb, tile)
            assert expert == binary_search(offsets, e, nb, tile), (e, nb, tile)
            most = max(most, rounds)
    return most


def expert_blocks(count: int, block_m: int, tail_rows: int) -> int:
    """Token blocks of an expert with `count` rows (sm90_routing.cu): the last block may hold tail_rows more."""
    return 0 if count == 0 else (max(count - tail_rows, 1) + block_m - 1) // block_m


def block_rows(first_row: int, end_row: int, m_block: int, m_blocks: int, block_m: int):
    """(row0, rows) of token block m_block of an expert's rows [first_row, end_row), as decode_tile_warp sets them."""
    row0 = first_row + m_block * block_m
    rows = end_row - row0 if m_block == m_blocks - 1 else min(block_m, end_row - row0)
    return row0, rows


def check_rows(max_count: int = 300) -> None:
    """Every expert size up to max_count, for the token blocks and tails the kernels use (FP8: 16 past 64; FP4: 8 past
    16) and without a tail: the blocks cover the expert's rows exactly once, in order; every block but the last holds
    block_m rows and the last 1 to block_m + tail_rows (the kernels' tile columns); with a tail, no expert takes more
    blocks than without one, and a block of its own for 1 to tail_rows rows past a full block never happens."""
    for block_m, tail_rows in ((16, 0), (16, 8), (32, 0), (64, 0), (64, 16), (128, 0)):
        for count in range(max_count + 1):
            m_blocks = expert_blocks(count, block_m, tail_rows)
            assert m_blocks <= expert_blocks(count, block_m, 0)
            first_row = 7  # any offset
            covered = first_row
            for m in range(m_blocks):
                row0, rows = block_rows(first_row, first_row + count, m, m_blocks, block_m)
                assert row0 == covered and rows >= 1, (block_m, tail_rows, count, m)
                assert rows == block_m if m < m_blocks - 1 else rows <= block_m + tail_rows, (block_m, count, m)
                covered += rows
            assert covered == first_row + count, (block_m, tail_rows, count)
            if tail_rows and count > block_m and 0 < count % block_m <= tail_rows:
                assert m_blocks == count // block_m, (block_m, tail_rows, count)


if __name__ == "__main__":
    print(f"ok: warp search == binary search, at most {check()} rounds")
    check_rows()
    print("ok: token blocks with tail rows cover every expert's rows")
