"""vLLM adapter: build :class:`megamoe.MegaMoEExperts` from a vLLM config, and run it through one opaque
custom op so vLLM's ``torch.compile`` graphs treat the layer as a single call (DESIGN.md §8).

vLLM is not imported at module import (this file imports without vLLM installed); only
:func:`make_megamoe_experts_from_vllm` imports ``vllm.distributed`` lazily, and only when it needs the
expert-parallel group of a multi-rank run.

Custom op (registered at import)::

    megamoe_vllm::experts_forward(Tensor hidden_states, Tensor topk_weights, Tensor topk_ids, Tensor(a!) out,
                                  str layer_name, float? activation_clamp, bool fast_math) -> ()

Its body looks the layer up by ``layer_name`` (the layer's ``prefix``; see :func:`megamoe.module.get_layer`)
and writes the layer's output into ``out``; its fake only checks shapes. This is the shape of vLLM's own
``deepseek_v4_mega_moe_experts`` op.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..module import MegaMoEConfig, MegaMoEExperts, get_layer

__all__ = ["VllmMegaMoEExperts", "experts_forward", "make_megamoe_experts_from_vllm", "megamoe_config_from_vllm",
           "weight_format_from_vllm"]

_UNSET = object()
OP_NAME = "megamoe_vllm::experts_forward"
OP_SCHEMA = ("(Tensor hidden_states, Tensor topk_weights, Tensor topk_ids, Tensor(a!) out, str layer_name, "
             "float? activation_clamp, bool fast_math) -> ()")


# ------------------------------------------------------------------------------------------------
# Config mapping
# ------------------------------------------------------------------------------------------------
def _get(obj: Any, key: str, default=None):
    """``obj[key]`` for dicts, ``obj.key`` otherwise."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def weight_format_from_vllm(vllm_config: Any) -> str:
    """The expert weight format a vLLM config implies, from these hints in this order:

    1. ``vllm_config.quant_config.moe_quant_algo == "NVFP4"`` (vLLM's DeepSeek-V4 quant config) -> "nvfp4";
    2. ``hf_config.quantization_config`` with ``moe_quant_algo`` or ``quant_algo`` "NVFP4" (ModelOpt) ->
       "nvfp4", "MXFP4" -> "mxfp4";
    3. ``hf_config.expert_dtype``: "fp4" -> "mxfp4" (the DeepSeek-V4 release), "fp8" -> "fp8",
       "nvfp4"/"mxfp4" as named;
    4. ``hf_config.model_type == "deepseek_v4"`` without ``expert_dtype`` -> "mxfp4" (vLLM's default);
    5. ``quantization_config.quant_method == "fp8"`` -> "fp8".

    Raises ValueError naming ``weight_format`` when none applies (pass ``weight_format=`` then).
    """
    hf_config = _get(_get(vllm_config, "model_config"), "hf_config")
    if str(_get(_get(vllm_config, "quant_config"), "moe_quant_algo", "")).upper() == "NVFP4":
        return "nvfp4"
    qcfg = _get(hf_config, "quantization_config")
    for key in ("moe_quant_algo", "quant_algo"):
        algo = str(_get(qcfg, key, "") or "").upper()
        if algo in ("NVFP4", "MXFP4"):
            return algo.lower()
    expert_dtype = _get(hf_config, "expert_dtype")
    if expert_dtype is not None:
        mapping = {"fp4": "mxfp4", "mxfp4": "mxfp4", "nvfp4": "nvfp4", "fp8": "fp8"}
        if str(expert_dtype).lower() not in mapping:
            raise ValueError(f"weight_format: hf_config.expert_dtype {expert_dtype!r} is not one of "
                             f"{sorted(mapping)}; pass weight_format=")
        return mapping[str(expert_dtype).lower()]
    if _get(hf_config, "model_type") == "deepseek_v4":
        return "mxfp4"
    if str(_get(qcfg, "quant_method", "") or "").lower() == "fp8":
        return "fp8"
    raise ValueError("weight_format: the vLLM config names no expert format megamoe knows (quant_config."
                     "moe_quant_algo, hf_config.quantization_config, hf_config.expert_dtype); pass weight_format=")


def _ep_group_from_vllm(vllm_config: Any):
    """None for one EP rank, else vLLM's EP device group (``vllm.distributed.get_ep_group()``)."""
    pc = _get(vllm_config, "parallel_config")
    world = int(_get(pc, "tensor_parallel_size", 1) or 1) * int(_get(pc, "data_parallel_size", 1) or 1)
    if world == 1:
        return None
    if not _get(pc, "enable_expert_parallel", False):
        raise NotImplementedError(
            f"parallel_config: megamoe runs routed experts with expert parallelism only (whole experts per "
            f"rank); got tensor_parallel_size x data_parallel_size = {world} without enable_expert_parallel. "
            f"Enable it (--enable-expert-parallel)")
    try:
        from vllm.distributed import get_ep_group
    except ImportError as exc:
        raise ImportError(f"parallel_config: {world} expert-parallel ranks need vLLM's EP group "
                          f"(vllm.distributed.get_ep_group), which did not import; pass group= instead") from exc
    return get_ep_group().device_group


