#!/usr/bin/env bash
# Per-kernel GPU time of one `mhla bench attention` case, read by Nsight Compute (durations only,
# clocks left alone as METHOD.md asks): which pass of a forward+backward costs what.
#   scripts/gpu_kernel_breakdown.sh LABEL BENCH-ARGS...
# e.g. scripts/gpu_kernel_breakdown.sh mhla_2048 --op mhla --causal --backend cuda --shape 16,8,2048,128 --blocks 16
# The CSV keeps every launch; the printed sums assume the bench order (forward calls, then
# forward+backward calls). Writes $OUT/breakdown/LABEL.csv (ncu's raw rows) and prints the per-kernel sums of the last
# forward+backward call (warm-up 1, iters 1: the bench's last launches).
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/breakdown; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
label=$1; shift
timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  "$bin" bench attention "$@" --warmup 1 --iters 1 > "$V/$label.csv" 2> "$V/$label.err"
echo "ncu $label rc=$?"
python3 - "$V/$label.csv" <<'PY'
import csv, sys
# ncu mixes its own messages and the bench's JSON into stdout: the CSV rows start with a quote.
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
if len(rows) < 2:
    sys.exit("no kernel rows")
head, rows = rows[0], rows[1:]
name_i, val_i, unit_i = (head.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit"))
scale = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}
# The last forward+backward call: from the states kernel that precedes the last query pass.
names = [r[name_i] for r in rows]
last = max((i for i, n in enumerate(names) if "query_backward" in n), default=len(rows) - 1)
first = max((i for i in range(last) if "states_kernel" in names[i]), default=0)
sums = {}
for r in rows[first:]:
    n = r[name_i].split("(")[0][-64:]
    sums[n] = sums.get(n, 0.0) + float(r[val_i].replace(",", "")) * scale.get(r[unit_i], 1.0)
total = sum(sums.values())
for n, v in sums.items():
    print(f"{v / 1e3:9.1f} us  {100 * v / total:5.1f}%  {n}")
print(f"{total / 1e3:9.1f} us  total over {len(rows) - first} launches")
PY
