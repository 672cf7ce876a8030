"""Error of an FP8-wgmma path for MXFP4 w4a8: per-32 power-of-two scales folded into E4M3 values per 128-K block.

    python benchmarks/fold_error.py [--experts 32 --hidden 1024 --intermediate 512 --tokens 256 --seeds 3]
                                    [--weight-fold 128 --weight-headroom 0]  (the kernels' fold until the thirtieth
                                                                              session; default: today's)
                                    [--token-fold 256,128]  (K per token fold exponent, L1's tokens and L2's; the
                                                             kernels': 128,128)

Hopper has FP8 tensor cores but no FP4 ones. E2M1 x 2^d is an E4M3 value for every E2M1 code when
0 <= d <= 8 (0.5 x 2^-8 = 2^-9 is E4M3's smallest subnormal), so an MXFP4 weight row can be decoded on chip to
E4M3 relative to the largest UE8M0 scale of its 128-K block, and promoted once per 128-K block with that
scale, exactly as the FP8 path promotes its 128 x 128 blocks. Only sub-blocks whose scale is more than 2^8
below the block's largest round (toward zero, by less than 2^-10 of the block's largest magnitude). The w4a8
activations (E4M3 with a UE8M0 scale per 32) can be folded the same way, but an E4M3 value divided by 2^d
keeps its 3 mantissa bits only down to 2^-6: small values in low-scale sub-blocks round.

Since the thirtieth session the kernels fold each weight row relative to its largest scale over the whole K minus 6
(transform_weights' row exponents): E2M1 x 2^d is exact in E4M3 for -8 <= d <= 6 (6 x 2^6 = 384 <= 448), so a row
whose scales span at most 14 binades folds exactly (--weight-fold 0 --weight-headroom 6, the defaults).

This script measures, on the CPU, what the folds change against the emulating reference (the semantics the
kernels must match within 1e-2), by running the reference with the folded values in place of the exact ones:
  weights   -- MXFP4 weights folded per (row, 128-K block); activations exact
  both      -- weights and both activation quantizations (tokens, L1 outputs) folded per (row, 128-K block)
and, as the scale, each format's own error vs BF16 math. Three families: the reference's random layer; the
same layer with UE8M0 scales spread over 2^0..2^(spread) within each 128-K block (--spread), the worst case
for the weight fold; and the random layer with outlier activation channels (--outlier-fraction of the hidden
channels, the same for every token as in LLM activations, scaled by --outlier-scale), the worst case for the
token fold: a 128-K block holding an outlier channel folds its other 32-blocks by about log2(scale).
Nothing here runs a kernel.
"""
from __future__ import annotations

from unittest import mock

import torch

from format_error import layer_arguments, rel_err
from megamoe import formats, reference

FOLD_BLOCK, SCALE_BLOCK = 128, 32


