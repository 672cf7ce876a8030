"""``MegaMoEExperts``: the fused expert layer as an ``nn.Module`` (DESIGN.md §8).

The module matches the interface of vLLM's ``DeepseekV4MegaMoEExperts`` (constructor arguments,
``weight_loader``, ``finalize_weights``, ``get_symm_buffer``, the EPLB methods and ``forward``) but takes a
plain :class:`MegaMoEConfig` instead of a vLLM config; ``megamoe.integrations.vllm`` maps one onto the other.

Life cycle::

    cfg = megamoe.MegaMoEConfig(max_tokens_per_rank=8192, group=ep_group, weight_format="mxfp4")
    experts = megamoe.MegaMoEExperts(cfg, num_experts=256, num_local_experts=32, experts_start_idx=32 * rank,
                                     top_k=6, hidden_size=4096, intermediate_size=2048, prefix="layers.3.ffn")
    megamoe.load_experts_from_safetensors(experts, "/path/to/ckpt", prefix="layers.3.ffn")   # or vLLM's loader
    experts.finalize_weights()            # checkpoint layout -> kernel layout, once
    y = experts(hidden_states, topk_weights, topk_ids, activation_clamp=10.0)

Decisions:

- Parameters hold the checkpoint layout of the weight format, one row block per local physical expert slot
  (names below). ``finalize_weights`` transforms them with :func:`megamoe.transform_weights` expert by
  expert, in place for the weights and FP4 scales (peak memory ~ the checkpoint's size), keeps the results as
  non-persistent buffers and sets the parameters to None.
- Redundant experts: physical slot ``p`` (global index ``experts_start_idx + p``) holds logical expert
  ``(experts_start_idx + p) % num_logical_experts`` (vLLM's initial EPLB placement), so one checkpoint expert
  fills every slot that replicates it.
- NVFP4: ModelOpt stores one ``weight_scale_2`` for w1 and one for w3. The fused L1 has one global scale per
  expert, so they must be equal; ``finalize_weights`` raises ValueError naming the expert otherwise (taking
  the max and requantizing would change the weights, which the exactness rule of DESIGN.md §1 forbids).
  ``input_scale`` is accepted and ignored: activations use a dynamic per-token scale (docs/decisions.md).
- EPLB: with state set, ``forward`` maps logical ids to physical slots as vLLM's
  ``eplb_map_to_physical_and_record`` does (replica ``(t * top_k + k) % logical_replica_count[e]`` of
  ``logical_to_physical_map[e]``) and the kernel counts the (token, slot) rows each local expert receives
  into this rank's slice of ``expert_load_view``.
"""
from __future__ import annotations

import dataclasses
import gc
import glob
import os
import re
import sys
import weakref
from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from . import formats
from .api import transform_weights
from .buffer import MegaMoEBuffer, checked_mode, get_symm_buffer as _allocate_symm_buffer
from .ops import ACT_FORMATS, WEIGHT_FORMATS

__all__ = ["MegaMoEConfig", "MegaMoEExperts", "load_experts_from_safetensors", "get_layer",
           "clear_symm_buffer_cache"]

_SHARDS = ("w1", "w2", "w3")


