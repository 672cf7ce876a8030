"""Tests of megamoe.formats: bit patterns, rounding rules, scale rules and error bounds.

Every test draws fresh inputs from its own seed (generated on the CPU, then moved, so the CPU and CUDA
runs see the same numbers). Expected values come from hand-written tables or from independent
computations (float64 arithmetic, brute-force nearest search, Python integers).
"""

import math
import sys

import pytest
import torch

from megamoe import formats as F

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")]
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]

E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn_blocks(shape, block: int, seed: int, device, dtype=torch.float32, spread: int = 8) -> torch.Tensor:
    """Normal values whose magnitude varies by up to 2^±spread from block to block (last dim blocked)."""
    g = _gen(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    k = shape[-1]
    exps = torch.randint(-spread, spread + 1, (*shape[:-1], k // block, 1), generator=g).double()
    x = (x.reshape(*shape[:-1], k // block, block) * torch.exp2(exps)).reshape(shape)
    return x.to(dtype).to(device)


def _e2m1_ref(x: torch.Tensor) -> torch.Tensor:
    """Brute-force E2M1 rounding in float64: nearest magnitude, ties to the even code, sign from x < 0."""
    xc = x.detach().cpu().to(torch.float32)
    m = xc.double().abs().reshape(-1, 1)
    values = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    dist = (m - values).abs()
    is_nearest = dist == dist.min(dim=1, keepdim=True).values
    even = (torch.arange(8) % 2 == 0).long()
    mag = (is_nearest.long() * (2 + even)).argmax(dim=1)  # of two nearest (a tie), the even code wins
    mag = torch.where(m.flatten().isinf(), 7, mag)
    mag = torch.where(m.flatten().isnan(), 0, mag)
    sign = (xc.flatten() < 0).long() * 8
    return (mag + sign).reshape(x.shape).to(torch.uint8)


def _unpack_ref(packed: torch.Tensor) -> torch.Tensor:
    """Independent nibble split: code[2i] = byte % 16, code[2i+1] = byte // 16."""
    p = packed.cpu().long()
    codes = torch.empty(*p.shape[:-1], 2 * p.shape[-1], dtype=torch.long)
    codes[..., 0::2] = p % 16
    codes[..., 1::2] = p // 16
    return codes


def _is_pow2(t: torch.Tensor) -> bool:
    return all(v > 0 and math.frexp(v)[0] == 0.5 for v in t.double().flatten().tolist())


def _f32_div(a: torch.Tensor, b: float) -> torch.Tensor:
    """Correctly rounded float32 a / b (float64 quotient of float32 operands, rounded once)."""
    return (a.double() / b).float()


# ----------------------------------------------------------------------------------------------------
# E2M1
# ----------------------------------------------------------------------------------------------------


def test_e2m1_values_table():
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert F.E2M1_VALUES.dtype == torch.float32
    assert F.E2M1_VALUES.tolist() == expected
    assert [math.copysign(1, v) for v in F.E2M1_VALUES.tolist()] == [1] * 8 + [-1] * 8


def test_e2m1_times_pow2_is_e4m3_from_2_pow_6_down_to_2_pow_minus_8():
    """The fold the FP8-wgmma MXFP4 path relies on (benchmarks/fold_error.py): every E2M1 value times 2^-d is
    an E4M3 value for -6 <= d <= 8 (0.5 x 2^-8 is E4M3's smallest subnormal, 6 x 2^6 = 384 <= 448 its
    largest), and no longer for d = 9 or d = -7; so a weight row folded relative to its largest scale times 2^-6
    is exact while its scales span at most 14 binades."""
    v = F.E2M1_VALUES.to(torch.float32)
    for d in range(-6, 9):
        x = v * 2.0 ** -d
        assert torch.equal(x.to(torch.float8_e4m3fn).to(torch.float32), x), d
    for d in (-7, 9):
        x = v * 2.0 ** -d
        assert not torch.equal(x.to(torch.float8_e4m3fn).to(torch.float32), x), d


def test_e2m1_every_code_round_trips(device):
    codes = torch.arange(16, dtype=torch.uint8, device=device)
    values = F.e2m1_dequantize(codes)
    assert values.dtype == torch.float32
    assert torch.equal(values.cpu(), F.E2M1_VALUES)
    # -0.0 (code 8) is not < 0, so it quantizes to +0 (code 0); every other code is a fixed point.
    expected = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 11, 12, 13, 14, 15], dtype=torch.uint8)
    assert torch.equal(F.e2m1_quantize(values).cpu(), expected)


def test_e2m1_ties_to_even_and_saturation(device):
    cases = {
        0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6,  # ties -> even code
        0.2: 0, 0.3: 1, 0.74: 1, 0.76: 2, 1.3: 3, 1.7: 3, 2.4: 4, 2.6: 5, 3.4: 5, 3.6: 6, 4.9: 6, 5.1: 7,
        6.0: 7, 7.0: 7, 100.0: 7, math.inf: 7,  # saturation
    }
    x = torch.tensor(list(cases), dtype=torch.float32, device=device)
    expected = torch.tensor(list(cases.values()), dtype=torch.uint8)
    assert torch.equal(F.e2m1_quantize(x).cpu(), expected)
    # Negatives mirror with the sign bit, including those that round to zero (code 8 = -0).
    assert torch.equal(F.e2m1_quantize(-x).cpu(), expected | 8)
    specials = torch.tensor([-0.0, 0.0, -0.1, math.nan, -math.nan], device=device)
    assert F.e2m1_quantize(specials).cpu().tolist() == [0, 0, 8, 0, 0]


def test_e2m1_quantize_matches_brute_force(device):
    g = _gen(101)
    x = torch.randn(4096, generator=g) * 3
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # The midpoints, their float32 neighbours and their negatives.
    below = torch.nextafter(midpoints, torch.tensor(0.0))
    above = torch.nextafter(midpoints, torch.tensor(9.0))
    near = torch.cat([midpoints, below, above])
    x = torch.cat([x, near, -near])
    got = F.e2m1_quantize(x.to(device))
    assert got.dtype == torch.uint8
    assert torch.equal(got.cpu(), _e2m1_ref(x))


def test_e2m1_known_bytes_decode(device):
    # byte -> (value of low nibble, value of high nibble)
    cases = {
        0x71: (0.5, 6.0),
        0x00: (0.0, 0.0),
        0xF8: (-0.0, -6.0),
        0x2A: (-1.0, 1.0),
        0x9C: (-2.0, -0.5),
        0x35: (3.0, 1.5),
        0x6E: (-4.0, 4.0),
        0x4B: (-1.5, 2.0),
    }
    packed = torch.tensor(list(cases), dtype=torch.uint8, device=device).reshape(2, 4)
    values = F.e2m1_dequantize(F.unpack_e2m1(packed)).cpu()
    expected = torch.tensor([v for pair in cases.values() for v in pair]).reshape(2, 8)
    assert values.shape == (2, 8)
    assert torch.equal(values, expected)
    assert torch.equal(values.signbit(), expected.signbit())  # -0.0 of code 8 survives
    # and back: quantizing the values repacks the same bytes, except -0.0 -> code 0 (0xF8 -> 0xF0)
    repacked = F.pack_e2m1(F.e2m1_quantize(values.to(device))).cpu().flatten().tolist()
    assert repacked == [0x71, 0x00, 0xF0, 0x2A, 0x9C, 0x35, 0x6E, 0x4B]


def test_pack_unpack_e2m1_round_trip(device):
    codes = torch.randint(0, 16, (3, 5, 64), generator=_gen(102), dtype=torch.uint8)
    packed = F.pack_e2m1(codes.to(device))
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    expected = (codes[..., 0::2].long() + 16 * codes[..., 1::2].long()).to(torch.uint8)
    assert torch.equal(packed.cpu(), expected)
    assert torch.equal(_unpack_ref(packed), codes.long())
    unpacked = F.unpack_e2m1(packed)
    assert unpacked.dtype == torch.uint8 and torch.equal(unpacked.cpu(), codes)
    # int8 and float4_e2m1fn_x2 storage of the same bytes unpack the same
    assert torch.equal(F.unpack_e2m1(packed.view(torch.int8)).cpu(), codes)
    assert torch.equal(F.unpack_e2m1(packed.view(torch.float4_e2m1fn_x2)).cpu(), codes)


# ----------------------------------------------------------------------------------------------------
# UE8M0 and ceil_pow2
# ----------------------------------------------------------------------------------------------------


def test_ue8m0_every_byte_round_trips(device):
    b = torch.arange(255, dtype=torch.uint8, device=device)
    values = F.ue8m0_to_float(b)
    assert values.dtype == torch.float32
    assert values.cpu().double().tolist() == [math.ldexp(1.0, i - 127) for i in range(255)]
    assert values[0].item() == 2.0**-127 and values[0].item() != 0  # exact float32 subnormal
    assert torch.equal(F.float_to_ue8m0(values), b)
    assert torch.isnan(F.ue8m0_to_float(torch.tensor([255], dtype=torch.uint8, device=device))).item()
    # agrees with torch's own e8m0 decoding (CPU), and float8_e8m0fnu input is accepted
    all_bytes = torch.arange(256, dtype=torch.uint8)
    torch_values = all_bytes.view(torch.float8_e8m0fnu).float()
    ours = F.ue8m0_to_float(all_bytes.to(device)).cpu()
    assert torch.allclose(ours, torch_values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(F.ue8m0_to_float(b.view(torch.float8_e8m0fnu)), values)


def test_ceil_pow2_powers_and_non_powers(device):
    powers = torch.exp2(torch.arange(-126, 128, dtype=torch.float64)).float()
    assert torch.equal(F.ceil_pow2(powers.to(device)).cpu(), powers)
    g = _gen(103)
    x = torch.exp2(torch.rand(4096, generator=g, dtype=torch.float64) * 250 - 125).float()
    # plus the float32 neighbours of powers of two (just above must go up, just below must stay)
    x = torch.cat([x, torch.nextafter(powers[1:-1], powers[2:]), torch.nextafter(powers[1:-1], powers[:-2])])
    expected = torch.exp2(torch.ceil(torch.log2(x.double()))).float()
    got = F.ceil_pow2(x.to(device))
    assert got.dtype == torch.float32
    assert torch.equal(got.cpu(), expected)


def test_ceil_pow2_documented_edge_cases(device):
    x = torch.tensor([0.0, 1e-40, -3.0, 1.5 * 2.0**127, math.inf, math.nan], device=device)
    got = F.ceil_pow2(x).cpu().tolist()
    assert got[:5] == [0.0, 2.0**-126, 4.0, math.inf, math.inf]
    assert math.isnan(got[5])
    specials = torch.tensor([math.nan, math.inf, 0.0], device=device)
    assert F.float_to_ue8m0(specials).cpu().tolist() == [255, 255, 0]


def test_pack_ue8m0_int32(device):
    hand = torch.tensor([[1, 2, 3, 4, 0x7F, 0x80, 0x01, 0xFE]], dtype=torch.uint8, device=device)
    packed = F.pack_ue8m0_int32(hand)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed.cpu().tolist() == [[0x04030201, 0xFE01807F - 2**32]]
    sf = torch.randint(0, 256, (2, 3, 16), generator=_gen(104), dtype=torch.uint8)
    packed = F.pack_ue8m0_int32(sf.to(device))
    assert packed.shape == (2, 3, 4)
    expected = [
        int.from_bytes(bytes(sf[i, j, 4 * w : 4 * w + 4].tolist()), "little", signed=True)
        for i in range(2) for j in range(3) for w in range(4)
    ]
    assert packed.cpu().flatten().tolist() == expected
    if sys.byteorder == "little":
        assert torch.equal(packed.cpu(), sf.view(torch.int32))
    unpacked = F.unpack_ue8m0_int32(packed)
    assert unpacked.dtype == torch.uint8 and torch.equal(unpacked.cpu(), sf)


# ----------------------------------------------------------------------------------------------------
# FP8
# ----------------------------------------------------------------------------------------------------


def _fp8_error_bound(x: torch.Tensor, scale_per_element: torch.Tensor) -> torch.Tensor:
    """Half an E4M3 ulp: 2^-4 relative in the normal range, 2^-10 * scale in the subnormal one."""
    return torch.maximum(x.abs() * 2.0**-4, scale_per_element * 2.0**-10) * (1 + 1e-5)


def test_quantize_fp8_f32(device):
    x = _randn_blocks((2, 3, 512), 128, seed=105, device=device)
    q, scale = F.quantize_fp8_f32(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, 4)
    amax = x.cpu().reshape(2, 3, 4, 128).abs().amax(-1)
    assert torch.equal(scale.cpu(), _f32_div(amax, 448.0))
    # the block maximum lands on ±448
    assert torch.equal(q.float().cpu().reshape(2, 3, 4, 128).abs().amax(-1), torch.full((2, 3, 4), 448.0))
    y = F.dequantize_fp8(q, scale, 128)
    assert y.dtype == torch.float32 and y.shape == x.shape
    s = scale.cpu().repeat_interleave(128, -1)
    assert ((y.cpu() - x.cpu()).abs() <= _fp8_error_bound(x.cpu(), s)).all()
    assert torch.equal(y.cpu(), q.float().cpu() * s)


def test_quantize_fp8_ue8m0(device):
    x = _randn_blocks((4, 256), 32, seed=106, device=device)
    q, sf = F.quantize_fp8_ue8m0(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert sf.dtype == torch.uint8 and sf.shape == (4, 8)
    scale = F.ue8m0_to_float(sf).cpu()
    assert _is_pow2(scale)
    s32 = _f32_div(x.cpu().reshape(4, 8, 32).abs().amax(-1), 448.0)
    assert (scale >= s32).all() and (scale < 2 * s32).all()
    # dividing by a power of two is exact, so q is the e4m3 rounding of an exact quotient
    s = scale.repeat_interleave(32, -1)
    ref = (x.cpu().double() / s.double()).float().clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.cpu().view(torch.uint8), ref.view(torch.uint8))
    y = F.dequantize_fp8(q, sf, 32)
    assert ((y.cpu() - x.cpu()).abs() <= _fp8_error_bound(x.cpu(), s)).all()
    assert torch.equal(F.dequantize_fp8(q, sf.view(torch.float8_e8m0fnu), 32), y)


def test_quantize_fp8_block2d(device):
    w = _randn_blocks((2, 256, 384), 128, seed=107, device=device)
    q, scale = F.quantize_fp8_block2d(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 2, 3)
    tiles = w.cpu().reshape(2, 2, 128, 3, 128)
    assert torch.equal(scale.cpu(), _f32_div(tiles.abs().amax(dim=(2, 4)), 448.0))
    q_tiles = q.float().cpu().reshape(2, 2, 128, 3, 128)
    assert torch.equal(q_tiles.abs().amax(dim=(2, 4)), torch.full((2, 2, 3), 448.0))
    y = F.dequantize_fp8_block2d(q, scale)
    assert y.dtype == torch.float32 and y.shape == w.shape
    s = scale.cpu().repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert ((y.cpu() - w.cpu()).abs() <= _fp8_error_bound(w.cpu(), s)).all()
    assert torch.equal(y.cpu(), q.float().cpu() * s)


# ----------------------------------------------------------------------------------------------------
# MXFP4
# ----------------------------------------------------------------------------------------------------


def test_quantize_mxfp4(device):
    x = _randn_blocks((3, 2, 256), 32, seed=108, device=device)
    packed, sf = F.quantize_mxfp4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, 128)
    assert sf.dtype == torch.uint8 and sf.shape == (3, 2, 8)
    scale = F.ue8m0_to_float(sf).cpu()
    assert _is_pow2(scale)
    s32 = _f32_div(x.cpu().reshape(3, 2, 8, 32).abs().amax(-1), 6.0)
    assert (scale >= s32).all() and (scale < 2 * s32).all()
    s = scale.repeat_interleave(32, -1)
    assert torch.equal(_unpack_ref(packed), _e2m1_ref(x.cpu() / s).long())  # x / 2^k is exact
    y = F.dequantize_mxfp4(packed, sf).cpu()
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y, F.E2M1_VALUES[_unpack_ref(packed)] * s)
    # E2M1 rounds to within 1/5 relative above 0.5, within 1/4 absolute (in scale units) below
    bound = torch.maximum(x.cpu().abs() / 5, s / 4) * (1 + 1e-6)
    assert ((y - x.cpu()).abs() <= bound).all()
    rel = (y - x.cpu()).norm() / x.cpu().norm()
    assert rel < 0.15


# ----------------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------------


def _nvfp4_dequant_ref(packed, sf, g):
    values = F.E2M1_VALUES[_unpack_ref(packed)]
    return (values * sf.cpu().float().repeat_interleave(16, -1)) * g.cpu()


def test_quantize_nvfp4_dynamic(device):
    # a small spread keeps every block scale a normal e4m3 number, so the error bound below holds
    x = _randn_blocks((2, 3, 256), 16, seed=109, device=device, spread=2)
    packed, sf, g = F.quantize_nvfp4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 128)
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == (2, 3, 16)
    assert g.dtype == torch.float32 and g.shape == (2, 3, 1)
    xc = x.cpu()
    assert torch.equal(g.cpu(), _f32_div(xc.abs().amax(-1, keepdim=True), 6 * 448))
    six_g = (6 * g.cpu().double()).float()  # float32 product 6 * g
    amax = xc.reshape(2, 3, 16, 16).abs().amax(-1)
    sf_ref = (amax.double() / six_g.double()).float().clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(sf.cpu().view(torch.uint8), sf_ref.view(torch.uint8))
    denom = (sf.cpu().float() * g.cpu()).repeat_interleave(16, -1)
    assert torch.equal(_unpack_ref(packed), _e2m1_ref(xc / denom).long())
    y = F.dequantize_nvfp4(packed, sf, g)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.equal(y.cpu(), _nvfp4_dequant_ref(packed, sf, g))
    bound = torch.maximum(xc.abs() / 5, denom / 4) * (1 + 1e-5)
    assert ((y.cpu() - xc).abs() <= bound).all()
    assert (y.cpu() - xc).norm() / xc.norm() < 0.15


def test_nvfp4_block_scales_are_not_powers_of_two(device):
    # One row, four blocks with maxima 6, 3, 5, 0.7: g = 6 / 2688 and sf = amax * 2688 / 36.
    x = torch.rand(4, 16, generator=_gen(110)) * 0.5
    x[:, 3] = torch.tensor([6.0, -3.0, 5.0, 0.7])
    x = x.reshape(1, 64).to(device)
    packed, sf, g = F.quantize_nvfp4(x)
    # 448 = e4m3(448), 224 = e4m3(224), 384 = e4m3(373.3), 52 = e4m3(52.27)
    assert sf.float().cpu().tolist() == [[448.0, 224.0, 384.0, 52.0]]
    assert [math.frexp(v)[0] == 0.5 for v in sf.float().cpu().flatten().tolist()] == [False] * 4
    y = F.dequantize_nvfp4(packed, sf, g).cpu()
    assert torch.equal(y, _nvfp4_dequant_ref(packed, sf, g))
    # The maxima 6 and -3 come back to float32 rounding; a power-of-two sf (256 or 128) for the -3 block
    # would give -6 * 256 * g = -3.43 or saturate at -6 * 128 * g = -1.71.
    assert torch.allclose(y[0, [3, 19]], torch.tensor([6.0, -3.0]), rtol=1e-6, atol=0)


def test_nvfp4_zero_block_scale_gives_zero(device):
    x = torch.randn(2, 32, generator=_gen(111))
    x[:, :16] *= 1000
    x[:, 16:] *= 1e-7  # amax / (6 g) far below the smallest e4m3 subnormal
    packed, sf, g = F.quantize_nvfp4(x.to(device))
    assert sf.float().cpu()[:, 1].tolist() == [0.0, 0.0]
    assert (sf.float().cpu()[:, 0] > 0).all()
    assert (_unpack_ref(packed)[:, 16:] == 0).all()
    y = F.dequantize_nvfp4(packed, sf, g).cpu()
    assert torch.isfinite(y).all() and (y[:, 16:] == 0).all()


def test_nvfp4_given_global_scale(device):
    x = _randn_blocks((5, 128), 16, seed=112, device=device)
    dyn = F.quantize_nvfp4(x)
    # passing the dynamic scale back in reproduces the same bits
    given = F.quantize_nvfp4(x, dyn[2].clone())
    assert torch.equal(given[0], dyn[0])
    assert torch.equal(given[1].view(torch.uint8), dyn[1].view(torch.uint8))
    assert torch.equal(given[2], dyn[2])
    # a scalar global scale is returned as given and used for every row
    g = torch.tensor(0.01)
    packed, sf, g_out = F.quantize_nvfp4(x, g)
    assert g_out.dtype == torch.float32 and torch.equal(g_out.cpu(), g)
    amax = x.cpu().reshape(5, 8, 16).abs().amax(-1)
    sf_ref = (amax.double() / (6 * g).float().double()).float().clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(sf.cpu().view(torch.uint8), sf_ref.view(torch.uint8))
    assert torch.equal(F.dequantize_nvfp4(packed, sf, g_out).cpu(), _nvfp4_dequant_ref(packed, sf, g_out))
    with pytest.raises(ValueError, match="^global_scale:"):
        F.quantize_nvfp4(x, torch.ones(5, device=device))


def test_quantize_nvfp4_weights(device):
    w = _randn_blocks((3, 32, 64), 16, seed=113, device=device)
    w[1] *= 100
    packed, sf, g = F.quantize_nvfp4_weights(w)
    assert packed.shape == (3, 32, 32) and sf.shape == (3, 32, 4) and g.shape == (3,)
    assert g.dtype == torch.float32 and sf.dtype == torch.float8_e4m3fn
    assert torch.equal(g.cpu(), _f32_div(w.cpu().abs().amax(dim=(1, 2)), 6 * 448))
    ref = F.quantize_nvfp4(w, g[:, None, None])
    assert torch.equal(packed, ref[0]) and torch.equal(sf.view(torch.uint8), ref[1].view(torch.uint8))
    y = F.dequantize_nvfp4(packed, sf, g[:, None, None]).cpu()
    assert torch.equal(y, _nvfp4_dequant_ref(packed, sf, g[:, None, None]))
    assert (y - w.cpu()).norm() / w.cpu().norm() < 0.15
    with pytest.raises(ValueError, match="^global_scale:"):
        F.dequantize_nvfp4(packed, sf, g)  # [E] must be passed as [E, 1, 1]
    with pytest.raises(ValueError, match="^w:"):
        F.quantize_nvfp4_weights(w[0])


# ----------------------------------------------------------------------------------------------------
# all formats
# ----------------------------------------------------------------------------------------------------


def _round_trips():
    """name -> (quantize+dequantize of x [..., K], K multiple)"""
    return {
        "fp8_f32": lambda x: F.dequantize_fp8(*F.quantize_fp8_f32(x), 128),
        "fp8_ue8m0": lambda x: F.dequantize_fp8(*F.quantize_fp8_ue8m0(x), 32),
        "mxfp4": lambda x: F.dequantize_mxfp4(*F.quantize_mxfp4(x)),
        "nvfp4": lambda x: F.dequantize_nvfp4(*F.quantize_nvfp4(x)),
        "fp8_block2d": lambda x: F.dequantize_fp8_block2d(*F.quantize_fp8_block2d(x)),
    }


@pytest.mark.parametrize("name", list(_round_trips()))
def test_zero_input_gives_zero(device, name):
    x = torch.zeros(2, 128, 256, device=device)
    y = _round_trips()[name](x)
    assert y.shape == x.shape and torch.equal(y, x)


def test_zero_input_scales(device):
    x = torch.zeros(2, 256, device=device)
    _, scale = F.quantize_fp8_f32(x)
    assert torch.equal(scale.cpu(), torch.full((2, 2), _f32_div(torch.tensor(1e-4), 448.0).item()))
    _, sf = F.quantize_fp8_ue8m0(x)
    assert sf.cpu().unique().tolist() == [127 - 22]  # ceil_pow2(1e-4 / 448 = 2.2e-7) = 2^-22
    _, sf = F.quantize_mxfp4(x)
    assert sf.cpu().unique().tolist() == [127 - 15]  # ceil_pow2(1e-4 / 6 = 1.7e-5) = 2^-15
    packed, sf, g = F.quantize_nvfp4(x)
    assert (packed == 0).all() and (sf.float() == 0).all()
    assert torch.equal(g.cpu(), torch.full((2, 1), _f32_div(torch.tensor(1e-4), 2688.0).item()))


@pytest.mark.parametrize("name", list(_round_trips()))
def test_leading_dims_match_flat(device, name):
    x = _randn_blocks((2, 3, 128, 256), 32, seed=114, device=device)
    batched = _round_trips()[name](x)
    if name == "fp8_block2d":  # blocks the last two dims: flatten only the leading ones
        flat = _round_trips()[name](x.reshape(6, 128, 256)).reshape(x.shape)
    else:
        flat = _round_trips()[name](x.reshape(-1, 256)).reshape(x.shape)
    assert batched.shape == x.shape and torch.equal(batched, flat)


@pytest.mark.parametrize("name", list(_round_trips()))
def test_low_precision_input_is_computed_in_float32(device, name):
    x = _randn_blocks((128, 256), 32, seed=115, device=device, dtype=torch.bfloat16)
    assert torch.equal(_round_trips()[name](x), _round_trips()[name](x.float()))


def test_divisibility_and_shape_errors():
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="^x: last dim 48 is not divisible by 128"):
        F.quantize_fp8_f32(x)
    with pytest.raises(ValueError, match="^x:"):
        F.quantize_fp8_ue8m0(x[:, :40])
    with pytest.raises(ValueError, match="^x:"):
        F.quantize_mxfp4(x)
    with pytest.raises(ValueError, match="^x:"):
        F.quantize_nvfp4(x[:, :40])
    with pytest.raises(ValueError, match="^w:"):
        F.quantize_fp8_block2d(torch.randn(100, 128))
    with pytest.raises(ValueError, match="^codes:"):
        F.pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="^sf:"):
        F.pack_ue8m0_int32(torch.zeros(6, dtype=torch.uint8))
    q, scale = F.quantize_fp8_f32(torch.randn(2, 256))
    with pytest.raises(ValueError, match="^scale_or_sf:"):
        F.dequantize_fp8(q, scale, 32)
    with pytest.raises(ValueError, match="^q:"):
        F.dequantize_fp8_block2d(q, scale[:, None])
    with pytest.raises(ValueError, match="^packed:"):
        F.dequantize_mxfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))
    packed, sf, g = F.quantize_nvfp4(torch.randn(2, 64))
    with pytest.raises(ValueError, match="^sf:"):
        F.dequantize_nvfp4(packed, sf[:, :2], g)
    with pytest.raises(TypeError, match="^scale_or_sf:"):
        F.dequantize_fp8(q, scale.half(), 128)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available")
