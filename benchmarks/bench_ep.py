"""Expert-parallel fused layer vs a non-overlapped NCCL pipeline, one process per GPU.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_ep.py \
        [--models V4-Flash] [--tokens 1,16,128,512,2048,8192] [--json out.json] [--plot out.png]
    python benchmarks/bench_ep.py --from-json a.json,b.json --plot out.png      # plot saved results

Per (model, tokens per rank):
- megamoe: ``pre_dispatch`` + ``fp8_mega_moe`` on a symmetric-memory buffer (dispatch, both GEMMs and the
  combine in one op, cross-rank flags, no NCCL, no host sync).
- peer: what a user can write today with NCCL and the project's own single-GPU expert compute: slot
  counts exchanged with ``all_to_all_single`` (a host sync: NCCL needs the split sizes on the host), bf16
  token rows dispatched with ``all_to_all_single``, ``megamoe.moe`` on the received rows with the rank's
  experts (top-k 1, the routing weight applied in SwiGLU as in the fused op), rows sent back with
  ``all_to_all_single``, ``index_add`` over slots.
Timing: each iteration starts after a device sync and a process-group barrier; CUDA events around the
call; median over iterations of the slowest rank. The floor of one rank = max(bytes of its touched
experts'
weights / copy bandwidth, its FLOPs / dense FP8 rate), ceilings measured in this run. NVLink GB/s = bytes
the fused op moves between GPUs (remote token rows in, remote bf16 expert outputs back) / its time.
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
import torch.distributed as dist

import megamoe
from megamoe import reference

import bench_utils as bu

MODELS = {
    "V4-Flash": dict(num_experts=256, top_k=6, hidden=4096, intermediate=2048),
    "V4-Pro": dict(num_experts=384, top_k=6, hidden=7168, intermediate=3072),
}


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median over iterations of the slowest rank's CUDA-event time (µs); ranks aligned before each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        bu.flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        t = torch.tensor([start.elapsed_time(end) * 1e3], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


class NcclPipeline:
    """Non-overlapped expert parallelism with NCCL collectives around the single-GPU op."""

    def __init__(self, cfg, l1, l2, max_tokens, device):
        self.cfg, self.l1, self.l2 = cfg, l1, l2
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.num_local = cfg["num_experts"] // self.world
        rows = self.world * max_tokens * cfg["top_k"]
        self.buf = megamoe.get_symm_buffer(None, self.num_local, rows, 1, cfg["hidden"], cfg["intermediate"],
                                           device=device)

    def __call__(self, x, idx, w):
        t, k = idx.shape
        valid = (idx >= 0).flatten()
        slot_ids = idx.flatten()[valid].long()
        slot_token = torch.arange(t, device=x.device).repeat_interleave(k)[valid]
        slot_w = w.flatten()[valid]
        dest = slot_ids // self.num_local
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()  # host sync
        n_recv = sum(recv_split)
        send_x = x[slot_token[order]]
        meta = torch.stack([(slot_ids[order] % self.num_local).float(), slot_w[order]], 1)
        recv_x = torch.empty(n_recv, x.shape[1], dtype=x.dtype, device=x.device)
        recv_meta = torch.empty(n_recv, 2, dtype=meta.dtype, device=x.device)
        dist.all_to_all_single(recv_x, send_x, recv_split, send_split)
        dist.all_to_all_single(recv_meta, meta, recv_split, send_split)
        out = megamoe.moe(recv_x, recv_meta[:, :1].to(torch.int32), recv_meta[:, 1:].contiguous(), self.l1, self.l2,
                          self.buf)
        back = torch.empty_like(send_x)
        dist.all_to_all_single(back, out, send_split, recv_split)
        y = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        y.index_add_(0, slot_token[order], back.float())
        return y.to(torch.bfloat16)


def profile_kernels(fn, what: str, iters: int = 5) -> None:
    """Per-kernel mean GPU time of `fn` on rank 0 (all ranks run it, in step)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(f"  kernels of {what} (mean over {iters} calls):")
        for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if ev.device_time_total > 0:
                print(f"    {ev.device_time_total / iters:9.1f} us  x{ev.count // iters}  {ev.key[:90]}")


