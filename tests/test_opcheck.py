"""Graph safety (DESIGN.md §5): torch.library.opcheck on every op and sample (schema, fake impl,
functionalization under AOT dispatch), and torch.compile(fullgraph=True) of a module calling megamoe.moe,
equal to eager, with static and dynamic token counts."""
import pytest
import torch

import megamoe
from conftest import COMBOS, devices, make_case, random_layer, requires_cuda

ops = torch.ops.megamoe
E, H, I, K = 8, 256, 256, 2
ALL_OK = {"test_schema": "SUCCESS", "test_autograd_registration": "SUCCESS", "test_faketensor": "SUCCESS",
          "test_aot_dispatch_dynamic": "SUCCESS"}
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


@pytest.fixture(autouse=True)
def float8_safe_schema_check(monkeypatch):
    """opcheck's test_schema compares every argument before/after the call with torch.allclose, which
    has no float8 kernel ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'), so any op taking
    FP8 weights or UE4M3 scales would fail there for torch's reason, not ours. Compare float8 tensors by
    their bytes instead (what "not mutated" means); every other dtype goes to the real allclose."""
    real_allclose = torch.allclose

    def allclose(a, b, *args, **kwargs):
        if isinstance(a, torch.Tensor) and a.dtype in _FLOAT8:
            return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return real_allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", allclose)


def opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert result == ALL_OK, result


def dispatched_case(weight_format, act_format, num_tokens, *, device="cpu", seed=0, idx_dtype=torch.int32):
    """A case whose buffer already holds pre_dispatch's result (what the fused ops read)."""
    c = make_case(E, H, I, K, num_tokens, weight_format, act_format, device=device, seed=seed,
                  idx_dtype=idx_dtype, max_tokens=max(num_tokens, 4), with_ref=False)
    megamoe.pre_dispatch(c.x, c.topk_idx, c.topk_weights, c.buffer, weight_format=weight_format)
    return c


def mega_moe_args(c, y, *, activation_clamp=None, recv_stats=None):
    b = c.buffer
    if c.weight_format == "fp8":
        return ops.fp8_mega_moe.default, (y, c.l1[0], c.l1[1], c.l2[0], c.l2[1], b.buffer, *b.config_args,
                                          activation_clamp, True, recv_stats)
    return ops.fp8_fp4_mega_moe.default, (y, *c.l1, *c.l2, b.buffer, *b.config_args, c.weight_format,
                                          c.act_format, activation_clamp, True, recv_stats)


# ------------------------------------------------------------------------------------------------
# opcheck, CPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [(8, 1, 4, 2, 256, 256, "fp8"), (8, 1, 0, 3, 256, 384, "fp4"),
                                 (16, 4, 33, 6, 512, 128, "fp8")])
def test_opcheck_get_buffer_layout(cfg):
    opcheck(ops.get_buffer_layout.default, cfg)
    out = ops.get_buffer_layout(*cfg)
    assert out.dtype == torch.int64 and out.shape == (len(megamoe.ops.BUFFER_LAYOUT_FIELDS),)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("is_l1", [True, False], ids=["l1", "l2"])
@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4", "nvfp4"])
def test_opcheck_transform_weights(weight_format, is_l1, device):
    lay = random_layer(E, H, I, weight_format, device=device)
    name = "w13" if is_l1 else "w2"
    opcheck(ops.transform_weights.default, (lay[name], lay[f"{name}_sf"], lay[f"{name}_global_sf"], weight_format,
                                            is_l1))


def test_opcheck_transform_weights_scalar_global_and_e8m0():
    nv, mx = random_layer(E, H, I, "nvfp4"), random_layer(E, H, I, "mxfp4")
    opcheck(ops.transform_weights.default, (nv["w13"], nv["w13_sf"], torch.tensor(0.5), "nvfp4", True))
    opcheck(ops.transform_weights.default, (mx["w2"], mx["w2_sf"].view(torch.float8_e8m0fnu), None, "mxfp4", False))


@pytest.mark.parametrize("num_tokens", [0, 5])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}-a{c[1]}")
def test_opcheck_pre_dispatch(combo, idx_dtype, num_tokens):
    c = make_case(E, H, I, K, num_tokens, *combo, idx_dtype=idx_dtype, max_tokens=8, with_ref=False)
    b = c.buffer
    opcheck(ops.pre_dispatch.default, (c.x, c.topk_idx, c.topk_weights, b.buffer, *b.config_args, b.intermediate,
                                       c.weight_format, c.act_format))


@pytest.mark.parametrize("variant", ["plain", "clamp+stats", "T0"])
def test_opcheck_fp8_mega_moe(variant):
    c = dispatched_case("fp8", "fp8", 0 if variant == "T0" else 5)
    kwargs = {"activation_clamp": 1.5, "recv_stats": torch.zeros(E, dtype=torch.int32)} if variant != "plain" else {}
    op, args = mega_moe_args(c, torch.empty_like(c.x), **kwargs)
    opcheck(op, args)


@pytest.mark.parametrize("combo", COMBOS[1:], ids=lambda c: f"{c[0]}-a{c[1]}")
def test_opcheck_fp8_fp4_mega_moe(combo):
    c = dispatched_case(*combo, 5)
    op, args = mega_moe_args(c, torch.empty_like(c.x), activation_clamp=3.0,
                             recv_stats=torch.zeros(E, dtype=torch.int32))
    opcheck(op, args)


def test_opcheck_leaves_args_alone_and_op_still_matches():
    """opcheck runs on copies: afterwards the real call on the same args still gives the reference."""
    c = dispatched_case("mxfp4", "fp4", 6)
    y = torch.empty_like(c.x)
    op, args = mega_moe_args(c, y)
    opcheck(op, args)
    op(*args)
    ref = c.reference()
    assert torch.equal(y, ref)


