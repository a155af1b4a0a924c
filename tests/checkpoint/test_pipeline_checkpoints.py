"""Checkpoints of pipeline-parallel runs (issue 15): one shard per (pp, tp) rank, resharded on load.

A tp2 x pp2 checkpoint (plain optimizer; and one with dropout) and a dp2 x pp2 one (distributed
optimizer, untied head) resume bit-identically at their own mesh, and at tp1 x pp1, pp4 and uneven stages with the same float64 losses (1e-10); exported
to pp1 tp1, the validation loss is the same; load_model at pp 1 and the Hugging Face export and
import read every stage's weights; `verify` names a tampered stage file, and meta.json's pipeline
fields are checked.
"""
import json
import os
import shutil

import numpy as np
import pytest

import cutp
from cutp.bench.model import random_tokens
from cutp.checkpoint import CheckpointError, export_full, load_model, main as ckpt_main
from cutp.checkpoint.files import expected_files, read_meta, write_meta
from cutp.hf import from_hf_gpt2, save_hf_gpt2
from cutp.models import GPT, GPTConfig
from cutp.train import RunConfig, build_run, evaluate, save, train_step
from tests.mpirun import run_mpi

DATA = dict(vocab=97, n=4096, seed=0)
GENERATE = "examples.generate:main"


def _config(tp=1, dp=1, pp=1, pp_layers=None, zero=False, dropout=0.0, tie=True, **run):
    model = GPTConfig(n_layer=4, n_head=4, n_kv_head=2 if tie else 4, n_embd=32, vocab_size=97, block_size=16,
                      dtype="float64", dropout=dropout, tie_embeddings=tie)  # (untied: no GQA, as in GPT-2)
    return RunConfig(model=model, tp=tp, dp=dp, pp=pp, pp_layers=pp_layers, batch_size=8, micro_batch_size=1,
                     seq_len=16, steps=4, warmup=1, seed=3, distributed_optimizer=zero, eval_every=0, eval_batches=2,
                     quiet=True, save_on_signal=False, **run)


def _run(cfg, comm, steps, save_at=None):
    """Losses of `steps` steps (a checkpoint after `save_at` of them) and the validation loss
    after the first `save_at` steps (or at the start)."""
    run = build_run(cfg, comm, dataset=random_tokens(DATA["vocab"], DATA["n"], DATA["seed"]))
    losses, val = [], None
    try:
        for i in range(steps):
            if i == (save_at or 0):
                val = evaluate(run)
            if save_at is not None and i == save_at:
                save(run)
            losses.append(train_step(run).loss)
    finally:
        run.close()
    return losses, val


def _resume(comm, ckpt, **mesh):
    kw = dict(mesh)
    dropout = kw.pop("dropout", 0.0)
    tie = kw.pop("tie", True)
    return _run(_config(resume=ckpt, resumed_step=2, dropout=dropout, tie=tie, **kw), comm, 2)


def _close(a, b, what):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=0, err_msg=what)


