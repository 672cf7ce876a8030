"""The CPU ops (DESIGN.md §5) against the emulating reference (§3), bitwise, for every format pair, plus
pre_dispatch's buffer contents, transform_weights' layout, the buffer layout and checked mode (§9)."""
import pytest
import torch

import megamoe
from megamoe import formats
from conftest import COMBOS, as_bytes, assert_bitwise_equal, make_case, random_layer

E, H, I, K = 8, 256, 384, 3
LAYOUT_REGIONS = ("error", "num_tokens", "expert_count", "expert_offset", "tile_offset", "sched", "peer_ptrs",
                  "signal", "x", "x_sf", "x_global_sf", "topk_idx", "topk_weights", "recv_count", "recv_idx",
                  "pool_src", "dispatch_x",
                  "dispatch_sf", "dispatch_global_sf", "dispatch_weight", "pool", "pool_sf", "pool_global_sf", "combine")


def combo_id(combo):
    return f"{combo[0]}-a{combo[1]}"


def nan_like(x):
    return torch.full_like(x, float("nan"))


# ------------------------------------------------------------------------------------------------
# Fused layer vs reference
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
@pytest.mark.parametrize("shape", [(E, H, I, K, 0), (E, H, I, K, 1), (E, H, I, K, 7), (E, H, I, K, 33),
                                   (16, 512, 256, 4, 64)], ids=lambda s: "E{}-H{}-I{}-K{}-T{}".format(*s))
def test_moe_matches_reference(combo, shape):
    """Functional ``moe`` and the in-place pre_dispatch + fused op both equal the reference bitwise."""
    e, h, i, k, t = shape
    c = make_case(e, h, i, k, t, *combo, seed=t)
    y = c.run()
    assert_bitwise_equal(y, c.ref, "moe")
    if t > 0:
        assert c.ref.abs().sum() > 0  # the comparison is not between two zero tensors

    # In-place form on a NaN-poisoned y: every element is overwritten.
    megamoe.pre_dispatch(c.x, c.topk_idx, c.topk_weights, c.buffer, weight_format=c.weight_format)
    y2 = nan_like(c.x)
    c.run_inplace(y2)
    assert not y2.isnan().any()
    assert_bitwise_equal(y2, c.ref, "in-place op")


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
@pytest.mark.parametrize("clamp", [None, 3.0])
def test_nan_activation_is_never_silent(combo, clamp):
    """A NaN in one token's hidden state: that token's row is non-finite in the op as in the reference (no
    quantization scale or clamp turns it finite), every other row is bitwise the reference's."""
    c = make_case(E, H, I, K, 16, *combo, masked_fraction=0.0, seed=17)
    c.x = c.x.clone()
    c.x[5, 17] = float("nan")
    ref = c.reference(activation_clamp=clamp)
    y = c.run(activation_clamp=clamp)
    assert not torch.isfinite(ref[5]).any() and not torch.isfinite(y[5]).any()
    others = torch.arange(16) != 5
    assert_bitwise_equal(y[others], ref[others], "rows without the NaN")


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_masked_slots(combo):
    """-1 slots contribute nothing; tokens with every slot masked get exactly 0."""
    c = make_case(E, H, I, K, 12, *combo, masked_fraction=0.5, seed=5)
    idx = c.topk_idx.clone()
    idx[3:6] = -1  # fully masked tokens
    ref = c.reference(topk_idx=idx)
    y = megamoe.moe(c.x, idx, c.topk_weights, c.l1, c.l2, c.buffer, weight_format=c.weight_format)
    assert_bitwise_equal(y, ref, "masked")
    assert (idx == -1).sum() > 9  # besides rows 3..5, some random slots are masked too
    assert torch.equal(y[3:6], torch.zeros_like(y[3:6]))
    assert y[:3].abs().sum() > 0