# ------------------------------------------------------------------------------------------------
# opcheck, CUDA (transform_weights runs on both devices above)
# ------------------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}-a{c[1]}")
def test_opcheck_pre_dispatch_cuda(combo):
    c = make_case(E, H, I, K, 5, *combo, device="cuda", idx_dtype=torch.int64, max_tokens=8, with_ref=False)
    b = c.buffer
    opcheck(ops.pre_dispatch.default, (c.x, c.topk_idx, c.topk_weights, b.buffer, *b.config_args, b.intermediate,
                                       c.weight_format, c.act_format))


@requires_cuda
def test_opcheck_fp8_mega_moe_cuda():
    c = dispatched_case("fp8", "fp8", 5, device="cuda")
    op, args = mega_moe_args(c, torch.empty_like(c.x), activation_clamp=1.5,
                             recv_stats=torch.zeros(E, dtype=torch.int32, device="cuda"))
    opcheck(op, args)


@requires_cuda
@pytest.mark.parametrize("combo", COMBOS[1:], ids=lambda c: f"{c[0]}-a{c[1]}")
def test_opcheck_fp8_fp4_mega_moe_cuda(combo):
    c = dispatched_case(*combo, 5, device="cuda")
    op, args = mega_moe_args(c, torch.empty_like(c.x), activation_clamp=1.5,
                             recv_stats=torch.zeros(E, dtype=torch.int32, device="cuda"))
    opcheck(op, args)


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------
class MoELayer(torch.nn.Module):
    """Holds kernel-layout weights and a buffer; forward is the functional megamoe.moe."""

    def __init__(self, case, activation_clamp=None):
        super().__init__()
        self.l1, self.l2, self.buffer = case.l1, case.l2, case.buffer
        self.weight_format, self.activation_clamp = case.weight_format, activation_clamp

    def forward(self, x, topk_idx, topk_weights):
        y = megamoe.moe(x, topk_idx, topk_weights, self.l1, self.l2, self.buffer, weight_format=self.weight_format,
                        activation_clamp=self.activation_clamp)
        return y * 2  # a following op, so the graph is more than the custom ops


class InPlaceLayer(MoELayer):
    """forward calls the in-place ops directly, with recv_stats."""

    def __init__(self, case):
        super().__init__(case)
        self.stats = torch.zeros(case.num_experts, dtype=torch.int32)

    def forward(self, x, topk_idx, topk_weights):
        megamoe.pre_dispatch(x, topk_idx, topk_weights, self.buffer, weight_format=self.weight_format)
        y = torch.empty_like(x)
        if self.weight_format == "fp8":
            megamoe.fp8_mega_moe(y, self.l1, self.l2, self.buffer, recv_stats=self.stats)
        else:
            megamoe.fp8_fp4_mega_moe(y, self.l1, self.l2, self.buffer, weight_format=self.weight_format,
                                     recv_stats=self.stats)
        return y


@pytest.mark.parametrize("combo", [("fp8", "fp8"), ("nvfp4", "fp4")], ids=lambda c: f"{c[0]}-a{c[1]}")
def test_compile_fullgraph_matches_eager(combo):
    torch._dynamo.reset()
    c = make_case(E, H, I, K, 9, *combo, seed=3, max_tokens=16)
    module = MoELayer(c, activation_clamp=2.0)
    eager = module(c.x, c.topk_idx, c.topk_weights)
    compiled = torch.compile(module, fullgraph=True)(c.x, c.topk_idx, c.topk_weights)
    assert torch.equal(compiled, eager)
    assert torch.equal(eager, 2 * c.reference(activation_clamp=2.0))


def test_compile_inplace_ops_and_recv_stats():
    torch._dynamo.reset()
    c = make_case(E, H, I, K, 7, "mxfp4", "fp8", seed=4, max_tokens=8)
    module = InPlaceLayer(c)
    compiled = torch.compile(module, fullgraph=True)
    y = compiled(c.x, c.topk_idx, c.topk_weights)
    assert torch.equal(y, c.ref)
    counts = torch.bincount(c.topk_idx[c.topk_idx >= 0].long(), minlength=E).int()
    assert torch.equal(module.stats, counts)  # the mutation of a module attribute is applied
    compiled(c.x, c.topk_idx, c.topk_weights)
    assert torch.equal(module.stats, 2 * counts)


@pytest.mark.parametrize("combo", [("fp8", "fp8"), ("mxfp4", "fp4")], ids=lambda c: f"{c[0]}-a{c[1]}")
def test_compile_dynamic_token_count(combo):
    """mark_dynamic on the token dim: one compiled graph serves several T (including T = capacity), each
    equal to eager."""
    torch._dynamo.reset()
    cap = 16
    base = make_case(E, H, I, K, 4, *combo, seed=0, max_tokens=cap, with_ref=False)
    module = MoELayer(base)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(module, fullgraph=True, backend=counter)
    for t in (5, 11, cap):
        c = make_case(E, H, I, K, t, *combo, seed=t, max_tokens=cap, with_ref=False)
        inputs = (c.x, c.topk_idx, c.topk_weights)
        for tensor in inputs:
            torch._dynamo.mark_dynamic(tensor, 0)
        out = compiled(*inputs)
        assert out.shape == (t, H)
        assert torch.equal(out, module(*inputs))
        assert torch.equal(out, 2 * base.reference(x=c.x, topk_idx=c.topk_idx, topk_weights=c.topk_weights))
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"
