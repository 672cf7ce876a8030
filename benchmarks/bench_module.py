"""MegaMoEExperts: forward overhead over the raw ops, and peak GPU memory while loading + finalizing.

    python benchmarks/bench_module.py [--json out.json] [--small] [--cpu] [--iters N]

1. Overhead (V4-Flash, FP8, T=1): eager time of ``MegaMoEExperts.forward`` vs the raw op sequence it wraps
   (``pre_dispatch`` + ``fp8_mega_moe`` on a preallocated y and the same buffer), medians of CUDA-event
   timings after warm-up, interleaved rounds in the same run; then both captured in a CUDA graph and
   replayed. No L2 flush: the question is the host-side cost per call. The rows carry the DESIGN.md §10
   floor (touched experts' bytes / copy bandwidth vs FLOPs / dense FP8 matmul rate, both measured here).
2. Load + finalize peak (V4-Flash shape, 256 experts, each format): the module is created on the GPU,
   every expert's checkpoint tensors are made on the GPU one expert at a time and streamed through
   ``weight_loader`` (then freed), ``finalize_weights`` runs; ``torch.cuda.max_memory_allocated`` over that
   whole span (reset before; the module's activation buffer excluded) over the bytes of the final kernel
   tensors. Target: <= 1.2.

``--small``: a reduced shape (64 experts, H=1024, I=512, top-4). ``--cpu``: the CPU ops (implies nothing
about speed on a GPU; a smoke run of this script): the overhead is host wall-clock medians, and the
CUDA-only measurements (graph replay, peak memory, ceilings) are skipped.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import time

import torch

import megamoe
from megamoe import formats
from megamoe import module as mm

import bench_utils as bu

FLASH = dict(num_experts=256, top_k=6, hidden=4096, intermediate=2048)
SMALL = dict(num_experts=64, top_k=4, hidden=1024, intermediate=512)
ROW_CHUNK = 256  # rows of float32 masters alive at a time while a synthetic expert is made


def make_module(cfg, weight_format, max_tokens, prefix, device):
    return megamoe.MegaMoEExperts(
        megamoe.MegaMoEConfig(max_tokens_per_rank=max_tokens, weight_format=weight_format, device=device),
        num_experts=cfg["num_experts"], num_local_experts=cfg["num_experts"], experts_start_idx=0,
        top_k=cfg["top_k"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"], prefix=prefix)


def shard_checkpoint(weight_format, n, k, gen, device):
    """One shard's checkpoint tensors [n, k] (weight, scale, global scale or None) of normal(0, 1/sqrt(k))
    weights, quantized ROW_CHUNK rows at a time so that only the checkpoint tensors themselves (what a
    loader holds) are large. NVFP4's per-expert global scale is fixed in advance (what a calibrated export
    has), 6 sigma over the largest E2M1 x E4M3 product, so it needs no pass over the whole expert."""
    w = torch.empty((n, k if weight_format == "fp8" else k // 2),
                    dtype=torch.float8_e4m3fn if weight_format == "fp8" else torch.uint8, device=device)
    if weight_format == "fp8":
        sf = torch.empty((n // 128, k // 128), dtype=torch.float32, device=device)
    elif weight_format == "mxfp4":
        sf = torch.empty((n, k // 32), dtype=torch.uint8, device=device)
    else:
        sf = torch.empty((n, k // 16), dtype=torch.float8_e4m3fn, device=device)
    g = torch.tensor(6.0 / math.sqrt(k) / (6 * 448), dtype=torch.float32, device=device) \
        if weight_format == "nvfp4" else None
    for r in range(0, n, ROW_CHUNK):
        master = torch.randn(min(ROW_CHUNK, n - r), k, device=device, generator=gen) / math.sqrt(k)
        if weight_format == "fp8":
            q, s = formats.quantize_fp8_block2d(master)
            sf[r // 128:(r + master.shape[0]) // 128] = s
        elif weight_format == "mxfp4":
            q, s = formats.quantize_mxfp4(master)
            sf[r:r + master.shape[0]] = s
        else:
            q, s, _ = formats.quantize_nvfp4(master, g)
            sf[r:r + master.shape[0]] = s
        w[r:r + master.shape[0]] = q
    return w, sf, g


def load_expert(m, weight_format, e, gen, cfg, device):
    """Streams logical expert ``e`` (w1, w3, w2 with scales) through weight_loader; the shards are freed
    on return."""
    h, i = cfg["hidden"], cfg["intermediate"]
    scale = "weight_scale_inv" if weight_format == "fp8" else "weight_scale"
    for shard, n, k in (("w1", i, h), ("w3", i, h), ("w2", h, i)):
        w, s, g = shard_checkpoint(weight_format, n, k, gen, device)
        proj = "w2" if shard == "w2" else "w13"
        m.weight_loader(getattr(m, f"{proj}_weight"), w, f"experts.{e}.{shard}.weight", shard, e)
        m.weight_loader(getattr(m, f"{proj}_{scale}"), s, f"experts.{e}.{shard}.{scale}", shard, e)
        if g is not None:
            m.weight_loader(getattr(m, f"{proj}_weight_scale_2"), g, f"experts.{e}.{shard}.weight_scale_2", shard, e)


def kernel_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def load_finalize_peak(cfg, weight_format):
    """(peak bytes over the load + finalize span, bytes of the final kernel tensors), on CUDA."""
    mm.clear_symm_buffer_cache()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = make_module(cfg, weight_format, max_tokens=1, prefix="", device="cuda")
    for e in range(cfg["num_experts"]):
        load_expert(m, weight_format, e, gen, cfg, "cuda")
    m.finalize_weights()
    torch.cuda.synchronize()
    # finalize also allocates the activations' buffer (max_tokens_per_rank = 1 keeps it small): not weights.
    peak = torch.cuda.max_memory_allocated() - base - m.get_symm_buffer().buffer.numel()
    final = kernel_bytes((*m.l1_weights, *m.l2_weights))
    del m
    mm.clear_symm_buffer_cache()
    torch.cuda.empty_cache()
    return peak, final


def time_host(fn, iters, warmup=3):
    """Median wall-clock microseconds of ``fn`` (CPU ops: the call is the whole work)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def overhead(cfg, iters, device):
    """Medians (raw ops, module forward) eager, and (raw ops, module forward) CUDA-graph replays (None on
    CPU), plus the touched experts' kernel bytes and the FLOPs of the call, for the floor."""
    gen = torch.Generator(device=device).manual_seed(0)
    m = make_module(cfg, "fp8", max_tokens=1, prefix="bench_module.overhead", device=device)
    for e in range(cfg["num_experts"]):
        load_expert(m, "fp8", e, gen, cfg, device)
    m.finalize_weights()
    e, h, i, k = cfg["num_experts"], cfg["hidden"], cfg["intermediate"], cfg["top_k"]
    x = torch.randn(1, h, device=device, generator=gen).bfloat16()
    idx = torch.randperm(e, device=device, generator=gen)[:k].view(1, k)
    w = torch.softmax(torch.rand(1, k, device=device, generator=gen), 1)
    buf = m.get_symm_buffer()
    y = torch.empty_like(x)
    l1, l2 = m.l1_weights, m.l2_weights
    pre_dispatch, fused = torch.ops.megamoe.pre_dispatch.default, torch.ops.megamoe.fp8_mega_moe.default

    def raw():
        pre_dispatch(x, idx, w, buf.buffer, *buf.config_args, buf.intermediate, "fp8", buf.act_format)
        fused(y, l1[0], l1[1], l2[0], l2[1], buf.buffer, *buf.config_args, None, True, None)

    def mod():
        m(x, w, idx)

    raw()
    if not torch.equal(m(x, w, idx), y):
        raise AssertionError("module output differs from the raw ops")
    if device == "cuda":
        timer = lambda fn: bu.time_events(fn, iters=iters, flush=False)  # noqa: E731
    else:
        timer = lambda fn: time_host(fn, iters)  # noqa: E731
    # Interleaved rounds so that clock and host drift hit both alike.
    raw_t, mod_t = [], []
    for _ in range(5):
        raw_t.append(timer(raw))
        mod_t.append(timer(mod))
    raw_graph = mod_graph = None
    if device == "cuda":
        raw_graph = bu.time_graph(raw, iters=iters, flush=False)
        mod_graph = bu.time_graph(mod, iters=iters, flush=False)
    touched = kernel_bytes(t[0] for t in (*l1[:2], *l2[:2])) * k  # what fp8_mega_moe reads; T=1: k experts
    flops = 2 * k * (2 * i * h + h * i)
    del m
    mm.clear_symm_buffer_cache()
    return statistics.median(raw_t), statistics.median(mod_t), raw_graph, mod_graph, touched, flops


