"""Issue 16, "Run directories and checkpoints": meta.json is sealed and checked against the files,
its numbers are bounded before any allocation, paths stay inside the checkpoint, a run directory
is locked and never silently reused, --out is checked at start-up, non-finite weights are never
saved, and ranks compare the content of their data."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

import cutp
from cutp import train
from cutp.checkpoint import (CheckpointError, list_checkpoints, load_checkpoint, main as checkpoint_main,
                             resolve_checkpoint, save_checkpoint)
from cutp.checkpoint.files import META_CHECKSUM, write_meta
from cutp.models import GPT, GPTConfig
from cutp.optim import AdamW, FlatParameters
from cutp.checkpoint.run_dir import LOCK_FILE, lock_run_dir
from tests.mpirun import ROOT, find_mpiexec
from tests.tp_utils import self_ctx

CFG = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=6)
SMALL = dict(preset="tiny", set=["n_layer=1"], dtype="float64", seq_len=16, batch_size=4, eval_every=0,
             device="cpu", quiet=True, save_on_signal=False)
MODEL = "model-tp00-of-01.safetensors"


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture
def saved(tmp_path):
    model = GPT(self_ctx(), CFG, seed=0)
    path = save_checkpoint(str(tmp_path / "run"), 5, model, AdamW(FlatParameters(model.parameters())), keep=2)
    return path, model


def _fresh():
    m = GPT(self_ctx(), CFG, seed=99)
    return m, AdamW(FlatParameters(m.parameters()))


def _meta(path):
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def _put_meta(path, meta, seal=False):
    if seal:
        write_meta(os.path.join(path, "meta.json"), meta)
    else:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(meta, f)


def _verify(path, capsys):
    status = checkpoint_main(["verify", path])
    return status, capsys.readouterr().out


# ---- 1. meta.json is sealed and checked against the files ---------------------------------------
@pytest.mark.parametrize("edit", [
    lambda m: m.update(step=999),
    lambda m: m["optimizer"].update(lr=0.5),
    lambda m: m["config"].update(n_layer=2),
    lambda m: m["mesh"].update(dp=4),
    lambda m: m["params"]["wte.weight"].update(real_rows=5),
], ids=["step", "lr", "n_layer", "mesh", "real_rows"])
def test_an_edited_meta_json_is_refused_by_load_and_verify(saved, edit, capsys):
    path, _ = saved
    meta = _meta(path)
    edit(meta)
    _put_meta(path, meta)
    m, opt = _fresh()
    # found by the checksum, or (an edit the files contradict) first by the check of the fields
    found = r"meta.json (was modified after it was written|is malformed: .*do not match|is malformed: parameter)"
    with pytest.raises(CheckpointError, match=found):
        load_checkpoint(path, m, opt)
    status, out = _verify(path, capsys)
    assert status == 1 and "DAMAGED" in out and re.search(found, out), out


def test_every_file_is_listed_and_matches_its_entry(saved, capsys):
    path, _ = saved
    assert _verify(path, capsys)[0] == 0
    # a file's entry removed (even with the checksum recomputed): the mesh's files are not all listed
    meta = _meta(path)
    del meta["files"][MODEL]
    _put_meta(path, meta, seal=True)
    m, opt = _fresh()
    with pytest.raises(CheckpointError, match=r"lists 1 files, but mesh.tp 1 with 1 optimizer shard\(s\) means 2"):
        load_checkpoint(path, m, opt)
    status, out = _verify(path, capsys)
    assert status == 1 and "lists 1 files" in out


def test_a_stray_shard_in_the_directory_is_found(saved, capsys):
    path, _ = saved
    shutil.copy(os.path.join(path, MODEL), os.path.join(path, "model-tp00-of-02.safetensors"))
    status, out = _verify(path, capsys)
    assert status == 1 and "model-tp00-of-02.safetensors is not listed in meta.json" in out, out
    m, opt = _fresh()
    with pytest.raises(CheckpointError, match=r"not listed in meta.json.*nothing was loaded"):
        load_checkpoint(path, m, opt)


def test_shapes_and_dtypes_in_the_files_must_match_meta(saved, capsys):
    from safetensors.numpy import load_file, save_file

    from cutp.checkpoint import sha256_file

    path, _ = saved
    shard = os.path.join(path, MODEL)
    for change, message in [(lambda t: t.update({"ln_f.weight": t["ln_f.weight"][:4]}),
                             r"tensor 'ln_f.weight' is F32 \[4\], meta.json says F32 \[8\]"),
                            (lambda t: t.update({"ln_f.bias": t["ln_f.bias"].astype(np.float64)}),
                             r"tensor 'ln_f.bias' is F64 \[8\], meta.json says F32 \[8\]")]:
        tensors = load_file(shard)
        change(tensors)
        save_file(tensors, shard)
        meta = _meta(path)
        meta["files"][MODEL] = {"sha256": sha256_file(shard), "bytes": os.path.getsize(shard)}
        _put_meta(path, meta, seal=True)
        status, out = _verify(path, capsys)
        assert status == 1 and any(re.search(message, line) for line in out.splitlines()), out


def test_an_old_checkpoint_without_checksum_loads_with_a_warning(saved, capsys):
    path, original = saved
    meta = _meta(path)
    del meta[META_CHECKSUM]
    _put_meta(path, meta)
    m, opt = _fresh()
    load_checkpoint(path, m, opt)
    assert all(np.array_equal(p.data, q.data) for p, q in zip(m.parameters(), original.parameters()))
    assert "has no checksum (written by an older cutp)" in capsys.readouterr().err
    assert _verify(path, capsys)[0] == 0


# ---- 2. crafted numbers are refused before any allocation -------------------------------------------
CRAFTED = textwrap.dedent("""
    import json, os, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a huge allocation fails here, not the machine
    from cutp.checkpoint import CheckpointError, export_full, load_model, main
    from cutp.checkpoint.files import write_meta
    from tests.tp_utils import self_ctx
    path = sys.argv[1]
    original = json.load(open(os.path.join(path, "meta.json")))
    def qkv(m, **kw):
        m["params"]["h.0.attn.c_attn.weight"]["sharding"].update(kw)
    def shape(m, name, s):
        m["params"][name]["full_shape"] = s
    cases = {
        "tp 1e9": lambda m: m["mesh"].update(tp=10**9),
        "n_head 1e7": lambda m: m["config"].update(n_head=10**7, n_embd=10**7),
        "qkv heads 1e7": lambda m: qkv(m, n_head=10**7, head_dim=1),
        "shape 2^40": lambda m: shape(m, "wte.weight", [2**40, 8]),
        "shape 2^30 x 2^10": lambda m: shape(m, "wte.weight", [2**30, 2**10]),
        "dp_shards 1e9": lambda m: m["optimizer"].update(dp_shards=10**9),
        "bool step": lambda m: m.update(step=True),
        "block_size 2^40": lambda m: m["config"].update(block_size=2**40),
        "vocab_multiple 2^40": lambda m: m["config"].update(vocab_multiple=2**40),
    }
    for name, edit in cases.items():
        meta = json.loads(json.dumps(original))
        edit(meta)
        write_meta(os.path.join(path, "meta.json"), meta)  # sealed again: a crafted file passes the checksum
        t = time.monotonic()
        for action in (lambda: main(["verify", path]), lambda: load_model(path, self_ctx()),
                       lambda: export_full(path, path + ".export")):
            try:
                status = action()
            except CheckpointError as e:
                status = str(e)
            assert status == 1 or "malformed" in str(status), (name, status)
        assert time.monotonic() - t < 10, name
        print("refused", name, flush=True)