def _worker(tmp):
    from mpi4py import MPI

    world, me = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
    cases = {  # name: (the mesh it is saved at, model settings)
        "drop": (dict(tp=2, pp=2), dict(dropout=0.1)),
        "tp2pp2": (dict(tp=2, pp=2), {}),
        "zero": (dict(dp=2, pp=2, zero=True), dict(tie=False)),
        "zero-tied": (dict(dp=2, pp=2, zero=True), {}),  # the last stage's DP shards leave out the tied copy
    }
    ref = {}
    for name, (mesh, model) in cases.items():
        out = os.path.join(tmp, name)
        ref[name] = _run(_config(out=out, **mesh, **model), world, 4, save_at=2)
    ckpt = {name: os.path.join(tmp, name, "step-00000002") for name in cases}

    # the same mesh: bit-identical, dropout included
    for name, (mesh, model) in cases.items():
        losses, _ = _resume(world, ckpt[name], **mesh, **model)
        assert losses == ref[name][0][2:], (name, losses, ref[name][0][2:])
    # other meshes: the same float64 losses
    for name in ("tp2pp2", "zero"):
        model = cases[name][1]
        for mesh in (dict(pp=4), dict(tp=2, pp=2, pp_layers=(3, 1)), dict(dp=2, pp=2, pp_layers=(1, 3), zero=True),
                     dict(tp=2, dp=2)):
            losses, val = _resume(world, ckpt[name], **mesh, **model)
            _close(losses, ref[name][0][2:], f"{name} at {mesh}")
            _close(val, ref[name][1], f"{name} val at {mesh}")
    if me == 0:  # one rank: tp1 x pp1, from the checkpoint and from its export
        for name in ("tp2pp2", "zero"):
            model = cases[name][1]
            losses, val = _resume(MPI.COMM_SELF, ckpt[name], **model)
            _close(losses, ref[name][0][2:], f"{name} at pp1")
            _close(val, ref[name][1], f"{name} val at pp1")
            exported = export_full(ckpt[name], os.path.join(tmp, f"{name}-export"))
            meta = read_meta(exported)
            assert meta["mesh"] == {"tp": 1, "dp": 1} and sorted(meta["files"]) == expected_files(1, 1)
            assert meta["exported_from"]["pp"] == 2 and "stage" not in meta["params"]["tok_embed.weight"]
            losses, val = _resume(MPI.COMM_SELF, exported, **model)
            _close(losses, ref[name][0][2:], f"{name} exported")
            _close(val, ref[name][1], f"{name} val exported")
        with open(os.path.join(tmp, "ref.json"), "w") as f:
            json.dump({name: ref[name][1] for name in cases}, f)
    world.Barrier()


def _worker_load_model(tmp):
    """load_model at pp 1 reads every stage's files (generation and HF export use it)."""
    from mpi4py import MPI

    ctx = cutp.init(comm=MPI.COMM_WORLD, tp=MPI.COMM_WORLD.Get_size())
    model, meta = load_model(os.path.join(tmp, "tp2pp2"), ctx)
    assert meta["mesh"]["pp"] == 2 and model.first_stage and model.last_stage
    full = load_model(os.path.join(tmp, "tp2pp2-export"), ctx)[0]
    for p, q in zip(model.parameters(), full.parameters()):
        assert p.name == q.name and np.array_equal(ctx.to_numpy(p.data), ctx.to_numpy(q.data)), p.name
    # Hugging Face export and import of a pipeline checkpoint (the untied one: GPT-2 has no GQA)
    model = load_model(os.path.join(tmp, "zero"), ctx)[0]
    save_hf_gpt2(model, os.path.join(tmp, "hf"))
    back = from_hf_gpt2(ctx, os.path.join(tmp, "hf"), dtype="float64")
    for p, q in zip(model.parameters(), back.parameters()):
        assert p.name == q.name and np.array_equal(ctx.to_numpy(p.data), ctx.to_numpy(q.data)), p.name
    ctx.close()


