"""Numerics of the planned FP4 GEMV path (T=1, one rank; docs/plans/fp4-gemv.md, open question "fp16 range"): the
error that fp16 block sums add to an MXFP4 w4a8 dot product, against float64, next to the bf16 rounding that every
FP4 path applies to L1's outputs anyway.

A 32-K block's sum is computed three ways (weights e2m1 codes, tokens E4M3 codes; both blocks' UE8M0 scales applied
per block in float32, blocks accumulated in float32 in K order):
- fp32: the block's 32 products (exact in float32) summed in float32 (FFMA per weight).
- fp16: weights decoded as e2m1 x 2^-14 (the exponent trick: the nibble's magnitude at fp16 bits 9-11, exact), tokens
  as fp16 (exact for E4M3), each product added into an fp16 accumulator with one rounding (HFMA2: two lanes of 16
  products each, the pairs (p, p + 4) of a 32-bit word as the kernel's e2m1x2 decode pairs them), the two lanes
  summed in float32, then x 2^14 and the blocks' scales.
- bf16 of the float64 sum: what L1's epilogue rounds every output to (a floor on the useful precision).
Data: weights from N(0, 1) rows with per-row spread, quantized by megamoe.formats.quantize_mxfp4; tokens N(0, 1) with
a few outlier channels x 30, quantized by quantize_fp8_ue8m0. Prints ||out - ref|| / ||ref|| (the tests' rel_err) and
the largest row's error over the outputs' RMS (a row's own relative error is unbounded where its sum cancels), per
path.

    python3 docs/models/fp4_gemv_numerics.py [--rows 2048] [--k 4096] [--seed 0]
"""
from __future__ import annotations

import argparse

import torch

from megamoe import formats


def block_sums_fp16(w_codes: torch.Tensor, q_tok: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, 32] e2m1 values and [blocks, 32] E4M3 values -> [rows, blocks] float32 block sums through
    two fp16 accumulators per block (one rounding per add; the product is exact in float32)."""
    w16 = (w_codes * 2.0**-14).to(torch.float16)  # exact: e2m1 x 2^-14 (down to 2^-15, an fp16 subnormal)
    assert torch.equal(w16.to(torch.float32), w_codes * 2.0**-14)
    x16 = q_tok.to(torch.float16)
    assert torch.equal(x16.to(torch.float32), q_tok)
    # Word s of the block holds K 8s .. 8s + 7; pair p of a word takes nibbles p and p + 4: lane 0 accumulates the
    # low nibbles (K 8s + p), lane 1 the high ones (K 8s + 4 + p), p = 0..3, s = 0..3: 16 adds per lane.
    idx = torch.arange(32).view(4, 2, 4)  # [s][lane][p] -> K
    order0, order1 = idx[:, 0, :].reshape(-1), idx[:, 1, :].reshape(-1)
    acc = [torch.zeros(w16.shape[:-1], dtype=torch.float16) for _ in range(2)]
    for lane, order in enumerate((order0, order1)):
        for k in order.tolist():
            prod = w16[..., k].to(torch.float32) * x16[..., k].to(torch.float32)  # exact in float32
            acc[lane] = (acc[lane].to(torch.float32) + prod).to(torch.float16)
    return (acc[0].to(torch.float32) + acc[1].to(torch.float32)) * 2.0**14


def errors(rows: int, k: int, seed: int) -> dict[str, tuple[float, float]]:
    """Per path: (rel_err against the float64 dot products, the largest row's error over the outputs' RMS)."""
    g = torch.Generator().manual_seed(seed)
    nb = k // 32
    w = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 0.5) * 0.02
    packed, wsf = formats.quantize_mxfp4(w)
    w_codes = formats.dequantize_mxfp4(packed, torch.full_like(wsf, 127))  # e2m1 values (scale 1)
    w_scale = formats.ue8m0_to_float(wsf)  # [rows, nb]

    x = torch.randn(k, generator=g)
    x[torch.randperm(k, generator=g)[:8]] *= 30.0
    q, xsf = formats.quantize_fp8_ue8m0(x.to(torch.bfloat16).to(torch.float32))
    q_tok = q.to(torch.float32)
    x_scale = formats.ue8m0_to_float(xsf)  # [nb]

    wb, qb = w_codes.view(rows, nb, 32), q_tok.view(nb, 32)
    scale = w_scale * x_scale  # [rows, nb]
    ref = ((wb.double() * qb.double()).sum(-1) * scale.double()).sum(-1)

    def accumulate(block: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows, dtype=torch.float32)
        for b in range(nb):  # K order, float32
            out = out + block[:, b] * scale[:, b]
        return out

    paths = {
        "fp32 block sums (FFMA)": accumulate((wb * qb).sum(-1)),
        "fp16 block sums (HFMA2)": accumulate(block_sums_fp16(wb, qb)),
        "bf16 rounding of the exact sum": ref.to(torch.bfloat16).double(),
    }
    result = {}
    for name, out in paths.items():
        d = out.double() - ref
        result[name] = ((d.norm() / ref.norm()).item(), (d.abs().max() / ref.pow(2).mean().sqrt()).item())
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"rows {args.rows}, K {args.k}: error against the float64 dot products")
    for name, (rel, worst) in errors(args.rows, args.k, args.seed).items():
        print(f"  {name:32s} rel_err {rel:.2e}   largest row error / outputs' RMS {worst:.2e}")


if __name__ == "__main__":
    main()
