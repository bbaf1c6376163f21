#!/usr/bin/env bash
# train.deterministic on the GPU (core/determinism.h): its tests and the graph/DiT tests around
# it, then MHLA and linear attention forward+backward timed with and without --deterministic at
# the vision shapes (B*N = 65,536, H = 6, D = 64, M = 16), ROUNDS rounds (default 2), then
# (unless SKIP_FULL) the whole [gpu] suite. Results: $OUT.
# SKIP_TESTS=1 skips the focused tests.
# Usage: source scripts/gpu_env.sh; OUT=... bash scripts/gpu_determinism_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filter="*train.deterministic*,train: CUDA-graph steps*,dit: CUDA-graph steps*,dit: the model on the GPU*"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 400 "$MHLA_TESTS_BIN" "$filter" > "$OUT/tests_determinism.txt" 2>&1
  echo "determinism tests rc=$? $(tail -2 "$OUT/tests_determinism.txt" | tr '\n' ' ')"
fi
shapes=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
for round in $(seq 1 "${ROUNDS:-2}"); do
  for op in mhla linear; do
    for mode in atomic deterministic; do
      flag=(); [ "$mode" = deterministic ] && flag=(--deterministic)
      timeout 120 "$MHLA_BIN" bench attention --op $op --backend cuda "${shapes[@]}" --blocks 16 \
        --warmup 5 --iters 20 "${flag[@]}" > "$OUT/bench_${op}_${mode}_r$round.jsonl"
    done
  done
done
python3 - "$OUT"/bench_*.jsonl <<'PY'
import json, sys
for path in sys.argv[1:]:
    for line in open(path):
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        mode = "deterministic" if r["deterministic"] else "atomic"
        print(f"{path.split('/')[-1]}: {r['op']} {mode} N={r['N']} fwd+bwd {r['fwd_bwd_ms']:.4f} ms "
              f"fwd {r['fwd_ms']:.4f} ms")
PY
if [ -z "${SKIP_FULL:-}" ]; then
  timeout ${FULL_LIMIT:-400} "$MHLA_TESTS_BIN" "[gpu]" > "$OUT/tests_gpu_full.txt" 2>&1
  echo "[gpu] suite rc=$? $(tail -2 "$OUT/tests_gpu_full.txt" | tr '\n' ' ')"
fi