def forward_row(op, model, us, peer, peer_us, nbytes, flops, ceilings):
    floor_us = None
    if ceilings:
        floor_us = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["fp8_flops_per_s"]) * 1e6
    return dict(op=op, format="fp8", act_format="fp8", model=model, ranks=1, tokens_per_rank=1, us=round(us, 2),
                floor_us=None if floor_us is None else round(floor_us, 2),
                time_over_floor=None if floor_us is None else round(us / floor_us, 3), peer=peer,
                peer_us=round(peer_us, 2), speedup=round(peer_us / us, 3), tflops=round(flops / us * 1e-6, 3),
                gbps=round(nbytes / us * 1e-3, 1), overhead_us=round(us - peer_us, 2))


def git_commit():
    commit = os.environ.get("MEGAMOE_COMMIT")  # the device copy of the tree carries no .git
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
        except OSError:
            commit = None
    return commit


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results (DESIGN.md §10 format) to this path")
    ap.add_argument("--small", action="store_true", help="a reduced shape (smoke run)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU ops; skips the CUDA-only measurements")
    ap.add_argument("--iters", type=int, default=50, help="timed calls per median")
    args = ap.parse_args()
    if args.iters < 1:
        ap.error(f"--iters: expected a positive count, got {args.iters}")
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA GPU: pass --cpu (with --small) for a smoke run on the CPU ops")
    cfg = SMALL if args.small else FLASH
    model = "small" if args.small else "V4-Flash"

    ceilings = {}
    if device == "cuda":
        ceilings = {"copy_bytes_per_s": bu.measure_copy_bandwidth(), "fp8_flops_per_s": bu.measure_fp8_matmul_flops()}
        print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
              f"FP8 matmul {ceilings['fp8_flops_per_s'] / 1e12:.0f} TFLOP/s")

    rows = []
    raw_us, mod_us, raw_graph_us, mod_graph_us, nbytes, flops = overhead(cfg, args.iters, device)
    # On the CPU the ops take milliseconds, so the difference there is mostly noise: only the GPU run
    # answers the overhead question (target <= 5 us).
    clock = "CUDA events, target <= 5 us" if device == "cuda" else "host wall clock, CPU ops: not the GPU overhead"
    print(f"{model} fp8 T=1 eager: raw ops {raw_us:.1f} us, module forward {mod_us:.1f} us, "
          f"overhead {mod_us - raw_us:+.1f} us ({clock})")
    rows.append(forward_row("MegaMoEExperts.forward", model, mod_us, "pre_dispatch + fp8_mega_moe (raw ops)",
                            raw_us, nbytes, flops, ceilings))
    if device == "cuda":
        print(f"{model} fp8 T=1 CUDA-graph replay: raw ops {raw_graph_us:.1f} us, module forward "
              f"{mod_graph_us:.1f} us, difference {mod_graph_us - raw_graph_us:+.1f} us")
        rows.append(forward_row("MegaMoEExperts.forward (CUDA graph)", model, mod_graph_us,
                                "pre_dispatch + fp8_mega_moe (raw ops, CUDA graph)", raw_graph_us, nbytes, flops,
                                ceilings))
        for fmt in ("fp8", "mxfp4", "nvfp4"):
            peak, final = load_finalize_peak(cfg, fmt)
            print(f"{model} {fmt:5s} load + finalize: peak {peak / 2**20:9.1f} MiB, final weights "
                  f"{final / 2**20:9.1f} MiB, ratio {peak / final:.3f} (target <= 1.2)")
            rows.append(dict(op="MegaMoEExperts.load+finalize", format=fmt, act_format="fp8", model=model, ranks=1,
                             tokens_per_rank=None, us=None, floor_us=None, time_over_floor=None, peer=None,
                             peer_us=None, speedup=None, tflops=None, gbps=None, peak_bytes=peak,
                             final_weight_bytes=final, peak_over_final=round(peak / final, 4)))
    else:
        print("CPU: CUDA-graph replay, load + finalize peak memory and the ceilings need a GPU (skipped)")
    if args.json:
        result = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  "date": datetime.date.today().isoformat(), "torch": torch.__version__, "commit": git_commit(),
                  "ceilings": ceilings, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
