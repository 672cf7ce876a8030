"""Model of e2m1x8_word_fast (csrc/kernels/sm90_common.cuh): E2M1 codes of v / scale (IEEE division, then
e2m1_code) taken from m = |v x r|, r = rcp.approx(scale), wherever m (1 - 2^-19) and m (1 + 2^-19) give the same code
(and m is in [2^-100, 2^100]; zeros give code 0), the divisions elsewhere. The claim: the fast path never differs from
the divisions, for any reciprocal within 1 ulp of 1 / scale (MUFU.RCP's bound; rcp.approx.ftz flushes subnormal
results to zero). Checked here in float32 arithmetic (numpy: the same IEEE single operations as the device's FMUL and
division without flush-to-zero) with r = RN(1 / scale) moved -1, 0 and +1 ulp, on random values and scales, on values
placed at and up to 64 ulps around every code boundary times the scale, and on zeros, subnormals, huge values, inf
and NaN; scales from random bit patterns (subnormal to inf: rcp.approx.ftz reads a subnormal as 0) and 0, -1, NaN
(both forms give zero codes).

    python3 docs/models/e2m1_fast_quotient.py [--samples 1000000] [--seed 0]
"""
from __future__ import annotations

import argparse

import numpy as np

F32 = np.float32
BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=F32)


def e2m1_code(q: np.ndarray) -> np.ndarray:
    """e2m1_code on float32 quotients: the magnitude's code (ties to even at the boundaries, saturating), sign bit 8
    for q < 0, NaN -> 0."""
    m = np.abs(q)
    with np.errstate(invalid="ignore"):
        code = ((m > 0.25).astype(np.uint32) + (m >= 0.75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5)
                + (m > 5.0))
        return code | np.where(q < 0, 8, 0).astype(np.uint32)


def divided(v: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e2m1x8_word: codes of the IEEE quotients; 0 where the scale is not positive (0, negative, NaN)."""
    with np.errstate(all="ignore"):
        return np.where(scale > 0, e2m1_code((v / scale).astype(F32)), 0).astype(np.uint32)


def fast(v: np.ndarray, scale: np.ndarray, ulps: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes, taken): the fast path's codes and where it takes them (elsewhere the kernel divides)."""
    with np.errstate(all="ignore"):
        flushed = np.where(np.abs(scale) < np.finfo(F32).tiny, F32(0), scale)  # ftz: a subnormal input reads as 0
        r = (F32(1) / flushed).astype(F32)
        for _ in range(abs(ulps)):  # the 1-ulp error of finite results (1 / 0 is inf, 1 / inf is 0: exact)
            moved = np.nextafter(r, np.where(ulps > 0, F32(np.inf), F32(0))).astype(F32)
            r = np.where(np.isfinite(r) & (r != 0), moved, r).astype(F32)
        r = np.where(np.abs(r) < np.finfo(F32).tiny, F32(0), r)  # ftz
        m = np.abs((v * r).astype(F32))
        lo = e2m1_code((m * F32(1 - 2.0 ** -19)).astype(F32))
        hi = e2m1_code((m * F32(1 + 2.0 ** -19)).astype(F32))
        taken = (v == 0) | ((lo == hi) & (m >= F32(2.0 ** -100)) & (m <= F32(2.0 ** 100)))
        codes = np.where(v == 0, 0, lo | np.where(v < 0, 8, 0)).astype(np.uint32)
        positive = scale > 0  # else the early return: zero codes
    return np.where(positive, codes, 0).astype(np.uint32), taken | ~positive


def cases(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    # scales as the quantizers make them: UE4M3 x a global scale (any float32), powers of two, and odd ones
    odd_scales = np.array([0.0, -0.0, -1.0, 1e-45, 1e-40, 2.0 ** -126, 2.0 ** 126, 3e38, np.inf, np.nan], dtype=F32)
    scale = np.concatenate([
        (2.0 ** rng.uniform(-40, 40, samples)).astype(F32),
        (2.0 ** rng.integers(-60, 60, samples // 4)).astype(F32),
        rng.uniform(1e-3, 1e3, samples // 4).astype(F32),
        rng.integers(1, 0x7F800001, samples // 4, dtype=np.int64).astype(np.uint32).view(F32),  # every positive float
        odd_scales[rng.integers(0, odd_scales.size, samples // 8)]])
    n = scale.size
    with np.errstate(all="ignore"):
        v_random = (rng.standard_normal(n) * scale * rng.uniform(0, 7, n)).astype(F32)
    # at and around every boundary: RN(b x scale) moved k ulps, k in [-64, 64]
    b = BOUNDS[rng.integers(0, BOUNDS.size, n)]
    with np.errstate(all="ignore"):
        v_edge = (b * scale).astype(F32)
    k = rng.integers(-64, 65, n)
    for step in range(1, 65):
        move = np.abs(k) >= step
        v_edge = np.where(move, np.nextafter(v_edge, np.where(k > 0, F32(np.inf), F32(-np.inf))), v_edge).astype(F32)
    v_edge = np.where(rng.random(n) < 0.5, -v_edge, v_edge).astype(F32)
    special = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-39, 3e38, -3e38, np.inf, -np.inf, np.nan], dtype=F32)
    v_special = special[rng.integers(0, special.size, n)]
    v = np.concatenate([v_random, v_edge, v_special])
    s = np.concatenate([scale, scale, scale])
    return v, s


def check(samples: int = 1_000_000, seed: int = 0) -> dict:
    """Per reciprocal offset: how many cases the fast path took and how many of them differ from the divisions."""
    v, s = cases(samples, seed)
    want = divided(v, s)
    out = {}
    for ulps in (-2, -1, 0, 1, 2):  # MUFU.RCP is within 1 ulp; 2 for margin
        codes, taken = fast(v, s, ulps)
        out[ulps] = (int(taken.sum()), int((taken & (codes != want)).sum()), v.size)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for ulps, (taken, wrong, total) in check(args.samples, args.seed).items():
        print(f"rcp {ulps:+d} ulp: fast path {taken} of {total} ({taken / total:.1%}), differing from the divisions: {wrong}")
