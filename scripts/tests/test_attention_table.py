"""attention_table.py on fixture rows: the ratio columns and the peers' GPU-work table."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "attention_table.py")


def ours_row(op, n, fwd_bwd_ms):
    return {"op": op, "backend": "cuda", "N": n, "B": 65536 // n, "fwd_bwd_ms": fwd_bwd_ms,
            "fwd_ms": fwd_bwd_ms / 4, "fwd_bwd_bandwidth_share": 0.5,
            "copy_bandwidth_gbs": 4200.0}


def peer_row(op, n, fwdbwd_ms):
    return {"kind": "vision", "op": op, "N": n, "fwdbwd_ms": fwdbwd_ms, "fwd_ms": fwdbwd_ms / 4}


class AttentionTable(unittest.TestCase):
    def run_table(self, *files):
        directory = tempfile.mkdtemp()
        paths = []
        for i, rows in enumerate(files):
            path = os.path.join(directory, f"{i}.jsonl")
            with open(path, "w") as out:
                out.write("not json: skipped\n")
                out.write("\n".join(json.dumps(r) for r in rows) + "\n")
            paths.append(path)
        done = subprocess.run([sys.executable, SCRIPT, *paths], capture_output=True, text=True)
        self.assertEqual(done.returncode, 0, done.stderr)
        return done.stdout

    def setUp(self):
        self.ours = [ours_row("mhla", 1024, 0.25), ours_row("linear", 1024, 0.2)]
        self.peers = [peer_row("mhla_torch_M16", 1024, 2.5), peer_row("linear_torch", 1024, 1.0),
                      peer_row("sdpa_cudnn", 1024, 1.0), peer_row("sdpa_flash", 1024, 1.5)]

    def test_ratios_of_the_main_table(self):
        text = self.run_table(self.ours, self.peers)
        row = next(line for line in text.splitlines() if line.startswith("| 1024 (64)"))
        self.assertIn("| 10.00× | 4.00× | 1.25× |", row)  # PyTorch MHLA, cuDNN, MHLA / linear
        self.assertNotIn("GPU work", text)  # no third file: no second table

    def test_the_peers_gpu_work(self):
        gpu = [{"kind": "vision_gpu_time", "op": "mhla_torch_M16", "N": 1024,
                "event_ms": [2.5, 2.9], "gpu_kernels_ms": 1.5, "kernels_share": 0.6},
               {"kind": "vision_gpu_time", "op": "sdpa_flash", "N": 1024, "error": "boom"}]
        text = self.run_table(self.ours, self.peers, gpu)
        rows = [line for line in text.splitlines() if line.startswith("| 1024 | ")]
        self.assertEqual(len(rows), 1, text)  # the failed peer is left out
        self.assertEqual(rows[0], "| 1024 | plain-PyTorch MHLA | 2.500 2.900 | 1.500 | 0.60 | 6.00× |")


if __name__ == "__main__":
    unittest.main()
