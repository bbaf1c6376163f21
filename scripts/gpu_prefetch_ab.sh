#!/usr/bin/env bash
# One device call for the L2 prefetch of the token passes (kernels/common/l2_prefetch.cuh: each
# CTA asks L2 for the first loads of the CTA one wave later), in one binary, switched by
# MHLA_L2_PREFETCH (0 off, N waves ahead):
#   1. the causal, bidirectional-family and op-harness [gpu] tests with prefetching on; memcheck
#      of the small-shape causal test and of a resident-kernel bench case;
#   2. forward+backward of causal linear attention and MHLA at the LM shapes, and of
#      bidirectional MHLA and linear attention at the vision shapes, with MHLA_L2_PREFETCH = 0, 1
#      and 2, two rounds;
#   3. the peers in the same call: fla's chunk_linear_attn (LM shapes) and the vision peers
#      (plain-PyTorch MHLA, SDPA) unless SKIP_PEER=1.
# Run from the repository root after `source scripts/gpu_env.sh` (binaries from
# `scripts/stage_gpu.sh --binaries`; carry .gpu_stage and .whl). SKIP_TESTS=1 shortens a repeat.
# Results in $OUT/prefetch.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/prefetch; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
source scripts/gpu_delta_checks.sh
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
settings=${SETTINGS:-"0 1 2"}

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step tests
  run_gpu_tests "$V" tests_causal.txt 200 "$tests" "*causal block-linear*"
  run_gpu_tests "$V" tests_bidirectional.txt 200 "$tests" "*bidirectional*"
  run_gpu_tests "$V" tests_ops.txt 240 "$tests" "ops: every op and GPU backend*"
  if command -v compute-sanitizer > /dev/null; then
    timeout 150 compute-sanitizer --tool memcheck "$tests" \
      "attention: causal block-linear kernels on small odd shapes" > "$V/memcheck_causal.txt" 2>&1
    echo "memcheck causal: $(grep 'ERROR SUMMARY' "$V/memcheck_causal.txt" | tail -1)"
    # 600 sequences: more CTAs than one wave, so the resident kernels prefetch.
    timeout 150 compute-sanitizer --tool memcheck "$bin" bench attention --op mhla --backend cuda \
      --shape 100,6,256,64 --blocks 16 --warmup 0 --iters 1 > "$V/memcheck_resident.txt" 2>&1
    echo "memcheck resident: $(grep 'ERROR SUMMARY' "$V/memcheck_resident.txt" | tail -1)"
  fi
fi

step bench
vision=(--shape 256,6,256,64 --shape 64,6,1024,64 --shape 16,6,4096,64 --shape 4,6,16384,64)
for round in 1 2; do
  for pf in $settings; do
    MHLA_L2_PREFETCH=$pf bench_lm "$V" "lm_pf${pf}_r$round" "$bin" linear mhla
    for op in mhla linear; do
      f="$V/vision_pf${pf}_r${round}_$op.jsonl"
      MHLA_L2_PREFETCH=$pf timeout 100 "$bin" bench attention --op $op --backend cuda \
        "${vision[@]}" --blocks 16 --warmup 5 --iters 20 2>> "$V/bench.err" | grep '^{' > "$f"
      python3 -c "import json,sys; print(sys.argv[2], ' '.join('%.3f' % json.loads(l)['fwd_bwd_ms'] for l in open(sys.argv[1])))" \
        "$f" "vision pf$pf r$round $op"
    done
  done
done

if [ "${SKIP_PEER:-0}" != 1 ]; then
  step peers
  OUT=$V timeout 150 python3 .gpu_stage/bench/peers_attention.py vision 2> "$V/peers_vision.err" |
    grep '^{' > "$V/peers_vision.jsonl"
  python3 -c "import json,sys; [print('vision peer', d.get('op'), d.get('N'), '%.3f' % d.get('fwdbwd_ms', -1)) for d in map(json.loads, open(sys.argv[1]))]" "$V/peers_vision.jsonl"
  source scripts/gpu_fla_env.sh
  OUT=$V timeout 200 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"
fi

step done
tar czf "$OUT/prefetch.tgz" -C "$OUT" prefetch && rm -rf "$V"
