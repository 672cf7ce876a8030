"""Model of the block-column form planned for NVFP4 tiles of 1-2 tokens on the BF16 path (docs/perf-notes.md,
fifty-seventh session): the UE4M3 block scales applied after the MMA instead of by an HMUL2 per weight pair. A model
of the index mapping, not kernel code; tests/test_models.py runs it.

The kernel's K order (sm90_fp4_grouped_gemm.cuh, file comment): in each 128-K group, thread q = lane % 4 of a fragment
row owns the physical K [32q, 32q + 32), and its element j = 8t + p + 4e (word t < 4, nibble pair p < 4, e < 2) sits at
logical k16 step 2t + p / 2, fragment column 2q + 8 (p % 2) + e. Physical K 32q + j lies in 16-K block 2q + t / 2, so
one logical step spans four blocks, one per q: a step's accumulator cannot hold one block alone.

Block-column form: the B tile (the token tile, N = 16 columns) gets a column per (block b < 8, token n < 2), column
2b + n, holding token n's value at every K of block b and zero at the other K of the group. Then accumulator column
2b + n of a row is the sum over block b alone of raw weight x token, and the promotion after the group multiplies it by
the row's factor for block b (the UE4M3 scale) and adds it to the token's sum. In the m64nN accumulator a thread
(lane % 4 = q') holds columns 2q' + {0, 1} and 8 + 2q' + {0, 1}: blocks q' and q' + 4 of both tokens, so each thread
promotes with 4 factors (rows r and r + 8, blocks q' and q' + 4) and the quad's four threads are summed at the tile's end.

The converters write it unit by unit (token n, group g, quarter q: the 32 K of thread q): each of the unit's 16 bf16
pairs (word t, pair p) goes to column 2 (2q + t / 2) + n at its store position, and the same position of the other
seven block columns of token n gets zero.

    python3 docs/models/nvfp4_block_columns.py
"""
from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def logical_of_physical(q: int, j: int) -> int:
    """Logical K (16 x step + fragment column) of physical element j of thread q's 32 K in a group."""
    t, rest = divmod(j, 8)
    e, p = divmod(rest, 4)
    return 16 * (2 * t + p // 2) + 2 * q + 8 * (p % 2) + e


def physical_of_logical() -> np.ndarray:
    """The inverse map over the group: physical K (32q + j) at each logical K."""
    out = np.full(128, -1)
    for q in range(4):
        for j in range(32):
            k = logical_of_physical(q, j)
            assert out[k] == -1, "two elements at one logical K"
            out[k] = 32 * q + j
    assert (out >= 0).all()
    return out


def block_of_physical(kp: int) -> int:
    return kp // 16


def converter_tile(x: np.ndarray) -> np.ndarray:
    """The block-column B tile of one group as the converters write it: x [2 tokens, 128 physical K] -> B [16 columns,
    128 logical K], by units (token n, quarter q) and their 16 pairs (word t, pair p), zeros to the other blocks."""
    b_tile = np.full((16, 128), np.nan)
    for n in range(2):
        for q in range(4):
            for t in range(4):
                for p in range(4):
                    for e in range(2):
                        j = 8 * t + p + 4 * e
                        k = logical_of_physical(q, j)
                        own = 2 * q + t // 2
                        assert own == block_of_physical(32 * q + j)
                        for b in range(8):
                            b_tile[2 * b + n, k] = x[n, 32 * q + j] if b == own else 0.0
    assert not np.isnan(b_tile).any(), "a position no unit writes"
    return b_tile


def accumulator_column(qq: int, h: int, n: int) -> int:
    """Column of the m64n16 accumulator register pair h (registers 4h .. 4h + 3), element n, of thread lane % 4 = qq:
    8 h + 2 qq + n (wgmma's fragment layout)."""
    return 8 * h + 2 * qq + n


def thread_blocks(qq: int) -> tuple[int, int]:
    """The blocks whose factors thread qq loads for its register pairs h = 0, 1: the columns' blocks, 2b + n = 8 h +
    2 qq + n, so b = qq + 4 h."""
    return qq, qq + 4


def check(num_cases: int = 200, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    phys = physical_of_logical()
    for _ in range(num_cases):
        groups = int(rng.integers(1, 5))
        k = 128 * groups
        rows = 16
        codes = rng.integers(0, 16, size=(rows, k))
        # UE4M3 values (any, including subnormal and zero), exact in float64
        scales = rng.choice(np.array([0.0, 2.0 ** -9, 7 * 2.0 ** -9, 2.0 ** -6, 0.875, 1.0, 1.125, 448.0]),
                            size=(rows, k // 16))
        x = rng.integers(-64, 65, size=(2, k)).astype(np.float64) * 2.0 ** -int(rng.integers(0, 8))
        want = (E2M1[codes] * np.repeat(scales, 16, axis=1)) @ x.T  # [rows, 2]: the true dot products
        got = np.zeros((rows, 2))
        for g in range(groups):
            a = E2M1[codes[:, 128 * g + phys]]  # raw weights (no scale) at logical K
            b_tile = converter_tile(x[:, 128 * g:128 * (g + 1)])
            acc = a @ b_tile.T  # [rows, 16]: the group's wgmmas
            for qq in range(4):  # the promotion, thread by thread, with the factors of the blocks it loads
                for h, blk in enumerate(thread_blocks(qq)):
                    for n in range(2):
                        got[:, n] += scales[:, 8 * g + blk] * acc[:, accumulator_column(qq, h, n)]
        assert np.array_equal(got, want), np.abs(got - want).max()
    # The claim behind the form: a logical k16 step spans four blocks (one per q), and in the block-column tile each
    # column holds exactly its block's 16 K.
    for step in range(8):
        assert len({block_of_physical(phys[16 * step + c]) for c in range(16)}) == 4
    ones = converter_tile(np.ones((2, 128)))
    for col in range(16):
        nz = np.nonzero(ones[col])[0]
        assert len(nz) == 16 and {block_of_physical(phys[k]) for k in nz} == {col // 2}


if __name__ == "__main__":
    check()
    print("block-column model: the converters' tile and the per-thread promotion give the exact dot products")
