"""megamoe.MegaMoEExperts (DESIGN.md §8) on the CPU: loading shard by shard through weight_loader,
redundant experts, rank slices, finalize, forward (bitwise equal to megamoe.moe on directly transformed
weights), EPLB, the vLLM adapter and its custom op (opcheck, torch.compile), safetensors round trips."""
import gc
import json
import random
import sys
import types
import weakref

import pytest
import torch

import megamoe
from conftest import COMBOS, random_layer, rel_err
from megamoe import module as mm
from megamoe import reference
from megamoe.integrations import vllm as mv

E, H, I, K = 8, 256, 256, 3
MAX_T = 16
SCALE = {"fp8": "weight_scale_inv", "mxfp4": "weight_scale", "nvfp4": "weight_scale"}
ALL_OK = {"test_schema": "SUCCESS", "test_autograd_registration": "SUCCESS", "test_faketensor": "SUCCESS",
          "test_aot_dispatch_dynamic": "SUCCESS"}
_prefix_counter = iter(range(10**9))


def unique_prefix(tag="layer"):
    return f"test_module.{tag}.{next(_prefix_counter)}"


def make_module(weight_format, act_format="fp8", *, num_experts=E, num_local=None, start=0, num_logical=None,
                max_tokens=MAX_T, prefix="", cls=megamoe.MegaMoEExperts, top_k=K):
    cfg = megamoe.MegaMoEConfig(max_tokens_per_rank=max_tokens, weight_format=weight_format, act_format=act_format)
    return cls(cfg, num_experts=num_experts, num_local_experts=num_experts if num_local is None else num_local,
               experts_start_idx=start, top_k=top_k, hidden_size=H, intermediate_size=I, prefix=prefix,
               num_logical_experts=num_logical)


def expert_shards(layer, weight_format, e):
    """(param name, shard id, checkpoint tensor) of logical expert e, as a checkpoint stores them."""
    return reference.checkpoint_shards(layer, weight_format, e)


def load_layer(module, layer, weight_format, experts, *, seed=0):
    """Loads every shard of ``experts`` through the parameters' weight_loader, in shuffled order; returns the
    return_success values by (expert, param, shard)."""
    items = [(e, *s) for e in experts for s in expert_shards(layer, weight_format, e)]
    random.Random(seed).shuffle(items)
    results = {}
    for e, name, shard, tensor in items:
        param = getattr(module, name)
        results[(e, name, shard)] = param.weight_loader(param, tensor, f"experts.{e}.{shard}.{name}", shard, e,
                                                        return_success=True)
    return results


def select_experts(layer, order):
    """The layer with its experts reordered/replicated (index_select along the expert dim)."""
    idx = torch.tensor(order)
    return {k: (v.index_select(0, idx) if isinstance(v, torch.Tensor) and v.dim() >= 1 else v)
            for k, v in layer.items()}


def direct_moe(layer, weight_format, act_format, x, ids, weights, *, num_experts=E, **kwargs):
    """megamoe.moe on weights transformed directly (no module), with a fresh buffer."""
    l1 = megamoe.transform_weights(layer["w13"], layer["w13_sf"], layer["w13_global_sf"],
                                   weight_format=weight_format, is_l1=True)
    l2 = megamoe.transform_weights(layer["w2"], layer["w2_sf"], layer["w2_global_sf"],
                                   weight_format=weight_format, is_l1=False)
    buf = megamoe.get_symm_buffer(None, num_experts, MAX_T, ids.shape[1], H, I, act_format=act_format,
                                  device=x.device)
    return megamoe.moe(x, ids, weights, l1, l2, buf, weight_format=weight_format, **kwargs)


def inputs(num_tokens, *, seed=1, num_experts=E, top_k=K, masked_fraction=0.2):
    ids, weights = reference.make_random_routing(num_tokens, num_experts, top_k, masked_fraction=masked_fraction,
                                                 seed=seed, dtype=torch.int64)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    return x, ids, weights


def loaded_module(weight_format, act_format="fp8", **kwargs):
    m = make_module(weight_format, act_format, **kwargs)
    load_layer(m, random_layer(E, H, I, weight_format), weight_format, range(m.num_logical_experts))
    return m


@pytest.fixture(autouse=True)
def fresh_buffers():
    mm.clear_symm_buffer_cache()
    yield
    mm.clear_symm_buffer_cache()


