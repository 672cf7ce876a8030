"""Argument validation (DESIGN.md §9): every bad input raises ValueError / TypeError / NotImplementedError
(TORCH_CHECK_VALUE / _TYPE / _NOT_IMPLEMENTED) with a message that starts with the argument's name, and
nothing is written to y, the buffer or recv_stats before the check fails."""
import dataclasses

import pytest
import torch

import megamoe
from megamoe.ops import ops
from conftest import as_bytes, make_case

E, H, I, K, T, CAP = 8, 256, 256, 2, 5, 8


class Ctx:
    """A valid call's arguments; a test breaks one of them. The buffer holds random bytes overwritten by a
    valid pre_dispatch, y and recv_stats hold random values, so any write shows up."""

    def __init__(self, weight_format="fp8", act_format="fp8"):
        c = make_case(E, H, I, K, T, weight_format, act_format, seed=21, max_tokens=CAP, with_ref=False)
        gen = torch.Generator().manual_seed(5)
        c.buffer.buffer.copy_(torch.randint(0, 256, c.buffer.buffer.shape, generator=gen, dtype=torch.uint8))
        megamoe.pre_dispatch(c.x, c.topk_idx, c.topk_weights, c.buffer, weight_format=weight_format)
        self.case = c
        self.wf, self.af = weight_format, act_format
        self.x, self.idx, self.w = c.x, c.topk_idx, c.topk_weights
        self.l1, self.l2, self.buf = list(c.l1), list(c.l2), c.buffer
        self.y = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        self.stats = torch.randint(0, 100, (E,), generator=gen, dtype=torch.int32)
        self.layer = c.layer

    def watched(self):
        return [self.y, self.buf.buffer, self.stats, self.x, self.idx, self.w, *self.l1, *self.l2]

    # Calls with every argument overridable.
    def pre_dispatch(self, x=None, idx=None, w=None, buffer=None, weight_format=None):
        megamoe.pre_dispatch(self.x if x is None else x, self.idx if idx is None else idx,
                             self.w if w is None else w, self.buf if buffer is None else buffer,
                             weight_format=self.wf if weight_format is None else weight_format)

    def moe_op(self, y=None, l1=None, l2=None, buffer=None, **kwargs):
        y = self.y if y is None else y
        l1, l2 = self.l1 if l1 is None else l1, self.l2 if l2 is None else l2
        buffer = self.buf if buffer is None else buffer
        kwargs.setdefault("recv_stats", self.stats)
        if self.wf == "fp8":
            megamoe.fp8_mega_moe(y, l1, l2, buffer, **kwargs)
        else:
            kwargs.setdefault("weight_format", self.wf)
            megamoe.fp8_fp4_mega_moe(y, l1, l2, buffer, **kwargs)

    def raw_fp4_op(self, weight_format=None, act_format=None):
        b = self.buf
        ops.fp8_fp4_mega_moe(self.y, *self.l1, *self.l2, b.buffer, *b.config_args,
                             weight_format or self.wf, act_format or self.af, None, True, self.stats)


def replaced(seq, i, value):
    out = list(seq)
    out[i] = value
    return out


