"""Per-kernel time breakdown of one fused call (torch.profiler, CUDA activity), for perf work.

    python benchmarks/profile_moe.py --model V4-Flash --tokens 1,8192 [--format mxfp4 --act-format fp8]

Under ncu (--ncu): no torch.profiler, 2 warm calls then one profiled call per T.
"""
import argparse

import torch

import megamoe
import bench_moe as bm
import bench_utils as bu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="V4-Flash")
    ap.add_argument("--tokens", default="1,8192")
    ap.add_argument("--format", default="fp8", choices=["fp8", "mxfp4", "nvfp4"])
    ap.add_argument("--act-format", default="fp8", choices=["fp8", "fp4"])
    ap.add_argument("--ncu", action="store_true")
    args = ap.parse_args()
    cfg = bm.MODELS[args.model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    fmt, act = args.format, args.act_format
    l1, l2 = bm.make_layer(cfg, gen) if fmt == "fp8" else bm.make_fp4_layer(cfg, fmt, gen)
    e, k, h, i = cfg["num_experts"], cfg["top_k"], cfg["hidden"], cfg["intermediate"]
    for t in map(int, args.tokens.split(",")):
        x = torch.randn(t, h, device="cuda").bfloat16()
        idx, w = bm.make_routing(t, e, k, gen)
        buf = megamoe.get_symm_buffer(None, e, t, k, h, i, act_format=act)
        y = torch.empty_like(x)

        step = bu.moe_step(x, idx, w, y, l1, l2, buf, fmt)
        for _ in range(2 if args.ncu else 3):
            step()
        torch.cuda.synchronize()
        if args.ncu:
            torch.cuda.cudart().cudaProfilerStart()
            step()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(f"== {args.model} {fmt} a{act} T={t} (5 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
