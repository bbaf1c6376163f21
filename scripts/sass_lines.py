#!/usr/bin/env python3
"""Stall samples by CUDA source line: joins an Nsight Compute SASS source-counter CSV (from
scripts/gpu_sass_profile.sh) with the line table nvdisasm prints for the same kernel compiled
here with the same flags (-lineinfo). Addresses are taken relative to the kernel's first
instruction.
Usage: sass_lines.py PROFILE.csv[.gz] CUBIN KERNEL-SUBSTRING [lines] [--outer]
                     [--column=NAME]   (default "Warp Stall Sampling (All Samples)"; e.g.
                                        "Instructions Executed" for where the instructions are)
                     [--reasons]       (beside each line, its three largest stall reasons, as
                                        shares of all the kernel's stall samples)"""
import csv, gzip, re, subprocess, sys, glob, os

prof, cubin, kname = sys.argv[1:4]
top = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4].isdigit() else 25
opener = gzip.open if prof.endswith(".gz") else open
rows = list(csv.reader(l for l in opener(prof, "rt") if l.startswith('"')))
start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
head, rows = rows[start], rows[start + 1:]
column = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--column=")),
              "Warp Stall Sampling (All Samples)")
key = head.index(column)
reasons = [(c[len("stall_"):], i) for i, c in enumerate(head)
           if c.startswith("stall_") and "Not Issued" not in c] if "--reasons" in sys.argv else []
samples = []
for r in rows:
    try:
        samples.append((int(r[0], 16), float(r[key] or 0),
                        {name: float(r[i] or 0) for name, i in reasons}))
    except ValueError:
        pass
base = samples[0][0]
nvdisasm = os.environ.get("NVDISASM") or glob.glob(
    "/work/main/.venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/nvdisasm")[0]
text = subprocess.run([nvdisasm, "-gi", "-c", cubin], capture_output=True, text=True).stdout
# Find the kernel's section, then map offsets to the line comments before them: the innermost
# line, and with --outer the outermost (the kernel's own line: its phase).
outer = "--outer" in sys.argv
line_of, inside, cur, chain = {}, False, None, []
for l in text.splitlines():
    if l.startswith("\t.text.") or ".section\t.text." in l:
        inside = kname in l
        continue
    if not inside:
        continue
    m = re.search(r'//## File "([^"]+)", line (\d+)', l)
    if m:
        chain.append(f"{os.path.basename(m.group(1))}:{m.group(2)}")
        continue
    if chain:
        cur = chain[-1] if outer else (chain[0] + (" @ " + chain[-1] if len(chain) > 1 else ""))
        chain = []
    m = re.search(r"/\*([0-9a-f]{4,})\*/", l)
    if m and cur:
        line_of[int(m.group(1), 16)] = cur
by_line, why, total, stalls = {}, {}, 0.0, 0.0
for addr, s, parts in samples:
    where = line_of.get(addr - base, "?")
    by_line[where] = by_line.get(where, 0.0) + s
    total += s
    for name, v in parts.items():
        why.setdefault(where, {})[name] = why.get(where, {}).get(name, 0.0) + v
        stalls += v
print(f"total {column}: {total:.0f}, {len(line_of)} mapped offsets")
for where, s in sorted(by_line.items(), key=lambda x: -x[1])[:top]:
    detail = ""
    if reasons:
        largest = sorted(why.get(where, {}).items(), key=lambda x: -x[1])[:3]
        detail = "  (" + ", ".join(f"{n} {100 * v / stalls:.1f}" for n, v in largest if v) + ")"
    print(f"  {100 * s / total:5.1f}%  {where}{detail}")
