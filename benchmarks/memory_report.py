"""What a megamoe layer holds in GPU memory, computed on the CPU (no GPU needed):

- each weight format's kernel-layout bytes per expert (`transform_weights` of one random expert, L1 + L2, weights and
  every scale: what the GPU keeps and what a decode step streams per touched expert), against FP8's;
- the per-rank buffer (`get_buffer_layout`'s total) for FP8 and FP4 activations at DeepSeek-V4 shapes, per
  max_tokens_per_rank and number of ranks;
- the workspace an NVFP4-activation (w4a4) call allocates beside the buffer: L1's float32 outputs, whose per-row
  global scale needs the whole row before L2's quantization (cuda_fp4_ops.cpp).

    python benchmarks/memory_report.py [--models V4-Flash,V4-Pro] [--tokens 128,512,2048,8192] [--ranks 1,8]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import megamoe
from megamoe import reference
from megamoe.buffer import buffer_layout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import MODELS  # noqa: E402  (the DeepSeek-V4 shapes; imports on a machine without a GPU)
WEIGHT_FORMATS = ("fp8", "mxfp4", "nvfp4")


def one_expert(n: int, k: int, weight_format: str, is_l1: bool, gen: torch.Generator) -> int:
    """Kernel-layout bytes of one random expert's [n, k] weight (all of transform_weights' outputs)."""
    if weight_format == "fp8":
        w = (torch.randn(1, n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        out = megamoe.transform_weights(w, torch.ones(1, n // 128, k // 128), weight_format="fp8", is_l1=is_l1)
    else:
        w, sf, g = reference.make_fp4_expert_weights(1, n, k, weight_format, generator=gen)
        out = megamoe.transform_weights(w, sf, g, weight_format=weight_format, is_l1=is_l1)
    return sum(t.numel() * t.element_size() for t in out if t is not None)


def bytes_per_expert(cfg: dict, weight_format: str, seed: int = 0) -> int:
    gen = torch.Generator().manual_seed(seed)
    h, i = cfg["hidden"], cfg["intermediate"]
    return one_expert(2 * i, h, weight_format, True, gen) + one_expert(h, i, weight_format, False, gen)


def buffer_bytes(cfg: dict, num_ranks: int, max_tokens_per_rank: int, act_format: str) -> int:
    return buffer_layout(cfg["num_experts"], num_ranks, max_tokens_per_rank, cfg["top_k"], cfg["hidden"],
                         cfg["intermediate"], act_format)["total_bytes"]


def nvfp4_act_workspace_bytes(cfg: dict, num_ranks: int, max_tokens_per_rank: int) -> int:
    """Bytes of the float32 [rows, intermediate] workspace of a w4a4 NVFP4 call with max_tokens_per_rank tokens: at one
    rank its tokens x top_k rows; with peers the buffer's pool_rows (every rank's tokens could come to this one, and
    the host does not read how many did)."""
    if num_ranks == 1:
        rows = max(max_tokens_per_rank * cfg["top_k"], 1)
    else:
        rows = buffer_layout(cfg["num_experts"], num_ranks, max_tokens_per_rank, cfg["top_k"], cfg["hidden"],
                             cfg["intermediate"], "fp4")["pool_rows"]
    return rows * cfg["intermediate"] * 4


def report(models: dict, tokens, ranks) -> dict:
    weights, buffers = [], []
    for name, cfg in models.items():
        fp8 = bytes_per_expert(cfg, "fp8")
        for fmt in WEIGHT_FORMATS:
            b = fp8 if fmt == "fp8" else bytes_per_expert(cfg, fmt)
            weights.append(dict(model=name, weight_format=fmt, bytes_per_expert=b, vs_fp8=round(b / fp8, 4),
                                layer_bytes=b * cfg["num_experts"]))
        for r in ranks:
            for t in tokens:
                row = dict(model=name, num_ranks=r, max_tokens_per_rank=t)
                for act in ("fp8", "fp4"):
                    row[f"{act}_bytes"] = buffer_bytes(cfg, r, t, act)
                row["fp4_vs_fp8"] = round(row["fp4_bytes"] / row["fp8_bytes"], 4)
                row["nvfp4_act_workspace_bytes"] = nvfp4_act_workspace_bytes(cfg, r, t)
                buffers.append(row)
    return dict(weights=weights, buffers=buffers)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="V4-Flash,V4-Pro")
    ap.add_argument("--tokens", default="128,512,2048,8192")
    ap.add_argument("--ranks", default="1,8")
    ap.add_argument("--json")
    args = ap.parse_args()
    models = {m: MODELS[m] for m in args.models.split(",")}
    doc = report(models, [int(t) for t in args.tokens.split(",")], [int(r) for r in args.ranks.split(",")])
    mb = 1 << 20
    print("| model | weights | MiB per expert (L1 + L2, kernel layout with scales) | vs FP8 | GiB per layer |")
    print("|---|---|---|---|---|")
    for w in doc["weights"]:
        print(f"| {w['model']} | {w['weight_format']} | {w['bytes_per_expert'] / mb:.2f} | {w['vs_fp8']:.3f} | "
              f"{w['layer_bytes'] / (1 << 30):.2f} |")
    print()
    print("| model | ranks | max tokens per rank | buffer MiB per rank, FP8 activations | FP4 activations | FP4 / FP8 "
          "| NVFP4 w4a4 call's workspace MiB (beside the buffer) |")
    print("|---|---|---|---|---|---|---|")
    for b in doc["buffers"]:
        print(f"| {b['model']} | {b['num_ranks']} | {b['max_tokens_per_rank']} | {b['fp8_bytes'] / mb:,.1f} | "
              f"{b['fp4_bytes'] / mb:,.1f} | {b['fp4_vs_fp8']:.3f} | {b['nvfp4_act_workspace_bytes'] / mb:,.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