@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[2], COMBOS[4]], ids=combo_id)
def test_all_tokens_to_one_expert(combo):
    c = make_case(E, H, I, K, 20, *combo, seed=8)
    idx = torch.full_like(c.topk_idx, -1)
    idx[:, 1] = 5
    stats = torch.zeros(E, dtype=torch.int32)
    y = megamoe.moe(c.x, idx, c.topk_weights, c.l1, c.l2, c.buffer, weight_format=c.weight_format,
                    recv_stats=stats)
    assert_bitwise_equal(y, c.reference(topk_idx=idx), "one expert")
    expected = torch.zeros(E, dtype=torch.int32)
    expected[5] = 20
    assert torch.equal(stats, expected)


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_int32_and_int64_ids_agree(combo):
    c = make_case(E, H, I, K, 9, *combo, seed=2)
    y32 = megamoe.moe(c.x, c.topk_idx.to(torch.int32), c.topk_weights, c.l1, c.l2, c.buffer,
                      weight_format=c.weight_format)
    y64 = megamoe.moe(c.x, c.topk_idx.to(torch.int64), c.topk_weights, c.l1, c.l2, c.buffer,
                      weight_format=c.weight_format)
    assert_bitwise_equal(y64, y32, "int64 vs int32 ids")
    assert_bitwise_equal(y32, c.ref, "int32 ids")


@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_activation_clamp(combo):
    c = make_case(E, H, I, K, 16, *combo, seed=4)
    clamp = 0.25
    y = c.run(activation_clamp=clamp)
    ref = c.reference(activation_clamp=clamp)
    assert_bitwise_equal(y, ref, "clamped")
    assert not torch.equal(y, c.ref), "activation_clamp=0.25 did not change the output"
    # A clamp above every |h| changes nothing.
    assert_bitwise_equal(c.run(activation_clamp=1e6), c.ref, "clamp 1e6")
    assert_bitwise_equal(c.run(activation_clamp=None), c.ref, "no clamp")


@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[1], COMBOS[4]], ids=combo_id)
def test_repeated_calls_are_deterministic(combo):
    c = make_case(E, H, I, K, 21, *combo, seed=6)
    y1, y2 = c.run(), c.run()
    assert_bitwise_equal(y2, y1, "second moe call")
    # The fused op alone again on the same pre_dispatch result (buffer pools already written once).
    y3 = nan_like(c.x)
    c.run_inplace(y3)
    assert_bitwise_equal(y3, y1, "fused op rerun")
    assert_bitwise_equal(y1, c.ref, "vs reference")


def test_stale_buffer_rows_beyond_num_tokens_are_ignored():
    """A buffer that held more tokens before gives the same result for fewer tokens now."""
    big = make_case(E, H, I, K, 30, "fp8", "fp8", seed=12, max_tokens=30, with_ref=False)
    big.run()
    small = make_case(E, H, I, K, 11, "fp8", "fp8", seed=13, max_tokens=30)
    small.buffer = big.buffer
    assert_bitwise_equal(small.run(), small.ref, "after a bigger call")


@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[3], COMBOS[2]], ids=combo_id)
def test_recv_stats_counts_rows_per_expert(combo):
    c = make_case(E, H, I, K, 25, *combo, masked_fraction=0.3, seed=9)
    ids = c.topk_idx.reshape(-1).long()
    counts = torch.bincount(ids[ids >= 0], minlength=E).to(torch.int32)
    assert counts.sum() < 25 * K and counts.sum() > 0  # some slots masked, some not
    stats = torch.full((E,), 7, dtype=torch.int32)
    y = c.run(recv_stats=stats)
    assert torch.equal(stats, counts + 7)
    assert_bitwise_equal(y, c.ref, "with recv_stats")
    # Cumulative over calls, also through the in-place op.
    c.run_inplace(nan_like(c.x), recv_stats=stats)
    assert torch.equal(stats, 2 * counts + 7)


