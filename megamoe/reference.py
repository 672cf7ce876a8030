"""PyTorch reference of the fused MoE expert layer (DESIGN.md §3): the semantics every kernel is checked
against.

The reference runs on any device, in float32 or float64 accumulation, and quantizes activations at exactly
the points the kernels do (into L1 per token, into L2 per (token, slot)), with the recipes of
docs/decisions.md implemented bit-exactly by :mod:`megamoe.formats`. With ``act_format="none"`` it skips
activation quantization; with ``weight_format="bf16"`` as well it is plain BF16 model math, the baseline
that measures a format's own error.

Besides :func:`mega_moe` it exposes the pieces other tests build on: :func:`act_recipe`,
:func:`quantize_activation`, :func:`dequantize_expert_weights`, and the random-problem generators
:func:`make_random_layer` and :func:`make_random_routing`.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from megamoe import formats

WEIGHT_FORMATS = ("fp8", "mxfp4", "nvfp4", "bf16")
ACT_FORMATS = ("fp8", "fp4", "none")
ACT_RECIPES = ("fp8_f32_128", "fp8_ue8m0_32", "mxfp4", "nvfp4", "none")

# (weight_format, act_format) -> activation recipe (docs/decisions.md, "Activation recipes").
_RECIPES = {
    ("fp8", "fp8"): "fp8_f32_128",
    ("mxfp4", "fp8"): "fp8_ue8m0_32",
    ("nvfp4", "fp8"): "fp8_ue8m0_32",
    ("mxfp4", "fp4"): "mxfp4",
    ("nvfp4", "fp4"): "nvfp4",
}

# Elements per packed byte along K of the checkpoint weight tensors.
_ELEMENTS_PER_BYTE = {"fp8": 1, "mxfp4": 2, "nvfp4": 2, "bf16": 1}


def act_recipe(weight_format: str, act_format: str) -> str:
    """The activation recipe that (weight_format, act_format) runs with.

    Returns one of ``"fp8_f32_128"``, ``"fp8_ue8m0_32"``, ``"mxfp4"``, ``"nvfp4"`` (docs/decisions.md) or
    ``"none"`` (``act_format="none"``: activations are not quantized; the only choice for ``"bf16"``
    weights). Raises ValueError naming the offending argument for unknown formats and unsupported pairs.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format: expected one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if act_format not in ACT_FORMATS:
        raise ValueError(f"act_format: expected one of {ACT_FORMATS}, got {act_format!r}")
    if act_format == "none":
        return "none"
    recipe = _RECIPES.get((weight_format, act_format))
    if recipe is None:
        allowed = sorted({a for (w, a) in _RECIPES if w == weight_format} | {"none"})
        raise ValueError(f"act_format: weight_format {weight_format!r} takes act_format in {allowed}, "
                         f"got {act_format!r}")
    return recipe


def quantize_activation(x: torch.Tensor, recipe: Union[str, Tuple[str, str]]) -> torch.Tensor:
    """Quantizes ``x`` row-wise (blocks along the last dimension) with an activation recipe and dequantizes.

    Args:
        x: float tensor ``[..., K]`` (any float dtype; quantized from its float32 value). K must be a
            multiple of the recipe's block (128, 32, 32, 16).
        recipe: a recipe name (:data:`ACT_RECIPES`) or a ``(weight_format, act_format)`` pair.
    Returns:
        float32 ``[..., K]``: the values the GEMM sees. ``"none"`` returns ``x`` as float32.
        For ``"nvfp4"`` the per-row global scale is dynamic (amax of the whole row).
    """
    if isinstance(recipe, tuple):
        recipe = act_recipe(*recipe)
    xf = x.to(torch.float32)
    if recipe == "none":
        return xf
    if recipe == "fp8_f32_128":
        q, scale = formats.quantize_fp8_f32(xf, 128)
        return formats.dequantize_fp8(q, scale, 128)
    if recipe == "fp8_ue8m0_32":
        q, sf = formats.quantize_fp8_ue8m0(xf, 32)
        return formats.dequantize_fp8(q, sf, 32)
    if recipe == "mxfp4":
        packed, sf = formats.quantize_mxfp4(xf)
        return formats.dequantize_mxfp4(packed, sf)
    if recipe == "nvfp4":
        packed, sf, g = formats.quantize_nvfp4(xf, None)
        return formats.dequantize_nvfp4(packed, sf, g)
    raise ValueError(f"recipe: expected one of {ACT_RECIPES} or a (weight_format, act_format) pair, "
                     f"got {recipe!r}")


