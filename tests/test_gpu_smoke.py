"""First GPU checks of the sm90 FP8 path (pre_dispatch bitwise vs CPU; fused op vs the reference)."""
import pytest
import torch

import megamoe
from megamoe import reference as R

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _case(E, H, I, K, T, seed, fmt="fp8", act="fp8", masked=0.1, max_tokens=None):
    layer = R.make_random_layer(E, H, I, fmt, seed=seed, device="cuda")
    idx, w = R.make_random_routing(T, E, K, masked_fraction=masked, seed=seed + 1, device="cuda")
    x = torch.randn(T, H, device="cuda").bfloat16()
    l1 = megamoe.transform_weights(layer["w13"], layer["w13_sf"], layer["w13_global_sf"], weight_format=fmt, is_l1=True)
    l2 = megamoe.transform_weights(layer["w2"], layer["w2_sf"], layer["w2_global_sf"], weight_format=fmt, is_l1=False)
    buf = megamoe.get_symm_buffer(None, E, max_tokens or max(T, 1), K, H, I, act_format=act, device="cuda")
    return layer, idx, w, x, l1, l2, buf


@pytest.mark.parametrize("fmt,act", [("fp8", "fp8"), ("mxfp4", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp8"), ("nvfp4", "fp4")])
def test_pre_dispatch_cuda_matches_cpu_bitwise(fmt, act):
    E, H, I, K, T = 8, 512, 256, 3, 37
    layer, idx, w, x, l1, l2, buf = _case(E, H, I, K, T, 3, fmt, act)
    megamoe.pre_dispatch(x, idx, w, buf, weight_format=fmt)
    cpu_buf = megamoe.get_symm_buffer(None, E, max(T, 1), K, H, I, act_format=act, device="cpu")
    megamoe.pre_dispatch(x.cpu(), idx.cpu(), w.cpu(), cpu_buf, weight_format=fmt)
    lay = buf.layout
    end = lay["pool_src_offset"]
    assert torch.equal(buf.buffer[:end].cpu(), cpu_buf.buffer[:end])


@pytest.mark.parametrize("E,H,I,K,T", [(8, 256, 384, 3, 1), (8, 256, 384, 3, 7), (8, 256, 384, 3, 333),
                                       (16, 384, 256, 4, 64), (32, 1024, 512, 6, 200)])
def test_fp8_mega_moe_matches_reference(E, H, I, K, T):
    layer, idx, w, x, l1, l2, buf = _case(E, H, I, K, T, 11)
    y = torch.full_like(x, float("nan"))
    megamoe.pre_dispatch(x, idx, w, buf)
    megamoe.fp8_mega_moe(y, l1, l2, buf)
    ref = R.mega_moe(x, idx, w, layer["w13"], layer["w2"], weight_format="fp8", act_format="fp8",
                     w13_sf=layer["w13_sf"], w2_sf=layer["w2_sf"])
    assert torch.isfinite(y).all()
    err = ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert err <= 1e-2, err
