#!/usr/bin/env bash
# One device call that checks and times the kernels written without a GPU (the dense masked
# block-linear kernels, `cuda_dense`, and the rotary kernel), with everything tarred into
# $OUT/validate.tgz (the device tool returns only a few files):
#   1. kernels/tests/block_linear_smoke (dense vs state kernels) plain and under memcheck;
#   2. the GPU test cases (op tests over every backend, rotary kernel vs reference, ...);
#   3. the attention bench at the vision shapes beside the peers (table with cuda_dense rows);
#   4. training-rate probes: DeiT and DiT with MHLA on cuda vs cuda_dense, GPT with every
#      causal type on reference vs cuda_dense, and the GPT peer;
#   5. the gated-delta decode step (issue 4: <= 20 us for B = 64, H = 8, D = 128);
#   6. a profile of 10 GPT and 10 DeiT steps (mhla train --profile).
# Run from the repository root on the GPU machine after `source scripts/gpu_env.sh`
# (binaries staged by `scripts/stage_gpu.sh --binaries`; carry data/fashion-mnist, data/text,
# .gpu_stage).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/v"
V=$OUT/v
bin=${MHLA_BIN:-build-gpu/mhla}
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
smoke=$(dirname "$tests")/block_linear_smoke
[ -x "$smoke" ] || smoke=build-gpu/kernels/block_linear_smoke
step() { echo "== $1 ($(date +%T))"; }
# Stages to run (default all); one device call may not fit them all in its 600 s.
stages=${*:-"smoke tests bench probes gpt decode profile"}
want() { [[ " $stages " == *" $1 "* ]]; }

if want smoke; then
step smoke
timeout 60 "$smoke" > "$V/smoke.txt" 2>&1; echo "smoke rc=$?"; cat "$V/smoke.txt"
command -v compute-sanitizer >/dev/null &&
  timeout 120 compute-sanitizer --tool memcheck "$smoke" > "$V/memcheck.txt" 2>&1 &&
  tail -2 "$V/memcheck.txt"

fi
if want tests; then
step "gpu tests"
timeout 240 "$tests" "[gpu]" > "$V/gpu_tests.txt" 2>&1; echo "gpu tests rc=$?"
tail -4 "$V/gpu_tests.txt"; grep -B2 -A8 "FAILED" "$V/gpu_tests.txt" | head -60

fi
if want bench; then
step bench
OUT=$V MHLA_BIN=$bin timeout 180 scripts/gpu_attention_bench.sh vision > "$V/bench.txt" 2>&1
tail -12 "$V/bench.txt"

fi
D=configs/deit_t2_fmnist.yaml S=configs/dit_s2_fmnist.yaml G=configs/gpt_austen_kjv.yaml
if want probes; then
step probes
OUT=$V MHLA_BIN=$bin STEPS=60 timeout 200 scripts/gpu_throughput_probe.sh \
  "deit_mhla_reference $D --set attention.backend=reference" \
  "deit_mhla_cuda $D --set attention.backend=cuda" \
  "deit_linear_cuda $D --set attention.type=linear --set attention.backend=cuda" \
  "deit_softmax $D --set attention.type=softmax" \
  "dit_softmax $S --set attention.type=softmax" \
  "dit_mhla_cuda $S --set attention.backend=cuda" \
  "dit_linear_cuda $S --set attention.type=linear --set attention.backend=cuda" | tee "$V/probes.jsonl"
fi
if want gpt; then
step gpt
for a in softmax linear mhla; do
  for backend in reference cuda_dense; do
    [ $a = softmax ] && [ $backend = cuda_dense ] && continue
    timeout 60 "$bin" train $G --set attention.type=$a --set attention.backend=$backend \
      --set train.epochs=1 --set run.name=gpt_${a}_$backend > "$V/gpt_${a}_$backend.log" 2>&1
    echo "gpt $a $backend rc=$?: $(grep -oE '[0-9]+ tok/s' "$V/gpt_${a}_$backend.log" | tail -1);" \
      "$(grep -oE 'val loss [0-9.]+' "$V/gpt_${a}_$backend.log" | tail -1)" | tee -a "$V/gpt.txt"
  done
done
timeout 60 python3 -c "import sys; sys.path.insert(0, '.gpu_stage/bench'); import peers_e2e as p; p.gpt(False); p.gpt(True)" 2>&1 |
  grep '^{' | tee "$V/peers_gpt.jsonl"

fi
if want decode; then
step decode
timeout 60 "$bin" bench decode --op gated_deltanet --shape 64,8,128 | tee "$V/decode.jsonl"
timeout 60 "$bin" bench decode --op kda --shape 64,8,128 | tee -a "$V/decode.jsonl"

fi
if want profile; then
step profile
timeout 60 "$bin" train $G --set train.epochs=1 --set run.name=profile_gpt --profile 10 > "$V/profile_gpt.log" 2>&1
cp runs/profile_gpt/profile/summary.md "$V/profile_gpt.md" 2>/dev/null
timeout 60 "$bin" train $D --set train.epochs=1 --set data.train_limit=10240 --set run.name=profile_deit \
  --profile 10 > "$V/profile_deit.log" 2>&1
cp runs/profile_deit/profile/summary.md "$V/profile_deit.md" 2>/dev/null
head -30 "$V/profile_gpt.md" 2>/dev/null
fi

tar czf "$OUT/validate.tgz" -C "$OUT" v