def dequantize_expert_weights(w: torch.Tensor, sf: Optional[torch.Tensor], global_sf: Optional[torch.Tensor],
                              weight_format: str, expert: int) -> torch.Tensor:
    """Dequantizes one expert of a checkpoint-layout weight tensor to float32 ``[N, K]``.

    Args:
        w: ``[E, N, K]`` float8_e4m3fn (fp8), ``[E, N, K/2]`` uint8 packed E2M1 (mxfp4, nvfp4) or
            ``[E, N, K]`` bf16/float (bf16).
        sf: float32 ``[E, N/128, K/128]`` (fp8), uint8 UE8M0 ``[E, N, K/32]`` (mxfp4),
            float8_e4m3fn ``[E, N, K/16]`` (nvfp4); unused for bf16.
        global_sf: float32 ``[E]`` or scalar (nvfp4 only).
        weight_format: one of :data:`WEIGHT_FORMATS`.
        expert: expert index ``e``.
    """
    if weight_format == "fp8":
        return formats.dequantize_fp8_block2d(w[expert], sf[expert])
    if weight_format == "mxfp4":
        return formats.dequantize_mxfp4(w[expert], sf[expert])
    if weight_format == "nvfp4":
        g = global_sf.reshape(-1)
        g = g[expert] if g.numel() > 1 else g[0]
        return formats.dequantize_nvfp4(w[expert], sf[expert], g.to(torch.float32))
    return w[expert].to(torch.float32)