def noncontig(t):
    """Same shape, dtype and values, but not contiguous."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def misaligned_copy(t):
    """A copy of ``t`` starting 8 bytes past a 16-byte boundary."""
    base = torch.empty(t.numel() + 64, dtype=t.dtype)
    start = (8 - base.data_ptr()) % 16
    out = base[start:start + t.numel()]
    out.copy_(t)
    assert out.data_ptr() % 16 == 8
    return out


def with_config(buf, **changes):
    return dataclasses.replace(buf, **changes)


def two_rank_buffer(buf):
    """The same buffer described as rank 0 of two, with the bytes that layout takes (its receive areas)."""
    two = with_config(buf, num_ranks=2, rank=0)
    return with_config(two, buffer=torch.zeros(two.layout["total_bytes"], dtype=torch.uint8, device=buf.buffer.device))


# (id, (weight_format, act_format), call(ctx), exception type, names the message must contain (first one
# at the start)).
CASES = [
    # ---------------------------------------------------------------- pre_dispatch
    ("pd-x-dtype", ("fp8", "fp8"), lambda c: c.pre_dispatch(x=c.x.float()), TypeError, ["x", "BFloat16"]),
    ("pd-x-dim", ("fp8", "fp8"), lambda c: c.pre_dispatch(x=c.x[None]), ValueError, ["x", "2 dimensions"]),
    ("pd-x-noncontig", ("fp8", "fp8"), lambda c: c.pre_dispatch(x=noncontig(c.x)), ValueError,
     ["x", "contiguous"]),
    ("pd-hidden-not-128", ("fp8", "fp8"), lambda c: c.pre_dispatch(x=c.x[:, :192].contiguous()), ValueError,
     ["x.size(1) (hidden)", "multiple of 128", "192"]),
    ("pd-hidden-mismatch", ("fp8", "fp8"), lambda c: c.pre_dispatch(x=torch.zeros(T, 2 * H, dtype=torch.bfloat16)),
     ValueError, ["x", "hidden", str(2 * H)]),
    ("pd-T-over-capacity", ("fp8", "fp8"),
     lambda c: c.pre_dispatch(x=torch.zeros(CAP + 1, H, dtype=torch.bfloat16),
                              idx=torch.zeros(CAP + 1, K, dtype=torch.int32), w=torch.zeros(CAP + 1, K)),
     ValueError, ["x", "max_tokens_per_rank", str(CAP + 1)]),
    ("pd-weight-format-unknown", ("fp8", "fp8"), lambda c: c.pre_dispatch(weight_format="fp16"), ValueError,
     ["weight_format", "'fp16'"]),
    ("pd-act-format-unknown", ("fp8", "fp8"),
     lambda c: ops.pre_dispatch(c.x, c.idx, c.w, c.buf.buffer, *c.buf.config_args, I, "fp8", "int8"), ValueError,
     ["act_format", "'int8'"]),
    ("pd-fp8-weights-fp4-acts", ("mxfp4", "fp4"), lambda c: c.pre_dispatch(weight_format="fp8"), ValueError,
     ["act_format", "fp4"]),
    ("pd-idx-dtype", ("fp8", "fp8"), lambda c: c.pre_dispatch(idx=c.idx.float()), TypeError,
     ["topk_idx", "int32 or int64"]),
    ("pd-idx-shape", ("fp8", "fp8"), lambda c: c.pre_dispatch(idx=torch.zeros(T, K + 1, dtype=torch.int32)),
     ValueError, ["topk_idx", "size 2 at dim 1"]),
    ("pd-idx-rows", ("fp8", "fp8"), lambda c: c.pre_dispatch(idx=c.idx[:-1]), ValueError,
     ["topk_idx", f"size {T} at dim 0"]),
    ("pd-idx-noncontig", ("fp8", "fp8"), lambda c: c.pre_dispatch(idx=noncontig(c.idx)), ValueError,
     ["topk_idx", "contiguous"]),
    ("pd-weights-dtype", ("fp8", "fp8"), lambda c: c.pre_dispatch(w=c.w.to(torch.bfloat16)), TypeError,
     ["topk_weights", "Float"]),
    ("pd-weights-shape", ("fp8", "fp8"), lambda c: c.pre_dispatch(w=c.w[:, :1].contiguous()), ValueError,
     ["topk_weights", "dim 1"]),
    ("pd-buffer-dtype", ("fp8", "fp8"),
     lambda c: c.pre_dispatch(buffer=with_config(c.buf, buffer=c.buf.buffer.view(torch.int8))), TypeError,
     ["buffer", "Byte"]),
    ("pd-buffer-too-small", ("fp8", "fp8"),
     lambda c: c.pre_dispatch(buffer=with_config(c.buf, buffer=c.buf.buffer[:-128])), ValueError,
     ["buffer", "bytes"]),
    ("pd-buffer-misaligned", ("fp8", "fp8"),
     lambda c: c.pre_dispatch(buffer=with_config(c.buf, buffer=misaligned_copy(c.buf.buffer))), ValueError,
     ["buffer", "16-byte aligned"]),
    ("pd-buffer-2d", ("fp8", "fp8"),
     lambda c: c.pre_dispatch(buffer=with_config(c.buf, buffer=c.buf.buffer.view(-1, 128))), ValueError,
     ["buffer", "1 dimensions"]),
    ("pd-fp8-buffer-more-tokens", ("fp8", "fp8"),
     lambda c: c.pre_dispatch(buffer=with_config(c.buf, max_tokens_per_rank=4 * CAP)), ValueError,
     ["buffer", "bytes"]),
    ("pd-rank-out-of-range", ("fp8", "fp8"), lambda c: c.pre_dispatch(buffer=with_config(c.buf, rank=1)),
     ValueError, ["rank", "[0, 1)", "got 1"]),
    ("pd-num-experts-zero", ("fp8", "fp8"), lambda c: c.pre_dispatch(buffer=with_config(c.buf, num_experts=0)),
     ValueError, ["num_experts", "positive"]),
    ("pd-experts-not-split", ("fp8", "fp8"),
     lambda c: c.pre_dispatch(buffer=with_config(c.buf, num_ranks=3, rank=0)), ValueError,
     ["num_experts", "num_ranks"]),
    ("pd-top-k-above-experts", ("fp8", "fp8"),
     lambda c: ops.pre_dispatch(c.x, c.idx, c.w, c.buf.buffer, E, 1, 0, CAP, E + 1, I, "fp8", "fp8"),
     ValueError, ["top_k", "num_experts"]),
    ("pd-intermediate-not-128", ("fp8", "fp8"),
     lambda c: ops.pre_dispatch(c.x, c.idx, c.w, c.buf.buffer, E, 1, 0, CAP, K, 200, "fp8", "fp8"), ValueError,
     ["intermediate", "multiple of 128", "200"]),
    # ---------------------------------------------------------------- fp8_mega_moe
    ("fp8-y-dtype", ("fp8", "fp8"), lambda c: c.moe_op(y=c.y.float()), TypeError, ["y", "BFloat16"]),
    ("fp8-y-noncontig", ("fp8", "fp8"), lambda c: c.moe_op(y=noncontig(c.y)), ValueError, ["y", "contiguous"]),
    ("fp8-y-hidden-not-128", ("fp8", "fp8"), lambda c: c.moe_op(y=torch.zeros(T, 192, dtype=torch.bfloat16)),
     ValueError, ["y.size(1) (hidden)", "192"]),
    ("fp8-T-over-capacity", ("fp8", "fp8"), lambda c: c.moe_op(y=torch.zeros(CAP + 1, H, dtype=torch.bfloat16)),
     ValueError, ["y", "max_tokens_per_rank", str(CAP + 1)]),
    ("fp8-l1-dtype", ("fp8", "fp8"), lambda c: c.moe_op(l1=replaced(c.l1, 0, c.l1[0].view(torch.uint8))),
     TypeError, ["l1_weights", "Float8_e4m3fn", "Byte"]),
    ("fp8-l1-num-experts", ("fp8", "fp8"), lambda c: c.moe_op(l1=[t[:E - 1].contiguous() for t in c.l1]),
     ValueError, ["l1_weights", f"size {E} at dim 0"]),
    ("fp8-l1-noncontig", ("fp8", "fp8"), lambda c: c.moe_op(l1=replaced(c.l1, 0, noncontig(c.l1[0]))),
     ValueError, ["l1_weights", "contiguous"]),
    ("fp8-l1-sf-checkpoint-layout", ("fp8", "fp8"), lambda c: c.moe_op(l1=replaced(c.l1, 1, c.layer["w13_sf"])),
     ValueError, ["l1_weights_sf", f"size {2 * I // 64} at dim 1"]),
    ("fp8-l1-sf-dtype", ("fp8", "fp8"), lambda c: c.moe_op(l1=replaced(c.l1, 1, c.l1[1].double())), TypeError,
     ["l1_weights_sf", "Float"]),
    ("fp8-l2-shape", ("fp8", "fp8"), lambda c: c.moe_op(l2=replaced(c.l2, 0, c.l2[0][:, :H - 128].contiguous())),
     ValueError, ["l2_weights", f"size {H} at dim 1"]),
    ("fp8-l2-dim", ("fp8", "fp8"), lambda c: c.moe_op(l2=replaced(c.l2, 0, c.l2[0][0])), ValueError,
     ["l2_weights", "3 dimensions"]),
    ("fp8-l2-sf-experts", ("fp8", "fp8"), lambda c: c.moe_op(l2=replaced(c.l2, 1, c.l2[1][:2].contiguous())),
     ValueError, ["l2_weights_sf", f"size {E} at dim 0"]),
    ("fp8-intermediate-mismatch", ("fp8", "fp8"),
     lambda c: c.moe_op(l2=replaced(c.l2, 0, torch.zeros(E, H, 2 * I, dtype=torch.float8_e4m3fn))), ValueError,
     ["l2_weights", "intermediate", str(2 * I)]),
    ("fp8-buffer-fp4", ("fp8", "fp8"),
     lambda c: c.moe_op(buffer=megamoe.get_symm_buffer(None, E, CAP, K, H, I, act_format="fp4", device="cpu")),
     ValueError, ["buffer", "bytes"]),
    ("fp8-buffer-dtype", ("fp8", "fp8"),
     lambda c: c.moe_op(buffer=with_config(c.buf, buffer=c.buf.buffer.view(torch.int8))), TypeError,
     ["buffer", "Byte"]),
    ("fp8-buffer-too-small", ("fp8", "fp8"),
     lambda c: c.moe_op(buffer=with_config(c.buf, buffer=c.buf.buffer[:c.buf.layout["combine_offset"]])),
     ValueError, ["buffer", "bytes"]),
    ("fp8-clamp-negative", ("fp8", "fp8"), lambda c: c.moe_op(activation_clamp=-1.0), ValueError,
     ["activation_clamp", "-1"]),
    ("fp8-clamp-zero", ("fp8", "fp8"), lambda c: c.moe_op(activation_clamp=0.0), ValueError,
     ["activation_clamp", "positive"]),
    ("fp8-clamp-nan", ("fp8", "fp8"), lambda c: c.moe_op(activation_clamp=float("nan")), ValueError,
     ["activation_clamp", "nan"]),
    ("fp8-clamp-inf", ("fp8", "fp8"), lambda c: c.moe_op(activation_clamp=float("inf")), ValueError,
     ["activation_clamp", "inf"]),
    ("fp8-recv-stats-shape", ("fp8", "fp8"), lambda c: c.moe_op(recv_stats=torch.zeros(E + 1, dtype=torch.int32)),
     ValueError, ["recv_stats", f"size {E} at dim 0"]),
    ("fp8-recv-stats-dtype", ("fp8", "fp8"), lambda c: c.moe_op(recv_stats=torch.zeros(E, dtype=torch.int64)),
     TypeError, ["recv_stats", "Int", "Long"]),
    ("fp8-recv-stats-2d", ("fp8", "fp8"), lambda c: c.moe_op(recv_stats=torch.zeros(1, E, dtype=torch.int32)),
     ValueError, ["recv_stats", "1 dimensions"]),
    ("fp8-num-ranks-2-cpu", ("fp8", "fp8"),
     lambda c: c.moe_op(l1=[t[:E // 2].contiguous() for t in c.l1], l2=[t[:E // 2].contiguous() for t in c.l2],
                        buffer=two_rank_buffer(c.buf), recv_stats=c.stats[:E // 2]),
     NotImplementedError, ["num_ranks", "got 2"]),
    # ---------------------------------------------------------------- fp8_fp4_mega_moe
    ("fp4-given-fp8-weights", ("fp8", "fp8"),
     lambda c: megamoe.fp8_fp4_mega_moe(c.y, c.l1, c.l2, c.buf, weight_format="fp8"), ValueError,
     ["weight_format", "fp8_mega_moe"]),
    ("fp4-weight-format-unknown", ("mxfp4", "fp8"), lambda c: c.raw_fp4_op(weight_format="int4"), ValueError,
     ["weight_format", "'int4'"]),
    ("fp4-act-format-unknown", ("mxfp4", "fp8"), lambda c: c.raw_fp4_op(act_format="fp6"), ValueError,
     ["act_format", "'fp6'"]),
    ("fp4-mx-weights-as-nvfp4", ("mxfp4", "fp8"), lambda c: c.moe_op(weight_format="nvfp4"), TypeError,
     ["l1_weights_sf", "Float8_e4m3fn"]),
    ("fp4-weights-dtype", ("mxfp4", "fp8"),
     lambda c: c.moe_op(l1=replaced(c.l1, 0, c.l1[0].view(torch.float8_e4m3fn))), TypeError,
     ["l1_weights", "Byte"]),
    ("fp4-unpacked-weights", ("mxfp4", "fp8"),
     lambda c: c.moe_op(l1=replaced(c.l1, 0, torch.zeros(E, 2 * I, H, dtype=torch.uint8))), ValueError,
     ["l1_weights", f"size {H // 2} at dim 2"]),
    ("fp4-sf-shape", ("nvfp4", "fp4"), lambda c: c.moe_op(l2=replaced(c.l2, 1, c.l2[1][:, :, :H // 32].contiguous())),
     ValueError, ["l2_weights_sf", f"size {I // 16} at dim 2"]),
    ("fp4-global-sf-shape", ("nvfp4", "fp8"), lambda c: c.moe_op(l1=replaced(c.l1, 2, torch.ones(E + 1))),
     ValueError, ["l1_weights_global_sf", f"size {E} at dim 0"]),
    ("fp4-global-sf-dtype", ("nvfp4", "fp4"), lambda c: c.moe_op(l2=replaced(c.l2, 2, c.l2[2].double())),
     TypeError, ["l2_weights_global_sf", "Float"]),
    ("fp4-mxfp4-row-exp-as-global", ("mxfp4", "fp8"), lambda c: c.moe_op(l1=replaced(c.l1, 2, torch.ones(E))),
     TypeError, ["l1_weights_global_sf", "Byte", "largest UE8M0", "Float"]),
    ("fp4-mxfp4-row-exp-shape", ("mxfp4", "fp4"),
     lambda c: c.moe_op(l2=replaced(c.l2, 2, c.l2[2][:, :H // 2].contiguous())), ValueError,
     ["l2_weights_global_sf", f"size {H} at dim 1"]),
    ("fp4-buffer-act-mismatch", ("mxfp4", "fp4"),
     lambda c: c.moe_op(buffer=with_config(c.buf, act_format="fp8")), ValueError, ["buffer", "bytes"]),
    ("fp4-clamp-negative", ("nvfp4", "fp4"), lambda c: c.moe_op(activation_clamp=-0.5), ValueError,
     ["activation_clamp", "-0.5"]),
    ("fp4-recv-stats-dtype", ("mxfp4", "fp4"), lambda c: c.moe_op(recv_stats=torch.zeros(E)), TypeError,
     ["recv_stats", "Int"]),
    ("fp4-T-over-capacity", ("nvfp4", "fp8"), lambda c: c.moe_op(y=torch.zeros(CAP + 3, H, dtype=torch.bfloat16)),
     ValueError, ["y", "max_tokens_per_rank"]),
    # ---------------------------------------------------------------- transform_weights
    ("tw-weight-format-unknown", ("fp8", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w13"], c.layer["w13_sf"], weight_format="e5m2", is_l1=True),
     ValueError, ["weight_format", "'e5m2'"]),
    ("tw-fp8-weights-dtype", ("fp8", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w13"].view(torch.uint8), c.layer["w13_sf"], is_l1=True),
     TypeError, ["weights", "Float8_e4m3fn"]),
    ("tw-fp8-sf-shape", ("fp8", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w13"], c.l1[1], is_l1=True), ValueError,
     ["weights_sf", f"size {2 * I // 128} at dim 1"]),
    ("tw-weights-dim", ("fp8", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w13"][0], c.layer["w13_sf"], is_l1=True), ValueError,
     ["weights", "3 dimensions"]),
    ("tw-l1-rows-not-256", ("fp8", "fp8"),
     lambda c: megamoe.transform_weights(torch.zeros(E, 384, H, dtype=torch.float8_e4m3fn),
                                         torch.ones(E, 3, H // 128), is_l1=True), ValueError,
     ["weights.size(1) (2 * intermediate)", "256", "384"]),
    ("tw-fp8-global-given", ("fp8", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w13"], c.layer["w13_sf"], torch.ones(E), is_l1=True),
     ValueError, ["weights_global_sf", "'fp8'"]),
    ("tw-mxfp4-global-given", ("mxfp4", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w2"], c.layer["w2_sf"], torch.ones(E), weight_format="mxfp4",
                                         is_l1=False), ValueError, ["weights_global_sf", "'mxfp4'"]),
    ("tw-mxfp4-sf-dtype", ("mxfp4", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w2"], c.layer["w2_sf"].float(), weight_format="mxfp4",
                                         is_l1=False), TypeError, ["weights_sf", "UE8M0"]),
    ("tw-nvfp4-no-global", ("nvfp4", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w13"], c.layer["w13_sf"], None, weight_format="nvfp4",
                                         is_l1=True), ValueError, ["weights_global_sf", "NVFP4"]),
    ("tw-nvfp4-global-dtype", ("nvfp4", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w13"], c.layer["w13_sf"], c.layer["w13_global_sf"].double(),
                                         weight_format="nvfp4", is_l1=True), TypeError,
     ["weights_global_sf", "Float"]),
    ("tw-nvfp4-global-count", ("nvfp4", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w13"], c.layer["w13_sf"], torch.ones(3), weight_format="nvfp4",
                                         is_l1=True), ValueError, ["weights_global_sf", f"expected {E}"]),
    ("tw-nvfp4-sf-as-mxfp4", ("nvfp4", "fp8"),
     lambda c: megamoe.transform_weights(c.layer["w13"], c.layer["w13_sf"].view(torch.uint8),
                                         c.layer["w13_global_sf"], weight_format="nvfp4", is_l1=True), TypeError,
     ["weights_sf", "Float8_e4m3fn"]),
    # ---------------------------------------------------------------- buffer layout / allocation
    ("layout-hidden", ("fp8", "fp8"), lambda c: megamoe.buffer_layout(E, 1, CAP, K, 200, I, "fp8"), ValueError,
     ["hidden", "multiple of 128", "200"]),
    ("layout-intermediate", ("fp8", "fp8"), lambda c: ops.get_buffer_layout(E, 1, CAP, K, H, 0, "fp8"), ValueError,
     ["intermediate", "positive"]),
    ("layout-max-tokens", ("fp8", "fp8"), lambda c: ops.get_buffer_layout(E, 1, -1, K, H, I, "fp8"), ValueError,
     ["max_tokens_per_rank", "-1"]),
    ("layout-act-format", ("fp8", "fp8"), lambda c: ops.get_buffer_layout(E, 1, CAP, K, H, I, "nvfp4"), ValueError,
     ["act_format", "'nvfp4'"]),
    ("layout-num-ranks", ("fp8", "fp8"), lambda c: ops.get_buffer_layout(E, 0, CAP, K, H, I, "fp8"), ValueError,
     ["num_ranks", "positive"]),
    ("layout-num-ranks-over-128", ("fp8", "fp8"), lambda c: ops.get_buffer_layout(258, 129, CAP, K, H, I, "fp8"),
     ValueError, ["num_ranks", "at most 128", "129"]),
    ("layout-pool-rows-int32", ("fp8", "fp8"), lambda c: ops.get_buffer_layout(256, 8, 1 << 25, 8, H, I, "fp8"),
     ValueError, ["max_tokens_per_rank", "int32", "8 x 33554432 x 8"]),
    ("symm-buffer-act-format", ("fp8", "fp8"),
     lambda c: megamoe.get_symm_buffer(None, E, CAP, K, H, I, act_format="bf16", device="cpu"), ValueError,
     ["act_format", "'bf16'"]),
]


@pytest.mark.parametrize("fmt, call, exc, names", [pytest.param(f, call, exc, names, id=i)
                                                   for i, f, call, exc, names in CASES])
def test_bad_input_raises_and_writes_nothing(fmt, call, exc, names):
    ctx = Ctx(*fmt)
    before = [as_bytes(t) for t in ctx.watched()]
    with pytest.raises(exc) as ei:
        call(ctx)
    assert type(ei.value) is exc, f"{type(ei.value).__name__}: {ei.value}"
    msg = str(ei.value)
    assert msg.startswith(names[0]), msg
    for name in names[1:]:
        assert name in msg, f"{name!r} not in {msg!r}"
    after = [as_bytes(t) for t in ctx.watched()]
    labels = ["y", "buffer", "recv_stats", "x", "topk_idx", "topk_weights", "l1", "l1_sf", "l1_global_sf",
              "l2", "l2_sf", "l2_global_sf"]
    for label, b, a in zip(labels, before, after):
        assert torch.equal(b, a), f"{label} was written before the check failed"


def test_case_ids_are_distinct_and_many():
    ids = [c[0] for c in CASES]
    assert len(set(ids)) == len(ids)
    assert len(ids) >= 20


@pytest.mark.parametrize("fmt", [("fp8", "fp8"), ("mxfp4", "fp4"), ("nvfp4", "fp8")])
def test_valid_call_writes(fmt):
    """Control for the harness above: unmodified calls succeed, and the snapshots see their writes (y and
    recv_stats by the fused op; the buffer by pre_dispatch; the CPU fused op only reads the buffer)."""
    ctx = Ctx(*fmt)
    y0, b0, s0 = as_bytes(ctx.y), as_bytes(ctx.buf.buffer), ctx.stats.clone()
    ctx.moe_op()
    assert not torch.equal(y0, as_bytes(ctx.y))
    assert torch.equal(ctx.stats - s0, torch.bincount(ctx.idx[ctx.idx >= 0].long(), minlength=E).int())
    ctx.pre_dispatch(x=-ctx.x)
    assert not torch.equal(b0, as_bytes(ctx.buf.buffer))


@pytest.mark.parametrize("code,exc,pattern", [
    (1, ValueError, r"topk_idx: expert id outside \[-1, num_experts\): got 9 at token 2, slot 1"),
    (2, ValueError, r"token count above the buffer's capacity: got 9 from rank 1"),
    (3, RuntimeError, r"buffer's peer table does not hold this buffer .*: rank 9 \(this rank: 0 of 1\)"),
    (4, RuntimeError, r"timed out waiting for a peer rank .*: rank 9 \(this rank: 0 of 1\)"),
    (5, RuntimeError, r"the FP4 GEMV read an expert id before pre_dispatch's store of it was visible \(slot 1: read 9\)"),
    (77, ValueError, r"unknown error code 77: got 9"),
])
def test_error_word_messages(code, exc, pattern):
    """check_error turns each code the kernels write into the error word (code, value, token, slot) into its message,
    and clears the word."""
    buf = megamoe.get_symm_buffer(None, E, CAP, K, H, I, device="cpu")
    buf.error_word().copy_(torch.tensor([code, 9, 2, 1], dtype=torch.int32))
    with pytest.raises(exc, match=pattern):
        buf.check_error()
    assert torch.equal(buf.error_word(), torch.zeros(4, dtype=torch.int32))
    buf.check_error()
