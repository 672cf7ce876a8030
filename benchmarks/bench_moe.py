"""Single-GPU fused expert layer vs the hardware floor and vs a peer pipeline, DeepSeek-V4 shapes.

    python benchmarks/bench_moe.py [--models V4-Flash,V4-Pro] [--tokens 1,16,...] [--formats fp8,mxfp4,nvfp4]
                                   [--act-formats fp8,fp4] [--json out.json] [--plot out.png]

For each (model, T): megamoe's time (CUDA-graph replay of pre_dispatch + fused op, L2 flushed clean — see
bench_utils.flush_l2; MEGAMOE_BENCH_FLUSH=dirty for the write-only flush — median), and
its time inside a graph of 8 such calls (event-record nodes around each: no graph launch per call, as in a
model whose step is one graph; `in_graph_us`);
the floor = max(touched experts' weight bytes / copy bandwidth, FLOPs / dense FP8 matmul rate), both
ceilings measured in this run; and a peer pipeline a user could write today with torch alone (routing by
argsort, torch._scaled_grouped_mm FP8 with row-wise scales, SwiGLU, index_add), also graph-replayed.
FP4 rows (MXFP4 / NVFP4 weights, w4a8 and w4a4): the floor counts the kernel layout's bytes per expert
(0.5 byte per weight plus scale bytes); their peer is this run's FP8 path (same shapes, same routing
distribution).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess

import torch

import megamoe

import bench_utils as bu

MODELS = {
    "V4-Flash": dict(num_experts=256, top_k=6, hidden=4096, intermediate=2048),
    "V4-Pro": dict(num_experts=384, top_k=6, hidden=7168, intermediate=3072),
}
TOKENS = (1, 16, 128, 512, 2048, 8192)


def time_in_graph(fn):
    """bu.time_in_graph, or None where this torch cannot time event-record nodes of a graph."""
    try:
        return bu.time_in_graph(fn)
    except RuntimeError as err:
        print(f"in-graph timing unavailable: {str(err).splitlines()[0]}")
        return None


def in_graph_fields(in_graph_us, floor_us):
    return dict(in_graph_us=None if in_graph_us is None else round(in_graph_us, 2),
                in_graph_over_floor=None if in_graph_us is None else round(in_graph_us / floor_us, 3))


# ------------------------------------------------------------------------------------------------
# Layer and routing
# ------------------------------------------------------------------------------------------------
def make_fp8_weights(num_experts, n, k, gen):
    """Checkpoint-layout FP8 block weights [E, n, k] + float32 [E, n/128, k/128], built expert by expert.

    NOTES: every 128-row block gets one scale for all its K blocks, so the peer's row-wise scaling reads
    the same weights as megamoe's block scaling (both compute the same layer; the benchmark reports the
    difference of their outputs, which then comes from activation rounding alone).
    """
    w = torch.empty(num_experts, n, k, dtype=torch.float8_e4m3fn, device="cuda")
    sf = torch.empty(num_experts, n // 128, k // 128, dtype=torch.float32, device="cuda")
    for e in range(num_experts):
        master = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).view(n // 128, 128, k)
        scale = master.abs().amax(dim=(1, 2)).clamp_min(1e-4) / 448.0
        w[e] = (master / scale[:, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(n, k)
        sf[e] = scale[:, None].expand(n // 128, k // 128)
    return w, sf


def make_layer(cfg, gen):
    e, h, i = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
    w13, sf13 = make_fp8_weights(e, 2 * i, h, gen)
    l1 = megamoe.transform_weights(w13, sf13, weight_format="fp8", is_l1=True)
    del w13, sf13
    w2, sf2 = make_fp8_weights(e, h, i, gen)
    l2 = megamoe.transform_weights(w2, sf2, weight_format="fp8", is_l1=False)
    del w2, sf2
    return l1, l2


def make_fp4_layer(cfg, weight_format, gen):
    """Random FP4 layer (checkpoint layout built expert by expert, then kernel layout)."""
    from megamoe import reference
    e, h, i = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]

    def one(n, k, is_l1):
        w, sf, g = reference.make_fp4_expert_weights(e, n, k, weight_format, generator=gen, device="cuda")
        return megamoe.transform_weights(w, sf, g, weight_format=weight_format, is_l1=is_l1)

    return one(2 * i, h, True), one(h, i, False)


def kernel_bytes_per_expert(l1, l2):
    """Bytes one expert's kernel-layout weights and scales occupy (what a decode step streams)."""
    return sum(t[0].numel() * t.element_size() for t in (*l1, *l2) if t is not None and t.dim() > 0)


