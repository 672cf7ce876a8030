"""Do the GPU's BF16 tensor-core MMAs take subnormal bf16 operands exactly? (H100: cuBLAS runs wgmmas for these.)

The question behind it (docs/perf-notes.md, fifty-seventh session): NVFP4 weights could enter a BF16 wgmma as the raw
E2M1 bit placement alone (e2m1 x 2^-126: codes 0 and 1 are bf16 subnormals) if their UE4M3 block scales were applied
after the MMA; that needs subnormal A operands multiplied exactly, not flushed to zero. Each case fills A with one
subnormal (or the smallest normal, as a control) and B with 2^100, so every product is a normal float32 and every
dot product an exact power-of-two multiple: any flush or rounding shows as `exact=False`.

    python3 benchmarks/probe_bf16_subnormal.py   (GPU only; a few seconds)
"""
from __future__ import annotations

import torch


def main() -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print(torch.cuda.get_device_name())
    for value in (2.0 ** -127, 2.0 ** -133, 3 * 2.0 ** -128, 2.0 ** -126):  # 2^-126: the smallest normal (control)
        for m, n, k in ((256, 256, 64), (64, 16, 4096), (4096, 16, 4096)):
            a = torch.full((m, k), value, dtype=torch.bfloat16, device="cuda")
            assert a.float()[0, 0].item() == value, "not a bf16 value"
            b = torch.full((k, n), 2.0 ** 100, dtype=torch.bfloat16, device="cuda")
            c = (a @ b).float()
            want = k * value * 2.0 ** 100
            print(f"a={value:.3e} (bits {a.view(torch.int16)[0, 0].item():#06x}) m,n,k={m},{n},{k}: "
                  f"got {c[0, 0].item():.6e} want {want:.6e} exact={bool((c == want).all())}")


if __name__ == "__main__":
    main()
