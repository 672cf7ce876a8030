"""Shared helpers for the megamoe op tests.

Import what you need from a test module (pytest puts ``tests/`` on ``sys.path``)::

    from conftest import COMBOS, devices, make_case, rel_err, requires_cuda

- :func:`make_case` builds one random problem: layer, routing, inputs, kernel-layout weights, a buffer and
  the emulating reference output (DESIGN.md §3).
- :func:`rel_err` is the Frobenius relative error every tolerance is stated in (inf when ``a`` is not
  finite, so NaN/Inf never pass).
- :func:`assert_bitwise_equal` is ``torch.equal`` that reports the first mismatching coordinate.
- :data:`requires_cuda` (decorator) / :data:`CUDA_MARKS` (for ``pytestmark`` or ``pytest.param``) mark a
  test ``gpu`` and skip it without a GPU; :data:`devices` is ``["cpu"]`` plus ``"cuda"`` (marked) when
  one is available, for ``@pytest.mark.parametrize("device", devices)`` (or use the ``device`` fixture).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import random
from typing import Optional

import pytest
import torch

import megamoe
from megamoe import reference

# (weight_format, act_format) pairs the ops run (docs/decisions.md, "Activation recipes").
COMBOS = [("fp8", "fp8"), ("mxfp4", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp8"), ("nvfp4", "fp4")]

# ------------------------------------------------------------------------------------------------
# Devices and markers
# ------------------------------------------------------------------------------------------------
HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = (pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))


def requires_cuda(obj):
    """Decorator: marks a test (or class) ``gpu`` and skips it when CUDA is not available."""
    for mark in CUDA_MARKS:
        obj = mark(obj)
    return obj


# For @pytest.mark.parametrize("device", devices): "cuda" is only listed when present, and marked gpu.
devices = ["cpu"] + ([pytest.param("cuda", marks=CUDA_MARKS)] if HAS_CUDA else [])


@pytest.fixture(params=devices)
def device(request) -> str:
    """Runs a test once per available device."""
    return request.param


# ------------------------------------------------------------------------------------------------
# Error metrics
# ------------------------------------------------------------------------------------------------
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b||_F / ||b||_F`` in float64; ``inf`` if ``a`` holds NaN/Inf.

    When ``b`` is all zeros the result is 0 if ``a`` is too, else ``inf``.
    """
    a64, b64 = a.detach().to(torch.float64).cpu(), b.detach().to(torch.float64).cpu()
    if not torch.isfinite(a64).all():
        return math.inf
    num, den = (a64 - b64).norm().item(), b64.norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of the raw bytes of ``t`` (any dtype, any strides) as a flat uint8 CPU tensor: a snapshot
    that later writes to ``t`` do not change, compared NaN-safely with ``torch.equal``."""
    t = t.detach().cpu().clone(memory_format=torch.contiguous_format).reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Asserts equal shape, dtype and bytes; the message names the first mismatching coordinate."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, b = actual.detach().cpu(), expected.detach().cpu()
    if torch.equal(as_bytes(a), as_bytes(b)):
        return
    elem_a = a.reshape(-1).view(torch.uint8).view(a.numel(), -1) if a.numel() else a
    elem_b = b.reshape(-1).view(torch.uint8).view(b.numel(), -1) if b.numel() else b
    bad = (elem_a != elem_b).any(-1).nonzero()
    flat = bad[0, 0].item()
    coord = tuple(int(c) for c in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
    raise AssertionError(f"{what}: {bad.shape[0]} of {a.numel()} elements differ; first at {coord}: "
                         f"{a.reshape(-1)[flat].item()} != {b.reshape(-1)[flat].item()}")


# ------------------------------------------------------------------------------------------------
# Random problems
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Case:
    """One random MoE problem. ``layer`` is :func:`megamoe.reference.make_random_layer`'s dict
    (checkpoint layout); ``l1``/``l2`` are :func:`megamoe.transform_weights` tuples of 3 tensors;
    ``ref`` is the emulating reference output for (x, topk_idx, topk_weights) without clamp."""
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    layer: dict
    l1: tuple
    l2: tuple
    buffer: megamoe.MegaMoEBuffer
    ref: torch.Tensor
    weight_format: str
    act_format: str

    @property
    def num_experts(self) -> int:
        return self.buffer.num_experts

    def reference(self, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                  x: Optional[torch.Tensor] = None, activation_clamp: Optional[float] = None) -> torch.Tensor:
        """The reference output for this layer with some inputs replaced."""
        return reference_output(self.layer, self.x if x is None else x,
                                self.topk_idx if topk_idx is None else topk_idx,
                                self.topk_weights if topk_weights is None else topk_weights,
                                self.weight_format, self.act_format, activation_clamp=activation_clamp)

    def run(self, **kwargs) -> torch.Tensor:
        """``megamoe.moe`` on this case (keyword arguments pass through)."""
        return megamoe.moe(self.x, self.topk_idx, self.topk_weights, self.l1, self.l2, self.buffer,
                           weight_format=self.weight_format, **kwargs)

    def run_inplace(self, y: torch.Tensor, **kwargs) -> None:
        """The in-place fused op of this weight format on ``y`` (the buffer must hold a pre_dispatch)."""
        if self.weight_format == "fp8":
            megamoe.fp8_mega_moe(y, self.l1, self.l2, self.buffer, **kwargs)
        else:
            megamoe.fp8_fp4_mega_moe(y, self.l1, self.l2, self.buffer, weight_format=self.weight_format,
                                     **kwargs)


def reference_output(layer: dict, x, topk_idx, topk_weights, weight_format: str, act_format: str, *,
                     activation_clamp: Optional[float] = None) -> torch.Tensor:
    """``reference.mega_moe`` with the checkpoint-layout weights of ``layer``."""
    return reference.mega_moe(x, topk_idx, topk_weights, layer["w13"], layer["w2"], weight_format=weight_format,
                              act_format=act_format, w13_sf=layer["w13_sf"], w2_sf=layer["w2_sf"],
                              w13_global_sf=layer["w13_global_sf"], w2_global_sf=layer["w2_global_sf"],
                              activation_clamp=activation_clamp)


# Layers whose w13 has at least this many elements are drawn on the GPU when they are built for it: a V4-Flash layer
# (6.4 G float32 normals, w13 and w2) took ~20 s on the device machine's CPU per make_case, most of a fused-launch
# test's time. At most GPU_DRAW_MAX_ELEMENTS: the float32 draw of w13 stays transient (V4-Flash: 17 GB).
GPU_DRAW_MIN_ELEMENTS = 1 << 28
GPU_DRAW_MAX_ELEMENTS = 6 << 30


@functools.lru_cache(maxsize=32)
def _cached_layer(num_experts, hidden, intermediate, weight_format, seed, device):
    """NOTES: a layer drawn on the GPU has other values than the CPU draw of the same seed; tests that compare a
    CUDA case with a CPU case of the same seed (test_matches_cpu_op) use small shapes, which are drawn on the CPU."""
    w13_elements = num_experts * 2 * intermediate * hidden
    on_gpu = device.startswith("cuda") and GPU_DRAW_MIN_ELEMENTS <= w13_elements <= GPU_DRAW_MAX_ELEMENTS
    gen = torch.Generator(device=device).manual_seed(seed) if on_gpu else None
    return reference.make_random_layer(num_experts, hidden, intermediate, weight_format, seed=None if on_gpu else seed,
                                       generator=gen, device=device)


def capture_graph(step) -> "torch.cuda.CUDAGraph":
    """``step`` run once outside capture (warm-up: lazy initialization, tensor maps), then captured in a CUDA graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def release_gpu_memory() -> None:
    """Drops the memoized layers and returns cached blocks to the driver. The full-size DeepSeek-V4 layers
    need most of an 80 GB GPU (V4-Pro FP8: ~51 GB of weights in both layouts plus float temporaries), so
    tests that build one call this first: a -k selection can otherwise meet them after other files'
    layers and run out of memory."""
    _cached_layer.cache_clear()
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def random_layer(num_experts: int, hidden: int, intermediate: int, weight_format: str, *, seed: int = 0,
                 device="cpu") -> dict:
    """``reference.make_random_layer`` memoized per arguments (a fresh dict; do not mutate its tensors)."""
    return dict(_cached_layer(num_experts, hidden, intermediate, weight_format, seed, str(device)))


