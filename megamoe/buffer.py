"""The per-rank buffer shared by pre_dispatch and the fused ops (DESIGN.md §5, §7).

Its layout is computed in C++ (``megamoe::get_buffer_layout``); this module allocates it (a plain device
tensor for one rank, ``torch.distributed._symmetric_memory`` when the EP group has several) and exposes
typed views for tests and checked mode.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional

import torch

from .ops import ACT_FORMATS, BUFFER_LAYOUT_FIELDS, ops

ERROR_CODES = {1: "expert id outside [-1, num_experts)", 2: "token count above the buffer's capacity",
               3: "buffer's peer table does not hold this buffer (not allocated by get_symm_buffer)",
               4: "timed out waiting for a peer rank (did every rank of the group call the op?)",
               5: "the FP4 GEMV read an expert id before pre_dispatch's store of it was visible"}


@functools.lru_cache(maxsize=None)
def buffer_layout(num_experts: int, num_ranks: int, max_tokens_per_rank: int, top_k: int, hidden: int,
                  intermediate: int, act_format: str = "fp8") -> dict:
    """Byte offsets and sizes of the buffer regions, by name (see csrc/include/megamoe/layout/buffer.hpp)."""
    values = ops.get_buffer_layout(num_experts, num_ranks, max_tokens_per_rank, top_k, hidden, intermediate,
                                   act_format).tolist()
    return dict(zip(BUFFER_LAYOUT_FIELDS, values))


@dataclasses.dataclass(eq=False)
class MegaMoEBuffer:
    """One rank's buffer plus the configuration it was sized for.

    ``buffer`` is uint8 [total_bytes]. Pass the whole object to ``pre_dispatch`` and the fused ops.
    """
    buffer: torch.Tensor
    num_experts: int
    num_ranks: int
    rank: int
    max_tokens_per_rank: int
    top_k: int
    hidden: int
    intermediate: int
    act_format: str
    group: Any = None
    handle: Any = None

    @property
    def layout(self) -> dict:
        return buffer_layout(self.num_experts, self.num_ranks, self.max_tokens_per_rank, self.top_k,
                             self.hidden, self.intermediate, self.act_format)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def config_args(self) -> tuple:
        """The buffer's configuration in op-argument order (num_experts .. top_k)."""
        return (self.num_experts, self.num_ranks, self.rank, self.max_tokens_per_rank, self.top_k)

    def view(self, region: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A typed view of a region, e.g. ``view("topk_idx", (T, K), torch.int32)``."""
        offset = self.layout[f"{region}_offset"]
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.buffer[offset:offset + nbytes].view(dtype).view(shape)

    def error_word(self) -> torch.Tensor:
        """int32 [4]: (code, offending value, token, slot); code 0 = no error since the last pre_dispatch."""
        return self.view("error", (4,), torch.int32)

    def check_error(self) -> None:
        """Reads the error word (a host sync) and raises ValueError if a kernel skipped bad input."""
        code, value, token, slot = self.error_word().tolist()
        if code == 0:
            return
        self.error_word().zero_()
        what = ERROR_CODES.get(code, f"unknown error code {code}")
        if code == 1:
            raise ValueError(f"topk_idx: {what}: got {value} at token {token}, slot {slot} "
                             f"(num_experts = {self.num_experts}); the slot was skipped")
        if code == 2:
            raise ValueError(f"{what}: got {value} from rank {slot if slot >= 0 else self.rank} "
                             f"(max_tokens_per_rank = {self.max_tokens_per_rank})")
        if code == 5:
            raise RuntimeError(f"{what} (slot {slot}: read {value}); the call's output is not valid, please report it")
        if code in (3, 4):
            raise RuntimeError(f"{what}: rank {value} (this rank: {self.rank} of {self.num_ranks}); "
                               f"the call's output is not valid")
        raise ValueError(f"{what}: got {value}")


def checked_mode(check: Optional[bool]) -> bool:
    """Whether a call reads the error word: the argument, else MEGAMOE_CHECK=1. Never while tracing or
    capturing (that would need a host sync)."""
    enabled = check if check is not None else os.environ.get("MEGAMOE_CHECK", "0") == "1"
    if not enabled or torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return True


def check_same_config(group, config: dict) -> None:
    """Every rank of ``group`` must size its buffer alike: the kernels address a peer's buffer with this rank's layout
    offsets, so a rank with another capacity or shape would read and write the wrong bytes of its peers. Gathers
    ``config`` from every rank (a host collective, once per buffer) and raises ValueError on every rank, naming the
    arguments that differ and each rank's value, before anything is allocated."""
    import torch.distributed as dist
    configs = [None] * dist.get_world_size(group)
    device = config.get("device")
    if device is not None and torch.device(device).type == "cuda":
        with torch.cuda.device(torch.device(device)):  # NCCL's object gather runs on the current device
            dist.all_gather_object(configs, config, group=group)
    else:
        dist.all_gather_object(configs, config, group=group)
    differing = [name for name in config if name != "device" and any(c.get(name) != config[name] for c in configs)]
    if differing:
        values = "; ".join(f"{name}: " + ", ".join(f"group rank {r} {c.get(name)!r}" for r, c in enumerate(configs))
                           for name in differing)
        raise ValueError(f"get_symm_buffer: every rank of the group must pass the same {', '.join(differing)} "
                         f"(got {values})")


def get_symm_buffer(group, num_experts: int, max_tokens_per_rank: int, top_k: int, hidden: int,
                    intermediate: int, act_format: str = "fp8",
                    device: Optional[torch.device | str] = None) -> MegaMoEBuffer:
    """Allocate the buffer for one rank of ``group`` (None or a one-rank group: a plain tensor).

    Args:
        group: ``torch.distributed`` process group of the expert-parallel ranks, or None (one rank).
        num_experts: global number of experts E (split evenly over the ranks).
        max_tokens_per_rank: capacity T_max; every call on this rank must have T <= T_max.
        top_k: experts per token K.
        hidden: H, a multiple of 128. intermediate: I, a multiple of 128.
        act_format: "fp8" (default) or "fp4" (FP4 halves the activation bytes).
        device: defaults to the current CUDA device if CUDA is available, else CPU.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    num_ranks, rank = 1, 0
    if group is not None:
        import torch.distributed as dist
        num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_ranks > 1:  # first: a rank that raised alone would leave the others waiting in a collective
            check_same_config(group, dict(num_experts=num_experts, max_tokens_per_rank=max_tokens_per_rank,
                                          top_k=top_k, hidden=hidden, intermediate=intermediate,
                                          act_format=act_format, device=device))
    if act_format not in ACT_FORMATS:
        raise ValueError(f"act_format: expected one of {ACT_FORMATS}, got {act_format!r}")
    layout = buffer_layout(num_experts, num_ranks, max_tokens_per_rank, top_k, hidden, intermediate, act_format)
    handle = None
    if num_ranks == 1:
        buf = torch.zeros(layout["total_bytes"], dtype=torch.uint8, device=device)
    else:
        if device.type != "cuda":
            raise ValueError(f"device: expert parallelism needs CUDA symmetric memory, got {device}")
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(layout["total_bytes"], dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, group)
        buf.zero_()
        # The peer table: kernels address other ranks' buffers (NVLink loads and stores) through it, and
        # check that the entry of their own rank is this buffer before trusting the others. (One rank:
        # unused, the buffer stays all zeros.)
        offset = layout["peer_ptrs_offset"]
        ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64)
        buf[offset:offset + 8 * num_ranks].view(torch.int64).copy_(ptrs)
        # Every rank's table and zeroed buffer are in place before any rank can call an op.
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
    return MegaMoEBuffer(buf, num_experts, num_ranks, rank, max_tokens_per_rank, top_k, hidden, intermediate,
                         act_format, group=group, handle=handle)
