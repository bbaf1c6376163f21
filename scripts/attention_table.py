#!/usr/bin/env python3
"""Markdown table of attention timings: our `mhla bench attention` lines beside the peers'
(peers_attention.py) from the same GPU run, with the ratios the issues ask for; with a third file
(peer_gpu_time.py's lines from the same run) also how much of each peer's time was GPU work.
Usage: attention_table.py OURS.jsonl PEERS.jsonl [PEERS_GPU_TIME.jsonl]"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rows import load  # noqa: E402


ours, peers = load(sys.argv[1]), load(sys.argv[2])
mine = {(r["op"], r["backend"], r["N"]): r for r in ours}
theirs = {(r["op"], r["N"]): r for r in peers if "error" not in r and r.get("kind") == "vision"}
copy_gbs = next((r["copy_bandwidth_gbs"] for r in ours), float("nan"))

print("Forward+backward ms (forward ms), bf16, H = 6, D = 64, B·N = 65,536, MHLA M = 16.\n")
print("| N (B) | MHLA cuda | linear cuda | MHLA reference | plain-PyTorch MHLA | plain-PyTorch linear "
      "| SDPA cuDNN | SDPA FA2 | PyTorch MHLA / ours | cuDNN / ours MHLA | ours MHLA / ours linear "
      "| MHLA bandwidth share | linear bandwidth share |")
print("|" + "---|" * 13)
for n in sorted({r["N"] for r in ours}):
    def cell(r, fb="fwd_bwd_ms", f="fwd_ms"):
        return f"{r[fb]:.3f} ({r[f]:.3f})" if r else "—"
    m, l, ref = mine.get(("mhla", "cuda", n)), mine.get(("linear", "cuda", n)), mine.get(("mhla", "reference", n))
    pm, pl = theirs.get(("mhla_torch_M16", n)), theirs.get(("linear_torch", n))
    cu, fa = theirs.get(("sdpa_cudnn", n)), theirs.get(("sdpa_flash", n))
    b = m["B"] if m else "?"
    ratio = lambda a, c: f"{a / c:.2f}×" if a and c else "—"
    print(f"| {n} ({b}) | {cell(m)} | {cell(l)} | {cell(ref)} | {cell(pm, 'fwdbwd_ms')} | {cell(pl, 'fwdbwd_ms')} "
          f"| {cell(cu, 'fwdbwd_ms')} | {cell(fa, 'fwdbwd_ms')} "
          f"| {ratio(pm and pm['fwdbwd_ms'], m and m['fwd_bwd_ms'])} "
          f"| {ratio(cu and cu['fwdbwd_ms'], m and m['fwd_bwd_ms'])} "
          f"| {ratio(m and m['fwd_bwd_ms'], l and l['fwd_bwd_ms'])} "
          f"| {m['fwd_bwd_bandwidth_share']:.0%} | {l['fwd_bwd_bandwidth_share']:.0%} |" if m and l else "| — | — |")
print(f"\nCopy bandwidth measured in the same process: {copy_gbs:.0f} GB/s. Bandwidth share = 12 tensors "
      "of B·N·H·D bf16 (forward q, k, v, o; backward q, k, v, o, dO, dq, dk, dv) over the fwd+bwd time.")

dense_rows = [n for n in sorted({r["N"] for r in ours}) if ("mhla", "cuda_dense", n) in mine]
if dense_rows:
    print("\nThe dense masked form (`cuda_dense`: O(N² D), no block states), same run:\n")
    print("| N | MHLA cuda_dense | linear cuda_dense | MHLA cuda / cuda_dense | PyTorch MHLA / cuda_dense "
          "| cuDNN / MHLA cuda_dense |")
    print("|---|---|---|---|---|---|")
    for n in dense_rows:
        d, dl, m = mine[("mhla", "cuda_dense", n)], mine.get(("linear", "cuda_dense", n)), mine.get(("mhla", "cuda", n))
        pm, cu = theirs.get(("mhla_torch_M16", n)), theirs.get(("sdpa_cudnn", n))
        r = lambda a, c: f"{a / c:.2f}×" if a and c else "—"
        print(f"| {n} | {d['fwd_bwd_ms']:.3f} ({d['fwd_ms']:.3f}) | {dl['fwd_bwd_ms']:.3f} |" if dl else f"| {n} | {d['fwd_bwd_ms']:.3f} | — |",
              f"{r(m and m['fwd_bwd_ms'], d['fwd_bwd_ms'])} | {r(pm and pm['fwdbwd_ms'], d['fwd_bwd_ms'])} "
              f"| {r(cu and cu['fwdbwd_ms'], d['fwd_bwd_ms'])} |")

if len(sys.argv) > 3:
    gpu = {(r["op"], r["N"]): r for r in load(sys.argv[3])
           if "error" not in r and r.get("kind") == "vision_gpu_time"}
    names = {"mhla_torch_M16": "plain-PyTorch MHLA", "linear_torch": "plain-PyTorch linear",
             "sdpa_cudnn": "SDPA cuDNN", "sdpa_flash": "SDPA FA2"}
    print("\nThe peers' GPU work (scripts/peer_gpu_time.py, same run): each peer's forward+backward "
          "timed as peers_attention.py times it, several runs in a row, and the sum of its GPU "
          "kernels per iteration under torch.profiler. A share well below 1 means the GPU waited "
          "for the host's launches, so that peer's time depends on the host CPU; the last column "
          "sets our MHLA against its GPU work alone.\n")
    print("| N | peer | event-timed ms (runs) | GPU kernels ms | kernels / fastest run "
          "| its GPU work / ours MHLA |")
    print("|---|---|---|---|---|---|")
    for (op, n), r in sorted(gpu.items(), key=lambda x: (x[0][1], x[0][0])):
        m = mine.get(("mhla", "cuda", n))
        against = f"{r['gpu_kernels_ms'] / m['fwd_bwd_ms']:.2f}×" if m else "—"
        runs = " ".join(f"{t:.3f}" for t in r["event_ms"])
        print(f"| {n} | {names.get(op, op)} | {runs} | {r['gpu_kernels_ms']:.3f} "
              f"| {r['kernels_share']:.2f} | {against} |")
