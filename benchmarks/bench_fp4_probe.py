"""Quick probe of the FP4 path: rel. error per (format, act format) on small shapes (--check), and CUDA-graph
timings of the fused layer on DeepSeek-V4-Flash shapes for FP8 / MXFP4 / NVFP4 (--bench).

    python3 benchmarks/bench_fp4_probe.py --check --bench --tokens 1,16,128,512
"""
from __future__ import annotations

import argparse
import sys
import os

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import megamoe  # noqa: E402
from megamoe import reference  # noqa: E402

import bench_utils as bu  # noqa: E402

COMBOS = [("mxfp4", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp8"), ("nvfp4", "fp4")]


def check():
    from conftest import make_case, rel_err
    for wf, af in COMBOS:
        errs = []
        for shape, t in (((8, 256, 384, 3), 7), ((5, 128, 128, 2), 33), ((16, 384, 256, 4), 113),
                         ((64, 640, 896, 8), 333)):
            e, h, i, k = shape
            c = make_case(e, h, i, k, t, wf, af, device="cuda", seed=t)
            y = c.run()
            torch.cuda.synchronize()
            errs.append(rel_err(y, c.ref))
        print(f"check {wf:6s} a{af}: " + " ".join(f"{x:.2e}" for x in errs), flush=True)


def fp4_layer(e, h, i, wf, gen):
    return [reference.make_fp4_expert_weights(e, n, k, wf, generator=gen, device="cuda") for n, k in ((2 * i, h), (h, i))]


def time_graph(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(iters):
        flush.zero_()  # evict L2 (50 MB) so weights come from HBM
        s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        t.record()
        t.synchronize()
        times.append(s.elapsed_time(t) * 1000)
    times.sort()
    return times[len(times) // 2]


def bench(tokens, model):
    e, k, h, i = {"V4-Flash": (256, 6, 4096, 2048), "V4-Pro": (384, 6, 7168, 3072)}[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = {}
    w13, s13 = reference.make_fp8_block_weights(e, 2 * i, h, generator=gen, device="cuda")
    w2, s2 = reference.make_fp8_block_weights(e, h, i, generator=gen, device="cuda")
    layers["fp8"] = (megamoe.transform_weights(w13, s13, weight_format="fp8", is_l1=True),
                     megamoe.transform_weights(w2, s2, weight_format="fp8", is_l1=False))
    del w13, w2
    for wf in ("mxfp4", "nvfp4"):
        (a, sa, ga), (b, sb, gb) = fp4_layer(e, h, i, wf, gen)
        layers[wf] = (megamoe.transform_weights(a, sa, ga, weight_format=wf, is_l1=True),
                      megamoe.transform_weights(b, sb, gb, weight_format=wf, is_l1=False))
        del a, b
    torch.cuda.empty_cache()
    for t in tokens:
        idx, w = reference.make_random_routing(t, e, k, seed=t, device="cuda")
        x = torch.randn(t, h, device="cuda").bfloat16()
        touched = idx.unique().numel()
        for wf, af in [("fp8", "fp8")] + COMBOS:
            buf = megamoe.get_symm_buffer(None, e, t, k, h, i, act_format=af)
            y = torch.empty_like(x)
            l1, l2 = layers[wf]

            step = bu.moe_step(x, idx, w, y, l1, l2, buf, wf)
            us = time_graph(step)
            wbytes = sum(x.numel() * x.element_size() for x in (*l1[:2], *l2[:2])) / e * touched
            print(f"bench {model} T={t:5d} {wf:6s} a{af}: {us:8.1f} us  weights {wbytes / 1e6:7.1f} MB  "
                  f"{wbytes / us / 1e3:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--tokens", default="1,16,128,512")
    ap.add_argument("--model", default="V4-Flash")
    a = ap.parse_args()
    if a.check:
        check()
    if a.bench:
        bench([int(t) for t in a.tokens.split(",")], a.model)
