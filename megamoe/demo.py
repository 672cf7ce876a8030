"""Demo: one DeepSeek-V4-Flash-shaped expert layer (random FP8 weights) through megamoe.MegaMoEExperts.

    python -m megamoe.demo

The layer is built as a serving engine would: the module is constructed, every expert's checkpoint tensors
go through ``weight_loader``, ``finalize_weights`` converts them to the kernel layout, then ``forward``.
On a GPU: 256 experts, top-6, H=4096, I=2048, 128 tokens, the fused sm90 kernels; the reference (float32)
is evaluated on a sample of tokens. Without a GPU: a reduced layer (16 experts, H=512, I=256) on the CPU
ops, every weight format. Prints the error vs the emulating reference and the time per call.
"""
from __future__ import annotations

import statistics
import time

import torch

import megamoe
from megamoe import reference


def _fp8_layer(num_experts, hidden, intermediate, device, gen):
    """Checkpoint-layout FP8 block weights in the dict form of reference.make_random_layer."""
    w13, w13_sf = reference.make_fp8_block_weights(num_experts, 2 * intermediate, hidden, generator=gen, device=device)
    w2, w2_sf = reference.make_fp8_block_weights(num_experts, hidden, intermediate, generator=gen, device=device)
    return dict(w13=w13, w13_sf=w13_sf, w13_global_sf=None, w2=w2, w2_sf=w2_sf, w2_global_sf=None)


def _time_us(fn, sync, iters=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_layer(layer, weight_format, act_format, num_experts, top_k, hidden, intermediate, num_tokens, device,
              sample=None):
    experts = megamoe.MegaMoEExperts(
        megamoe.MegaMoEConfig(max_tokens_per_rank=num_tokens, weight_format=weight_format, act_format=act_format,
                              device=device),
        num_experts=num_experts, num_local_experts=num_experts, experts_start_idx=0, top_k=top_k,
        hidden_size=hidden, intermediate_size=intermediate)
    for e in range(num_experts):
        for name, shard, tensor in reference.checkpoint_shards(layer, weight_format, e):
            param = getattr(experts, name)
            param.weight_loader(param, tensor, f"experts.{e}.{shard}.{name}", shard, e)
    experts.finalize_weights()
    idx, w = reference.make_random_routing(num_tokens, num_experts, top_k, seed=1, device=device)
    x = torch.randn(num_tokens, hidden, device=device).bfloat16()
    y = experts(x, w, idx)
    rows = torch.arange(num_tokens, device=device) if sample is None else torch.randperm(num_tokens, device=device)[:sample]
    ref = reference.mega_moe(x[rows], idx[rows], w[rows], layer["w13"], layer["w2"], weight_format=weight_format,
                             act_format=act_format, w13_sf=layer["w13_sf"], w2_sf=layer["w2_sf"],
                             w13_global_sf=layer["w13_global_sf"], w2_global_sf=layer["w2_global_sf"])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    us = _time_us(lambda: experts(x, w, idx), sync)
    return _rel_err(y[rows], ref), us


def main():
    if torch.cuda.is_available():
        e, k, h, i, t = 256, 6, 4096, 2048, 128
        print(f"GPU {torch.cuda.get_device_name()}: DeepSeek-V4-Flash layer, {e} experts, top-{k}, H={h}, I={i}, "
              f"T={t}, FP8 block weights")
        gen = torch.Generator(device="cuda").manual_seed(0)
        layer = _fp8_layer(e, h, i, "cuda", gen)
        err, us = run_layer(layer, "fp8", "fp8", e, k, h, i, t, "cuda", sample=64)
        print(f"  fp8 / fp8 : rel err vs reference {err:.2e} (64 sampled tokens) | {us:8.1f} us per call (eager)")
        return
    e, k, h, i, t = 16, 6, 512, 256, 64
    print(f"No GPU: reduced layer on the CPU ops, {e} experts, top-{k}, H={h}, I={i}, T={t}")
    for fmt, act in [("fp8", "fp8"), ("mxfp4", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp8"), ("nvfp4", "fp4")]:
        layer = reference.make_random_layer(e, h, i, fmt, seed=0)
        err, us = run_layer(layer, fmt, act, e, k, h, i, t, "cpu")
        print(f"  {fmt:5s} / {act}: rel err vs reference {err:.2e} | {us:8.1f} us per call")


if __name__ == "__main__":
    main()
