"""Expert-parallel correctness checks: one process per GPU, every rank checks its own output.

The EP result of each rank must equal, bit for bit, the rows of that rank in the single-GPU (EP=1) result
of the same global batch with the same weights: the per-element arithmetic does not depend on which rank
computes a row (K order, promotion and requantization are per element; combine sums slots in slot order).

Run directly on a multi-GPU machine::

    python -m torch.distributed.run --nproc-per-node 2 tests/ep_cases.py [--shapes small,flash[,flash-large]]
        [--formats fp8:fp8,mxfp4:fp8,mxfp4:fp4,nvfp4:fp8,nvfp4:fp4]

``--formats`` lists (weight format, activation format) pairs; FP4 pairs run every check except the module
one (its FP4 checkpoint loading is covered on one GPU).

or through ``tests/test_ep.py`` (pytest spawns the processes).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

import megamoe
from megamoe import reference

# name -> (num_experts, hidden, intermediate, top_k); experts divisible by 2, 4 and 8 ranks.
SHAPES = {
    "small": (16, 256, 384, 3),
    "medium": (64, 1024, 512, 6),
    "flash": (256, 4096, 2048, 6),
    "flash-large": (256, 4096, 2048, 6),  # V4-Flash with 8192 tokens per rank of capacity (see CAPACITY)
}
# Tokens per rank a shape's buffer holds. flash-large: at 8 ranks the buffer's later regions start past 2^31
# bytes (every address computation must be 64-bit); not in the default --shapes (its EP=1 reference of the
# full-capacity case runs ranks x 8192 tokens on each GPU).
CAPACITY = {"small": 400, "medium": 400, "flash": 64, "flash-large": 8192}


@contextlib.contextmanager
def env_set(var: str, value: str):
    """`var` = `value` inside the block (the ops read their MEGAMOE_* switches per call), restored after it."""
    saved = os.environ.get(var)
    os.environ[var] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = saved


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


class Layer:
    """One global layer (identical on every rank: same seeds) in ``weight_format``, its kernel-layout
    weights, and this rank's slice of experts."""

    def __init__(self, shape: str, device: torch.device, weight_format: str = "fp8", act_format: str = "fp8"):
        self.num_experts, self.hidden, self.intermediate, self.top_k = SHAPES[shape]
        self.weight_format, self.act_format = weight_format, act_format
        rank, world = dist.get_rank(), dist.get_world_size()
        e, h, i = self.num_experts, self.hidden, self.intermediate
        self.w13_global_sf = self.w2_global_sf = None
        if weight_format == "fp8":
            gen = torch.Generator(device=device).manual_seed(1234)
            self.w13, self.w13_sf = reference.make_fp8_block_weights(e, 2 * i, h, generator=gen, device=device)
            self.w2, self.w2_sf = reference.make_fp8_block_weights(e, h, i, generator=gen, device=device)
        else:
            t = reference.make_random_layer(e, h, i, weight_format, seed=1234, device=device)
            self.w13, self.w13_sf, self.w13_global_sf = t["w13"], t["w13_sf"], t["w13_global_sf"]
            self.w2, self.w2_sf, self.w2_global_sf = t["w2"], t["w2_sf"], t["w2_global_sf"]
        self.l1 = megamoe.transform_weights(self.w13, self.w13_sf, self.w13_global_sf, weight_format=weight_format,
                                            is_l1=True)
        self.l2 = megamoe.transform_weights(self.w2, self.w2_sf, self.w2_global_sf, weight_format=weight_format,
                                            is_l1=False)
        self.num_local = e // world
        lo, hi = rank * self.num_local, (rank + 1) * self.num_local
        self.l1_local = tuple(t[lo:hi].contiguous() for t in self.l1)
        self.l2_local = tuple(t[lo:hi].contiguous() for t in self.l2)
        self.device = device

    def batch(self, counts: list[int], seed: int, *, experts=None, masked_fraction: float = 0.0,
              idx_dtype=torch.int32):
        """The global batch (identical on every rank): x [sum(counts), H], routing; ``experts`` restricts
        ids to a range."""
        total = sum(counts)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(total, self.hidden, generator=gen).to(self.device, torch.bfloat16)
        lo, hi = experts if experts is not None else (0, self.num_experts)
        n = hi - lo
        k = min(self.top_k, n)
        idx, w = reference.make_random_routing(total, n, k, masked_fraction=masked_fraction, seed=seed + 1,
                                               device=self.device, dtype=idx_dtype)
        idx = torch.where(idx >= 0, idx + lo, idx)
        if k < self.top_k:  # fewer experts than slots: the rest of the slots are unused
            pad = torch.full((total, self.top_k - k), -1, dtype=idx.dtype, device=self.device)
            idx, w = torch.cat([idx, pad], 1), torch.cat([w, torch.zeros_like(pad, dtype=w.dtype)], 1)
        return x, idx, w

    def ep1(self, x, idx, w) -> torch.Tensor:
        """The single-GPU result of the global batch (all experts, a plain buffer). Without the FP4 split K of the last
        round and the FP4 GEMV path for one token, which only one rank takes (heuristics::fp4_split_round, fp4_gemv):
        their sums add in another order."""
        buf = megamoe.get_symm_buffer(None, self.num_experts, max(x.shape[0], 1), self.top_k, self.hidden,
                                      self.intermediate, act_format=self.act_format, device=self.device)
        with env_set("MEGAMOE_FP4_SPLIT_ROUND", "0"), env_set("MEGAMOE_FP4_GEMV", "0"):
            return megamoe.moe(x, idx, w, self.l1, self.l2, buf, weight_format=self.weight_format, check=True)

    def moe(self, x, idx, w, buf, **kw) -> torch.Tensor:
        """This rank's call of the fused layer on its own tokens."""
        return megamoe.moe(x, idx, w, self.l1_local, self.l2_local, buf, weight_format=self.weight_format, **kw)

    def fused(self, y, buf) -> None:
        """The fused op alone (after pre_dispatch), into y."""
        if self.weight_format == "fp8":
            megamoe.fp8_mega_moe(y, self.l1_local, self.l2_local, buf)
        else:
            megamoe.fp8_fp4_mega_moe(y, self.l1_local, self.l2_local, buf, weight_format=self.weight_format)