def megamoe_config_from_vllm(vllm_config: Any, *, weight_format: Optional[str] = None,
                             act_format: Optional[str] = None, group: Any = _UNSET,
                             max_tokens_per_rank: Optional[int] = None) -> MegaMoEConfig:
    """:class:`MegaMoEConfig` from a vLLM config; each keyword overrides what would be read.

    Read: ``scheduler_config.max_num_batched_tokens`` (max tokens), ``parallel_config``
    (``tensor_parallel_size``, ``data_parallel_size``, ``enable_expert_parallel``: the EP group),
    ``model_config.hf_config`` / ``quant_config`` (weight format, :func:`weight_format_from_vllm`),
    ``device_config.device`` (if present). ``act_format`` defaults to "fp8".
    """
    if max_tokens_per_rank is None:
        max_tokens_per_rank = _get(_get(vllm_config, "scheduler_config"), "max_num_batched_tokens")
        if max_tokens_per_rank is None:
            raise ValueError("max_tokens_per_rank: vllm_config.scheduler_config.max_num_batched_tokens is missing; "
                             "pass max_tokens_per_rank=")
    return MegaMoEConfig(
        max_tokens_per_rank=int(max_tokens_per_rank),
        group=_ep_group_from_vllm(vllm_config) if group is _UNSET else group,
        weight_format=weight_format if weight_format is not None else weight_format_from_vllm(vllm_config),
        act_format=act_format if act_format is not None else "fp8",
        device=_get(_get(vllm_config, "device_config"), "device"),
    )


# ------------------------------------------------------------------------------------------------
# The module vLLM models use
# ------------------------------------------------------------------------------------------------
class VllmMegaMoEExperts(MegaMoEExperts):
    """:class:`MegaMoEExperts` whose ``forward`` goes through ``torch.ops.megamoe_vllm.experts_forward``
    (opaque to ``torch.compile``, like vLLM's ``deepseek_v4_mega_moe_experts``). Needs a non-empty prefix."""

    def __init__(self, config: MegaMoEConfig, **kwargs):
        if not kwargs.get("prefix"):
            raise ValueError("prefix: VllmMegaMoEExperts needs a non-empty, unique layer name (the custom op "
                             "finds the layer by it)")
        super().__init__(config, **kwargs)

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                activation_clamp: Optional[float] = None, fast_math: bool = True) -> torch.Tensor:
        return experts_forward(self, hidden_states, topk_weights, topk_ids, activation_clamp=activation_clamp,
                               fast_math=fast_math)


def make_megamoe_experts_from_vllm(vllm_config: Any, *, weight_format: Optional[str] = None,
                                   act_format: Optional[str] = None, group: Any = _UNSET,
                                   max_tokens_per_rank: Optional[int] = None, **ctor_kwargs) -> VllmMegaMoEExperts:
    """A :class:`VllmMegaMoEExperts` for a vLLM config (what ``DeepseekV4MegaMoEExperts(vllm_config, ...)``
    would be). ``ctor_kwargs`` are :class:`megamoe.MegaMoEExperts`'s keyword arguments (num_experts,
    num_local_experts, experts_start_idx, top_k, hidden_size, intermediate_size, prefix,
    num_logical_experts); the other keywords override :func:`megamoe_config_from_vllm`'s reading."""
    config = megamoe_config_from_vllm(vllm_config, weight_format=weight_format, act_format=act_format, group=group,
                                      max_tokens_per_rank=max_tokens_per_rank)
    return VllmMegaMoEExperts(config, **ctor_kwargs)


def experts_forward(layer: MegaMoEExperts, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, *, activation_clamp: Optional[float] = None,
                    fast_math: bool = True) -> torch.Tensor:
    """``layer``'s output through the custom op: checks the token count (ValueError naming hidden_states),
    allocates ``out`` bf16 [T, H] and calls ``torch.ops.megamoe_vllm.experts_forward``."""
    if not layer.prefix:
        raise ValueError("layer: the custom op finds layers by prefix; this one has an empty prefix")
    layer._check_num_tokens(hidden_states)
    out = torch.empty(hidden_states.shape, dtype=torch.bfloat16, device=hidden_states.device)
    torch.ops.megamoe_vllm.experts_forward(hidden_states, topk_weights, topk_ids, out, layer.prefix,
                                           activation_clamp, fast_math)
    return out


# ------------------------------------------------------------------------------------------------
# Custom op
# ------------------------------------------------------------------------------------------------
def _experts_forward_impl(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          out: torch.Tensor, layer_name: str, activation_clamp: Optional[float],
                          fast_math: bool) -> None:
    get_layer(layer_name).forward_into(out, hidden_states, topk_weights, topk_ids,
                                       activation_clamp=activation_clamp, fast_math=fast_math)


def _experts_forward_fake(hidden_states, topk_weights, topk_ids, out, layer_name, activation_clamp, fast_math):
    torch._check(hidden_states.dim() == 2, lambda: "hidden_states: expected [num_tokens, hidden]")
    torch._check(out.shape == hidden_states.shape and out.dtype == torch.bfloat16,
                 lambda: "out: expected bf16 with hidden_states' shape")
    torch._check(topk_ids.shape == topk_weights.shape, lambda: "topk_ids/topk_weights: shapes differ")
    return None


def _op_registered() -> bool:
    try:
        torch.ops.megamoe_vllm.experts_forward.default
        return True
    except (AttributeError, RuntimeError):
        return False


if not _op_registered():
    _experts_forward_op = torch.library.custom_op(OP_NAME, _experts_forward_impl, mutates_args=("out",),
                                                  schema=OP_SCHEMA)
    _experts_forward_op.register_fake(_experts_forward_fake)