""")


def test_crafted_numbers_in_meta_are_refused_without_allocating(saved):
    path, _ = saved
    out = subprocess.run([sys.executable, "-c", CRAFTED, path], env=_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("refused") == 9, out.stdout[-3000:] + out.stderr[-3000:]


# ---- 3. paths stay inside the checkpoint; only regular files are opened -------------------------------
VERIFY_EACH = textwrap.dedent("""
    import sys
    from cutp.checkpoint import CheckpointError, main
    for path in sys.argv[1:]:
        print("====", path, flush=True)
        try:
            print("status", main(["verify", path]), flush=True)
        except CheckpointError as e:
            print(e, "\\nstatus 1", flush=True)
""")


def test_fifos_devices_and_paths_outside_are_refused_without_hanging(saved, tmp_path):
    path, _ = saved
    cases = {}

    def case(name, damage):
        target = str(tmp_path / name)
        shutil.copytree(path, target)
        damage(target)
        cases[name] = target

    def replace_model(target, how):
        os.remove(os.path.join(target, MODEL))
        how(os.path.join(target, MODEL))

    def renamed(target):
        meta = _meta(target)
        meta["files"]["/dev/zero"] = meta["files"].pop(MODEL)
        _put_meta(target, meta, seal=True)  # checksum recomputed: refused all the same, never opened

    def fifo_meta(target):
        os.remove(os.path.join(target, "meta.json"))
        os.mkfifo(os.path.join(target, "meta.json"))

    outside = str(tmp_path / "outside.safetensors")
    shutil.copy(os.path.join(path, MODEL), outside)
    case("fifo", lambda t: replace_model(t, os.mkfifo))  # reading it would block forever
    case("devzero", lambda t: replace_model(t, lambda p: os.symlink("/dev/zero", p)))  # endless, and outside
    case("outside", lambda t: replace_model(t, lambda p: os.symlink(outside, p)))
    case("inside", lambda t: (os.rename(os.path.join(t, MODEL), os.path.join(t, ".real")),
                              os.symlink(".real", os.path.join(t, MODEL))))  # a symlink inside is fine
    case("named", renamed)
    case("fifo_meta", fifo_meta)
    out = subprocess.run([sys.executable, "-c", VERIFY_EACH] + list(cases.values()), env=_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    said = {name: part for name, part in zip(cases, out.stdout.split("==== ")[1:])}
    assert "is not a regular file" in said["fifo"] and "status 1" in said["fifo"], out.stdout
    assert "symlink leading out of" in said["devzero"] and "status 1" in said["devzero"], out.stdout
    assert "symlink leading out of" in said["outside"] and "status 1" in said["outside"], out.stdout
    assert ": OK" in said["inside"] and "status 0" in said["inside"], out.stdout
    assert "files ['/dev/zero'] are not the shard files" in said["named"] and "status 1" in said["named"], out.stdout
    assert "meta.json is not a regular file" in said["fifo_meta"] and "status 1" in said["fifo_meta"], out.stdout


def test_latest_may_not_point_outside_the_run_directory(saved, tmp_path):
    path, _ = saved
    run = os.path.dirname(path)
    other = tmp_path / "other"
    shutil.copytree(path, other / "step-00000009")
    for target in ["../other/step-00000009", str(other / "step-00000009"), "meta.json"]:
        with open(os.path.join(run, "latest"), "w") as f:
            json.dump({"step": 9, "path": target}, f)
        with pytest.raises(CheckpointError, match=r"latest is malformed or unsafe"):
            resolve_checkpoint(run)
    os.remove(os.path.join(run, "latest"))
    os.symlink(other / "step-00000009", os.path.join(run, "step-00000010"))  # a step-* symlink leading out
    with open(os.path.join(run, "latest"), "w") as f:
        json.dump({"step": 10, "path": "step-00000010"}, f)
    with pytest.raises(CheckpointError, match=r"symlink leading out of"):
        resolve_checkpoint(run)


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
                                                     r"parameter wte.weight holds NaN or Inf values on rank 0"):
            train.train_step(run)
        run.step = 1
        with pytest.raises(CheckpointError, match=r"step 1: parameter wte.weight holds NaN or Inf"):
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
