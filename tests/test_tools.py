"""CPU checks of the device-side diagnostic tools, so they still fit the kernel when a device session needs them:
every ablate.py patch applies to the current kernel sources (each original text once), tile_trace.py
parses its trace lines with and without the clock fields, and probe_fp4.py's generated source fits the kernel."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ablate = load_tool("ablate")


# Each patch alone, and the all-data ablation device_check.sh's ablate mode runs by default.
@pytest.mark.parametrize("names", [[n] for n in ablate.PATCHES] + [["no-scales", "no-token-tma", "no-weight-tma"]],
                         ids=lambda names: ",".join(names))
def test_ablate_patches_apply(names, tmp_path, monkeypatch):
    kernel = tmp_path / ablate.kernel_of(names[0])
    kernel.parent.mkdir(parents=True)
    shutil.copy(ROOT / ablate.kernel_of(names[0]), kernel)
    before = kernel.read_text()
    monkeypatch.setattr("sys.argv", ["ablate.py", str(tmp_path), ",".join(names)])
    ablate.main()  # exits naming the patch if an original text is not found exactly once
    after = kernel.read_text()
    for name in names:
        for old, new in ablate.PATCHES[name]:
            assert new in after
    assert after != before


def test_ablate_unknown_patch_is_refused(tmp_path, monkeypatch):
    kernel = tmp_path / ablate.KERNEL
    kernel.parent.mkdir(parents=True)
    shutil.copy(ROOT / ablate.KERNEL, kernel)
    monkeypatch.setattr("sys.argv", ["ablate.py", str(tmp_path), "no-such-patch"])
    with pytest.raises(SystemExit, match="unknown ablation 'no-such-patch'"):
        ablate.main()


def test_tile_trace_parses_clock_fields():
    trace = load_tool("tile_trace")
    old_c = "MMTRACE C 3 7 0 12 1 64 1000 21000 27000 23000 23200 26000 26300"
    new_c = old_c + " 35800 1900"
    old_p = "MMTRACE P 3 7 40 900 950"
    new_p = old_p + " 22000 45000"
    for c, p, cycles in ((old_c, old_p, None), (new_c, new_p, 35800)):
        tiles, claims, entries, kernels, shape, walks = trace.parse(
            ["MMTRACE MARK", "MMTRACE E 3 7 800 100", p, c, "MMTRACE END", "MMTRACE SHAPE 4096 2048 6 256"])
        assert walks == {}
        assert shape == (4096, 2048, 6, 256, 128, 1.0)  # no stage fields: FP8's 128-K stage of 1-byte weights
        assert len(tiles) == 1 and len(claims) == 1 and entries == {3: 800}
        tile = tiles[0]
        assert (tile["gemm"], tile["expert"], tile["n_block"], tile["rows"]) == (0, 12, 1, 64)
        assert (tile["start"], tile["main_end"], tile["end"]) == (1000, 21000, 27000)
        assert tile["main_cycles"] == cycles
        assert tile["full_wait_cycles"] == (None if cycles is None else 1900)
        assert claims[0]["wait_cycles"] == (None if cycles is None else 22000)
        assert claims[0]["span_cycles"] == (None if cycles is None else 45000)


def test_tile_trace_fp4_records(capsys):
    """FP4 kernels: the stage fields of SHAPE (256 K of 0.5-byte weights), producer cycles not recorded (-1), no
    whole-walk sums, and the epilogue phases (L2: joined, staged, stored); per-stage cycles and GB/s use the FP4 stage."""
    trace = load_tool("tile_trace")
    lines = ["MMTRACE MARK", "MMTRACE E 1024 5 1000 900", "MMTRACE P 1024 5 7 950 960 -1 -1",
             "MMTRACE S 1024 " + " ".join(["0"] * 16) + " 90000",
             "MMTRACE C 1024 5 1 3 0 1 2000 82000 86000 83000 85000 86000 86000 144000 16000",
             "MMTRACE END", "MMTRACE SHAPE 4096 2048 6 256 256 0.5"]
    tiles, claims, entries, kernels, shape, walks = trace.parse(lines)
    assert shape == (4096, 2048, 6, 256, 256, 0.5)
    assert claims[0]["wait_cycles"] is None and claims[0]["span_cycles"] is None
    assert trace.walk_totals(walks, entries) == {}
    out = trace.summarize(tiles, claims, entries, shape)
    l2 = out["L2"]
    assert l2["epilogue_phases_us"] == {"joined": pytest.approx(1.0), "stage": pytest.approx(2.0),
                                        "store": pytest.approx(1.0)}
    assert l2["cycles_per_kblock_median"] == pytest.approx(144000 / 8)  # K = 2048: 8 stages of 256
    assert l2["gbps_per_tile_median"] == pytest.approx(256 * 2048 * 0.5 / 80.0 / 1e3)  # bytes over the 80 µs loop
    assert "producer_span_per_kblock_median" not in l2
    assert "cycles per 256-K stage" in capsys.readouterr().out


def test_tile_trace_walk_totals():
    """The whole-walk line: per gemm tiles and summed ns; the shares add up with the end-marker wait to the span."""
    trace = load_tool("tile_trace")
    lines = ["MMTRACE MARK", "MMTRACE E 0 5 1000 900", "MMTRACE E 1 6 3000 900",
             "MMTRACE S 0 2 4000 20000 1000 1000 1000 1000 2000 1 1000 8000 600 200 0 0 200 41000",
             "MMTRACE S 1 1 2000 10000 3000 0 0 0 0 0 0 0 0 0 0 0 0 21000", "MMTRACE END"]
    *_, entries, _, _, walks = trace.parse(lines)
    assert walks[0] == dict(l1=[2, 4000, 20000, 1000, 1000, 1000, 1000, 2000], l2=[1, 1000, 8000, 600, 200, 0, 0, 200],
                            exit=41000)
    out = trace.walk_totals(walks, entries)
    assert out["span_us"] == 40.0 and out["ctas"] == 2
    assert out["l1"]["tiles"] == 3 and out["l1"]["main_us"] == 15.0 and out["l1"]["per_tile_us"] == [2.0, 10.0, 3.0]
    assert out["l2"]["tiles"] == 1 and out["l2"]["epilogue_us"] == 0.5
    l1_phases = out["l1"]["epilogue_phases_per_tile_us"]
    assert l1_phases == pytest.approx(dict(swiglu=4 / 3, amax=1 / 3, quantize=1 / 3, store=1 / 3, count=2 / 3))
    assert out["l2"]["epilogue_phases_per_tile_us"] == pytest.approx({"stage": 0.6, "copy-out": 0.2, "rest": 0.2})
    # CTA 0: 40 µs after its entry, 40 accounted; CTA 1: 18 after its entry, 15 accounted -> 1.5 µs mean end wait
    assert out["end_wait_us"] == 1.5 and out["late_entry_us"] == 1.0


def test_probe_fp4_source_fits_the_kernel():
    """probe_fp4.py builds its CUDA source on the GPU machine only: check here that the generated m64n128k16 (bf16)
    and m64n128k32 (e4m3) wrappers are whole (64 accumulators, 4 A registers, the descriptor and the scale flag) and
    that the kernel-header functions the probe calls still exist under those names."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        probe = load_tool("probe_fp4")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    src = probe.CUDA_SRC
    assert "RS128_SRC" not in src
    wrapper = src[src.index("struct WgmmaBF16RS128"):src.index("struct WgmmaFP8RS128")]
    assert wrapper.count('"+f"(d[') == 64
    assert "{%64, %65, %66, %67}, %68, p, 1, 1, 0" in wrapper and "setp.ne.b32 p, %69, 0" in wrapper
    fp8 = src[src.index("struct WgmmaFP8RS128"):src.index("template <int kN> struct Rs")]  # m64n128k32 e4m3
    assert fp8.count('"+f"(d[') == 64 and "m64n128k32.f32.e4m3.e4m3" in fp8
    assert "{%64, %65, %66, %67}, %68, p, 1, 1;" in fp8 and '"r"(int(accumulate))' in fp8
    header = (ROOT / "csrc" / "kernels" / "sm90_fp4_grouped_gemm.cuh").read_text()
    for name in ("void decode_weights(", "void decode_weights_e4m3(", "void convert_token_unit(",
                 "void fence_fragment("):
        assert name in header, name
    assert set(probe.MODES) >= {"full", "mma-wait", "decode", "mma-stream", "full+conv", "e4m3-ss"}


@pytest.mark.parametrize("name, function", [("probe_fp4", "probe"), ("probe_mma", "mma")])
def test_probe_declarations_match_definitions(name, function):
    """load_inline binds CPP_SRC's declaration to CUDA_SRC's definition only on the GPU machine: their parameter
    lists must agree."""
    import re
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        probe = load_tool(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def params(text):
        m = re.search(r"void " + function + r"\(([^)]*)\)", text)
        assert m, f"{name}: no {function}(...)"
        return [" ".join(p.split()) for p in m.group(1).split(",")]

    assert params(probe.CPP_SRC) == params(probe.CUDA_SRC)


@pytest.mark.parametrize("patch", sorted((ROOT / "benchmarks" / "patches").glob("*.patch")), ids=lambda p: p.stem)
def test_ab_patches_apply(patch, tmp_path):
    """The kernel variants kept as patches for a device A/B (benchmarks/patches) still apply to the current sources."""
    import subprocess

    for tree in ("csrc", "tests", "megamoe"):  # a variant may carry its test and Python changes
        shutil.copytree(ROOT / tree, tmp_path / tree, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_memory_report_small_layer():
    """benchmarks/memory_report.py on a small layer (CPU ops only): the bytes per expert of each weight format's kernel
    layout, pinned (L1 [2I, H] = [256, 256], L2 [H, I] = [256, 128]), and its buffer rows against the layout op called
    by keyword; the buffer grows with the tokens and the ranks, and FP4 activations take less than FP8's."""
    from megamoe.buffer import buffer_layout
    memory_report = load_tool("memory_report")
    align_up = lambda v, a: (v + a - 1) // a * a  # noqa: E731
    cfg = dict(num_experts=4, top_k=2, hidden=256, intermediate=128)
    doc = memory_report.report({"small": cfg}, [16, 64], [1, 2])
    per = {w["weight_format"]: w["bytes_per_expert"] for w in doc["weights"]}
    l1, l2 = 256 * 256, 256 * 128  # weights per expert
    # MXFP4: packed E2M1, a UE8M0 scale per 32, a row exponent byte per row; NVFP4: packed E2M1, a UE4M3 scale per 16,
    # a float32 global scale; FP8: a byte per weight plus 48 bytes of float32 scales at this size.
    assert per["mxfp4"] == (l1 + l2) // 2 + (l1 + l2) // 32 + 2 * 256
    assert per["nvfp4"] == (l1 + l2) // 2 + (l1 + l2) // 16 + 2 * 4
    assert per["fp8"] == l1 + l2 + 56
    rows = {(b["num_ranks"], b["max_tokens_per_rank"]): b for b in doc["buffers"]}
    assert len(rows) == 4
    for (ranks, tokens), b in rows.items():
        for act in ("fp8", "fp4"):
            want = buffer_layout(num_experts=4, num_ranks=ranks, max_tokens_per_rank=tokens, top_k=2, hidden=256,
                                 intermediate=128, act_format=act)["total_bytes"]
            assert b[f"{act}_bytes"] == want
        assert 0 < b["fp4_bytes"] < b["fp8_bytes"]
        # the w4a4 NVFP4 workspace: float32 L1 outputs, the call's rows at one rank, the pool's worst case with peers
        want_rows = tokens * 2 if ranks == 1 else align_up(ranks * tokens * 2, 128)
        assert b["nvfp4_act_workspace_bytes"] == want_rows * 128 * 4
    # (pool rows round up to 128, so the ranks are compared at 64 tokens: 128 and 256 routed rows)
    assert rows[(1, 16)]["fp8_bytes"] < rows[(1, 64)]["fp8_bytes"] < rows[(2, 64)]["fp8_bytes"]


def test_every_kernel_switch_is_documented():
    """Every MEGAMOE_* environment variable the C++ sources read (std::getenv, forced_block_m, rotate_rounds,
    fp4_gemv_layer_bits) has a row in the README's table of kernel switches, and the table names no variable the sources
    no longer read."""
    import re

    read = set()
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".hpp", ".cpp", ".cu", ".cuh", ".h"):
            read |= set(re.findall(r'(?:getenv|forced_block_m|rotate_rounds|fp4_gemv_layer_bits)\("(MEGAMOE_[A-Z0-9_]+)"',
                                   path.read_text()))
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("Kernel switches"):]
    table = table[:table.index("\n## ")]
    rows = set(re.findall(r"^\| `(MEGAMOE_[A-Z0-9_]+)`(?:, `(MEGAMOE_[A-Z0-9_]+)`)?", table, flags=re.M))
    documented = {name for row in rows for name in row if name}
    assert read - documented == set(), "switches read by csrc/ without a README row"
    assert documented - read == set(), "README rows for switches csrc/ no longer reads"


@pytest.fixture
def probe_power(monkeypatch):
    """benchmarks/probe_power.py, loaded with benchmarks/ on sys.path; the bench_utils it imports leaves with it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    had = "bench_utils" in sys.modules
    yield load_tool("probe_power")
    if not had:
        sys.modules.pop("bench_utils", None)


def test_probe_power_model(probe_power):
    """probe_power.py's energy model on made-up rows: P0 100 W; reads at 3 TB/s draw 400 W (100 pJ/B above P0);
    the matmul at 1 PFLOP/s 700 W (0.6 pJ/FLOP). A call of 3 GB and 1 TFLOP has a 1 ms floor (both ceilings), but
    its 0.3 + 0.6 J over the 600 W a 700 W limit leaves above P0 take 1.5 ms."""
    rows = [dict(mean_power_w=100.0), dict(mean_power_w=400.0, bytes_per_s=3e12),
            dict(mean_power_w=350.0, bytes_per_s=3e12), dict(mean_power_w=700.0, flops_per_s=1e15)]
    model = probe_power.energy_model(rows)
    assert model["e_read"] == pytest.approx(1e-10) and model["e_flop"] == pytest.approx(6e-13)
    # The call takes 1.8 ms and 1.08 J above P0 (0.18 J of P0 on top): 1.2x the model's work.
    row = probe_power.power_floor(dict(us_per_call=1800.0, joules_per_call=1.08 + 0.18), 3 * 10**9, 10**12, model,
                                  700.0)
    assert row["floor_us"] == pytest.approx(1000.0) and row["power_floor_us"] == pytest.approx(1500.0)
    assert row["power_floor_over_floor"] == pytest.approx(1.5)
    assert row["time_over_bound"] == pytest.approx(1.2) and row["time_over_power_floor"] == pytest.approx(1.2)
    assert row["dynamic_joules_over_model"] == pytest.approx(1.2)
    # A decode-like call: 3 GB, 1 GFLOP: the bytes floor (1 ms) is above the power floor (0.3006 J / 600 W = 0.501
    # ms), so the bound is the floor; the ratio over the power floor alone is kept apart.
    row = probe_power.power_floor(dict(us_per_call=1100.0, joules_per_call=0.4), 3 * 10**9, 10**9, model, 700.0)
    assert row["power_floor_over_floor"] == pytest.approx(1.0)
    assert row["time_over_bound"] == pytest.approx(1.1)
    assert row["time_over_power_floor"] == pytest.approx(1.1e-3 / (0.3006 / 600), rel=1e-3)


def test_probe_power_environment(probe_power, monkeypatch):
    """probe_power.py's per-row settings: applied inside, restored after (set, changed and unset variables); a
    malformed entry is refused before anything is set."""
    monkeypatch.setenv("MEGAMOE_PROBE_A", "1")
    monkeypatch.setenv("MEGAMOE_PROBE_B", "")  # recorded by monkeypatch, so a leak is undone after the test
    monkeypatch.delenv("MEGAMOE_PROBE_B")
    with probe_power.environment(" MEGAMOE_PROBE_A=2, MEGAMOE_PROBE_B=x=y "):
        assert os.environ["MEGAMOE_PROBE_A"] == "2" and os.environ["MEGAMOE_PROBE_B"] == "x=y"
    assert os.environ["MEGAMOE_PROBE_A"] == "1" and "MEGAMOE_PROBE_B" not in os.environ
    assert probe_power.parse_setting(" - ") == []
    for bad in ("MEGAMOE_PROBE_A", "", "A=1,", "MY VAR=1"):
        with pytest.raises(ValueError, match="--settings"):
            with probe_power.environment(bad):
                pass
    assert os.environ["MEGAMOE_PROBE_A"] == "1"


def test_ncu_bytes_parses_ncu_csv(tmp_path, capsys, monkeypatch):
    """ncu_bytes.py reads ncu's --csv rows (one per kernel and metric, values with thousands separators) into
    per-kernel totals in launch order."""
    ncu_bytes = load_tool("ncu_bytes")
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
              '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    def row(i, name, metric, value):
        return f'"{i}","1","python3","h","{name}","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","m","{metric}","byte","{value}"'
    lines = ["==PROF== Connected", header,
             row(0, "void unnamed>::gather_kernel<0>(int *)", "dram__bytes_read.sum", "143,000,000"),
             row(0, "void unnamed>::gather_kernel<0>(int *)", "lts__t_sectors_op_read.sum", "1,000"),
             row(1, "void sm90_fp8_grouped_gemm_kernel<64, 4, 2, 0>(int)", "dram__bytes_read.sum", "6,780,000,000")]
    path = tmp_path / "run.csv"
    path.write_text("\n".join(lines) + "\n")
    kernels = ncu_bytes.per_kernel(str(path))
    assert [name for _, name in kernels] == ["void unnamed>::gather_kernel<0>(int *)",
                                             "void sm90_fp8_grouped_gemm_kernel<64, 4, 2, 0>(int)"]
    assert kernels[("0", "void unnamed>::gather_kernel<0>(int *)")]["lts__t_sectors_op_read.sum"] == 1000.0
    monkeypatch.setattr(sys, "argv", ["ncu_bytes.py", str(path)])
    ncu_bytes.main()
    out = capsys.readouterr().out
    assert "gather_kernel<0>" in out and "6.780" in out and "6.923" in out  # the total's DRAM reads
    path.write_text("\n".join(lines[:2] + [lines[2].replace('"byte","143,000,000"', '"Mbyte","143"')]) + "\n")
    with pytest.raises(ValueError, match="--print-units base"):
        ncu_bytes.per_kernel(str(path))
