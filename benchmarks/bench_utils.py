"""Shared timing helpers: warm-up, L2 flush, CUDA-graph replay, medians; and the hardware ceilings
measured in the same run (copy bandwidth, dense FP8 matmul rate)."""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Callable

import torch

_FLUSH = None


def l2_flush_mode() -> str:
    """How flush_l2 leaves the L2: "clean" (default) or "dirty" (MEGAMOE_BENCH_FLUSH)."""
    mode = os.environ.get("MEGAMOE_BENCH_FLUSH", "clean")
    if mode not in ("clean", "dirty"):
        raise ValueError(f"MEGAMOE_BENCH_FLUSH: expected clean or dirty, got {mode!r}")
    return mode


def flush_l2() -> None:
    """Evict the L2 cache (50-60 MB on H100/H200) with 256 MB buffers: write one (zero_), then, in the default
    "clean" mode, read a second, so that the lines the write left dirty are written back before the timed call
    and the L2 holds clean lines. NOTES: a write-only flush (MEGAMOE_BENCH_FLUSH=dirty, the usual zero_ of a big
    buffer) leaves ~50 MB of dirty lines that the timed call must write back to HBM on top of its own reads: +9 µs
    for a 100 MB weight stream, V4-Flash T=1 89.4 -> 80.0 µs per graph replay with a clean flush (H100,
    2026-11-24, docs/perf-notes.md, tenth session). The floor counts only the call's own bytes, and a decode step's
    L2 before the MoE layer holds mostly clean lines (weights, KV cache read by attention), so the clean flush
    compares like with like; both modes stay selectable."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(2, 256 << 20, dtype=torch.uint8, device="cuda")
        _FLUSH[1].random_(0, 256)
    _FLUSH[0].zero_()
    if l2_flush_mode() == "clean":
        _FLUSH[1].view(torch.int64).amax()


def warm(fn: Callable[[], None], *, min_calls: int = 100, min_ms: float = 150.0, max_ms: float = 2000.0,
         flush: bool = True) -> None:
    """Calls `fn` (each after an L2 flush, as the timed calls) at least `min_calls` times and for at least `min_ms`,
    in groups of 10, stopping after `max_ms` whatever the count (long calls).
    NOTES: after a CUDA graph is captured, the next ~90 calls of the op run slow, replays and eager calls alike, then
    stay fast (H100, 2026-11-24, V4-Pro T=1: 155 µs eager before the capture, 175 µs for ~90 calls after it, then
    153-155 µs; V4-Flash ~20 calls, 80 -> 74 µs; cause not found). Three warm-up calls left every T=1 row in the
    slow state. A server captures its graphs once and replays them for hours, so every timing warms up past it."""
    start = time.perf_counter()
    calls = 0
    while (calls < min_calls or (time.perf_counter() - start) * 1e3 < min_ms) and \
            (calls == 0 or (time.perf_counter() - start) * 1e3 < max_ms):
        for _ in range(10):
            if flush:
                flush_l2()
            fn()
        calls += 10
        torch.cuda.synchronize()


def capture_graph(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of what `body` launches, captured on a side stream that follows the current one."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def time_graph(fn: Callable[[], None], *, iters: int = 20, warmup: int = 3, flush: bool = True) -> float:
    """Median microseconds of one replay of a CUDA graph holding `fn`, L2 flushed before each replay."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = capture_graph(fn)
    warm(graph.replay, flush=flush)
    return time_events(graph.replay, iters=iters, warmup=warmup, flush=flush)