def make_case(num_experts: int, hidden: int, intermediate: int, top_k: int, num_tokens: int,
              weight_format: str = "fp8", act_format: str = "fp8", *, masked_fraction: float = 0.25,
              device="cpu", seed: int = 0, idx_dtype: torch.dtype = torch.int32,
              max_tokens: Optional[int] = None, with_ref: bool = True) -> Case:
    """A random problem on ``device``, deterministic in ``seed``.

    Weights come from ``seed`` (and are cached per shape/format/seed), routing from ``seed + 1``, x (bf16
    N(0, 1)) from ``seed + 2``. The buffer holds ``max_tokens`` tokens (default ``max(num_tokens, 1)``) and
    is fresh (all zeros). ``with_ref=False`` skips the reference (``ref`` is None).
    """
    layer = random_layer(num_experts, hidden, intermediate, weight_format, seed=seed, device=device)
    topk_idx, topk_weights = reference.make_random_routing(num_tokens, num_experts, top_k,
                                                           masked_fraction=masked_fraction, seed=seed + 1,
                                                           device=device, dtype=idx_dtype)
    gen = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    l1 = megamoe.transform_weights(layer["w13"], layer["w13_sf"], layer["w13_global_sf"],
                                   weight_format=weight_format, is_l1=True)
    l2 = megamoe.transform_weights(layer["w2"], layer["w2_sf"], layer["w2_global_sf"],
                                   weight_format=weight_format, is_l1=False)
    capacity = max(num_tokens, 1) if max_tokens is None else max_tokens
    buffer = megamoe.get_symm_buffer(None, num_experts, capacity, top_k, hidden, intermediate,
                                     act_format=act_format, device=device)
    ref = (reference_output(layer, x, topk_idx, topk_weights, weight_format, act_format) if with_ref else None)
    return Case(x, topk_idx, topk_weights, layer, l1, l2, buffer, ref, weight_format, act_format)