def test_cuda_matches_cpu_bit_exactly():
    # Maxima a with a * float32(1/d) != a / d: PyTorch's CUDA `tensor / python_float` multiplies by the
    # reciprocal, so these catch a division by a constant that is not a true float32 division.
    cand = torch.rand(100000, generator=_gen(116)) * 100

    def inexact_reciprocal(d):
        return cand[cand * torch.tensor(1 / d) != cand / d][:32]

    x = torch.randn(64, 1024, generator=_gen(117)) * 0.01
    x[:32, 0] = inexact_reciprocal(448.0)
    x[:32, 512] = -inexact_reciprocal(448.0)
    x[32:, 0] = inexact_reciprocal(6.0 * 448.0)
    x[32:, 512] = -inexact_reciprocal(6.0 * 448.0)
    quantizers = {
        "fp8_f32": F.quantize_fp8_f32,
        "fp8_ue8m0": F.quantize_fp8_ue8m0,
        "mxfp4": F.quantize_mxfp4,
        "nvfp4": F.quantize_nvfp4,
        "nvfp4_weights": lambda t: F.quantize_nvfp4_weights(t.reshape(2, 32, 1024)),
        "fp8_block2d": lambda t: F.quantize_fp8_block2d(t.reshape(256, 256)),
    }
    for name, fn in quantizers.items():
        for a, b in zip(fn(x), fn(x.cuda())):
            assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), name
    for name, fn in _round_trips().items():
        xs = x.reshape(4, 128, 128) if name == "fp8_block2d" else x
        assert torch.equal(fn(xs), fn(xs.cuda()).cpu()), name