# ------------------------------------------------------------------------------------------------
# Loading, finalize, forward
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: f"{c[0]}-a{c[1]}")
def test_load_finalize_forward_matches_moe_and_reference(combo):
    wf, af = combo
    layer = random_layer(E, H, I, wf)
    m = make_module(wf, af)
    results = load_layer(m, layer, wf, range(E), seed=hash(combo) % 1000)
    assert all(v is True for v in results.values()) and len(results) == E * len(expert_shards(layer, wf, 0))
    assert m.missing_weights() == []
    m.finalize_weights()
    x, ids, weights = inputs(7)
    y = m(x, weights, ids)
    assert y.dtype == torch.bfloat16 and y.shape == (7, H)
    assert torch.equal(y, direct_moe(layer, wf, af, x, ids, weights))
    ref = reference.mega_moe(x, ids, weights, layer["w13"], layer["w2"], weight_format=wf, act_format=af,
                             w13_sf=layer["w13_sf"], w2_sf=layer["w2_sf"], w13_global_sf=layer["w13_global_sf"],
                             w2_global_sf=layer["w2_global_sf"])
    assert rel_err(y, ref) <= 1e-2
    assert ref.float().norm() > 0
    # activation_clamp and fast_math pass through
    y_clamp = m(x, weights, ids, activation_clamp=0.5, fast_math=False)
    assert torch.equal(y_clamp, direct_moe(layer, wf, af, x, ids, weights, activation_clamp=0.5, fast_math=False))
    assert not torch.equal(y_clamp, y)


@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4", "nvfp4"])
def test_finalize_in_place_equals_whole_transform(weight_format):
    """finalize_weights transforms expert by expert into the checkpoint storage: the kernel tensors are
    bit-identical to transform_weights of the whole layer, and the weights (every format) and FP4 block
    scales reuse the parameters' storage (no second copy of them at any time)."""
    layer = random_layer(E, H, I, weight_format)
    m = make_module(weight_format)
    load_layer(m, layer, weight_format, range(E))
    reused = ["w13_weight", "w2_weight"] + ([] if weight_format == "fp8" else ["w13_weight_scale", "w2_weight_scale"])
    ptrs = [getattr(m, n).data_ptr() for n in reused]
    m.finalize_weights()
    for proj, is_l1 in (("w13", True), ("w2", False)):
        want = megamoe.transform_weights(layer[proj], layer[f"{proj}_sf"], layer[f"{proj}_global_sf"],
                                         weight_format=weight_format, is_l1=is_l1)
        got = (getattr(m, f"{proj}_kernel"), getattr(m, f"{proj}_kernel_sf"), getattr(m, f"{proj}_kernel_global_sf"))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    kernel = ["w13_kernel", "w2_kernel"] + ([] if weight_format == "fp8" else ["w13_kernel_sf", "w2_kernel_sf"])
    assert [getattr(m, n).data_ptr() for n in kernel] == ptrs