# ------------------------------------------------------------------------------------------------
# pre_dispatch: buffer contents
# ------------------------------------------------------------------------------------------------
def expected_quantized(x, weight_format, act_format):
    """(element bytes [T, *], scale bytes [T, *], global scale float32 [T] or None) per megamoe.formats."""
    xf = x.float()
    if weight_format == "fp8":
        q, scale = formats.quantize_fp8_f32(xf, 128)
        return q.view(torch.uint8), scale.contiguous().view(torch.uint8), None
    if act_format == "fp8":
        q, sf = formats.quantize_fp8_ue8m0(xf, 32)
        return q.view(torch.uint8), sf, None
    if weight_format == "mxfp4":
        packed, sf = formats.quantize_mxfp4(xf)
        return packed, sf, None
    packed, sf, g = formats.quantize_nvfp4(xf, None)
    return packed, sf.view(torch.uint8), g.reshape(-1)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("combo", COMBOS, ids=combo_id)
def test_pre_dispatch_buffer_contents(combo, idx_dtype):
    t, cap = 13, 16
    c = make_case(E, H, I, K, t, *combo, seed=3, idx_dtype=idx_dtype, max_tokens=cap, with_ref=False)
    buf = c.buffer
    buf.buffer.fill_(0xAB)  # the error word must be reset, and nothing else depends on prior contents
    megamoe.pre_dispatch(c.x, c.topk_idx, c.topk_weights, buf, weight_format=c.weight_format)
    lay = buf.layout
    data, sf, g = expected_quantized(c.x, *combo)
    token_bytes = H // 2 if c.act_format == "fp4" else H
    assert lay["token_bytes"] == token_bytes and data.shape == (t, token_bytes)
    assert_bitwise_equal(buf.view("x", (cap, token_bytes), torch.uint8)[:t], data, "x")
    sf_region = buf.view("x_sf", (cap, lay["token_sf_bytes"]), torch.uint8)[:t]
    assert_bitwise_equal(sf_region[:, :sf.shape[1]], sf, "x_sf")
    if g is not None:
        assert_bitwise_equal(buf.view("x_global_sf", (cap,), torch.float32)[:t], g, "x_global_sf")
    assert_bitwise_equal(buf.view("topk_idx", (cap, K), torch.int32)[:t], c.topk_idx.to(torch.int32),
                         "topk_idx")
    assert_bitwise_equal(buf.view("topk_weights", (cap, K), torch.float32)[:t], c.topk_weights,
                         "topk_weights")
    assert buf.view("num_tokens", (1,), torch.int32).item() == t
    assert buf.error_word().tolist() == [0, 0, 0, 0]


def test_bad_ids_stored_clamped_and_reported_by_the_fused_op():
    """pre_dispatch clears the error word and stores ids as int32 (out-of-range ones clamped, still out of
    range: the CUDA kernel records no error, so nothing races with its clear); the fused op skips them and
    reports the first."""
    c = make_case(E, H, I, K, 6, "fp8", "fp8", seed=1, masked_fraction=0.0, with_ref=False, idx_dtype=torch.int64)
    idx = c.topk_idx.clone()
    idx[2, 1] = E + 3
    idx[4, 0] = -(1 << 40)
    megamoe.pre_dispatch(c.x, idx, c.topk_weights, c.buffer)
    assert c.buffer.error_word().tolist() == [0, 0, 0, 0]
    stored = c.buffer.view("topk_idx", (6, K), torch.int32)
    assert torch.equal(stored, idx.clamp(-2**31, 2**31 - 1).to(torch.int32))
    c.run_inplace(nan_like(c.x), check=False)
    assert c.buffer.error_word().tolist() == [1, E + 3, 2, 1]
    # The next pre_dispatch clears the word.
    megamoe.pre_dispatch(c.x, c.topk_idx, c.topk_weights, c.buffer)
    assert c.buffer.error_word().tolist() == [0, 0, 0, 0]


# ------------------------------------------------------------------------------------------------
# transform_weights
# ------------------------------------------------------------------------------------------------
def chunk_rows(t, j):
    return t[:, 64 * j:64 * (j + 1)]


