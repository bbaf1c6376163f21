"""Why the plain-PyTorch MHLA peer's time moves between device calls (issue 3's 10x target).

For each vision shape it times the peer's forward+backward exactly as
../shared/bench/peers_attention.py does (imported from .gpu_stage/bench, 3 warm-up and 10 timed
iterations between two CUDA events), five times in a row, and then once under torch.profiler,
summing the durations of the GPU kernels of those 10 iterations. If the kernels' sum is well below
the event-timed span, the GPU waited for the host's launches, so the peer's time is set by the
host CPU rather than by the GPU. Prints one JSON line per shape.
Usage (device machine, repository root): python3 experiments/attention_vision/session45/peer_launch_bound.py
"""
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.getcwd(), ".gpu_stage", "bench"))
os.environ.setdefault("OUT", "/tmp")
import peers_attention as peers  # noqa: E402

M = 16
for B, H, N, D in peers.shapes_vision():
    q, k, v = [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]
    mix = torch.softmax(torch.randn(M, M, device="cuda"), -1).to(torch.bfloat16)
    run = peers.fwd_bwd(lambda a, b, c: peers.mhla_torch(a, b, c, mix, M), (q, k, v))
    timed = [peers.bench(run) for _ in range(5)]
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    kernel_us = sum(e.device_time_total for e in prof.key_averages()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    # key_averages' device totals count each kernel once per call; per iteration:
    per_iteration_ms = kernel_us / 10 / 1e3
    print(json.dumps({"N": N, "event_ms": [round(t, 3) for t in timed],
                      "gpu_kernels_ms": round(per_iteration_ms, 3),
                      "kernels_share_of_span": round(per_iteration_ms / min(timed), 3)}),
          flush=True)
    del q, k, v
    torch.cuda.empty_cache()
