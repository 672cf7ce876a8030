#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, benchmark. Logs under $OUT (or ./device_out).
#   benchmarks/device_check.sh [build|quick|test|sanitize|profile|bench|fp4|all][,more modes] [pytest -k expression]
#   fp4: the FP4 GPU tests (with the sweep and the exactness test), then the FP4 probe benchmark.
#   ablate: FP8 GEMM ablation builds with tile traces (ABLATIONS, ABL_MODEL, ABL_TOKENS; see below).
#   sanitize: SANITIZE_FP8_K / SANITIZE_FP4_K replace the test selections (e.g. SANITIZE_FP8_K=pair_walk; none skips
#   the FP8 tests); SANITIZE_KERNELS limits the tools to kernels whose name holds it (e.g. SANITIZE_FP8_K=none
#   SANITIZE_FP4_K=fp4_gemv SANITIZE_KERNELS=fp4_gemv: the GEMV alone).
#   poison: the FP4 GPU tests (POISON_K, default all of test_gpu_fp4.py) on a build whose converters fill the token
#   columns past each tile's rows with NaN (MEGAMOE_POISON_STALE_COLUMNS): no stored value may depend on them.
#   race: racecheck of the FP8 tests RACE_K in one tree per RACE_VARIANTS entry ("none" or ablate.py patches that
#   keep results exact: sync-scales, fill-scales); hazard summaries in race-<variant>.log; RACE_ARGS go to
#   compute-sanitizer (e.g. "--racecheck-report hazard": every hazard with its addresses and threads).
#   clocks: SM clock, power and throttle reasons (nvidia-smi every 50 ms) during bench_moe at CLOCK_TOKENS (8192) for
#   CLOCK_MODEL (V4-Flash), FP8, no peer: clocks-<tree>.csv, clocks.log; CLOCK_ABLATIONS (space-separated ablate.py patch
#   lists, "none" for this tree) runs ablated copies of the tree in turn (e.g. "none no-scales ones-scales": does a
#   faster ablation run at a higher clock, i.e. is the loop held by power?).
#   power: benchmarks/probe_power.py (energy and clock of copy, read, FP8 matmul and the FP8 call at POWER_TOKENS (8192)
#   of POWER_MODELS (V4-Flash,V4-Pro) and POWER_FORMATS (fp8; mxfp4, nvfp4: w4a8); the power floor) per
#   POWER_ABLATIONS tree ("none" for this tree), each moe row once per POWER_SETTINGS entry (";"-separated, "-" or
#   VAR=VALUE,...), POWER_SECONDS (3) a workload: power.log, power-<tree>.json.
#   profile: profile_moe.py per kernel for PROFILE_CASES (space-separated fmt:act, default fp8:fp8) at PROFILE_TOKENS
#   (1,128,8192) of PROFILE_MODEL (V4-Flash); PROFILE_TIMELINE=1 adds the graph-replay timeline (PROFILE_FLUSH=1: each
#   replay after an L2 flush, as the bench's per-replay figure); PROFILE_ABLATIONS (space-separated ablate.py patch
#   lists, "none" for this tree) profile ablated copies of the tree in turn.
#   ncu: Nsight Compute reports of the grouped GEMMs (NCU_CASES, see below; NCU_KERNELS: another kernel-name regex).
#   stream: the HBM -> shared-memory streaming ceiling per SM count and bytes in flight (probe_stream.py; STREAM_PATTERNS
#   picks its --patterns, e.g. gemv: the FP4 GEMV's chunk ring by box shape and small copies).
#   bytes: DRAM and L2 bytes per kernel of one call (ncu metrics, benchmarks/ncu_bytes.py) per BYTES_CASES entry
#   (model:format:tokens, default V4-Flash:fp8:8192 V4-Pro:fp8:8192 V4-Flash:mxfp4:8192): bytes.log, bytes-*.csv.
#   trace: tile traces (tile_trace.py) from a MEGAMOE_TILE_TRACE build, TRACE_CASES (fmt:act:T, default MXFP4 w4a8 at
#   T = 1, 16, 512), TRACE_MODEL (V4-Flash): trace-*.txt / .json.
#   probe: the FP4 consumer-loop probe (probe_fp4.py: decode + register-A wgmmas in shared memory) and the FP8 loop's
#   promotion rows (probe_mma.py --scales-only); no extension build.
#   ep: expert parallelism on every GPU of the machine: tests/test_ep.py (EP_FORMATS, default fp8:fp8) then bench_ep.py
#   (V4-Flash, --formats EP_BENCH_FORMATS, default fp8), once per setting in EP_SETTINGS (space-separated, each
#   "-" or a comma list of VAR=VALUE, e.g. "- MEGAMOE_FP8_FUSED=1"; EP_TESTS=0 / EP_BENCH=0 skip a step; EP_BENCH_ARGS, e.g. "--alt-env MEGAMOE_FP8_FUSED=1", go to bench_ep.py); logs in ep.log, rows in ep-<setting>.json.
#   bench_ep.py fails the call when a row differs from the NCCL pipeline by more than 1e-2. At 8 ranks the tests take
#   about twice EP=4's ~235 s for four FP4 pairs: one format pair a call, EP_BENCH=0 for the test calls, and
#   EP_SHAPES=flash-large once (its pool regions start past 2^31 at 8 ranks: docs/perf-notes.md, fifty-third session).
#   eptrace: the EP launch chain's phases at decode (ep_trace.py) on every GPU of the machine, from a MEGAMOE_PHASE_TRACE
#   build, per EPTRACE_CASES entry (fmt:act:tokens per rank, default fp8:fp8:1 mxfp4:fp8:1), model EPTRACE_MODEL.
#   Modes combine with commas (e.g. fp4,bench); BENCH_FORMATS picks bench_moe's --formats (default fp8).
#   Pass MEGAMOE_COMMIT=<this tree's hash> for bench.json's commit: the device copy's git HEAD was stale on 2026-11-26.
set -uo pipefail
what=${1:-all}
kexpr=${2:-}
[[ ",$what," == *",all,"* ]] && what="$what,test,sanitize,bench"
has() { [[ ",$what," == *",$1,"* ]]; }
# patched_tree PATCHES LOG [VAR=VALUE...]: a copy of this tree with benchmarks/ablate.py's PATCHES applied
# ("none": unpatched), built with the given environment (log in $out/LOG); prints the copy's path, fails if the
# build fails (the log's tail on stderr).
patched_tree() {
  local patches=$1 log=$2 tree
  shift 2
  tree=$(mktemp -d)
  tar --exclude=./build --exclude=./.ab --exclude='./megamoe/*.so' -cf - . | tar -xf - -C "$tree"
  [ "$patches" != none ] && python3 benchmarks/ablate.py "$tree" "$patches" >&2
  if ! (cd "$tree" && env "$@" python3 setup.py build_ext --inplace >"$out/$log" 2>&1); then
    tail -20 "$out/$log" >&2
    return 1
  fi
  echo "$tree"
}
# ablation_tree PATCHES LOG: this tree for "none", else patched_tree PATCHES LOG (its build log removed on success:
# at most 8 files come back from a call).
ablation_tree() {
  [ "$1" = none ] && { echo "$PWD"; return 0; }
  patched_tree "$1" "$2" && rm -f "$out/$2"
}
out=${OUT:-device_out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export CXX=/usr/bin/g++ CC=/usr/bin/gcc TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$out/gpu.txt"

if [ "$what" != stream ] && [ "$what" != ablate ] && [ "$what" != race ] && [ "$what" != poison ] && [ "$what" != probe ] && [ "$what" != trace ] && [ "$what" != eptrace ]; then  # these build their own trees (or none)
  start=$(date +%s)
  python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi
[ "$what" = build ] && exit 0

if has quick || has test; then
  args=(-q --timeout=900 --timeout-method=thread -p no:cacheprovider)  # thread: fires on a hung kernel too
  has quick && args+=(-m gpu)
  [ -n "$kexpr" ] && args+=(-k "$kexpr")
  python3 -m pytest tests "${args[@]}" 2>&1 | tee "$out/tests.log" | tail -40
fi
if has fp4; then
  python3 -m pytest tests/test_gpu_fp4.py tests/test_nvfp4_exactness.py -q -p no:cacheprovider --maxfail=5 2>&1 \
    | tee "$out/tests-fp4.log" | tail -5
  python3 benchmarks/bench_fp4_probe.py --check --bench --tokens 1,16,128,512 2>&1 | tee "$out/fp4-probe.log"
fi
if has stream; then
  python3 benchmarks/probe_stream.py --json "$out/stream.json" ${STREAM_PATTERNS:+--patterns "$STREAM_PATTERNS"} 2>&1 \
    | tee "$out/stream.log"
fi
if has power; then
  for ablation in ${POWER_ABLATIONS:-none}; do
    tree=$(ablation_tree "$ablation" build-power.log) || exit 1
    echo "== tree: ${ablation/none/this}" | tee -a "$out/power.log"
    # --settings=...: its value starts with "-", which argparse would take for an option.
    (cd "$tree/benchmarks" && PYTHONPATH="$tree" python3 probe_power.py --models "${POWER_MODELS:-V4-Flash,V4-Pro}" \
      --tokens "${POWER_TOKENS:-8192}" --formats "${POWER_FORMATS:-fp8}" --settings="${POWER_SETTINGS:--}" \
      --seconds "${POWER_SECONDS:-3}" --json "$out/power-${ablation//,/.}.json") 2>&1 | tee -a "$out/power.log"
  done
fi
if has profile; then
  for ablation in ${PROFILE_ABLATIONS:-none}; do
    tree=$(ablation_tree "$ablation" build-profile.log) || exit 1
    for case in ${PROFILE_CASES:-fp8:fp8}; do
      echo "== tree: ${ablation/none/this}"
      (cd "$tree/benchmarks" && PYTHONPATH="$tree" python3 profile_moe.py --model "${PROFILE_MODEL:-V4-Flash}" \
        --tokens "${PROFILE_TOKENS:-1,128,8192}" --format "${case%%:*}" --act-format "${case##*:}" \
        $([ "${PROFILE_TIMELINE:-0}" = 1 ] && echo --timeline) $([ "${PROFILE_FLUSH:-0}" = 1 ] && echo --flush))
    done
  done 2>&1 | tee "$out/profile.log"
fi
if has ncu; then
  # Nsight Compute, full set with source counters, of the grouped-GEMM kernels of one call per case
  # (NCU_CASES: format:act_format:tokens; NCU_MODEL, default V4-Flash); details and per-SASS-instruction stalls as text.
  # NCU_ABLATION (benchmarks/ablate.py patches, comma list) profiles an ablated copy of the tree instead.
  ncu_tree=$PWD
  if [ -n "${NCU_ABLATION:-}" ]; then
    ncu_tree=$(patched_tree "$NCU_ABLATION" build-ncu.log) || exit 1
  fi
  for spec in ${NCU_CASES:-mxfp4:fp8:16 fp8:fp8:1}; do
    IFS=: read -r fmt act t <<<"$spec"
    rep="$out/ncu-$fmt-a$act-$t${NCU_ABLATION:+-abl}"
    (cd "$ncu_tree/benchmarks" && PYTHONPATH="$ncu_tree" ncu --profile-from-start off --clock-control none --set full --import-source yes \
      -k "regex:${NCU_KERNELS:-grouped_gemm}" -f -o "$rep" python3 profile_moe.py --ncu --model "${NCU_MODEL:-V4-Flash}" --format "$fmt" \
      --act-format "$act" --tokens "$t") >"$rep.log" 2>&1 || tail -20 "$rep.log"
    ncu -i "$rep.ncu-rep" --page details >"$rep-details.txt" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep-sass.csv" 2>&1
    grep -E "Duration|Issued Warp|Eligible|Active Warps|No Eligible|DRAM Throughput|Compute \(SM\)" "$rep-details.txt"
    # At most 8 files come back from a device call: keep the text, drop the binary report unless NCU_KEEP_REP=1.
    gzip -f "$rep-sass.csv"
    [ "${NCU_KEEP_REP:-0}" = 1 ] || rm -f "$rep.ncu-rep" "$rep.log"
  done
fi
if has bytes; then
  # DRAM and L2 bytes per kernel of one call (ncu, cold L2 before each kernel) per BYTES_CASES entry
  # (model:format:tokens, default V4-Flash and V4-Pro FP8 and V4-Flash MXFP4 at 8192; FP4 with FP8 tokens).
  metrics=$(cd benchmarks && python3 -c "import ncu_bytes; print(','.join(ncu_bytes.METRICS))")
  for spec in ${BYTES_CASES:-V4-Flash:fp8:8192 V4-Pro:fp8:8192 V4-Flash:mxfp4:8192}; do
    IFS=: read -r model fmt t <<<"$spec"
    csv="$out/bytes-$model-$fmt-$t.csv"
    if (cd benchmarks && ncu --profile-from-start off --clock-control none --metrics "$metrics" --print-units base \
        --csv python3 profile_moe.py --ncu --model "$model" --format "$fmt" --tokens "$t") >"$csv" 2>"$out/bytes.err"
    then
      python3 benchmarks/ncu_bytes.py "$csv" | tee -a "$out/bytes.log"
    else
      tail -20 "$out/bytes.err"
    fi
  done
fi
if has trace; then
  # Tile traces (benchmarks/tile_trace.py) from a diagnostic build (MEGAMOE_TILE_TRACE) of this tree, one per
  # TRACE_CASES entry (format:act_format:tokens, default FP4 decode), model TRACE_MODEL (V4-Flash).
  tree=$(patched_tree none build-trace.log MEGAMOE_NVCC_DEFINES=MEGAMOE_TILE_TRACE) || exit 1
  for spec in ${TRACE_CASES:-mxfp4:fp8:1 mxfp4:fp8:16 mxfp4:fp8:512}; do
    IFS=: read -r fmt act t <<<"$spec"
    (cd "$tree" && PYTHONPATH="$tree" timeout 300 python3 benchmarks/tile_trace.py --model "${TRACE_MODEL:-V4-Flash}" \
      --format "$fmt" --act-format "$act" --tokens "$t" --json "$out/trace-$fmt-a$act-$t.json") \
      >"$out/trace-$fmt-a$act-$t.txt" 2>&1
    echo "== trace $spec"; grep -v "^CTAs inside\|^[0-9]*:[0-9]" "$out/trace-$fmt-a$act-$t.txt" | cut -c1-220
  done
fi
if has eptrace; then
  tree=$(patched_tree none build-eptrace.log MEGAMOE_NVCC_DEFINES=MEGAMOE_PHASE_TRACE) || exit 1
  ngpu=$(nvidia-smi -L | wc -l)
  for spec in ${EPTRACE_CASES:-fp8:fp8:1 mxfp4:fp8:1}; do
    IFS=: read -r fmt act t <<<"$spec"
    stamps=$(mktemp -d)
    (cd "$tree" && PYTHONPATH="$tree:$tree/benchmarks" timeout 300 python3 -m torch.distributed.run --nproc-per-node $ngpu \
      benchmarks/ep_trace.py --model "${EPTRACE_MODEL:-V4-Flash}" --format "$fmt" --act-format "$act" --tokens "$t" \
      --dir "$stamps") 2>&1 | grep -v "^W\|^\*" | tee -a "$out/eptrace.log"
    rm -rf "$stamps"
  done
fi
if has probe; then
  (cd benchmarks && python3 probe_fp4.py --json "$out/probe-fp4.json") 2>&1 | grep -v "warning\|module\|^ *$\|\^" | tee "$out/probe-fp4.log"
  (cd benchmarks && python3 probe_mma.py --scales-only --json "$out/probe-mma-scales.json") 2>&1 \
    | grep -v "warning\|module\|^ *$\|\^" | tee "$out/probe-mma-scales.log"
fi
if has ep; then
  ngpu=$(nvidia-smi -L | wc -l)
  formats=${EP_FORMATS:-fp8:fp8}
  for setting in ${EP_SETTINGS:--}; do
    envs=(); [ "$setting" != - ] && IFS=, read -ra envs <<<"$setting"
    tag=${setting//[^A-Za-z0-9]/_}
    if [ "${EP_TESTS:-1}" = 1 ]; then
    echo "== EP=$ngpu setting $setting: tests/test_ep.py ($formats)" | tee -a "$out/ep.log"
    env "${envs[@]}" MEGAMOE_EP_RANKS=$ngpu MEGAMOE_EP_FORMATS=$formats MEGAMOE_EP_SHAPES=${EP_SHAPES:-small,flash} \
      python3 -m pytest tests/test_ep.py -q -p no:cacheprovider 2>&1 | tail -5 | tee -a "$out/ep.log"
    fi
    [ "${EP_BENCH:-1}" = 1 ] || continue
    echo "== EP=$ngpu setting $setting: bench_ep.py" | tee -a "$out/ep.log"
    env "${envs[@]}" python3 -m torch.distributed.run --nproc-per-node $ngpu benchmarks/bench_ep.py \
      --formats "${EP_BENCH_FORMATS:-fp8}" ${EP_BENCH_ARGS:-} --json "$out/ep-$tag.json" 2>&1 | grep -v "^W\|^\*" | tee -a "$out/ep.log"
  done
fi
if has bench; then
  python3 benchmarks/bench_moe.py --formats "${BENCH_FORMATS:-fp8}" --json "$out/bench.json" --plot "$out/bench.png" 2>&1 | tee "$out/bench.log"
fi
if has ablate; then
  # Ablation builds of the FP8 GEMM (benchmarks/ablate.py: timing only, outputs garbage), each with a tile trace of
  # one call: ABLATIONS (space-separated; "none" or a comma list of ablations), ABL_MODEL (V4-Flash), ABL_TOKENS (8192).
  for abl in ${ABLATIONS:-none no-scales,no-token-tma,no-weight-tma}; do
    tag=${abl//,/.}  # no '+': the device tool returns only plain file names
    tree=$(patched_tree "$abl" "build-abl-$tag.log" MEGAMOE_NVCC_DEFINES=MEGAMOE_TILE_TRACE) || continue
    (cd "$tree" && PYTHONPATH="$tree" timeout 300 python3 benchmarks/tile_trace.py --model "${ABL_MODEL:-V4-Flash}" \
      --tokens "${ABL_TOKENS:-8192}") >"$out/trace-abl-$tag.txt" 2>&1
    echo "== ablation $abl"; grep -A4 "^L1:\|^whole walk" "$out/trace-abl-$tag.txt" | grep -v "^L1: \(epilogue\|claim\)\|^--" | cut -c1-220
  done
fi
if has clocks; then
  for ablation in ${CLOCK_ABLATIONS:-none}; do
    tree=$(ablation_tree "$ablation" build-clocks.log) || exit 1
    csv="$out/clocks-${ablation//,/.}.csv"  # no "+": see the ablate mode
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
      --format=csv -lms 50 >"$csv" 2>&1 &
    smi=$!
    echo "== tree: ${ablation/none/this}" | tee -a "$out/clocks.log"
    (cd "$tree" && PYTHONPATH="$tree" python3 benchmarks/bench_moe.py --formats fp8 --no-peer \
      --models "${CLOCK_MODEL:-V4-Flash}" --tokens "${CLOCK_TOKENS:-8192}") 2>&1 | tee -a "$out/clocks.log" | tail -3
    kill $smi
    # The busiest samples: the median SM clock and power of the samples above half the peak power.
    python3 - "$csv" <<'PY' | tee -a "$out/clocks.log"
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r and r[0][:1].isdigit()]
val = lambda r, i: float(r[i].split()[0])
busy = [r for r in rows if val(r, 3) > 0.5 * max(val(x, 3) for x in rows)]
print(f"clocks: {len(rows)} samples, {len(busy)} busy; SM MHz median {statistics.median(val(r, 1) for r in busy):.0f} "
      f"(min {min(val(r, 1) for r in busy):.0f}); power W median {statistics.median(val(r, 3) for r in busy):.0f} "
      f"(max {max(val(r, 3) for r in busy):.0f}); reasons {sorted({r[5].strip() for r in busy})}")
PY
  done
fi
if has race; then
  # Racecheck A/B of the FP8 kernels' scale-copy synchronisation (benchmarks/ablate.py sync-scales / fill-scales).
  for variant in ${RACE_VARIANTS:-none sync-scales fill-scales}; do
    tree=$(patched_tree "$variant" "build-race-$variant.log") || continue
    (cd "$tree" && PYTHONPATH="$tree" compute-sanitizer --tool racecheck --kernel-name kns=megamoe --error-exitcode 9 ${RACE_ARGS:-} \
      python3 -m pytest tests/test_gpu_fp8.py -q -p no:cacheprovider -k "${RACE_K:-pair_walk and E16}") \
      >"$out/race-$variant.log" 2>&1
    echo "== race $variant: exit $?; $(grep -c 'Race reported' "$out/race-$variant.log") reports; $(grep 'RACECHECK SUMMARY\|passed\|failed' "$out/race-$variant.log" | tr '\n' ' ')"
  done
fi
if has poison; then
  tree=$(patched_tree none build-poison.log MEGAMOE_NVCC_DEFINES=MEGAMOE_POISON_STALE_COLUMNS) || exit 1
  sel=(); [ -n "${POISON_K:-}" ] && sel=(-k "$POISON_K")
  (cd "$tree" && python3 -m pytest tests/test_gpu_fp4.py -q -p no:cacheprovider --maxfail=5 "${sel[@]}") 2>&1 \
    | tee "$out/poison.log" | tail -5
fi
if has sanitize; then
  # Last (slowest): reduced GPU suite under compute-sanitizer (memcheck, racecheck on shared memory). The FP8
  # selection includes tiles of more k blocks than pipeline stages (pair_walk E16: 5 and 7), where the ring wraps
  # within a tile: the small shapes (2-3 k blocks) never reuse a stage slot in one tile.
  # racecheck instruments megamoe's kernels only: on torch's own reduce_kernel (the tests' amax) it reports
  # hazards (2026-11-23, H100: 4 reports, all in at::native::reduce_kernel<MaxNanFunctor>, none in ours).
  # SANITIZE_FP8_K=none skips the FP8 tests; SANITIZE_KERNELS (a kernel-name substring, e.g. fp4_gemv) limits both
  # tools to those kernels (faster; racecheck otherwise instruments every megamoe kernel).
  for tool in memcheck racecheck; do
    filter=(); [ $tool = racecheck ] && filter=(--kernel-name kns=megamoe)
    [ -n "${SANITIZE_KERNELS:-}" ] && filter=(--kernel-name "kns=$SANITIZE_KERNELS")
    if [ "${SANITIZE_FP8_K:-}" != none ]; then
      compute-sanitizer --tool $tool "${filter[@]}" --error-exitcode 9 python3 -m pytest tests/test_gpu_fp8.py -q -p no:cacheprovider \
        -k "${SANITIZE_FP8_K:-small_shapes and (shape0 or shape2) or masked or one_expert or recv_stats or int64 or bad_expert or pair_walk and E16 or fused_launch_graph_replay}" 2>&1 | tee "$out/sanitize-$tool.log" | tail -4
      echo "compute-sanitizer $tool exit (FP8): ${PIPESTATUS[0]}"
    fi
    # FP4 (every weight / activation format pair): small shapes at 7 and 113 tokens, masks, one expert, bad ids, and
    # the scale tiles' bulk copies against the scale warp's (block_m 16, 16 with split K, 128; both GEMMs tiled).
    compute-sanitizer --tool $tool "${filter[@]}" --error-exitcode 9 python3 -m pytest tests/test_gpu_fp4.py -q -p no:cacheprovider \
      -k "${SANITIZE_FP4_K:-small_shapes and (shape0 or shape2) and (7 or 113) or masked or one_expert or bad_expert or scale_tma and 1024 and not 64}" 2>&1 | tee "$out/sanitize-fp4-$tool.log" | tail -4
    echo "compute-sanitizer $tool exit (FP4): ${PIPESTATUS[0]}"
  done
fi
