"""MegaMoEExperts: forward overhead over the raw ops, and peak GPU memory while loading + finalizing.

    python benchmarks/bench_module.py [--json out.json] [--small]

1. Overhead (V4-Flash, FP8, T=1): eager time of ``MegaMoEExperts.forward`` vs the raw op sequence it wraps
   (``pre_dispatch`` + ``fp8_mega_moe`` on a preallocated y and the same buffer), medians of CUDA-event
   timings after warm-up, in the same run; plus the module's CUDA-graph replay time. No L2 flush: the
   question is the host-side cost per call.
2. Load + finalize peak (V4-Flash shape, 256 experts, each format): the module is created on the GPU,
   every expert's checkpoint tensors are made on the GPU one expert at a time and streamed through
   ``weight_loader`` (then freed), ``finalize_weights`` runs; ``torch.cuda.max_memory_allocated`` over that
   whole span (reset before; the module's own shared buffer excluded) over the bytes of the final kernel
   tensors. Target: <= 1.2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess

import torch

import megamoe
from megamoe import formats
from megamoe import module as mm

import bench_utils as bu

FLASH = dict(num_experts=256, top_k=6, hidden=4096, intermediate=2048)
SMALL = dict(num_experts=16, top_k=4, hidden=512, intermediate=256)


def make_module(cfg, weight_format, max_tokens, prefix):
    return megamoe.MegaMoEExperts(
        megamoe.MegaMoEConfig(max_tokens_per_rank=max_tokens, weight_format=weight_format, device="cuda"),
        num_experts=cfg["num_experts"], num_local_experts=cfg["num_experts"], experts_start_idx=0,
        top_k=cfg["top_k"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], prefix=prefix)


def expert_checkpoint(weight_format, n, k, gen):
    """One expert's checkpoint tensors [n, k] (weight, scale, global scale or None), made on the GPU."""
    master = torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)
    if weight_format == "fp8":
        w, s = formats.quantize_fp8_block2d(master)
        return w, s, None
    if weight_format == "mxfp4":
        w, s = formats.quantize_mxfp4(master)
        return w, s, None
    w, s, g = formats.quantize_nvfp4_weights(master[None])
    return w[0], s[0], g[0]


def load_expert(m, weight_format, e, gen, cfg):
    h, i = cfg["hidden"], cfg["intermediate"]
    scale = "weight_scale_inv" if weight_format == "fp8" else "weight_scale"
    w13, s13, g13 = expert_checkpoint(weight_format, 2 * i, h, gen)
    srows = s13.shape[0] // 2
    for shard, half in (("w1", 0), ("w3", 1)):
        m.weight_loader(m.w13_weight, w13[half * i:(half + 1) * i], f"experts.{e}.{shard}.weight", shard, e)
        m.weight_loader(getattr(m, f"w13_{scale}"), s13[half * srows:(half + 1) * srows], "s", shard, e)
        if g13 is not None:
            m.weight_loader(m.w13_weight_scale_2, g13, "g", shard, e)
    w2, s2, g2 = expert_checkpoint(weight_format, h, i, gen)
    m.weight_loader(m.w2_weight, w2, f"experts.{e}.w2.weight", "w2", e)
    m.weight_loader(getattr(m, f"w2_{scale}"), s2, "s", "w2", e)
    if g2 is not None:
        m.weight_loader(m.w2_weight_scale_2, g2.reshape(1), "g", "w2", e)


def kernel_bytes(m):
    return sum(t.numel() * t.element_size() for t in (*m.l1_weights, *m.l2_weights))


def load_finalize_peak(cfg, weight_format):
    mm.clear_symm_buffer_cache()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = make_module(cfg, weight_format, max_tokens=1, prefix="")
    for e in range(cfg["num_experts"]):
        load_expert(m, weight_format, e, gen, cfg)
    # The shared buffer is the activations' workspace, not weights: allocate it before the span ends and
    # subtract it (a max_tokens of 1 keeps it small anyway).
    m.finalize_weights()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    buffer_bytes = m.get_symm_buffer().buffer.numel()
    final = kernel_bytes(m)
    del m
    mm.clear_symm_buffer_cache()
    torch.cuda.empty_cache()
    return peak - buffer_bytes, final


def overhead(cfg, iters):
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = make_module(cfg, "fp8", max_tokens=1, prefix="bench_module.overhead")
    for e in range(cfg["num_experts"]):
        load_expert(m, "fp8", e, gen, cfg)
    m.finalize_weights()
    h, k = cfg["hidden"], cfg["top_k"]
    x = torch.randn(1, h, device="cuda").bfloat16()
    idx = torch.randperm(cfg["num_experts"], device="cuda")[:k].view(1, k)
    w = torch.softmax(torch.rand(1, k, device="cuda"), 1)
    buf = m.get_symm_buffer()
    y = torch.empty_like(x)

    ops = torch.ops.megamoe

    def raw():
        ops.pre_dispatch(x, idx, w, buf.buffer, *buf.config_args, buf.intermediate, "fp8", buf.act_format)
        ops.fp8_mega_moe(y, *m.l1_weights[:2], *m.l2_weights[:2], buf.buffer, *buf.config_args, None, True, None)

    def mod():
        m(x, w, idx)

    # Interleaved rounds so clock and host drift hit both alike.
    raw_t, mod_t = [], []
    for _ in range(5):
        raw_t.append(bu.time_events(raw, iters=iters, flush=False))
        mod_t.append(bu.time_events(mod, iters=iters, flush=False))
    graph_us = bu.time_graph(mod, iters=iters, flush=False)
    raw()
    assert torch.equal(m(x, w, idx), y), "module output differs from the raw ops"
    return statistics.median(raw_t), statistics.median(mod_t), graph_us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--small", action="store_true", help="a reduced shape (smoke run)")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    cfg = SMALL if args.small else FLASH
    model = "small" if args.small else "V4-Flash"
    rows = []
    raw_us, mod_us, graph_us = overhead(cfg, args.iters)
    print(f"{model} fp8 T=1: raw ops {raw_us:.1f} us, module forward {mod_us:.1f} us (eager), "
          f"overhead {mod_us - raw_us:+.1f} us; module graph replay {graph_us:.1f} us")
    rows.append(dict(op="MegaMoEExperts.forward", format="fp8", act_format="fp8", model=model, ranks=1,
                     tokens_per_rank=1, us=round(mod_us, 2), peer="pre_dispatch + fp8_mega_moe (raw ops)",
                     peer_us=round(raw_us, 2), overhead_us=round(mod_us - raw_us, 2), graph_us=round(graph_us, 2)))
    for fmt in ("fp8", "mxfp4", "nvfp4"):
        peak, final = load_finalize_peak(cfg, fmt)
        print(f"{model} {fmt:5s} load + finalize: peak {peak / 2**20:9.1f} MiB, final weights "
              f"{final / 2**20:9.1f} MiB, ratio {peak / final:.3f}")
        rows.append(dict(op="MegaMoEExperts.load+finalize", format=fmt, act_format="fp8", model=model, ranks=1,
                         peak_bytes=peak, final_weight_bytes=final, peak_over_final=round(peak / final, 4)))
    if args.json:
        commit = os.environ.get("MEGAMOE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                           torch=torch.__version__, commit=commit, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
