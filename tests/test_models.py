"""The Python models in docs/models/ (protocol and bit-level checks of kernel designs) run on the CPU: a change
that breaks a model's claim fails here, not only when someone reruns the script."""
from __future__ import annotations

import importlib.util
import pathlib
import random

import pytest

MODELS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "models"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, MODELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fused_fp8_protocol_random_configurations():
    """The two producer warps (weights and the walk; token parts behind the grid dependency and the L1 counts): no
    deadlock, every tile consumed once, L2 token parts only after their expert's L1 tiles, both parts of every stage
    from the same tile (40 random configurations with late CTAs, the script's own generator)."""
    model = load("fused_fp8_protocol")
    rnd = random.Random(0)
    for s in range(40):
        model.run(s, **model.random_configuration(rnd))


def test_fused_fp8_cluster_protocol_random_configurations():
    """The pair walk (two-CTA clusters sharing weight tiles by multicast; built, off by default): no deadlock, every (unit, rank) consumed
    once, no multicast into a slot the peer CTA has not released, L2 token parts after their expert's L1 blocks, and
    L1 counts from real blocks only (odd block counts give phantom halves), over 80 random configurations."""
    model = load("fused_fp8_cluster_protocol")
    rnd = random.Random(0)
    for s in range(80):
        model.run(s, **model.random_configuration(rnd))


@pytest.mark.parametrize("name,mutation", [
    ("fused_fp8_protocol", "no_l1_gate"), ("fused_fp8_protocol", "ring_overwrite"),
    ("fused_fp8_cluster_protocol", "own_slot_only"), ("fused_fp8_cluster_protocol", "no_l1_gate"),
    ("fused_fp8_cluster_protocol", "no_ring_flush")])
def test_protocol_models_catch_broken_rules(name, mutation):
    """Each rule a walk relies on, broken on purpose, fails its model in some of 40 configurations (a model that
    passes everything checks nothing)."""
    model = load(name)
    rnd = random.Random(1)
    caught = 0
    for s in range(40):
        try:
            model.run(s, **model.random_configuration(rnd), mutation=mutation)
        except AssertionError:
            caught += 1
    assert caught > 0


def test_mxfp4_fp8_decode_bytes_and_fragments():
    """The planned MXFP4-on-FP8-wgmma decode: kernel-layout words decoded by PRMT tables give the E4M3 byte of
    e2m1 x 2^-d for every code, position and shift, and the fragment / token-tile K permutation computes the
    natural-order dot products exactly."""
    model = load("mxfp4_fp8_decode")
    model.check_decode(num_words=4000)
    model.check_fragments()


def test_nvfp4_block_columns_give_exact_dot_products():
    """The block-column form planned for NVFP4 tiles of 1-2 tokens (perf-notes, fifty-seventh session): with the
    kernel's K order, a token tile of one column per (16-K block, token) as the converters would write it and the
    promotion of each thread's four accumulator columns by their blocks' scales give the exact dot products (200
    random cases of 1-4 groups, scales subnormal and zero included); a logical k16 step spans four blocks."""
    model = load("nvfp4_block_columns")
    model.check(num_cases=200)


def test_warp_tile_decode_equals_binary_search():
    """The FP8 producer's warp-wide tile decode (2 rounds up to 1,024 experts) finds the binary search's expert for
    every tile of random expert-offset tables, empty experts included."""
    model = load("warp_tile_decode")
    assert model.check(num_tables=600) <= 3


def test_token_blocks_with_tail_rows_cover_each_expert():
    """Routing's token blocks with tail rows (FP8 block_m 64 + 16, FP4 block_m 16 + 8) and decode_tile_warp's rows
    per block: each expert's rows exactly once, every block but the last full, the last within the tile's columns."""
    load("warp_tile_decode").check_rows(max_count=300)


def test_fp4_gemv_fp16_block_sums_within_bf16_rounding():
    """The planned T=1 GEMV's fp16 block sums (docs/plans/fp4-gemv.md): against float64 their error stays well under
    the bf16 rounding that L1's epilogue applies to every output (and under the tests' 1e-2), and float32 block sums
    are exact to float32 rounding. The model itself asserts that the fp16 weights (e2m1 x 2^-14) and tokens (E4M3) are
    exact, so the error measured is the accumulators' alone (and nonzero: the fp16 sums are really rounded)."""
    model = load("fp4_gemv_numerics")
    for k in (2048, 4096):
        err = model.errors(256, k, seed=k)
        fp32, fp16, bf16 = (err[name][0] for name in (
            "fp32 block sums (FFMA)", "fp16 block sums (HFMA2)", "bf16 rounding of the exact sum"))
        assert fp32 < 1e-6, err
        assert 1e-6 < fp16 < bf16 / 3 and fp16 < 1e-3, err


def test_e2m1_fast_quotient_equals_the_divisions():
    """e2m1x8_word_fast (codes from a reciprocal product where no code boundary lies within 2^-19) gives the
    IEEE divisions' codes for reciprocals up to 2 ulps below and above 1 / scale, on random values, values at and around
    every boundary and special values (docs/models/e2m1_fast_quotient.py); it takes most random values."""
    model = load("e2m1_fast_quotient")
    for ulps, (taken, wrong, total) in model.check(200_000, seed=1).items():
        assert wrong == 0, (ulps, wrong)
        assert taken > total // 2, (ulps, taken, total)