def make_routing(num_tokens, num_experts, top_k, gen):
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=gen)
    weights, idx = scores.topk(top_k, dim=1)
    return idx.to(torch.int64), torch.softmax(weights, dim=1).float()


# ------------------------------------------------------------------------------------------------
# Peer: torch routing + torch._scaled_grouped_mm (row-wise FP8) + SwiGLU + index_add
# ------------------------------------------------------------------------------------------------
class PeerPipeline:
    """Reads the same FP8 weight bytes (kernel layout: L1 gate/up rows interleaved by 64, which the
    peer's SwiGLU undoes with a view) with one float32 scale per output row."""

    def __init__(self, l1, l2, cfg):
        self.e, self.k = cfg["num_experts"], cfg["top_k"]
        self.inter = cfg["intermediate"]
        self.w13t = l1[0].transpose(1, 2)  # [E, H, 2I], column-major as _scaled_grouped_mm wants
        self.w2t = l2[0].transpose(1, 2)   # [E, I, H]
        self.s13 = l1[1][:, :, 0].repeat_interleave(64, dim=1).contiguous()  # [E, 2I]
        self.s2 = l2[1][:, :, 0].repeat_interleave(64, dim=1).contiguous()   # [E, H]

    @staticmethod
    def _quant_rows(t):
        scale = t.abs().amax(dim=1).float().clamp_min(1e-4) / 448.0
        return (t.float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale

    def __call__(self, x, idx, weights, y):
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        tokens = order // self.k
        xq, xs = self._quant_rows(x[tokens])
        h = torch._scaled_grouped_mm(xq, self.w13t, scale_a=xs, scale_b=self.s13, offs=offs, out_dtype=torch.bfloat16)
        h = h.view(-1, self.inter // 64, 2, 64)
        g, u = h[:, :, 0].reshape(-1, self.inter).float(), h[:, :, 1].reshape(-1, self.inter).float()
        a = torch.nn.functional.silu(g) * u * weights.flatten()[order][:, None]
        aq, as_ = self._quant_rows(a)
        o = torch._scaled_grouped_mm(aq, self.w2t, scale_a=as_, scale_b=self.s2, offs=offs, out_dtype=torch.bfloat16)
        y.zero_()
        y.index_add_(0, tokens, o)


# ------------------------------------------------------------------------------------------------
def run_fp4(models, tokens, ceilings, formats_, act_formats, fp8_rows):
    """FP4 weights (w4a8, w4a4) vs the floor at 0.5 byte per weight plus scale bytes; the peer is this
    run's FP8 path on the same shape and routing (FP4 decode should take ~0.55x its time)."""
    rows = []
    fp8_us = {(r["model"], r["tokens_per_rank"]): r["us"] for r in fp8_rows}
    for name in models:
        cfg = MODELS[name]
        e, k, h, i = cfg["num_experts"], cfg["top_k"], cfg["hidden"], cfg["intermediate"]
        for fmt in formats_:
            gen = torch.Generator(device="cuda")
            gen.manual_seed(1)
            l1, l2 = make_fp4_layer(cfg, fmt, gen)
            expert_bytes = kernel_bytes_per_expert(l1, l2)
            for act in act_formats:
                for t in tokens:
                    rgen = torch.Generator(device="cuda")
                    rgen.manual_seed(t)  # uniform random routing, as the FP8 rows (same distribution)
                    x = torch.randn(t, h, device="cuda", generator=rgen).bfloat16()
                    idx, w = make_routing(t, e, k, rgen)
                    buf = megamoe.get_symm_buffer(None, e, t, k, h, i, act_format=act)
                    y = torch.empty_like(x)

                    def ours():
                        megamoe.pre_dispatch(x, idx, w, buf, weight_format=fmt)
                        megamoe.fp8_fp4_mega_moe(y, l1, l2, buf, weight_format=fmt)

                    try:
                        us = bu.time_graph(ours)
                        in_graph_us = time_in_graph(ours)
                    except NotImplementedError as err:
                        print(f"{name} {fmt} act {act}: {str(err).splitlines()[0]}")
                        break
                    touched = torch.unique(idx).numel()
                    nbytes = touched * expert_bytes
                    flops = 2 * t * k * 3 * i * h
                    floor_us = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["fp8_flops_per_s"]) * 1e6
                    peer_us = fp8_us.get((name, t))
                    rows.append(dict(op="fp8_fp4_mega_moe", format=fmt, act_format=act, model=name, ranks=1,
                                     tokens_per_rank=t, us=round(us, 2), floor_us=round(floor_us, 2),
                                     time_over_floor=round(us / floor_us, 3), peer="megamoe fp8_mega_moe",
                                     peer_us=peer_us, speedup=None if peer_us is None else round(peer_us / us, 3),
                                     tflops=round(flops / us / 1e6, 1), gbps=round(nbytes / us / 1e3, 1),
                                     touched_experts=touched, **in_graph_fields(in_graph_us, floor_us)))
                    r = rows[-1]
                    print(f"{name:9s} {fmt:5s} a{act:3s} T={t:5d} | {us:9.1f} us | floor {floor_us:9.1f} us | "
                          f"x{r['time_over_floor']:5.2f} | vs fp8 {r['speedup'] or float('nan'):5.2f} | "
                          f"{r['gbps']:7.1f} GB/s | in graph x{r['in_graph_over_floor'] or float('nan'):5.2f}",
                          flush=True)
                    del buf
            del l1, l2
            torch.cuda.empty_cache()
    return rows


def run(models, tokens, ceilings, with_peer=True):
    rows = []
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for name in models:
        cfg = MODELS[name]
        e, k, h, i = cfg["num_experts"], cfg["top_k"], cfg["hidden"], cfg["intermediate"]
        l1, l2 = make_layer(cfg, gen)
        peer = PeerPipeline(l1, l2, cfg) if with_peer else None
        expert_bytes = 3 * i * h + (l1[1][0].numel() + l2[1][0].numel()) * 4
        for t in tokens:
            x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
            idx, w = make_routing(t, e, k, gen)
            buf = megamoe.get_symm_buffer(None, e, t, k, h, i)
            y = torch.empty_like(x)

            def ours():
                megamoe.pre_dispatch(x, idx, w, buf)
                megamoe.fp8_mega_moe(y, l1, l2, buf)

            us = bu.time_graph(ours)
            in_graph_us = time_in_graph(ours)
            eager_us = bu.time_events(ours, warmup=100) if t == 1 else None  # after captures: see bench_utils.warm
            y_ours = y.clone()
            y_peer = torch.empty_like(x)
            peer_us, diff = None, None
            if peer is not None:
                try:
                    peer_us = bu.time_graph(lambda: peer(x, idx, w, y_peer))
                    diff = ((y_peer.double() - y_ours.double()).norm() / y_ours.double().norm()).item()
                except (RuntimeError, NotImplementedError) as err:  # peer op missing on this torch/GPU
                    print(f"peer unavailable: {err}")
            touched = torch.unique(idx).numel()
            nbytes = touched * expert_bytes
            flops = 2 * t * k * 3 * i * h
            floor_us = max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["fp8_flops_per_s"]) * 1e6
            rows.append(dict(op="fp8_mega_moe", format="fp8", act_format="fp8", model=name, ranks=1,
                             tokens_per_rank=t, us=round(us, 2), floor_us=round(floor_us, 2),
                             time_over_floor=round(us / floor_us, 3), peer="torch._scaled_grouped_mm",
                             peer_us=None if peer_us is None else round(peer_us, 2),
                             speedup=None if peer_us is None else round(peer_us / us, 3),
                             tflops=round(flops / us / 1e6, 1), gbps=round(nbytes / us / 1e3, 1),
                             eager_us=None if eager_us is None else round(eager_us, 2),
                             peer_rel_diff=None if diff is None else round(diff, 4), touched_experts=touched,
                             **in_graph_fields(in_graph_us, floor_us)))
            r = rows[-1]
            print(f"{name:9s} T={t:5d} | {us:9.1f} us | floor {floor_us:9.1f} us | x{r['time_over_floor']:5.2f} | "
                  f"peer {r['peer_us'] or float('nan'):9.1f} us | speedup {r['speedup'] or float('nan'):5.2f} | "
                  f"{r['tflops']:6.1f} TFLOP/s | {r['gbps']:7.1f} GB/s | in graph x{r['in_graph_over_floor'] or float('nan'):5.2f}" +
                  (f" | eager {eager_us:.1f} us" if eager_us else ""), flush=True)
            del buf
        del l1, l2, peer
        torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key in sorted({(r["model"], r["format"], r["act_format"]) for r in rows}):
        rs = [r for r in rows if (r["model"], r["format"], r["act_format"]) == key]
        ts = [r["tokens_per_rank"] for r in rs]
        label = f"{key[0]} {key[1]}" + (f" a{key[2]}" if key[1] != "fp8" else "")
        axes[0].plot(ts, [r["time_over_floor"] for r in rs], marker="o", label=label)
        axes[1].plot(ts, [r["speedup"] or float("nan") for r in rs], marker="o", label=label)
    axes[0].set(xscale="log", xlabel="tokens", ylabel="time / floor", title="megamoe vs hardware floor")
    axes[1].set(xscale="log", xlabel="tokens", ylabel="speedup",
                title="vs peer (FP8: torch._scaled_grouped_mm; FP4: megamoe FP8)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="V4-Flash,V4-Pro")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--formats", default="fp8", help="comma list of fp8, mxfp4, nvfp4")
    ap.add_argument("--act-formats", default="fp8,fp4", help="activation formats of the FP4 rows")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--no-peer", action="store_true", help="skip the peer pipeline (A/B runs of megamoe versions)")
    args = ap.parse_args()
    # The floor takes the short matmul figure (as since the first bench); the sustained one, at the board's power
    # limit, is reported beside it (bench_utils.measure_fp8_matmul_flops).
    ceilings = {"copy_bytes_per_s": bu.measure_copy_bandwidth(), "fp8_flops_per_s": bu.measure_fp8_matmul_flops(),
                "fp8_flops_per_s_sustained": bu.measure_fp8_matmul_flops(sustained_ms=1000.0)}
    print(f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), "
          f"FP8 matmul {ceilings['fp8_flops_per_s'] / 1e12:.0f} TFLOP/s "
          f"({ceilings['fp8_flops_per_s_sustained'] / 1e12:.0f} sustained, not in the floor)")
    models, tokens = args.models.split(","), [int(t) for t in args.tokens.split(",")]
    formats_ = args.formats.split(",")
    rows = run(models, tokens, ceilings, with_peer=not args.no_peer) if "fp8" in formats_ else []
    fp4 = [f for f in formats_ if f != "fp8"]
    if fp4:
        rows += run_fp4(models, tokens, ceilings, fp4, args.act_formats.split(","), rows)
    commit = os.environ.get("MEGAMOE_COMMIT")  # the device copy of the tree carries no .git
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(__file__)).stdout.strip() or None
        except OSError:
            commit = None
    result = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "commit": commit, "l2_flush": bu.l2_flush_mode(), "ceilings": ceilings,
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
