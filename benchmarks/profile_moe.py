"""Per-kernel time breakdown of one fused call (torch.profiler, CUDA activity), for perf work.

    python benchmarks/profile_moe.py --model V4-Flash --tokens 1,8192 [--format mxfp4 --act-format fp8]
        [--timeline [--flush]]

--timeline: the call captured in a CUDA graph and replayed under the profiler; prints each kernel's start and
end (µs from the replay's first kernel's start), medians over 20 replays after 100 warm-up replays. With
programmatic dependent launch a kernel starts before its predecessor ends and waits in griddepcontrol.wait, so
per-kernel durations overlap: the end stamps show the critical path. --flush: an L2 flush (bench_utils.flush_l2, as
before each of the bench's timed calls) before each replay, so that every replay starts cold as the bench's per-replay
figure does (without it the weights the last replay left in the L2 cache shorten the next).

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
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--flush", action="store_true", help="--timeline: an L2 flush before each replay")
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
        if args.timeline:
            print_timeline(step, f"{args.model} {fmt} a{act} T={t}", flush=args.flush)


def print_timeline(step, what: str, warmup: int = 100, replays: int = 20, flush: bool = False) -> None:
    """Start / end of each kernel of a graph replay, µs from its first kernel's start: medians over `replays`
    replays after `warmup` (right after a capture the op runs slow for ~90 replays: perf-notes, tenth session).
    flush: bench_utils.flush_l2 before each replay (its kernels are left out of the timeline: only megamoe's)."""
    import json
    import statistics
    import tempfile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            if flush:
                bu.flush_l2()
                torch.cuda.synchronize()  # the flush ends before the replay starts
            graph.replay()
            torch.cuda.synchronize()  # replays apart: each replay's kernels are consecutive in time
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset")
                      and (not flush or "megamoe" in e.get("name", ""))), key=lambda e: e["ts"])
    per_call = len(kernels) // replays
    calls = [kernels[r * per_call:(r + 1) * per_call] for r in range(replays)]
    print(f"-- timeline of a graph replay{' after an L2 flush' if flush else ''}, {what}: start / end / duration (µs), "
          f"medians of {replays} replays after {warmup}; spread of the end (min-max)")
    for j in range(per_call):
        start = [c[j]["ts"] - c[0]["ts"] for c in calls]
        end = [c[j]["ts"] + c[j]["dur"] - c[0]["ts"] for c in calls]
        dur = [c[j]["dur"] for c in calls]
        print(f"   {statistics.median(start):8.1f} {statistics.median(end):8.1f} {statistics.median(dur):8.1f}"
              f"  ({min(end):6.1f}-{max(end):6.1f})  {calls[-1][j]['name'][:80]}")


if __name__ == "__main__":
    main()
