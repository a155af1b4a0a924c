"""Run directories (`--out DIR`, cutp.checkpoint.run_dir): a run directory is locked and never
silently reused, --out is checked at start-up, `latest` names the newest complete checkpoint,
pruning keeps it and never removes the checkpoint just written, non-finite
weights are never saved, and ranks compare the content of their data. The checkpoints themselves
(meta.json, damage, resume, reshard): tests/checkpoint/test_checkpoint.py."""
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import cutp
from cutp import train
from cutp.checkpoint import CheckpointError, list_checkpoints, resolve_checkpoint, save_checkpoint
from cutp.models import GPT, GPTConfig
from cutp.optim import AdamW, FlatParameters
from cutp.checkpoint.run_dir import LOCK_FILE, lock_run_dir
from tests.mpirun import ROOT, find_mpiexec
from tests.tp_utils import self_ctx

CFG = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=6)
SMALL = dict(preset="tiny", set=["n_layer=1"], dtype="float64", seq_len=16, batch_size=4, eval_every=0,
             device="cpu", quiet=True, save_on_signal=False)


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")


# ---- 4-6. the run directory: locked, not silently reused, checked at start-up -------------------------
def _config(out, **kw):
    return train.resolve_run_config(MPI.COMM_SELF, steps=kw.pop("steps", 1), out=str(out), **SMALL, **kw)


def _train(cfg):
    run = train.build_run(cfg, MPI.COMM_SELF)
    try:
        while run.step < run.end_step:
            train.train_step(run)
        return train.save(run)
    finally:
        run.close()


def test_a_second_job_on_the_same_out_is_refused_and_a_dead_holder_releases_it(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from cutp.checkpoint.run_dir import lock_run_dir; "
                               "lock = lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(120)",
                               str(out)], env=_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(cutp.ConfigError, match=rf"out {out} is in use by another job \(host .*, pid "
                                                    rf"{holder.pid}, since .*\); wait until it ends"):
            train.build_run(_config(out), MPI.COMM_SELF)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with open(out / LOCK_FILE) as f:
        assert str(holder.pid) in f.read()  # a killed holder leaves its file behind ...
    lock_run_dir(str(out)).release()  # ... but the kernel dropped its lock
    assert not os.path.exists(out / LOCK_FILE)  # a lock released is removed
    _train(_config(out))  # and a run takes it and releases it at close()
    lock_run_dir(str(out)).release()


def test_an_out_holding_another_runs_checkpoints_needs_resume_or_overwrite(tmp_path):
    out = tmp_path / "run"
    _train(_config(out, steps=2))
    with pytest.raises(cutp.ConfigError, match=rf"^out {out} holds checkpoints of another run \(step-00000002\); "
                                                rf"pass resume {out} to continue it, or overwrite to replace them$"):
        train.build_run(_config(out, steps=1), MPI.COMM_SELF)
    assert [s for s, _ in list_checkpoints(str(out))] == [2]
    _train(train.resolve_run_config(MPI.COMM_SELF, resume=str(out), steps=3, out=str(out), device="cpu", quiet=True,
                                    eval_every=0, save_on_signal=False))  # resuming it is fine
    assert [s for s, _ in list_checkpoints(str(out))] == [2, 3]
    _train(_config(out, steps=1, overwrite=True))  # replaced, once the new run's checkpoint is complete
    assert [s for s, _ in list_checkpoints(str(out))] == [1]
    assert resolve_checkpoint(str(out)).endswith("step-00000001")