def scale_tiled(weight_format, n, k):
    """Whether transform_weights writes FP4 scales as scale tiles (csrc/include/megamoe/formats.hpp)."""
    blk = 16 if weight_format == "nvfp4" else 32
    return weight_format != "fp8" and n % 256 == 0 and (k // blk) % 16 == 0


def scales_by_row(sf, weight_format, k):
    """Kernel-layout FP4 scales [E, N, C] back in row order: scale tiles [E, N / 256, C / 16, 256, 16] undone."""
    e, n, c = sf.shape
    if not scale_tiled(weight_format, n, k):
        return sf
    return sf.reshape(e, n // 256, c // 16, 256, 16).transpose(2, 3).reshape(e, n, c)


def assert_interleaved(out, ckpt, inter, what):
    """out chunk 2j == gate rows [64j, 64j+64), chunk 2j+1 == up rows [I+64j, I+64j+64)."""
    assert out.shape == ckpt.shape, what
    for j in range(inter // 64):
        assert_bitwise_equal(chunk_rows(out, 2 * j), ckpt[:, 64 * j:64 * j + 64], f"{what} gate chunk {j}")
        assert_bitwise_equal(chunk_rows(out, 2 * j + 1), ckpt[:, inter + 64 * j:inter + 64 * j + 64],
                             f"{what} up chunk {j}")


def assert_fresh(outputs, inputs):
    """No output shares storage with an input (or with another output)."""
    ptrs = [t.untyped_storage().data_ptr() for t in inputs if t is not None]
    out_ptrs = [t.untyped_storage().data_ptr() for t in outputs]
    assert len(set(out_ptrs)) == 3
    assert not set(out_ptrs) & set(ptrs)


def assert_third_tensor(og, osf, g, weight_format, what):
    """The kernel layout's third tensor: nvfp4 the global scales passed through, mxfp4 each kernel-layout row's
    largest UE8M0 scale (uint8 [E, N]: the FP8-wgmma path's fold exponent), fp8 ones."""
    if weight_format == "mxfp4":
        e, n = osf.shape[:2]
        assert og.shape == (e, n) and og.dtype == torch.uint8, what
        want = osf.to(torch.int32).max(dim=2).values.to(torch.uint8)
        assert_bitwise_equal(og, want, what)
    elif weight_format == "nvfp4":
        assert og.shape == (E,) and og.dtype == torch.float32, what
        assert torch.equal(og, g.reshape(-1).expand(E)), what  # passes through
    else:
        assert og.shape == (E,) and og.dtype == torch.float32, what
        assert torch.equal(og, torch.ones(E)), what


@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4", "nvfp4"])
def test_transform_weights_l1_interleave(weight_format):
    lay = random_layer(E, H, I, weight_format)
    w, sf, g = lay["w13"], lay["w13_sf"], lay["w13_global_sf"]
    snapshot = [as_bytes(t) for t in (w, sf) + ((g,) if g is not None else ())]
    ow, osf, og = megamoe.transform_weights(w, sf, g, weight_format=weight_format, is_l1=True)
    assert_interleaved(ow, w, I, "weights")
    assert ow.dtype == w.dtype and ow.is_contiguous()
    if weight_format == "fp8":
        # Scales per (64-row chunk, 128-K block): chunk 2j has gate block (64j)//128, 2j+1 up block.
        assert osf.shape == (E, 2 * I // 64, H // 128) and osf.dtype == torch.float32
        for j in range(I // 64):
            assert torch.equal(osf[:, 2 * j], sf[:, (64 * j) // 128])
            assert torch.equal(osf[:, 2 * j + 1], sf[:, (I + 64 * j) // 128])
    else:
        assert_interleaved(scales_by_row(osf, weight_format, H), sf, I, "weights_sf")
        assert osf.dtype == (torch.uint8 if weight_format == "mxfp4" else torch.float8_e4m3fn)
    assert_third_tensor(og, scales_by_row(osf, weight_format, H), g, weight_format, "weights_global_sf")
    assert_fresh((ow, osf, og), (w, sf, g))
    # Inputs untouched; writing to the outputs does not reach them.
    ow.view(torch.uint8).zero_()
    osf.zero_()
    og.zero_()
    for before, t in zip(snapshot, (w, sf, g)):
        assert torch.equal(before, as_bytes(t))


@pytest.mark.parametrize("weight_format", ["fp8", "mxfp4", "nvfp4"])
def test_transform_weights_l2_keeps_row_order(weight_format):
    lay = random_layer(E, H, I, weight_format)
    w, sf, g = lay["w2"], lay["w2_sf"], lay["w2_global_sf"]
    ow, osf, og = megamoe.transform_weights(w, sf, g, weight_format=weight_format, is_l1=False)
    assert_bitwise_equal(ow, w, "w2")
    if weight_format == "fp8":
        assert osf.shape == (E, H // 64, I // 128)
        assert torch.equal(osf, sf.repeat_interleave(2, dim=1))
    else:
        assert_bitwise_equal(scales_by_row(osf, weight_format, I), sf, "w2_sf")
    assert_third_tensor(og, scales_by_row(osf, weight_format, I), g, weight_format, "weights_global_sf")
    assert_fresh((ow, osf, og), (w, sf, g))


@pytest.mark.parametrize("weight_format", ["mxfp4", "nvfp4"])
def test_transform_weights_fp4_scale_tiles(weight_format):
    """FP4 scales where N % 256 == 0 and K / blk % 16 == 0 (every V4 shape) come out as scale tiles: per expert, the
    16 bytes of K at column group j of rows [256 i, 256 i + 256) are 4 KB in one piece at ((i * C / 16) + j) * 4096,
    row r of the tile at 16 r (formats.hpp); checked byte by byte against that address for every scale of a layer
    with one tiled and one row-order GEMM (MXFP4 L2: K / 32 = 8 bytes; L1: two 16-byte column groups), and the row
    exponents stay per row."""
    e, h, i = 2, 1024, 256
    lay = random_layer(e, h, i, weight_format)
    for name, gsf, n, k, is_l1 in (("w13", "w13_global_sf", 2 * i, h, True), ("w2", "w2_global_sf", h, i, False)):
        w, sf = lay[name], lay[name + "_sf"]
        ow, osf, og = megamoe.transform_weights(w, sf, lay[gsf], weight_format=weight_format, is_l1=is_l1)
        c = osf.shape[2]
        tiled = scale_tiled(weight_format, n, k)
        assert tiled == (weight_format == "nvfp4" or is_l1), (name, c)
        # the rows' order (interleaved for L1) from the untiled view; then every byte at its tile address
        kernel_rows = scales_by_row(osf, weight_format, k)
        if is_l1:
            assert_interleaved(kernel_rows, sf, i, name + "_sf")
        else:
            assert_bitwise_equal(kernel_rows, sf, name + "_sf")
        flat = as_bytes(osf).reshape(e, -1)
        src = as_bytes(kernel_rows).reshape(e, -1)
        r = torch.arange(n).view(n, 1).expand(n, c)
        col = torch.arange(c).view(1, c).expand(n, c)
        addr = ((r // 256) * (c // 16) + col // 16) * 4096 + (r % 256) * 16 + col % 16 if tiled else r * c + col
        for x in range(e):
            assert torch.equal(flat[x][addr.reshape(-1)], src[x].reshape(-1)), (name, x)
        if weight_format == "mxfp4":
            assert torch.equal(og, kernel_rows.amax(2)), name


def test_transform_weights_scale_variants():
    """MXFP4 scales as float8_e8m0fnu come out as the same uint8 bytes; an NVFP4 scalar global scale is
    expanded to one per expert."""
    lay = random_layer(E, H, I, "mxfp4")
    a = megamoe.transform_weights(lay["w13"], lay["w13_sf"], None, weight_format="mxfp4", is_l1=True)
    b = megamoe.transform_weights(lay["w13"], lay["w13_sf"].view(torch.float8_e8m0fnu), None,
                                  weight_format="mxfp4", is_l1=True)
    assert b[1].dtype == torch.uint8
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    # The row exponents follow the interleaved rows: a scale raised in checkpoint up row I + 3 (kernel row 64 + 3)
    sf = lay["w13_sf"].clone()
    sf[1, I + 3, 5] = 200
    c = megamoe.transform_weights(lay["w13"], sf, None, weight_format="mxfp4", is_l1=True)
    assert c[2][1, 64 + 3] == 200 and torch.equal(c[2][0], a[2][0])
    nv = random_layer(E, H, I, "nvfp4")
    out = megamoe.transform_weights(nv["w2"], nv["w2_sf"], torch.tensor(0.125), weight_format="nvfp4",
                                    is_l1=False)
    assert torch.equal(out[2], torch.full((E,), 0.125))


# ------------------------------------------------------------------------------------------------
# Buffer layout
# ------------------------------------------------------------------------------------------------
def region_sizes(lay, top_k, hidden):
    cap, e_loc, rows = lay["max_tokens_per_rank"], lay["num_local_experts"], lay["pool_rows"]
    return {
        "error": 16, "num_tokens": 4, "expert_count": 4 * e_loc, "expert_offset": 4 * (e_loc + 1),
        "tile_offset": 4 * (e_loc + 1), "sched": 4 * (e_loc + 1),
        "peer_ptrs": 8 * lay["num_ranks"], "signal": 4 * (2 * lay["num_ranks"] + 1),  # per peer: 2 phases, + epoch
        "x": cap * lay["token_bytes"],
        "x_sf": cap * lay["token_sf_bytes"],
        "x_global_sf": 4 * cap, "topk_idx": 4 * cap * top_k, "topk_weights": 4 * cap * top_k,
        # with peers only: every rank's count and slot ids, pushed by its pre_dispatch
        "recv_count": 4 * lay["num_ranks"] if lay["num_ranks"] > 1 else 0,
        "recv_idx": 4 * lay["num_ranks"] * -(-cap * top_k // 32) * 32 if lay["num_ranks"] > 1 else 0,  # rows of 128 B
        "pool_src": 4 * rows, "dispatch_x": rows * lay["token_bytes"], "dispatch_sf": rows * lay["token_sf_bytes"],
        "dispatch_global_sf": 4 * rows, "dispatch_weight": 4 * rows, "pool": rows * lay["pool_row_bytes"],
        "pool_sf": rows * lay["pool_row_sf_bytes"], "pool_global_sf": 4 * rows,
        "combine": 2 * cap * top_k * hidden,
    }


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
@pytest.mark.parametrize("cfg", [(8, 1, 33, 3, 256, 384), (16, 1, 1, 4, 512, 256), (8, 1, 0, 3, 256, 384),
                                 (256, 4, 100, 6, 4096, 2048), (6, 2, 17, 6, 128, 128),
                                 # EP=8 at DeepSeek-V4 shapes (V4-Flash 8,192 and V4-Pro 2,048 tokens per rank)
                                 (256, 8, 8192, 6, 4096, 2048), (384, 8, 2048, 6, 7168, 3072),
                                 # regions past 2^31 (V4-Pro 8,192 tokens per rank) and past 2^32 (top_k 8)
                                 (384, 8, 8192, 6, 7168, 3072), (384, 8, 8192, 8, 7168, 3072)],
                         ids=lambda c: "E{}-R{}-T{}-K{}-H{}-I{}".format(*c))
def test_buffer_layout(cfg, act_format):
    e, ranks, cap, k, h, i = cfg
    lay = dict(megamoe.buffer_layout(e, ranks, cap, k, h, i, act_format))
    lay["max_tokens_per_rank"], lay["num_ranks"] = cap, ranks
    fp4 = act_format == "fp4"
    assert lay["num_local_experts"] == e // ranks
    assert lay["token_bytes"] == (h // 2 if fp4 else h)
    assert lay["token_sf_bytes"] == (h // 16 if fp4 else h // 32)  # FP8: H/32 covers H/128 float32 too
    assert lay["pool_row_bytes"] == (i // 2 if fp4 else i)
    assert lay["pool_rows"] % 128 == 0
    assert lay["pool_rows"] >= ranks * cap * min(k, e // ranks)
    sizes = region_sizes(lay, k, h)
    offsets = [lay[f"{r}_offset"] for r in LAYOUT_REGIONS]
    assert offsets[0] == 0
    assert all(o % 128 == 0 for o in offsets), offsets
    # Increasing (equal only after an empty region, e.g. max_tokens_per_rank = 0), never overlapping.
    assert all(a <= b for a, b in zip(offsets, offsets[1:])), offsets
    assert all(a < b for r, a, b in zip(LAYOUT_REGIONS, offsets, offsets[1:]) if sizes[r] > 0), offsets
    for r, nxt in zip(LAYOUT_REGIONS, LAYOUT_REGIONS[1:] + ("total",)):
        end = lay[f"{r}_offset"] + sizes[r]
        limit = lay["total_bytes"] if nxt == "total" else lay[f"{nxt}_offset"]
        assert end <= limit, f"region {r} ends at {end}, past {nxt} at {limit}"
    assert lay["total_bytes"] % 128 == 0


def _same_config_worker(rank, world, store_path, hidden_by_rank, results):
    import datetime
    import os
    import traceback
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        try:
            # The real entry point: with a matching configuration it goes on to refuse the CPU device (expert
            # parallelism needs CUDA symmetric memory), after the gather.
            megamoe.get_symm_buffer(dist.group.WORLD, 8, 16, 2, hidden_by_rank[rank], 128, device="cpu")
            results.put((rank, "no error"))
        except ValueError as err:
            results.put((rank, str(err)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # anything else: reported, never a silent hang of the other rank
        results.put((rank, "unexpected: " + traceback.format_exc()))


@pytest.mark.parametrize("hidden_by_rank", [(256, 256), (256, 512)], ids=["same", "hidden differs"])
def test_symm_buffer_config_must_match_across_ranks(hidden_by_rank, tmp_path):
    """get_symm_buffer's check (two CPU processes over gloo): ranks that size their buffers differently (the kernels
    address a peer's buffer with this rank's offsets) all get a ValueError naming the argument and each rank's value,
    before anything is allocated; the same configuration passes the check (and then meets the CPU device's refusal)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_same_config_worker, args=(r, 2, str(tmp_path / "store"), hidden_by_rank, results),
                         daemon=True) for r in range(2)]
    try:
        for proc in procs:
            proc.start()
        got = dict(results.get(timeout=120) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
        assert [proc.exitcode for proc in procs] == [0, 0], got
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    for rank in (0, 1):
        if hidden_by_rank[0] == hidden_by_rank[1]:
            assert got[rank].startswith("device:"), got  # past the check: the CPU device is refused next
        else:
            assert "hidden" in got[rank] and "group rank 0 256, group rank 1 512" in got[rank], got
            assert "top_k" not in got[rank] and "device" not in got[rank], got


def test_fp4_buffer_is_smaller():
    f8 = megamoe.buffer_layout(8, 1, 64, 3, 1024, 512, "fp8")
    f4 = megamoe.buffer_layout(8, 1, 64, 3, 1024, 512, "fp4")
    assert f4["token_bytes"] * 2 == f8["token_bytes"] == 1024
    assert f4["total_bytes"] < f8["total_bytes"]


@pytest.mark.parametrize("act_format", ["fp8", "fp4"])
def test_get_symm_buffer_cpu(act_format):
    """Plain uint8 tensor of exactly total_bytes, zeroed, 16-byte aligned (the ops require it for TMA),
    with the configuration recorded."""
    for cap in range(1, 9):
        b = megamoe.get_symm_buffer(None, 8, cap, 3, 256, 384, act_format=act_format, device="cpu")
        assert b.buffer.dtype == torch.uint8 and b.buffer.dim() == 1
        assert b.buffer.numel() == b.layout["total_bytes"]
        assert b.buffer.data_ptr() % 16 == 0
        assert not b.buffer.any()
        assert (b.num_experts, b.num_ranks, b.rank, b.max_tokens_per_rank, b.top_k, b.hidden,
                b.intermediate, b.act_format) == (8, 1, 0, cap, 3, 256, 384, act_format)
        assert b.config_args == (8, 1, 0, cap, 3)


# ------------------------------------------------------------------------------------------------
# Checked mode (bad expert ids)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("combo", [COMBOS[0], COMBOS[2]], ids=combo_id)
@pytest.mark.parametrize("bad", [E, E + 100, -2, -1000])
def test_check_mode_bad_expert_id(combo, bad):
    c = make_case(E, H, I, K, 10, *combo, seed=7, masked_fraction=0.0, idx_dtype=torch.int64)
    idx = c.topk_idx.clone()
    idx[6, 2] = bad
    masked = idx.clone()
    masked[6, 2] = -1
    ref = c.reference(topk_idx=masked)
    stats = torch.zeros(E, dtype=torch.int32)
    counts = torch.bincount(masked.reshape(-1)[masked.reshape(-1) >= 0], minlength=E).to(torch.int32)

    with pytest.raises(ValueError) as ei:
        megamoe.moe(c.x, idx, c.topk_weights, c.l1, c.l2, c.buffer, weight_format=c.weight_format, check=True)
    msg = str(ei.value)
    assert msg.startswith("topk_idx") and f"got {bad} " in msg and "token 6, slot 2" in msg, msg
    assert c.buffer.error_word().tolist() == [0, 0, 0, 0]  # reading the error clears it

    # The in-place op with check=True still wrote y (the slot skipped) before raising.
    megamoe.pre_dispatch(c.x, idx, c.topk_weights, c.buffer, weight_format=c.weight_format)
    y = nan_like(c.x)
    with pytest.raises(ValueError, match=f"topk_idx: .*got {bad} "):
        c.run_inplace(y, check=True)
    assert_bitwise_equal(y, ref, "y after checked call")

    # check=False: the slot is skipped silently, and it is not counted.
    y = megamoe.moe(c.x, idx, c.topk_weights, c.l1, c.l2, c.buffer, weight_format=c.weight_format,
                    check=False, recv_stats=stats)
    assert_bitwise_equal(y, ref, "unchecked")
    assert torch.equal(stats, counts)
    assert c.buffer.error_word().tolist() == [1, bad, 6, 2]


def test_check_mode_env(monkeypatch):
    c = make_case(E, H, I, K, 4, "fp8", "fp8", seed=11, masked_fraction=0.0)
    idx = c.topk_idx.clone()
    idx[0, 0] = 99
    monkeypatch.setenv("MEGAMOE_CHECK", "1")
    with pytest.raises(ValueError, match="topk_idx: .*got 99 "):
        megamoe.moe(c.x, idx, c.topk_weights, c.l1, c.l2, c.buffer)
    megamoe.moe(c.x, idx, c.topk_weights, c.l1, c.l2, c.buffer, check=False)  # explicit False wins
    assert_bitwise_equal(c.run(), c.ref, "good ids under MEGAMOE_CHECK=1")  # no error, no raise
    monkeypatch.setenv("MEGAMOE_CHECK", "0")
    y = megamoe.moe(c.x, idx, c.topk_weights, c.l1, c.l2, c.buffer)
    masked = idx.clone()
    masked[0, 0] = -1
    assert_bitwise_equal(y, c.reference(topk_idx=masked), "MEGAMOE_CHECK=0")