def test_pipeline_checkpoints_resume_reshard_export_and_verify(tmp_path, capsys):
    tmp = str(tmp_path)
    run_mpi(4, "tests.checkpoint.test_pipeline_checkpoints:_worker", tmp, timeout=240)
    ckpt = os.path.join(tmp, "tp2pp2", "step-00000002")
    meta = read_meta(ckpt)
    assert meta["mesh"] == {"tp": 2, "dp": 1, "pp": 2, "pp_layers": [2, 2]}
    assert sorted(meta["files"]) == sorted(set(os.listdir(ckpt)) - {"meta.json"}) == expected_files(2, 1, 2)
    assert "model-pp01-of-02-tp00-of-02.safetensors" in meta["files"] and len(meta["files"]) == 8
    stages = {name: info.get("stage") for name, info in meta["params"].items()}
    assert stages["tok_embed.weight"] == 0 and stages["layers.1.attn.qkv.weight"] == 0 and stages["layers.2.attn_norm.weight"] == 1
    assert stages["final_norm.weight"] == 1 and len(meta["rng"]["stages"]) == 2
    zero = read_meta(os.path.join(tmp, "zero", "step-00000002"))
    assert "optim-pp01-of-02-tp00-of-01-dp01-of-02.safetensors" in zero["files"]
    assert zero["params"]["lm_head.weight"]["stage"] == 1
    run_mpi(2, "tests.checkpoint.test_pipeline_checkpoints:_worker_load_model", tmp, timeout=120)

    # verify: a tampered stage file is named
    assert ckpt_main(["verify", ckpt]) == 0
    bad = os.path.join(tmp, "bad")
    shutil.copytree(ckpt, bad)
    target = os.path.join(bad, "model-pp01-of-02-tp01-of-02.safetensors")
    with open(target, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        b = f.read(1)
        f.seek(-8, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    capsys.readouterr()
    assert ckpt_main(["verify", bad]) == 1
    out = capsys.readouterr().out
    assert "model-pp01-of-02-tp01-of-02.safetensors is corrupted" in out and "DAMAGED" in out and "pp 2" in out
    with pytest.raises(CheckpointError, match="export refuses|corrupted"):
        export_full(bad, os.path.join(tmp, "bad-export"))

    # meta.json's pipeline fields are checked like the rest, even when sealed again
    original = json.load(open(os.path.join(ckpt, "meta.json")))
    edits = {
        "mesh.pp is 10000000": lambda m: m["mesh"].update(pp=10**7),
        "mesh.pp_layers is \\[2\\]": lambda m: m["mesh"].update(pp_layers=[2]),
        "mesh.pp_layers: pp_layers 1,1": lambda m: m["mesh"].update(pp_layers=[1, 1]),
        "parameter .layers.0.attn_norm.weight.: stage 1 is not the stage that holds it": lambda m: m["params"]["layers.0.attn_norm.weight"].update(stage=1),
        "parameter .final_norm.weight.: stage 0 is not the stage that holds it": lambda m: m["params"]["final_norm.weight"].pop("stage"),
        "it lists 6 files, but mesh.tp 2 x mesh.pp 2": lambda m: m["files"].pop("model-pp01-of-02-tp01-of-02.safetensors")
        and m["files"].pop("optim-pp01-of-02-tp01-of-02.safetensors"),
        "rng.stages must hold integer offsets for each of the pp=1 stages": lambda m: m["mesh"].update(pp=1),
        "rng.stages must hold integer offsets for each of the pp=2": lambda m: m["rng"]["stages"].pop(),
        "it lists 8 files, but mesh.tp 2 with 1 optimizer shard.s. means 4": lambda m: m["mesh"].update(pp=1)
        or m["rng"].pop("stages"),
    }
    edited = os.path.join(tmp, "edited")
    shutil.copytree(ckpt, edited)
    for message, edit in edits.items():
        meta = json.loads(json.dumps(original))
        edit(meta)
        write_meta(os.path.join(edited, "meta.json"), {k: v for k, v in meta.items() if k != "meta_sha256"})
        with pytest.raises(CheckpointError, match="malformed: " + message):
            read_meta(edited)


def test_train_gpt_resumes_a_pipeline_run_bit_identically(tmp_path):
    """The script: --pp 2 --tp 2 --out with --save-every, --resume at the same mesh (the losses and
    the final checkpoint's every file, weights and moments, are the same bits) and on one rank."""
    base = ["--preset", "tiny", "--dtype", "float64", "--seq-len", "16", "--batch-size", "4", "--eval-every", "0",
            "--quiet", "--set", "n_layer=2", "--dropout", "0.1", "--micro-batch-size", "1"]
    args = base + ["--tp", "2", "--pp", "2"]
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    run, rerun = tmp_path / "run", tmp_path / "rerun"
    run_mpi(4, "tests.acceptance.test_mixed_precision:_worker_two_mains", str(tmp_path / "h.json"), [  # one launch
        ("run", args + ["--steps", "4", "--save-every", "2", "--keep", "0", "--out", str(run), "--metrics", str(full)]),
        ("resume", args + ["--steps", "4", "--resume", str(run / "step-00000002"), "--out", str(rerun),
                           "--metrics", str(part)])], timeout=240)
    read = lambda p: [json.loads(line) for line in open(p)]  # noqa: E731
    a, b = read(full)[2:], read(part)
    assert [r["step"] for r in b] == [3, 4] and [r["loss"] for r in a] == [r["loss"] for r in b], (a, b)
    names = sorted(os.listdir(run / "step-00000004"))
    assert names == sorted(os.listdir(rerun / "step-00000004")) and len(names) == 9
    for name in names:
        if name != "meta.json":
            assert (run / "step-00000004" / name).read_bytes() == (rerun / "step-00000004" / name).read_bytes(), name
    # and on one rank (dropout draws by position: the same masks at every layout)
    one = tmp_path / "one.jsonl"
    run_mpi(1, "examples.train_gpt:main", base + ["--steps", "4", "--resume", str(run / "step-00000002"),
                                                  "--metrics", str(one)], timeout=120)
    np.testing.assert_allclose([r["loss"] for r in read(one)], [r["loss"] for r in a], rtol=1e-10, atol=0)


# ---- --init-from into pipeline stages -----------------------------------------------------------
def _worker_init_from(tmp):
    from mpi4py import MPI

    from cutp.train import resolve_run_config
    from tests.tp_utils import self_ctx

    world = MPI.COMM_WORLD
    hf, data = os.path.join(tmp, "hf"), os.path.join(tmp, "data.txt")
    if world.Get_rank() == 0:
        with open(data, "w") as f:
            f.write("def read_config(path):\n    return open(path).read()\n" * 60)
        model = GPT(self_ctx(), GPTConfig(n_layer=4, n_head=2, n_embd=16, vocab_size=300, block_size=32), seed=5)
        save_hf_gpt2(model, hf)  # (random initial weights, as GPT-2's files hold them)
    world.Barrier()

    def losses(comm, **mesh):
        cfg = resolve_run_config(comm, init_from=hf, dtype="float64", steps=3, batch_size=4, micro_batch_size=1,
                                 seq_len=16, data=data, eval_every=0, quiet=True, dropout=0.1, **mesh)
        run = build_run(cfg, comm)
        try:
            out = [train_step(run).loss for _ in range(3)]
            if cfg.out:
                save(run)
            return out
        finally:
            run.close()

    got = {"pp2": losses(world, pp=2, out=os.path.join(tmp, "pp2")), "pp2v2": losses(world, pp=2, pp_virtual=2)}
    if world.Get_rank() == 0:
        ref = losses(MPI.COMM_SELF)
        for name, ls in got.items():
            _close(ls, ref, name)
    world.Barrier()


def test_init_from_hugging_face_into_pipeline_stages_and_generation_at_pp1(tmp_path):
    """Fine-tuning from GPT-2 files at pp 2 (and V = 2 chunks) gives pp 1's losses; examples/generate.py
    asked for --pp 2 says it loads the pipeline checkpoint at pp 1, and samples what one rank does."""
    run_mpi(2, "tests.checkpoint.test_pipeline_checkpoints:_worker_init_from", str(tmp_path), timeout=180)
    ckpt = os.path.join(tmp_path, "pp2")
    argv = ["--ckpt", ckpt, "--device", "cpu", "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--temperature",
            "0", "--print-ids"]
    two = run_mpi(2, GENERATE, argv + ["--pp", "2"], timeout=120)
    one = run_mpi(1, GENERATE, argv, timeout=120)
    assert "note: --pp 2: generation runs the whole model on every TP group" in two.stdout, two.stdout
    assert "loaded at pp 1, tp 2" in two.stdout
    ids = [line for line in two.stdout.splitlines() if line.startswith("ids:")]
    assert len(ids) == 1 and ids == [line for line in one.stdout.splitlines() if line.startswith("ids:")], (
        two.stdout, one.stdout)
