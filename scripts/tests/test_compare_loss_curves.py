"""compare_loss_curves.py on fixture runs: the loss differences at common steps, the last
evaluation of each run, and clear errors for runs that cannot be compared."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "compare_loss_curves.py")


def write_run(directory, name, rows, raw_lines=()):
    path = os.path.join(directory, f"{name}.jsonl")
    with open(path, "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
        for line in raw_lines:
            out.write(line + "\n")
    return path


def progress(step, loss):
    return {"epoch": 1, "img_per_second": 1000.0, "loss": loss, "lr": 1e-3, "step": step}


def evaluation(step, accuracy):
    return {"epoch": 1, "step": step,
            "eval": {"accuracy": accuracy, "count": 100, "split": "test", "weights": "ema"}}


class CompareLossCurves(unittest.TestCase):
    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)

    def test_differences_at_common_steps_and_last_evaluations(self):
        d = tempfile.mkdtemp()
        a = write_run(d, "a", [progress(100, 1.0), progress(200, 0.8), evaluation(200, 0.5),
                               progress(300, 0.6), evaluation(300, 0.7)])
        # Step 300 is missing from b, step 400 from a: only 100 and 200 are compared.
        b = write_run(d, "b", [progress(100, 1.1), progress(200, 0.75), progress(400, 0.1),
                               evaluation(400, 0.69)])
        done = self.run_script(a, b, "cuda", "reference")
        self.assertEqual(done.returncode, 0, done.stderr)
        result = json.loads(done.stdout)
        self.assertEqual(result["common_steps"], 2)
        self.assertAlmostEqual(result["loss_abs_diff_mean"], 0.075, places=5)
        self.assertAlmostEqual(result["loss_abs_diff_max"], 0.1, places=5)
        self.assertAlmostEqual(result["loss_last10_cuda"], 0.9, places=5)
        self.assertAlmostEqual(result["loss_last10_reference"], 0.925, places=5)
        self.assertEqual(result["last_eval_cuda"]["accuracy"], 0.7)
        self.assertEqual(result["last_eval_cuda"]["step"], 300)
        self.assertEqual(result["last_eval_reference"]["accuracy"], 0.69)

    def test_no_common_step_is_an_error(self):
        d = tempfile.mkdtemp()
        a = write_run(d, "a", [progress(100, 1.0)])
        b = write_run(d, "b", [progress(200, 1.0)])
        done = self.run_script(a, b)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("no training loss logged at the same step", done.stderr)

    def test_a_broken_line_names_file_and_line(self):
        d = tempfile.mkdtemp()
        a = write_run(d, "a", [progress(100, 1.0)], raw_lines=["{truncated"])
        b = write_run(d, "b", [progress(100, 1.0)])
        done = self.run_script(a, b)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn(f"{a}:2: not a JSON line", done.stderr)

    def test_a_missing_file_is_named(self):
        d = tempfile.mkdtemp()
        b = write_run(d, "b", [progress(100, 1.0)])
        missing = os.path.join(d, "missing.jsonl")
        done = self.run_script(missing, b)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn(f"{missing}: No such file or directory", done.stderr)

    def test_wrong_arguments_print_the_usage(self):
        done = self.run_script("only-one.jsonl")
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("Usage: compare_loss_curves.py", done.stderr)


if __name__ == "__main__":
    unittest.main()
