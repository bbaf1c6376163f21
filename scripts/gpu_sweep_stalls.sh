#!/usr/bin/env bash
# Where the causal prefix sweeps spend their time: Nsight Compute's warp-state (stall reasons),
# memory workload, occupancy and speed-of-light sections for prefix_window_backward_kernel (and,
# with KERNELS=prefix_window, the forward sweep too) of MHLA at T = 2,048 (B = 16, H = 8,
# D = 128, M = 16). Session 23's first run compared the backward depths 8 and 16
# (MHLA_SWEEP_BACKWARD_AHEAD, since removed: the depth follows from the window).
# Run after `source scripts/gpu_env.sh`; raw reports in $OUT/sweep_stalls/, a summary printed.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/sweep_stalls; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
kernels=${KERNELS:-prefix_window_backward}
for depth in default; do
  timeout 150 ncu --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section SpeedOfLight \
    -k regex:$kernels --csv --page raw "$bin" bench attention --op mhla \
    --causal --backend cuda --shape 16,8,2048,128 --blocks 16 --warmup 0 --iters 1 \
    > "$V/depth$depth.csv" 2> "$V/depth$depth.err"
  echo "== $kernels ($depth depth)"
  python3 - "$V/depth$depth.csv" <<'PY'
import csv, re, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
names, units, values = rows[0], rows[1], rows[2]
want = re.compile(r"gpu__time_duration.sum|^inst_executed$|dram__throughput.avg.pct|sm__throughput.avg.pct|"
                  r"smsp__average_warp_latency_per_inst_issued|sm__warps_active.avg.pct|"
                  r"smsp__issue_active.avg.pct|sm__issue_active.avg.pct|issue_stalled_.*_per_issue_active")
picked = [(n, v, u) for n, u, v in zip(names, units, values) if want.search(n)]
def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0
for n, v, u in sorted(picked, key=lambda x: -number(x[1]) if "stalled" in x[0] else -1e9):
    print(f"{n[:80]:80} {v:>12} {u}")
PY
done
