"""Per-CTA tile timeline of the grouped GEMMs (diagnostic; needs a build with MEGAMOE_TILE_TRACE).

    MEGAMOE_NVCC_DEFINES=MEGAMOE_TILE_TRACE python setup.py build_ext --inplace
    python benchmarks/tile_trace.py [--model V4-Flash] [--tokens 1] [--format fp8|mxfp4|nvfp4] [--act-format fp8|fp4]
        [--no-flush] [--graph] [--json out.json]

Runs one call (after warm-up and an L2 flush) in a child process, whose kernels print, at exit, the global-timer
stamps of each CTA's tiles: when the weight producer claimed the tile and issued its first weight load, when its first
stage was full (consumers), when the main loop, each epilogue phase and the epilogue ended. Prints the walk's
phases (µs from the first claim): L1 / L2 tile starts and ends, each tile's main-loop time and weight bytes per µs,
the epilogue's phases, how many CTAs hold a tile over time, and the gap
between L1's last end and L2's first token stage; then the launch chain around it (pre_dispatch, routing with its
phases, gather, the GEMM's dependency wait, combine: each block's entry, wait exit and end). --graph traces a
replay of the call captured in a CUDA graph. NOTES: a kernel that printed completes ~30 µs late (H100, 2026-11-24),
so in the chain only the durations inside one kernel hold (e.g. the routing phases), not the gaps between kernels;
those come from `profile_moe.py --timeline` on a normal build.
FP4 weights (--format mxfp4 / nvfp4): the two FP4 launches record the same lines (L2's CTAs numbered from 1024), with
one epilogue phase, no whole-walk sums and no producer wait counts; a stage there is 256 K of 0.5-byte weights
(FP8: 128 K of 1-byte weights), and the consumers' wait counts the bf16 token tile too.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(model: str, tokens: int, flush: bool, graph: bool, fmt: str = "fp8", act: str = "fp8") -> None:
    import torch

    import megamoe
    import bench_moe as bm
    import bench_utils as bu

    cfg = bm.MODELS[model]
    e, k, h, i = cfg["num_experts"], cfg["top_k"], cfg["hidden"], cfg["intermediate"]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    l1, l2 = bm.make_layer(cfg, gen) if fmt == "fp8" else bm.make_fp4_layer(cfg, fmt, gen)
    x = torch.randn(tokens, h, device="cuda", generator=gen).bfloat16()
    idx, w = bm.make_routing(tokens, e, k, gen)
    buf = megamoe.get_symm_buffer(None, e, tokens, k, h, i, act_format=act)
    y = torch.empty_like(x)
    libc = ctypes.CDLL(None)
    call = bu.moe_step(x, idx, w, y, l1, l2, buf, fmt)

    for _ in range(3):
        call()
    if graph:  # the traced call is a replay of the call captured in a CUDA graph, as a server runs it
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        call = g.replay
        for _ in range(2):
            call()
    if flush:
        bu.flush_l2()
    torch.cuda.synchronize()
    libc.fflush(None)
    print("MMTRACE MARK", flush=True)
    call()
    torch.cuda.synchronize()
    libc.fflush(None)
    print("MMTRACE END", flush=True)
    stage_k, weight_bytes = (128, 1.0) if fmt == "fp8" else (256, 0.5)  # K per pipeline stage, bytes per weight
    print(f"MMTRACE SHAPE {h} {i} {k} {e} {stage_k} {weight_bytes}", flush=True)


def parse(lines):
    cta_tiles, claims, entries, kernels, shape, walks = [], [], {}, [], None, {}
    on = False
    for line in lines:
        f = line.split()
        if len(f) < 2 or f[0] != "MMTRACE":
            continue
        if f[1] == "MARK":
            on, cta_tiles, claims, entries, kernels, walks = True, [], [], {}, [], {}
        elif f[1] == "END":
            on = False
        elif f[1] == "SHAPE":
            shape = tuple(int(v) for v in f[2:6]) + ((int(f[6]), float(f[7])) if len(f) > 7 else (128, 1.0))
        elif on and f[1] == "P":
            claims.append(dict(cta=int(f[2]), sm=int(f[3]), tile=int(f[4]), claim=int(f[5]), issue=int(f[6]),
                               wait_cycles=int(f[7]) if len(f) > 8 and int(f[7]) >= 0 else None,  # < 0: none
                               span_cycles=int(f[8]) if len(f) > 8 and int(f[8]) >= 0 else None))
        elif on and f[1] == "E":
            entries[int(f[2])] = int(f[4])
            name = "gemm" if int(f[2]) < 1024 else "gemm-l2"  # the FP4 kernels' L2 launch prints from 1024
            kernels.append(dict(kernel=name, block=int(f[2]), stamps=[int(f[5]), int(f[4])]))
        elif on and f[1] == "S":  # the CTA's whole walk: per gemm tiles, ns to first full stage / main loop / phases
            v = [int(x) for x in f[3:20]]
            walks[int(f[2])] = dict(l1=v[0:8], l2=v[8:16], exit=v[16])
        elif on and f[1] == "K":
            n = int(f[4])
            kernels.append(dict(kernel=f[2], block=int(f[3]), stamps=[int(v) for v in f[5:5 + n]]))
        elif on and f[1] == "C":
            cta_tiles.append(dict(cta=int(f[2]), sm=int(f[3]), gemm=int(f[4]), expert=int(f[5]), n_block=int(f[6]),
                                  rows=int(f[7]), start=int(f[8]), main_end=int(f[9]), end=int(f[10]),
                                  epilogue=[int(v) for v in f[11:15]],
                                  main_cycles=int(f[15]) if len(f) > 15 else None,
                                  full_wait_cycles=int(f[16]) if len(f) > 16 else None))
    return cta_tiles, claims, entries, kernels, shape, walks


def walk_totals(walks, entries) -> dict:
    """Where the CTAs' time went over the whole walk (every tile; the per-tile records cover only each CTA's first
    few): per gemm, the mean per CTA of the time from the previous tile's end to a tile's first full stage (waiting
    for the tile's data, and in the fused walk for its expert's L1 tiles), in main loops and in epilogues, as
    shares of the span from the first consumer entry to the last exit; the rest is the wait for the end marker."""
    if not any(w["l1"][0] or w["l2"][0] for w in walks.values()):  # none recorded (the FP4 kernels)
        return {}
    ctas = [b for b in walks if b in entries]
    t0, t1 = min(entries[b] for b in ctas), max(walks[b]["exit"] for b in ctas)
    span = (t1 - t0) / 1e3
    out = {"span_us": span, "ctas": len(ctas)}
    print(f"whole walk ({len(ctas)} CTAs, span {span:.1f} µs from the first entry to the last exit): per gemm, "
          f"tiles, then per-CTA mean µs (share of the span) waiting for a tile's first full stage / main loops / "
          f"epilogues, and µs per tile")
    accounted = 0.0
    for name in ("l1", "l2"):
        n = sum(walks[b][name][0] for b in ctas)
        if n == 0:
            continue
        phases = [sum(walks[b][name][j] for b in ctas) / 1e3 for j in range(3, 8)]
        parts = [sum(walks[b][name][j] for b in ctas) / 1e3 for j in (1, 2)] + [sum(phases)]
        per_cta = [v / len(ctas) for v in parts]
        accounted += sum(per_cta)
        names = ("swiglu", "amax", "quantize", "store", "count") if name == "l1" else ("stage", "copy-out", "rest")
        per_phase = [v / n for v in phases]
        per_phase = dict(zip(names, per_phase if name == "l1" else per_phase[:2] + per_phase[4:]))
        out[name] = dict(tiles=n, to_first_full_us=per_cta[0], main_us=per_cta[1], epilogue_us=per_cta[2],
                         per_tile_us=[v / n for v in parts], epilogue_phases_per_tile_us=per_phase)
        print(f"  {name.upper()}: {n} tiles; " + " / ".join(f"{v:.1f} ({v / span:.0%})" for v in per_cta) +
              "; per tile " + " / ".join(f"{v / n:.2f}" for v in parts) + " (epilogue: " +
              " ".join(f"{k} {v:.2f}" for k, v in per_phase.items()) + ")")
    late = sum((walks[b]["exit"] - entries[b]) / 1e3 for b in ctas) / len(ctas) - accounted
    start = sum((entries[b] - t0) / 1e3 for b in ctas) / len(ctas)
    out["end_wait_us"], out["late_entry_us"] = late, start
    print(f"  waiting for the end marker {late:.1f} ({late / span:.0%}), entering after the first CTA {start:.1f} "
          f"({start / span:.0%})")
    return out


def chain(kernels, t0) -> dict:
    """The launch chain around the GEMM: per kernel, its blocks' first entry, dependency-wait exits and last end
    (µs from the GEMM's first claim; earlier kernels are negative), and the routing block's phase stamps."""
    out = {}
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    names = sorted({k["kernel"] for k in kernels}, key=lambda n: min(k["stamps"][0] for k in kernels if k["kernel"] == n))
    print("launch chain (µs from the GEMM's first claim; gaps between kernels inflated by the printing, see the "
          "header): kernel, blocks, first entry, dependency wait done (first - last), last end")
    for name in names:
        ks = [k for k in kernels if k["kernel"] == name]
        row = dict(blocks=len(ks), entry=us(min(k["stamps"][0] for k in ks)),
                   waited_first=us(min(k["stamps"][1] for k in ks)), waited_last=us(max(k["stamps"][1] for k in ks)),
                   end=us(max(k["stamps"][-1] for k in ks)) if not name.startswith("gemm") else None)
        out[name] = row
        end = f"{row['end']:7.1f}" if row["end"] is not None else "      -"
        print(f"  {name:13s} {row['blocks']:4d} {row['entry']:7.1f} {row['waited_first']:7.1f} - "
              f"{row['waited_last']:7.1f} {end}")
        if name == "routing":
            stamps = [us(v) for v in ks[0]["stamps"]]
            out[name]["phases"] = stamps
            print("    routing phases (entry, waited, barrier 0, token counts, counted, scanned, scattered): "
                  + " ".join(f"{v:.2f}" for v in stamps))
    return out


def summarize(tiles, claims, entries, shape) -> dict:
    hidden, inter, stage_k, weight_bytes = shape[0], shape[1], shape[4], shape[5]
    t0 = min([c["claim"] for c in claims] + [t["start"] for t in tiles])
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    out = {"ctas_with_tiles": len({t["cta"] for t in tiles}), "ctas": len(entries)}
    print(f"CTAs {out['ctas']}, with tiles {out['ctas_with_tiles']}; consumer entry (after the grid dependency "
          f"wait): {us(min(entries.values())):.1f} - {us(max(entries.values())):.1f} µs")
    for gemm, name, k_bytes in ((0, "L1", hidden), (1, "L2", inter)):
        ts = [t for t in tiles if t["gemm"] == gemm]
        if not ts:
            continue
        main = [(t["main_end"] - t["start"]) / 1e3 for t in ts]
        epi = [(t["end"] - t["main_end"]) / 1e3 for t in ts]
        rate = [256 * k_bytes * weight_bytes / ((t["main_end"] - t["start"]) / 1e3) / 1e3 for t in ts]  # GB/s per tile
        row = dict(tiles=len(ts), first_start=us(min(t["start"] for t in ts)),
                   last_start=us(max(t["start"] for t in ts)), first_end=us(min(t["end"] for t in ts)),
                   last_end=us(max(t["end"] for t in ts)), main_us_median=statistics.median(main),
                   main_us_max=max(main), epilogue_us_median=statistics.median(epi),
                   gbps_per_tile_median=statistics.median(rate))
        # Epilogue phases (µs each, medians): L1 SwiGLU, token amax shared, quantized, stored, counted (fused);
        # L2 staged, copies issued (FP8: bulk copies, not waited for), the rest.
        names = ("swiglu", "amax", "quantize", "store", "count") if gemm == 0 else ("stage", "copy-out", "rest")
        if weight_bytes < 1:  # FP4: joined = every consumer warpgroup past its main loop (their drift)
            names = ("joined", "swiglu+amax", "quantize", "store") if gemm == 0 else ("joined", "stage", "store")
        marks = lambda t: [t["main_end"]] + t["epilogue"][:len(names) - 1] + [t["end"]]  # noqa: E731
        row["epilogue_phases_us"] = {n: statistics.median((marks(t)[j + 1] - marks(t)[j]) / 1e3 for t in ts)
                                     for j, n in enumerate(names)}
        cycles = [t["main_cycles"] for t in ts if t["main_cycles"] is not None]
        if cycles:  # the SM clock in situ: main-loop cycles over its global-timer ns
            ghz = [t["main_cycles"] / (t["main_end"] - t["start"]) for t in ts
                   if t["main_cycles"] is not None and t["main_end"] > t["start"]]
            row["sm_ghz_median"] = statistics.median(ghz)
            kblocks = k_bytes // stage_k
            row["cycles_per_kblock_median"] = statistics.median(cycles) / kblocks
            row["consumer_full_wait_per_kblock_median"] = statistics.median(
                t["full_wait_cycles"] for t in ts if t["full_wait_cycles"] is not None) / kblocks
            print(f"{name}: SM clock in the main loop (median) {row['sm_ghz_median']:.3f} GHz (min {min(ghz):.3f}, "
                  f"max {max(ghz):.3f}); {row['cycles_per_kblock_median']:.0f} cycles per {stage_k}-K stage, of which the "
                  f"consumers waited {row['consumer_full_wait_per_kblock_median']:.0f} for full stages")
        out[name] = row
        print(f"{name}: epilogue phases (median µs) " +
              " ".join(f"{n} {v:.2f}" for n, v in row["epilogue_phases_us"].items()))
        print(f"{name}: {row['tiles']} tiles; first stage full {row['first_start']:.1f} - {row['last_start']:.1f} µs; "
              f"ends {row['first_end']:.1f} - {row['last_end']:.1f} µs; main loop median {row['main_us_median']:.1f} "
              f"(max {row['main_us_max']:.1f}) µs = {row['gbps_per_tile_median']:.1f} GB/s per tile; epilogue "
              f"{row['epilogue_us_median']:.2f} µs")
    # The n-th tile a CTA's consumers took is its producer's n-th claim (the last claim is the end marker).
    wait = collections.defaultdict(list)
    for cta in {t["cta"] for t in tiles}:
        cs = sorted((c for c in claims if c["cta"] == cta), key=lambda c: c["claim"])
        ts = sorted((t for t in tiles if t["cta"] == cta), key=lambda t: t["start"])
        for n, (c, t) in enumerate(zip(cs, ts)):
            wait[t["gemm"]].append((t["start"] - c["claim"]) / 1e3)
            if c["wait_cycles"] is not None:  # the producer's own cycles per k block of this tile
                kblocks = (hidden if t["gemm"] == 0 else inter) // stage_k
                wait[("pwait", t["gemm"])].append(c["wait_cycles"] / kblocks)
                wait[("pspan", t["gemm"])].append(c["span_cycles"] / kblocks)
            if n == 0:  # the CTA's first tile: decode cost, then the first loads' latency
                wait["decode"].append((c["issue"] - c["claim"]) / 1e3)
                wait["load"].append((t["start"] - c["issue"]) / 1e3)
    for gemm, name in ((0, "L1"), (1, "L2")):
        if wait[gemm]:
            out[name]["claim_to_first_stage_us_median"] = statistics.median(wait[gemm])
            print(f"{name}: claim -> first stage full: median {statistics.median(wait[gemm]):.1f}, "
                  f"max {max(wait[gemm]):.1f} µs")
        if wait[("pwait", gemm)]:
            out[name]["producer_span_per_kblock_median"] = statistics.median(wait[("pspan", gemm)])
            out[name]["producer_empty_wait_per_kblock_median"] = statistics.median(wait[("pwait", gemm)])
            print(f"{name}: weight producer (warp 0) cycles per k block (median): first to last stage issued "
                  f"{statistics.median(wait[('pspan', gemm)]):.0f}, of which waiting for free stages "
                  f"{statistics.median(wait[('pwait', gemm)]):.0f}")
    if wait["decode"]:
        out["first_tile_claim_to_issue_us_median"] = statistics.median(wait["decode"])
        out["first_tile_issue_to_full_us_median"] = statistics.median(wait["load"])
        print(f"first tile of each CTA: claim -> first weight load issued {statistics.median(wait['decode']):.1f} µs "
              f"(median), issued -> first stage full {statistics.median(wait['load']):.1f} µs")
    if "L1" in out and "L2" in out:
        print(f"L2 tiles whose first stage was full before L1's last end: "
              f"{sum(t['start'] - t0 < (out['L1']['last_end'] * 1e3) for t in tiles if t['gemm'] == 1)}")
    end = max(t["end"] for t in tiles)
    step = max(1, int((end - t0) / 1e3 / 40))
    busy = collections.Counter()
    for t in tiles:
        for b in range(int(us(t["start"])) // step, int(us(t["end"])) // step + 1):
            busy[(b, t["gemm"])] += 1
    print(f"CTAs inside a tile per {step} µs (L1 / L2):")
    print(" ".join(f"{b * step}:{busy[(b, 0)]}/{busy[(b, 1)]}" for b in range(int(us(end)) // step + 1)))
    out["end_us"] = us(end)
    print(f"last tile ends at {us(end):.1f} µs after the first claim")
    return out


def main() -> None:
    # The tile walk's traces: at one token MXFP4 w4a8 would otherwise take the GEMV path, which has no tiles.
    os.environ.setdefault("MEGAMOE_FP4_GEMV", "0")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="V4-Flash")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--no-flush", action="store_true", help="no L2 flush before the traced call (weights warm)")
    ap.add_argument("--graph", action="store_true", help="trace a CUDA-graph replay of the call (default: eager)")
    ap.add_argument("--format", default="fp8", choices=["fp8", "mxfp4", "nvfp4"], help="weight format")
    ap.add_argument("--act-format", default="fp8", choices=["fp8", "fp4"], help="activation format (FP4 weights)")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args.model, args.tokens, not args.no_flush, args.graph, args.format, args.act_format)
        return
    argv = [sys.executable, __file__, "--child", "--model", args.model, "--tokens", str(args.tokens),
            "--format", args.format, "--act-format", args.act_format]
    argv += (["--no-flush"] if args.no_flush else []) + (["--graph"] if args.graph else [])
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=HERE)
    if proc.returncode != 0:
        sys.exit(proc.stderr[-3000:])
    tiles, claims, entries, kernels, shape, walks = parse(proc.stdout.splitlines())
    if not tiles:
        sys.exit("no MMTRACE lines: build with MEGAMOE_NVCC_DEFINES=MEGAMOE_TILE_TRACE (see the header)")
    print(f"{args.model} {args.format} a{args.act_format} T={args.tokens}")
    out = summarize(tiles, claims, entries, shape)
    out["walk"] = walk_totals(walks, entries)
    if kernels:
        out["chain"] = chain(kernels, min(c["claim"] for c in claims))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, tokens=args.tokens, summary=out, tiles=tiles, claims=claims,
                           entries=entries), f)


if __name__ == "__main__":
    main()