def _silu_mul(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u * weight`` in float32, ``silu(g) = g / (1 + exp(-g))``.

    ``exp`` is evaluated in float64 and rounded to float32 (the correctly rounded float32 exp): PyTorch's
    own float32 exp differs by an ulp between its vectorized and scalar paths, which would make the
    reference depend on the device, the CPU's vector ISA and the thread split.
    """
    e = torch.exp(-g.to(torch.float64)).to(torch.float32)
    return g / (1.0 + e) * u * weight


def _check_inputs(x, topk_idx, topk_weights, w13, w2, weight_format, w13_sf, w2_sf, w13_global_sf,
                  w2_global_sf, dtype) -> Tuple[int, int]:
    """Validates shapes/dtypes; returns (num_experts, intermediate). Errors name the argument."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"x: expected bf16 [num_tokens, hidden], got {x.dtype} {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx: expected int32 or int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx: expected [{num_tokens}, top_k], got {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights: expected float32 {tuple(topk_idx.shape)}, "
                         f"got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    per_byte = _ELEMENTS_PER_BYTE[weight_format]
    if w13.dim() != 3 or w13.shape[2] * per_byte != hidden or w13.shape[1] % 2:
        raise ValueError(f"w13: expected [num_experts, 2*intermediate, {hidden // per_byte}] for "
                         f"weight_format {weight_format!r}, got {tuple(w13.shape)}")
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    if w2.dim() != 3 or tuple(w2.shape) != (num_experts, hidden, intermediate // per_byte):
        raise ValueError(f"w2: expected [{num_experts}, {hidden}, {intermediate // per_byte}], "
                         f"got {tuple(w2.shape)}")
    for name, w, sf in (("w13_sf", w13, w13_sf), ("w2_sf", w2, w2_sf)):
        if weight_format == "bf16":
            continue
        if sf is None:
            raise ValueError(f"{name}: required for weight_format {weight_format!r}")
        n, k = w.shape[1], w.shape[2] * per_byte
        expected = {"fp8": (num_experts, n // 128, k // 128), "mxfp4": (num_experts, n, k // 32),
                    "nvfp4": (num_experts, n, k // 16)}[weight_format]
        if tuple(sf.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected} for weight_format {weight_format!r}, "
                             f"got {tuple(sf.shape)}")
    if weight_format == "nvfp4":
        for name, g in (("w13_global_sf", w13_global_sf), ("w2_global_sf", w2_global_sf)):
            if g is None or g.numel() not in (1, num_experts):
                raise ValueError(f"{name}: expected float32 [{num_experts}] or a scalar for weight_format "
                                 f"'nvfp4', got {None if g is None else tuple(g.shape)}")
    return num_experts, intermediate


def mega_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor, *, weight_format: str = "fp8", act_format: str = "fp8",
             w13_sf: Optional[torch.Tensor] = None, w2_sf: Optional[torch.Tensor] = None,
             w13_global_sf: Optional[torch.Tensor] = None, w2_global_sf: Optional[torch.Tensor] = None,
             activation_clamp: Optional[float] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference MoE expert layer (DESIGN.md §3) on checkpoint-layout weights.

    Args:
        x: bf16 ``[T, H]`` hidden states.
        topk_idx: int32 or int64 ``[T, K]`` expert ids; ``-1`` marks an unused slot, and any id outside
            ``[-1, E)`` is treated as ``-1`` (the kernels' skip rule).
        topk_weights: float32 ``[T, K]`` routing weights.
        w13: L1 weights ``[E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up), in the checkpoint layout of
            ``weight_format``: float8_e4m3fn (``"fp8"``), uint8 packed E2M1 ``[E, 2I, H/2]``
            (``"mxfp4"``, ``"nvfp4"``) or bf16/float master weights (``"bf16"``).
        w2: L2 weights ``[E, H, I]`` (``[E, H, I/2]`` packed for FP4), same format.
        weight_format: ``"fp8"``, ``"mxfp4"``, ``"nvfp4"`` or ``"bf16"``.
        act_format: ``"fp8"``, ``"fp4"`` or ``"none"`` (no activation quantization); with
            ``weight_format`` it selects the recipe (:func:`act_recipe`).
        w13_sf, w2_sf: block scales: float32 ``[E, N/128, K/128]`` (fp8), uint8 UE8M0 ``[E, N, K/32]``
            (mxfp4), float8_e4m3fn ``[E, N, K/16]`` (nvfp4); None for bf16.
        w13_global_sf, w2_global_sf: float32 ``[E]`` (or scalar) NVFP4 global scales; None otherwise.
        activation_clamp: if given, ``g = min(g, c)`` and ``u = clamp(u, -c, c)`` before SwiGLU.
        dtype: accumulation dtype of both GEMMs, torch.float32 (what the kernels do) or torch.float64.
    Returns:
        bf16 ``[T, H]`` on ``x``'s device; rows of tokens without a valid slot are 0.

    Steps per (token t, slot k) with valid expert e: ``xq = qdq(x[t])``; ``h = bf16(W13[e] @ xq)``;
    clamp; ``a = qdq(silu(g) * u * topk_weights[t, k])`` (float32, quantized along I);
    ``o = bf16(W2[e] @ a)``; ``y[t] = bf16(sum_k o)`` summed in float32 in slot order. Each touched
    expert's weights are dequantized once, to float32 by :mod:`megamoe.formats` (exact for FP8 and MXFP4;
    NVFP4 rounds once, when the global scale is applied), then cast to ``dtype``.
    """
    recipe = act_recipe(weight_format, act_format)
    num_experts, intermediate = _check_inputs(x, topk_idx, topk_weights, w13, w2, weight_format, w13_sf,
                                              w2_sf, w13_global_sf, w2_global_sf, dtype)
    num_tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    device = x.device
    if num_tokens == 0 or top_k == 0:
        return torch.zeros(num_tokens, hidden, dtype=torch.bfloat16, device=device)

    # One row per (token, slot), flattened token-major: row r = t * K + k.
    ids = topk_idx.to(device=device, dtype=torch.int64).reshape(-1)
    row_token = torch.arange(num_tokens, device=device).repeat_interleave(top_k)
    row_weight = topk_weights.to(device).reshape(-1)
    valid_rows = ((ids >= 0) & (ids < num_experts)).nonzero().squeeze(1)

    # Step 1: quantize-dequantize each token once, along H.
    xq = quantize_activation(x, recipe).to(dtype)
    # Step 5's bf16 outputs per (token, slot); invalid slots stay 0 and add nothing in step 6.
    o_rows = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=device)

    for e in ids[valid_rows].unique().tolist():
        rows = valid_rows[ids[valid_rows] == e]
        w13_e = dequantize_expert_weights(w13, w13_sf, w13_global_sf, weight_format, e).to(device, dtype)
        w2_e = dequantize_expert_weights(w2, w2_sf, w2_global_sf, weight_format, e).to(device, dtype)
        # Step 2: L1 GEMM, accumulated in `dtype`, rounded to bf16.
        h = (xq[row_token[rows]] @ w13_e.T).to(torch.bfloat16).to(torch.float32)
        # Step 3: split gate/up and clamp.
        g, u = h[:, :intermediate], h[:, intermediate:]
        if activation_clamp is not None:
            g = g.clamp(max=activation_clamp)
            u = u.clamp(-activation_clamp, activation_clamp)
        # Step 4: SwiGLU times the routing weight (float32), quantized along I per row.
        a = quantize_activation(_silu_mul(g, u, row_weight[rows, None]), recipe).to(dtype)
        # Step 5: L2 GEMM, accumulated in `dtype`, rounded to bf16.
        o_rows[rows] = (a @ w2_e.T).to(torch.bfloat16).to(torch.float32)

    # Step 6: float32 sum over slots in order k = 0..K-1, rounded to bf16.
    o = o_rows.view(num_tokens, top_k, hidden)
    y = o[:, 0].clone()
    for k in range(1, top_k):
        y += o[:, k]
    return y.to(torch.bfloat16)


def _generator(seed: Optional[int], generator: Optional[torch.Generator]) -> torch.Generator:
    """The generator to draw from: ``generator`` if given, else a CPU generator seeded with ``seed`` (0)."""
    if generator is not None:
        return generator
    return torch.Generator("cpu").manual_seed(0 if seed is None else seed)


def make_fp8_block_weights(num_experts: int, n: int, k: int, *, generator: Optional[torch.Generator] = None,
                           device="cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """Random checkpoint-layout FP8 block weights built expert by expert (no full float32 master, so
    DeepSeek-V4-sized layers fit): float8_e4m3fn [E, n, k] and float32 [E, n/128, k/128]; masters are
    N(0, 1/k). ``generator`` must live on ``device``."""
    w = torch.empty(num_experts, n, k, dtype=torch.float8_e4m3fn, device=device)
    sf = torch.empty(num_experts, n // 128, k // 128, dtype=torch.float32, device=device)
    for e in range(num_experts):
        master = torch.randn(n, k, device=device, generator=generator) / math.sqrt(k)
        w[e], sf[e] = formats.quantize_fp8_block2d(master)
    return w, sf


def make_fp4_expert_weights(num_experts: int, n: int, k: int, weight_format: str, *,
                            generator: Optional[torch.Generator] = None, device="cpu"):
    """Random checkpoint-layout FP4 weights built expert by expert (DeepSeek-V4-sized layers fit); masters
    are N(0, 1/k). Returns (uint8 packed E2M1 [E, n, k/2], block scales [E, n, k/32] UE8M0 uint8 (mxfp4)
    or [E, n, k/16] float8_e4m3fn (nvfp4), float32 global scales [E] (nvfp4) or None). ``generator`` must
    live on ``device``."""
    if weight_format not in ("mxfp4", "nvfp4"):
        raise ValueError(f"weight_format: expected 'mxfp4' or 'nvfp4', got {weight_format!r}")
    nv = weight_format == "nvfp4"
    w = torch.empty(num_experts, n, k // 2, dtype=torch.uint8, device=device)
    sf = torch.empty(num_experts, n, k // (16 if nv else 32), dtype=torch.float8_e4m3fn if nv else torch.uint8,
                     device=device)
    g = torch.ones(num_experts, dtype=torch.float32, device=device) if nv else None
    for e in range(num_experts):
        master = torch.randn(1, n, k, device=device, generator=generator) / math.sqrt(k)
        if nv:
            q, s, ge = formats.quantize_nvfp4_weights(master)
            w[e], sf[e], g[e] = q[0], s[0], ge[0]
        else:
            w[e], sf[e] = formats.quantize_mxfp4(master[0])
    return w, sf, g


def make_random_layer(num_experts: int, hidden: int, intermediate: int, weight_format: str, *,
                      seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                      device: Union[str, torch.device] = "cpu", scale: float = 1.0) -> dict:
    """Random expert weights: bf16 masters plus their checkpoint-layout quantization.

    Masters are normal with std ``scale / sqrt(fan_in)`` (``fan_in`` = H for w13, I for w2), so with O(1)
    inputs every activation is O(1). Values are drawn on the generator's device (CPU by default, from
    ``seed``; pass one of ``seed`` or ``generator``) and moved to ``device``.

    Returns a dict with:
        ``w13_bf16`` bf16 ``[E, 2I, H]``, ``w2_bf16`` bf16 ``[E, H, I]``;
        ``w13``, ``w13_sf``, ``w13_global_sf``, ``w2``, ``w2_sf``, ``w2_global_sf``: the checkpoint
        tensors of ``weight_format`` as :func:`mega_moe` takes them (None where the format has none):
        fp8 -> float8_e4m3fn ``[E, N, K]`` + float32 ``[E, N/128, K/128]``; mxfp4 -> uint8
        ``[E, N, K/2]`` + uint8 UE8M0 ``[E, N, K/32]``; nvfp4 -> uint8 ``[E, N, K/2]`` + float8_e4m3fn
        ``[E, N, K/16]`` + float32 ``[E]``; bf16 -> the masters themselves.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format: expected one of {WEIGHT_FORMATS}, got {weight_format!r}")
    gen = _generator(seed, generator)
    layer = {}
    for name, shape, fan_in in (("w13", (num_experts, 2 * intermediate, hidden), hidden),
                                ("w2", (num_experts, hidden, intermediate), intermediate)):
        w = torch.randn(shape, generator=gen, device=gen.device) * (scale / math.sqrt(fan_in))
        w = w.to(device=device, dtype=torch.bfloat16)
        layer[f"{name}_bf16"] = w
        q, sf, global_sf = w, None, None
        if weight_format == "fp8":
            q, sf = formats.quantize_fp8_block2d(w.float())
        elif weight_format == "mxfp4":
            q, sf = formats.quantize_mxfp4(w.float())
        elif weight_format == "nvfp4":
            q, sf, global_sf = formats.quantize_nvfp4_weights(w.float())
        layer[name], layer[f"{name}_sf"], layer[f"{name}_global_sf"] = q, sf, global_sf
    return layer


def checkpoint_shards(layer: dict, weight_format: str, expert: int) -> list:
    """One expert's tensors as a checkpoint stores them, for ``MegaMoEExperts.weight_loader``:
    ``(parameter name, shard id, tensor)`` for w1, w3 (halves of ``w13``) and w2 with their scales (and, for
    nvfp4, ``weight_scale_2`` and an ``input_scale`` of 1). ``layer`` is :func:`make_random_layer`'s dict."""
    inter = layer["w2"].shape[-1] * (1 if weight_format == "fp8" else 2)
    rows = inter // 128 if weight_format == "fp8" else inter  # scale rows of one shard
    scale = "weight_scale_inv" if weight_format == "fp8" else "weight_scale"
    e = expert
    out = []
    for shard, sl, srows in (("w1", slice(0, inter), slice(0, rows)), ("w3", slice(inter, 2 * inter),
                                                                       slice(rows, 2 * rows))):
        out.append(("w13_weight", shard, layer["w13"][e, sl]))
        out.append((f"w13_{scale}", shard, layer["w13_sf"][e, srows]))
        if weight_format == "nvfp4":
            out.append(("w13_weight_scale_2", shard, layer["w13_global_sf"][e].reshape(())))
            out.append(("w13_input_scale", shard, torch.tensor(1.0)))
    out.append(("w2_weight", "w2", layer["w2"][e]))
    out.append((f"w2_{scale}", "w2", layer["w2_sf"][e]))
    if weight_format == "nvfp4":
        out.append(("w2_weight_scale_2", "w2", layer["w2_global_sf"][e].reshape(1)))
        out.append(("w2_input_scale", "w2", torch.tensor([1.0])))
    return out


def make_random_routing(num_tokens: int, num_experts: int, top_k: int, *, masked_fraction: float = 0.0,
                        seed: Optional[int] = None, generator: Optional[torch.Generator] = None,
                        device: Union[str, torch.device] = "cpu",
                        dtype: torch.dtype = torch.int32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing.

    Each token gets ``top_k`` distinct experts; each slot is independently masked (id ``-1``) with
    probability ``masked_fraction``. Weights are positive and sum to 1 over a token's K slots (masked
    slots keep their weight, which the layer must ignore).

    Returns:
        ``topk_idx`` ``dtype`` (int32/int64) ``[T, K]`` and ``topk_weights`` float32 ``[T, K]`` on ``device``.
    """
    if top_k > num_experts:
        raise ValueError(f"top_k: expected at most num_experts={num_experts}, got {top_k}")
    gen = _generator(seed, generator)
    ids = torch.rand(num_tokens, num_experts, generator=gen, device=gen.device).argsort(-1)[:, :top_k]
    masked = torch.rand(num_tokens, top_k, generator=gen, device=gen.device) < masked_fraction
    ids = ids.masked_fill(masked, -1)
    weights = torch.rand(num_tokens, top_k, generator=gen, device=gen.device) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(device=device, dtype=dtype), weights.to(device=device, dtype=torch.float32)