def fused_bytes_moved(idx, num_local, rank, token_bytes, hidden):
    """Bytes the fused op moves over NVLink for this rank's tokens (remote in + remote out)."""
    valid = idx >= 0
    remote = (valid & (idx.long() // num_local != rank)).sum().item()
    return remote * (token_bytes + 2 * hidden)


def plot(docs, path):
    """Speedup vs the NCCL pipeline and time over the floor, per (model, ranks), from result documents."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    rows = [r for d in docs for r in d["rows"]]
    for key in sorted({(r["model"], r["ranks"]) for r in rows}):
        rs = sorted((r for r in rows if (r["model"], r["ranks"]) == key), key=lambda r: r["tokens_per_rank"])
        ts = [r["tokens_per_rank"] for r in rs]
        label = f"{key[0]} EP={key[1]}"
        axes[0].plot(ts, [r["speedup"] for r in rs], marker="o", label=label)
        axes[1].plot(ts, [r["time_over_floor"] for r in rs], marker="o", label=label)
    axes[0].set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="speedup",
                title="fused EP op vs NCCL all_to_all pipeline")
    axes[1].set(xscale="log", xlabel="tokens per rank", ylabel="time / floor", title="fused EP op vs floor")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    gpu = docs[0]["gpu"].replace("NVIDIA ", "")
    fig.suptitle(f"megamoe expert parallelism, FP8, {gpu}, {docs[0]['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="V4-Flash")
    parser.add_argument("--tokens", default="1,16,128,512,2048,8192")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also print the fused op's per-kernel GPU times (torch.profiler, rank 0)")
    parser.add_argument("--plot", default=None, help="PNG of the results (with --from-json: no GPU run)")
    parser.add_argument("--from-json", default=None, help="comma list of result files to plot")
    args = parser.parse_args()
    if args.from_json:
        plot([json.load(open(p)) for p in args.from_json.split(",")], args.plot)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    tokens = [int(t) for t in args.tokens.split(",")]
    copy_bw = bu.measure_copy_bandwidth()
    fp8_rate = bu.measure_fp8_matmul_flops()
    log(f"EP={world}  copy {copy_bw / 1e12:.2f} TB/s  FP8 {fp8_rate / 1e12:.0f} TFLOP/s  "
        f"({torch.cuda.get_device_name()})")
    rows = []
    for model in args.models.split(","):
        cfg = MODELS[model]
        e, h, i, k = cfg["num_experts"], cfg["hidden"], cfg["intermediate"], cfg["top_k"]
        num_local = e // world
        gen = torch.Generator(device=device).manual_seed(17 + rank)
        w13, sf13 = reference.make_fp8_block_weights(num_local, 2 * i, h, generator=gen, device=device)
        l1 = megamoe.transform_weights(w13, sf13, weight_format="fp8", is_l1=True)
        del w13, sf13
        w2, sf2 = reference.make_fp8_block_weights(num_local, h, i, generator=gen, device=device)
        l2 = megamoe.transform_weights(w2, sf2, weight_format="fp8", is_l1=False)
        del w2, sf2
        cap = max(tokens)
        buf = megamoe.get_symm_buffer(dist.group.WORLD, e, cap, k, h, i, device=device)
        peer = NcclPipeline(cfg, l1, l2, cap, device)
        log(f"{'model':9} {'T/rank':>6} {'us':>9} {'floor':>8} {'t/floor':>7} {'peer us':>9} {'speedup':>7} "
            f"{'NVLink GB/s':>11} {'rel diff':>8}")
        for t in tokens:
            g = torch.Generator().manual_seed(1000 * t + rank)
            x = torch.randn(t, h, generator=g).to(device, torch.bfloat16)
            idx, w = reference.make_random_routing(t, e, k, seed=1000 * t + 7 * rank + 1, device=device)
            y = torch.empty_like(x)

            def fused():
                megamoe.pre_dispatch(x, idx, w, buf)
                megamoe.fp8_mega_moe(y, l1, l2, buf)

            us = timed(fused, args.iters)
            if args.profile:
                profile_kernels(fused, f"{model} T/rank={t}")
            peer_us = timed(lambda: peer(x, idx, w), args.iters)
            y_peer = peer(x, idx, w)
            fused()
            diff = ((y.float() - y_peer.float()).norm() / y_peer.float().norm().clamp_min(1e-30)).item()
            # Floor of the slowest rank: its touched local experts' weight bytes, its FLOPs.
            all_idx = [torch.empty_like(idx) for _ in range(world)]
            dist.all_gather(all_idx, idx)
            ids = torch.cat(all_idx).flatten()
            ids = ids[ids >= 0].long()
            local = ids[(ids // num_local) == rank]
            touched = torch.unique(local).numel()
            weight_bytes = touched * 3 * h * i * (1 + 4 / (64 * 128))
            flops = local.numel() * 2 * 3 * h * i
            floor = torch.tensor([max(weight_bytes / copy_bw, flops / fp8_rate) * 1e6], device=device)
            dist.all_reduce(floor, op=dist.ReduceOp.MAX)
            moved = torch.tensor([fused_bytes_moved(idx, num_local, rank, h + h // 32, h)], device=device,
                                 dtype=torch.float64)
            dist.all_reduce(moved, op=dist.ReduceOp.MAX)
            gbps = moved.item() / (us * 1e-6) / 1e9
            row = dict(op="fp8_mega_moe", format="fp8", act_format="fp8", model=model, ranks=world,
                       tokens_per_rank=t, us=round(us, 2), floor_us=round(floor.item(), 2),
                       time_over_floor=round(us / floor.item(), 3), peer="nccl_all_to_all+megamoe.moe",
                       peer_us=round(peer_us, 2), speedup=round(peer_us / us, 3), tflops=None,
                       gbps=round(gbps, 1), rel_diff_vs_peer=round(diff, 5))
            rows.append(row)
            log(f"{model:9} {t:6d} {us:9.1f} {floor.item():8.1f} {us / floor.item():7.2f} {peer_us:9.1f} "
                f"{peer_us / us:7.2f} {gbps:11.1f} {diff:8.1e}")
        del buf, peer, l1, l2
        torch.cuda.empty_cache()
    if rank == 0:
        commit = os.environ.get("MEGAMOE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None
        doc = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                   torch=torch.__version__, commit=commit,
                   ceilings=dict(copy_bytes_per_s=copy_bw, fp8_flops=fp8_rate), rows=rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    if rank == 0 and args.plot:
        plot([doc], args.plot)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
