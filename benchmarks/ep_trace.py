"""Phases of the expert-parallel launch chain at decode (diagnostic; needs a MEGAMOE_PHASE_TRACE build).

    MEGAMOE_NVCC_DEFINES=MEGAMOE_PHASE_TRACE python setup.py build_ext --inplace
    python -m torch.distributed.run --nproc-per-node 4 benchmarks/ep_trace.py [--model V4-Flash] [--format fp8]
        [--act-format fp8] [--tokens 1] [--calls 8]

Every rank runs pre_dispatch + the fused op inside a CUDA graph of --calls calls (as bench_ep --graph), replays it
after warm-up, and its kernels print their phase stamps (PhaseStamps: global-timer ns) into a file per rank. Rank 0
prints, per rank, the median over the last replay's calls of each phase's length in µs:
- pre_dispatch: dependency wait -> end;
- routing: dependency wait -> barrier 0 passed (every rank's pre_dispatch done; skew included) -> the ranks' token
  counts read -> every rank's ids read and counted -> scanned -> scattered;
- gather (block 0: its 8 warps take items 0-7, rows or, in the folding gathers, a row's passes of 32 groups; every
  item where the rank receives few rows): dependency wait -> row count read -> its first item stored -> its other
  items (calls where block 0 has no item are left out);
- combine (block 0): dependency wait -> barrier 1 passed -> end.
NOTES: a kernel that printed completes late (tile_trace.py: ~30 µs on H100), so only the durations inside one kernel
hold, never the gaps between kernels, and a barrier's wait includes the peers' printing.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics

import torch
import torch.distributed as dist

import megamoe
from megamoe import reference

import bench_utils as bu
from bench_ep import GRAPH_WARM_REPLAYS, make_local_layer
from bench_moe import MODELS

# Per kernel: the names of the phases between consecutive stamps (the first stamp is the block's entry).
PHASES = {
    "pre_dispatch": ["launch->waited", "work"],
    "routing": ["launch->waited", "barrier 0", "token counts", "ids counted", "scanned", "scattered"],
    "gather": ["launch->waited", "row count", "first row", "rest"],
    "combine": ["launch->waited", "barrier 1", "sums"],
}


def parse(path: str):
    """The MMTRACE K lines after the last MARK: [(kernel, stamps)] in print order."""
    lines = open(path).read().splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("MMTRACE MARK")]
    out = []
    for line in lines[marks[-1] + 1 if marks else 0:]:
        f = line.split()
        if len(f) > 4 and f[:2] == ["MMTRACE", "K"] and int(f[3]) == 0:  # block 0 of each kernel
            n = int(f[4])
            out.append((f[2], [int(v) for v in f[5:5 + n]]))
    return out


def summarize(records, rank: int) -> None:
    print(f"rank {rank}: median µs per phase over {sum(1 for k, _ in records if k == 'routing')} calls")
    for kernel, names in PHASES.items():
        # Records with every stamp only (a gather block without rows has no first-row stamp).
        stamps = [s for k, s in records if k == kernel and len(s) == len(names) + 1]
        if not stamps:
            continue
        cols = [f"{name} {statistics.median((s[j + 1] - s[j]) / 1e3 for s in stamps):6.2f}"
                for j, name in enumerate(names)]
        print(f"  {kernel:12s} " + " | ".join(cols) + (f" ({len(stamps)} calls)" if kernel == "gather" else ""))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="V4-Flash")
    parser.add_argument("--format", default="fp8")
    parser.add_argument("--act-format", default="fp8")
    parser.add_argument("--tokens", type=int, default=1, help="tokens per rank")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--dir", default=os.environ.get("OUT", "."), help="where the per-rank stamp files go")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    cfg = MODELS[args.model]
    e, h, i, k = cfg["num_experts"], cfg["hidden"], cfg["intermediate"], cfg["top_k"]
    gen = torch.Generator(device=device).manual_seed(17 + rank)
    l1, l2 = make_local_layer(e // world, h, i, args.format, gen, device)
    buf = megamoe.get_symm_buffer(dist.group.WORLD, e, args.tokens, k, h, i, act_format=args.act_format,
                                  device=device)
    x = torch.randn(args.tokens, h, generator=torch.Generator().manual_seed(rank)).to(device, torch.bfloat16)
    idx, w = reference.make_random_routing(args.tokens, e, k, seed=7 * rank + 1, device=device)
    y = torch.empty_like(x)
    call = bu.moe_step(x, idx, w, y, l1, l2, buf, args.format)

    # The kernels' printf goes to the process's stdout: this rank's file from here on.
    path = os.path.join(args.dir, f"ep-trace-rank{rank}.txt")
    libc = ctypes.CDLL(None)
    torch.cuda.synchronize()
    saved = os.dup(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = bu.capture_graph(lambda: [call() for _ in range(args.calls)])
    for _ in range(GRAPH_WARM_REPLAYS):  # the same count on every rank: each call joins its peers' flags
        graph.replay()
    torch.cuda.synchronize()
    libc.fflush(None)
    os.write(1, b"MMTRACE MARK\n")
    graph.replay()
    torch.cuda.synchronize()
    libc.fflush(None)
    os.dup2(saved, 1)
    os.close(fd)
    dist.barrier()
    if rank == 0:
        print(f"EP={world} {args.model} {args.format}:{args.act_format} {args.tokens} token(s) per rank, "
              f"{torch.cuda.get_device_name()}")
        for r in range(world):
            summarize(parse(os.path.join(args.dir, f"ep-trace-rank{r}.txt")), r)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
