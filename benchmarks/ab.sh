#!/usr/bin/env bash
# A/B of source trees in one device call (METHOD.md: compare versions only within one run).
# AB_VARIANTS: space-separated variants, each a tree (a folder; "." is this one) optionally followed by
# ",VAR=VALUE" settings for its runs (the same tree may appear with several settings); default ".ab/base .".
# Trees other than "." are copies ignored by git (carry .ab). Prepare them here, e.g.
#   rm -rf .ab && for b in main wip/x; do mkdir -p .ab/${b//\//-} && git archive $b | tar -x -C .ab/${b//\//-}; done
#   device: run(command="AB_VARIANTS='.ab/main .ab/wip-x .,MEGAMOE_FP8_FUSED=0' bash benchmarks/ab.sh", carry=[".ab"])
# Each tree is built once, in place; with AB_TESTS (a pytest -k expression, or "all") the GPU tests (-m gpu, 300 s
# per test and AB_TEST_BUDGET_S in all at most) run for every variant but the first (the verified base;
# AB_TEST_VARIANTS="1 3" picks others, "0 1" includes the base), with its settings, and a variant that fails them
# (but the base) is left out of the benchmark; bench_moe (no peer pipeline) then runs on the variants in turn, AB_ROUNDS times. Under $OUT (at most
# 8 files come back): ab.txt (each row's median time / floor per variant and its median time over the first
# variant's), ab.json (every row, with variant and round), ab-log.txt (build, test and bench logs).
#   AB_FORMATS (fp8), AB_ACT_FORMATS (fp8,fp4: the FP4 rows), AB_MODELS (V4-Flash,V4-Pro), AB_TOKENS (1,16,512,2048,8192), AB_ROUNDS (1)
set -uo pipefail
here=$(pwd)
out=${OUT:-device_out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=$(mktemp -d)
log="$out/ab-log.txt"
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$log"

specs=(${AB_VARIANTS:-.ab/base .})
names=()
declare -A built
for spec in "${specs[@]}"; do
  dir=${spec%%,*}
  [ -d "$dir" ] || { echo "ab.sh: no tree at $dir (see the header of this script)"; exit 2; }
  tree=$(cd "$dir" && pwd)
  name=$([ "$tree" = "$here" ] && echo here || basename "$tree")
  [ "$spec" != "$dir" ] && name="$name+${spec#*,}"
  name=${name//[^A-Za-z0-9._+-]/-}
  names+=("$name")
  if [ -z "${built[$tree]:-}" ]; then
    start=$(date +%s)
    if ! (cd "$tree" && python3 setup.py build_ext --inplace >"$work/build.log" 2>&1); then
      tail -40 "$work/build.log" | tee -a "$log"
      exit 1
    fi
    built[$tree]=1
    echo "build $name: $(( $(date +%s) - start )) s" | tee -a "$log"
  fi
done

# Runs "$@" in variant i's tree with its settings.
in_variant() {
  local i=$1; shift
  local spec=${specs[$i]} dir=${specs[$i]%%,*}
  local envs=()
  [ "$spec" != "$dir" ] && IFS=, read -ra envs <<<"${spec#*,}"
  (cd "$dir" && env PYTHONPATH="$(pwd)" "${envs[@]}" "$@")
}

declare -A failed
if [ -n "${AB_TESTS:-}" ]; then
  for i in "${!specs[@]}"; do
    # AB_TEST_VARIANTS: the variant indices whose tests run (default: every variant but the first; "0" in it tests the
    # base too, e.g. a main whose last change has not run the GPU tests yet); the others are benchmarked untested
    # (variants that differ only in settings the tests switch themselves).
    if [ -n "${AB_TEST_VARIANTS:-}" ]; then
      [[ " $AB_TEST_VARIANTS " != *" $i "* ]] && continue
    elif [ "$i" = 0 ]; then
      continue
    fi
    # thread method: the default (a signal) never fires while a hung kernel holds the process in a CUDA call.
    args=(-q -m gpu -p no:cacheprovider --maxfail=5 --timeout=300 --timeout-method=thread)
    [ "$AB_TESTS" != all ] && args+=(-k "$AB_TESTS")
    # AB_TEST_BUDGET_S (default 240) bounds a variant's whole test run: a selection that outgrows it (the V4
    # shapes' layers take ~20 s each to build) would otherwise eat the call's 10 minutes before any bench row
    # (2026-11-24). A variant whose tests ran out of time is benchmarked, marked "untested" in the table.
    in_variant "$i" timeout "${AB_TEST_BUDGET_S:-240}" python3 -m pytest tests "${args[@]}" >"$work/tests.log" 2>&1
    rc=$?
    { echo "== tests ${names[$i]} (rc $rc)"; tail -30 "$work/tests.log"; } >>"$log"
    echo "tests ${names[$i]}: $(tail -1 "$work/tests.log")"
    if [ $rc = 124 ]; then
      echo "ab.sh: ${names[$i]}'s tests ran past AB_TEST_BUDGET_S=${AB_TEST_BUDGET_S:-240} s: benchmarked untested"
      names[$i]="${names[$i]}(untested)"
    elif [ $rc != 0 ]; then
      tail -30 "$work/tests.log"
      if [ "$i" = 0 ]; then  # the base stays the ratios' reference: benchmarked, marked
        echo "ab.sh: ${names[$i]} (the base) failed its GPU tests: benchmarked, marked"
        names[$i]="${names[$i]}(tests-FAILED)"
      else
        echo "ab.sh: ${names[$i]} failed its GPU tests: not benchmarked"
        failed[$i]=1
      fi
    fi
  done
fi

# Table of what has run so far (rewritten after each bench, so a call cut off at its limit still returns one).
summarize() {
python3 - "$work" "$out" "${names[@]}" <<'PY' >"$out/ab.txt"
import glob, json, statistics, sys
work, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
med, med_us, med_ig, every = {}, {}, {}, []
for i, v in enumerate(names):
    rows, us, ig = {}, {}, {}
    for f in sorted(glob.glob(f"{work}/ab-{i}-*.json")):
        doc = json.load(open(f))
        for r in doc["rows"]:
            key = (r["model"], r["format"], r["act_format"], r["tokens_per_rank"])
            rows.setdefault(key, []).append(r["time_over_floor"])
            us.setdefault(key, []).append(r["us"])
            if r.get("in_graph_us"):
                ig.setdefault(key, []).append(r["in_graph_us"])
            every.append(dict(r, variant=v, round=int(f.rsplit("-", 1)[1][:-5]), gpu=doc["gpu"]))
    med[i] = {k: statistics.median(x) for k, x in rows.items()}  # by index: two variants may share a name
    med_us[i] = {k: statistics.median(x) for k, x in us.items()}
    med_ig[i] = {k: statistics.median(x) for k, x in ig.items()}
json.dump(every, open(f"{out}/ab.json", "w"), indent=1)
print("variants: " + ", ".join(f"[{i}] {v}" for i, v in enumerate(names)))
print(f"{'model':9} {'format':10} {'T':>5} " + " ".join(f"{'[' + str(i) + ']':>14}" for i in range(len(names)))
      + f"   (x floor; time / [0]'s)")
for k in sorted(med[0]):
    cells = []
    for i in range(len(names)):
        x = med[i].get(k)
        cells.append("-" if x is None else f"{x:6.3f} ({med_us[i][k] / med_us[0][k]:5.3f})")
    print(f"{k[0]:9} {k[1] + ':' + k[2]:10} {k[3]:5d} " + " ".join(f"{c:>14}" for c in cells))
if med_ig[0]:
    print("in a graph of 8 calls (no graph launch per call): us (time / [0]'s)")
    for k in sorted(med_ig[0]):
        cells = [("-" if med_ig[i].get(k) is None else f"{med_ig[i][k]:7.1f} ({med_ig[i][k] / med_ig[0][k]:5.3f})")
                 for i in range(len(names))]
        print(f"{k[0]:9} {k[1] + ':' + k[2]:10} {k[3]:5d} " + " ".join(f"{c:>15}" for c in cells))
PY
}

for round in $(seq 1 "${AB_ROUNDS:-1}"); do
  for i in "${!specs[@]}"; do
    [ -n "${failed[$i]:-}" ] && continue
    in_variant "$i" timeout 300 python3 benchmarks/bench_moe.py --no-peer --formats "${AB_FORMATS:-fp8}" \
      --act-formats "${AB_ACT_FORMATS:-fp8,fp4}" \
      --models "${AB_MODELS:-V4-Flash,V4-Pro}" --tokens "${AB_TOKENS:-1,16,512,2048,8192}" \
      --json "$work/ab-$i-$round.json" >"$work/bench.log" 2>&1
    rc=$?
    { echo "== bench ${names[$i]} round $round (rc $rc)"; cat "$work/bench.log"; } >>"$log"
    [ $rc = 0 ] || { tail -20 "$work/bench.log"; summarize; exit 1; }
    summarize
    echo "round $round ${names[$i]} done"
  done
done
cat "$out/ab.txt"