def fold_e4m3(v: torch.Tensor, scale32: torch.Tensor, block: int = FOLD_BLOCK, headroom: int = 0) -> torch.Tensor:
    """Values ``v`` [..., K] that carry a power-of-two scale per 32 (``scale32`` [..., K/32], float32),
    re-expressed as E4M3 relative to the largest scale of each ``block``-K block (0: the whole row) times
    2^-headroom (round to nearest even, the cvt.rn.satfinite of the kernel), times that."""
    k = v.shape[-1]
    block = block or k
    s = scale32.view(*scale32.shape[:-1], k // block, block // SCALE_BLOCK)
    big = s.amax(dim=-1, keepdim=True).repeat_interleave(block, dim=-1).view(*v.shape) * 2.0 ** -headroom
    return (v / big).to(torch.float8_e4m3fn).to(torch.float32) * big


_EXACT_ACTIVATION = reference.quantize_activation


def exact_activation(x: torch.Tensor, _recipe) -> torch.Tensor:
    """Drop-in for reference.quantize_activation: the w4a8 recipe whatever the call asks (the folded weights
    go through the reference's bf16 path, whose own recipe is "none")."""
    return _EXACT_ACTIVATION(x, "fp8_ue8m0_32")


TOKEN_FOLD = [FOLD_BLOCK, FOLD_BLOCK]  # --token-fold: K per token fold exponent, L1's tokens and L2's (the kernels')


def folded_activation(x: torch.Tensor, block: int) -> torch.Tensor:
    """reference.quantize_activation's w4a8 recipe (per-32 UE8M0), folded per ``block`` K (K % block == 0, or the
    last block shorter: the kernels' odd 128-K group count at 256)."""
    xf = x.to(torch.float32)
    q, sf = formats.quantize_fp8_ue8m0(xf, SCALE_BLOCK)
    scale = formats.ue8m0_to_float(sf)
    v = formats.dequantize_fp8(q, sf, SCALE_BLOCK)
    k = v.shape[-1]
    if k % block:  # the whole blocks, then the rest as one block
        cut = k - k % block
        return torch.cat([fold_e4m3(v[..., :cut], scale[..., :cut // SCALE_BLOCK], block),
                          fold_e4m3(v[..., cut:], scale[..., cut // SCALE_BLOCK:], k - cut)], dim=-1)
    return fold_e4m3(v, scale, block)


WEIGHT_FOLD = [0, 6]  # --weight-fold (0: one exponent per row for the whole K), --weight-headroom


def folded_weights(w: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """MXFP4 checkpoint weights [E, N, K/2] + UE8M0 [E, N, K/32] -> folded float32 [E, N, K]."""
    return fold_e4m3(formats.dequantize_mxfp4(w, sf), formats.ue8m0_to_float(sf), *WEIGHT_FOLD)


def gradient_scales(sf: torch.Tensor, spread: int) -> torch.Tensor:
    """The same scales lowered by 0..spread along K (linearly, the same for every row): the worst case of a fold
    relative to one exponent per row, harmless within a 128-K block."""
    drop = torch.round(torch.linspace(0, spread, sf.shape[-1])).to(torch.int32)
    return (sf.to(torch.int32) - drop).clamp(1, 254).to(torch.uint8)


def spread_scales(sf: torch.Tensor, spread: int, gen: torch.Generator) -> torch.Tensor:
    """The same scales with each 32-block's exponent lowered by 0..spread (uniform), per 128-K block."""
    drop = torch.randint(0, spread + 1, sf.shape, generator=gen, dtype=torch.int32)
    return (sf.to(torch.int32) - drop).clamp(1, 254).to(torch.uint8)


def run(layer: dict, x, idx, w, fold_w: bool, fold_act: bool) -> torch.Tensor:
    if not fold_w and not fold_act:
        return reference.mega_moe(x, idx, w, layer["w13"], layer["w2"], weight_format="mxfp4", act_format="fp8",
                                  w13_sf=layer["w13_sf"], w2_sf=layer["w2_sf"])
    if fold_w:  # float weights through the reference's bf16 path (dequantization = identity)
        w13, w2 = folded_weights(layer["w13"], layer["w13_sf"]), folded_weights(layer["w2"], layer["w2_sf"])
        kw = dict(weight_format="bf16", act_format="none")
    else:
        w13, w2 = layer["w13"], layer["w2"]
        kw = dict(weight_format="mxfp4", act_format="fp8", w13_sf=layer["w13_sf"], w2_sf=layer["w2_sf"])
    calls = []

    def folded(x, _recipe):  # the reference quantizes L1's tokens first, then L2's (per expert)
        block = TOKEN_FOLD[1 if calls else 0]
        calls.append(block)
        return folded_activation(x, block)

    act = folded if fold_act else exact_activation
    with mock.patch.object(reference, "quantize_activation", act):
        return reference.mega_moe(x, idx, w, w13, w2, **kw)


def main():
    ap = layer_arguments()
    ap.add_argument("--spread", type=int, default=12, help="largest exponent drop in the spread-scale family")
    ap.add_argument("--outlier-fraction", type=float, default=0.01, help="share of hidden channels that are outliers")
    ap.add_argument("--outlier-scale", type=float, default=100.0, help="their magnitude relative to the others")
    ap.add_argument("--weight-fold", type=int, default=WEIGHT_FOLD[0],
                    help="K per weight fold exponent (0: one per row for the whole K, the kernels'; 128: until the "
                         "thirtieth session)")
    ap.add_argument("--weight-headroom", type=int, default=WEIGHT_FOLD[1],
                    help="binades the folded weights may rise above E2M1's range (6: the kernels'; at most 6)")
    ap.add_argument("--token-fold", default=",".join(map(str, TOKEN_FOLD)),
                    help="K per token fold exponent, L1's tokens and L2's, each 128, 256 or 512 (the kernels': 128,128; "
                         "256 would halve L1's promotions: measured and rejected, docs/perf-notes.md, thirty-second "
                         "session)")
    args = ap.parse_args()
    folds = [int(v) for v in args.token_fold.split(",")]
    if len(folds) != 2 or any(v not in (128, 256, 512) for v in folds):
        ap.error(f"--token-fold: expected two of 128 / 256 / 512 (L1,L2), got {args.token_fold!r}")
    TOKEN_FOLD[:] = folds
    if not 0 <= args.weight_headroom <= 6:
        ap.error(f"--weight-headroom: expected 0 to 6 (6 x 2^6 = 384 <= 448, E4M3's largest), got {args.weight_headroom}")
    WEIGHT_FOLD[:] = [args.weight_fold, args.weight_headroom]
    e, h, i, k, t = args.experts, args.hidden, args.intermediate, args.top_k, args.tokens
    print(f"E={e} H={h} I={i} top-k={k} T={t}, {args.seeds} seeds, CPU; errors relative to the emulating reference; "
          f"weights folded per {args.weight_fold or 'row'} K (headroom 2^{args.weight_headroom}), activations per "
          f"{TOKEN_FOLD[0]} (L1) / {TOKEN_FOLD[1]} (L2) K")
    rows = []
    outliers = f"outlier channels ({args.outlier_fraction:.1%} x {args.outlier_scale:g})"
    gradient = f"K-gradient 0..{args.spread}"
    for family in ("random", f"spread 0..{args.spread}", gradient, outliers):
        errs = {"weights": [], "both": [], "format vs bf16": []}
        for seed in range(args.seeds):
            layer = reference.make_random_layer(e, h, i, "mxfp4", seed=seed)
            if family.startswith("spread"):
                gen = torch.Generator().manual_seed(seed + 300)
                layer["w13_sf"] = spread_scales(layer["w13_sf"], args.spread, gen)
                layer["w2_sf"] = spread_scales(layer["w2_sf"], args.spread, gen)
            if family == gradient:
                layer["w13_sf"] = gradient_scales(layer["w13_sf"], args.spread)
                layer["w2_sf"] = gradient_scales(layer["w2_sf"], args.spread)
            idx, w = reference.make_random_routing(t, e, k, seed=seed + 100)
            x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 200))
            if family == outliers:
                gen = torch.Generator().manual_seed(seed + 400)
                channels = torch.randperm(h, generator=gen)[:max(1, round(args.outlier_fraction * h))]
                x[:, channels] *= args.outlier_scale
            x = x.to(torch.bfloat16)
            ref = run(layer, x, idx, w, False, False)
            errs["weights"].append(rel_err(run(layer, x, idx, w, True, False), ref))
            errs["both"].append(rel_err(run(layer, x, idx, w, True, True), ref))
            if family == "random":
                base = reference.mega_moe(x, idx, w, layer["w13_bf16"], layer["w2_bf16"], weight_format="bf16",
                                          act_format="none")
                errs["format vs bf16"].append(rel_err(ref, base))
        rows.append((family, {n: max(v) if v else None for n, v in errs.items()}))
    print("| weights family | fold weights | fold weights + activations | MXFP4 w4a8 vs BF16 math |")
    print("|---|---|---|---|")
    for family, m in rows:
        fmt = lambda v: "-" if v is None else f"{v:.2e}"
        print(f"| {family} | {fmt(m['weights'])} | {fmt(m['both'])} | {fmt(m['format vs bf16'])} |")
    print("(max over seeds)")


if __name__ == "__main__":
    main()