# ------------------------------------------------------------------------------------------------
# Randomized GPU sweeps (test_gpu_fp8.py, test_gpu_fp4.py)
# ------------------------------------------------------------------------------------------------
# A fresh seed per run (printed in every failure); MEGAMOE_SWEEP_SEED replays one.
SWEEP_SEED = int(os.environ.get("MEGAMOE_SWEEP_SEED", random.SystemRandom().randrange(1 << 30)))
SWEEP_TOL = 1e-2
SMALL_CASE_SLOTS = 64   # fewer (token, slot) rows than this: the per-case bound is SMALL_CASE_TOL
SMALL_CASE_TOL = 5e-2


def skew_first_slot(case: Case, num_experts: int) -> None:
    """Slot 0 of every token goes to one of the first few experts: hot experts with many token blocks (a
    slot may then repeat another slot's expert; each slot still counts on its own). Updates the reference."""
    t = case.topk_idx.shape[0]
    hot = torch.randint(0, max(1, num_experts // 4), (t,), device=case.topk_idx.device, dtype=case.topk_idx.dtype)
    idx = case.topk_idx.clone()
    idx[:, 0] = torch.where(idx[:, 0] >= 0, hot, idx[:, 0])
    case.topk_idx = idx
    case.ref = case.reference(topk_idx=idx)


class SweepPool:
    """Checks each sweep case against its bound and pools the squared errors of all of them: the pooled
    relative error must meet SWEEP_TOL even where single tiny cases only meet SMALL_CASE_TOL."""

    def __init__(self):
        self.diff, self.ref, self.cases = 0.0, 0.0, 0

    def check(self, y: torch.Tensor, case: Case, num_tokens: int, top_k: int, params) -> None:
        if not num_tokens:
            return
        err = rel_err(y, case.ref)
        tol = SMALL_CASE_TOL if num_tokens * top_k < SMALL_CASE_SLOTS else SWEEP_TOL
        assert err <= tol, f"sweep seed {SWEEP_SEED}: {params}: rel err {err}"
        self.diff += (y.double() - case.ref.double()).square().sum().item()
        self.ref += case.ref.double().square().sum().item()
        self.cases += 1

    def check_pooled(self) -> None:
        if self.cases < 100:
            pytest.skip("the random sweep did not run (selected out)")
        pooled = math.sqrt(self.diff / self.ref)
        assert pooled <= SWEEP_TOL, f"sweep seed {SWEEP_SEED}: pooled rel err {pooled} over {self.cases} cases"
