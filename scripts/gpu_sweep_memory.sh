#!/usr/bin/env bash
# Nsight Compute memory metrics of the causal prefix sweeps (MHLA at T = 8,192, B = 4, H = 8,
# D = 128, M = 16): DRAM bytes and throughput, L2 hit rate, for the packed states off / on and
# the sweeps' load depths 1 and 8. Run after `source scripts/gpu_env.sh`; prints a table.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/sweep_memory; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active
for config in "0 1" "0 8" "1 8"; do
  set -- $config
  MHLA_CAUSAL_PACKED_STATES=$1 MHLA_SWEEP_AHEAD=$2 MHLA_SWEEP_BACKWARD_AHEAD=$2 timeout 120 \
    ncu --metrics $metrics -k "regex:prefix_window|lean_states|lean_query" --csv "$bin" bench attention \
    --op mhla --causal --backend cuda --shape 4,8,8192,128 --blocks 16 --warmup 0 --iters 1 \
    > "$V/s$1_a$2.csv" 2> /dev/null
  echo "== packed states $1, depth $2"
  python3 - "$V/s$1_a$2.csv" <<'PY'
import csv, sys
rows = [l for l in open(sys.argv[1]) if l.startswith('"')]
r = csv.DictReader(rows)
seen = {}
for x in r:
    k = (x["ID"], x["Kernel Name"].split("(")[0].split("<")[0].split("::")[-1])
    seen.setdefault(k, {})[x["Metric Name"]] = x["Metric Value"]
for (i, name), m in seen.items():
    print(i, name, " ".join(f"{k.split('__')[1].split('.')[0][:22]}={v}" for k, v in sorted(m.items())))
PY
done
