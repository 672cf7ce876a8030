#!/usr/bin/env bash
# A/B of source trees in one device call (METHOD.md: compare versions only within one run).
# The variants are the trees in AB_VARIANTS (default .ab/base; ignored by git: carry .ab) plus this tree,
# named "here". Prepare them here, e.g.
#   rm -rf .ab && for b in main wip/x; do mkdir -p .ab/${b//\//-} && git archive $b | tar -x -C .ab/${b//\//-}; done
#   device: run(command="AB_VARIANTS='.ab/main .ab/wip-x' bash benchmarks/ab.sh", carry=[".ab"])
# Each tree is built in place; with AB_TESTS (a pytest -k expression, or "all") the GPU tests (-m gpu, 300 s
# per test at most) of every variant but the first (the verified base) run; bench_moe (no peer pipeline)
# then runs on the variants in turn, AB_ROUNDS times. Under $OUT (at most 8 files come back): ab.txt (the
# table: each row's median time / floor per variant and its median time over the first variant's),
# ab.json (every row, with variant and round), ab-log.txt (build, test and bench logs, tails).
#   AB_FORMATS (fp8), AB_MODELS (V4-Flash,V4-Pro), AB_TOKENS (1,16,512,2048,8192), AB_ROUNDS (1)
set -uo pipefail
here=$(pwd)
trees=()
for v in ${AB_VARIANTS:-.ab/base}; do
  [ -d "$v" ] || { echo "ab.sh: no tree at $v (see the header of this script)"; exit 2; }
  trees+=("$(cd "$v" && pwd)")
done
trees+=("$here")
name_of() { [ "$1" = "$here" ] && echo here || basename "$1"; }
out=${OUT:-device_out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=$(mktemp -d)
log="$out/ab-log.txt"
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$log"

for tree in "${trees[@]}"; do
  name=$(name_of "$tree")
  start=$(date +%s)
  if ! (cd "$tree" && python3 setup.py build_ext --inplace >"$work/build-$name.log" 2>&1); then
    tail -40 "$work/build-$name.log" | tee -a "$log"
    exit 1
  fi
  echo "build $name: $(( $(date +%s) - start )) s" | tee -a "$log"
  if [ -n "${AB_TESTS:-}" ] && [ "$tree" != "${trees[0]}" ]; then
    args=(-q -m gpu -p no:cacheprovider --maxfail=5 --timeout=300)
    [ "$AB_TESTS" != all ] && args+=(-k "$AB_TESTS")
    (cd "$tree" && PYTHONPATH=$tree python3 -m pytest tests "${args[@]}") >"$work/tests-$name.log" 2>&1
    rc=$?
    { echo "== tests $name (rc $rc)"; tail -30 "$work/tests-$name.log"; } >>"$log"
    echo "tests $name: $(tail -1 "$work/tests-$name.log")"
    [ $rc = 0 ] || { tail -30 "$work/tests-$name.log"; echo "ab.sh: $name failed its GPU tests; no benchmark"; exit 1; }
  fi
done

for round in $(seq 1 "${AB_ROUNDS:-1}"); do
  for tree in "${trees[@]}"; do
    name=$(name_of "$tree")
    (cd "$tree" && PYTHONPATH=$tree python3 benchmarks/bench_moe.py --no-peer --formats "${AB_FORMATS:-fp8}" \
      --models "${AB_MODELS:-V4-Flash,V4-Pro}" --tokens "${AB_TOKENS:-1,16,512,2048,8192}" \
      --json "$work/ab-$name-$round.json") >"$work/ab-$name-$round.log" 2>&1
    rc=$?
    { echo "== bench $name round $round (rc $rc)"; cat "$work/ab-$name-$round.log"; } >>"$log"
    [ $rc = 0 ] || { tail -20 "$work/ab-$name-$round.log"; exit 1; }
    echo "round $round $name done"
  done
done

names=()
for tree in "${trees[@]}"; do names+=("$(name_of "$tree")"); done
python3 - "$work" "$out" "${names[@]}" <<'PY' | tee "$out/ab.txt"
import glob, json, os, statistics, sys
work, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
med, med_us, every = {}, {}, []
for v in names:
    rows, us = {}, {}
    for f in sorted(glob.glob(f"{work}/ab-{v}-*.json")):
        doc = json.load(open(f))
        for r in doc["rows"]:
            key = (r["model"], r["format"], r["act_format"], r["tokens_per_rank"])
            rows.setdefault(key, []).append(r["time_over_floor"])
            us.setdefault(key, []).append(r["us"])
            every.append(dict(r, variant=v, round=os.path.basename(f).rsplit("-", 1)[1][:-5], gpu=doc["gpu"]))
    med[v] = {k: statistics.median(x) for k, x in rows.items()}
    med_us[v] = {k: statistics.median(x) for k, x in us.items()}
json.dump(every, open(f"{out}/ab.json", "w"), indent=1)
first = names[0]
print(f"{'model':9} {'format':10} {'T':>5} " + " ".join(f"{v[:14]:>14}" for v in names)
      + f"   (x floor; time / {first}'s)")
for k in sorted(med[first]):
    cells = []
    for v in names:
        x = med[v].get(k)
        cells.append("-" if x is None else f"{x:6.3f} ({med_us[v][k] / med_us[first][k]:5.3f})")
    print(f"{k[0]:9} {k[1] + ':' + k[2]:10} {k[3]:5d} " + " ".join(f"{c:>14}" for c in cells))
PY
