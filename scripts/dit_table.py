#!/usr/bin/env python3
"""Markdown table of a DiT study (scripts/gpu_dit_study.sh): per attention type the training
rate, the final test diffusion loss and FID-FMNIST / KID without and with guidance.
Usage: dit_table.py OUT_DIR CONFIG_NAME ATTENTION..."""
import glob
import json
import os
import sys

out, name, types = sys.argv[1], sys.argv[2], sys.argv[3:]


def records(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip().startswith("{")]


def fid(attention, label):
    matches = glob.glob(os.path.join(out, f"{name}_{attention}_fid_cfg{label}.json"))
    rows = records(matches[0]) if matches else []
    return rows[-1] if rows else None


print(f"`{name}`: FID-FMNIST (own feature network) and KID on the EMA weights, 50 DDIM steps.\n")
print("| attention | img/s (last 10 progress lines) | train s | test diffusion loss | FID-FMNIST | KID | FID-FMNIST, guided | KID, guided | samples |")
print("|---|---|---|---|---|---|---|---|---|")
network = None
for attention in types:
    metrics = records(os.path.join(out, f"{name}_{attention}_metrics.jsonl"))
    rates = [m["img_per_second"] for m in metrics if "img_per_second" in m][-10:]
    evals = [m for m in metrics if "eval" in m]
    loss = evals[-1]["eval"]["diffusion_loss"] if evals else float("nan")
    seconds = metrics[-1].get("train_seconds", float("nan")) if metrics else float("nan")
    plain = fid(attention, "1")
    guided = next((fid(attention, g) for g in ["1.5", "2", "2.0", "3", "4"] if fid(attention, g)), None)
    cell = lambda r, k, f: (f % r[k]) if r else "—"
    network = network or (plain or guided or {}).get("feature_network_sha256")
    rate = sum(rates) / len(rates) if rates else float("nan")
    print(f"| {attention} | {rate:,.0f} | {seconds:.0f} | {loss:.5f} | {cell(plain, 'fid_fmnist', '%.2f')} "
          f"| {cell(plain, 'kid_fmnist', '%.4f')} | {cell(guided, 'fid_fmnist', '%.2f')} "
          f"| {cell(guided, 'kid_fmnist', '%.4f')} | {cell(plain, 'samples', '%d')} |")
guided_scale = next((g for g in ["1.5", "2", "3", "4"] if any(fid(a, g) for a in types)), "?")
print(f"\nGuided: classifier-free guidance scale {guided_scale}. Feature network SHA-256: {network}.")
