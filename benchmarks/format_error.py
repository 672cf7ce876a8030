"""Each format's own error: the emulating reference of a (weight format, activation format) pair vs plain
BF16 model math (bf16 master weights, no activation quantization), on the same random layer and tokens.

    python benchmarks/format_error.py [--experts 32 --hidden 1024 --intermediate 512 --tokens 256]

This measures the formats, not the kernels: the kernels match the emulating reference to ~1e-4 (the GPU
tests bound it by 1e-2). Runs on the CPU in a minute; on a GPU if one is present.
"""
from __future__ import annotations

import argparse

import torch

from megamoe import reference

PAIRS = (("fp8", "fp8"), ("mxfp4", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp8"), ("nvfp4", "fp4"))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def layer_arguments() -> argparse.ArgumentParser:
    """The layer and batch options of the format error studies (this script, fold_error.py)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--seeds", type=int, default=3)
    return ap


def main():
    args = layer_arguments().parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    e, h, i, k, t = args.experts, args.hidden, args.intermediate, args.top_k, args.tokens
    print(f"E={e} H={h} I={i} top-k={k} T={t}, {args.seeds} seeds, device {device}")
    errs = {p: [] for p in PAIRS}
    for seed in range(args.seeds):
        idx, w = reference.make_random_routing(t, e, k, seed=seed + 100, device=device)
        x = (torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 200))).to(device, torch.bfloat16)
        base = None
        for wf, af in PAIRS:
            layer = reference.make_random_layer(e, h, i, wf, seed=seed, device=device)
            if base is None:  # the masters depend on the seed only, not on the format
                base = reference.mega_moe(x, idx, w, layer["w13_bf16"], layer["w2_bf16"], weight_format="bf16",
                                          act_format="none")
            y = reference.mega_moe(x, idx, w, layer["w13"], layer["w2"], weight_format=wf, act_format=af,
                                   w13_sf=layer["w13_sf"], w2_sf=layer["w2_sf"],
                                   w13_global_sf=layer["w13_global_sf"], w2_global_sf=layer["w2_global_sf"])
            errs[(wf, af)].append(rel_err(y, base))
    print("| weights | activations | rel. error vs BF16 math (mean over seeds) |")
    print("|---|---|---|")
    for (wf, af), v in errs.items():
        print(f"| {wf} | {af} | {sum(v) / len(v):.2e} |")


if __name__ == "__main__":
    main()
