"""End to end: a small model (embedding -> 2 blocks of router + MegaMoEExperts + residual -> head), run
eagerly, under torch.compile(fullgraph=True) and (CUDA) captured in a CUDA graph.

- eager, compiled and graph-replayed outputs are bitwise equal (same kernels, deterministic);
- each block's expert output matches megamoe.reference (float32, from the layer's checkpoint tensors) on the
  inputs and routing that block saw (1e-2);
- one compilation serves every token count of a bucket (dynamic token dimension);
- a CUDA graph replays correctly with new inputs copied into its static input.
The CPU variants run the C++ CPU ops (CI has no GPU) and compile with aot_eager (Dynamo, the fake impls and
functionalization of the mutating ops, without inductor's C++ build, too slow for a 2-core CI); CUDA compiles
with inductor.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import megamoe
from conftest import COMBOS, CUDA_MARKS, HAS_CUDA, random_layer, reference_output, rel_err
from megamoe import module as mm
from megamoe import reference

E, H, I, K, VOCAB, MAX_T = 8, 256, 384, 3, 64, 32
_names = itertools.count()


def _params():
    out = []
    for device in ("cpu", "cuda"):
        for fmt, act in COMBOS:
            marks = list(CUDA_MARKS) if device == "cuda" else []
            out.append(pytest.param(device, fmt, act, marks=marks, id=f"{device}-{fmt}-a{act}"))
    return out


def _tracing_or_capturing() -> bool:
    return torch.compiler.is_compiling() or (HAS_CUDA and torch.cuda.is_current_stream_capturing())


class Block(torch.nn.Module):
    def __init__(self, layer, weight_format, act_format, device, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.router = torch.nn.Parameter((torch.randn(E, H, generator=gen) / H ** 0.5).to(device, torch.bfloat16),
                                         requires_grad=False)
        self.experts = megamoe.MegaMoEExperts(
            megamoe.MegaMoEConfig(max_tokens_per_rank=MAX_T, weight_format=weight_format, act_format=act_format,
                                  device=device),
            num_experts=E, num_local_experts=E, experts_start_idx=0, top_k=K, hidden_size=H, intermediate_size=I,
            prefix=f"test_model_e2e.{next(_names)}")
        for e in range(E):
            for name, shard, tensor in reference.checkpoint_shards(layer, weight_format, e):
                param = getattr(self.experts, name)
                param.weight_loader(param, tensor.to(device), f"experts.{e}.{shard}.{name}", shard, e)
        self.experts.finalize_weights()
        self.seen = None  # (h, idx, weights, expert output) of the last eager call, for the reference check

    def forward(self, h):
        scores = F.softplus(F.linear(h, self.router).float()).sqrt()  # DeepSeek-V4's sqrt-softplus routing
        w, idx = scores.topk(K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = self.experts(h, w, idx)
        if not _tracing_or_capturing():
            self.seen = (h, idx, w, out)
        return h + out


class Model(torch.nn.Module):
    def __init__(self, weight_format, device, act_format="fp8"):
        super().__init__()
        self.weight_format, self.act_format = weight_format, act_format
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, H, generator=gen).to(device, torch.bfloat16),
                                        requires_grad=False)
        self.layers = [random_layer(E, H, I, weight_format, seed=10 + j) for j in range(2)]
        self.blocks = torch.nn.ModuleList(Block(self.layers[j], weight_format, act_format, device, 20 + j)
                                          for j in range(2))
        self.head = torch.nn.Parameter((torch.randn(VOCAB, H, generator=gen) / H ** 0.5).to(device, torch.bfloat16),
                                       requires_grad=False)

    def forward(self, tokens):
        h = F.embedding(tokens, self.embed)
        for block in self.blocks:
            h = block(h)
        return F.linear(h, self.head).float()


@pytest.fixture(autouse=True)
def fresh_buffers():
    mm.clear_symm_buffer_cache()
    yield
    mm.clear_symm_buffer_cache()


def tokens(n, seed, device):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


def check_blocks_against_reference(model):
    for block, layer in zip(model.blocks, model.layers):
        h, idx, w, out = block.seen
        ref = reference_output(layer, h.cpu(), idx.cpu(), w.cpu(), model.weight_format, model.act_format)
        assert ref.float().norm() > 0
        assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("device,weight_format,act_format", _params())
def test_eager_compile_agree_and_match_reference(device, weight_format, act_format):
    model = Model(weight_format, device, act_format)
    t = tokens(9, 1, device)
    eager = model(t)
    assert torch.isfinite(eager).all()
    check_blocks_against_reference(model)

    torch._dynamo.reset()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(len(compiles))
        if device == "cuda":
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(t), eager)
    for n, seed in ((5, 2), (17, 3), (MAX_T, 4)):
        tn = tokens(n, seed, device)
        assert torch.equal(compiled(tn), model(tn))
    assert len(compiles) == 1, f"expected one compilation for token counts 9, 5, 17, {MAX_T}; got {len(compiles)}"


@pytest.mark.parametrize("device,weight_format,act_format", [p for p in _params() if p.values[0] == "cuda"])
def test_cuda_graph_replay_with_new_inputs(device, weight_format, act_format):
    model = Model(weight_format, device, act_format)
    static = tokens(MAX_T, 5, device)
    model(static)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model(static)
    for seed in (6, 7, 8):
        fresh = tokens(MAX_T, seed, device)
        static.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        want = model(fresh)
        assert torch.equal(out, want)
        check_blocks_against_reference(model)


def test_too_many_tokens_raise():
    model = Model("fp8", "cpu")
    with pytest.raises(ValueError, match="hidden_states"):
        model(tokens(MAX_T + 1, 9, "cpu"))
