#!/usr/bin/env python3
# Writes the asm wrappers of kernels/common/warpgroup_mma_ops.inc:
#   python3 scripts/gen_warpgroup_mma.py > kernels/common/warpgroup_mma_ops.inc
# One per N and 16-bit type: 64 x N x 16 products, A and B from
# shared memory through descriptors, fp32 accumulators.
out = []
for n in (64, 128):
    regs = n // 2
    for tname, ptx in (("__nv_bfloat16", "bf16"), ("__half", "f16")):
        dl = ", ".join(f"%{i}" for i in range(regs))
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
        out.append(f"""template <>
struct WarpgroupMma<{tname}, {n}> {{
  // d (+)= A B for A [64][16] and B [16][{n}], both K-major in shared memory (descriptors).
  static __device__ __forceinline__ void run(float (&d)[{regs}], uint64_t a, uint64_t b,
                                             int accumulate) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} "
        "{{{dl}}}, "
        "%{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}\\n"
        : {outs}
        : "l"(a), "l"(b), "r"(accumulate));
  }}
}};
""")
print("\n".join(out))
