#!/usr/bin/env bash
# The causal kernels at the LM shapes beside fla's chunk_linear_attn (one call, defaults only),
# then the GPT table's KDA row (configs/gpt_austen_kjv.yaml, 240 s bound). Carry .gpu_stage
# (gzipped binaries, triton_cache.tgz), .whl and data/text; run after `source scripts/gpu_env.sh`.
# Results in $OUT/final.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/final; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
for op in linear mhla; do
  timeout 90 "$bin" bench attention --op $op --causal --backend cuda --shape 16,8,2048,128 \
    --shape 4,8,8192,128 --shape 1,8,32768,128 --blocks 16 --warmup 3 --iters 10 | grep '^{' |
    tee -a "$V/ours_lm.jsonl"
done
source scripts/gpu_fla_env.sh
OUT=$V timeout 150 python3 scripts/fla_linear_peer.py 2>&1 | grep '^{' | tee "$V/peers_lm.jsonl"
python3 scripts/lm_attention_table.py "$V/ours_lm.jsonl" "$V/peers_lm.jsonl" > "$V/attention_lm.md"
timeout 240 "$bin" train configs/gpt_austen_kjv.yaml --set attention.type=kda --set run.name=gpt_kda \
  > "$V/gpt_kda.log" 2>&1
echo "gpt kda rc=$?: $(grep -E 'done:' "$V/gpt_kda.log")"
tail -4 "$V/gpt_kda.log"
cp runs/gpt_kda/metrics.jsonl "$V/gpt_kda_metrics.jsonl" 2>/dev/null
tar czf "$OUT/final.tgz" -C "$OUT" final
