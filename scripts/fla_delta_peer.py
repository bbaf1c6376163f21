#!/usr/bin/env python3
"""fla's chunk_gated_delta_rule (and, with --kda, chunk_kda) alone at the LM shapes, timed by the
peer script's own functions and inputs (../shared/bench/peers_attention.py, staged in
.gpu_stage/bench), as its `lm` mode times them, without first compiling fla's other kernels.
One JSON line per shape and op, kind "lm".
Usage: fla_delta_peer.py [--kda | --kda-only]   (fla importable: source scripts/gpu_fla_env.sh)"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".gpu_stage", "bench"))
import peers_attention as peer  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
import fla.ops.common.chunk_o as _chunk_o  # noqa: E402

_chunk_o.TRITON_ABOVE_3_7_1 = True  # timing only, as the peer script does (see its docstring)

ops = [] if "--kda-only" in sys.argv else [
    ("fla_chunk_gated_delta_rule", lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b)[0], False)]
if "--kda" in sys.argv or "--kda-only" in sys.argv:
    from fla.ops.kda import chunk_kda  # noqa: E402
    ops.append(("fla_chunk_kda", lambda q, k, v, g, b: chunk_kda(q, k, v, g, b)[0], True))

for B, H, N, D in peer.shapes_lm():
    for name, f, per_key in ops:
        mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device=peer.dev, dtype=dt)
        q = F.normalize(mk(B, N, H, D), p=2, dim=-1).requires_grad_()
        k = F.normalize(mk(B, N, H, D), p=2, dim=-1).requires_grad_()
        v = mk(B, N, H, D).requires_grad_()
        g = F.logsigmoid(mk(*((B, N, H, D) if per_key else (B, N, H)), dt=torch.float32)).requires_grad_()
        beta = torch.rand(B, N, H, device=peer.dev, dtype=torch.bfloat16).sigmoid().requires_grad_()
        ins = (q, k, v, g, beta)
        fwd = peer.bench(peer.fwd_only(f, ins))
        fb = peer.bench(peer.fwd_bwd(f, ins))
        peer.emit(kind="lm", op=name, B=B, H=H, N=N, D=D, fwd_ms=fwd, fwdbwd_ms=fb,
                  tokens_per_s=B * N / (fb / 1e3))
        del ins, q, k, v, g, beta
        torch.cuda.empty_cache()