def test_param_layouts_and_attributes():
    shapes = {
        "fp8": {"w13_weight": ((E, 2 * I, H), torch.float8_e4m3fn),
                "w13_weight_scale_inv": ((E, 2 * I // 128, H // 128), torch.float32),
                "w2_weight": ((E, H, I), torch.float8_e4m3fn),
                "w2_weight_scale_inv": ((E, H // 128, I // 128), torch.float32)},
        "mxfp4": {"w13_weight": ((E, 2 * I, H // 2), torch.uint8),
                  "w13_weight_scale": ((E, 2 * I, H // 32), torch.uint8),
                  "w2_weight": ((E, H, I // 2), torch.uint8), "w2_weight_scale": ((E, H, I // 32), torch.uint8)},
        "nvfp4": {"w13_weight": ((E, 2 * I, H // 2), torch.uint8),
                  "w13_weight_scale": ((E, 2 * I, H // 16), torch.float8_e4m3fn),
                  "w13_weight_scale_2": ((E, 2), torch.float32), "w13_input_scale": ((E, 2), torch.float32),
                  "w2_weight": ((E, H, I // 2), torch.uint8), "w2_weight_scale": ((E, H, I // 16), torch.float8_e4m3fn),
                  "w2_weight_scale_2": ((E,), torch.float32), "w2_input_scale": ((E,), torch.float32)},
    }
    for wf, expected in shapes.items():
        m = make_module(wf)
        got = {n: (tuple(p.shape), p.dtype) for n, p in m.named_parameters()}
        assert got == expected, wf
        for p in m.parameters():
            assert p.requires_grad is False
            assert p.weight_loader == m.weight_loader
            assert p.weight_loader.supports_moe_loading is True
    assert megamoe.MegaMoEExperts.weight_loader.supports_moe_loading is True


def test_redundant_experts_fill_every_replica():
    """8 physical slots, 6 logical experts: slots 6 and 7 hold logical 0 and 1 (p % 6)."""
    wf = "mxfp4"
    layer = random_layer(E, H, I, wf)
    m = make_module(wf, num_logical=6)
    results = load_layer(m, layer, wf, range(6))
    assert all(results.values())
    assert m.missing_weights() == []
    for name in ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"):
        p = getattr(m, name)
        assert torch.equal(p[6], p[0]) and torch.equal(p[7], p[1]), name
        assert not torch.equal(p[6], p[1]), name
    x, ids, weights = inputs(9)
    y = m(x, weights, ids)
    replicated = select_experts(layer, [0, 1, 2, 3, 4, 5, 0, 1])
    assert torch.equal(y, direct_moe(replicated, wf, "fp8", x, ids, weights))
    # a replica computes what its original does: ids 6 -> 0 and 7 -> 1 give the same output
    ids_orig = torch.where(ids >= 6, ids - 6, ids)
    assert (ids != ids_orig).any()
    assert torch.equal(m(x, weights, ids_orig), y)


def test_rank_slice_loads_only_local_experts():
    """num_experts=16 physical, 12 logical, this rank holds physical 8..15 = logical 8..11, 0..3."""
    wf = "fp8"
    layer = random_layer(E, H, I, wf)
    m = make_module(wf, num_experts=16, num_local=8, start=8, num_logical=12)
    assert m._local_slots(3) == [7] and m._local_slots(9) == [1] and m._local_slots(5) == []
    w1 = layer["w13"][5, :I]
    assert m.weight_loader(m.w13_weight, w1, "experts.5.w1.weight", "w1", 5, return_success=True) is False
    assert m.weight_loader(m.w13_weight, w1, "experts.5.w1.weight", "w1", 5) is None
    assert m.w13_weight.view(torch.uint8).count_nonzero() == 0  # nothing written
    assert m.weight_loader(m.w13_weight, w1, "experts.3.w1.weight", "w1", 3, return_success=True) is True
    assert torch.equal(m.w13_weight[7, :I].view(torch.uint8), w1.view(torch.uint8))
    assert m.w13_weight[7, I:].view(torch.uint8).count_nonzero() == 0  # w3 rows untouched
    # w3 of expert 3 lands in rows [I, 2I); fp8 scale shards in row blocks [I/128, 2I/128)
    m.weight_loader(m.w13_weight_scale_inv, torch.full((I // 128, H // 128), 2.0), "s", "w3", 3)
    assert torch.equal(m.w13_weight_scale_inv[7], torch.cat([torch.zeros(I // 128, H // 128),
                                                             torch.full((I // 128, H // 128), 2.0)]))
    # a w1/w3 shard offered to a w2 parameter is not this parameter's (vLLM's rule)
    assert m.weight_loader(m.w2_weight, w1, "experts.3.w1.weight", "w1", 3, return_success=True) is False
    missing = m.missing_weights()
    assert "experts.3.w3.weight" in missing and "experts.3.w1.weight_scale_inv" in missing
    assert "experts.3.w1.weight" not in missing and "experts.3.w3.weight_scale_inv" not in missing
    assert len(missing) == 8 * 6 - 2
    # the kernels need experts_start_idx = rank * num_local_experts: one rank cannot run this slice
    with pytest.raises(ValueError, match=r"experts_start_idx.*num_experts = 16.*experts_start_idx = 8"):
        m(torch.zeros(1, H, dtype=torch.bfloat16), torch.ones(1, K), torch.zeros(1, K, dtype=torch.int64))


def test_loader_errors_name_the_tensor():
    m = make_module("fp8")
    bad = torch.zeros(I + 1, H, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError) as ei:
        m.weight_loader(m.w13_weight, bad, "layers.0.ffn.experts.2.w1.weight", "w1", 2)
    msg = str(ei.value)
    assert "layers.0.ffn.experts.2.w1.weight" in msg and "w13_weight" in msg
    assert f"({I}, {H})" in msg and f"({I + 1}, {H})" in msg
    with pytest.raises(ValueError, match=r"w2_scale_name: expected shape \(2, 2\).*got \(2, 3\)"):
        m.weight_loader(m.w2_weight_scale_inv, torch.ones(2, 3), "w2_scale_name", "w2", 0)
    with pytest.raises(ValueError, match=r"shard_id: expected one of .*got 'w4'"):
        m.weight_loader(m.w2_weight, torch.zeros(H, I, dtype=torch.float8_e4m3fn), "n", "w4", 0)
    with pytest.raises(TypeError, match=r"wname: expected dtype torch.float8_e4m3fn for w2_weight.*got torch.bfloat16"):
        m.weight_loader(m.w2_weight, torch.zeros(H, I, dtype=torch.bfloat16), "wname", "w2", 0)
    stranger = torch.nn.Parameter(torch.zeros(E, H, I), requires_grad=False)
    with pytest.raises(ValueError, match=r"other: param is not a checkpoint-layout parameter"):
        m.weight_loader(stranger, torch.zeros(H, I), "other", "w2", 0)
    assert m.missing_weights()[0] == "experts.0.w1.weight"


def test_loader_reinterprets_and_converts_exactly():
    mx = make_module("mxfp4")
    layer = random_layer(E, H, I, "mxfp4")
    w2, sf2 = layer["w2"][0], layer["w2_sf"][0]
    mx.weight_loader(mx.w2_weight, w2.view(torch.int8), "w", "w2", 0)
    mx.weight_loader(mx.w2_weight_scale, sf2.view(torch.float8_e8m0fnu), "s", "w2", 0)
    assert torch.equal(mx.w2_weight[0], w2) and torch.equal(mx.w2_weight_scale[0], sf2)
    # fp8 block scales stored as UE8M0 (float8_e8m0fnu or raw uint8): decoded exactly to 2^(b-127)
    f8 = make_module("fp8")
    b = torch.tensor([[120, 127], [130, 1]], dtype=torch.uint8)
    f8.weight_loader(f8.w2_weight_scale_inv, b.view(torch.float8_e8m0fnu), "s", "w2", 1)
    assert torch.equal(f8.w2_weight_scale_inv[1], torch.tensor([[2.0**-7, 1.0], [8.0, 2.0**-126]]))
    f8.weight_loader(f8.w2_weight_scale_inv, b, "s", "w2", 2)
    assert torch.equal(f8.w2_weight_scale_inv[2], f8.w2_weight_scale_inv[1])
    # nvfp4 per-expert scalars: [], [1] and [1, 1] are one value; w1 -> column 0, w3 -> column 1
    nv = make_module("nvfp4")
    nv.weight_loader(nv.w13_weight_scale_2, torch.tensor(0.25), "g1", "w1", 4)
    nv.weight_loader(nv.w13_weight_scale_2, torch.tensor([[0.5]]), "g3", "w3", 4)
    nv.weight_loader(nv.w2_weight_scale_2, torch.tensor([0.125]), "g2", "w2", 4)
    assert nv.w13_weight_scale_2[4].tolist() == [0.25, 0.5] and nv.w2_weight_scale_2[4].item() == 0.125


def test_finalize_idempotent_frees_checkpoint_params():
    wf = "nvfp4"
    layer = random_layer(E, H, I, wf)
    m = loaded_module(wf)
    refs = {n: weakref.ref(p) for n, p in m.named_parameters()}
    assert len(refs) == 8
    assert not m.finalized and len(mm._SYMM_BUFFERS) == 0
    m.finalize_weights()
    gc.collect()
    assert m.finalized
    assert len(mm._SYMM_BUFFERS) == 1 and m._symm_buffer is next(iter(mm._SYMM_BUFFERS.values()))  # at load
    assert list(m.named_parameters()) == [] and m.state_dict() == {}
    assert all(r() is None for r in refs.values()), [n for n, r in refs.items() if r() is not None]
    for n in ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale"):
        assert getattr(m, n) is None
    l1 = megamoe.transform_weights(layer["w13"], layer["w13_sf"], layer["w13_global_sf"], weight_format=wf, is_l1=True)
    l2 = megamoe.transform_weights(layer["w2"], layer["w2_sf"], layer["w2_global_sf"], weight_format=wf, is_l1=False)
    for got, want in zip(m.l1_weights + m.l2_weights, l1 + l2):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert sorted(n for n, _ in m.named_buffers()) == sorted(megamoe.MegaMoEExperts._KERNEL_BUFFERS)
    ptrs = [t.data_ptr() for t in m.l1_weights + m.l2_weights]
    m.finalize_weights()
    assert [t.data_ptr() for t in m.l1_weights + m.l2_weights] == ptrs
    assert m.missing_weights() == []
    with pytest.raises(RuntimeError, match=r"late_name: .*finalized"):
        m.weight_loader(torch.nn.Parameter(torch.zeros(1)), torch.zeros(1), "late_name", "w1", 0)


def test_forward_before_finalize_finalizes():
    wf = "fp8"
    m = loaded_module(wf)
    assert not m.finalized
    x, ids, weights = inputs(5, seed=7)
    y = m(x, weights, ids)
    assert m.finalized
    assert torch.equal(y, direct_moe(random_layer(E, H, I, wf), wf, "fp8", x, ids, weights))


def test_too_many_tokens_raises_naming_hidden_states():
    m = loaded_module("fp8", max_tokens=4)
    x, ids, weights = inputs(5)
    with pytest.raises(ValueError, match=r"hidden_states: got 5 tokens, more than max_tokens_per_rank = 4"):
        m(x, weights, ids)
    assert not m.finalized  # checked before anything else happens
    assert m(x[:4], weights[:4], ids[:4]).shape == (4, H)


def test_nvfp4_w1_w3_global_scales_must_match():
    m = loaded_module("nvfp4", num_experts=16, num_local=8, start=8, num_logical=8)  # slot p: logical p
    m.weight_loader(m.w13_weight_scale_2, torch.tensor(0.75), "experts.2.w3.weight_scale_2", "w3", 2)
    with pytest.raises(ValueError) as ei:
        m.finalize_weights()
    msg = str(ei.value)
    assert msg.startswith("w13_weight_scale_2: expert 2 (physical 10, local slot 2)") and "0.75" in msg, msg
    assert not m.finalized and m.w13_weight is not None  # nothing changed


def test_config_and_constructor_validation():
    with pytest.raises(ValueError, match=r"weight_format: expected one of .*got 'int4'"):
        megamoe.MegaMoEConfig(max_tokens_per_rank=8, weight_format="int4")
    with pytest.raises(ValueError, match=r"act_format: weight_format 'fp8' takes act_format 'fp8', got 'fp4'"):
        megamoe.MegaMoEConfig(max_tokens_per_rank=8, weight_format="fp8", act_format="fp4")
    with pytest.raises(ValueError, match=r"max_tokens_per_rank: expected a positive int, got 0"):
        megamoe.MegaMoEConfig(max_tokens_per_rank=0)
    cfg = megamoe.MegaMoEConfig(max_tokens_per_rank=8)
    kw = dict(num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H, intermediate_size=I)
    with pytest.raises(ValueError, match=r"hidden_size: expected a multiple of 128, got 200"):
        megamoe.MegaMoEExperts(cfg, **{**kw, "hidden_size": 200})
    with pytest.raises(ValueError, match=r"experts_start_idx: .*got 4"):
        megamoe.MegaMoEExperts(cfg, **{**kw, "experts_start_idx": 4})
    with pytest.raises(ValueError, match=r"num_logical_experts: expected at most num_experts = 8, got 9"):
        megamoe.MegaMoEExperts(cfg, **kw, num_logical_experts=9)
    with pytest.raises(TypeError, match=r"config: expected megamoe.MegaMoEConfig, got SimpleNamespace"):
        megamoe.MegaMoEExperts(types.SimpleNamespace(), **kw)


def test_prefix_registry_rejects_duplicates():
    name = unique_prefix("dup")
    m = make_module("fp8", prefix=name)
    assert mm.get_layer(name) is m
    with pytest.raises(ValueError, match=rf"prefix: a MegaMoEExperts layer named '{name}' already exists"):
        make_module("fp8", prefix=name)
    del m
    m2 = make_module("fp8", prefix=name)  # the first one is gone: the name is free again
    assert mm.get_layer(name) is m2
    with pytest.raises(KeyError, match=r"layer_name: no MegaMoEExperts layer is registered as 'nope'"):
        mm.get_layer("nope")
    make_module("fp8")
    make_module("fp8")  # an empty prefix is never registered


def test_symm_buffer_shared_per_shape():
    a, b = loaded_module("fp8"), loaded_module("mxfp4")
    c = loaded_module("mxfp4", "fp4")
    d = loaded_module("fp8", max_tokens=8)
    assert a.get_symm_buffer() is b.get_symm_buffer()  # fp8 activations: one buffer for both formats
    assert c.get_symm_buffer() is not a.get_symm_buffer() and c.get_symm_buffer().act_format == "fp4"
    assert d.get_symm_buffer() is not a.get_symm_buffer() and d.get_symm_buffer().max_tokens_per_rank == 8
    buf = a.get_symm_buffer()
    assert (buf.num_experts, buf.max_tokens_per_rank, buf.top_k, buf.hidden, buf.intermediate) == (E, MAX_T, K, H, I)
    assert len(mm._SYMM_BUFFERS) == 3
    # two layers sharing a buffer, called in turn, each give their own output
    x, ids, weights = inputs(6)
    ya, yb = a(x, weights, ids), b(x, weights, ids)
    assert torch.equal(a(x, weights, ids), ya) and torch.equal(b(x, weights, ids), yb) and not torch.equal(ya, yb)


# ------------------------------------------------------------------------------------------------
# EPLB
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4", "nvfp4"])
def test_get_expert_weights_alias_the_kernel_tensors(weight_format):
    m = loaded_module(weight_format)
    views = m.get_expert_weights()
    assert m.finalized
    kernel = [m.w13_kernel, m.w13_kernel_sf, m.w2_kernel, m.w2_kernel_sf]
    if weight_format != "fp8":  # nvfp4: per-expert global scales; mxfp4: per-row exponents
        kernel += [m.w13_kernel_global_sf, m.w2_kernel_global_sf]
    assert len(views) == len(kernel)
    for v, t in zip(views, kernel):
        assert v.dtype == torch.uint8 and v.is_contiguous()
        assert v.shape == (E, t[0].numel() * t.element_size()) and v.data_ptr() == t.data_ptr()
    if weight_format == "fp8":
        assert [v.shape[1] for v in views] == [2 * I * H, 2 * I // 64 * H // 128 * 4, H * I, H // 64 * I // 128 * 4]
    # EPLB moves experts by copying rows of these views: swapping slots 0 and 1 must swap the experts
    x, ids, weights = inputs(8, seed=3)
    y = m(x, weights, ids)
    for v in views:
        v[[0, 1]] = v[[1, 0]].clone()
    swapped = torch.where(ids == 0, 1, torch.where(ids == 1, 0, ids))
    assert (ids == 0).any() and (ids == 1).any()
    assert torch.equal(m(x, weights, swapped), y)
    m.update_expert_map()  # a no-op, present for vLLM


def test_eplb_maps_logical_ids_and_records_load():
    """6 logical experts on 8 slots: logical 0 -> slots (0, 6), logical 1 -> (1, 7)."""
    wf = "mxfp4"
    layer = random_layer(E, H, I, wf)
    m = make_module(wf, num_logical=6)
    load_layer(m, layer, wf, range(6))
    load = torch.zeros(E, dtype=torch.int32)
    l2p = torch.tensor([[0, 6], [1, 7], [2, -1], [3, -1], [4, -1], [5, -1]])
    counts = torch.tensor([2, 2, 1, 1, 1, 1])
    m.set_eplb_state(3, load, l2p, counts)
    assert m.moe_layer_idx == 3 and m.expert_load_view is load
    x, ids, weights = inputs(10, num_experts=6, seed=5)
    ids[0, 0], ids[1, 1] = 7, -1  # 7 is not a logical expert: the slot is skipped
    y = m(x, weights, ids)
    # vLLM's replica choice: replica (t * K + k) % replica_count
    pos = torch.arange(ids.numel()).view(ids.shape)
    safe = ids.clamp(0, 5)
    expected = torch.where((ids >= 0) & (ids < 6), l2p[safe, pos % counts[safe]], -1)
    assert ((expected == 6) | (expected == 7)).any() and ((expected == 0) | (expected == 1)).any()
    assert torch.equal(m._map_to_physical(ids)[ids != 7], expected[ids != 7])
    assert m._map_to_physical(ids)[0, 0].item() >= E
    assert torch.equal(y, direct_moe(select_experts(layer, [0, 1, 2, 3, 4, 5, 0, 1]), wf, "fp8", x, expected, weights))
    assert torch.equal(load, torch.bincount(expected[expected >= 0], minlength=E).to(torch.int32))
    m(x, weights, ids)
    assert torch.equal(load, 2 * torch.bincount(expected[expected >= 0], minlength=E).to(torch.int32))
    with pytest.raises(ValueError, match=r"expert_load_view: expected int32 \[8\] or \[8\], got torch.int64"):
        m.set_eplb_state(0, torch.zeros(E, dtype=torch.int64), l2p, counts)
    with pytest.raises(ValueError, match=r"logical_to_physical_map: expected \[6, max_replicas\]"):
        m.set_eplb_state(0, load, l2p[:5], counts)


# ------------------------------------------------------------------------------------------------
# vLLM adapter and custom op
# ------------------------------------------------------------------------------------------------
def vllm_config(*, max_tokens=MAX_T, hf=None, quant_config=None, tp=1, dp=1, ep=False):
    return types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=max_tokens),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=dp,
                                              enable_expert_parallel=ep),
        model_config=types.SimpleNamespace(hf_config=hf if hf is not None else types.SimpleNamespace()),
        quant_config=quant_config,
    )


def test_vllm_weight_format_hints():
    ns = types.SimpleNamespace
    cases = [
        (vllm_config(hf=ns(model_type="deepseek_v4")), "mxfp4"),
        (vllm_config(hf=ns(model_type="deepseek_v4", expert_dtype="fp8",
                           quantization_config={"quant_method": "fp8"})), "fp8"),
        (vllm_config(hf=ns(expert_dtype="fp4", quantization_config={"quant_method": "fp8"})), "mxfp4"),
        (vllm_config(hf=ns(quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"})), "nvfp4"),
        (vllm_config(hf=ns(model_type="deepseek_v4"), quant_config=ns(moe_quant_algo="NVFP4")), "nvfp4"),
        (vllm_config(hf=ns(quantization_config={"quant_method": "fp8"})), "fp8"),
    ]
    for cfg, want in cases:
        assert mv.weight_format_from_vllm(cfg) == want
    with pytest.raises(ValueError, match=r"weight_format: the vLLM config names no expert format"):
        mv.weight_format_from_vllm(vllm_config())
    with pytest.raises(ValueError, match=r"weight_format: hf_config.expert_dtype 'int4'"):
        mv.weight_format_from_vllm(vllm_config(hf=ns(expert_dtype="int4")))


def test_vllm_config_mapping_and_groups():
    ns = types.SimpleNamespace
    cfg = mv.megamoe_config_from_vllm(vllm_config(max_tokens=96, hf=ns(model_type="deepseek_v4"), ep=True))
    assert (cfg.max_tokens_per_rank, cfg.group, cfg.weight_format, cfg.act_format) == (96, None, "mxfp4", "fp8")
    cfg = mv.megamoe_config_from_vllm(vllm_config(hf=ns(model_type="deepseek_v4")), weight_format="nvfp4",
                                      act_format="fp4", max_tokens_per_rank=7)
    assert (cfg.max_tokens_per_rank, cfg.weight_format, cfg.act_format) == (7, "nvfp4", "fp4")
    with pytest.raises(NotImplementedError, match=r"parallel_config: .*= 4 without enable_expert_parallel"):
        mv.megamoe_config_from_vllm(vllm_config(hf=ns(model_type="deepseek_v4"), tp=4))
    if "vllm" not in sys.modules:
        with pytest.raises(ImportError, match=r"parallel_config: 8 expert-parallel ranks need vLLM's EP group"):
            mv.megamoe_config_from_vllm(vllm_config(hf=ns(model_type="deepseek_v4"), tp=4, dp=2, ep=True))
    sentinel = object()
    cfg = mv.megamoe_config_from_vllm(vllm_config(hf=ns(model_type="deepseek_v4"), tp=4, dp=2, ep=True),
                                      group=sentinel)
    assert cfg.group is sentinel
    with pytest.raises(ValueError, match=r"max_tokens_per_rank: vllm_config.scheduler_config"):
        mv.megamoe_config_from_vllm(types.SimpleNamespace(model_config=None))


def make_vllm_module(wf="mxfp4", af="fp8", prefix=None):
    ns = types.SimpleNamespace
    m = mv.make_megamoe_experts_from_vllm(
        vllm_config(hf=ns(model_type="deepseek_v4", expert_dtype={"fp8": "fp8", "mxfp4": "fp4", "nvfp4": "nvfp4"}[wf])),
        act_format=af, num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H,
        intermediate_size=I, prefix=prefix or unique_prefix("vllm"))
    load_layer(m, random_layer(E, H, I, wf), wf, range(E))
    return m


def test_vllm_module_runs_through_the_custom_op():
    m = make_vllm_module("mxfp4")
    assert isinstance(m, mv.VllmMegaMoEExperts) and m.weight_format == "mxfp4" and m.max_num_tokens == MAX_T
    assert mm.get_layer(m.prefix) is m
    x, ids, weights = inputs(6)
    y = m(x, weights, ids, activation_clamp=1.0)
    assert torch.equal(y, direct_moe(random_layer(E, H, I, "mxfp4"), "mxfp4", "fp8", x, ids, weights,
                                     activation_clamp=1.0))
    out = torch.empty_like(x)
    torch.ops.megamoe_vllm.experts_forward(x, weights, ids, out, m.prefix, 1.0, True)
    assert torch.equal(out, y)
    with pytest.raises(ValueError, match=r"hidden_states: got 17 tokens, more than max_tokens_per_rank = 16"):
        x17, ids17, weights17 = inputs(17)
        m(x17, weights17, ids17)
    with pytest.raises(ValueError, match=r"prefix: VllmMegaMoEExperts needs a non-empty"):
        mv.make_megamoe_experts_from_vllm(vllm_config(hf=types.SimpleNamespace(model_type="deepseek_v4")),
                                          num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K,
                                          hidden_size=H, intermediate_size=I)
    assert str(torch.ops.megamoe_vllm.experts_forward.default._schema) == "megamoe_vllm::experts_forward" + mv.OP_SCHEMA


def test_custom_op_opcheck():
    m = make_vllm_module("nvfp4", "fp4")
    m.finalize_weights()
    for num_tokens, clamp in ((5, None), (0, None), (9, 2.0)):
        x, ids, weights = inputs(num_tokens, seed=num_tokens)
        out = torch.empty_like(x)
        result = torch.library.opcheck(torch.ops.megamoe_vllm.experts_forward.default,
                                       (x, weights, ids, out, m.prefix, clamp, True))
        assert result == ALL_OK, result


class _Block(torch.nn.Module):
    """A model block around the experts: the custom op between two ordinary ops."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, topk_weights, topk_ids):
        y = self.experts(x * 2, topk_weights, topk_ids, activation_clamp=3.0)
        return y.float() + 1


@pytest.mark.parametrize("cls", ["vllm", "plain"])
def test_compile_fullgraph_matches_eager(cls):
    torch._dynamo.reset()
    if cls == "vllm":
        experts = make_vllm_module("fp8")
    else:
        experts = loaded_module("fp8")
    experts.finalize_weights()
    block = _Block(experts)
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    for num_tokens, seed in ((7, 1), (7, 2)):
        x, ids, weights = inputs(num_tokens, seed=seed)
        eager = block(x, weights, ids)
        assert torch.equal(compiled(x, weights, ids), eager)
    assert torch.equal(eager, direct_moe(random_layer(E, H, I, "fp8"), "fp8", "fp8", x * 2, ids, weights,
                                         activation_clamp=3.0).float() + 1)


# ------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------
def test_safetensors_missing_gives_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"load_experts_from_safetensors needs the 'safetensors' package: "
                                          r"pip install safetensors"):
        megamoe.load_experts_from_safetensors(make_module("fp8"), "x", prefix="layers.0.ffn")


@pytest.mark.parametrize("combo", [("fp8", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp8")], ids=lambda c: f"{c[0]}-a{c[1]}")
def test_safetensors_round_trip(combo, tmp_path, capsys):
    pytest.importorskip("safetensors")
    from megamoe.tools.write_synthetic_checkpoint import main
    wf, af = combo
    main(["--format", wf, "--out", str(tmp_path), "--experts", str(E), "--hidden", str(H),
          "--intermediate", str(I), "--prefix", "layers.5.ffn", "--masters"])
    assert "wrote" in capsys.readouterr().out
    info = json.loads((tmp_path / "megamoe_synthetic.json").read_text())
    assert info == {"weight_format": wf, "num_experts": E, "hidden_size": H, "intermediate_size": I,
                    "prefix": "layers.5.ffn", "seed": 0}
    m = make_module(wf, af)
    loaded = megamoe.load_experts_from_safetensors(m, tmp_path, prefix="layers.5.ffn")
    per_expert = 12 if wf == "nvfp4" else 6
    assert len(loaded) == E * per_expert and "layers.5.ffn.experts.3.w3.weight" in loaded
    err = capsys.readouterr().err
    assert f"megamoe: layers.5.ffn: {E * per_expert}/{E * per_expert} expert tensors" in err
    layer = random_layer(E, H, I, wf)
    x, ids, weights = inputs(6)
    assert torch.equal(m(x, weights, ids), direct_moe(layer, wf, af, x, ids, weights))
    from safetensors.torch import load_file
    masters = load_file(str(tmp_path / "masters.safetensors"))
    assert torch.equal(masters["layers.5.ffn.experts.w13_bf16"], layer["w13_bf16"])


def test_safetensors_rank_slice_names_and_missing(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file
    from megamoe.tools.write_synthetic_checkpoint import write_synthetic_checkpoint
    wf = "fp8"
    write_synthetic_checkpoint(str(tmp_path / "a"), wf, prefix="model.layers.1.mlp")
    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    # vLLM-style scale names, split over two files, plus an unrelated tensor under the prefix
    renamed = {k.replace(".scale", ".weight_scale_inv"): v for k, v in tensors.items()}
    keys = sorted(renamed)
    (tmp_path / "b").mkdir()
    save_file({k: renamed[k] for k in keys[::2]}, str(tmp_path / "b" / "part-1.safetensors"))
    save_file({**{k: renamed[k] for k in keys[1::2]}, "model.layers.1.mlp.gate.weight": torch.zeros(E, H)},
              str(tmp_path / "b" / "part-2.safetensors"))
    # EP rank 1 of 2: experts 4..7
    m = make_module(wf, num_experts=E, num_local=4, start=4)
    loaded = megamoe.load_experts_from_safetensors(m, tmp_path / "b", prefix="model.layers.1.mlp", progress=False)
    assert len(loaded) == 4 * 6 and all(int(k.split(".")[5]) >= 4 for k in loaded)
    assert torch.equal(m.w13_weight_scale_inv, random_layer(E, H, I, wf)["w13_sf"][4:])
    # a missing tensor of a local expert is reported by name
    del renamed["model.layers.1.mlp.experts.6.w3.weight"]
    save_file(renamed, str(tmp_path / "c.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp: 1 expert tensors .*"
                                         r"'model.layers.1.mlp.experts.6.w3.weight'"):
        megamoe.load_experts_from_safetensors(make_module(wf, num_local=4, start=4), tmp_path / "c.safetensors",
                                              prefix="model.layers.1.mlp", progress=False)
    with pytest.raises(ValueError, match=r"prefix: no 'layers.9.ffn.experts"):
        megamoe.load_experts_from_safetensors(make_module(wf), tmp_path / "c.safetensors", prefix="layers.9.ffn",
                                              progress=False)
