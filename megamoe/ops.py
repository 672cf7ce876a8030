"""Thin Python access to the C++ ops (``torch.ops.megamoe.*``) and their fake implementations.

The C++ ops validate every argument; the fakes repeat the shape rules that decide output metadata so
that torch.compile and FakeTensor tracing see the same contract.
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library: registers the ops)

ops = torch.ops.megamoe

# Field order of get_buffer_layout's result (csrc/include/megamoe/layout/buffer.hpp).
BUFFER_LAYOUT_FIELDS = (
    "total_bytes", "error_offset", "num_tokens_offset", "expert_count_offset", "expert_offset_offset",
    "tile_offset_offset", "sched_offset", "peer_ptrs_offset", "signal_offset", "x_offset", "x_sf_offset",
    "x_global_sf_offset", "topk_idx_offset",
    "topk_weights_offset", "recv_count_offset", "recv_idx_offset", "pool_src_offset", "dispatch_x_offset",
    "dispatch_sf_offset",
    "dispatch_global_sf_offset", "dispatch_weight_offset", "pool_offset", "pool_sf_offset", "pool_global_sf_offset",
    "combine_offset", "token_bytes", "token_sf_bytes", "pool_rows", "pool_row_bytes",
    "pool_row_sf_bytes", "num_local_experts",
)

WEIGHT_FORMATS = ("fp8", "mxfp4", "nvfp4")
ACT_FORMATS = ("fp8", "fp4")


@torch.library.register_fake("megamoe::get_buffer_layout")
def _get_buffer_layout_fake(num_experts, num_ranks, max_tokens_per_rank, top_k, hidden, intermediate,
                            act_format):
    return torch.empty(len(BUFFER_LAYOUT_FIELDS), dtype=torch.int64, device="cpu")


@torch.library.register_fake("megamoe::transform_weights")
def _transform_weights_fake(weights, weights_sf, weights_global_sf, weight_format, is_l1):
    torch._check(weight_format in WEIGHT_FORMATS, lambda: f"weight_format: unknown '{weight_format}'")
    torch._check(weights.dim() == 3, lambda: "weights: expected 3 dimensions")
    e, n = weights.shape[0], weights.shape[1]
    if weight_format == "fp8":
        k = weights.shape[2]
        sf = weights.new_empty((e, n // 64, k // 128), dtype=torch.float32)
    else:
        sf = weights_sf.new_empty(weights_sf.shape, dtype=weights_sf.dtype
                                  if weights_sf.dtype != torch.float8_e8m0fnu else torch.uint8)
    # The third tensor: mxfp4 each row's largest UE8M0 scale [E, N] uint8; else per-expert float32 [E].
    g = weights.new_empty((e, n), dtype=torch.uint8) if weight_format == "mxfp4" else \
        weights.new_empty((e,), dtype=torch.float32)
    return (weights.new_empty(weights.shape), sf, g)


@torch.library.register_fake("megamoe::pre_dispatch")
def _pre_dispatch_fake(x, topk_idx, topk_weights, buffer, num_experts, num_ranks, rank,
                       max_tokens_per_rank, top_k, intermediate, weight_format, act_format):
    torch._check(x.dim() == 2 and x.dtype == torch.bfloat16, lambda: "x: expected bf16 [num_tokens, hidden]")
    torch._check(topk_idx.shape == topk_weights.shape, lambda: "topk_idx/topk_weights: shapes differ")
    torch._check(x.shape[0] <= max_tokens_per_rank, lambda: "x: more tokens than max_tokens_per_rank")
    return None


def _mega_moe_fake_checks(y, l1_weights, l2_weights, buffer, max_tokens_per_rank):
    torch._check(y.dim() == 2 and y.dtype == torch.bfloat16, lambda: "y: expected bf16 [num_tokens, hidden]")
    torch._check(y.shape[0] <= max_tokens_per_rank, lambda: "y: more tokens than max_tokens_per_rank")
    torch._check(l1_weights.dim() == 3 and l2_weights.dim() == 3, lambda: "weights: expected 3 dimensions")
    torch._check(buffer.dtype == torch.uint8, lambda: "buffer: expected uint8")


@torch.library.register_fake("megamoe::fp8_mega_moe")
def _fp8_mega_moe_fake(y, l1_weights, l1_weights_sf, l2_weights, l2_weights_sf, buffer, num_experts,
                       num_ranks, rank, max_tokens_per_rank, top_k, activation_clamp, fast_math, recv_stats):
    _mega_moe_fake_checks(y, l1_weights, l2_weights, buffer, max_tokens_per_rank)
    return None


@torch.library.register_fake("megamoe::fp8_fp4_mega_moe")
def _fp8_fp4_mega_moe_fake(y, l1_weights, l1_weights_sf, l1_weights_global_sf, l2_weights, l2_weights_sf,
                           l2_weights_global_sf, buffer, num_experts, num_ranks, rank, max_tokens_per_rank,
                           top_k, weight_format, act_format, activation_clamp, fast_math, recv_stats):
    _mega_moe_fake_checks(y, l1_weights, l2_weights, buffer, max_tokens_per_rank)
    return None