def test_an_unusable_out_is_refused_at_start_up(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(cutp.ConfigError, match=rf"out {afile} is a file, not a directory"):
        train.build_run(_config(afile), MPI.COMM_SELF)
    with pytest.raises(cutp.ConfigError, match=rf"out {afile}/sub cannot be written"):
        train.build_run(_config(afile / "sub"), MPI.COMM_SELF)
    if os.geteuid() != 0:  # root writes into read-only directories
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(cutp.ConfigError, match=rf"out {ro} cannot be written"):
            train.build_run(_config(ro), MPI.COMM_SELF)


def test_an_unusable_out_stops_every_rank_with_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    cmd = [find_mpiexec(), "-n", "2", sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--preset",
           "tiny", "--set", "n_layer=1", "--seq-len", "16", "--batch-size", "4", "--steps", "5", "--quiet",
           "--out", str(afile)]
    out = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [line for line in (out.stdout + out.stderr).splitlines() if "error:" in line]
    assert errors == [f"train_gpt.py: error: --out {afile} is a file, not a directory; choose a directory for the "
                      "checkpoints"], out.stdout + out.stderr


# ---- 7. never a non-finite checkpoint; the newest healthy one is never pruned ------------------------
def test_non_finite_weights_are_never_saved_nor_the_healthy_checkpoint_pruned(tmp_path):
    model = GPT(self_ctx(), CFG, seed=0)
    opt = AdamW(FlatParameters(model.parameters()))
    run = str(tmp_path / "run")
    save_checkpoint(run, 1, model, opt, keep=1)
    model.parameters()[3].data.reshape(-1)[2] = np.nan
    name = model.parameters()[3].name
    with pytest.raises(CheckpointError, match=rf"step 2: parameter {name} holds NaN or Inf values \(rank 0\): the "
                                              r"weights diverged, so no checkpoint was written"):
        save_checkpoint(run, 2, model, opt, keep=1)
    assert [s for s, _ in list_checkpoints(run)] == [1] and resolve_checkpoint(run).endswith("step-00000001")
    assert sorted(os.listdir(run)) == ["latest", "step-00000001"]  # no half-written directory either
    model.parameters()[3].data.reshape(-1)[2] = 0.0
    for step in (2, 3, 4):
        save_checkpoint(run, step, model, opt, keep=0)  # --keep 0 keeps all
    assert [s for s, _ in list_checkpoints(run)] == [1, 2, 3, 4]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the poisoned forward's NaNs
def test_diverged_weights_are_named_when_the_run_stops(tmp_path):
    run = train.build_run(_config(tmp_path / "run", steps=3, max_skips=1), MPI.COMM_SELF)
    try:
        run.model.parameters()[0].data[...] = np.inf
        with pytest.raises(FloatingPointError, match=r"1 consecutive non-finite steps; stopping after step 1: "
                                                     r"parameter tok_embed.weight holds NaN or Inf values on rank 0"):
            train.train_step(run)
        run.step = 1
        with pytest.raises(CheckpointError, match=r"step 1: parameter tok_embed.weight holds NaN or Inf"):
            train.save(run)
        assert list_checkpoints(str(tmp_path / "run")) == []
    finally:
        run.close()


# ---- 8. ranks compare the content of their data, not only its path and size -------------------------
def test_the_same_data_path_with_other_contents_is_found(tmp_path):
    base = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--preset", "tiny", "--set", "n_layer=1",
            "--seq-len", "16", "--batch-size", "4", "--steps", "1", "--quiet", "--eval-every", "0",
            "--data", "corpus.txt"]
    rng = np.random.default_rng(0)
    for node in ("a", "b"):  # two "nodes": the same relative path and size, other bytes
        (tmp_path / node).mkdir()
        (tmp_path / node / "corpus.txt").write_bytes(bytes(rng.integers(97, 123, 4000, dtype=np.uint8)))
    cmd = [find_mpiexec(), "-n", "1", "-wdir", str(tmp_path / "a")] + base + [
        ":", "-n", "1", "-wdir", str(tmp_path / "b")] + base
    out = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "the training data differs across ranks: data_blake2b: ranks 0 have" in out.stdout + out.stderr, (
        out.stdout + out.stderr)


def test_keep_prunes_only_after_a_newer_checkpoint_is_complete(tmp_path):
    ctx = self_ctx()
    model = GPT(ctx, GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=6))
    run = str(tmp_path / "run")
    for step in (1, 2, 3):
        save_checkpoint(run, step, model, keep=2)
    assert sorted(os.listdir(run)) == ["latest", "step-00000002", "step-00000003"]
    # a crash mid-save leaves a .tmp directory: it is never taken for a checkpoint
    os.makedirs(os.path.join(run, ".tmp-step-00000004"))
    from cutp.checkpoint import resolve_checkpoint

    assert resolve_checkpoint(run).endswith("step-00000003")
    os.remove(os.path.join(run, "latest"))
    assert resolve_checkpoint(run).endswith("step-00000003")
    shutil.rmtree(os.path.join(run, "step-00000003"))
    with open(os.path.join(run, "latest"), "w") as f:
        json.dump({"step": 3, "path": "step-00000003"}, f)
    assert resolve_checkpoint(run).endswith("step-00000002")  # falls back to the newest complete one


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path, capsys):
    ctx = self_ctx()
    model = GPT(ctx, GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=6))
    run = str(tmp_path / "run")
    save_checkpoint(run, 50, model, keep=1)  # a run that went further, then was abandoned
    path = save_checkpoint(run, 35, model, keep=1)  # restarted from an earlier step
    assert os.path.exists(os.path.join(path, "meta.json"))
    assert json.load(open(os.path.join(run, "latest"))) == {"step": 35, "path": "step-00000035"}
    assert "holds checkpoints of later steps" in capsys.readouterr().err
    save_checkpoint(run, 36, model, keep=1)
    assert sorted(os.listdir(run)) == ["latest", "step-00000036", "step-00000050"]
