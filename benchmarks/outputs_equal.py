"""Bitwise comparison of the op's outputs between two source trees (a kernel change that keeps the arithmetic).

    cd TREE_A && python benchmarks/outputs_equal.py save /tmp/a.pt --cases nvfp4:fp4:V4-Flash:16,...
    cd TREE_B && python benchmarks/outputs_equal.py check /tmp/a.pt

`save` runs each case (format:act_format:model:tokens; seeded inputs and layers, built the same way in every tree)
and stores y; `check` reruns the stored cases in this tree and prints, per case, whether y is bitwise equal (exit
status 1 if any differs or holds a NaN: y starts as NaN, so two trees that never wrote it would otherwise agree).
Tests compare against the reference within a tolerance; this says that a change meant to keep every operation (the
same values in the same order) did.
"""
from __future__ import annotations

import argparse
import sys

import torch

import megamoe
import bench_moe as bm
import bench_utils as bu


def run_case(spec: str) -> torch.Tensor:
    fmt, act, model, t = spec.split(":")
    cfg = bm.MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    l1, l2 = bm.make_layer(cfg, gen) if fmt == "fp8" else bm.make_fp4_layer(cfg, fmt, gen)
    e, k, h, i = cfg["num_experts"], cfg["top_k"], cfg["hidden"], cfg["intermediate"]
    t = int(t)
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    idx, w = bm.make_routing(t, e, k, gen)
    buf = megamoe.get_symm_buffer(None, e, t, k, h, i, act_format=act)
    y = torch.full_like(x, float("nan"))
    bu.moe_step(x, idx, w, y, l1, l2, buf, fmt)()
    torch.cuda.synchronize()
    return y.cpu()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "check"])
    ap.add_argument("path")
    ap.add_argument("--cases", default="nvfp4:fp4:V4-Flash:16")
    args = ap.parse_args()
    if args.mode == "save":
        torch.save({c: run_case(c) for c in args.cases.split(",")}, args.path)
        return 0
    saved = torch.load(args.path)
    bad = 0
    for c, y0 in saved.items():
        y = run_case(c)
        same = torch.equal(y.view(torch.int16), y0.view(torch.int16))
        nan = int(y.isnan().sum())  # the inputs are finite: a NaN is an output the op never wrote
        bad += not same or nan > 0
        d = (y.float() - y0.float()).norm() / y0.float().norm().clamp_min(1e-30)
        diff = "" if same else f" (relative difference {float(d):.2e})"
        print(f"{c}: {'bitwise equal' if same else 'DIFFERENT'}{diff}{'' if nan == 0 else f', {nan} NaN (FAIL)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
