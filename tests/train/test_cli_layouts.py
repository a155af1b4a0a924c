"""examples/train_gpt.py on layouts whose sizes were partly omitted (issue 26): each was refused
before ("tp*dp = 4*4 = 16 but the communicator has 4 ranks", or a 1F1B schedule short of
micro-batches); now the omitted sizes are derived and the run trains."""
import json
import os
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, find_mpiexec

TRAIN_PY = os.path.join(ROOT, "examples", "train_gpt.py")
SMALL = ["--set", "n_layer=2", "--set", "n_embd=32", "--set", "n_head=2", "--steps", "2", "--seq-len", "16",
         "--eval-every", "0", "--device", "cpu"]


def _train(n, flags, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run([find_mpiexec(), "-n", str(n), sys.executable, TRAIN_PY, *flags, *SMALL, "--metrics",
                          str(metrics)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["loss"] < 10 for r in rows), rows
    return text


@pytest.mark.parametrize("n,flags,mesh,split", [
    (4, ["--preset", "tiny", "--dp", "4"], "mesh tp=1 x dp=4 ", "micro-batch 2, accumulation 1"),
    (4, ["--preset", "tiny", "--pp", "2", "--dp", "2"], "mesh tp=1 x dp=2 x pp=2 ", "micro-batch 2, accumulation 2"),
    (4, ["--preset", "tiny-moe", "--dp", "2", "--ep", "2"], "mesh tp=2 x dp=2 (ep=2) ",
     "micro-batch 4, accumulation 1"),
    (2, ["--preset", "tiny", "--pp", "2"], "mesh tp=1 x dp=1 x pp=2 ", "micro-batch 4, accumulation 2"),
])
def test_a_layout_given_in_part_trains(n, flags, mesh, split, tmp_path):
    text = _train(n, flags, tmp_path)
    assert mesh in text and split in text, text


def test_a_refusal_on_the_command_line_names_flags_and_numbers(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = subprocess.run([find_mpiexec(), "-n", "3", sys.executable, TRAIN_PY, "--preset", "tiny", "--pp", "3",
                          *SMALL], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert (out.stdout + out.stderr).strip().splitlines() == [
        "train_gpt.py: error: n_layer=2 cannot fill pp=3 stages: each needs at least one layer, so n_layer must be "
        "at least pp x V = 3 x 1 = 3; use a model of at least 3 layers (n_layer=3)"]
