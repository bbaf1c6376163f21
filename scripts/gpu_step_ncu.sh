#!/usr/bin/env bash
# Nsight Compute times of chosen kernels in the first training step(s) of a config: every launch
# whose demangled name matches REGEX (up to LAUNCHES of them) is timed alone, without clock
# locking (as the bench), and summarized per kernel (name with template arguments): launches,
# median, min and max in microseconds.
# Usage: scripts/gpu_step_ncu.sh LABEL REGEX LAUNCHES CONFIG [--set KEY=VALUE]...
# Writes $OUT/ncu_LABEL.txt (the raw report) and prints the summary. Environment variables reach
# the training run (A/B switches); SECTIONS adds Nsight sections to the raw report. Run after
# `source scripts/gpu_env.sh`.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bin=${MHLA_BIN:-build-gpu/mhla}
label=$1 regex=$2 launches=$3 config=$4; shift 4
raw="$OUT/ncu_$label.txt"
batch=$(awk '/^  batch_size:/ {print $2; exit}' "$config")
read -r -a sections <<< "${SECTIONS:-}"  # e.g. "SpeedOfLight Occupancy WarpStateStats"
timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum "${sections[@]/#/--section=}" \
  --kernel-name-base demangled \
  -k "regex:$regex" --launch-count "$launches" \
  "$bin" train "$config" "$@" --set train.epochs=1 --set data.train_limit=$(( 4 * batch )) \
  --set data.test_limit=256 --set run.name=ncu_$label --set diffusion.fid_samples=0 \
  --set diffusion.grid_samples=0 > "$raw" 2>&1
echo "ncu $label rc=$?"
python3 - "$raw" <<'PY'
import collections, re, sys
times = collections.defaultdict(list)
name = None
for line in open(sys.argv[1], errors="replace"):
    head = re.match(r"\s*(?:void )?(.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Context", line)
    if head:
        name = head.group(1).replace("(anonymous namespace)", "{anon}").split("(")[0]
        name = name.replace("{anon}::", "").replace("unnamed>::", "").replace("mhla_kernels::", "")
        continue
    m = re.search(r"gpu__time_duration.sum\s+(\S+)\s+([\d.,]+)", line)
    if m and name:
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[m.group(1)]
        times[name].append(float(m.group(2).replace(",", "")) * scale)
        name = None
for k, v in sorted(times.items()):
    v = sorted(v)
    print(f"  {k}: {len(v)} launches, median {v[len(v) // 2]:.2f} us, min {v[0]:.2f}, max {v[-1]:.2f}")
PY
