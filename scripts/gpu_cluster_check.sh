#!/usr/bin/env bash
# The cluster kernels (kernels/mhla/cluster_block_linear.h) on the H200 in one device call: the
# kernel smoke test plain and under compute-sanitizer (memcheck, racecheck), the GPU tests of the
# bidirectional families and the op harness, then the vision shapes timed for each kernel family
# side by side (MHLA_BIDIRECTIONAL_KERNEL=states / cluster / the default order), and, unless
# SKIP_PEER=1, the peers of ../shared/bench/peers_attention.py in the same call and the DiT probes
# at 1,024 tokens. Run after `source scripts/gpu_env.sh` with binaries from
# `scripts/stage_gpu.sh --binaries`; results in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
smoke=$(dirname "$bin")/block_linear_smoke
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader > "$OUT/gpu.txt"

if [ "${SKIP_CHECKS:-0}" != 1 ]; then
  step smoke
  timeout 120 "$smoke" > "$OUT/smoke.txt" 2>&1; echo "smoke rc=$?"
  grep -E "^B=|cluster" "$OUT/smoke.txt" | head -60
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool "$smoke" > "$OUT/$tool.txt" 2>&1
    echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.txt" | tail -1)"
  done
  step tests
  timeout 300 "$tests" "bidirectional kernel families*,ops: every op and GPU backend*,ops: GPU backends read strided*" \
    > "$OUT/tests.txt" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests.txt"; grep -B5 -A25 FAILED "$OUT/tests.txt" | head -80
fi

"$smoke" --occupancy
step bench
shapes=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
for round in 1 2; do
  for family in ${FAMILIES:-states cluster default}; do
    for op in mhla linear; do
      env_family=$family; [ $family = default ] && env_family=
      MHLA_BIDIRECTIONAL_KERNEL=$env_family timeout 120 "$bin" bench attention --op $op \
        --backend cuda "${shapes[@]}" --blocks 16 --warmup 5 --iters 20 | grep '^{' |
        sed "s/^{/{\"family\": \"$family\", \"round\": $round, /" >> "$OUT/families.jsonl"
    done
  done
done
python3 - "$OUT/families.jsonl" <<'PY'
import json, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows[(r["op"], r["N"], r["family"])].append(r)
for (op, n, family), rs in sorted(rows.items()):
    fwd = [round(x["fwd_ms"], 4) for x in rs]
    fb = [round(x["fwd_bwd_ms"], 4) for x in rs]
    share = [round(x["fwd_bwd_bandwidth_share"], 3) for x in rs]
    print(f"{op:7s} N={n:6d} {family:8s} fwd {fwd} fwd+bwd {fb} share {share}")
PY

if [ -n "${NCU_SHAPE:-}" ]; then
  step ncu
  MHLA_BIDIRECTIONAL_KERNEL=cluster timeout 200 ncu --clock-control none --kernel-name regex:cluster_ --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis "$bin" bench attention --op mhla --backend cuda \
    --shape "$NCU_SHAPE" --blocks 16 --warmup 1 --iters 1 > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "cluster_(forward|backward)_kernel|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Block Limit|Cluster|Waves" "$OUT/ncu.txt" | head -80
fi

if [ "${SKIP_PEER:-0}" != 1 ]; then
  step vision_table
  OUT=$OUT/vision timeout 200 scripts/gpu_attention_bench.sh vision > "$OUT/vision.log" 2>&1
  echo "vision rc=$?"; cat "$OUT/vision/attention_vision.md" 2>/dev/null | head -12
  step dit_probes
  for attn in softmax mhla linear; do
    OUT="$OUT/probes" MHLA_BIN="$bin" STEPS=40 timeout 120 scripts/gpu_throughput_probe.sh \
      "dit64_$attn configs/dit_s2_fmnist64.yaml --set attention.type=$attn" |
      tee -a "$OUT/probes.jsonl"
  done
fi
step done
