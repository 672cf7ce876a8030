"""Bit-exact quantization formats of megamoe, in pure PyTorch (any device).

Formats (DESIGN.md §4, docs/decisions.md):

- FP8 E4M3 (``torch.float8_e4m3fn``): elements are ``x / scale`` (a true float32 division), clamped to
  ±448 and cast (round to nearest even). Scales are float32 ``amax / 448`` (``fp8_f32_128``) or UE8M0
  ``ceil_pow2(amax / 448)`` (``fp8_ue8m0_32``).
- E2M1 code (4 bits): bit 3 sign, bits 0-2 index into {0, .5, 1, 1.5, 2, 3, 4, 6}; two codes per byte,
  ``byte = code[2i] | code[2i+1] << 4``.
- UE8M0 (uint8): value ``2^(b-127)``; 0xFF is NaN.
- MXFP4: E2M1 elements with one UE8M0 scale ``ceil_pow2(amax / 6)`` per 32.
- NVFP4: E2M1 elements with one UE4M3 (``float8_e4m3fn``) scale per 16 and a float32 global scale ``g``;
  value = ``(e2m1 * float(sf)) * g``. Block scales are never rounded to powers of two.

Common rules: everything is computed in float32; the last dim is blocked; ``amax`` is taken over the
block and clamped below at ``AMAX_EPS`` (except the NVFP4 block amax, see ``quantize_nvfp4``).

Division by a constant always divides by a tensor on the operand's device: PyTorch's CUDA kernel turns
``tensor / python_float`` into a multiplication by the reciprocal, which is not bit-exact.
"""

import torch

FP8_MAX = 448.0
E2M1_MAX = 6.0
AMAX_EPS = 1e-4

# Value of each E2M1 code; code 8 is -0.0.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)

_FP8_BLOCK = 128
_UE8M0_BLOCK = 32
_NVFP4_BLOCK = 16
_UE8M0_PER_INT32 = 4
_F32_EXP_MASK = 0xFF
_F32_MANTISSA_MASK = 0x7FFFFF
_F32_ABS_MASK = 0x7FFFFFFF
_F32_QUIET_NAN = 0x7FC00000
_F32_POW2_M127 = 0x00400000  # 2^-127: the float32 subnormal with only the top mantissa bit set


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


