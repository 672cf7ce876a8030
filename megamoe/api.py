"""Public Python API: in-place ops and the functional ``moe``."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .buffer import MegaMoEBuffer, checked_mode
from .ops import ops


def _check_buffer_dims(buffer: MegaMoEBuffer, name: str, hidden: int, l2_weights: Optional[torch.Tensor] = None,
                       fp4: bool = False) -> None:
    """The ops derive H from x / y and I from l2_weights; the buffer must have been sized for the same.

    Only sizes the op itself would accept are compared here (multiples of 128, the format's weight
    dtype); the op's own checks name everything else.
    """
    if hidden % 128 == 0 and hidden != buffer.hidden:
        raise ValueError(f"{name}: expected hidden = {buffer.hidden} (the buffer's), got {hidden}")
    if l2_weights is None or l2_weights.dim() != 3:
        return
    if l2_weights.dtype != (torch.uint8 if fp4 else torch.float8_e4m3fn):
        return
    intermediate = l2_weights.shape[-1] * (2 if fp4 else 1)
    if intermediate % 128 == 0 and intermediate != buffer.intermediate:
        raise ValueError(f"l2_weights: expected intermediate = {buffer.intermediate} (the buffer's), "
                         f"got {intermediate}")


def transform_weights(weights: torch.Tensor, weights_sf: torch.Tensor,
                      weights_global_sf: Optional[torch.Tensor] = None, *, weight_format: str = "fp8",
                      is_l1: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checkpoint layout -> kernel layout, once at load (docs/decisions.md).

    Args:
        weights: L1 ``w13`` [E, 2I, H] or L2 ``w2`` [E, H, I]; float8_e4m3fn (fp8) or uint8 packed E2M1
            [E, N, K/2] (mxfp4, nvfp4).
        weights_sf: fp8: float32 [E, N/128, K/128] (``weight_scale_inv``); mxfp4: UE8M0 uint8 [E, N, K/32];
            nvfp4: float8_e4m3fn [E, N, K/16].
        weights_global_sf: nvfp4 only: float32 [E] or scalar (``weight_scale_2``).
        is_l1: True for ``w13`` (gate/up rows get interleaved), False for ``w2``.
    Returns:
        (weights, weights_sf, weights_global_sf) in kernel layout. The third tensor: nvfp4 the float32 [E]
        global scales; mxfp4 each kernel-layout row's largest UE8M0 scale, uint8 [E, N] (the FP8-wgmma path
        folds a row's weights relative to it; it scales nothing); fp8 float32 ones [E].
    """
    return ops.transform_weights(weights, weights_sf, weights_global_sf, weight_format, is_l1)


def pre_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buffer: MegaMoEBuffer,
                 *, weight_format: str = "fp8") -> None:
    """Quantize ``x`` bf16 [T, H] and store it with ``topk_idx`` int32/int64 [T, K] (-1 = unused) and
    ``topk_weights`` float32 [T, K] in ``buffer``. T <= buffer.max_tokens_per_rank."""
    _check_buffer_dims(buffer, "x", x.shape[-1])
    ops.pre_dispatch(x, topk_idx, topk_weights, buffer.buffer, *buffer.config_args, buffer.intermediate,
                     weight_format, buffer.act_format)


def fp8_mega_moe(y: torch.Tensor, l1_weights: Sequence[torch.Tensor], l2_weights: Sequence[torch.Tensor],
                 buffer: MegaMoEBuffer, *, activation_clamp: Optional[float] = None, fast_math: bool = True,
                 recv_stats: Optional[torch.Tensor] = None, check: Optional[bool] = None) -> None:
    """Fused expert layer for FP8 block weights; writes ``y`` bf16 [T, H] in place.

    Args:
        l1_weights: (weights, weights_sf[, global]) from ``transform_weights(..., is_l1=True)``.
        l2_weights: the same for ``w2``.
        recv_stats: optional int32 [E_local], incremented by the (token, slot) rows each local expert got.
        check: read the buffer's error word after the call and raise (default: MEGAMOE_CHECK=1).
    """
    _check_buffer_dims(buffer, "y", y.shape[-1], l2_weights[0])
    ops.fp8_mega_moe(y, l1_weights[0], l1_weights[1], l2_weights[0], l2_weights[1], buffer.buffer,
                     *buffer.config_args, activation_clamp, fast_math, recv_stats)
    if checked_mode(check):
        buffer.check_error()


def fp8_fp4_mega_moe(y: torch.Tensor, l1_weights: Sequence[torch.Tensor], l2_weights: Sequence[torch.Tensor],
                     buffer: MegaMoEBuffer, *, weight_format: str = "mxfp4",
                     activation_clamp: Optional[float] = None, fast_math: bool = True,
                     recv_stats: Optional[torch.Tensor] = None, check: Optional[bool] = None) -> None:
    """Fused expert layer for FP4 weights (``weight_format`` "mxfp4" or "nvfp4"); activations per
    ``buffer.act_format`` ("fp8": w4a8, "fp4": w4a4). Arguments as ``fp8_mega_moe``; the weight tuples
    hold (weights, weights_sf, weights_global_sf)."""
    _check_buffer_dims(buffer, "y", y.shape[-1], l2_weights[0], fp4=weight_format != "fp8")
    ops.fp8_fp4_mega_moe(y, l1_weights[0], l1_weights[1], l1_weights[2], l2_weights[0], l2_weights[1],
                         l2_weights[2], buffer.buffer, *buffer.config_args, weight_format, buffer.act_format,
                         activation_clamp, fast_math, recv_stats)
    if checked_mode(check):
        buffer.check_error()


def moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, l1_weights: Sequence[torch.Tensor],
        l2_weights: Sequence[torch.Tensor], buffer: MegaMoEBuffer, *, weight_format: str = "fp8",
        activation_clamp: Optional[float] = None, fast_math: bool = True,
        recv_stats: Optional[torch.Tensor] = None, check: Optional[bool] = None) -> torch.Tensor:
    """Functional form: pre_dispatch + the fused op; returns y bf16 [T, H]."""
    pre_dispatch(x, topk_idx, topk_weights, buffer, weight_format=weight_format)
    y = torch.empty_like(x)
    if weight_format == "fp8":
        fp8_mega_moe(y, l1_weights, l2_weights, buffer, activation_clamp=activation_clamp, fast_math=fast_math,
                     recv_stats=recv_stats, check=check)
    else:
        fp8_fp4_mega_moe(y, l1_weights, l2_weights, buffer, weight_format=weight_format,
                         activation_clamp=activation_clamp, fast_math=fast_math, recv_stats=recv_stats,
                         check=check)
    return y