def my_rows(counts: list[int], t: torch.Tensor) -> torch.Tensor:
    rank = dist.get_rank()
    start = sum(counts[:rank])
    return t[start:start + counts[rank]]


def check_equal(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)
        bad = (got != want).any(-1).nonzero().flatten().tolist()[:8]
        raise AssertionError(f"rank {dist.get_rank()}: {name}: EP result differs from EP=1 "
                             f"(rel err {diff.item():.3e}, first differing tokens {bad})")


def run_case(layer: Layer, buf, name: str, counts: list[int], seed: int, **batch_kw) -> None:
    x, idx, w = layer.batch(counts, seed, **batch_kw)
    want = my_rows(counts, layer.ep1(x, idx, w))
    got = layer.moe(my_rows(counts, x), my_rows(counts, idx), my_rows(counts, w), buf, check=True)
    check_equal(name, got, want)


def run_switch_mixed(layer: Layer, buf, shape: str, var: str, names: tuple[str, str], counts: list[int],
                     seed: int) -> None:
    """A per-call switch `var` on the even ranks and off on the odd ones (names[0]), then off everywhere (names[1]):
    each bitwise equal to EP=1 with the default settings (paths that give the same bits, which ranks may mix)."""
    rank = dist.get_rank()
    for i, (name, on_here) in enumerate(((names[0], rank % 2 == 0), (names[1], False))):
        x, idx, w = layer.batch(counts, seed + i)
        want = my_rows(counts, layer.ep1(x, idx, w))
        with env_set(var, "1" if on_here else "0"):
            got = layer.moe(my_rows(counts, x), my_rows(counts, idx), my_rows(counts, w), buf, check=True)
        check_equal(name, got, want)
        log(f"[{shape}] {name} (tokens per rank {counts}): bitwise equal to EP=1")


