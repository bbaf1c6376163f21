#!/usr/bin/env python3
"""The SASS lines where a kernel's warps stall most, from `ncu --section SourceCounters --page
source --print-source sass --csv` output: share of all stall samples, the instruction, and
excess shared-memory wavefronts (bank conflicts) where there are any.
Usage: ncu_top_sass.py FILE.csv [lines]"""
import csv, sys
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
if not rows: sys.exit("no rows")
start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
head = rows[start]; rows = rows[start + 1:]
excess = next((i for i, h in enumerate(head) if h == "L1 Wavefronts Shared Excessive"), None)
key = next((i for i, h in enumerate(head) if "Warp Stall Sampling (All" in h), None)
src = next((i for i, h in enumerate(head) if h in ("Source", "# Source")), 1)
if key is None: sys.exit("no stall column: " + str(head))
def val(r):
    try: return float(r[key].replace(",", ""))
    except: return 0.0
tot = sum(val(r) for r in rows)
print("total samples", tot)
for r in sorted(rows, key=val, reverse=True)[:int(sys.argv[2]) if len(sys.argv) > 2 else 30]:
    extra = f" excess-smem {r[excess]}" if excess is not None and r[excess] not in ("0", "") else ""
    print(f"{val(r)/tot*100:5.1f}%  {r[src].strip()[:90]}{extra}")
