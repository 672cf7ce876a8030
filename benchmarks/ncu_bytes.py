"""Per-kernel DRAM and L2 bytes of one call, from an ncu --csv run of profile_moe.py --ncu (device_check.sh bytes).

    ncu --profile-from-start off --metrics <METRICS> --print-units base --csv python3 profile_moe.py --ncu ... > run.csv
    python3 benchmarks/ncu_bytes.py run.csv

ncu replays each kernel with the caches flushed before it (its default --cache-control all), so a kernel's DRAM bytes
are what it moves from a cold L2: the call's own traffic, kernel by kernel, against the weight bytes of the floor.
"""
from __future__ import annotations

import collections
import csv
import sys

# What device_check.sh's bytes mode asks ncu for.
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sectors_op_read.sum", "lts__t_sectors_op_write.sum",
           "lts__t_sector_hit_rate.pct", "gpu__time_duration.sum")
BASE_UNITS = {"byte", "sector", "ns", "nsecond", "%"}  # ncu 2025 names nanoseconds "ns" in base units


def per_kernel(path: str) -> "collections.OrderedDict[tuple[str, str], dict[str, float]]":
    """{(launch id, kernel name): {metric: value}} in launch order."""
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    header, rows = rows[0], rows[1:]
    col = {name: header.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
    kernels: collections.OrderedDict = collections.OrderedDict()
    for r in rows:
        unit, text = r[col["Metric Unit"]], r[col["Metric Value"]].replace(",", "")
        # Base units only (device_check passes --print-units base): a scaled unit would be read wrong here.
        if unit not in BASE_UNITS:
            raise ValueError(f"{path}: {r[col['Metric Name']]} in {unit!r}, expected one of {sorted(BASE_UNITS)} "
                             "(run ncu with --print-units base)")
        try:
            value = float(text)
        except ValueError:  # "n/a" where a metric was not collected
            continue
        kernels.setdefault((r[col["ID"]], r[col["Kernel Name"]]), {})[r[col["Metric Name"]]] = value
    return kernels


def main():
    for path in sys.argv[1:]:
        kernels = per_kernel(path)
        print(f"== {path}")
        print(f"{'kernel':48s} {'us':>8s} {'DRAM rd GB':>10s} {'DRAM wr GB':>10s} {'L2 rd GB':>9s} {'L2 wr GB':>9s} "
              f"{'L2 hit':>7s}")
        total = collections.Counter()
        for (_, name), m in kernels.items():
            short = name.replace("void ", "").replace("<unnamed>::", "").replace("unnamed>::", "").replace("(anonymous namespace)::", "").split("(")[0][:48]
            row = dict(us=m.get("gpu__time_duration.sum", 0) / 1e3, rd=m.get("dram__bytes_read.sum", 0) / 1e9,
                       wr=m.get("dram__bytes_write.sum", 0) / 1e9, l2rd=m.get("lts__t_sectors_op_read.sum", 0) * 32 / 1e9,
                       l2wr=m.get("lts__t_sectors_op_write.sum", 0) * 32 / 1e9)
            total.update(row)
            print(f"{short:48s} {row['us']:8.1f} {row['rd']:10.3f} {row['wr']:10.3f} {row['l2rd']:9.2f} {row['l2wr']:9.2f} "
                  f"{m.get('lts__t_sector_hit_rate.pct', float('nan')):6.1f}%")
        print(f"{'total':48s} {total['us']:8.1f} {total['rd']:10.3f} {total['wr']:10.3f} {total['l2rd']:9.2f} "
              f"{total['l2wr']:9.2f}")


if __name__ == "__main__":
    main()
