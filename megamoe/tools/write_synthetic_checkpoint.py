"""Write a small synthetic MoE-layer checkpoint (random experts) in a real checkpoint's naming.

    python -m megamoe.tools.write_synthetic_checkpoint --format fp8 --out /tmp/ckpt
    python -m megamoe.tools.write_synthetic_checkpoint --format nvfp4 --experts 16 --hidden 512 --out /tmp/nv

Weights are bf16 masters from :func:`megamoe.reference.make_random_layer` (seeded), quantized by
:mod:`megamoe.formats`, and stored per expert under the names
:func:`megamoe.load_experts_from_safetensors` reads:

- fp8 (DeepSeek release naming): ``{prefix}.experts.{e}.{w1,w2,w3}.weight`` float8_e4m3fn and ``.scale``
  float32 per 128x128 block;
- mxfp4 (DeepSeek release naming): ``.weight`` packed E2M1 uint8 and ``.scale`` float8_e8m0fnu per 1x32;
- nvfp4 (ModelOpt naming): ``.weight`` packed E2M1 uint8, ``.weight_scale`` float8_e4m3fn per 1x16,
  ``.weight_scale_2`` float32 scalar (shared by w1 and w3 of an expert), ``.input_scale`` float32 scalar
  (1.0; megamoe ignores it).

Files: ``model.safetensors`` (the experts), ``masters.safetensors`` (``{prefix}.experts.w13_bf16`` [E, 2I, H]
and ``{prefix}.experts.w2_bf16`` [E, H, I], with ``--masters``) and ``megamoe_synthetic.json`` (the
arguments). Needs the ``safetensors`` package.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

import torch

from megamoe import reference


def expert_tensors(layer: dict, weight_format: str, prefix: str) -> dict:
    """Checkpoint name -> tensor for every expert of ``layer`` (a make_random_layer dict)."""
    num_experts, n13 = layer["w13"].shape[:2]
    inter = n13 // 2
    scale_rows = inter // 128 if weight_format == "fp8" else inter
    out = {}
    for e in range(num_experts):
        parts = {
            "w1": (layer["w13"][e, :inter], layer["w13_sf"][e, :scale_rows]),
            "w3": (layer["w13"][e, inter:], layer["w13_sf"][e, scale_rows:]),
            "w2": (layer["w2"][e], layer["w2_sf"][e]),
        }
        for shard, (w, sf) in parts.items():
            base = f"{prefix}.experts.{e}.{shard}"
            out[f"{base}.weight"] = w.contiguous()
            if weight_format == "fp8":
                out[f"{base}.scale"] = sf.contiguous()
            elif weight_format == "mxfp4":
                out[f"{base}.scale"] = sf.contiguous().view(torch.float8_e8m0fnu)
            else:
                g = layer["w13_global_sf" if shard != "w2" else "w2_global_sf"][e]
                out[f"{base}.weight_scale"] = sf.contiguous()
                out[f"{base}.weight_scale_2"] = g.reshape(()).clone()
                out[f"{base}.input_scale"] = torch.ones((), dtype=torch.float32)
    return out


def write_synthetic_checkpoint(out_dir: str, weight_format: str, *, num_experts: int = 8, hidden: int = 256,
                               intermediate: int = 256, prefix: str = "layers.0.ffn", seed: int = 0,
                               masters: bool = False, layer: Optional[dict] = None) -> dict:
    """Writes the checkpoint into ``out_dir`` (created if needed) and returns the layer dict
    (``make_random_layer``'s, or ``layer`` if given)."""
    from safetensors.torch import save_file

    if weight_format not in ("fp8", "mxfp4", "nvfp4"):
        raise ValueError(f"weight_format: expected fp8, mxfp4 or nvfp4, got {weight_format!r}")
    if layer is None:
        layer = reference.make_random_layer(num_experts, hidden, intermediate, weight_format, seed=seed)
    os.makedirs(out_dir, exist_ok=True)
    save_file(expert_tensors(layer, weight_format, prefix), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt", "producer": "megamoe.tools.write_synthetic_checkpoint"})
    if masters:
        save_file({f"{prefix}.experts.w13_bf16": layer["w13_bf16"].contiguous(),
                   f"{prefix}.experts.w2_bf16": layer["w2_bf16"].contiguous()},
                  os.path.join(out_dir, "masters.safetensors"))
    info = {"weight_format": weight_format, "num_experts": num_experts, "hidden_size": hidden,
            "intermediate_size": intermediate, "prefix": prefix, "seed": seed}
    with open(os.path.join(out_dir, "megamoe_synthetic.json"), "w") as f:
        json.dump(info, f, indent=2)
    return layer


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", required=True, choices=["fp8", "mxfp4", "nvfp4"], help="expert weight format")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256, help="H, a multiple of 128")
    p.add_argument("--intermediate", type=int, default=256, help="I, a multiple of 128")
    p.add_argument("--prefix", default="layers.0.ffn", help="layer prefix of the tensor names")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--masters", action="store_true", help="also write the bf16 masters")
    a = p.parse_args(argv)
    write_synthetic_checkpoint(a.out, a.format, num_experts=a.experts, hidden=a.hidden, intermediate=a.intermediate,
                               prefix=a.prefix, seed=a.seed, masters=a.masters)
    print(f"wrote {a.format} layer '{a.prefix}' ({a.experts} experts, H={a.hidden}, I={a.intermediate}) to {a.out}")


if __name__ == "__main__":
    main()