def time_in_graph(fn: Callable[[], None], *, calls: int = 8, replays: int = 5, flush: bool = True,
                  warm_replays: int | None = None) -> float:
    """Median microseconds of `fn` inside a CUDA graph of `calls` copies of [L2 flush, event, fn, event], replayed
    `replays` times; a call's time is its end event minus its start event (event-record nodes). Unlike
    time_graph, no call pays the graph's own launch (~10 us per replay on the H100, 2026-11-23): so a model
    whose decode step is one graph sees the layer. `warm_replays`: exactly that many warm-up replays instead of
    warm()'s timed loop (expert parallelism: every rank must replay as often, each call joins the others' flags)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(calls)]

    def body():
        for start, end in zip(starts, ends):
            if flush:
                flush_l2()
            start.record()
            fn()
            end.record()

    flush_l2()  # allocate the flush buffer outside the capture
    graph = capture_graph(body)
    if warm_replays is None:
        warm(graph.replay, min_calls=100 // calls, flush=False)  # each replay flushes before each of its calls
    else:
        for _ in range(warm_replays):
            graph.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        times += [start.elapsed_time(end) * 1e3 for start, end in zip(starts, ends)]
    return statistics.median(times)


def time_events(fn: Callable[[], None], *, iters: int = 20, warmup: int = 3, flush: bool = True) -> float:
    """Median microseconds of `fn` between two CUDA events, L2 flushed before each run."""
    if warmup:
        warm(fn, min_calls=warmup, min_ms=0.0, flush=flush)
    times = []
    for _ in range(iters):
        if flush:
            flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure_copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    us = time_events(lambda: dst.copy_(src), iters=10, flush=False)
    return 2 * src.numel() / (us * 1e-6)


def measure_fp8_matmul_flops(n: int = 8192, sustained_ms: float = 0.0) -> float:
    """Dense FP8 matmul rate (FLOP/s) of torch._scaled_mm on random data, n x n x n: 10 calls after 3 (the floor's
    figure), or with `sustained_ms`, after that long back to back. NOTES: the H100 holds this matmul at its 700 W
    limit once it runs for more than a few tens of ms (SM clock ~1.23-1.31 GHz, 1,218-1,241 TFLOP/s over 1-3 s against
    1,150-1,450 for the short figure, which depends on what ran before it; benchmarks/probe_power.py, docs/perf-notes.md,
    fifty-fifth session); the prefill calls run at that limit too."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")

    def matmul():
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    if sustained_ms <= 0:
        return 2 * n ** 3 / (time_events(matmul, iters=10, flush=False) * 1e-6)
    # The limit's controller moves the clock every few ms (1.15-1.5 GHz): time batches of 200 calls (~0.2 s).
    warm(matmul, min_calls=3, min_ms=sustained_ms, max_ms=2 * sustained_ms, flush=False)

    def batch():
        for _ in range(200):
            matmul()

    return 200 * 2 * n ** 3 / (time_events(batch, iters=3, warmup=0, flush=False) * 1e-6)


def moe_step(x, idx, w, y, l1, l2, buf, weight_format: str) -> Callable[[], None]:
    """One layer call as a user makes it: pre_dispatch, then the fused op of the weight format, into y."""
    import megamoe

    def step():
        megamoe.pre_dispatch(x, idx, w, buf, weight_format=weight_format)
        if weight_format == "fp8":
            megamoe.fp8_mega_moe(y, l1, l2, buf)
        else:
            megamoe.fp8_fp4_mega_moe(y, l1, l2, buf, weight_format=weight_format)

    return step


def parse_setting(setting: str, what: str) -> list:
    """[(VAR, VALUE), ...] of a setting: "-" (nothing) or a comma list of VAR=VALUE (spaces around items ignored);
    `what` names the argument it came from in the error."""
    setting = setting.strip()
    if setting == "-":
        return []
    pairs = []
    for item in setting.split(","):
        var, sep, value = item.strip().partition("=")
        if not sep or not var.strip() or any(c.isspace() for c in var.strip()):
            raise ValueError(f"{what}: expected '-' or VAR=VALUE[,VAR=VALUE...], got {setting!r}")
        pairs.append((var.strip(), value))
    return pairs


@contextlib.contextmanager
def environment(setting: str, what: str):
    """The environment with `setting` (parse_setting) applied, restored after: the kernel switches are read per call
    (and at a graph's capture), so a benchmark times settings side by side in one process."""
    pairs = parse_setting(setting, what)
    saved = {var: os.environ.get(var) for var, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
