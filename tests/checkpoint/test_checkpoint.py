"""Checkpoints (cutp.checkpoint): saved, loaded, resumed and resharded.

A save killed midway leaves the previous checkpoint in use; a resume takes the run settings from
the checkpoint and reproduces the steps bit for bit; a checkpoint saved at TP 4 loads at TP 2 and
TP 1 (the vocabulary repadded) with the same validation loss. meta.json is sealed and checked
against the files (`verify` and load name what is wrong), its numbers are bounded before any
allocation, paths stay inside the checkpoint; a damaged checkpoint (truncated, flipped byte,
missing shard, malformed metadata, another model's) is named and loads nothing.
Pipeline-parallel checkpoints: tests/checkpoint/test_pipeline_checkpoints.py; run directories
(locks, `latest`, pruning, start-up checks): tests/checkpoint/test_run_dir.py."""
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

import cutp
from cutp.checkpoint import CheckpointError, load_checkpoint, main as checkpoint_main, resolve_checkpoint, save_checkpoint
from cutp.checkpoint.files import META_CHECKSUM, write_meta
from cutp.models import GPT, GPTConfig
from cutp.optim import AdamW, FlatParameters
from tests.mpirun import ROOT, run_mpi
from tests.tp_utils import self_ctx

TRAIN = "examples.train_gpt:main"
BASE = ["--preset", "tiny", "--dtype", "float64", "--seq-len", "32", "--batch-size", "8", "--eval-every", "0",
        "--quiet", "--set", "n_layer=2"]


def _env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


CFG = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=6)


MODEL = "model-tp00-of-01.safetensors"


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


