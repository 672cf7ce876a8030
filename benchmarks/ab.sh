#!/usr/bin/env bash
# A/B of two source trees in one device call (METHOD.md: compare versions only within one run).
# B is this tree; A is a copy of the base version (default .ab/base, ignored by git: carry it).
#   here:   rm -rf .ab/base && mkdir -p .ab/base && git archive main | tar -x -C .ab/base
#   device: run(command="bash benchmarks/ab.sh", carry=[".ab"])
# Each tree is built in place; bench_moe then runs on A and B alternately, AB_ROUNDS times, and the last
# lines compare the medians (time / floor of each row, B / A). With AB_TESTS (a pytest -k expression, or
# "all") B's GPU tests run first and a failure stops the call.
#   AB_BASE, AB_FORMATS (fp8), AB_MODELS (V4-Flash,V4-Pro), AB_TOKENS (1,16,512,2048,8192), AB_ROUNDS (2)
set -uo pipefail
base=${AB_BASE:-.ab/base}
[ -d "$base" ] || { echo "ab.sh: no base tree at $base (see the header of this script)"; exit 2; }
base=$(cd "$base" && pwd)
here=$(pwd)
out=${OUT:-device_out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"

for tree in "$base" "$here"; do
  name=$([ "$tree" = "$base" ] && echo A || echo B)
  start=$(date +%s)
  (cd "$tree" && python3 setup.py build_ext --inplace >"$out/build-$name.log" 2>&1) || { tail -40 "$out/build-$name.log"; exit 1; }
  echo "build $name: $(( $(date +%s) - start )) s"
done

if [ -n "${AB_TESTS:-}" ]; then
  args=(-q -m gpu -p no:cacheprovider --maxfail=5)
  [ "$AB_TESTS" != all ] && args+=(-k "$AB_TESTS")
  PYTHONPATH=$here python3 -m pytest tests "${args[@]}" 2>&1 | tee "$out/tests-B.log" | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "ab.sh: B's GPU tests failed; no benchmark"; exit 1; }
fi

for round in $(seq 1 "${AB_ROUNDS:-2}"); do
  for tree in "$base" "$here"; do
    name=$([ "$tree" = "$base" ] && echo A || echo B)
    (cd "$tree" && PYTHONPATH=$tree python3 benchmarks/bench_moe.py --formats "${AB_FORMATS:-fp8}" \
      --models "${AB_MODELS:-V4-Flash,V4-Pro}" --tokens "${AB_TOKENS:-1,16,512,2048,8192}" \
      --json "$out/ab-$name-$round.json") >"$out/ab-$name-$round.log" 2>&1 || { tail -20 "$out/ab-$name-$round.log"; exit 1; }
    echo "round $round $name done"
  done
done

python3 - "$out" <<'EOF'
import glob, json, statistics, sys
out = sys.argv[1]
runs = {v: [json.load(open(f)) for f in sorted(glob.glob(f"{out}/ab-{v}-*.json"))] for v in "AB"}
def key(r):
    return (r["model"], r["format"], r["act_format"], r["tokens_per_rank"])
med = {}
for v, docs in runs.items():
    rows = {}
    for d in docs:
        for r in d["rows"]:
            rows.setdefault(key(r), []).append(r["time_over_floor"])
    med[v] = {k: statistics.median(x) for k, x in rows.items()}
print(f"{'model':9} {'format':10} {'T':>5} {'A x floor':>10} {'B x floor':>10} {'B / A':>6}")
for k in sorted(med["A"]):
    if k in med["B"]:
        a, b = med["A"][k], med["B"][k]
        print(f"{k[0]:9} {k[1] + ':' + k[2]:10} {k[3]:5d} {a:10.3f} {b:10.3f} {b / a:6.3f}")
EOF
