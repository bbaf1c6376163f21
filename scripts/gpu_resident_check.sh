#!/usr/bin/env bash
# Issue 3 after the resident kernels: GPU tests, the vision bench beside the peers, DeiT probes
# (reference vs cuda) and the full DeiT-T/2 recipe on the cuda backend.
source scripts/gpu_env.sh
V=$OUT/v; mkdir -p $V
timeout 150 $MHLA_TESTS_BIN "[gpu]" > $V/gpu_tests.txt 2>&1; echo "gpu tests rc=$?"; tail -3 $V/gpu_tests.txt
OUT=$V timeout 150 scripts/gpu_attention_bench.sh vision > $V/bench.txt 2>&1; echo "bench rc=$?"
head -9 $V/attention_vision.md | tail -5
D=configs/deit_t2_fmnist.yaml
OUT=$V STEPS=60 timeout 100 scripts/gpu_throughput_probe.sh "deit_mhla_reference $D --set attention.backend=reference" "deit_mhla_cuda $D --set attention.backend=cuda" | tee $V/probes.jsonl
start=$(date +%s)
timeout 260 $MHLA_BIN train $D --set attention.backend=cuda --set run.name=deit_mhla_cuda_resident > $V/deit_full.log 2>&1; echo "deit rc=$? $(( $(date +%s) - start )) s"
tail -4 $V/deit_full.log
cp runs/deit_mhla_cuda_resident/metrics.jsonl $V/deit_metrics.jsonl 2>/dev/null
cp runs/deit_mhla_cuda_resident/config.yaml $V/deit_config.yaml 2>/dev/null
tar czf $OUT/deit.tgz -C $OUT v
