"""The JSON lines of a bench or peer run (lines that do not start with "{" are skipped)."""
import json


def load(path):
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows
