"""Power probe: is a call bound by the board's power limit rather than by bytes or FLOPs? (METHOD.md: measure the
ceiling before optimising against it.)

The FP8 prefill calls (T=8192) run with nvidia-smi reporting "SW power cap": the board holds its power at the
enforced limit (~700 W on an H100 SXM) by lowering the SM clock (~1.40-1.46 GHz against 1.98 idle-boost,
docs/perf-notes.md, fifty-fifth session). Then the time a call needs is at least the energy its work takes over the
power the board may draw, and the floor max(bytes / copy rate, FLOPs / matmul rate) may be out of reach: streaming
the weights and running the MMAs each draw power, and the cap is shared.

Each workload runs back to back for --seconds (after as long a warm-up, so the power controller settles) while
NVML's energy counter (mJ) and a 10 ms sampler (SM clock, power, clock-event reasons) run; per workload it prints
the rate, the mean power, the energy per call and the SM clock:
  spin    torch.cuda._sleep on one SM: the board's power with the clocks up and almost nothing running (P0);
  read    a max over a 4 GB buffer: bytes read from HBM (the weight stream's kind of traffic);
  copy    a 2 GB -> 2 GB copy: the floor's bandwidth ceiling (read + write bytes, as bench_utils counts them);
  matmul  torch._scaled_mm FP8 8192^3: the floor's FLOP ceiling, sustained;
  moe     pre_dispatch + fp8_mega_moe per (model, T), as bench_moe runs it (graph replay, no L2 flush: the weights
          are 6-26 GB at the default T=8192, far past the L2).
From these, a linear energy model: e_read = (P_read - P0) / read rate (J per byte), e_flop = (P_matmul - P0) /
matmul rate (J per FLOP), and for each moe row the power floor t_power = (bytes e_read + FLOPs e_flop) / (P_limit -
P0): the least time at which the call's bytes and FLOPs fit under the limit, at the efficiency the read and matmul
workloads reach. It is a model (the energy per operation falls with the clock's voltage; the moe call has work the
floor does not count), so the rows print it beside the measured energy of the call itself.

    python3 benchmarks/probe_power.py [--models V4-Flash,V4-Pro] [--tokens 8192] [--formats fp8,mxfp4,nvfp4]
                                   [--settings="-;MEGAMOE_FP8_BLOCK_M=128"] [--seconds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
import threading
import time

import torch

import bench_utils as bu

# The moe rows' kernel settings (bench_utils), errors naming --settings (';'-separated entries).
parse_setting = functools.partial(bu.parse_setting, what="--settings")
environment = functools.partial(bu.environment, what="--settings")

NVML_CLOCK_SM = 1
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


class Nvml:
    """The few NVML calls this probe needs, through ctypes (no pynvml dependency)."""

    def __init__(self, cuda_device: int):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        try:  # NVML numbers GPUs without CUDA_VISIBLE_DEVICES; torch maps it
            index = torch.cuda._get_nvml_device_index(cuda_device)
        except Exception:  # noqa: BLE001  (private helper: fall back to the CUDA index)
            index = cuda_device
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self.handle)),
                    "nvmlDeviceGetHandleByIndex_v2")
        reasons = getattr(self.lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or self.lib.nvmlDeviceGetCurrentClocksThrottleReasons

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML {what} failed with return code {rc}")

    def _uint(self, fn, *args) -> int:
        value = ctypes.c_uint()
        self._check(fn(self.handle, *args, ctypes.byref(value)), fn.__name__)
        return value.value

    def _ull(self, fn) -> int:
        value = ctypes.c_ulonglong()
        self._check(fn(self.handle, ctypes.byref(value)), fn.__name__)
        return value.value

    def energy_j(self) -> float:
        return self._ull(self.lib.nvmlDeviceGetTotalEnergyConsumption) * 1e-3

    def power_w(self) -> float:
        return self._uint(self.lib.nvmlDeviceGetPowerUsage) * 1e-3

    def sm_mhz(self) -> int:
        return self._uint(self.lib.nvmlDeviceGetClockInfo, ctypes.c_int(NVML_CLOCK_SM))

    def power_limit_w(self) -> float:
        return self._uint(self.lib.nvmlDeviceGetEnforcedPowerLimit) * 1e-3

    def reasons(self) -> int:
        return self._ull(self._reasons)


class Sampler(threading.Thread):
    """SM clock, power and clock-event reasons every `period` seconds until stop()."""

    def __init__(self, nvml: Nvml, period: float = 0.01):
        super().__init__(daemon=True)
        self.nvml, self.period, self.samples = nvml, period, []
        self._halt = threading.Event()  # not _stop: Thread has a method of that name

    def run(self):
        while not self._halt.is_set():
            self.samples.append((self.nvml.sm_mhz(), self.nvml.power_w(), self.nvml.reasons()))
            time.sleep(self.period)

    def stop(self):
        self._halt.set()
        self.join()
        return self.samples


def run_for(fn, seconds: float, calls_per_batch: int) -> int:
    """Launches `fn` in batches until `seconds` have passed, one batch always queued behind the running one (the GPU
    never drains between batches); returns the number of calls. Ends synchronized."""
    calls, start, previous = 0, time.perf_counter(), None
    while True:
        for _ in range(calls_per_batch):
            fn()
        calls += calls_per_batch
        done = torch.cuda.Event()
        done.record()
        if previous is not None:
            previous.synchronize()
        previous = done
        if time.perf_counter() - start >= seconds:
            break
    torch.cuda.synchronize()
    return calls


def measure(nvml: Nvml, name: str, fn, seconds: float, work: dict) -> dict:
    """Rate, mean power, energy per call and SM clock of `fn` run back to back for `seconds` (after a warm-up as
    long). `work`: per-call amounts (e.g. {"bytes": ..., "flops": ...}) reported as rates."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    batch = max(1, min(1000, int(0.05 / max(time.perf_counter() - t0, 1e-6))))  # ~50 ms a batch
    run_for(fn, seconds, batch)  # warm-up: the power controller settles
    sampler = Sampler(nvml)
    sampler.start()
    e0, t0 = nvml.energy_j(), time.perf_counter()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    calls = run_for(fn, seconds, batch)
    end.record()
    end.synchronize()
    e1, t1 = nvml.energy_j(), time.perf_counter()
    samples = sampler.stop()
    gpu_s = start.elapsed_time(end) * 1e-3
    row = dict(workload=name, calls=calls, us_per_call=round(gpu_s / calls * 1e6, 2),
               mean_power_w=round((e1 - e0) / (t1 - t0), 1), joules_per_call=(e1 - e0) / calls,
               sm_mhz_median=statistics.median_low(s[0] for s in samples) if samples else None,
               power_cap_share=round(sum(1 for s in samples if s[2] & SW_POWER_CAP) / max(1, len(samples)), 3),
               samples=len(samples))
    for key, amount in work.items():
        row[f"{key}_per_s"] = amount * calls / gpu_s
        row[key] = amount
    rates = "  ".join(f"{row[f'{k}_per_s'] / 1e12:8.2f} T{k}/s" for k in work)
    print(f"{name:24s} {row['us_per_call']:10.1f} us/call  {row['mean_power_w']:6.1f} W  "
          f"{row['sm_mhz_median']} MHz  power-cap {row['power_cap_share']:4.0%}  {rates}", flush=True)
    return row


def energy_model(rows: list) -> dict:
    """P0 (spin), the sustained copy and matmul rates, and the energy per byte read / per FLOP above P0."""
    spin, read, copy, mm = rows[:4]
    p0 = spin["mean_power_w"]
    model = dict(p0_w=p0, copy_bytes_per_s=copy["bytes_per_s"], fp8_flops_per_s=mm["flops_per_s"],
                 e_read=(read["mean_power_w"] - p0) / read["bytes_per_s"],
                 e_copy=(copy["mean_power_w"] - p0) / copy["bytes_per_s"],
                 e_flop=(mm["mean_power_w"] - p0) / mm["flops_per_s"])
    print(f"model: P0 {p0:.0f} W, e_read {model['e_read'] * 1e12:.1f} pJ/B, e_copy {model['e_copy'] * 1e12:.1f} pJ/B "
          f"(read + write), e_flop {model['e_flop'] * 1e15:.3f} fJ/FLOP (FP8)")
    return model


def power_floor(row: dict, nbytes: int, flops: int, model: dict, limit_w: float) -> dict:
    """`row` with the floor at the sustained ceilings, the power floor, and the call's ratios to both."""
    floor_s = max(nbytes / model["copy_bytes_per_s"], flops / model["fp8_flops_per_s"])
    work_j = nbytes * model["e_read"] + flops * model["e_flop"]
    power_s = work_j / (limit_w - model["p0_w"])
    call_s = row["us_per_call"] * 1e-6
    # time_over_bound: over the larger of the two floors (the least time either allows); time_over_power_floor: over
    # the power floor alone, which tracks the energy ratio wherever the call runs at the limit.
    row.update(floor_us=round(floor_s * 1e6, 1), power_floor_us=round(power_s * 1e6, 1),
               time_over_floor=round(call_s / floor_s, 3),
               power_floor_over_floor=round(max(power_s, floor_s) / floor_s, 3),
               time_over_bound=round(call_s / max(power_s, floor_s), 3),
               time_over_power_floor=round(call_s / power_s, 3),
               dynamic_joules_over_model=round((row["joules_per_call"] - model["p0_w"] * call_s) / work_j, 3))
    print(f"  floor {floor_s * 1e6:8.1f} us (sustained ceilings)  power floor {power_s * 1e6:8.1f} us "
          f"(x{row['power_floor_over_floor']:.2f} the floor)  call x{row['time_over_floor']:.2f} the floor, "
          f"x{row['time_over_bound']:.2f} the larger floor, x{row['time_over_power_floor']:.2f} the power floor; its "
          f"energy above P0 x{row['dynamic_joules_over_model']:.2f} the model's for its bytes and FLOPs", flush=True)
    return row


def write_json(path, limit_w: float, model: dict, rows: list) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), power_limit_w=limit_w, model=model, rows=rows), f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="V4-Flash,V4-Pro")
    parser.add_argument("--tokens", default="8192")
    parser.add_argument("--formats", default="fp8", help="fp8, mxfp4, nvfp4 (FP4: w4a8)")
    parser.add_argument("--settings", default="-", help="';'-separated kernel settings per moe row, each '-' (as set) "
                        "or a comma list of VAR=VALUE (e.g. \"-;MEGAMOE_FP8_BLOCK_M=128\")")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    settings = [setting.strip() for setting in args.settings.split(";")]
    for setting in settings:
        parse_setting(setting)  # every entry checked before hours of rows

    import megamoe
    import bench_moe

    nvml = Nvml(torch.cuda.current_device())
    limit_w = nvml.power_limit_w()
    print(f"{torch.cuda.get_device_name()}: enforced power limit {limit_w:.0f} W")
    rows = []
    rows.append(measure(nvml, "spin", lambda: torch.cuda._sleep(1 << 20), args.seconds, {}))
    big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    big.random_(0, 256)
    rows.append(measure(nvml, "read", lambda: big.view(torch.int64).amax(), args.seconds, {"bytes": big.numel()}))
    src, dst = big[: 2 << 30], big[2 << 30:]
    rows.append(measure(nvml, "copy", lambda: dst.copy_(src), args.seconds, {"bytes": 2 * src.numel()}))
    del big, src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    rows.append(measure(nvml, "matmul", lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                                 out_dtype=torch.bfloat16),
                        args.seconds, {"flops": 2 * n ** 3}))
    del a, b
    torch.cuda.empty_cache()
    model = energy_model(rows)
    for name in args.models.split(","):
        cfg = bench_moe.MODELS[name]
        e, k, h, i = cfg["num_experts"], cfg["top_k"], cfg["hidden"], cfg["intermediate"]
        for fmt in args.formats.split(","):
            gen = torch.Generator(device="cuda")
            gen.manual_seed(0)
            # FP4 weights with FP8 tokens (w4a8). Bytes: the kernel layout's (bench_moe's FP4 count; for FP8 it adds
            # the 8 bytes of the two per-expert float32 factors to bench_moe's FP8 count).
            l1, l2 = bench_moe.make_layer(cfg, gen) if fmt == "fp8" else bench_moe.make_fp4_layer(cfg, fmt, gen)
            expert_bytes = bench_moe.kernel_bytes_per_expert(l1, l2)
            for t in (int(v) for v in args.tokens.split(",")):
                x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
                idx, w = bench_moe.make_routing(t, e, k, gen)
                buf = megamoe.get_symm_buffer(None, e, t, k, h, i)
                y = torch.empty_like(x)
                step = bu.moe_step(x, idx, w, y, l1, l2, buf, fmt)
                nbytes = torch.unique(idx).numel() * expert_bytes
                flops = 2 * t * k * 3 * i * h
                for setting in settings:
                    with environment(setting):  # the kernels read their switches per call: at the capture
                        for _ in range(3):  # as bench_utils.time_graph: eager calls before the capture
                            step()
                        torch.cuda.synchronize()
                        graph = bu.capture_graph(step)
                    label = f"moe {name} {fmt} T={t}" + ("" if setting == "-" else f" {setting}")
                    row = measure(nvml, label, graph.replay, args.seconds, {"bytes": nbytes, "flops": flops})
                    rows.append(power_floor(dict(row, setting=setting), nbytes, flops, model, limit_w))
                    write_json(args.json, limit_w, model, rows)  # each row kept if a later one fails
                    del graph
                del buf
            del l1, l2
            torch.cuda.empty_cache()
    write_json(args.json, limit_w, model, rows)


if __name__ == "__main__":
    main()
