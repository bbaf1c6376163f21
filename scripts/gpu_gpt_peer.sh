#!/usr/bin/env bash
# Issue 5's throughput numbers in one device call, on the staged binary:
#   1. 60-step training-rate probes of configs/gpt_austen_kjv.yaml: softmax (default, with
#      train.cuda_graph=true, and at the peer's architecture: learned positions, no biases),
#      linear and MHLA;
#   2. the GPT PyTorch peer (../shared/bench/peers_e2e.py: d512, 8 layers, T = 1,024, batch 32),
#      eager and torch.compile;
#   3. the MHLA row of the GPT table (the whole recipe: validation loss, bits per byte, time).
# Run from the repository root after `source scripts/gpu_env.sh` (carry .gpu_stage and
# data/text). Results in $OUT/gpt_peer.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/gpt_peer; mkdir -p "$V"
bin=${MHLA_BIN:-build-gpu/mhla}
t0=$(date +%s); step() { echo "== $1 (t=$(( $(date +%s) - t0 ))s)"; }
G=configs/gpt_austen_kjv.yaml

step probes
OUT=$V timeout 200 bash scripts/gpu_throughput_probe.sh \
  "softmax $G" \
  "softmax_graph $G --set train.cuda_graph=true" \
  "softmax_peer_arch $G --set model.positions=learned --set model.bias=false" \
  "linear $G --set attention.type=linear" \
  "mhla $G --set attention.type=mhla" | tee "$V/probes.jsonl"

step peer
timeout 240 python3 -c "import sys; sys.path.insert(0, '.gpu_stage/bench'); import peers_e2e as p; p.gpt(False); p.gpt(True)" \
  2>&1 | grep '^{' | tee "$V/peers_gpt.jsonl"

step mhla_row
timeout 150 "$bin" train $G --set attention.type=mhla --set run.name=gpt_mhla > "$V/gpt_mhla.log" 2>&1
echo "gpt mhla rc=$?: $(grep -E 'done:' "$V/gpt_mhla.log")"
tail -4 "$V/gpt_mhla.log"
cp runs/gpt_mhla/metrics.jsonl "$V/gpt_mhla_metrics.jsonl" 2> /dev/null
gzip -f "$V"/*.log
tar czf "$OUT/gpt_peer.tgz" -C "$OUT" gpt_peer && rm -rf "$V"
step done
