"""MegaMoEExperts on the GPU: peak memory while a checkpoint is streamed expert by expert through
weight_loader and finalized, at a reduced shape (benchmarks/bench_module.py measures V4-Flash), and the
finalized kernel tensors bit-identical to transform_weights of the whole layer on the GPU."""
from __future__ import annotations

import pytest
import torch

import megamoe
from conftest import CUDA_MARKS, assert_bitwise_equal
from megamoe import module as mm

pytestmark = list(CUDA_MARKS)

# 64 experts: one expert's temporaries (its checkpoint shards while loading, its transformed slice while
# finalizing) are ~1/64 of the layer, so the peak shows whether finalize ever holds a second copy.
E, H, I, K = 64, 1024, 512, 4


def random_expert(weight_format: str, gen: torch.Generator) -> dict:
    """One expert's checkpoint tensors (w13 = w1 rows then w3 rows) made on the GPU from random bytes.

    Values are valid for the format (no NaN codes, non-negative scales) but not a quantized layer: the test
    is about memory and layout, and raw bytes need no float32 temporaries that would blur the peak.
    """
    def rand_bytes(*shape, high=256):
        return torch.randint(0, high, shape, dtype=torch.uint8, device="cuda", generator=gen)

    out = {}
    for proj, n, k in (("w13", 2 * I, H), ("w2", H, I)):
        if weight_format == "fp8":
            out[proj] = rand_bytes(n, k, high=0x7F).view(torch.float8_e4m3fn)  # 0x7F is NaN
            out[f"{proj}_sf"] = torch.rand(n // 128, k // 128, device="cuda", generator=gen) + 0.5
        elif weight_format == "mxfp4":
            out[proj] = rand_bytes(n, k // 2)
            out[f"{proj}_sf"] = rand_bytes(n, k // 32, high=8) + 120  # UE8M0 2^-7 .. 2^0
        else:
            out[proj] = rand_bytes(n, k // 2)
            out[f"{proj}_sf"] = rand_bytes(n, k // 16, high=0x7F).view(torch.float8_e4m3fn)
            out[f"{proj}_global_sf"] = torch.rand((), device="cuda", generator=gen) + 0.5
    return out


def load_expert(m: megamoe.MegaMoEExperts, weight_format: str, e: int, t: dict) -> None:
    scale = "weight_scale_inv" if weight_format == "fp8" else "weight_scale"
    sf_rows = t["w13_sf"].shape[0] // 2
    for shard, half in (("w1", 0), ("w3", 1)):
        m.weight_loader(m.w13_weight, t["w13"][half * I:(half + 1) * I], f"experts.{e}.{shard}.weight", shard, e)
        m.weight_loader(getattr(m, f"w13_{scale}"), t["w13_sf"][half * sf_rows:(half + 1) * sf_rows],
                        f"experts.{e}.{shard}.{scale}", shard, e)
        if weight_format == "nvfp4":
            m.weight_loader(m.w13_weight_scale_2, t["w13_global_sf"], f"experts.{e}.{shard}.weight_scale_2", shard, e)
    m.weight_loader(m.w2_weight, t["w2"], f"experts.{e}.w2.weight", "w2", e)
    m.weight_loader(getattr(m, f"w2_{scale}"), t["w2_sf"], f"experts.{e}.w2.{scale}", "w2", e)
    if weight_format == "nvfp4":
        m.weight_loader(m.w2_weight_scale_2, t["w2_global_sf"], f"experts.{e}.w2.weight_scale_2", "w2", e)


@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4", "nvfp4"])
def test_load_finalize_peak_memory_and_layout(weight_format):
    mm.clear_symm_buffer_cache()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = megamoe.MegaMoEExperts(
        megamoe.MegaMoEConfig(max_tokens_per_rank=1, weight_format=weight_format, device="cuda"),
        num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H, intermediate_size=I)
    for e in range(E):
        load_expert(m, weight_format, e, random_expert(weight_format, gen))  # freed after each expert
    m.finalize_weights()
    torch.cuda.synchronize()
    # finalize also allocates the activations' buffer (max_tokens_per_rank = 1: small); it is not weights.
    peak = torch.cuda.max_memory_allocated() - base - m.get_symm_buffer().buffer.numel()
    kernel = (*m.l1_weights, *m.l2_weights)
    final = sum(t.numel() * t.element_size() for t in kernel)
    assert peak <= 1.2 * final, f"{weight_format}: peak {peak} B over final weights {final} B = {peak / final:.3f}"

    # The same bytes, regenerated whole and transformed in one call on the GPU: bit-identical.
    gen.manual_seed(0)
    experts = [random_expert(weight_format, gen) for _ in range(E)]
    for proj, is_l1, got in (("w13", True, m.l1_weights), ("w2", False, m.l2_weights)):
        whole = {k: torch.stack([x[k] for x in experts]) for k in (proj, f"{proj}_sf", f"{proj}_global_sf")
                 if k in experts[0]}
        want = megamoe.transform_weights(whole[proj], whole[f"{proj}_sf"], whole.get(f"{proj}_global_sf"),
                                         weight_format=weight_format, is_l1=is_l1)
        for name, g, w in zip(("weights", "weights_sf", "weights_global_sf"), got, want):
            assert_bitwise_equal(g, w, f"{weight_format} {proj} {name}")
    mm.clear_symm_buffer_cache()
