#!/usr/bin/env bash
# One device call on the bidirectional kernels' mixing-matrix gradient (dm) error: the family
# test's per-case errors (MHLA_FAMILY_ERRORS=1) under each setting, so the same random draws are
# compared across settings; then the hidden diagnostic test (dm over many draws of one shape
# against a float64 reference, the float32 reference's own error beside it) under each setting.
#   SETTINGS="MHLA_PIPELINED_CHUNKS=0 -" DRAWS=32 SHAPE=16,8,1200,32,2 scripts/gpu_dm_error_check.sh
# Run after `source scripts/gpu_env.sh`; writes $OUT/dm_error/*.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}; V=$OUT/dm_error; mkdir -p "$V"
tests=${MHLA_TESTS_BIN:-build-gpu/tests/mhla_tests}
read -r -a settings <<< "${SETTINGS:-MHLA_PIPELINED_CHUNKS=0 -}"
for setting in "${settings[@]}"; do
  name=${setting//[^A-Za-z0-9_]/_}; [ "$setting" = "-" ] && name=default && setting=""
  env $setting MHLA_FAMILY_ERRORS=1 timeout 300 "$tests" \
    "bidirectional kernel families: each matches*" > "$V/families_$name.txt" 2>&1
  echo "families $name rc=$? $(grep -c family-errors "$V/families_$name.txt") cases"
  env $setting MHLA_DM_SHAPE="${SHAPE:-16,8,1200,32,2}" MHLA_DM_DRAWS="${DRAWS:-32}" timeout 300 \
    "$tests" "bidirectional kernel families: dm error over many draws" > "$V/draws_$name.txt" 2>&1
  echo "draws $name rc=$? $(grep -c dm-draw "$V/draws_$name.txt") draws"
done