def check_shape(shape: str, device: torch.device, *, stress_calls: int, weight_format: str = "fp8",
                act_format: str = "fp8") -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    t0 = time.time()
    layer = Layer(shape, device, weight_format, act_format)
    cap = CAPACITY[shape]
    buf = megamoe.get_symm_buffer(dist.group.WORLD, layer.num_experts, cap, layer.top_k, layer.hidden,
                                  layer.intermediate, act_format=act_format, device=device)
    torch.cuda.synchronize()
    shape = f"{shape} {weight_format}/a{act_format}"
    log(f"[{shape}] layer and buffer ready in {time.time() - t0:.1f} s")
    nl = layer.num_local
    uneven = [(37 * r + 5) % cap for r in range(world)]
    uneven[-1] = 0
    cases = [
        ("uneven counts, one rank empty", uneven, {}),
        ("one token per rank", [1] * world, {}),
        ("full capacity", [cap] * world, {}),
        ("every token to rank 0's experts", [cap // 2] * world, {"experts": (0, nl)}),
        ("every token to the last rank's experts", [cap // 3] * world, {"experts": ((world - 1) * nl, world * nl)}),
        ("masked slots, int64 ids", [(11 * r + 3) % cap for r in range(world)],
         {"masked_fraction": 0.3, "idx_dtype": torch.int64}),
        ("no tokens anywhere", [0] * world, {}),
    ]
    for i, (name, counts, kw) in enumerate(cases):
        run_case(layer, buf, name, counts, 100 + i, **kw)
        log(f"[{shape}] {name} (tokens per rank {counts}): bitwise equal to EP=1")

    # FP8: one launch for L1 + L2 or two (heuristics/sm90.hpp: one with peers since 2026-11-27; each rank decides
    # for itself, and MEGAMOE_FP8_FUSED per rank): mixed modes, and two launches everywhere, give the same bits.
    run_switch_mixed(layer, buf, shape, "MEGAMOE_FP8_FUSED",
                     ("one launch on even ranks, two on odd", "two launches on every rank"), uneven, 150)

    # Routing reads every rank's slot ids in one flat pass where they fit one pass of its block (decode), else rank by
    # rank (heuristics::routing_flat_reads): the same counts, so the same bits, also where ranks differ. By default:
    # empty ranks between others, and the largest flat pass (4,096 slots) and one slot group past it where the
    # capacity reaches them (small at 4 ranks and more).
    run_switch_mixed(layer, buf, shape, "MEGAMOE_ROUTING_FLAT",
                     ("routing flat on even ranks, rank by rank on odd", "routing rank by rank on every rank"),
                     uneven, 155)
    # Routing reads every rank's token count and slot ids where that rank's pre_dispatch pushed them, in its own buffer,
    # or over NVLink from the rank's buffer (heuristics::ep_read_pushed; pre_dispatch pushes either way): the same
    # counts, so the same bits, also where ranks differ.
    run_switch_mixed(layer, buf, shape, "MEGAMOE_EP_PUSH",
                     ("routing reads pushed ids on even ranks, over NVLink on odd",
                      "routing reads over NVLink on every rank"),
                     uneven, 154)
    gaps = [0 if r % 2 else (7 * r + 3) % cap + 1 for r in range(world)]
    run_case(layer, buf, "empty odd ranks", gaps, 157)
    log(f"[{shape}] empty odd ranks (tokens per rank {gaps}): bitwise equal to EP=1")
    flat_tokens = 4096 // layer.top_k  # routing's flat pass: 4 ids x 1024 threads
    for i, total in enumerate((flat_tokens, flat_tokens + 1)):
        if total > world * cap:
            continue
        edge = [min(cap, total - min(total, cap * r)) for r in range(world)]
        run_case(layer, buf, f"{total * layer.top_k} routed slots", edge, 158 + i)
        log(f"[{shape}] {total * layer.top_k} routed slots (tokens per rank {edge}): bitwise equal to EP=1")

    # A capacity whose slots per rank are not a multiple of 4 ids, read rank by rank with 16-byte loads
    # (MEGAMOE_ROUTING_FLAT=0): every rank's row of the pushed ids starts 16-byte aligned (layout recv_idx_stride).
    odd_cap = cap + 1 if cap * layer.top_k % 4 == 0 else cap
    odd = megamoe.get_symm_buffer(dist.group.WORLD, layer.num_experts, odd_cap, layer.top_k, layer.hidden,
                                  layer.intermediate, act_format=act_format, device=device)
    counts = [(13 * r + 7) % odd_cap + 1 for r in range(world)]
    with env_set("MEGAMOE_ROUTING_FLAT", "0"):
        run_case(layer, odd, "capacity of an odd slot count, rank by rank", counts, 160)
    log(f"[{shape}] capacity {odd_cap}, rank by rank (tokens per rank {counts}): bitwise equal to EP=1")
    del odd

    # MXFP4 w4a4: a rank folds its tokens upstream only while the fold's workspace (every rank's pool rows) stays under
    # heuristics::kFp4FoldMxfp4MaxBytes, so with many ranks a prefill-sized buffer converts them in the tiles instead
    # (at 8 ranks from ~880 tokens per rank at V4-Flash). Both paths give the same bits: ranks that mix them, and
    # converters everywhere, against EP=1 with the default. (=1 does not lift the cap: in flash-large, ~600 MB at 2
    # ranks, both cases run the converters on every rank; small and flash mix the paths.)
    if weight_format == "mxfp4" and act_format == "fp4":
        run_switch_mixed(layer, buf, shape, "MEGAMOE_FP4_FOLD_MXFP4",
                         ("w4a4 fold on even ranks, converters on odd", "w4a4 converters on every rank"), uneven, 160)

    # Against the emulating float reference as well (not only against EP=1).
    counts = [min(cap, 9 + r) for r in range(world)]
    x, idx, w = layer.batch(counts, 7, masked_fraction=0.2)
    got = layer.moe(my_rows(counts, x), my_rows(counts, idx), my_rows(counts, w), buf, check=True)
    ref = reference.mega_moe(my_rows(counts, x), my_rows(counts, idx), my_rows(counts, w), layer.w13, layer.w2,
                             weight_format=weight_format, act_format=act_format, w13_sf=layer.w13_sf,
                             w2_sf=layer.w2_sf, w13_global_sf=layer.w13_global_sf, w2_global_sf=layer.w2_global_sf)
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert torch.isfinite(got).all() and err <= 1e-2, f"rank {rank}: EP vs reference rel err {err:.3e}"
    log(f"[{shape}] vs float reference: rel err {err:.2e} (rank 0)")

    # Repeated calls: the flags of one call never satisfy the next.
    x, idx, w = layer.batch(uneven, 42)
    ys = [layer.moe(my_rows(uneven, x), my_rows(uneven, idx), my_rows(uneven, w), buf) for _ in range(3)]
    for y in ys[1:]:
        check_equal("repeated call", y, ys[0])
    check_equal("repeated call vs EP=1", ys[0], my_rows(uneven, layer.ep1(x, idx, w)))
    log(f"[{shape}] repeated calls: identical")

    # CUDA graph: capture pre_dispatch + the fused op once, replay with new inputs of the same size.
    counts = [cap // 2 + r for r in range(world)]
    t = counts[rank]
    sx = torch.zeros(t, layer.hidden, dtype=torch.bfloat16, device=device)
    sidx = torch.full((t, layer.top_k), -1, dtype=torch.int32, device=device)
    sw = torch.zeros(t, layer.top_k, dtype=torch.float32, device=device)
    sy = torch.full((t, layer.hidden), float("nan"), dtype=torch.bfloat16, device=device)

    def step():
        megamoe.pre_dispatch(sx, sidx, sw, buf, weight_format=weight_format)
        layer.fused(sy, buf)

    step()  # warm-up outside capture
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(3):
        x, idx, w = layer.batch(counts, 200 + i, masked_fraction=0.1)
        sx.copy_(my_rows(counts, x)), sidx.copy_(my_rows(counts, idx)), sw.copy_(my_rows(counts, w))
        sy.fill_(float("nan"))
        graph.replay()
        check_equal(f"graph replay {i}", sy, my_rows(counts, layer.ep1(x, idx, w)))
    buf.check_error()
    log(f"[{shape}] CUDA graph replay with new inputs: bitwise equal to EP=1")

    # The module (DESIGN.md §8) with the EP group: checkpoint shards of every expert offered to each rank's
    # weight_loader (only local ones are taken), finalize, forward: equal to EP=1 as well.
    if weight_format != "fp8":
        return _stress(layer, buf, shape, cap, stress_calls, t0)
    module = megamoe.MegaMoEExperts(
        megamoe.MegaMoEConfig(max_tokens_per_rank=cap, group=dist.group.WORLD), num_experts=layer.num_experts,
        num_local_experts=nl, experts_start_idx=rank * nl, top_k=layer.top_k, hidden_size=layer.hidden,
        intermediate_size=layer.intermediate, prefix=f"ep_cases.{shape}").to(device)
    taken = 0
    inter = layer.intermediate
    for e in range(layer.num_experts):
        for shard, rows in (("w1", slice(0, inter)), ("w3", slice(inter, 2 * inter))):
            srows = slice(rows.start // 128, rows.stop // 128)
            taken += module.weight_loader(module.w13_weight, layer.w13[e, rows], f"experts.{e}.{shard}.weight",
                                          shard, e, return_success=True)
            module.weight_loader(module.w13_weight_scale_inv, layer.w13_sf[e, srows], f"experts.{e}.{shard}.scale",
                                 shard, e)
        taken += module.weight_loader(module.w2_weight, layer.w2[e], f"experts.{e}.w2.weight", "w2", e,
                                      return_success=True)
        module.weight_loader(module.w2_weight_scale_inv, layer.w2_sf[e], f"experts.{e}.w2.scale", "w2", e)
    assert taken == 3 * nl, f"rank {rank}: weight_loader took {taken} shards, expected {3 * nl}"
    module.finalize_weights()
    counts = uneven
    x, idx, w = layer.batch(counts, 77, masked_fraction=0.1)
    got = module(my_rows(counts, x), my_rows(counts, w), my_rows(counts, idx).long())
    check_equal("MegaMoEExperts with the EP group", got, my_rows(counts, layer.ep1(x, idx, w)))
    log(f"[{shape}] MegaMoEExperts with the EP group: bitwise equal to EP=1")
    del module
    _stress(layer, buf, shape, cap, stress_calls, t0)


def _stress(layer: Layer, buf, shape: str, cap: int, stress_calls: int, t0: float) -> None:
    world = dist.get_world_size()
    # Many consecutive calls with random token counts per rank (all ranks draw the same sequence, so each
    # knows the global batch); the last one is checked in full, the error word every 100 calls.
    gen = torch.Generator().manual_seed(99)
    start = time.time()
    for it in range(stress_calls):
        counts = torch.randint(0, cap + 1, (world,), generator=gen).tolist()
        x, idx, w = layer.batch(counts, 1000 + it)
        y = layer.moe(my_rows(counts, x), my_rows(counts, idx), my_rows(counts, w), buf, check=(it % 100 == 99))
    torch.cuda.synchronize()
    if stress_calls:
        check_equal("last stress call", y, my_rows(counts, layer.ep1(x, idx, w)))
        log(f"[{shape}] {stress_calls} consecutive calls with random counts: no hang, last call exact "
            f"({time.time() - start:.1f} s)")
    log(f"[{shape}] done in {time.time() - t0:.1f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="small,flash")
    parser.add_argument("--stress-calls", type=int, default=1000)
    parser.add_argument("--formats", default="fp8:fp8",
                        help="comma list of weight_format:act_format pairs (fp8:fp8, mxfp4:fp8, nvfp4:fp4, ...)")
    parser.add_argument("--watchdog-s", type=float, default=280.0,
                        help="dump every thread's stack and exit if one (format pair, shape) check takes longer "
                             "(a hang)")
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)  # setup; re-armed per check below
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        for pair in args.formats.split(","):
            wf, af = pair.split(":")
            for shape in args.shapes.split(","):
                # Per check, not per run: a run-wide 280 s fired on a healthy run of five format pairs on two shapes
                # at 4 ranks (2026-11-26, 4 x H200: checks of 12-70 s, the V4-Flash FP4 ones with ~50 s of layer
                # building).
                faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
                check_shape(shape, device, stress_calls=args.stress_calls if shape == "small" else 100,
                            weight_format=wf, act_format=af)
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)  # the final barrier and shutdown
        dist.barrier()
        log(f"EP={world}: all checks passed")
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