@dataclasses.dataclass
class MegaMoEConfig:
    """What the module needs from its surroundings (DESIGN.md §8).

    Attributes:
        max_tokens_per_rank: most tokens one forward call may carry on this rank (sizes the buffer).
        group: the expert-parallel ``torch.distributed`` process group, or None for one rank.
        weight_format: "fp8" (block FP8), "mxfp4" or "nvfp4": the checkpoint's expert format.
        act_format: "fp8" (default) or "fp4" (FP4 weights only): the activations into the GEMMs.
        device: where the parameters are allocated; None follows torch's default device (what
            ``with torch.device(...)`` or vLLM's model-init context sets).
    """
    max_tokens_per_rank: int
    group: Any = None
    weight_format: str = "fp8"
    act_format: str = "fp8"
    device: Optional[Union[str, torch.device]] = None

    def __post_init__(self):
        if not isinstance(self.max_tokens_per_rank, int) or self.max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank: expected a positive int, got {self.max_tokens_per_rank!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format: expected one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.act_format not in ACT_FORMATS:
            raise ValueError(f"act_format: expected one of {ACT_FORMATS}, got {self.act_format!r}")
        if self.weight_format == "fp8" and self.act_format != "fp8":
            raise ValueError(f"act_format: weight_format 'fp8' takes act_format 'fp8', got {self.act_format!r}")
        if self.device is not None:
            self.device = torch.device(self.device)


# ------------------------------------------------------------------------------------------------
# Registry of named layers (for custom ops that look a layer up by name, e.g. integrations.vllm)
# ------------------------------------------------------------------------------------------------
_LAYERS: "weakref.WeakValueDictionary[str, MegaMoEExperts]" = weakref.WeakValueDictionary()


def _register_layer(name: str, layer: "MegaMoEExperts") -> None:
    if name in _LAYERS:
        gc.collect()  # a dropped layer may still sit in a reference cycle (params -> bound weight_loader)
    if name in _LAYERS:
        raise ValueError(f"prefix: a MegaMoEExperts layer named {name!r} already exists (duplicate layer name)")
    _LAYERS[name] = layer


def get_layer(name: str) -> "MegaMoEExperts":
    """The live MegaMoEExperts constructed with ``prefix=name``; KeyError if there is none."""
    layer = _LAYERS.get(name)
    if layer is None:
        raise KeyError(f"layer_name: no MegaMoEExperts layer is registered as {name!r} "
                       f"(registered: {sorted(_LAYERS.keys())[:8]})")
    return layer


# ------------------------------------------------------------------------------------------------
# Shared buffers: one per (group, device, shapes, act_format), shared by every layer of a model
# ------------------------------------------------------------------------------------------------
_SYMM_BUFFERS: dict = {}


def clear_symm_buffer_cache() -> None:
    """Drops the cached buffers (the layers that hold none keep working: they allocate on next use)."""
    _SYMM_BUFFERS.clear()


def _as_uint8_bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _reusable_or_new(checkpoint: Optional[torch.Tensor], kernel_slice: torch.Tensor, num: int) -> torch.Tensor:
    """Where finalize writes the kernel layout of ``num`` experts whose first slice is ``kernel_slice``: the
    checkpoint tensor itself when it has the same dtype and per-expert shape (no second copy of the bytes
    is ever held), else a new tensor."""
    if (checkpoint is not None and checkpoint.is_contiguous() and checkpoint.dtype == kernel_slice.dtype
            and checkpoint.shape[1:] == kernel_slice.shape[1:] and checkpoint.shape[0] == num):
        return checkpoint
    return torch.empty((num, *kernel_slice.shape[1:]), dtype=kernel_slice.dtype, device=kernel_slice.device)


class MegaMoEExperts(nn.Module):
    """Routed experts of one MoE layer on this rank, through megamoe's fused ops.

    Args:
        config: :class:`MegaMoEConfig`.
        num_experts: physical experts over all EP ranks (logical experts plus redundant replicas).
        num_local_experts: physical experts on this rank (E_loc).
        experts_start_idx: global physical index of this rank's first expert (``rank * E_loc`` when the
            layer runs; any value is accepted for loading).
        top_k: experts per token. hidden_size: H. intermediate_size: I (both multiples of 128).
        prefix: layer name; a non-empty prefix registers the layer for :func:`get_layer` (a second live
            layer with the same prefix raises ValueError).
        num_logical_experts: experts in the checkpoint (default ``num_experts``).

    Parameters (checkpoint layout, ``requires_grad=False``, each with a ``weight_loader`` attribute):

    ========  ===================================================================================
    fp8       ``w13_weight`` float8_e4m3fn [E_loc, 2I, H], ``w13_weight_scale_inv`` float32
              [E_loc, 2I/128, H/128], ``w2_weight`` [E_loc, H, I], ``w2_weight_scale_inv``
              [E_loc, H/128, I/128]
    mxfp4     ``w13_weight`` uint8 [E_loc, 2I, H/2], ``w13_weight_scale`` uint8 UE8M0 [E_loc, 2I, H/32],
              ``w2_weight`` [E_loc, H, I/2], ``w2_weight_scale`` [E_loc, H, I/32]
    nvfp4     ``w13_weight`` uint8 [E_loc, 2I, H/2], ``w13_weight_scale`` float8_e4m3fn
              [E_loc, 2I, H/16], ``w13_weight_scale_2`` float32 [E_loc, 2] (w1, w3),
              ``w13_input_scale`` float32 [E_loc, 2] (unused), ``w2_weight`` [E_loc, H, I/2],
              ``w2_weight_scale`` [E_loc, H, I/16], ``w2_weight_scale_2`` [E_loc], ``w2_input_scale``
              [E_loc] (unused)
    ========  ===================================================================================

    After :meth:`finalize_weights` the kernel layout lives in non-persistent buffers ``w13_kernel``,
    ``w13_kernel_sf``, ``w13_kernel_global_sf``, ``w2_kernel``, ``w2_kernel_sf``, ``w2_kernel_global_sf``
    (docs/decisions.md, "Kernel weight layout") and the parameters are None.
    """

    _KERNEL_BUFFERS = ("w13_kernel", "w13_kernel_sf", "w13_kernel_global_sf", "w2_kernel", "w2_kernel_sf",
                       "w2_kernel_global_sf")

    def __init__(self, config: MegaMoEConfig, *, num_experts: int, num_local_experts: int,
                 experts_start_idx: int, top_k: int, hidden_size: int, intermediate_size: int,
                 prefix: str = "", num_logical_experts: Optional[int] = None):
        super().__init__()
        if not isinstance(config, MegaMoEConfig):
            raise TypeError(f"config: expected megamoe.MegaMoEConfig, got {type(config).__name__} "
                            f"(for a vLLM config use megamoe.integrations.vllm.make_megamoe_experts_from_vllm)")
        num_logical_experts = num_experts if num_logical_experts is None else num_logical_experts
        for name, value in (("num_experts", num_experts), ("num_local_experts", num_local_experts),
                            ("top_k", top_k), ("hidden_size", hidden_size),
                            ("intermediate_size", intermediate_size), ("num_logical_experts", num_logical_experts)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if value % 128:
                raise ValueError(f"{name}: expected a multiple of 128, got {value}")
        if not isinstance(experts_start_idx, int) or experts_start_idx < 0 or \
                experts_start_idx + num_local_experts > num_experts:
            raise ValueError(f"experts_start_idx: expected 0 <= experts_start_idx and experts_start_idx + "
                             f"num_local_experts ({num_local_experts}) <= num_experts ({num_experts}), "
                             f"got {experts_start_idx!r}")
        if num_logical_experts > num_experts:
            raise ValueError(f"num_logical_experts: expected at most num_experts = {num_experts}, "
                             f"got {num_logical_experts}")
        if top_k > num_experts:
            raise ValueError(f"top_k: expected at most num_experts = {num_experts}, got {top_k}")

        self.config = config
        self.weight_format = config.weight_format
        self.act_format = config.act_format
        self.prefix = prefix
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.experts_start_idx = experts_start_idx
        self.experts_end_idx = experts_start_idx + num_local_experts
        self.num_logical_experts = num_logical_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.max_num_tokens = config.max_tokens_per_rank

        # EPLB state (set_eplb_state); None while EPLB is off.
        self.moe_layer_idx: Optional[int] = None
        self.expert_load_view: Optional[torch.Tensor] = None
        self.logical_to_physical_map: Optional[torch.Tensor] = None
        self.logical_replica_count: Optional[torch.Tensor] = None

        self._ckpt_params = self._checkpoint_param_specs()
        for name, (shape, dtype, _) in self._ckpt_params.items():
            param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=config.device), requires_grad=False)
            param.weight_loader = self.weight_loader
            if name.endswith(("weight_scale", "weight_scale_inv")):
                param.quant_method = "block"
            self.register_parameter(name, param)
        for name in self._KERNEL_BUFFERS:
            self.register_buffer(name, None, persistent=False)
        self._loaded_shards: set = set()
        self._finalized = False
        self._symm_buffer: Optional[MegaMoEBuffer] = None
        self._op_args: Optional[tuple] = None  # (pre_dispatch, fused op, their fixed arguments) once used
        self._checked = False
        if prefix:
            _register_layer(prefix, self)

    # --------------------------------------------------------------------------------------------
    # checkpoint-layout parameters
    # --------------------------------------------------------------------------------------------
    def _checkpoint_param_specs(self) -> dict:
        """name -> (shape, dtype, rows-of-one-shard or None). Rows: w1/w3 take the first/second half of
        dim 1 (``shard rows``); scalar-per-shard tensors ([E_loc, 2]) take column 0/1."""
        e, h, i, f = self.num_local_experts, self.hidden_size, self.intermediate_size, self.weight_format
        if f == "fp8":
            return {
                "w13_weight": ((e, 2 * i, h), torch.float8_e4m3fn, i),
                "w13_weight_scale_inv": ((e, 2 * i // 128, h // 128), torch.float32, i // 128),
                "w2_weight": ((e, h, i), torch.float8_e4m3fn, None),
                "w2_weight_scale_inv": ((e, h // 128, i // 128), torch.float32, None),
            }
        if f == "mxfp4":
            return {
                "w13_weight": ((e, 2 * i, h // 2), torch.uint8, i),
                "w13_weight_scale": ((e, 2 * i, h // 32), torch.uint8, i),
                "w2_weight": ((e, h, i // 2), torch.uint8, None),
                "w2_weight_scale": ((e, h, i // 32), torch.uint8, None),
            }
        return {
            "w13_weight": ((e, 2 * i, h // 2), torch.uint8, i),
            "w13_weight_scale": ((e, 2 * i, h // 16), torch.float8_e4m3fn, i),
            "w13_weight_scale_2": ((e, 2), torch.float32, 1),
            "w13_input_scale": ((e, 2), torch.float32, 1),
            "w2_weight": ((e, h, i // 2), torch.uint8, None),
            "w2_weight_scale": ((e, h, i // 16), torch.float8_e4m3fn, None),
            "w2_weight_scale_2": ((e,), torch.float32, None),
            "w2_input_scale": ((e,), torch.float32, None),
        }

    # Parameters whose every (slot, shard) must be loaded before the layer is complete.
    def _required_params(self) -> list:
        return [n for n in self._ckpt_params if not n.endswith("input_scale")]

    def _local_slots(self, expert_id: int) -> list:
        """Local physical slots that hold logical expert ``expert_id`` (every replica on this rank)."""
        return [p - self.experts_start_idx for p in range(self.experts_start_idx, self.experts_end_idx)
                if p % self.num_logical_experts == expert_id]

    def _param_name(self, param: torch.Tensor, weight_name: str) -> str:
        for name in self._ckpt_params:
            if self._parameters.get(name) is param:
                return name
        if self._finalized:
            raise RuntimeError(f"{weight_name}: MegaMoEExperts {self.prefix!r} is finalized; its checkpoint-layout "
                               f"parameters are gone, so weights can no longer be loaded")
        raise ValueError(f"{weight_name}: param is not a checkpoint-layout parameter of this MegaMoEExperts "
                         f"(expected one of {list(self._ckpt_params)})")

    def _coerce(self, loaded: torch.Tensor, dtype: torch.dtype, name: str, weight_name: str) -> torch.Tensor:
        """Same-bits reinterpretations (int8 / float8_e8m0fnu / float4_e2m1fn_x2 into uint8) and exact
        conversions (UE8M0 bytes, bf16, fp16 into a float32 scale); anything else is a TypeError."""
        if loaded.dtype == dtype:
            return loaded
        if dtype == torch.uint8 and loaded.dtype in (torch.int8, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2):
            return loaded.view(torch.uint8)
        if dtype == torch.float32:
            if loaded.dtype in (torch.uint8, torch.float8_e8m0fnu):
                return formats.ue8m0_to_float(loaded)  # exactly 2^(b-127)
            if loaded.dtype in (torch.bfloat16, torch.float16):
                return loaded.to(torch.float32)
        raise TypeError(f"{weight_name}: expected dtype {dtype} for {name} (weight_format "
                        f"{self.weight_format!r}), got {loaded.dtype}")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, shard_id: str,
                      expert_id: int, return_success: bool = False) -> Optional[bool]:
        """Copies one checkpoint tensor of one expert into ``param`` (vLLM's MoE weight-loader contract).

        Args:
            param: one of this module's checkpoint-layout parameters.
            loaded_weight: the checkpoint tensor of expert ``expert_id``, shard ``shard_id``: e.g. w1's
                ``[I, H]`` weight (fp8) or ``[I, H/32]`` UE8M0 scale (mxfp4), or a scalar ``weight_scale_2``.
            weight_name: a name for messages (vLLM passes the mapped parameter name).
            shard_id: "w1" (rows [0, I) of w13, scales [0, I/128) for fp8), "w3" (rows [I, 2I)) or "w2".
            expert_id: logical (checkpoint) expert id; every local slot replicating it is filled.
            return_success: return True/False (loaded / expert not on this rank or shard not of
                this parameter) instead of None.
        Raises:
            ValueError naming ``weight_name`` on a shape mismatch or unknown ``shard_id``; TypeError on a
            dtype that cannot be stored exactly.
        """
        name = self._param_name(param, weight_name)
        shape, dtype, shard_rows = self._ckpt_params[name]
        if shard_id not in _SHARDS:
            raise ValueError(f"{weight_name}: shard_id: expected one of {_SHARDS}, got {shard_id!r}")
        is_w13 = name.startswith("w13_")
        if is_w13 != (shard_id in ("w1", "w3")):
            return False if return_success else None  # shard of the other projection (as vLLM)
        slots = self._local_slots(int(expert_id))
        if not slots:
            return False if return_success else None
        loaded = self._coerce(loaded_weight, dtype, name, weight_name)
        for slot in slots:
            dst = param.data[slot]
            if is_w13:
                dst = dst.narrow(0, 0 if shard_id == "w1" else shard_rows, shard_rows)
            src = loaded
            if tuple(src.shape) != tuple(dst.shape):
                if dst.numel() == 1 and src.numel() == 1:
                    src = src.reshape(dst.shape)  # per-expert scalars: [], [1] and [1, 1] are one value
                else:
                    raise ValueError(f"{weight_name}: expected shape {tuple(dst.shape)} for shard {shard_id} of "
                                     f"expert {expert_id} in {name} {tuple(shape)}, got {tuple(loaded_weight.shape)}")
            dst.copy_(src)
            self._loaded_shards.add((name, slot, shard_id))
        return True if return_success else None

    weight_loader.supports_moe_loading = True  # type: ignore[attr-defined]

    def missing_weights(self) -> list:
        """Checkpoint tensors not loaded yet, as ``"experts.{e}.{w1|w2|w3}.{param}"`` (``e`` logical),
        one entry per missing (local slot, shard); empty after finalize."""
        if self._finalized:
            return []
        missing = []
        for name in self._required_params():
            shards = ("w1", "w3") if name.startswith("w13_") else ("w2",)
            suffix = name.split("_", 1)[1]
            for slot in range(self.num_local_experts):
                logical = (self.experts_start_idx + slot) % self.num_logical_experts
                missing += [f"experts.{logical}.{s}.{suffix}" for s in shards
                            if (name, slot, s) not in self._loaded_shards]
        return missing

    # --------------------------------------------------------------------------------------------
    # finalize
    # --------------------------------------------------------------------------------------------
    @property
    def finalized(self) -> bool:
        return self._finalized

    def _nvfp4_l1_global_scale(self) -> torch.Tensor:
        s2 = self.w13_weight_scale_2.data
        differs = s2[:, 0] != s2[:, 1]
        if bool(differs.any()):
            slot = int(differs.nonzero()[0, 0])
            phys = self.experts_start_idx + slot
            raise ValueError(
                f"w13_weight_scale_2: expert {phys % self.num_logical_experts} (physical {phys}, local slot {slot}) "
                f"has w1 weight_scale_2 = {s2[slot, 0].item()!r} and w3 weight_scale_2 = {s2[slot, 1].item()!r}; "
                f"the fused w13 needs one global scale per expert, so they must be equal (requantizing to a "
                f"common scale would change the weights; export the checkpoint with a shared gate/up scale)")
        return s2[:, 0].contiguous()

    def finalize_weights(self) -> None:
        """Checkpoint layout -> kernel layout (once; later calls return at once).

        Expert by expert and in place: each expert's slice is transformed into a temporary and copied back
        into the checkpoint parameter's own storage wherever the kernel layout has the checkpoint's dtype and
        shape per expert (weights of every format, FP4 block scales, NVFP4 global scales: a permutation of
        the same bytes); that storage then becomes the kernel buffer. Only the FP8 block scales (float32
        [E, N/128, K/128] -> [E, N/64, K/128], under 0.1 % of the bytes), fp8's all-ones global scales and
        mxfp4's row exponents (uint8 [E, N]) are allocated anew, so peak memory stays at the checkpoint's size
        plus one expert.
        Results are bit-identical to :func:`megamoe.transform_weights` of the whole layer (the transform is
        per expert). Afterwards the parameters are None and the kernel tensors are the non-persistent
        buffers ``w13_kernel*`` / ``w2_kernel*``. Also allocates the shared buffer
        (:meth:`get_symm_buffer`; collective with several EP ranks), so call it on every rank at load time,
        and before ``torch.compile`` traces :meth:`forward`.
        """
        if self._finalized:
            return
        f = self.weight_format
        global_l1 = self._nvfp4_l1_global_scale() if f == "nvfp4" else None  # checked before anything changes
        scale = "weight_scale_inv" if f == "fp8" else "weight_scale"
        num = self.num_local_experts
        for proj, is_l1 in (("w13", True), ("w2", False)):
            w = getattr(self, f"{proj}_weight").data
            sf = getattr(self, f"{proj}_{scale}").data
            g = None
            if f == "nvfp4":
                g = global_l1 if is_l1 else self.w2_weight_scale_2.data.contiguous()
            kernel = None  # (weights, scales, global scales) in kernel layout, filled expert by expert
            for e in range(num):
                got = transform_weights(w[e:e + 1], sf[e:e + 1], None if g is None else g[e:e + 1],
                                        weight_format=f, is_l1=is_l1)
                if kernel is None:
                    kernel = tuple(_reusable_or_new(src, t, num) for src, t in zip((w, sf, g), got))
                for dst, t in zip(kernel, got):
                    dst[e:e + 1].copy_(t)  # slice e of an in-place destination was read above, never again
                del got
            for name in [n for n in self._ckpt_params if n.startswith(f"{proj}_")]:
                setattr(self, name, None)  # drops the parameters; reused storage lives on as kernel buffers
            for suffix, t in zip(("", "_sf", "_global_sf"), kernel):
                setattr(self, f"{proj}_kernel{suffix}", t)
            del w, sf, g, kernel
        self._loaded_shards.clear()
        self._finalized = True
        # Allocate the buffer now, at load, not in the first forward: with several EP ranks the allocation
        # is collective (every rank must reach it, and a rank may skip a layer's forward), and a forward
        # traced by torch.compile should find it in place. One rank with a slice it cannot run (loading
        # only, e.g. experts_start_idx != 0) defers to get_symm_buffer, which then names the problem.
        num_ranks, rank = self._ep_ranks()
        if num_ranks > 1 or self._runnable_slice(num_ranks, rank):
            self.get_symm_buffer()

    @property
    def l1_weights(self) -> tuple:
        return (self.w13_kernel, self.w13_kernel_sf, self.w13_kernel_global_sf)

    @property
    def l2_weights(self) -> tuple:
        return (self.w2_kernel, self.w2_kernel_sf, self.w2_kernel_global_sf)

    def _weights_device(self) -> torch.device:
        t = self.w13_kernel if self._finalized else self.w13_weight
        return t.device

    # --------------------------------------------------------------------------------------------
    # buffer
    # --------------------------------------------------------------------------------------------
    def _ep_ranks(self) -> tuple:
        group = self.config.group
        if group is None:
            return 1, 0
        import torch.distributed as dist
        return dist.get_world_size(group), dist.get_rank(group)

    def _runnable_slice(self, num_ranks: int, rank: int) -> bool:
        return (self.num_experts == num_ranks * self.num_local_experts
                and self.experts_start_idx == rank * self.num_local_experts)

    def get_symm_buffer(self) -> MegaMoEBuffer:
        """The per-rank buffer, shared by every layer with the same (group, device, num_experts,
        max_tokens_per_rank, top_k, H, I, act_format). Checks that the experts are split evenly over the
        EP ranks with this rank's slice at ``experts_start_idx`` (what the kernels assume)."""
        if self._symm_buffer is not None:
            return self._symm_buffer
        num_ranks, rank = self._ep_ranks()
        if not self._runnable_slice(num_ranks, rank):
            raise ValueError(
                f"experts_start_idx: the kernels need num_experts = EP ranks x num_local_experts and "
                f"experts_start_idx = rank x num_local_experts; got num_experts = {self.num_experts}, "
                f"num_local_experts = {self.num_local_experts}, experts_start_idx = {self.experts_start_idx} "
                f"with {num_ranks} rank(s) (rank {rank})")
        device = self._weights_device()
        group = self.config.group
        key = (None if group is None else id(group), str(device), self.num_experts, self.max_num_tokens,
               self.top_k, self.hidden_size, self.intermediate_size, self.act_format)
        buf = _SYMM_BUFFERS.get(key)
        if buf is None:
            buf = _allocate_symm_buffer(group, self.num_experts, self.max_num_tokens, self.top_k, self.hidden_size,
                                        self.intermediate_size, act_format=self.act_format, device=device)
            _SYMM_BUFFERS[key] = buf  # the buffer holds `group`, so id(group) stays valid
        self._symm_buffer = buf
        return buf

    # --------------------------------------------------------------------------------------------
    # EPLB
    # --------------------------------------------------------------------------------------------
    def set_eplb_state(self, moe_layer_idx: int, expert_load_view: torch.Tensor,
                       logical_to_physical_map: torch.Tensor, logical_replica_count: torch.Tensor) -> None:
        """Stores vLLM's EPLB tensors for this layer.

        Args:
            expert_load_view: int32 ``[num_experts]`` (load per physical expert; this rank adds to its slice
                ``[experts_start_idx, +E_loc)``) or int32 ``[num_local_experts]``.
            logical_to_physical_map: int ``[num_logical_experts, max_replicas]`` (-1 padded).
            logical_replica_count: int ``[num_logical_experts]``.
        """
        if expert_load_view.dtype != torch.int32 or expert_load_view.dim() != 1 or \
                expert_load_view.shape[0] not in (self.num_experts, self.num_local_experts):
            raise ValueError(f"expert_load_view: expected int32 [{self.num_experts}] or [{self.num_local_experts}], "
                             f"got {expert_load_view.dtype} {tuple(expert_load_view.shape)}")
        if logical_to_physical_map.dim() != 2 or logical_to_physical_map.shape[0] != self.num_logical_experts:
            raise ValueError(f"logical_to_physical_map: expected [{self.num_logical_experts}, max_replicas], "
                             f"got {tuple(logical_to_physical_map.shape)}")
        if tuple(logical_replica_count.shape) != (self.num_logical_experts,):
            raise ValueError(f"logical_replica_count: expected [{self.num_logical_experts}], "
                             f"got {tuple(logical_replica_count.shape)}")
        self.moe_layer_idx = moe_layer_idx
        self.expert_load_view = expert_load_view
        self.logical_to_physical_map = logical_to_physical_map
        self.logical_replica_count = logical_replica_count

    def get_expert_weights(self) -> list:
        """The kernel-layout tensors EPLB moves between slots, each a uint8 ``(E_loc, -1)`` view that
        aliases what the kernels read (finalizes first): w13, w13_sf, w2, w2_sf, plus the third kernel
        tensors for nvfp4 (per-expert global scales) and mxfp4 (per-row exponents); for fp8 they are all ones
        and not listed."""
        self.finalize_weights()
        names = ["w13_kernel", "w13_kernel_sf", "w2_kernel", "w2_kernel_sf"]
        if self.weight_format != "fp8":
            names += ["w13_kernel_global_sf", "w2_kernel_global_sf"]
        views = []
        for name in names:
            t = getattr(self, name)
            assert t.is_contiguous() and t.shape[0] == self.num_local_experts, name
            views.append(_as_uint8_bytes(t).view(self.num_local_experts, -1))
        return views

    def update_expert_map(self) -> None:
        """No expert map to update: the local slice is fixed by experts_start_idx."""

    def _map_to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical -> physical ids, replica ``(t * K + k) % replica_count`` (vLLM's choice); -1 stays -1 and
        an id outside [0, num_logical_experts) is moved outside [0, num_experts) so the kernels skip and
        record it. No host sync."""
        l2p, counts = self.logical_to_physical_map, self.logical_replica_count
        device = topk_ids.device
        ids = topk_ids.to(torch.int64)
        valid = (ids >= 0) & (ids < self.num_logical_experts)
        safe = torch.where(valid, ids, 0)
        pos = torch.arange(ids.numel(), device=device).view(ids.shape)
        replica = pos % counts.to(device=device, dtype=torch.int64)[safe].clamp_min(1)
        phys = l2p.to(device=device, dtype=torch.int64)[safe, replica]
        shifted = torch.where(ids < 0, ids, ids + (self.num_experts - self.num_logical_experts))
        return torch.where(valid, phys, shifted).to(topk_ids.dtype)

    def _recv_stats(self) -> Optional[torch.Tensor]:
        view = self.expert_load_view
        if view is None:
            return None
        if view.shape[0] == self.num_local_experts and self.num_local_experts != self.num_experts:
            return view
        return view[self.experts_start_idx:self.experts_end_idx]

    # --------------------------------------------------------------------------------------------
    # forward
    # --------------------------------------------------------------------------------------------
    def _check_num_tokens(self, hidden_states: torch.Tensor) -> None:
        if hidden_states.dim() >= 1 and hidden_states.shape[0] > self.max_num_tokens:
            raise ValueError(f"hidden_states: got {hidden_states.shape[0]} tokens, more than max_tokens_per_rank = "
                             f"{self.max_num_tokens} (MegaMoEConfig; the buffer is sized for it)")

    def forward_into(self, out: torch.Tensor, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, activation_clamp: Optional[float] = None,
                     fast_math: bool = True) -> None:
        """:meth:`forward` writing into ``out`` (bf16 contiguous ``[T, H]``)."""
        self._check_num_tokens(hidden_states)
        self._run(out, hidden_states, topk_weights, topk_ids, activation_clamp, fast_math)

    def _run(self, out, hidden_states, topk_weights, topk_ids, activation_clamp, fast_math) -> None:
        if self._op_args is None:
            self.finalize_weights()  # covers dummy weight loading (vLLM calls it again from forward)
            self._prepare_op_args()
        if self.logical_to_physical_map is not None:
            topk_ids = self._map_to_physical(topk_ids)
        recv_stats = self._recv_stats()
        # NOTES: the ops are called directly (their resolved overloads: no per-call overload lookup) with
        # arguments fixed at the first call (the checks of the Python wrappers in megamoe.api are static for
        # a finalized layer): a decode step pays only the two op dispatches (benchmarks/bench_module.py
        # measures the difference to the raw ops).
        pre_dispatch, fused, buffer_args, fixed = self._op_args
        pre_dispatch(hidden_states, topk_ids, topk_weights, *buffer_args)
        fused(out, *fixed, activation_clamp, fast_math, recv_stats)
        if self._checked and checked_mode(True):  # never while tracing or capturing
            self._symm_buffer.check_error()

    def _prepare_op_args(self) -> None:
        buf = self.get_symm_buffer()
        buffer_args = (buf.buffer, *buf.config_args, buf.intermediate, self.weight_format, buf.act_format)
        ops = torch.ops.megamoe
        if self.weight_format == "fp8":
            fused = ops.fp8_mega_moe.default
            fixed = (*self.l1_weights[:2], *self.l2_weights[:2], buf.buffer, *buf.config_args)
        else:
            fused = ops.fp8_fp4_mega_moe.default
            fixed = (*self.l1_weights, *self.l2_weights, buf.buffer, *buf.config_args, self.weight_format,
                     buf.act_format)
        self._op_args = (ops.pre_dispatch.default, fused, buffer_args, fixed)
        # Checked mode (reads the error word: a host sync) as megamoe.api's wrappers do, decided once.
        self._checked = os.environ.get("MEGAMOE_CHECK", "0") == "1"

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                activation_clamp: Optional[float] = None, fast_math: bool = True) -> torch.Tensor:
        """Routed-expert output of this rank's tokens.

        Args:
            hidden_states: bf16 ``[T, H]``, ``T <= max_tokens_per_rank`` (else ValueError).
            topk_weights: float32 ``[T, top_k]``.
            topk_ids: int32/int64 ``[T, top_k]``: physical expert ids, or logical ids when EPLB state is set;
                -1 marks an unused slot.
            activation_clamp: SwiGLU clamp (DESIGN.md §3) or None. fast_math: passed to the kernels.
        Returns:
            bf16 ``[T, H]``. Finalizes the weights first if that has not happened.
        """
        self._check_num_tokens(hidden_states)
        out = torch.empty_like(hidden_states, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
        self._run(out, hidden_states, topk_weights, topk_ids, activation_clamp, fast_math)
        return out

    def extra_repr(self) -> str:
        return (f"weight_format={self.weight_format!r}, act_format={self.act_format!r}, "
                f"num_experts={self.num_experts}, num_local_experts={self.num_local_experts}, "
                f"experts_start_idx={self.experts_start_idx}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, max_tokens_per_rank={self.max_num_tokens}, "
                f"finalized={self._finalized}")


# ------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------
# Checkpoint suffix after "{prefix}.experts.{e}.{w1|w2|w3}." -> parameter suffix after "w13_" / "w2_".
_SUFFIXES = {
    "fp8": {"weight": "weight", "scale": "weight_scale_inv", "weight_scale_inv": "weight_scale_inv"},
    "mxfp4": {"weight": "weight", "scale": "weight_scale", "weight_scale": "weight_scale"},
    "nvfp4": {"weight": "weight", "weight_scale": "weight_scale", "weight_scale_2": "weight_scale_2",
              "input_scale": "input_scale"},
}


def _safetensors_files(paths) -> list:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.safetensors")))
            if not found:
                raise FileNotFoundError(f"paths: no *.safetensors file in {p}")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"paths: {p} does not exist")
    return files


def load_experts_from_safetensors(module: MegaMoEExperts, paths: Union[str, os.PathLike, Iterable], *,
                                  prefix: str, progress: bool = True, strict: bool = True) -> set:
    """Streams one layer's expert tensors from ``.safetensors`` files into ``module.weight_loader``.

    Tensors are read one at a time (never a whole file), so the host memory needed is one tensor.

    Names followed (``e`` = logical expert id, ``wN`` in w1 (gate), w3 (up), w2 (down)): every key
    ``"{prefix}.experts.{e}.{wN}.{suffix}"``, which is vLLM's DeepSeek-V4 expert mapping
    (``make_deepseek_v4_expert_params_mapping``: ``experts.{e}.{wN}.`` -> ``experts.w13_`` / ``experts.w2_``):

    - fp8 (DeepSeek-V4 release / DeepSeek-V3 style): ``weight`` (float8_e4m3fn), ``scale`` or
      ``weight_scale_inv`` (float32, or float8_e8m0fnu / uint8 UE8M0 bytes, decoded exactly).
    - mxfp4 (DeepSeek-V4 release): ``weight`` (packed E2M1 as uint8 / int8 / float4_e2m1fn_x2), ``scale`` or
      ``weight_scale`` (UE8M0 as float8_e8m0fnu or uint8).
    - nvfp4 (NVIDIA ModelOpt): ``weight``, ``weight_scale`` (float8_e4m3fn), ``weight_scale_2`` (float32
      scalar), ``input_scale`` (float32 scalar, ignored by the kernels).

    Other keys under the prefix (e.g. ``{prefix}.gate.weight``, shared experts) are left alone.

    Args:
        module: the layer to fill (not finalized).
        paths: a ``.safetensors`` file, a directory (all its ``*.safetensors``), or a list of either.
        prefix: the layer's checkpoint prefix, e.g. ``"layers.3.ffn"`` (DeepSeek release) or
            ``"model.layers.3.mlp"`` (ModelOpt exports).
        progress: print a counter to stderr.
        strict: raise ValueError if a local expert slot is still missing a tensor afterwards.
    Returns:
        the set of checkpoint keys that were loaded into this rank (experts of other ranks are skipped).
    """
    try:
        from safetensors import safe_open
    except ImportError as exc:  # not a dependency of the package
        raise ImportError("load_experts_from_safetensors needs the 'safetensors' package: "
                          "pip install safetensors") from exc
    if not isinstance(module, MegaMoEExperts):
        raise TypeError(f"module: expected MegaMoEExperts, got {type(module).__name__}")
    if module.finalized:
        raise RuntimeError("module: already finalized; load weights before finalize_weights()")
    suffixes = _SUFFIXES[module.weight_format]
    pattern = re.compile(re.escape(prefix) + r"\.experts\.(\d+)\.(w[123])\.(.+)$")
    files = _safetensors_files(paths)

    plan = []  # (file, key, expert, shard, param name)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                m = pattern.match(key)
                if m is None or m.group(3) not in suffixes:
                    continue
                expert, shard = int(m.group(1)), m.group(2)
                param = ("w13_" if shard in ("w1", "w3") else "w2_") + suffixes[m.group(3)]
                plan.append((path, key, expert, shard, param))
    if not plan:
        raise ValueError(f"prefix: no '{prefix}.experts.<e>.<w1|w2|w3>.<{'|'.join(suffixes)}>' tensor in {files}")

    loaded = set()
    total, done = len(plan), 0
    step = max(64, total // 100)  # a counter, not a line per tensor
    for path in files:
        items = [p for p in plan if p[0] == path]
        if not items:
            continue
        with safe_open(path, framework="pt", device="cpu") as f:
            for _, key, expert, shard, param_name in items:
                tensor = f.get_tensor(key)
                ok = module.weight_loader(getattr(module, param_name), tensor, key, shard_id=shard,
                                          expert_id=expert, return_success=True)
                del tensor
                if ok:
                    loaded.add(key)
                done += 1
                if progress and (done % step == 0 or done == total):
                    sys.stderr.write(f"\rmegamoe: {prefix}: {done}/{total} expert tensors "
                                     f"({len(loaded)} on this rank)")
                    sys.stderr.flush()
    if progress:
        sys.stderr.write("\n")
    if strict:
        missing = module.missing_weights()
        if missing:
            raise ValueError(f"{prefix}: {len(missing)} expert tensors of this rank are not in {files}; first: "
                             f"{[f'{prefix}.{m}' for m in missing[:6]]}")
    return loaded
