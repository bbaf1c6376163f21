#!/usr/bin/env python3
"""How much of a peer's measured time is GPU work: for the vision peers of
../shared/bench/peers_attention.py (imported from the directory given, by default
.gpu_stage/bench), forward+backward timed as that script times it (3 warm-up and 10 timed
iterations between two CUDA events) RUNS times in a row, then ten iterations under
torch.profiler with the durations of their GPU kernels summed. A peer whose kernels fill much less
than its event-timed span waited for the host's launches: its time then depends on the host CPU
(session 45: the plain-PyTorch MHLA at N >= 1,024 took 2.3-3.0 ms for 1.2-1.5 ms of kernels).

Usage: peer_gpu_time.py [PEERS_DIR] [--runs R] [--ops a,b,...]   (GPU machine)
Prints one JSON line per (op, N): kind "vision_gpu_time", event_ms (the R runs),
gpu_kernels_ms (per iteration) and kernels_share (gpu_kernels_ms over the fastest run).
"""
import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

parser = argparse.ArgumentParser()
parser.add_argument("peers_dir", nargs="?", default=os.path.join(".gpu_stage", "bench"))
parser.add_argument("--runs", type=int, default=5)
parser.add_argument("--ops", default="mhla_torch_M16,linear_torch,sdpa_cudnn,sdpa_flash")
args = parser.parse_args()
sys.path.insert(0, os.path.abspath(args.peers_dir))
os.environ.setdefault("OUT", "/tmp")
import peers_attention as peers  # noqa: E402

M = 16  # the blocks of the vision MHLA peer


def peer_functions(mix):
    return {
        "mhla_torch_M16": lambda a, b, c: peers.mhla_torch(a, b, c, mix, M),
        "linear_torch": peers.linear_torch,
        "sdpa_cudnn": peers.sdpa(False, torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash": peers.sdpa(False),
    }


def kernel_ms_per_iteration(run, iterations=10):
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            run()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / iterations / 1e3


for B, H, N, D in peers.shapes_vision():
    q, k, v = [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3)]
    mix = torch.softmax(torch.randn(M, M, device="cuda"), -1).to(torch.bfloat16)
    functions = peer_functions(mix)
    for op in args.ops.split(","):
        try:
            run = peers.fwd_bwd(functions[op], (q, k, v))
            timed = [peers.bench(run) for _ in range(args.runs)]
            kernels = kernel_ms_per_iteration(run)
            print(json.dumps({"kind": "vision_gpu_time", "op": op, "B": B, "H": H, "N": N, "D": D,
                              "event_ms": [round(t, 4) for t in timed],
                              "gpu_kernels_ms": round(kernels, 4),
                              "kernels_share": round(kernels / min(timed), 3)}), flush=True)
        except Exception as error:  # a peer that fails here is reported, the others still run
            print(json.dumps({"kind": "vision_gpu_time", "op": op, "N": N,
                              "error": repr(error)[:300]}), flush=True)
    del q, k, v
    torch.cuda.empty_cache()