def _div_const(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c`` as a true float32 division on every device (see the module docstring)."""
    return x / torch.full((), c, dtype=torch.float32, device=x.device)


def _check_last_dim(t: torch.Tensor, name: str, multiple: int) -> int:
    if t.dim() == 0:
        raise ValueError(f"{name}: expected at least 1 dim, got a 0-dim tensor")
    k = t.shape[-1]
    if k % multiple != 0:
        raise ValueError(f"{name}: last dim {k} is not divisible by {multiple}")
    return k


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> [..., K/block, block] (K already checked)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblocked(x: torch.Tensor) -> torch.Tensor:
    """[..., K/block, block] -> [..., K]."""
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 [..., K] -> float32 [..., K/block]: |x| max per block, clamped below at AMAX_EPS."""
    return _blocked(x, block).abs().amax(-1).clamp_min(AMAX_EPS)


def _apply_scale(x: torch.Tensor, scale: torch.Tensor, block: int, divide: bool) -> torch.Tensor:
    """float32 [..., K] (/ or *) per-block scale [..., K/block] -> float32 [..., K]."""
    xb = _blocked(x, block)
    s = scale.unsqueeze(-1)
    return _unblocked(xb / s if divide else xb * s)


def _check_scale_blocks(k: int, scale: torch.Tensor, block: int, name: str) -> None:
    if scale.dim() == 0 or scale.shape[-1] * block != k:
        got = "a 0-dim tensor" if scale.dim() == 0 else f"last dim {scale.shape[-1]}"
        raise ValueError(f"{name}: expected last dim {k // block} (K={k} / block {block}), got {got}")


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _as_ue8m0_bytes(sf: torch.Tensor, name: str) -> torch.Tensor:
    """UE8M0 scales as uint8 (``float8_e8m0fnu`` is reinterpreted; same bits)."""
    if sf.dtype == torch.float8_e8m0fnu:
        return sf.view(torch.uint8)
    if sf.dtype != torch.uint8:
        raise TypeError(f"{name}: expected dtype uint8 or float8_e8m0fnu (UE8M0), got {sf.dtype}")
    return sf


def _as_e2m1_bytes(packed: torch.Tensor, name: str) -> torch.Tensor:
    """Packed E2M1 as uint8 (int8 and ``float4_e2m1fn_x2`` storage are reinterpreted; same bits)."""
    if packed.dtype in (torch.int8, torch.float4_e2m1fn_x2):
        return packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise TypeError(
            f"{name}: expected dtype uint8, int8 or float4_e2m1fn_x2 (packed E2M1), got {packed.dtype}"
        )
    return packed


# ----------------------------------------------------------------------------------------------------
# scalar formats: UE8M0, E2M1
# ----------------------------------------------------------------------------------------------------


def ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """Rounds float32 values up to a power of two, by their bits.

    Args:
        s: float tensor (any shape; cast to float32).
    Returns:
        float32, same shape: the exponent field plus one when the mantissa is non-zero, mantissa zeroed.

    Exact for positive normal inputs (the only ones the recipes produce, since amax >= AMAX_EPS). Other
    inputs: the sign is ignored (``ceil_pow2(-3) == 4``); 0 -> 0; subnormals -> 2^-126; values above
    2^127 -> inf; inf -> inf; NaN -> NaN.
    """
    bits = s.to(torch.float32).view(torch.int32)
    exponent = (bits >> 23) & _F32_EXP_MASK
    rounded = (exponent + ((bits & _F32_MANTISSA_MASK) != 0).to(torch.int32)) << 23
    # Exponent 255 (inf/NaN): keep the magnitude, so NaN stays NaN.
    return torch.where(exponent == _F32_EXP_MASK, bits & _F32_ABS_MASK, rounded).view(torch.float32)


def float_to_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """Encodes powers of two as UE8M0 bytes.

    Args:
        s: float tensor of exact powers of two (as returned by ``ceil_pow2``), any shape.
    Returns:
        uint8, same shape: the float32 exponent field. Mantissa bits and the sign are ignored (a
        non-power of two is floored); NaN and inf give 0xFF (NaN), 0 and subnormals give 0 (2^-127).
    """
    bits = s.to(torch.float32).view(torch.int32)
    return ((bits >> 23) & _F32_EXP_MASK).to(torch.uint8)


def ue8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """Decodes UE8M0 bytes.

    Args:
        b: uint8 (or ``float8_e8m0fnu``) tensor, any shape.
    Returns:
        float32, same shape: exactly 2^(b-127), built from bits (b=0 is the float32 subnormal 2^-127);
        0xFF -> NaN.
    """
    e = _as_ue8m0_bytes(b, "b").to(torch.int32)
    bits = torch.where(e == 0, _F32_POW2_M127, e << 23)
    bits = torch.where(e == _F32_EXP_MASK, _F32_QUIET_NAN, bits)
    return bits.view(torch.float32)


def e2m1_quantize(x: torch.Tensor) -> torch.Tensor:
    """Rounds to E2M1 codes: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code, saturating.

    Args:
        x: float tensor, any shape (compared in float32).
    Returns:
        uint8 codes 0..15, same shape. The sign bit (8) is set when x < 0, so -0.0 -> 0 but a small
        negative that rounds to zero (e.g. -0.1) -> 8 (-0). NaN -> 0 (every comparison is false).
    """
    xf = x.to(torch.float32)
    m = xf.abs()
    # Each comparison is one rounding boundary (midpoint between two values); `>` at a midpoint whose
    # lower neighbour has the even code, `>=` where the upper one has.
    code = (
        (m > 0.25).to(torch.uint8)
        + (m >= 0.75).to(torch.uint8)
        + (m > 1.25).to(torch.uint8)
        + (m >= 1.75).to(torch.uint8)
        + (m > 2.5).to(torch.uint8)
        + (m >= 3.5).to(torch.uint8)
        + (m > 5.0).to(torch.uint8)
    )
    return code | ((xf < 0).to(torch.uint8) << 3)


def e2m1_dequantize(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (integer tensor with values 0..15, any shape) -> float32 values, same shape."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Packs two E2M1 codes per byte.

    Args:
        codes: integer tensor [..., K] of codes 0..15, K even.
    Returns:
        uint8 [..., K/2] with ``byte[i] = code[2i] | code[2i+1] << 4``.
    """
    _check_last_dim(codes, "codes", 2)
    pairs = _blocked(codes.to(torch.uint8), 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_e2m1``: uint8 [..., K/2] -> uint8 codes [..., K] (low nibble first)."""
    p = _as_e2m1_bytes(packed, "packed")
    if p.dim() == 0:
        raise ValueError("packed: expected at least 1 dim, got a 0-dim tensor")
    return _unblocked(torch.stack((p & 0x0F, p >> 4), dim=-1))


def _e2m1_values(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Packed E2M1 [..., K/2] -> float32 values [..., K], K divisible by ``block``."""
    v = e2m1_dequantize(unpack_e2m1(packed))
    if v.shape[-1] % block != 0:
        raise ValueError(
            f"packed: last dim {packed.shape[-1]} holds K={v.shape[-1]}, not divisible by {block}"
        )
    return v


# ----------------------------------------------------------------------------------------------------
# FP8 E4M3 with per-block scales
# ----------------------------------------------------------------------------------------------------


def quantize_fp8_f32(x: torch.Tensor, block: int = _FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with a float32 scale per block of the last dim (recipe ``fp8_f32_128``).

    Args:
        x: float tensor [..., K], K divisible by ``block``.
    Returns:
        q: float8_e4m3fn [..., K] = e4m3(clamp(x / scale, ±448)).
        scale: float32 [..., K/block] = max(amax, AMAX_EPS) / 448.
    """
    _check_last_dim(x, "x", block)
    xf = x.to(torch.float32)
    scale = _div_const(_block_amax(xf, block), FP8_MAX)
    return _to_fp8(_apply_scale(xf, scale, block, divide=True)), scale


def quantize_fp8_ue8m0(x: torch.Tensor, block: int = _UE8M0_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with a power-of-two UE8M0 scale per block of the last dim (recipe ``fp8_ue8m0_32``).

    Args:
        x: float tensor [..., K], K divisible by ``block``.
    Returns:
        q: float8_e4m3fn [..., K] = e4m3(clamp(x / scale, ±448)).
        sf: uint8 UE8M0 [..., K/block] of scale = ceil_pow2(max(amax, AMAX_EPS) / 448).
    """
    _check_last_dim(x, "x", block)
    xf = x.to(torch.float32)
    scale = ceil_pow2(_div_const(_block_amax(xf, block), FP8_MAX))
    return _to_fp8(_apply_scale(xf, scale, block, divide=True)), float_to_ue8m0(scale)


def dequantize_fp8(q: torch.Tensor, scale_or_sf: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of ``quantize_fp8_f32`` / ``quantize_fp8_ue8m0``.

    Args:
        q: float8_e4m3fn [..., K], K divisible by ``block``.
        scale_or_sf: float32 scales or uint8 (``float8_e8m0fnu``) UE8M0 bytes, [..., K/block]; the
            dtype decides which.
        block: elements per scale.
    Returns:
        float32 [..., K] = float(q) * scale.
    """
    k = _check_last_dim(q, "q", block)
    _check_scale_blocks(k, scale_or_sf, block, "scale_or_sf")
    if scale_or_sf.dtype == torch.float32:
        scale = scale_or_sf
    elif scale_or_sf.dtype in (torch.uint8, torch.float8_e8m0fnu):
        scale = ue8m0_to_float(scale_or_sf)
    else:
        raise TypeError(
            f"scale_or_sf: expected dtype float32 (scale) or uint8/float8_e8m0fnu (UE8M0), "
            f"got {scale_or_sf.dtype}"
        )
    return _apply_scale(q.to(torch.float32), scale, block, divide=False)


def _blocked_2d(w: torch.Tensor, block: int) -> torch.Tensor:
    """[..., N, K] -> [..., N/block, block, K/block, block]."""
    n, k = w.shape[-2:]
    return w.reshape(*w.shape[:-2], n // block, block, k // block, block)


def _check_2d(w: torch.Tensor, name: str, block: int) -> tuple[int, int]:
    if w.dim() < 2:
        raise ValueError(f"{name}: expected at least 2 dims [..., N, K], got {w.dim()}")
    n, k = w.shape[-2:]
    if n % block != 0 or k % block != 0:
        raise ValueError(f"{name}: N={n} and K={k} (last two dims) must be divisible by block {block}")
    return n, k


def quantize_fp8_block2d(w: torch.Tensor, block: int = _FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights with a float32 scale per block x block tile (checkpoint format; the scale is what
    checkpoints call ``weight_scale_inv``).

    Args:
        w: float tensor [..., N, K], N and K divisible by ``block``.
    Returns:
        q: float8_e4m3fn [..., N, K] = e4m3(clamp(w / scale, ±448)).
        scale: float32 [..., N/block, K/block] = max(amax_tile, AMAX_EPS) / 448.
    """
    _check_2d(w, "w", block)
    wb = _blocked_2d(w.to(torch.float32), block)
    scale = _div_const(wb.abs().amax(dim=(-3, -1)).clamp_min(AMAX_EPS), FP8_MAX)
    q = _to_fp8(wb / scale[..., :, None, :, None])
    return q.reshape(w.shape), scale


def dequantize_fp8_block2d(q: torch.Tensor, scale: torch.Tensor, block: int = _FP8_BLOCK) -> torch.Tensor:
    """Inverse of ``quantize_fp8_block2d``.

    Args:
        q: float8_e4m3fn [..., N, K].
        scale: float32 [..., N/block, K/block].
    Returns:
        float32 [..., N, K] = float(q) * scale of its tile.
    """
    n, k = _check_2d(q, "q", block)
    if scale.dim() < 2 or tuple(scale.shape[-2:]) != (n // block, k // block):
        raise ValueError(
            f"scale: expected last two dims ({n // block}, {k // block}) for q [..., {n}, {k}] and "
            f"block {block}, got {tuple(scale.shape)}"
        )
    v = _blocked_2d(q.to(torch.float32), block) * scale.to(torch.float32)[..., :, None, :, None]
    return v.reshape(q.shape)


# ----------------------------------------------------------------------------------------------------
# MXFP4
# ----------------------------------------------------------------------------------------------------


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4: E2M1 elements, UE8M0 scale per 32 along the last dim.

    Args:
        x: float tensor [..., K], K divisible by 32.
    Returns:
        packed: uint8 [..., K/2] packed E2M1 codes of x / scale.
        sf: uint8 UE8M0 [..., K/32] of scale = ceil_pow2(max(amax, AMAX_EPS) / 6).
    """
    _check_last_dim(x, "x", _UE8M0_BLOCK)
    xf = x.to(torch.float32)
    scale = ceil_pow2(_div_const(_block_amax(xf, _UE8M0_BLOCK), E2M1_MAX))
    codes = e2m1_quantize(_apply_scale(xf, scale, _UE8M0_BLOCK, divide=True))
    return pack_e2m1(codes), float_to_ue8m0(scale)


def dequantize_mxfp4(packed: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_mxfp4``: packed uint8 [..., K/2], UE8M0 sf [..., K/32] -> float32 [..., K]."""
    v = _e2m1_values(packed, _UE8M0_BLOCK)
    _check_scale_blocks(v.shape[-1], sf, _UE8M0_BLOCK, "sf")
    return _apply_scale(v, ue8m0_to_float(sf), _UE8M0_BLOCK, divide=False)


# ----------------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------------


def _nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """g = max(amax, AMAX_EPS) / (6 * 448): maps the largest value onto the largest e2m1 x e4m3 product."""
    return _div_const(amax.clamp_min(AMAX_EPS), E2M1_MAX * FP8_MAX)


def _check_global_scale(g: torch.Tensor, x_shape: torch.Size, name: str) -> None:
    """g must broadcast to x[..., :1] without growing it (so [E] for [E, N, K] must be [E, 1, 1])."""
    row_shape = (*x_shape[:-1], 1)
    try:
        ok = tuple(torch.broadcast_shapes(g.shape, row_shape)) == row_shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name}: shape {tuple(g.shape)} does not broadcast to {row_shape} (x[..., :1]); "
            f"per-expert scales [E] of [E, N, K] weights must be passed as [E, 1, 1]"
        )


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4: E2M1 elements, UE4M3 scale per 16 along the last dim, float32 global scale.

    Args:
        x: float tensor [..., K], K divisible by 16.
        global_scale: float32 tensor (or number) broadcastable to x[..., :1], or None for the dynamic
            per-row scale g = max(amax_row, AMAX_EPS) / (6 * 448) of docs/decisions.md.
    Returns:
        packed: uint8 [..., K/2] packed E2M1 codes of x / (float(sf) * g), code 0 where that is not
            positive (sf == 0, e.g. an all-zero block or one whose amax is tiny next to g).
        sf: float8_e4m3fn [..., K/16] = e4m3(min(amax_block / (6 * g), 448)); amax_block is not
            clamped to AMAX_EPS, and sf is not rounded to a power of two.
        global_scale: float32 g, [..., 1] when computed here, else the given one as float32.
    """
    _check_last_dim(x, "x", _NVFP4_BLOCK)
    xf = x.to(torch.float32)
    if global_scale is None:
        g = _nvfp4_global_scale(xf.abs().amax(-1, keepdim=True))
    else:
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        _check_global_scale(g, x.shape, "global_scale")
    amax = _blocked(xf, _NVFP4_BLOCK).abs().amax(-1)
    sf = (amax / (E2M1_MAX * g)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = sf.to(torch.float32) * g
    scaled = _blocked(xf, _NVFP4_BLOCK) / denom.unsqueeze(-1)
    # denom > 0 exactly where sf > 0 (for a positive g); elsewhere the quotient is inf or NaN.
    scaled = torch.where(denom.unsqueeze(-1) > 0, scaled, 0.0)
    return pack_e2m1(e2m1_quantize(_unblocked(scaled))), sf, g


def dequantize_nvfp4(packed: torch.Tensor, sf: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_nvfp4``.

    Args:
        packed: uint8 [..., K/2] packed E2M1 codes.
        sf: float8_e4m3fn [..., K/16] (uint8 bytes are reinterpreted as e4m3).
        global_scale: float32 broadcastable to [..., 1] (pass per-expert [E] as [E, 1, 1]).
    Returns:
        float32 [..., K] = (e2m1 * float(sf)) * global_scale, evaluated in that order.
    """
    v = _e2m1_values(packed, _NVFP4_BLOCK)
    _check_scale_blocks(v.shape[-1], sf, _NVFP4_BLOCK, "sf")
    if sf.dtype == torch.uint8:
        sf = sf.view(torch.float8_e4m3fn)
    elif sf.dtype != torch.float8_e4m3fn:
        raise TypeError(f"sf: expected dtype float8_e4m3fn (UE4M3) or uint8, got {sf.dtype}")
    g = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    _check_global_scale(g, v.shape, "global_scale")
    return _apply_scale(v, sf.to(torch.float32), _NVFP4_BLOCK, divide=False) * g


def quantize_nvfp4_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 expert weights with a per-expert global scale (the ModelOpt checkpoint layout).

    Args:
        w: float tensor [E, N, K], K divisible by 16.
    Returns:
        packed: uint8 [E, N, K/2] (``weight``).
        sf: float8_e4m3fn [E, N, K/16] (``weight_scale``).
        global_scale: float32 [E] (``weight_scale_2``) = max(amax_expert, AMAX_EPS) / (6 * 448).
    """
    if w.dim() != 3:
        raise ValueError(f"w: expected 3 dims [E, N, K], got shape {tuple(w.shape)}")
    _check_last_dim(w, "w", _NVFP4_BLOCK)
    g = _nvfp4_global_scale(w.to(torch.float32).abs().amax(dim=(1, 2)))
    packed, sf, _ = quantize_nvfp4(w, g[:, None, None])
    return packed, sf, g


# ----------------------------------------------------------------------------------------------------
# UE8M0 packing (SM100-style)
# ----------------------------------------------------------------------------------------------------


def pack_ue8m0_int32(sf: torch.Tensor) -> torch.Tensor:
    """Packs 4 UE8M0 bytes per int32 along the last dim.

    Args:
        sf: uint8 (or ``float8_e8m0fnu``) [..., K/32], last dim divisible by 4.
    Returns:
        int32 [..., K/128]: byte j of each group at bits 8j (little endian), independent of the host.
    """
    _check_last_dim(sf, "sf", _UE8M0_PER_INT32)
    b = _blocked(_as_ue8m0_bytes(sf, "sf").to(torch.int64), _UE8M0_PER_INT32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    # Fold the unsigned 32-bit word into int32's range before narrowing.
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_ue8m0_int32(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_ue8m0_int32``: int32 [..., K/128] -> uint8 UE8M0 [..., K/32]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed: expected dtype int32, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("packed: expected at least 1 dim, got a 0-dim tensor")
    w = packed.to(torch.int64)
    b = torch.stack([(w >> (8 * j)) & 0xFF for j in range(_UE8M0_PER_INT32)], dim=-1)
    return _unblocked(b).to(torch.uint8)
