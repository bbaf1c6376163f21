#!/usr/bin/env python3
"""fla's chunk_linear_attn alone at the LM shapes, timed by the peer script's own functions
(../shared/bench/peers_attention.py: bench, fwd_only, fwd_bwd, emit; staged in .gpu_stage/bench),
exactly as its `lm` mode times it but without compiling fla's gated kernels first (minutes of
Triton compilation on a fresh machine). One JSON line per shape, kind "lm".
Usage: fla_linear_peer.py   (fla importable: see gpu_attention_bench.sh for the wheels)"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".gpu_stage", "bench"))
import peers_attention as peer  # noqa: E402
import torch  # noqa: E402
from fla.ops.linear_attn import chunk_linear_attn  # noqa: E402

for B, H, N, D in peer.shapes_lm():
    ins = [torch.randn(B, N, H, D, device=peer.dev, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    f = lambda q, k, v: chunk_linear_attn(q, k, v, normalize=False)[0]
    fwd = peer.bench(peer.fwd_only(f, ins))
    fb = peer.bench(peer.fwd_bwd(f, ins))
    peer.emit(kind="lm", op="fla_chunk_linear_attn", B=B, H=H, N=N, D=D, fwd_ms=fwd, fwdbwd_ms=fb,
              tokens_per_s=B * N / (fb / 1e3))
    del ins
    torch.cuda.empty_cache()
