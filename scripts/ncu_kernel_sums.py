#!/usr/bin/env python3
"""Per-kernel sums of an Nsight Compute CSV (gpu__time_duration.sum rows, as written by
`ncu --metrics gpu__time_duration.sum --csv`): total, launches and time per launch by kernel
name, largest first. Usage: ncu_kernel_sums.py FILE.csv[.gz] [top]"""
import csv
import gzip
import re
import sys

opener = gzip.open if sys.argv[1].endswith(".gz") else open
rows = list(csv.reader(l for l in opener(sys.argv[1], "rt") if l.startswith('"')))
head, rows = rows[0], rows[1:]
n, v, u = (head.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit"))
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
sums = {}
for r in rows:
    name = re.sub(r"\(anonymous namespace\)::|<unnamed>::|^void ", "", r[n])
    name = re.sub(r"<.*", "", name).split("(")[0].split("::")[-1][:60]
    t, c = sums.get(name, (0.0, 0))
    sums[name] = (t + float(r[v].replace(",", "")) * scale[r[u]], c + 1)
print(sys.argv[1].split("/")[-1], "total us", round(sum(t for t, _ in sums.values()), 1))
for name, (t, c) in sorted(sums.items(), key=lambda x: -x[1][0])[: int(sys.argv[2]) if len(sys.argv) > 2 else 16]:
    print(f"  {t:9.1f} us  {c:4d}x  {t / c:8.1f} per  {name}")
