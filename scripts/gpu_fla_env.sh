# Source on a GPU machine before running fla (the peer of the linear-attention kernels): installs
# the wheels carried in .whl without dependencies into /tmp/site (on PYTHONPATH), and points
# Triton at /tmp/triton_cache, seeded from a carried .gpu_stage/triton_cache.tgz so that fla's
# kernels need not compile again (or from .gpu_stage/triton_cache.txz, xz-packed). Pack the cache back with `tar czf X -C "$TRITON_CACHE_DIR" .`.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .gpu_stage/triton_cache.tgz ]; then tar xzf .gpu_stage/triton_cache.tgz -C "$TRITON_CACHE_DIR"; fi
# xz packs fla's full cache (gated DeltaNet, KDA, linear attention) in 15 MB instead of 33, which
# leaves room in the 64 MiB carry for the binaries.
if [ -f .gpu_stage/triton_cache.txz ]; then tar xJf .gpu_stage/triton_cache.txz -C "$TRITON_CACHE_DIR"; fi
