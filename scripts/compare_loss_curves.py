#!/usr/bin/env python3
"""Compares two training runs' metrics.jsonl (the same recipe on two backends): the training
losses logged at the same steps (mean and largest absolute difference, the means of the last ten
common points) and each run's last test accuracy (EMA and trained weights). Prints one JSON line.
Usage: compare_loss_curves.py A/metrics.jsonl B/metrics.jsonl [LABEL_A LABEL_B]"""
import json
import sys


def read(path):
    rows = []
    try:
        f = open(path)
    except OSError as e:
        sys.exit(f"{path}: {e.strerror}")
    with f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{number}: not a JSON line ({e.msg})")
    return rows


def losses(rows):
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r and "eval" not in r}


def last_eval(rows):
    evals = [r for r in rows if isinstance(r.get("eval"), dict)]
    return evals[-1] if evals else None


def main(argv):
    if len(argv) not in (3, 5):
        sys.exit(__doc__)
    a_rows, b_rows = read(argv[1]), read(argv[2])
    label_a, label_b = (argv[3], argv[4]) if len(argv) == 5 else ("a", "b")
    la, lb = losses(a_rows), losses(b_rows)
    common = sorted(set(la) & set(lb))
    if not common:
        sys.exit(f"no training loss logged at the same step in {argv[1]} and {argv[2]}")
    diffs = [abs(la[s] - lb[s]) for s in common]
    tail = common[-10:]
    result = {
        "common_steps": len(common),
        "loss_abs_diff_mean": round(sum(diffs) / len(diffs), 5),
        "loss_abs_diff_max": round(max(diffs), 5),
        f"loss_last10_{label_a}": round(sum(la[s] for s in tail) / len(tail), 5),
        f"loss_last10_{label_b}": round(sum(lb[s] for s in tail) / len(tail), 5),
    }
    for label, rows in ((label_a, a_rows), (label_b, b_rows)):
        e = last_eval(rows)
        if e is not None:
            result[f"last_eval_{label}"] = dict(e["eval"], step=e.get("step"))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv)