# ---- meta.json is sealed and checked against the files ---------------------------------------------
@pytest.mark.parametrize("edit", [
    lambda m: m.update(step=999),
    lambda m: m["optimizer"].update(lr=0.5),
    lambda m: m["config"].update(n_layer=2),
    lambda m: m["mesh"].update(dp=4),
    lambda m: m["params"]["tok_embed.weight"].update(real_rows=5),
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
    for change, message in [(lambda t: t.update({"final_norm.weight": t["final_norm.weight"][:4]}),
                             r"tensor 'final_norm.weight' is F32 \[4\], meta.json says F32 \[8\]"),
                            (lambda t: t.update({"final_norm.bias": t["final_norm.bias"].astype(np.float64)}),
                             r"tensor 'final_norm.bias' is F64 \[8\], meta.json says F32 \[8\]")]:
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


# ---- crafted numbers are refused before any allocation ---------------------------------------------
CRAFTED = textwrap.dedent("""
    import json, os, resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a huge allocation fails here, not the machine
    from cutp.checkpoint import CheckpointError, export_full, load_model, main
    from cutp.checkpoint.files import write_meta
    from tests.tp_utils import self_ctx
    path = sys.argv[1]
    original = json.load(open(os.path.join(path, "meta.json")))
    def qkv(m, **kw):
        m["params"]["layers.0.attn.qkv.weight"]["sharding"].update(kw)
    def shape(m, name, s):
        m["params"][name]["full_shape"] = s
    cases = {
        "tp 1e9": lambda m: m["mesh"].update(tp=10**9),
        "n_head 1e7": lambda m: m["config"].update(n_head=10**7, n_embd=10**7),
        "qkv heads 1e7": lambda m: qkv(m, n_head=10**7, head_dim=1),
        "shape 2^40": lambda m: shape(m, "tok_embed.weight", [2**40, 8]),
        "shape 2^30 x 2^10": lambda m: shape(m, "tok_embed.weight", [2**30, 2**10]),
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


# ---- paths stay inside the checkpoint; only regular files are opened ---------------------------------
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


# ---- a save killed midway ------------------------------------------------------------------------
def _worker_killed_while_saving(run, where):
    import cutp.checkpoint.save as ck  # where save_checkpoint looks up what is patched below

    ctx = cutp.init(tp=2, device="cpu")
    model = GPT(ctx, GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, block_size=8), seed=1)
    opt = AdamW(FlatParameters(model.parameters()))
    ck.save_checkpoint(run, 1, model, opt)
    for p in model.parameters():
        p.data += 1  # step 2 differs from step 1
    if where == "shard" and ctx.rank == 1:  # half a shard on disk, then the power goes
        def write_half(path, tensors, metadata=None):
            ck.write_safetensors.__wrapped__(path, tensors, metadata)
            os.truncate(path, os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)

        write_half.__wrapped__ = ck.write_safetensors
        ck.write_safetensors = write_half
    if where == "rename" and ctx.rank == 0:  # every file of step 2 written, killed before the rename
        real_replace = os.replace

        def replace(src, dst):
            if os.path.basename(src) == ".tmp-" + ck.checkpoint_name(2):
                os.kill(os.getpid(), signal.SIGKILL)
            real_replace(src, dst)

        ck.os.replace = replace
    ck.save_checkpoint(run, 2, model, opt)
    raise AssertionError("not killed")


@pytest.mark.parametrize("where", ["shard", "rename"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_in_use(tmp_path, where):
    from cutp.checkpoint import list_checkpoints, resolve_checkpoint

    run = str(tmp_path / "run")
    run_mpi(2, "tests.checkpoint.test_checkpoint:_worker_killed_while_saving", run, where, timeout=60, expect_failure=True)
    assert [step for step, _ in list_checkpoints(run)] == [1]  # the half-written step 2 is not a checkpoint
    assert os.path.basename(resolve_checkpoint(run)) == "step-00000001"
    assert any(name.startswith(".tmp-") for name in os.listdir(run))  # what was left stays apart
    verify = subprocess.run([sys.executable, "-m", "cutp.checkpoint", "verify", run], env=_env(),
                            capture_output=True, text=True)
    assert verify.returncode == 0 and "OK" in verify.stdout, verify.stdout + verify.stderr
    model = GPT(self_ctx(), GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, block_size=8), seed=0,
                init=False)
    load_checkpoint(resolve_checkpoint(run), model, AdamW(FlatParameters(model.parameters())))
    reference = GPT(self_ctx(), GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, block_size=8), seed=1)
    for name, value in reference.gather_state_dict().items():  # step 1's weights, not step 2's
        np.testing.assert_array_equal(model.gather_state_dict()[name], value, err_msg=name)


# ---- a damaged checkpoint is named and loads nothing ----------------------------------------------
@pytest.fixture
def saved_run(tmp_path):
    ctx = self_ctx()
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=6)
    model = GPT(ctx, cfg, seed=0)
    opt = AdamW(FlatParameters(model.parameters()))
    path = save_checkpoint(str(tmp_path / "run"), 5, model, opt, keep=2)

    def fresh():
        m = GPT(ctx, cfg, seed=99)
        return m, AdamW(FlatParameters(m.parameters()))

    return path, fresh, model


def _unchanged(model, seed=99):
    ref = GPT(model.ctx, model.config, seed=seed)
    return all(np.array_equal(p.data, q.data) for p, q in zip(model.parameters(), ref.parameters()))


def test_intact_checkpoint_loads(saved_run):
    path, fresh, original = saved_run
    m, opt = fresh()
    meta = load_checkpoint(path, m, opt)
    assert meta["step"] == 5
    assert all(np.array_equal(p.data, q.data) for p, q in zip(m.parameters(), original.parameters()))


def test_truncated_shard_is_named(saved_run):
    path, fresh, _ = saved_run
    shard = os.path.join(path, "model-tp00-of-01.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 10)
    m, opt = fresh()
    with pytest.raises(CheckpointError, match=r"model-tp00-of-01.safetensors is truncated.*nothing was loaded"):
        load_checkpoint(path, m, opt)
    assert _unchanged(m)


def test_flipped_byte_is_named(saved_run):
    path, fresh, _ = saved_run
    shard = os.path.join(path, "optim-tp00-of-01.safetensors")
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 7)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    m, opt = fresh()
    with pytest.raises(CheckpointError, match=r"optim-tp00-of-01.safetensors is corrupted: sha256"):
        load_checkpoint(path, m, opt)
    assert _unchanged(m)


def test_missing_shard_is_named(saved_run):
    path, fresh, _ = saved_run
    os.remove(os.path.join(path, "model-tp00-of-01.safetensors"))
    m, _ = fresh()
    with pytest.raises(CheckpointError, match=r"model-tp00-of-01.safetensors is missing"):
        load_checkpoint(path, m)
    assert _unchanged(m)


def test_malformed_metadata_is_named(saved_run):
    path, fresh, _ = saved_run
    meta_path = os.path.join(path, "meta.json")
    with open(meta_path, "w") as f:
        f.write('{"format": "cutp-checkpoint", "version": 1, "step": ')
    m, _ = fresh()
    with pytest.raises(CheckpointError, match=r"meta.json is malformed JSON"):
        load_checkpoint(path, m)
    with open(meta_path, "w") as f:
        json.dump({"format": "cutp-checkpoint", "version": 1, "step": "five"}, f)
    with pytest.raises(CheckpointError, match=r"field 'step' is missing or not a int"):
        load_checkpoint(path, m)
    assert _unchanged(m)


def test_wrong_model_is_refused(saved_run, tmp_path):
    path, _, _ = saved_run
    other = GPT(self_ctx(), GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=6))
    with pytest.raises(CheckpointError, match=r"n_layer: checkpoint 1 vs model 2"):
        load_checkpoint(path, other)


@pytest.mark.parametrize("edit,msg", [
    (lambda m: m["mesh"].pop("tp"), r"mesh.tp is None, not an integer >= 1"),
    (lambda m: m["params"]["tok_embed.weight"].pop("sharding"), r"parameter 'tok_embed.weight': sharding 'absent'"),
    (lambda m: m["params"]["tok_embed.weight"].update(sharding={"kind": "zz"}), r"neither null nor a known kind"),
    (lambda m: m["params"]["final_norm.weight"].update(full_shape="8"), r"full_shape '8' is not a list"),
    (lambda m: m["optimizer"].pop("step"), r"optimizer must be null or an object with an integer step"),
    (lambda m: m.update(rng={"offsets": {"replicated": "x"}}), r"rng must be null or hold integer offsets"),
])
def test_malformed_metadata_fields_are_named(saved_run, edit, msg):
    path, fresh, _ = saved_run
    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    edit(meta)
    json.dump(meta, open(meta_path, "w"))
    m, opt = fresh()
    with pytest.raises(CheckpointError, match=msg):
        load_checkpoint(path, m, opt)
    assert _unchanged(m)


def test_a_tensor_missing_from_a_shard_loads_nothing(saved_run):
    """meta.json and checksums agree, but the optimizer shard lacks one tensor: nothing changes."""
    from safetensors.numpy import load_file, save_file

    from cutp.checkpoint import sha256_file
    from cutp.checkpoint.files import write_meta

    path, fresh, _ = saved_run
    shard = os.path.join(path, "optim-tp00-of-01.safetensors")
    tensors = load_file(shard)
    tensors.pop("exp_avg_sq.final_norm.bias")
    save_file(tensors, shard)
    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    meta["files"]["optim-tp00-of-01.safetensors"] = {"sha256": sha256_file(shard), "bytes": os.path.getsize(shard)}
    write_meta(meta_path, meta)  # re-sealed: found by the file's tensors against meta.json, before any is read
    m, opt = fresh()
    m0 = opt.m.copy()
    with pytest.raises(CheckpointError, match=r"lacks tensors \['exp_avg_sq.final_norm.bias'\].*nothing was loaded"):
        load_checkpoint(path, m, opt)
    assert _unchanged(m) and np.array_equal(opt.m, m0) and opt.step_count == 0


# ---- resume and reshard ---------------------------------------------------------------------------
def test_resume_takes_the_run_settings_from_the_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    first = run_mpi(2, TRAIN, ["--steps", "4", "--run-steps", "2", "--seq-len", "16", "--eval-every", "0",
                               "--set", "n_layer=1", "--lr", "0.002", "--out", out], timeout=120)
    assert "batch 8 x 16 tokens" in first.stdout
    # another mesh, no run flags: same batch, sequence length and learning rate
    res = run_mpi(4, TRAIN, ["--resume", out, "--tp", "2", "--dp", "2", "--eval-every", "0"], timeout=120)
    assert "batch 8 x 16 tokens" in res.stdout and "lr 0.002" in res.stdout and "steps 2..4" in res.stdout
    assert "layout: tp 2 x dp 2, the resumed run's was tp 2 x dp 1" in res.stdout  # said in one line
    assert f"saved {out}/step-00000004" in res.stdout  # no --out: into the resumed run's directory
    bad = run_mpi(2, TRAIN, ["--resume", out, "--lr", "0.1"], timeout=120, expect_failure=True)
    assert "--lr 0.1 differs from the resumed run's 0.002" in bad.stdout
    bad = run_mpi(2, TRAIN, ["--resume", out, "--set", "n_layer=2"], timeout=120, expect_failure=True)
    assert "n_layer: checkpoint 1, flags 2" in bad.stdout
    ok = run_mpi(2, TRAIN, ["--resume", out, "--set", "n_layer=1", "--steps", "5", "--eval-every", "0"], timeout=120)
    assert "steps 4..5" in ok.stdout  # --steps may change: it extends the run


def test_resume_reproduces_steps_bit_identically(tmp_path):
    from safetensors.numpy import load_file

    args = BASE + ["--dropout", "0.1", "--tp", "2", "--dp", "2", "--micro-batch-size", "2"]
    full, part = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    run, rerun = tmp_path / "run", tmp_path / "rerun"
    ckpt = run / "step-00000015"
    # one launch: the run, then the resume from its step 15 into another directory
    run_mpi(4, "tests.acceptance.test_mixed_precision:_worker_two_mains", str(tmp_path / "histories.json"),
            [("run", args + ["--steps", "20", "--save-every", "5", "--keep", "2", "--out", str(run),
                             "--metrics", str(full)]),
             ("resume", args + ["--steps", "20", "--resume", str(ckpt), "--metrics", str(part), "--out", str(rerun)])],
            timeout=480)
    # --keep 2: the run directory keeps the two newest checkpoints and points `latest` at the last
    assert sorted(p.name for p in run.iterdir()) == ["config.toml", "latest", "step-00000015", "step-00000020"]
    assert json.loads((run / "latest").read_text()) == {"step": 20, "path": "step-00000020"}
    a, b = _metrics(full)[15:], _metrics(part)
    assert [r["step"] for r in b] == list(range(16, 21))
    for ra, rb in zip(a, b):
        assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"], (ra, rb)
    # and the final weights and optimizer moments are bit-identical too
    files = sorted(p.name for p in (run / "step-00000020").glob("*.safetensors"))
    assert files == sorted(p.name for p in (rerun / "step-00000020").glob("*.safetensors")) and len(files) == 4
    for name in files:
        x, y = load_file(run / "step-00000020" / name), load_file(rerun / "step-00000020" / name)
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x), name
    # a checkpoint is safetensors and JSON only, and records the library version and the data position
    assert sorted(p.name for p in (run / "step-00000020").iterdir()) == sorted(files + ["meta.json"])
    import cutp

    meta = json.loads((run / "step-00000020" / "meta.json").read_text())
    assert meta["cutp_version"] == cutp.__version__ and meta["step"] == 20
    assert meta["data"]["next_step"] == 20 and meta["data"]["global_batch"] == 8 and meta["data"]["seq_len"] == 32


def _worker_val_losses(cases):
    """Each (checkpoint, tp, out) of cases on the first tp ranks of the job, one after the other:
    one launch loads the checkpoint at every TP size."""
    from mpi4py import MPI

    from tests.tp_utils import first_ranks, wait_for_all

    for ckpt, tp, out in cases:
        sub = first_ranks(tp)
        if sub != MPI.COMM_NULL:
            _val_loss(ckpt, tp, out, sub)
            sub.Free()
        wait_for_all(MPI.COMM_WORLD)


def _val_loss(ckpt, tp, out, comm):
    import cutp
    from cutp.checkpoint import load_model
    from cutp.data import BatchSampler, load_dataset

    ctx = cutp.init(comm=comm, tp=tp, device="cpu")
    model, meta = load_model(ckpt, ctx)
    model.eval()
    sampler = BatchSampler(load_dataset(None), 32, 4, ctx.dp_size, ctx.dp_rank, 4, seed=0)
    losses = [model.forward(x, y) for i in range(2) for x, y in sampler.micro_batches(i, "val")]
    if ctx.rank == 0:
        with open(out, "w") as f:
            json.dump({"val": float(np.mean(losses)), "step": meta["step"]}, f)
    ctx.close()


def test_checkpoint_saved_at_tp4_loads_at_tp2_and_tp1(tmp_path):
    from cutp.checkpoint import export_full, read_meta

    run_mpi(4, TRAIN, BASE + ["--steps", "3", "--tp", "4", "--out", str(tmp_path / "run")], timeout=240)
    ckpt = str(tmp_path / "run")
    # and an exported single-shard copy holds the same model
    exported = export_full(ckpt, str(tmp_path / "full"))
    meta = read_meta(exported)
    assert meta["mesh"] == {"tp": 1, "dp": 1} and len(meta["files"]) == 2
    cases = [(ckpt, tp, str(tmp_path / f"val{tp}.json")) for tp in (4, 2, 1)]
    cases.append((exported, 2, str(tmp_path / "val_export.json")))
    run_mpi(4, "tests.checkpoint.test_checkpoint:_worker_val_losses", cases, timeout=240)
    vals = {tp: json.loads((tmp_path / f"val{tp}.json").read_text()) for tp in (4, 2, 1)}
    assert vals[4]["step"] == 3
    assert abs(vals[2]["val"] - vals[4]["val"]) <= 1e-10 * vals[4]["val"]
    assert abs(vals[1]["val"] - vals[4]["val"]) <= 1e-10 * vals[4]["val"]
    out = tmp_path / "val_export.json"
    assert abs(json.loads(out.read_text())["val"] - vals[4]["val"]) <= 1e-10 * vals[4]["val"]


def _worker_repad_vocabulary(run):
    """A checkpoint whose vocabulary padding differs from the loading model's (97 real rows,
    padded to 256 at TP=2 but to 128 at TP=1): the real rows survive, the padding is rebuilt."""
    import cutp
    from cutp.checkpoint import export_full, load_checkpoint, save_checkpoint
    from cutp.models import GPT, GPTConfig
    from cutp.optim import AdamW, FlatParameters
    from tests.tp_utils import self_ctx

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=97, block_size=8, tie_embeddings=False)
    ctx = cutp.init(tp=2, device="cpu")
    model = GPT(ctx, cfg, seed=4)
    opt = AdamW(FlatParameters(model.parameters()))
    opt.m[...] = 1.5  # something to carry over
    path = save_checkpoint(run, 1, model, opt)
    want = model.gather_state_dict(rank=None)
    one = GPT(self_ctx(), cfg, seed=0, init=False)
    opt1 = AdamW(FlatParameters(one.parameters()))
    load_checkpoint(path, one, opt1)
    assert one.padded_vocab == 128 and model.padded_vocab == 256
    got = one.gather_state_dict()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not one.tok_embed.weight.data[97:].any() and not one.lm_head.weight.data[97:].any()
    for key, m in opt1.state_dict().items():  # moments re-padded like the parameters
        if not key.startswith("exp_avg."):
            continue
        rows = one.named_parameters()[key[len("exp_avg."):]].real_rows
        assert (m[:rows] == 1.5).all() and not m[rows:].any() if rows else (m == 1.5).all(), key
    if ctx.rank == 0:
        exported = export_full(path, run + "-full")
        from cutp.checkpoint import read_meta

        assert read_meta(exported)["params"]["tok_embed.weight"]["full_shape"] == [128, 8]
    ctx.close()


def test_checkpoint_repads_the_vocabulary_for_another_tp(tmp_path):
    run_mpi(2, "tests.checkpoint.test_checkpoint:_worker_repad_vocabulary", str(tmp_path / "run"), timeout=120)
