"""Expert-parallel fused layer vs a non-overlapped NCCL pipeline, one process per GPU.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_ep.py \
        [--models V4-Flash] [--tokens 1,16,128,512,2048,8192] [--formats fp8,mxfp4:fp8,nvfp4:fp4] \
        [--json out.json] [--plot out.png] [--alt-env VAR=VALUE] [--graph] [--profile]
    python benchmarks/bench_ep.py --from-json a.json,b.json --plot out.png      # plot saved results

Per (model, tokens per rank):
- megamoe: ``pre_dispatch`` + ``fp8_mega_moe`` (or ``fp8_fp4_mega_moe`` for MXFP4 / NVFP4 weights, with FP8
  or FP4 activations: ``--formats weight[:act]``) on a symmetric-memory buffer (dispatch, both GEMMs and the
  combine in one op, cross-rank flags, no NCCL, no host sync).
- peer: what a user can write today with NCCL and the project's own single-GPU expert compute: slot
  counts exchanged with ``all_to_all_single`` (a host sync: NCCL needs the split sizes on the host), bf16
  token rows dispatched with ``all_to_all_single``, ``megamoe.moe`` on the received rows with the rank's
  experts (top-k 1, the routing weight applied in SwiGLU as in the fused op), rows sent back with
  ``all_to_all_single``, ``index_add`` over slots.
Timing: each iteration starts after a device sync and a process-group barrier; CUDA events around the
call; median over iterations of the slowest rank. The floor of one rank = max(bytes of its touched
experts'
weights (kernel layout: FP4 is 0.5 byte per weight plus its scales) / copy bandwidth, its FLOPs / dense FP8
rate), ceilings measured in this run. NVLink GB/s = bytes
the fused op moves between GPUs (remote token rows in, remote bf16 expert outputs back) / its time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess

import torch
import torch.distributed as dist

import megamoe
from megamoe import reference

import bench_utils as bu
from bench_moe import MODELS  # the DeepSeek-V4 shapes, one definition for the benchmarks


# Relative Frobenius difference of y against the NCCL pipeline's past which the run fails (the kernels' tolerance
# against the reference; the 358 rows committed up to 2026-11-27, EP=2 and 4, all read 0.0).
REL_DIFF_LIMIT = 1e-2


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

    def __init__(self, cfg, l1, l2, max_tokens, device, weight_format="fp8", act_format="fp8"):
        self.cfg, self.l1, self.l2, self.weight_format = cfg, l1, l2, weight_format
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.num_local = cfg["num_experts"] // self.world
        rows = self.world * max_tokens * cfg["top_k"]
        self.buf = megamoe.get_symm_buffer(None, self.num_local, rows, 1, cfg["hidden"], cfg["intermediate"],
                                           act_format=act_format, device=device)

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
                          self.buf, weight_format=self.weight_format)
        back = torch.empty_like(send_x)
        dist.all_to_all_single(back, out, send_split, recv_split)
        y = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        y.index_add_(0, slot_token[order], back.float())
        return y.to(torch.bfloat16)


# Warm-up replays of a graph of 8 calls, the same on every rank (each call joins the others' flags, so a time-based
# warm-up could hang): 13 x 8 calls, past the ~90 slow calls after a capture (bench_utils.warm).
GRAPH_WARM_REPLAYS = 13


def graph_time(fn) -> float:
    """Median µs of one call inside a CUDA graph of 8 calls (bench_utils.time_in_graph: an event pair around each
    call, L2 flushed before each), slowest rank. Calls follow each other as in a model's decode graph, so a rank's
    call waits for its peers' through the op's own flags, not for the host barrier that starts each eager timing
    (the processes leave it at different times) nor for host launches (the spread of the eager decode rows); only
    each replay's first call follows a host sync (1 call in 8; the median takes the others)."""
    torch.cuda.synchronize()
    dist.barrier()
    t = torch.tensor([bu.time_in_graph(fn, calls=8, replays=5, warm_replays=GRAPH_WARM_REPLAYS)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


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
        # Eagerly the first kernel's PDL wait absorbs the wait for the previous call, i.e. for the peers: read
        # the order and the overlaps here, the gaps in the graph's timeline (profile_graph).
        print_last_call(prof, iters, "eager")


def print_last_call(prof, calls: int, what: str) -> None:
    """The last of `calls` profiled calls' kernels in order: start after the call's first kernel's start, duration
    (µs). A kernel that starts before its predecessor ends overlaps it (programmatic dependent launch)."""
    kernels = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda ev: ev.time_range.start)
    if not kernels or len(kernels) % calls:
        print(f"  {what}: {len(kernels)} kernels for {calls} calls, no timeline")
        return
    last = kernels[-(len(kernels) // calls):]
    t0 = last[0].time_range.start
    print(f"  {what}, the last call's kernels (start, duration in us):")
    for ev in last:
        print(f"    {ev.time_range.start - t0:9.1f} {ev.time_range.elapsed_us():9.1f}  {ev.name[:90]}")


def profile_graph(fn, what: str, calls: int = 8) -> None:
    """The kernels of one call inside a CUDA graph of `calls` calls: two replays profiled on every rank (each
    replays as often), rank 0's printed; no L2 flush. In a graph no call waits for a host launch or a host barrier,
    so the gaps between kernels are the chain's own: the waits for the peers' flags and the launches' latencies."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = bu.capture_graph(lambda: [fn() for _ in range(calls)])
    for _ in range(GRAPH_WARM_REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print_last_call(prof, 2 * calls, f"{what} in a graph of {calls} calls")
    del graph


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
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    rows = [r for d in docs for r in d["rows"]]
    # A colour per format pair, a line style per (model, ranks): the series stay apart with many files.
    pairs = sorted({(r["format"], r["act_format"]) for r in rows})
    setups = sorted({(r["model"], r["ranks"]) for r in rows})
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "v"]
    def key_of(r):
        return r["model"], r["ranks"], r["format"], r["act_format"]

    # Per call in a graph of 8 where every row has it (--graph), else eager: one measure in the panel.
    in_graph = bool(rows) and all("graph_over_floor" in r for r in rows)
    floor_key = "graph_over_floor" if in_graph else "time_over_floor"
    for key in sorted({key_of(r) for r in rows}):
        rs = sorted((r for r in rows if key_of(r) == key), key=lambda r: r["tokens_per_rank"])
        ts = [r["tokens_per_rank"] for r in rs]
        label = f"{key[0]} {key[2]}{'' if key[3] == 'fp8' else '-a4'} EP={key[1]}"
        setup = setups.index((key[0], key[1]))
        look = dict(color=f"C{pairs.index((key[2], key[3])) % 10}", linestyle=styles[setup % len(styles)],
                    marker=markers[setup % len(markers)], label=label)
        axes[0].plot(ts, [r["speedup"] for r in rs], **look)
        axes[1].plot(ts, [r[floor_key] for r in rs], **look)
    axes[0].set(xscale="log", yscale="log", xlabel="tokens per rank", ylabel="speedup",
                title="fused EP op vs NCCL all_to_all pipeline")
    axes[1].set(xscale="log", xlabel="tokens per rank", ylabel="time / floor",
                title="fused EP op vs floor" + (" (in a graph)" if in_graph else ""))
    for ax in axes:
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    gpu = docs[0]["gpu"].replace("NVIDIA ", "")
    formats = sorted({r["format"] + ("" if r["act_format"] == "fp8" else "-a4") for r in rows})
    fig.suptitle(f"megamoe expert parallelism, {', '.join(formats)}, {gpu}, {docs[0]['date']}")
    fig.tight_layout(rect=(0, 0.04 + 0.035 * ((len(labels) + 3) // 4), 1, 1))
    fig.savefig(path, dpi=80)


def make_local_layer(num_local, h, i, weight_format, gen, device):
    """This rank's experts in kernel layout (checkpoint layout made and dropped one projection at a time)."""
    def one(n, k, is_l1):
        if weight_format == "fp8":
            w, sf = reference.make_fp8_block_weights(num_local, n, k, generator=gen, device=device)
            g = None
        else:
            w, sf, g = reference.make_fp4_expert_weights(num_local, n, k, weight_format, generator=gen, device=device)
        return megamoe.transform_weights(w, sf, g, weight_format=weight_format, is_l1=is_l1)

    return one(2 * i, h, True), one(h, i, False)


def bench_model(cfg, model, weight_format, act_format, tokens, args, copy_bw, fp8_rate, device):
    """Rows of one (model, format pair) at every token count."""
    rank, world = dist.get_rank(), dist.get_world_size()
    e, h, i, k = cfg["num_experts"], cfg["hidden"], cfg["intermediate"], cfg["top_k"]
    num_local = e // world
    gen = torch.Generator(device=device).manual_seed(17 + rank)
    l1, l2 = make_local_layer(num_local, h, i, weight_format, gen, device)
    # Kernel-layout bytes of one expert (weights + scales): what streaming a touched expert costs.
    bytes_per_expert = sum(t.numel() * t.element_size() for t in (*l1, *l2) if t is not None) / num_local
    cap = max(tokens)
    buf = megamoe.get_symm_buffer(dist.group.WORLD, e, cap, k, h, i, act_format=act_format, device=device)
    token_bytes = buf.layout["token_bytes"] + buf.layout["token_sf_bytes"]  # a remote row in: values + scales
    peer = NcclPipeline(cfg, l1, l2, cap, device, weight_format, act_format)
    log(f"{model} {weight_format} weights, {act_format} activations: {bytes_per_expert / 1e6:.1f} MB per expert")
    log(f"{'model':9} {'T/rank':>6} {'us':>9} {'floor':>8} {'t/floor':>7} {'peer us':>9} {'speedup':>7} "
        f"{'NVLink GB/s':>11} {'rel diff':>8}" + (f" {'alt us':>9} {'alt/us':>6} {'alt diff':>8}" if args.alt_env else "")
        + (f" {'graph us':>9} {'g/floor':>7}" if args.graph else "")
        + (f" {'alt g us':>9} {'alt/g':>6}" if args.graph and args.alt_env else ""))
    rows = []
    for t in tokens:
        g = torch.Generator().manual_seed(1000 * t + rank)
        x = torch.randn(t, h, generator=g).to(device, torch.bfloat16)
        idx, w = reference.make_random_routing(t, e, k, seed=1000 * t + 7 * rank + 1, device=device)
        y = torch.empty_like(x)

        fused = bu.moe_step(x, idx, w, y, l1, l2, buf, weight_format)
        # Eager A/B back to back first, then the graphs (a capture and its replays change what follows: warm()).
        us = timed(fused, args.iters)
        alt_us = alt_diff = y_alt = None
        if args.alt_env:  # the same op with a kernel switch set (read per call), timed in this run: an A/B
            with bu.environment(args.alt_env, "--alt-env"):
                alt_us = timed(fused, args.iters)
                y_alt = y.clone()
        graph_us = y_graph = alt_graph_us = y_alt_graph = None
        if args.graph:
            graph_us = graph_time(fused)
            y_graph = y.clone()
            if args.alt_env:  # captured with the switch set: the host reads it while recording the launches
                with bu.environment(args.alt_env, "--alt-env"):
                    alt_graph_us = graph_time(fused)
                    y_alt_graph = y.clone()
        if args.profile:
            profile_kernels(fused, f"{model} {weight_format}:{act_format} T/rank={t}")
            if args.graph:
                profile_graph(fused, f"{model} {weight_format}:{act_format} T/rank={t}")
        peer_us = timed(lambda: peer(x, idx, w), args.iters)
        y_peer = peer(x, idx, w)
        fused()
        if alt_us is not None:
            alt_diff = (y_alt.float() - y.float()).abs().max().item()
        # Each graph's output against its eager output.
        graph_diff = (y_graph.float() - y.float()).abs().max().item() if y_graph is not None else None
        alt_graph_diff = (y_alt_graph.float() - y_alt.float()).abs().max().item() if y_alt_graph is not None else None
        diff = ((y.float() - y_peer.float()).norm() / y_peer.float().norm().clamp_min(1e-30)).item()
        # Floor of the slowest rank: its touched local experts' weight bytes, its FLOPs.
        all_idx = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(all_idx, idx)
        ids = torch.cat(all_idx).flatten()
        ids = ids[ids >= 0].long()
        local = ids[(ids // num_local) == rank]
        touched = torch.unique(local).numel()
        flops = local.numel() * 2 * 3 * h * i
        floor = torch.tensor([max(touched * bytes_per_expert / copy_bw, flops / fp8_rate) * 1e6], device=device)
        dist.all_reduce(floor, op=dist.ReduceOp.MAX)
        moved = torch.tensor([fused_bytes_moved(idx, num_local, rank, token_bytes, h)], device=device,
                             dtype=torch.float64)
        dist.all_reduce(moved, op=dist.ReduceOp.MAX)
        gbps = moved.item() / (us * 1e-6) / 1e9
        op = "fp8_mega_moe" if weight_format == "fp8" else "fp8_fp4_mega_moe"
        rows.append(dict(op=op, format=weight_format, act_format=act_format, model=model, ranks=world,
                         tokens_per_rank=t, us=round(us, 2), floor_us=round(floor.item(), 2),
                         time_over_floor=round(us / floor.item(), 3), peer="nccl_all_to_all+megamoe.moe",
                         peer_us=round(peer_us, 2), speedup=round(peer_us / us, 3), tflops=None,
                         gbps=round(gbps, 1), rel_diff_vs_peer=round(diff, 5)))
        alt = ""
        if alt_us is not None:
            rows[-1].update(alt_env=args.alt_env, alt_us=round(alt_us, 2), alt_max_abs_diff=alt_diff)
            alt = f" {alt_us:9.1f} {alt_us / us:6.3f} {alt_diff:8.1e}"
        if graph_us is not None:
            rows[-1].update(graph_us=round(graph_us, 2), graph_over_floor=round(graph_us / floor.item(), 3),
                            graph_max_abs_diff=graph_diff)
            alt += f" {graph_us:9.1f} {graph_us / floor.item():7.2f}"
            if alt_graph_us is not None:
                rows[-1].update(alt_graph_us=round(alt_graph_us, 2), alt_graph_max_abs_diff=alt_graph_diff)
                alt += f" {alt_graph_us:9.1f} {alt_graph_us / graph_us:6.3f}"
        log(f"{model:9} {t:6d} {us:9.1f} {floor.item():8.1f} {us / floor.item():7.2f} {peer_us:9.1f} "
            f"{peer_us / us:7.2f} {gbps:11.1f} {diff:8.1e}{alt}")
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="V4-Flash")
    parser.add_argument("--tokens", default="1,16,128,512,2048,8192")
    parser.add_argument("--formats", default="fp8",
                        help="comma list of weight_format[:act_format] (fp8, mxfp4, nvfp4; act fp8 or fp4)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=None)
    parser.add_argument("--alt-env", default=None,
                        help="VAR=VALUE: also time the fused op with this kernel switch set, in the same run "
                             "(e.g. MEGAMOE_FP8_FUSED=1); rows get alt_us and the largest difference of outputs")
    parser.add_argument("--graph", action="store_true",
                        help="also time the fused op inside a CUDA graph of 8 calls per rank (graph_us: per call, "
                             "slowest rank's median; with --alt-env also alt_graph_us), after 3 eager and 104 graph "
                             "warm-up calls; eager calls each start after a host barrier that the processes leave at "
                             "different times, which spreads the decode rows")
    parser.add_argument("--profile", action="store_true",
                        help="also print the fused op's per-kernel GPU times and one call's kernels in order "
                             "(torch.profiler, rank 0); with --graph also one call's kernels inside a graph of 8 calls")
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
    pairs = [tuple((f + ":fp8").split(":")[:2]) for f in args.formats.split(",")]
    for model in args.models.split(","):
        for weight_format, act_format in pairs:
            rows += bench_model(MODELS[model], model, weight_format, act_format, tokens, args, copy_bw, fp8_rate,
                                device)
            torch.cuda.empty_cache()
    if rank == 0:
        commit = os.environ.get("MEGAMOE_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None
        doc = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                   torch=torch.__version__, commit=commit, l2_flush=bu.l2_flush_mode(),
                   ceilings=dict(copy_bytes_per_s=copy_bw, fp8_flops=fp8_rate), rows=rows)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    if rank == 0 and args.plot:
        plot([doc], args.plot)
    dist.barrier()
    dist.destroy_process_group()
    # The fused op against the NCCL pipeline (the same per-expert math on one rank's experts): a row past the
    # kernels' tolerance (DESIGN.md: 1e-2 against the reference) or NaN fails the run once its results are written,
    # so that a wrong result at a rank count or shape no test covers (the EP=8 V4-Pro rows' offsets past 2^31) is
    # not just a logged number.
    bad = [r for r in rows if not r["rel_diff_vs_peer"] <= REL_DIFF_LIMIT]
    if bad:
        raise SystemExit("bench_ep: the fused op differs from the NCCL pipeline by more than "
                         f"{REL_DIFF_LIMIT} in " + ", ".join(f"{r['model']} {r['format']}:{r['act_format']} "
                                                           f"T/rank={r['tokens_per_rank']} ({r['rel_diff_vs_peer']})"
                                                           for r in bad))


if __name__ == "__main__":
    main()
