#!/usr/bin/env python3
"""Markdown table of the causal (language-model) attention timings: our `mhla bench attention
--causal` lines beside the peers' (peers_attention.py lm: SDPA and fla) from the same GPU run,
with the ratios issues 4 and 5 ask for.
Usage: lm_attention_table.py OURS.jsonl PEERS.jsonl"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rows import load  # noqa: E402


ours, peers = load(sys.argv[1]), load(sys.argv[2])
mine = {(r["op"], r["backend"], r["N"]): r for r in ours if "fwd_bwd_ms" in r}
theirs = {(r["op"], r["N"]): r for r in peers if r.get("kind") == "lm" and "fwdbwd_ms" in r}
errors = [r for r in peers if r.get("kind") == "lm" and "error" in r]


def ms(r, key):
    return r[key] if r else None


def cell(r, key):
    v = ms(r, key)
    return f"{v:.3f}" if v is not None else "—"


def ratio(a, b):
    return f"{a / b:.2f}×" if a and b else "—"


columns = [
    ("SDPA flash (peer)", "peer", "sdpa_flash_causal"),
    ("SDPA cuDNN (peer)", "peer", "sdpa_cudnn_causal"),
    ("softmax (ours, SDPA)", "ours", ("softmax", "reference")),
    ("fla linear", "peer", "fla_chunk_linear_attn"),
    ("linear reference", "ours", ("linear", "reference")),
    ("linear cuda", "ours", ("linear", "cuda")),
    ("linear cuda_dense", "ours", ("linear", "cuda_dense")),
    ("MHLA reference", "ours", ("mhla", "reference")),
    ("MHLA cuda", "ours", ("mhla", "cuda")),
    ("MHLA cuda_dense", "ours", ("mhla", "cuda_dense")),
    ("fla gated DeltaNet", "peer", "fla_chunk_gated_delta_rule"),
    ("gated DeltaNet reference", "ours", ("gated_deltanet", "reference")),
    ("gated DeltaNet cuda", "ours", ("gated_deltanet", "cuda")),
    ("fla KDA", "peer", "fla_chunk_kda"),
    ("KDA reference", "ours", ("kda", "reference")),
    ("KDA cuda", "ours", ("kda", "cuda")),
]
print("Causal attention, forward+backward ms, bf16, H = 8, D = 128, B·T = 32,768 (MHLA: 64-token "
      "blocks). Peers and ours from the same GPU run.\n")
print("| T (B) | " + " | ".join(c[0] for c in columns) +
      " | fla GDN / ours | fla KDA / ours | ours MHLA / ours linear | fla linear / ours MHLA |"
      " (ratios: our best backend) |")
print("|" + "---|" * (len(columns) + 6))
for n in sorted({r["N"] for r in ours}):
    def get(kind, key):
        return theirs.get((key, n)) if kind == "peer" else mine.get((key[0], key[1], n))
    row = []
    for _, kind, key in columns:
        r = get(kind, key)
        row.append(cell(r, "fwdbwd_ms" if kind == "peer" else "fwd_bwd_ms"))
    b = next((r["B"] for r in ours if r["N"] == n), "?")
    best = lambda op: min((mine[(op, be, n)]["fwd_bwd_ms"] for be in ("reference", "cuda", "cuda_dense")
                           if (op, be, n) in mine), default=None)
    gdn = {"fwd_bwd_ms": best("gated_deltanet")}
    kda = {"fwd_bwd_ms": best("kda")}
    print(f"| {n} ({b}) | " + " | ".join(row) +
          f" | {ratio(ms(theirs.get(('fla_chunk_gated_delta_rule', n)), 'fwdbwd_ms'), ms(gdn, 'fwd_bwd_ms'))}"
          f" | {ratio(ms(theirs.get(('fla_chunk_kda', n)), 'fwdbwd_ms'), ms(kda, 'fwd_bwd_ms'))}"
          f" | {ratio(best('mhla'), best('linear'))}"
          f" | {ratio(ms(theirs.get(('fla_chunk_linear_attn', n)), 'fwdbwd_ms'), best('mhla'))} | |")
if errors:
    print("\nPeer errors: " + "; ".join(f"{r.get('op', '')} {r.get('N', '')}: {r['error'][:160]}"
                                       for r in errors))
