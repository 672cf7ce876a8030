"""sm90 FP4 path (pre_dispatch + fp8_fp4_mega_moe: MXFP4 / NVFP4 weights, FP8 or FP4 activations) on the
GPU vs the emulating reference.

Skipped without a GPU. Tolerance (DESIGN.md §3): relative Frobenius error <= 1e-2 vs megamoe.reference
(float32), NaN/Inf never pass. Outputs are poisoned with NaN before each call.

The kernel decodes weights and activations to bf16 exactly and accumulates in float32, so it differs
from the reference only by the float32 summation order; that can still flip a bf16 rounding of h and
then one step of the L2 requantization of that element. As in the FP8 tests, sweep cases with only a few
(token, slot) rows are checked against 5e-2 (a bug detector: wrong indexing or scales give tens of
percent) and the sweep as a whole, pooled, against 1e-2.
"""
from __future__ import annotations

import random

import pytest
import torch

import megamoe
from megamoe import reference
from conftest import capture_graph, release_gpu_memory, SWEEP_SEED, CUDA_MARKS, SweepPool, make_case, rel_err, skew_first_slot

pytestmark = list(CUDA_MARKS)
TOL = 1e-2
COMBOS = [("mxfp4", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp8"), ("nvfp4", "fp4")]
COMBO_IDS = [f"{w}-a{a}" for w, a in COMBOS]
MODELS = {"V4-Flash": (256, 6, 4096, 2048), "V4-Pro": (384, 6, 7168, 3072)}

combo = pytest.mark.parametrize("weight_format,act_format", COMBOS, ids=COMBO_IDS)


@pytest.fixture(autouse=True)
def poisoned_workspaces(monkeypatch):
    """The op's per-call workspaces (MXFP4 w4a4's folded tokens) start as NaN bytes in every test: a tile that never
    wrote its part would otherwise pass on the previous call's values, which the caching allocator hands back."""
    monkeypatch.setenv("MEGAMOE_POISON_WORKSPACES", "1")


def run_poisoned(case, **kwargs):
    megamoe.pre_dispatch(case.x, case.topk_idx, case.topk_weights, case.buffer, weight_format=case.weight_format)
    y = torch.full_like(case.x, float("nan"))
    megamoe.fp8_fp4_mega_moe(y, case.l1, case.l2, case.buffer, weight_format=case.weight_format, **kwargs)
    return y


def case_with_rows(rows, hidden, inter, weight_format, act_format, seed, routing_seed, max_tokens=None):
    """A top-1 case whose expert e gets exactly rows[e] tokens, in a random token order (no reference yet: callers
    may change the case first, then set case.ref = case.reference()); a buffer of max_tokens (default: the tokens)."""
    e, t = len(rows), sum(rows)
    case = make_case(e, hidden, inter, 1, t, weight_format, act_format, device="cuda", seed=seed, with_ref=False,
                     max_tokens=max_tokens)
    gen = torch.Generator().manual_seed(routing_seed)
    experts = torch.repeat_interleave(torch.arange(e), torch.tensor(rows))[torch.randperm(t, generator=gen)]
    case.topk_idx = experts.view(t, 1).to(device="cuda", dtype=case.topk_idx.dtype)
    return case


# ------------------------------------------------------------------------------------------------
# Small odd shapes, edge cases
# ------------------------------------------------------------------------------------------------
@combo
@pytest.mark.parametrize("shape", [(8, 256, 384, 3), (16, 384, 256, 4), (5, 128, 128, 2), (64, 640, 896, 8)])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 113, 333])
def test_small_shapes(weight_format, act_format, shape, num_tokens):
    e, h, i, k = shape
    case = make_case(e, h, i, k, num_tokens, weight_format, act_format, device="cuda", seed=num_tokens + e)
    y = run_poisoned(case)
    assert y.shape == case.ref.shape
    if num_tokens:
        assert rel_err(y, case.ref) <= TOL


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("shape", [(8, 256, 384, 3), (16, 384, 256, 4), (5, 128, 128, 2), (64, 640, 896, 8)])
@pytest.mark.parametrize("num_tokens", [1, 7, 113, 333])
def test_mxfp4_fp8_mma_path(act_format, shape, num_tokens, monkeypatch):
    """MXFP4 weights on FP8 wgmmas (MEGAMOE_MXFP4_FP8MMA=1): weights folded to E4M3 per row, tokens per 128-K group
    (docs/perf-notes.md). Against the reference and the BF16 path within the FP8 kernel's bounds (its tensor-core
    accumulation, promoted per 128 K, flips some requantized codes: up to ~2 % at a few rows, hence 5e-2 below
    100 tokens); a different result from the BF16 path with FP8 tokens (the switch took effect); repeated calls
    bitwise equal. Shapes cover K = 128 and 384 (a half stage), block_m 16 / 32 / 64 and hot experts.
    Scale spreads: test_mxfp4_fp8_mma_wide_scale_spreads."""
    e, h, i, k = shape
    case = make_case(e, h, i, k, num_tokens, "mxfp4", act_format, device="cuda", seed=31 * num_tokens + e)
    if num_tokens > 100:
        skew_first_slot(case, e)
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "0")  # not inherited from the caller's environment
    monkeypatch.setenv("MEGAMOE_FP4_GEMV", "0")  # T=1: the tile walks, not the GEMV path
    bf16 = run_poisoned(case)
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1")
    y = run_poisoned(case)
    assert torch.equal(run_poisoned(case), y)
    bound = TOL if num_tokens > 100 else 5e-2
    assert rel_err(y, case.ref) <= bound
    assert rel_err(y, bf16) <= bound
    if act_format == "fp8":
        assert not torch.equal(y, bf16)


@pytest.mark.parametrize("block_m", ["16", "16-split", "32", "64"])
@pytest.mark.parametrize("hidden,inter,spread", [(384, 256, 0), (640, 896, 3), (1024, 1024, 12)])
def test_mxfp4_fp8_mma_gather_fold_equals_kernel_fold(block_m, hidden, inter, spread, monkeypatch):
    """FP8-wgmma path with FP8 tokens: tokens folded per 128-K group before the kernel reads them
    (MEGAMOE_MXFP4_FOLD_TOKENS=1: L1's by the gather as it copies them, L2's by L1's epilogue as it writes them;
    E4M3 rows in the tile's order and one float factor per group) give the E4M3 tiles and factors the kernel's
    converters fold (=0), so the outputs are bitwise equal: with every GEMM output poisoned before each call,
    experts of 1-100 rows and one empty, block_m 16 (also with split K of the last round) / 32 / 64, partial L1
    and L2 stages (hidden 384, 640; intermediate 896), several tiles per CTA, and the scales of both GEMMs' tokens
    spread over about 2^0..2^spread within each 128-K group (12: past E4M3's range, so the fold rounds)."""
    rows = [1, 8, 9, 15, 16, 17, 24, 33, 48, 64, 65, 100, 0, 12]
    case = case_with_rows(rows, hidden, inter, "mxfp4", "fp8", seed=601 + hidden + spread, routing_seed=602 + hidden)
    if spread:
        # L1's tokens: per-channel magnitudes 2^0..2^spread, so each 128-K group's four UE8M0 token scales differ.
        chan = torch.arange(hidden, device="cuda") // 32 % 4
        case.x = (case.x.float() * torch.exp2(chan.float() * spread / 3)).to(case.x.dtype)
        # L2's tokens (the SwiGLU outputs): gate and up rows of intermediate channel j scaled by 2^(q spread / 6),
        # q = j // 32 % 4, through their UE8M0 weight scales, so the products span about 2^0..2^spread per group.
        w13_sf = case.layer["w13_sf"].clone()
        bits = w13_sf.view(torch.uint8)
        lift = (torch.arange(2 * inter, device="cuda") % inter // 32 % 4) * spread // 6
        bits.copy_((bits.to(torch.int32) + lift.view(1, -1, 1)).clamp(max=254).to(torch.uint8))
        case.layer = dict(case.layer, w13_sf=w13_sf)
        case.l1 = megamoe.transform_weights(case.layer["w13"], w13_sf, None, weight_format="mxfp4", is_l1=True)
    case.ref = case.reference()
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1")
    monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", block_m.split("-")[0])
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", "2" if block_m.endswith("split") else "0")
    gather_fold = switch_keeps_bits(case, monkeypatch, "MEGAMOE_MXFP4_FOLD_TOKENS")
    assert rel_err(gather_fold, case.ref) <= 5e-2


def fold_rows(x8: torch.Tensor, sf: torch.Tensor):
    """The gather's fold of FP8 tokens (E4M3 rows x8 [R, H] uint8, UE8M0 per 32 sf [R, H / 32] uint8) for L1, in
    torch: each 128-K group scaled to T, its largest scale, value x 2^-(T - t) rounded to E4M3 (nearest even; 2^-d for
    d >= 127 is 0), bytes in the kernel's tile order (16-byte chunk c, word q = quarter q's K 4c .. 4c + 3), and one
    float factor 2^(T - 127) per group: [H / 128, R]."""
    r, h = x8.shape
    g = h // 128
    t = sf.to(torch.int64).view(r, g, 4)
    tmax = t.amax(-1)
    d = (tmax[..., None] - t).to(torch.float64)
    f = torch.where(d >= 127, torch.zeros_like(d), torch.exp2(-d)).to(torch.float32)
    vals = x8.view(torch.float8_e4m3fn).to(torch.float32).view(r, g, 4, 32)
    folded = (vals * f[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    tiles = folded.view(r, g, 4, 8, 4).permute(0, 1, 3, 2, 4).reshape(r, h)
    factors = torch.exp2((tmax - 127).to(torch.float64)).to(torch.float32).t()
    return tiles, factors


# 4608: 36 groups, two passes of the gather's per-warp stage (32 + 4 groups): with few rows on two warps each (a warp
# per pass, where every row's passes fit the grid's warps at once), with 1,200 rows (2,400 passes: more than an H100's
# 2,112 gather warps) one warp per row.
@pytest.mark.parametrize("hidden,inter,spread,rows", [
    (640, 384, 12, "few"), (1024, 256, 4, "few"), (4608, 256, 5, "few"), (4608, 256, 5, "many")])
def test_mxfp4_w4a8_gather_fold_bits(hidden, inter, spread, rows, monkeypatch):
    """L1's FP8 tokens on the FP8-wgmma path, folded by the gather per 128-K group: the dispatch rows and factors it
    leaves in the buffer equal a torch model of the fold bit for bit (fold_rows), for every pool row, hidden 640 (a
    partial stage) and 1024, with each group's four quarter scales about 2^0..2^spread apart (12: past E4M3's range,
    so the fold rounds and flushes)."""
    rows = [5, 0, 17, 40, 3, 64, 1, 9] if rows == "few" else [300, 0, 417, 483]
    case = case_with_rows(rows, hidden, inter, "mxfp4", "fp8", seed=707 + hidden, routing_seed=708)
    quarter = torch.arange(hidden, device="cuda") // 32 % 4
    case.x = (case.x.float() * torch.exp2(quarter.float() * spread / 3)).to(case.x.dtype)
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1")
    monkeypatch.setenv("MEGAMOE_MXFP4_FOLD_TOKENS", "1")
    y = run_poisoned(case)
    assert torch.isfinite(y).all()
    buf, lay, num_rows, t = case.buffer, case.buffer.layout, sum(rows), case.x.shape[0]
    x8 = buf.view("x", (t, hidden), torch.uint8)
    sf = buf.view("x_sf", (t, hidden // 32), torch.uint8)
    token = buf.view("pool_src", (num_rows,), torch.int32).to(torch.int64)  # top-1, one rank: the token itself
    assert sorted(token.tolist()) == list(range(t))
    want_rows, want_factors = fold_rows(x8[token], sf[token])
    assert (sf.to(torch.int64).view(t, -1, 4).amax(-1, keepdim=True) - sf.view(t, -1, 4).to(torch.int64)).max() >= spread - 1
    got_rows = buf.view("dispatch_x", (lay["pool_rows"], hidden), torch.uint8)[:num_rows]
    got_factors = buf.view("dispatch_sf", (hidden // 128, lay["pool_rows"]), torch.float32)[:, :num_rows]
    assert torch.equal(got_rows, want_rows)
    assert torch.equal(got_factors, want_factors)


@pytest.mark.parametrize("weight_format,block_m,rows_per_expert,experts", [
    ("mxfp4", "128", 200, 12), ("mxfp4", "64", 100, 30), ("nvfp4", "64", 100, 30), ("mxfp4", "16-split", 20, 30),
    ("nvfp4", "16-split", 20, 30)])
def test_rotated_rounds_equal_static_walk(weight_format, block_m, rows_per_expert, experts, monkeypatch):
    """The FP4 walk with each round's whole tiles rotated among the CTAs (MEGAMOE_FP4_ROTATE_ROUNDS=1,
    heuristics::fp4_rotate_rounds) runs the same tiles as the static walk (=0), so the outputs are bitwise equal: 2-3
    rounds of tiles with a partial last one (experts of two token blocks and a few rows either side), every GEMM
    output poisoned first, and with split K of the last round (block_m 16, a forced round of 100 units, which is not
    the grid: rounds mix whole and split units)."""
    gen = torch.Generator().manual_seed(811 + experts)
    rows = (rows_per_expert + torch.randint(-8, 9, (experts,), generator=gen)).tolist()
    case = case_with_rows(rows, 640, 896, weight_format, "fp8", seed=812 + experts, routing_seed=813)
    case.ref = case.reference()
    monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", block_m.split("-")[0])
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", "100" if block_m.endswith("split") else "0")
    rotated = switch_keeps_bits(case, monkeypatch, "MEGAMOE_FP4_ROTATE_ROUNDS")
    assert rel_err(rotated, case.ref) <= TOL


def spread_ue8m0(sf: torch.Tensor, spread: int, seed: int) -> torch.Tensor:
    """The same UE8M0 scales with each 32-block's exponent lowered by 0..spread."""
    gen = torch.Generator().manual_seed(seed)
    drop = torch.randint(0, spread + 1, sf.shape, generator=gen, dtype=torch.int32).to(sf.device)
    return (sf.view(torch.uint8).to(torch.int32) - drop).clamp(1, 254).to(torch.uint8)


def with_nvfp4_scales(case, layer: dict, layer_key: str, sf: torch.Tensor) -> None:
    """The NVFP4 case with `layer` (a copy of case.layer) holding scales `sf` at `layer_key`, both layers transformed
    again."""
    layer[layer_key] = sf
    case.layer = layer
    case.l1 = megamoe.transform_weights(layer["w13"], layer["w13_sf"], layer["w13_global_sf"], weight_format="nvfp4",
                                        is_l1=True)
    case.l2 = megamoe.transform_weights(layer["w2"], layer["w2_sf"], layer["w2_global_sf"], weight_format="nvfp4",
                                        is_l1=False)


def scale_byte_case(act_format, scale_byte):
    """A small MXFP4 case whose expert 3 has one weight scale byte set (one gate row, second 32-K block), and
    the tokens routed to that expert."""
    case = make_case(8, 256, 384, 2, 64, "mxfp4", act_format, device="cuda", masked_fraction=0.0, seed=12)
    layer = dict(case.layer)
    w13_sf = layer["w13_sf"].clone()
    w13_sf.view(torch.uint8)[3, 5, 1] = scale_byte
    layer["w13_sf"] = w13_sf
    case.layer = layer
    case.l1 = megamoe.transform_weights(layer["w13"], w13_sf, None, weight_format="mxfp4", is_l1=True)
    hit = (case.topk_idx == 3).any(dim=1)
    assert hit.any() and (~hit).any()
    return case, hit


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
def test_mxfp4_fp8_mma_default(act_format, monkeypatch):
    """Without the switch, MXFP4 weights take the FP8-wgmma path with both token formats (w4a4 and w4a8); =0
    takes the BF16 path. A weight scale byte of 161 (2^34) tells them apart: the FP8-wgmma path computes it
    exactly, the BF16 path (past its range) poisons the expert's tokens with NaN. The default's bits equal
    those of the path forced by the switch."""
    monkeypatch.delenv("MEGAMOE_MXFP4_FP8MMA", raising=False)
    case, hit = scale_byte_case(act_format, 161)
    y = run_poisoned(case)
    assert bool(torch.isfinite(y[hit]).all())
    assert rel_err(y[~hit], case.ref[~hit]) <= TOL
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1")
    assert torch.equal(run_poisoned(case), y)
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "0")
    bf16 = run_poisoned(case)
    assert not bool(torch.isfinite(bf16[hit]).all())
    assert rel_err(bf16[~hit], case.ref[~hit]) <= TOL


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("spread", [12, 20])
def test_mxfp4_fp8_mma_wide_scale_spreads(act_format, spread, monkeypatch):
    """The fold's hard cases on the GPU: each 32-block's weight scale lowered by 0..spread, and tokens with outlier
    channels (x 300 on 1 % of the hidden channels: the token fold shifts their neighbours by ~8). Weights fold
    relative to their row's largest scale with 2^6 headroom (transform_weights' row exponents): exact while a row
    spans at most 14 binades (spread 12 on rows that span ~2), rounded past that (spread 20: blocks more than 14
    binades below the row's largest). Within the CPU study's bounds (benchmarks/fold_error.py) plus the FP8
    accumulation, and close to the BF16 path, which computes these products exactly."""
    e, h, i, k, t = 16, 512, 384, 4, 200
    case = make_case(e, h, i, k, t, "mxfp4", act_format, device="cuda", masked_fraction=0.0, seed=41)
    layer = dict(case.layer)
    layer["w13_sf"] = spread_ue8m0(layer["w13_sf"], spread, 1)
    layer["w2_sf"] = spread_ue8m0(layer["w2_sf"], spread, 2)
    case.layer = layer
    case.l1 = megamoe.transform_weights(layer["w13"], layer["w13_sf"], None, weight_format="mxfp4", is_l1=True)
    case.l2 = megamoe.transform_weights(layer["w2"], layer["w2_sf"], None, weight_format="mxfp4", is_l1=False)
    x = case.x.float()
    channels = torch.randperm(h, generator=torch.Generator().manual_seed(3))[: h // 100].to(x.device)
    x[:, channels] *= 300
    case.x = x.to(torch.bfloat16)
    case.ref = case.reference()
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "0")  # not inherited from the caller's environment
    bf16 = run_poisoned(case)
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1")
    y = run_poisoned(case)
    assert rel_err(y, case.ref) <= TOL
    assert rel_err(y, bf16) <= TOL


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("scale_byte", [161, 200, 255])
def test_mxfp4_fp8_mma_scale_range(act_format, scale_byte, monkeypatch):
    """The FP8-wgmma path multiplies by 2^(E - 127) in float32, so weight scales past the BF16 path's range
    (2^33) stay exact: 161 and 200 match the reference (finite there); 255 (NaN) poisons exactly the tokens
    routed to that expert."""
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1")
    case, hit = scale_byte_case(act_format, scale_byte)
    y = run_poisoned(case)
    if scale_byte == 255:
        assert not torch.isfinite(y[hit]).all(dim=1).any(), "a token routed to the NaN-scaled expert came out finite"
        assert rel_err(y[~hit], case.ref[~hit]) <= TOL
    else:
        ref = case.reference()
        assert torch.isfinite(ref).all()
        assert rel_err(y, ref) <= TOL


@combo
@pytest.mark.parametrize("shape", [(16, 384, 256, 4), (64, 640, 896, 8)])
def test_forced_block_m_equal(weight_format, act_format, shape, monkeypatch):
    """MEGAMOE_FP4_BLOCK_M=16 / 32 / 64 (tests, A/Bs) runs the same arithmetic on other tiles: per output, the same
    K order and the same epilogue math (one 64-row slice per consumer at block_m 16, two at 32 / 64), so the outputs
    are bitwise equal, on poisoned outputs, with hot experts of several token blocks. The default too."""
    e, h, i, k = shape
    case = make_case(e, h, i, k, 113, weight_format, act_format, device="cuda", seed=71 + e)
    skew_first_slot(case, e)
    monkeypatch.delenv("MEGAMOE_FP4_BLOCK_M", raising=False)
    default = run_poisoned(case)
    assert rel_err(default, case.ref) <= TOL
    for block_m in (16, 32, 64):
        monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", str(block_m))
        assert torch.equal(run_poisoned(case), default), f"block_m {block_m}"


def assert_narrow_equals_full_width(case, block_m, fp8_mma, monkeypatch):
    """MEGAMOE_FP4_NARROW_MMA=0 runs every tile at the block's width; by default the tiles' wgmmas are only as wide as
    their rows. Each output's products and K order are the same, so the outputs must be bitwise equal (poisoned
    outputs, a repeated call) and within the tolerance of the reference."""
    case.ref = case.reference()
    monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", str(block_m))
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1" if fp8_mma else "0")
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", "0")
    monkeypatch.setenv("MEGAMOE_FP4_NARROW_MMA", "0")
    full = run_poisoned(case)
    monkeypatch.delenv("MEGAMOE_FP4_NARROW_MMA")
    narrow = run_poisoned(case)
    assert torch.equal(narrow, full)
    assert torch.equal(run_poisoned(case), narrow)
    assert rel_err(narrow, case.ref) <= TOL


@combo
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_narrow_mma_equals_full_width(weight_format, act_format, block_m, monkeypatch):
    """BF16 path (MXFP4 weights pinned to it here): each tile's wgmmas are as wide as its rows rounded up to 8, at
    least 16 (m64n16, n24 ... n64; block_m 16: m64n8 for up to 8 rows), bitwise equal to the block's width for
    experts of every width class and a few token blocks (rows 1-100, one empty). The split-K builds run the block's
    width (block_m 16 at few tokens: test_split_last_round). At block_m 16 with NVFP4 tokens the rows here take the
    wide-tail build (m64n24 for 17-24 rows in a last block)."""
    rows = [1, 8, 9, 15, 16, 17, 24, 25, 31, 32, 33, 40, 41, 47, 48, 49, 56, 57, 63, 64, 65, 80, 100, 0]
    case = case_with_rows(rows, 384, 256, weight_format, act_format, seed=301 + block_m, routing_seed=302 + block_m)
    assert_narrow_equals_full_width(case, block_m, False, monkeypatch)


@pytest.mark.parametrize("act_format,fold", [("fp8", "1"), ("fp4", "1"), ("fp4", "0")],
                         ids=["afp8", "afp4-folded", "afp4-converters"])
@pytest.mark.parametrize("block_m", [32, 64])
@pytest.mark.parametrize("hidden,inter", [(384, 256), (640, 896)])
def test_mxfp4_fp8_mma_narrow_equals_full_width(act_format, fold, block_m, hidden, inter, monkeypatch):
    """The FP8-wgmma path (MXFP4 weights, the default) runs each tile's stages at its rows' width: 16 / 32 at
    block_m 32, 32 / 48 / 64 at block_m 64 (m64nNk32 into the partial), bitwise equal to the block's width for
    experts of every width class (rows 1-100, one empty), with partial stages (hidden 384, 640; intermediate 896).
    MXFP4 tokens both folded upstream (the default) and converted in the tiles (MEGAMOE_FP4_FOLD_MXFP4=0)."""
    monkeypatch.setenv("MEGAMOE_FP4_FOLD_MXFP4", fold)
    rows = [1, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 47, 48, 49, 56, 63, 64, 65, 80, 96, 97, 100, 0]
    case = case_with_rows(rows, hidden, inter, "mxfp4", act_format, seed=701 + block_m + hidden,
                          routing_seed=702 + block_m)
    assert_narrow_equals_full_width(case, block_m, True, monkeypatch)


def block128_case(hidden, inter, act_format, spread, seed, routing_seed, max_tokens=None):
    """An MXFP4 top-1 case for the block_m 128 equalities: experts of 1-300 rows (every n64 / n96 / n128 width class,
    several 128-row blocks) and one empty; the token channels scaled by 2^(spread / 3 x (channel / 32 % 4)), so that the
    token scales spread within each 128-K group by up to `spread` binades (12: the fold rounds)."""
    rows = [1, 16, 63, 64, 65, 96, 97, 127, 128, 129, 200, 256, 300, 0, 33]
    case = case_with_rows(rows, hidden, inter, "mxfp4", act_format, seed=seed, routing_seed=routing_seed,
                          max_tokens=max_tokens)
    if spread:
        chan = torch.arange(hidden, device="cuda") // 32 % 4
        case.x = (case.x.float() * torch.exp2(chan.float() * spread / 3)).to(case.x.dtype)
    case.ref = case.reference()
    return case


# inter 4608: 36 groups, two passes of the pool fold's per-warp stage.
@pytest.mark.parametrize("hidden,inter,spread", [(384, 256, 0), (640, 896, 3), (1024, 1024, 12), (256, 2048, 0),
                                                  (384, 4608, 2)])
def test_mxfp4_block128_equals_block64(hidden, inter, spread, monkeypatch):
    """Block_m 128 (MXFP4 w4a8 on the FP8-wgmma path, folded tokens: 128 x 128 tiles, one 64-row slice per consumer,
    L1's SwiGLU pair exchanged, L2's input folded by a pass after L1) runs each output's products in the K order and
    epilogue math of block_m 64, so the outputs are bitwise equal: experts of 1-300 rows (every n64 / n96 / n128 width
    class, several 128-row blocks) and one empty, partial stages (hidden 384, 640; intermediate 896), token scales
    spread within each 128-K group (12: the fold rounds), on poisoned GEMM outputs, narrow and full-width wgmmas."""
    case = block128_case(hidden, inter, "fp8", spread, seed=801 + hidden + spread, routing_seed=802 + inter)
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1")
    monkeypatch.setenv("MEGAMOE_MXFP4_FOLD_TOKENS", "1")

    def run(block_m, narrow=True):
        monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", str(block_m))
        monkeypatch.setenv("MEGAMOE_FP4_NARROW_MMA", "1" if narrow else "0")
        poison_gemm_outputs(case.buffer)
        return run_poisoned(case)

    y64 = run(64)
    assert rel_err(y64, case.ref) <= (TOL if not spread else 5e-2)
    y128 = run(128)
    assert torch.equal(y128, y64)
    assert torch.equal(run(128, narrow=False), y64)
    assert torch.equal(run(128), y64)  # run to run


@pytest.mark.parametrize("hidden,inter,spread", [(384, 256, 0), (640, 896, 3), (1024, 1024, 12), (256, 2048, 0),
                                                  (4608, 256, 5), (256, 4608, 2)])
def test_mxfp4_w4a4_upstream_fold_equals_converters(hidden, inter, spread, monkeypatch):
    """MXFP4 w4a4 on the FP8-wgmma path (heuristics::fp4_fold_mxfp4_tokens): the gather folds the dispatched MXFP4
    tokens into E4M3 rows of a workspace, L1 quantizes its outputs to MXFP4 and folds them for L2 in its epilogue
    (block_m 16 / 32 / 64; at block_m 128, whose tiles hold half of L2's 128-K group, a pass after L1 does:
    launch_fold_mxfp4), and both GEMMs run the folded-token builds (w4a8's; block_m 128: the 128 x 128 tiles). The
    folded values are the converters' (fold_e2m1_quarter), so at every block_m the outputs equal the converters' block_m
    64 build's
    (MEGAMOE_FP4_FOLD_MXFP4=0) bitwise, on poisoned GEMM outputs: experts of 1-300 rows and one empty, partial stages,
    token scales spread within each 128-K group (12: the fold rounds). Without the fold block_m stays at most 64 (the
    converters need the bf16 ring); with it the workspace holds T x top_k rows (the TMA reads past them as zeros),
    here in a buffer of 4,096 tokens for the 1,575 routed."""
    case = block128_case(hidden, inter, "fp4", spread, seed=901 + hidden + spread, routing_seed=902 + inter,
                         max_tokens=4096)
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1")
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", "0")

    def run(block_m, fold):
        monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", str(block_m))
        monkeypatch.setenv("MEGAMOE_FP4_FOLD_MXFP4", "1" if fold else "0")
        poison_gemm_outputs(case.buffer)
        poison_dispatch_rows(case.buffer)
        y = run_poisoned(case)
        assert dispatch_rows_copied(case) != fold, f"block_m {block_m}: the fold {'did not run' if fold else 'ran'}"
        return y

    converters = run(64, False)
    assert rel_err(converters, case.ref) <= (TOL if not spread else 5e-2)
    for block_m in (16, 32, 64, 128):
        assert torch.equal(run(block_m, True), converters), block_m
    assert torch.equal(run(16, False), converters)  # the converters' blocks agree as well
    assert torch.equal(run(128, True), converters)  # run to run


@pytest.mark.parametrize("weight_format,act_format,fp8_mma", [("nvfp4", "fp4", False), ("nvfp4", "fp8", False),
                                                                ("mxfp4", "fp8", False), ("mxfp4", "fp8", True)])
@pytest.mark.parametrize("hidden,inter", [(384, 256), (256, 1024), (1024, 1024)])
def test_wide_tail_equals_no_tail(weight_format, act_format, fp8_mma, hidden, inter, monkeypatch):
    """The wide-tail build (block_m 16, NVFP4 or FP8 tokens, no split; by default from 11 expected rows per expert): an
    expert's last token block takes up to 8 rows past 16, one m64n24 tile instead of a second tile.
    MEGAMOE_FP4_WIDE_TAIL=1 / =0 forces it on / off (the routing's token blocks show which ran). Each output's products
    and K order are the same, so the outputs are bitwise equal, with every GEMM output poisoned before each call (y,
    the pool and combine area, L1's float32 scratch with NVFP4 tokens), for experts whose last block is narrow (1-8
    rows: m64n8 with NVFP4 tokens; FP8 tokens run every tile of the build at m64n24), 9-16 rows, wide (17-24 rows past
    the full blocks) or several blocks deep; also with MEGAMOE_FP4_NARROW_MMA=0 (a different build with NVFP4 tokens
    only; with FP8 tokens it repeats the run). MXFP4 weights with FP8 tokens run both paths (the FP8-wgmma path's
    build takes folded tokens and runs every tile on m64n24k32). Hidden 384
    runs a partial last L1 stage; intermediate 1024 gives each CTA several L1 tiles (and L2 tiles at hidden 1024), so
    the shared-memory early inputs and token tiles are rewritten between tiles."""
    rows = [1, 8, 9, 15, 16, 17, 20, 23, 24, 25, 31, 32, 33, 40, 41, 47, 48, 49, 56, 57, 0, 12]
    e, k, t = len(rows), 1, sum(rows)  # top-1 (case_with_rows)
    case = case_with_rows(rows, hidden, inter, weight_format, act_format, seed=401 + hidden + inter,
                          routing_seed=402 + hidden + inter)
    case.ref = case.reference()
    monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", "16")
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", "0")
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1" if fp8_mma else "0")
    monkeypatch.setenv("MEGAMOE_MXFP4_FOLD_TOKENS", "1")  # the FP8-wgmma path's build takes folded tokens only

    def run(tail):
        monkeypatch.setenv("MEGAMOE_FP4_WIDE_TAIL", "1" if tail else "0")
        poison_gemm_outputs(case.buffer)
        megamoe.pre_dispatch(case.x, case.topk_idx, case.topk_weights, case.buffer, weight_format=weight_format)
        y = torch.full_like(case.x, float("nan"))
        # L1's float32 scratch is the op's first allocation, [t k, inter]: hand the caching allocator a NaN block of
        # that size just before the call.
        torch.full((t * k, inter), float("nan"), device="cuda")
        megamoe.fp8_fp4_mega_moe(y, case.l1, case.l2, case.buffer, weight_format=weight_format)
        blocks = case.buffer.view("tile_offset", (e + 1,), torch.int32).tolist()[e]
        assert blocks == sum((max(c - (8 if tail else 0), 1) + 15) // 16 for c in rows if c), f"tail {tail}"
        return y

    narrow, wide = run(False), run(True)
    assert torch.equal(wide, narrow)
    monkeypatch.setenv("MEGAMOE_FP4_NARROW_MMA", "0")
    assert torch.equal(run(True), narrow)
    assert rel_err(wide, case.ref) <= TOL


def fp4_split_plans(case, e, h, i, block_m, round_):
    """Python mirror of the kernel's SplitPlan (sm90_fp4_grouped_gemm.cuh) for L1 and L2: (whole, splits) each."""
    idx = case.topk_idx.flatten()
    counts = torch.bincount(idx[(idx >= 0) & (idx < e)].long(), minlength=e)
    blocks = int(((counts + block_m - 1) // block_m).sum())
    plans = []
    for n, k in ((2 * i, h), (h, i)):
        tiles, kblocks = blocks * -(-n // 256), -(-k // 256)
        rest = tiles - (tiles - 1) // round_ * round_  # the last round's tiles
        s = min(round_ // rest, kblocks, 8) if tiles > round_ and 2 * rest <= round_ else 1
        plans.append((tiles, s if s >= 2 else 1))
    return plans


def poison_dispatch_rows(buffer):
    """0xFF over the dispatch area's token rows (the gather's copies; see dispatch_rows_copied)."""
    lay = buffer.layout
    buffer.buffer[lay["dispatch_x_offset"]:lay["dispatch_sf_offset"]].fill_(0xFF)


def dispatch_rows_copied(case):
    """Whether the gather copied the packed token rows into the dispatch area (poisoned by poison_dispatch_rows before
    the call): where MXFP4 tokens are folded upstream it writes the fold's workspace instead, so a test can tell which
    path ran."""
    lay = case.buffer.layout
    rows = case.buffer.buffer[lay["dispatch_x_offset"]:lay["dispatch_sf_offset"]]
    return bool((rows[: case.x.shape[0] * case.x.shape[1] // 2] != 0xFF).any())


def poison_gemm_outputs(buffer):
    """NaN bytes over the buffer's pool (L1's outputs: tokens, scales, global scales) and combine area (L2's), so
    that a result can only come from this call's GEMMs (a split tile whose epilogue never ran would leave them)."""
    buffer.buffer[buffer.layout["pool_offset"]:].fill_(0xFF)


def run_split_poisoned(case):
    poison_gemm_outputs(case.buffer)
    return run_poisoned(case)


def switch_keeps_bits(case, monkeypatch, var):
    """Runs the case with the switch `var` = 0, then = 1 twice (every GEMM output poisoned first): the three outputs
    are bitwise equal. Returns the = 1 output."""
    def run(on):
        monkeypatch.setenv(var, "1" if on else "0")
        return run_split_poisoned(case)

    off, on = run(False), run(True)
    assert torch.equal(on, off)
    assert torch.equal(run(True), on)
    return on


@combo
@pytest.mark.parametrize("block_m", ["16", "16-split", "64", "128"])
@pytest.mark.parametrize("hidden,inter", [(1024, 512), (640, 512), (1536, 384)])
def test_scale_tma_keeps_bits(weight_format, act_format, block_m, hidden, inter, monkeypatch):
    """The weight scales as scale tiles by one bulk copy per stage (MEGAMOE_FP4_SCALE_TMA=1, the default where
    transform_weights writes scale tiles) give the bits of the scale warp's cp.async from the same tiles (=0), every
    GEMM output poisoned: block_m 16 (also with split K of the last round), 64 and 128 (MXFP4 w4a8: 128-row tiles,
    half a scale tile), experts of 1-130 rows and one empty. Shapes: both GEMMs' scales as tiles (1024 x 512); none
    (640 x 512: K / 32 = 20 bytes, n = 640 not a multiple of 256; the switch changes nothing there, a control); L1's
    only (1536 x 384). Against the reference as well (the tiles' addressing wrong would fail it)."""
    if block_m == "128" and (weight_format, act_format) != ("mxfp4", "fp8"):
        pytest.skip("block_m 128 is the MXFP4 w4a8 (folded tokens) build")
    rows = [1, 8, 17, 33, 64, 65, 100, 0, 12, 130]
    case = case_with_rows(rows, hidden, inter, weight_format, act_format, seed=701 + hidden + inter,
                          routing_seed=702 + hidden)
    case.ref = case.reference()
    monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", block_m.split("-")[0])
    split_round = 0
    if block_m.endswith("split"):
        # One tile past a round (the Python mirror of the plan): L1's last tile splits into K units that start at odd
        # stages too (a scale tile's second half).
        tiles = fp4_split_plans(case, len(rows), hidden, inter, 16, 2)[0][0]
        split_round = min(tiles - 1, torch.cuda.get_device_properties(0).multi_processor_count)
        plans = fp4_split_plans(case, len(rows), hidden, inter, 16, split_round)
        assert plans[0][1] > 1, plans
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", str(split_round))
    y = switch_keeps_bits(case, monkeypatch, "MEGAMOE_FP4_SCALE_TMA")
    assert rel_err(y, case.ref) <= 5e-2


@combo
@pytest.mark.parametrize("shape", [(16, 2048, 512, 4), (64, 640, 896, 8)])
@pytest.mark.parametrize("num_tokens", [1, 7, 40])
def test_split_last_round(weight_format, act_format, shape, num_tokens, monkeypatch):
    """Split K of the last round (MEGAMOE_FP4_SPLIT_ROUND forces a round smaller than the grid, so that these shapes
    have two or three rounds of tiles): the last round's tiles run as 2-8 K units (8 at h = 2048) whose float32
    partials the last unit sums. Against the reference, against the unsplit launch (MEGAMOE_FP4_SPLIT_ROUND=0; other summation order, so
    within the tolerance, not bitwise) and bitwise run to run; every case splits at least one GEMM (checked on the
    Python mirror of the plan), with partial last stages (h = 640, i = 896). Block_m 16: the only build with the split.
    At block_m 32 the forced round is ignored (the launch equals the unsplit one bitwise)."""
    e, h, i, k = shape
    case = make_case(e, h, i, k, num_tokens, weight_format, act_format, device="cuda", seed=97 * num_tokens + e)
    block_m = 16
    monkeypatch.setenv("MEGAMOE_FP4_GEMV", "0")  # T=1: the tile walk, which the split is part of
    monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", "32")
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", "2")
    at_32 = run_split_poisoned(case)
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", "0")
    assert torch.equal(run_split_poisoned(case), at_32)
    monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", str(block_m))
    unsplit = run_split_poisoned(case)
    bound = TOL if num_tokens * k > 100 else 5e-2
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count  # the host ignores larger rounds
    tested = set()
    for tiles, _ in fp4_split_plans(case, e, h, i, block_m, 2):
        # Two rounds with one tile left over (the most splits) or a third of them (two splits each); three rounds.
        for round_ in (tiles - 1, -(-2 * tiles // 3), int(tiles / 2.2)):
            if not 2 <= round_ <= num_sms or round_ in tested:
                continue
            plans = fp4_split_plans(case, e, h, i, block_m, round_)
            if all(s == 1 for _, s in plans):
                continue
            tested.add(round_)
            monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", str(round_))
            y = run_split_poisoned(case)
            assert rel_err(y, case.ref) <= bound, f"round {round_}, plans {plans}"
            assert rel_err(y, unsplit) <= bound, f"round {round_}, plans {plans}"
            assert torch.equal(run_split_poisoned(case), y), f"round {round_}, plans {plans}"
    assert tested, "no round splits a GEMM of this case"


@combo
def test_masked_tokens_are_zero(weight_format, act_format):
    case = make_case(8, 256, 384, 3, 64, weight_format, act_format, device="cuda", masked_fraction=0.5, seed=3)
    idx = case.topk_idx.clone()
    idx[::4] = -1  # every 4th token has no valid slot
    case.topk_idx = idx
    y = run_poisoned(case)
    assert torch.equal(y[::4], torch.zeros_like(y[::4]))
    assert rel_err(y, case.reference(topk_idx=idx)) <= TOL


@combo
def test_all_tokens_one_expert(weight_format, act_format):
    case = make_case(16, 256, 256, 4, 300, weight_format, act_format, device="cuda", masked_fraction=0.0, seed=4)
    idx = torch.full_like(case.topk_idx, -1)
    idx[:, 0] = 5
    case.topk_idx = idx
    y = run_poisoned(case)
    assert rel_err(y, case.reference(topk_idx=idx)) <= TOL


@combo
def test_int64_ids_equal_int32(weight_format, act_format):
    case = make_case(8, 256, 384, 3, 50, weight_format, act_format, device="cuda", seed=5)
    y32 = run_poisoned(case)
    case.topk_idx = case.topk_idx.to(torch.int64)
    y64 = run_poisoned(case)
    assert torch.equal(y32, y64)


@combo
@pytest.mark.parametrize("clamp", [None, 0.5, 3.0])
def test_activation_clamp(weight_format, act_format, clamp):
    case = make_case(8, 256, 384, 3, 40, weight_format, act_format, device="cuda", seed=6)
    case.x = case.x * 4  # make the clamp bite
    y = run_poisoned(case, activation_clamp=clamp)
    ref = case.reference(activation_clamp=clamp)
    assert rel_err(y, ref) <= TOL
    if clamp == 0.5:
        assert rel_err(y, case.reference()) > 10 * TOL


@combo
def test_deterministic_and_fully_overwritten(weight_format, act_format):
    case = make_case(32, 512, 384, 6, 500, weight_format, act_format, device="cuda", seed=7)
    first = run_poisoned(case)
    assert rel_err(first, case.ref) <= TOL
    for _ in range(3):
        assert torch.equal(run_poisoned(case), first)


@combo
def test_recv_stats_counts_rows_per_expert(weight_format, act_format):
    case = make_case(16, 256, 256, 4, 77, weight_format, act_format, device="cuda", seed=8)
    stats = torch.zeros(16, dtype=torch.int32, device="cuda")
    run_poisoned(case, recv_stats=stats)
    run_poisoned(case, recv_stats=stats)
    ids = case.topk_idx[case.topk_idx >= 0].long()
    expected = 2 * torch.bincount(ids, minlength=16).int()
    assert torch.equal(stats, expected)


@combo
def test_bad_expert_id_skipped_and_reported(weight_format, act_format):
    case = make_case(8, 256, 384, 3, 20, weight_format, act_format, device="cuda", masked_fraction=0.0, seed=9)
    idx = case.topk_idx.clone()
    idx[3, 1] = 8  # == num_experts
    masked = idx.clone()
    masked[3, 1] = -1
    case.topk_idx = idx
    y = run_poisoned(case)  # not checked: the slot is skipped
    assert rel_err(y, case.reference(topk_idx=masked)) <= 5e-2
    with pytest.raises(ValueError, match=r"topk_idx.*got 8 at token 3, slot 1"):
        run_poisoned(case, check=True)


@combo
@pytest.mark.parametrize("clamp", [None, 3.0])
def test_nan_activation_is_never_silent(weight_format, act_format, clamp):
    """A NaN in one token's hidden state makes that token's output non-finite (every quantization scale, the
    SwiGLU clamp and the L1 requantization keep it, as the reference does); the other tokens are unaffected."""
    case = make_case(8, 256, 384, 3, 64, weight_format, act_format, device="cuda", masked_fraction=0.0, seed=13)
    case.x = case.x.clone()
    case.x[5, 17] = float("nan")
    ref = case.reference(activation_clamp=clamp)
    y = run_poisoned(case, activation_clamp=clamp)
    assert not torch.isfinite(y[5]).any()
    others = torch.arange(64, device="cuda") != 5
    assert rel_err(y[others], ref[others]) <= TOL


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("scale_byte", [161, 200, 254, 255])
def test_mxfp4_scale_bytes_past_bf16_range_are_never_silent(act_format, scale_byte, monkeypatch):
    """BF16 path: UE8M0 bytes the decoder's fast path does not cover (factor past bf16, or 255 = NaN) poison
    exactly the tokens routed to that expert; every other token still matches the reference. (The FP8-wgmma
    path, the default for MXFP4 weights, computes 161 and 200 exactly: test_mxfp4_fp8_mma_scale_range.)"""
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "0")
    case, hit = scale_byte_case(act_format, scale_byte)
    y = run_poisoned(case)
    assert not torch.isfinite(y[hit]).all(dim=1).any(), "a token routed to the poisoned expert came out finite"
    assert rel_err(y[~hit], case.ref[~hit]) <= TOL


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("layer_key,pattern", [
    ("w13_sf", ((0x30, 0x38), (0x38, 0x30))), ("w13_sf", ((0x07, 0x08), (0x08, 0x07))),
    ("w13_sf", ((0x08, 0x09), (0x07, 0x06))), ("w13_sf", ((0x00, 0x38), (0x38, 0x00))),
    ("w13_sf", ((0x7E, 0x7E), (0x7E, 0x7E))), ("w13_sf", ((0x7F, 0x38), (0x38, 0x38))),
    ("w2_sf", ((0x38, 0x30), (0x30, 0x38))), ("w2_sf", ((0x01, 0x01), (0x01, 0x01))),
    ("w2_sf", ((0x06, 0x07), (0x09, 0x08))), ("w2_sf", ((0x38, 0x00), (0x00, 0x38))),
    ("w2_sf", ((0x38, 0x38), (0x38, 0x7F)))],
    ids=["l1-normal", "l1-subnormal-normal", "l1-rows-normal-subnormal", "l1-zero-one", "l1-max", "l1-nan",
         "l2-normal", "l2-min-subnormal", "l2-rows-subnormal-normal", "l2-one-zero", "l2-nan"])
def test_nvfp4_walk_scale_bytes(layer_key, pattern, act_format):
    """BF16 path (the tile walk, T=16): NVFP4 weight scale bytes on both sides of the decoder's fast range
    (weight_factors_nv: 8-0x7E by one IMAD, the rest on its branch), every block of one layer set. The byte depends on
    the 16-K block's parity and on the row's half of its 16 (pattern[(row // 8) % 2][block % 2]), so a thread's two
    factors differ and so do its rows r and r + 8 (one row on the fast range, the other off it, in some cases): a
    swapped half, a row read for the other or a misread byte moves the output. Subnormal, zero, normal and 448 are
    applied exactly (the subnormal bytes beside normal ones of about their size, so that a misread shows); a NaN byte
    in some blocks leaves no token finite. (L1's kernel rows interleave gate and up in chunks of 64 checkpoint rows,
    so rows r and r + 8 of a 64-row slice are checkpoint rows 8 apart there too.)"""
    case = make_case(8, 1024, 512, 2, 16, "nvfp4", act_format, device="cuda", masked_fraction=0.0, seed=57)
    layer = dict(case.layer)
    sf = layer[layer_key].clone()
    u = sf.view(torch.uint8)
    n = torch.arange(u.shape[1], device=u.device)
    for h in (0, 1):
        rows = ((n // 8) % 2 == h).nonzero().squeeze(1)
        for j in (0, 1):
            u[:, rows, j::2] = pattern[h][j]
    with_nvfp4_scales(case, layer, layer_key, sf)
    y = run_poisoned(case)
    if any(0x7F in p for p in pattern):
        assert not torch.isfinite(y).all(dim=1).any(), "a token came out finite"
    else:
        ref = case.reference()
        assert torch.isfinite(ref).all() and bool((ref != 0).any())
        assert rel_err(y, ref) <= TOL


@combo
def test_capacity_larger_than_tokens(weight_format, act_format):
    case = make_case(8, 256, 384, 3, 33, weight_format, act_format, device="cuda", max_tokens=1000, seed=10)
    assert rel_err(run_poisoned(case), case.ref) <= TOL


@combo
def test_matches_cpu_op(weight_format, act_format):
    """The CUDA op and the CPU op (the exact emulation) agree to the tolerance on the same inputs."""
    case = make_case(8, 256, 384, 3, 60, weight_format, act_format, device="cuda", seed=14, with_ref=False)
    y = run_poisoned(case)
    cpu = make_case(8, 256, 384, 3, 60, weight_format, act_format, device="cpu", seed=14, with_ref=False)
    y_cpu = megamoe.moe(cpu.x, cpu.topk_idx, cpu.topk_weights, cpu.l1, cpu.l2, cpu.buffer,
                        weight_format=weight_format)
    assert rel_err(y, y_cpu) <= TOL


# ------------------------------------------------------------------------------------------------
# Graphs and compile
# ------------------------------------------------------------------------------------------------
@combo
def test_cuda_graph_replay_with_new_inputs(weight_format, act_format):
    case = make_case(16, 256, 384, 4, 96, weight_format, act_format, device="cuda", seed=11)
    x, idx, w = case.x.clone(), case.topk_idx.clone(), case.topk_weights.clone()
    y = torch.empty_like(x)

    def step():
        megamoe.pre_dispatch(x, idx, w, case.buffer, weight_format=weight_format)
        megamoe.fp8_fp4_mega_moe(y, case.l1, case.l2, case.buffer, weight_format=weight_format)

    graph = capture_graph(step)
    for seed in range(3):
        gen = torch.Generator().manual_seed(100 + seed)
        x.copy_(torch.randn(96, 256, generator=gen).to("cuda", torch.bfloat16))
        new_idx, new_w = reference.make_random_routing(96, 16, 4, masked_fraction=0.2, seed=200 + seed, device="cuda")
        idx.copy_(new_idx)
        w.copy_(new_w)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = case.reference(x=x, topk_idx=idx, topk_weights=w)
        assert rel_err(y, ref) <= TOL


@combo
def test_split_graph_replay(weight_format, act_format, monkeypatch):
    """A graph captured with a forced split round (the host's choice is baked in at capture), replayed on new routing:
    the kernels plan the split from each replay's tile count, the gather kernel re-zeroes the counters, and the GEMM
    outputs are poisoned before every replay; at least one replay must split a GEMM (Python mirror of the plan)."""
    e, h, i, k, t, round_ = 16, 2048, 512, 4, 7, 40
    case = make_case(e, h, i, k, t, weight_format, act_format, device="cuda", seed=13)
    x, idx, w = case.x.clone(), case.topk_idx.clone(), case.topk_weights.clone()
    y = torch.empty_like(x)
    monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", "16")
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", str(round_))

    def step():
        megamoe.pre_dispatch(x, idx, w, case.buffer, weight_format=weight_format)
        megamoe.fp8_fp4_mega_moe(y, case.l1, case.l2, case.buffer, weight_format=weight_format)

    graph = capture_graph(step)
    splits = []
    for seed in range(4):
        gen = torch.Generator().manual_seed(300 + seed)
        x.copy_(torch.randn(t, h, generator=gen).to("cuda", torch.bfloat16))
        new_idx, new_w = reference.make_random_routing(t, e, k, masked_fraction=0.1, seed=400 + seed, device="cuda")
        idx.copy_(new_idx)
        w.copy_(new_w)
        case.topk_idx = idx
        splits += [s for _, s in fp4_split_plans(case, e, h, i, 16, round_)]
        poison_gemm_outputs(case.buffer)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = case.reference(x=x, topk_idx=idx, topk_weights=w)
        assert rel_err(y, ref) <= 5e-2, f"replay {seed}"
    assert max(splits) >= 2, "no replay split a GEMM"


@combo
def test_torch_compile_fullgraph(weight_format, act_format):
    torch._dynamo.reset()
    case = make_case(8, 256, 384, 3, 45, weight_format, act_format, device="cuda", seed=12)

    class Experts(torch.nn.Module):
        def forward(self, x, idx, w):
            return megamoe.moe(x, idx, w, case.l1, case.l2, case.buffer, weight_format=weight_format)

    compiled = torch.compile(Experts(), fullgraph=True)
    y = compiled(case.x, case.topk_idx, case.topk_weights)
    assert torch.equal(y, Experts()(case.x, case.topk_idx, case.topk_weights))
    assert rel_err(y, case.ref) <= TOL


# ------------------------------------------------------------------------------------------------
# Randomized sweep
# ------------------------------------------------------------------------------------------------
def _sweep_params(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        wf, af = rng.choice(COMBOS)
        e = rng.choice([1, 2, 3, 8, 16, 33, 64, 128])
        k = rng.randint(1, min(8, e))
        h = 128 * rng.randint(1, 12)
        i = 128 * rng.randint(1, 12)
        t = rng.choice([0, 1, 2, 5, 17, 64, 129, 300, 600])
        masked = rng.choice([0.0, 0.1, 0.5])
        skew = rng.random() < 0.3
        out.append((wf, af, e, k, h, i, t, masked, skew, rng.randrange(1 << 30)))
    return out


_sweep_pool = SweepPool()


@pytest.mark.parametrize("params", _sweep_params(240, SWEEP_SEED),
                         ids=lambda p: "{}-a{}-E{}K{}H{}I{}T{}m{}s{}-{}".format(*p))
def test_random_sweep(params):
    wf, af, e, k, h, i, t, masked, skew, seed = params
    case = make_case(e, h, i, k, t, wf, af, device="cuda", masked_fraction=masked, seed=seed % 1000)
    if skew and t:
        skew_first_slot(case, e)
    _sweep_pool.check(run_poisoned(case), case, t, k, params)


def test_random_sweep_pooled_error():
    """All sweep cases together (runs after them, file order) meet the 1e-2 bound."""
    _sweep_pool.check_pooled()


# ------------------------------------------------------------------------------------------------
# DeepSeek-V4 shapes (all experts), reference on a sample of tokens
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(m, f) for m in MODELS for f in ("mxfp4", "nvfp4")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def model_layer(request):
    name, weight_format = request.param
    release_gpu_memory()  # a full-size layer needs most of the GPU
    e, k, h, i = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    w13, sf13, g13 = reference.make_fp4_expert_weights(e, 2 * i, h, weight_format, generator=gen, device="cuda")
    w2, sf2, g2 = reference.make_fp4_expert_weights(e, h, i, weight_format, generator=gen, device="cuda")
    l1 = megamoe.transform_weights(w13, sf13, g13, weight_format=weight_format, is_l1=True)
    l2 = megamoe.transform_weights(w2, sf2, g2, weight_format=weight_format, is_l1=False)
    yield name, weight_format, (e, k, h, i), (w13, sf13, g13, w2, sf2, g2), l1, l2
    torch.cuda.empty_cache()


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("num_tokens", [1, 16, 128, 512, 2048, 8192])  # V4-Flash 8192: block_m 128 with MXFP4 w4a8
def test_deepseek_v4_shapes(model_layer, act_format, num_tokens):
    name, weight_format, (e, k, h, i), (w13, sf13, g13, w2, sf2, g2), l1, l2 = model_layer
    if name == "V4-Pro" and num_tokens not in (1, 512):
        pytest.skip("V4-Pro: a decode and a prefill size are enough (time)")
    idx, w = reference.make_random_routing(num_tokens, e, k, masked_fraction=0.05, seed=num_tokens, device="cuda",
                                           dtype=torch.int64)
    x = torch.randn(num_tokens, h, device="cuda").bfloat16()
    buf = megamoe.get_symm_buffer(None, e, num_tokens, k, h, i, act_format=act_format)
    megamoe.pre_dispatch(x, idx, w, buf, weight_format=weight_format)
    y = torch.full_like(x, float("nan"))
    megamoe.fp8_fp4_mega_moe(y, l1, l2, buf, weight_format=weight_format)
    assert torch.isfinite(y).all()
    # The reference is per token: check a random sample of at most 256 tokens.
    sample = torch.randperm(num_tokens, device="cuda")[:256]
    ref = reference.mega_moe(x[sample], idx[sample], w[sample], w13, w2, weight_format=weight_format,
                             act_format=act_format, w13_sf=sf13, w2_sf=sf2, w13_global_sf=g13, w2_global_sf=g2)
    assert rel_err(y[sample], ref) <= TOL, name


@pytest.mark.parametrize("weight_format", ["mxfp4", "nvfp4"])
def test_scale_tiles_misaligned_are_refused(weight_format):
    """Scale tiles go to shared memory in 16-byte pieces: tiled FP4 scales (hidden 1024: K / blk a multiple of 16)
    whose data pointer is off 16-byte alignment (a sliced tensor; transform_weights never returns one) are refused
    naming the argument, before any launch (y keeps its poison)."""
    case = make_case(4, 1024, 256, 2, 8, weight_format, "fp8", device="cuda", seed=9, with_ref=False)
    w, sf, g = case.l1
    raw = sf.view(torch.uint8)
    shifted = torch.empty(raw.numel() + 8, dtype=torch.uint8, device="cuda")[8:].view(raw.shape)
    shifted.copy_(raw)
    megamoe.pre_dispatch(case.x, case.topk_idx, case.topk_weights, case.buffer, weight_format=weight_format)
    y = torch.full_like(case.x, float("nan"))
    with pytest.raises(ValueError, match=r"l1_weights_sf: expected a data pointer aligned to 16 bytes.*offset of 8"):
        megamoe.fp8_fp4_mega_moe(y, (w, shifted.view(sf.dtype), g), case.l2, case.buffer, weight_format=weight_format)
    torch.cuda.synchronize()
    assert y.isnan().all()


def test_mxfp4_row_exponents_misaligned_is_refused():
    """The kernel copies four rows' exponents as one 4-byte word: MXFP4 row exponents whose data pointer is off 4-byte
    alignment (a sliced tensor; transform_weights never returns one) are refused naming the argument, before any
    launch (y keeps its poison)."""
    case = make_case(4, 256, 128, 2, 8, "mxfp4", "fp8", device="cuda", seed=7, with_ref=False)
    w, sf, row_exp = case.l1
    shifted = torch.empty(row_exp.numel() + 1, dtype=torch.uint8, device="cuda")[1:].view(row_exp.shape)
    shifted.copy_(row_exp)
    megamoe.pre_dispatch(case.x, case.topk_idx, case.topk_weights, case.buffer, weight_format="mxfp4")
    y = torch.full_like(case.x, float("nan"))
    with pytest.raises(ValueError, match=r"l1_weights_global_sf: expected a data pointer aligned to 4 bytes.*offset of 1"):
        megamoe.fp8_fp4_mega_moe(y, (w, sf, shifted), case.l2, case.buffer, weight_format="mxfp4")
    torch.cuda.synchronize()
    assert y.isnan().all()


@pytest.mark.parametrize("num_tokens", [7, 40])
def test_mxfp4_w4a4_fold_split_equals_converters_split(num_tokens, monkeypatch):
    """Split K of the last round with MXFP4 tokens: the folded build (kOutFP4 with split K) equals the converters'
    split build bitwise (the same partials summed in split order), both against the reference within the tolerance;
    the round is forced so that at least one GEMM splits (the Python mirror of the plan)."""
    e, h, i, k = 16, 2048, 512, 4
    case = make_case(e, h, i, k, num_tokens, "mxfp4", "fp4", device="cuda", seed=131 * num_tokens)
    monkeypatch.setenv("MEGAMOE_MXFP4_FP8MMA", "1")
    monkeypatch.setenv("MEGAMOE_FP4_BLOCK_M", "16")
    tiles = fp4_split_plans(case, e, h, i, 16, 2)[0][0]
    round_ = tiles - 1
    plans = fp4_split_plans(case, e, h, i, 16, round_)
    assert any(s > 1 for _, s in plans), plans
    monkeypatch.setenv("MEGAMOE_FP4_SPLIT_ROUND", str(round_))

    def run(fold):
        monkeypatch.setenv("MEGAMOE_FP4_FOLD_MXFP4", "1" if fold else "0")
        poison_dispatch_rows(case.buffer)
        y = run_split_poisoned(case)
        assert dispatch_rows_copied(case) != fold
        return y

    converters = run(False)
    assert rel_err(converters, case.ref) <= (TOL if num_tokens * k > 100 else 5e-2)
    assert torch.equal(run(True), converters)
    assert torch.equal(run(True), converters)  # run to run


# ------------------------------------------------------------------------------------------------
# The GEMV path: one token on one rank, FP4 weights with FP8 tokens or tokens of their own format (heuristics::fp4_gemv)
# ------------------------------------------------------------------------------------------------
GEMV_PAIRS = [("mxfp4", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp8"), ("nvfp4", "fp4")]  # heuristics::fp4_gemv's pairs


def run_marked(case, **kwargs):
    """run_poisoned with routing's first per-expert row count poisoned first; returns (y, whether routing rewrote it,
    i.e. whether the tile walk took the call: the GEMV path runs no routing)."""
    buf, off = case.buffer.buffer, case.buffer.layout["expert_count_offset"]
    buf[off:off + 4].fill_(0x7F)
    y = run_poisoned(case, **kwargs)
    return y, not bool((buf[off:off + 4] == 0x7F).all())


@pytest.mark.parametrize("shape", [(8, 256, 384, 3), (16, 1024, 512, 4), (64, 640, 896, 8)],
                         ids=["row-scales", "scale-tiles", "odd"])
@pytest.mark.parametrize("clamp,fast_math", [(None, True), (0.5, False)], ids=["plain", "clamp-exact"])
@pytest.mark.parametrize("weight_format,act_format", GEMV_PAIRS)
def test_fp4_gemv_one_token(shape, clamp, fast_math, weight_format, act_format, monkeypatch):
    """MXFP4 and NVFP4 w4a8 and w4a4 at T=1 on one rank take the GEMV path (routing does not run) and agree with the reference and with
    the tile walk (MEGAMOE_FP4_GEMV=0, which routing shows it took; another summation: within the tolerance, not
    bitwise); repeated calls are bitwise equal. Shapes: row-major scales (K / 32 not a multiple of 16), scale tiles in
    both GEMMs, an odd one (hidden 640, intermediate 896: 5 and 7 groups of 128 over 8 warps, some with none). With the
    clamp biting (x scaled up) and the exact silu."""
    e, h, i, k = shape
    case = make_case(e, h, i, k, 1, weight_format, act_format, device="cuda", masked_fraction=0.0, seed=811 + h)
    if clamp is not None:
        case.x = case.x * 4
    ref = case.reference(activation_clamp=clamp)
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    y, routed = run_marked(case, activation_clamp=clamp, fast_math=fast_math)
    assert not routed, "the default took the tile walk at T=1"
    assert rel_err(y, ref) <= TOL
    assert torch.equal(run_poisoned(case, activation_clamp=clamp, fast_math=fast_math), y)
    monkeypatch.setenv("MEGAMOE_FP4_GEMV", "0")
    walk, routed = run_marked(case, activation_clamp=clamp, fast_math=fast_math)
    assert routed
    assert rel_err(y, walk) <= TOL


def test_fp4_gemv_slots_stats_and_errors(monkeypatch):
    """The GEMV path's slots: a repeated expert counts twice in recv_stats and adds twice, a masked slot (-1) adds
    nothing, all slots masked give zeros, a bad id is skipped and reported (check=True raises) as routing reports it;
    against the reference."""
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    case = make_case(8, 256, 384, 4, 1, "mxfp4", "fp8", device="cuda", masked_fraction=0.0, seed=812)
    idx = torch.tensor([[3, -1, 3, 6]], dtype=case.topk_idx.dtype, device="cuda")
    case.topk_idx = idx
    stats = torch.zeros(8, dtype=torch.int32, device="cuda")
    y, routed = run_marked(case, recv_stats=stats)
    assert not routed
    assert torch.equal(stats, torch.bincount(torch.tensor([3, 3, 6]), minlength=8).int().cuda())
    assert rel_err(y, case.reference(topk_idx=idx)) <= TOL
    case.topk_idx = torch.full_like(idx, -1)
    assert torch.equal(run_poisoned(case), torch.zeros_like(case.x))
    bad = idx.clone()
    bad[0, 1] = 8  # == num_experts
    case.topk_idx = bad
    assert rel_err(run_poisoned(case), case.reference(topk_idx=idx)) <= TOL
    with pytest.raises(ValueError, match=r"topk_idx.*got 8 at token 0, slot 1"):
        run_poisoned(case, check=True)


@pytest.mark.parametrize("weight_format,act_format", GEMV_PAIRS)
def test_fp4_gemv_many_slots_several_items_a_cta(weight_format, act_format, monkeypatch):
    """top_k 12 with masked and bad slots between valid ones, and more items than SMs (L1: 16 items a slot, L2: 16;
    12 slots: 192 items, so a CTA takes two, skipping the invalid slots' items in between): against the reference with
    the bad slot masked, recv_stats per valid slot, and the bad id reported (check=True raises). y is bitwise the
    combine's sum of L2's bf16 rows in the combine area (float32 in slot order, valid slots only)."""
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    e = 24
    case = make_case(e, 1024, 512, 12, 1, weight_format, act_format, device="cuda", masked_fraction=0.0, seed=815)
    idx = torch.tensor([[3, -1, 17, 5, e, 9, -1, 3, 22, 0, 11, 8]], dtype=case.topk_idx.dtype, device="cuda")
    valid = idx.clone()
    valid[0, 4] = -1
    case.topk_idx = idx
    stats = torch.zeros(e, dtype=torch.int32, device="cuda")
    y, routed = run_marked(case, recv_stats=stats)
    assert not routed
    kept = valid[valid >= 0].cpu()
    assert torch.equal(stats, torch.bincount(kept, minlength=e).int().cuda())
    assert rel_err(y, case.reference(topk_idx=valid)) <= TOL
    off, h = case.buffer.layout["combine_offset"], case.x.shape[1]
    rows = case.buffer.buffer[off:off + 12 * h * 2].view(torch.bfloat16).view(12, h)
    combined = torch.zeros(h, dtype=torch.float32, device="cuda")
    for j in range(12):
        if valid[0, j] >= 0:
            combined = combined + rows[j].float()
    assert torch.equal(y[0], combined.bfloat16())
    with pytest.raises(ValueError, match=rf"topk_idx.*got {e} at token 0, slot 4"):
        run_poisoned(case, check=True)


def test_fp4_gemv_nvfp4_tokens_more_slots_a_cta_than_warps(monkeypatch):
    """NVFP4 w4a4: each L2 CTA quantizes the L1 rows of the slots its items take (quantize_tokens_nvfp4: a warp a
    slot's row amax, a thread a 16-K block); top_k 48 over hidden 4096 (L2: 64 items a slot, 3,072 items, ~23 slots a
    CTA, more than its 16 consumer warps) takes warps through several slots. Against the reference, and bitwise run
    to run."""
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    case = make_case(48, 4096, 128, 48, 1, "nvfp4", "fp4", device="cuda", masked_fraction=0.0, seed=816)
    y, routed = run_marked(case)
    assert not routed
    assert rel_err(y, case.reference()) <= TOL
    assert torch.equal(run_poisoned(case), y)


def test_fp4_gemv_nvfp4_token_rows_of_every_scale(monkeypatch):
    """NVFP4 w4a4 on the GEMV: L2 quantizes each slot's L1 output row with its own global scale (the row's amax), as the
    walk's requantization does: slots whose top-k weights make rows of zeros (weight 0), of values below the quantizer's
    amax floor (1e-9) and of ordinary and large values (1, 300) against the reference and the walk, and the zero and tiny
    slots alone (their output all zeros in the reference, or tiny) within the tolerance of theirs."""
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    case = make_case(8, 256, 384, 4, 1, "nvfp4", "fp4", device="cuda", masked_fraction=0.0, seed=816)
    case.topk_weights = torch.tensor([[0.0, 1e-9, 1.0, 300.0]], device="cuda")
    y, routed = run_marked(case)
    assert not routed
    assert rel_err(y, case.reference()) <= TOL
    monkeypatch.setenv("MEGAMOE_FP4_GEMV", "0")
    walk, routed = run_marked(case)
    assert routed
    assert rel_err(y, walk) <= TOL
    monkeypatch.delenv("MEGAMOE_FP4_GEMV")
    for weights in ([0.0, 0.0, 0.0, 0.0], [0.0, 1e-9, 0.0, 0.0]):
        case.topk_weights = torch.tensor([weights], device="cuda")
        y = run_poisoned(case)
        ref = case.reference()
        if weights[1] == 0.0:
            assert torch.equal(y, torch.zeros_like(y))
        else:
            assert torch.isfinite(y).all() and rel_err(y, ref) <= TOL


@pytest.mark.parametrize("weight_format,act_format", GEMV_PAIRS)
def test_fp4_gemv_item_runs_same_bits(weight_format, act_format, monkeypatch):
    """Each CTA's items as a run of consecutive items or as every gridDim.x-th (MEGAMOE_FP4_GEMV_RUNS, L1 bit 0, L2
    bit 1): an item's sums do not depend on the CTA that takes it, so every setting gives the same bits. top_k 12 with
    masked and bad slots between valid ones (runs that start or end inside a slot and skip invalid ones), V4-like K."""
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    e = 24
    case = make_case(e, 1024, 512, 12, 1, weight_format, act_format, device="cuda", masked_fraction=0.0, seed=817)
    case.topk_idx = torch.tensor([[3, -1, 17, 5, e, 9, -1, 3, 22, 0, 11, 8]], dtype=case.topk_idx.dtype, device="cuda")
    outs = []
    for runs in "0123":
        monkeypatch.setenv("MEGAMOE_FP4_GEMV_RUNS", runs)
        y, routed = run_marked(case)
        assert not routed
        outs.append(y)
    valid = case.topk_idx.clone()
    valid[0, 4] = -1
    assert rel_err(outs[0], case.reference(topk_idx=valid)) <= TOL
    for y in outs[1:]:
        assert torch.equal(y, outs[0])


def gemv_forms_outputs(case, switch, monkeypatch):
    """The GEMV's output for each setting 0-3 of a form switch (bit 0 L1, bit 1 L2), each on the GEMV path, against
    the reference and bitwise run to run (poisoned outputs), and within the tolerance of setting 0 (the BF16 form)."""
    outs = {}
    for forms in "0123":
        monkeypatch.setenv(switch, forms)
        y, routed = run_marked(case)
        assert not routed
        assert rel_err(y, case.reference()) <= TOL, forms
        assert torch.equal(run_poisoned(case), y), forms
        outs[forms] = y
    for forms in "123":
        assert rel_err(outs[forms], outs["0"]) <= TOL, forms
    return outs


# The shapes both weight formats' form tests share (E, H, I, top_k): L1 / L2 chunks an item 2 / 1, - / 3 (hidden 1152:
# row-major scales), 5 / 1.
GEMV_FORM_SHAPES = [(16, 1024, 512, 4), (16, 1152, 1536, 4), (24, 2560, 512, 6)]
GEMV_FORM_IDS = ["two-and-one-chunks", "row-scales-three-chunks", "five-chunks"]


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("shape", GEMV_FORM_SHAPES + [(64, 512, 1536, 64), (64, 512, 1024, 64)],
                         ids=GEMV_FORM_IDS + ["l2-one-stage-fits", "l2-five-stages-fit"])
def test_fp4_gemv_mxfp4_wgmma_and_bf16_forms(shape, act_format, monkeypatch):
    """MXFP4 on the GEMV's two forms, by layer (MEGAMOE_FP4_GEMV_FP8MMA, bit 0 L1, bit 1 L2): FP8 wgmmas on weights and
    tokens folded to E4M3 (where a layer's K is whole chunks of 512) and BF16 mma.sync on exact products: each setting
    against the reference and bitwise run to run (poisoned outputs), and within the tolerance of the BF16 form. Chunks
    an item: L1 2 / - (hidden 1152: the BF16 form) / 5 / 1 / 1, L2 1 / 3 (row-major scales: hidden 1152 is not whole
    256-row scale tiles) / 1, so that warpgroups take one, several or no chunks of an item, in turn. top_k 64: L2's
    token rows leave room for 1 and 5 chunk stages, where the layer keeps the BF16 form (heuristics::
    fp4_gemv_chunk_stages: 8 or none) while L1 takes the wgmma form."""
    e, h, i, k = shape
    case = make_case(e, h, i, k, 1, "mxfp4", act_format, device="cuda", masked_fraction=0.0, seed=818 + h)
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    gemv_forms_outputs(case, "MEGAMOE_FP4_GEMV_FP8MMA", monkeypatch)


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("shape", GEMV_FORM_SHAPES + [(64, 512, 1024, 64), (8, 4096, 2048, 6)],
                         ids=GEMV_FORM_IDS + ["l2-no-room", "v4-flash-layers"])
def test_fp4_gemv_nvfp4_wgmma_and_bf16_forms(shape, act_format, monkeypatch):
    """NVFP4 on the GEMV's two forms, by layer (MEGAMOE_FP4_GEMV_NV_FP8MMA, bit 0 L1, bit 1 L2 with FP8 tokens): FP8
    wgmmas on the unscaled E2M1 weights against B operands that keep each token lane's K in its own column (each
    accumulator column one 16-K block's sum, scaled in float32 by its UE4M3 weight scale and the token's), and BF16
    mma.sync on exact products: each setting against the reference and bitwise run to run (poisoned outputs), and
    within the tolerance of the BF16 form. Chunks an item: L1 2 / - (hidden 1152) / 5 / 1 / 8, L2 1 / 3 (row-major
    scales: hidden 1152 is not whole 256-row scale tiles) / 1 / 2 (top_k 64: no room for 8 chunk stages beside the
    token, the BF16 form) / 4, so that warpgroups take one, several or no chunks of an item. NVFP4 tokens: L2 keeps the
    BF16 form (its quantizer writes that form's fragments)."""
    e, h, i, k = shape
    case = make_case(e, h, i, k, 1, "nvfp4", act_format, device="cuda", masked_fraction=0.0, seed=929 + h)
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    outs = gemv_forms_outputs(case, "MEGAMOE_FP4_GEMV_NV_FP8MMA", monkeypatch)
    if act_format == "fp8" and h == 4096:  # both layers on it, K 4096 / 2048: the sums' order and FP8-wgmma rounding
        assert not torch.equal(outs["3"], outs["0"])  # show in some of the 4096 outputs (the switch took effect)


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("layer_key,scale_byte",
                         [("w13_sf", 0x07), ("w13_sf", 0x08), ("w13_sf", 0x7E), ("w13_sf", 0x7F), ("w2_sf", 0x01),
                          ("w2_sf", 0x07), ("w2_sf", 0x08), ("w2_sf", 0x7E), ("w2_sf", 0x7F)],
                         ids=["l1-max-subnormal", "l1-min-normal", "l1-max", "l1-nan", "l2-min-subnormal",
                              "l2-max-subnormal", "l2-min-normal", "l2-max", "l2-nan"])
def test_fp4_gemv_nvfp4_scale_bytes(layer_key, scale_byte, act_format, monkeypatch):
    """NVFP4 weight scale bytes at the ends of UE4M3's range on both GEMV forms (MEGAMOE_FP4_GEMV_NV_FP8MMA 0 / 3):
    every UE4M3 byte of one layer of the token's only expert (top_k 1) set to a subnormal (2^-9, 7 x 2^-9), the smallest
    normal (2^-6) or 448 is applied exactly (the output, that expert's alone, against the reference: a byte flushed or
    misread moves all of it); 0x7F (NaN) makes the output non-finite, never a finite wrong value. L1 at 2^-9 is left
    out: its outputs then requantize to zero. Hidden 1024 / intermediate 512: both layers on the wgmma form with 3."""
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    case = make_case(8, 1024, 512, 1, 1, "nvfp4", act_format, device="cuda", masked_fraction=0.0, seed=31)
    e = int(case.topk_idx[0, 0])
    layer = dict(case.layer)
    sf = layer[layer_key].clone()
    sf.view(torch.uint8)[e] = scale_byte
    with_nvfp4_scales(case, layer, layer_key, sf)
    ref = case.reference()
    for forms in "03":
        monkeypatch.setenv("MEGAMOE_FP4_GEMV_NV_FP8MMA", forms)
        y, routed = run_marked(case)
        assert not routed
        if scale_byte == 0x7F:
            assert not torch.isfinite(y).all(), forms
        else:
            assert torch.isfinite(ref).all() and bool((ref != 0).any())
            assert rel_err(y, ref) <= TOL, forms


@pytest.mark.parametrize("scale_byte", [161, 200, 255])
def test_fp4_gemv_scale_range(scale_byte, monkeypatch):
    """The GEMV decodes each weight relative to its row's largest scale (transform_weights' row exponents) and
    multiplies the row by 2^(e - 127) in float32, as the FP8-wgmma path does: scale bytes past the BF16 path's range
    (2^33) stay exact, and 255 (NaN) makes the output of a token routed to that expert non-finite."""
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    case, hit = scale_byte_case("fp8", scale_byte)
    t = int(hit.nonzero()[0, 0])  # one token routed to the expert with the odd scale
    case.x, case.topk_idx, case.topk_weights = case.x[t:t + 1], case.topk_idx[t:t + 1], case.topk_weights[t:t + 1]
    y, routed = run_marked(case)
    assert not routed
    if scale_byte == 255:
        assert not torch.isfinite(y).all()
    else:
        ref = case.reference()
        assert torch.isfinite(ref).all()
        assert rel_err(y, ref) <= TOL


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
def test_fp4_gemv_deepseek_v4_graph(model_layer, act_format, monkeypatch):
    """DeepSeek-V4 shapes at T=1 (MXFP4 and NVFP4, w4a8 and w4a4) on the GEMV path (routing does not run): against the
    reference and the tile walk (MEGAMOE_FP4_GEMV=0), and captured in a CUDA graph replayed with new inputs (a new token, ids with a
    masked and a repeated slot, new weights): the same bits as an eager call on them."""
    name, weight_format, (e, k, h, i), (w13, sf13, g13, w2, sf2, g2), l1, l2 = model_layer
    if (weight_format, act_format) not in GEMV_PAIRS:
        pytest.skip("not a GEMV pair (heuristics::fp4_gemv)")
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    buf = megamoe.get_symm_buffer(None, e, 1, k, h, i, act_format=act_format)
    x = torch.randn(1, h, device="cuda").bfloat16()
    idx, w = reference.make_random_routing(1, e, k, masked_fraction=0.0, seed=5, device="cuda")
    out = torch.full_like(x, float("nan"))
    off = buf.layout["expert_count_offset"]
    buf.buffer[off:off + 4].fill_(0x7F)

    def step():
        megamoe.pre_dispatch(x, idx, w, buf, weight_format=weight_format)
        megamoe.fp8_fp4_mega_moe(out, l1, l2, buf, weight_format=weight_format)

    def ref():
        return reference.mega_moe(x, idx, w, w13, w2, weight_format=weight_format, act_format=act_format, w13_sf=sf13,
                                  w2_sf=sf2, w13_global_sf=g13, w2_global_sf=g2)

    graph = capture_graph(step)  # one eager call first, then the capture
    torch.cuda.synchronize()
    assert bool((buf.buffer[off:off + 4] == 0x7F).all()), "the tile walk took the call"
    eager = out.clone()
    assert rel_err(eager, ref()) <= TOL, name
    monkeypatch.setenv("MEGAMOE_FP4_GEMV", "0")
    step()
    assert rel_err(eager, out) <= TOL, name
    monkeypatch.delenv("MEGAMOE_FP4_GEMV")
    x.copy_(torch.randn_like(x))
    new_idx = idx.clone()
    new_idx[0, 1], new_idx[0, 2] = -1, new_idx[0, 0]
    idx.copy_(new_idx)
    w.copy_(torch.rand_like(w))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    out.fill_(float("nan"))
    step()
    assert torch.equal(replayed, out)
    assert rel_err(replayed, ref()) <= TOL, name


@pytest.mark.parametrize("fp8_mma", ["0", "3"], ids=["bf16-form", "wgmma-form"])
@pytest.mark.parametrize("weight_format,act_format", GEMV_PAIRS)
def test_fp4_gemv_back_to_back_calls_stream_their_own_experts(weight_format, act_format, fp8_mma, monkeypatch):
    """The GEMV's L1 reads the token's expert ids before its dependency wait (pre_dispatch triggers it only once its
    blocks stored and fenced them) and streams those experts' weights while pre_dispatch still runs. Calls issued back
    to back on one buffer, with no synchronisation between them and each call's experts disjoint from the previous
    call's, each match the reference of their own inputs (ids read before they were stored would be the previous
    call's: other experts), eagerly and replayed in one CUDA graph (the same bits). Its negative control (the early
    read with pre_dispatch triggering right after its wait, before the ids: H100, 2026-11-27) passed as well: pre_dispatch
    stores the ids within its first instructions, so that race did not show in 8 calls; the test guards the protocol's
    grosser failures (ids read from the wrong call or place)."""
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    monkeypatch.setenv("MEGAMOE_FP4_GEMV_FP8MMA", fp8_mma)  # both producers (produce / produce_chunks)
    monkeypatch.setenv("MEGAMOE_FP4_GEMV_NV_FP8MMA", fp8_mma)
    e, h, i, k, calls = 32, 1024, 512, 4, 8
    case = make_case(e, h, i, k, 1, weight_format, act_format, device="cuda", masked_fraction=0.0, seed=9001,
                     with_ref=False)
    gen = torch.Generator().manual_seed(9002)
    groups = torch.randperm(e, generator=gen).view(e // k, k)  # call c takes group c % (e / k): disjoint neighbours
    xs = [torch.randn(1, h, generator=gen).bfloat16().cuda() for _ in range(calls)]
    ids = [groups[c % groups.shape[0]].view(1, k).to(torch.int32).cuda() for c in range(calls)]
    ws = [torch.rand(1, k, generator=gen).cuda() for _ in range(calls)]
    outs = [torch.full_like(xs[0], float("nan")) for _ in range(calls)]

    def step():
        for c in range(calls):
            megamoe.pre_dispatch(xs[c], ids[c], ws[c], case.buffer, weight_format=weight_format)
            megamoe.fp8_fp4_mega_moe(outs[c], case.l1, case.l2, case.buffer, weight_format=weight_format,
                                     check=False)  # no host read between the calls

    off = case.buffer.layout["expert_count_offset"]
    case.buffer.buffer[off:off + 4].fill_(0x7F)  # routing (the tile walk) would rewrite it
    step()
    torch.cuda.synchronize()
    assert bool((case.buffer.buffer[off:off + 4] == 0x7F).all()), "the tile walk took the calls"
    for c in range(calls):
        assert rel_err(outs[c], case.reference(topk_idx=ids[c], topk_weights=ws[c], x=xs[c])) <= TOL, c
    eager = [o.clone() for o in outs]
    graph = capture_graph(step)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for c in range(calls):
        assert torch.equal(outs[c], eager[c]), c
    assert case.buffer.error_word().tolist() == [0, 0, 0, 0]  # no id read early differed from the stored one


@pytest.mark.parametrize("hidden", [256, 1024], ids=["bf16-form", "wgmma-l1"])
@pytest.mark.parametrize("clamp", [None, 3.0])
@pytest.mark.parametrize("weight_format,act_format", GEMV_PAIRS)
def test_fp4_gemv_nan_token_is_never_silent(clamp, weight_format, act_format, hidden, monkeypatch):
    """A NaN in the token's hidden state makes its output non-finite on the GEMV path (the token's scale, the clamp
    and the L1 requantization keep it), as on the tile walk; hidden 1024: L1 on the wgmma forms (whole 512-K chunks)."""
    monkeypatch.delenv("MEGAMOE_FP4_GEMV", raising=False)
    case = make_case(8, hidden, 384, 3, 1, weight_format, act_format, device="cuda", masked_fraction=0.0, seed=814)
    case.x = case.x.clone()
    case.x[0, 17] = float("nan")
    y, routed = run_marked(case, activation_clamp=clamp)
    assert not routed
    assert not torch.isfinite(y).all()
