"""Checkpoints at their edges, in one process (issue 41's coverage): a save that cannot create
its directory, write a shard or finish is one agreed CheckpointError and leaves the previous
checkpoint in use; a leftover of a killed save is replaced; a load that cannot use the metadata,
lacks the parameters or optimizer state asked for, or fails reading after verification names it
and loads nothing; files that cannot be opened, listed, named or parsed (after a matching digest)
are named; the run directory's lock under a symlink, a lock file that keeps being replaced, a
damaged checkpoint neither counted nor pruned; `python -m cutp.checkpoint` usage; export's dtype
range and an existing destination; dp-sharded optimizer pieces that do not fit or cover their
tensor; PEFT adapters of a family PEFT names otherwise; a frozen run over its cutp base, and the
base gone; a ZeRO-3 save whose streamed model file fails."""
import dataclasses
import json
import os
import re
import shutil
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cutp.checkpoint import CheckpointError, load_checkpoint, load_model, resolve_checkpoint, save_checkpoint
from cutp.checkpoint import export, files, load, names, run_dir, save
from cutp.checkpoint.adapters import write_peft_adapter
from cutp.checkpoint.files import (StreamedSafetensors, read_meta, unlisted_files, verify_file, write_meta,
                                   write_safetensors)
from cutp.models import GPT, GPTConfig
from cutp.optim import AdamW, FlatParameters
from cutp.optim.sharded import ShardedAdamW
from cutp.runtime.errors import ConfigError
from cutp.tensor_parallel.lora import set_up_trainable
from tests.tp_utils import self_ctx

CFG = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=6)
MODEL = "model-tp00-of-01.safetensors"


@pytest.fixture
def run(tmp_path):
    """(the run directory, its checkpoint of step 1, the model saved)"""
    model = GPT(self_ctx(), CFG, seed=0)
    return str(tmp_path / "run"), save_checkpoint(str(tmp_path / "run"), 1, model), model


def _weights(model):
    return {p.name: np.array(p.data) for p in model.parameters()}


def test_a_save_that_cannot_write_is_one_error_and_the_previous_checkpoint_stays(run, tmp_path, monkeypatch):
    out, first, model = run
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"cannot create checkpoint directory .*file/run/\.tmp-step-00000002: "
                                              "NotADirectoryError: "):
        save_checkpoint(str(tmp_path / "file" / "run"), 2, model)

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(save, "write_safetensors", disk_full)
        with pytest.raises(CheckpointError, match=r"writing checkpoint shards into .*\.tmp-step-00000002 failed on "
                                                  r"rank 0: OSError: \[Errno 28\] No space left on device$"):
            save_checkpoint(out, 2, model)
    with monkeypatch.context() as m:
        m.setattr(save, "write_meta", disk_full)
        with pytest.raises(CheckpointError, match=r"^finishing checkpoint .*step-00000002 failed: OSError: "):
            save_checkpoint(out, 2, model)
    assert resolve_checkpoint(out) == first and not os.path.exists(os.path.join(out, "step-00000002"))
    # the leftover of a killed save is replaced by the next save of that step
    os.makedirs(os.path.join(out, ".tmp-step-00000002"), exist_ok=True)
    with open(os.path.join(out, ".tmp-step-00000002", "junk"), "w") as f:
        f.write("x")
    second = save_checkpoint(out, 2, model)
    assert resolve_checkpoint(out) == second and not os.path.exists(os.path.join(out, ".tmp-step-00000002"))
    assert sorted(os.listdir(second)) == ["meta.json", MODEL]


def test_a_load_that_cannot_be_done_names_why_and_loads_nothing(run, monkeypatch):
    out, ckpt, _ = run
    other = GPT(self_ctx(), CFG, seed=5)
    before = _weights(other)
    with pytest.raises(CheckpointError, match=r"has no optimizer state; it cannot resume training \(load it for "
                                              r"inference or fine-tuning without resume\)"):
        load_checkpoint(ckpt, other, AdamW(FlatParameters(other.parameters())))
    deeper = GPT(self_ctx(), GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=6), seed=0)
    with pytest.raises(CheckpointError, match=r"meta.json lacks parameters \['layers.1\."):
        load_checkpoint(ckpt, deeper, check_config=False)
    wider = GPT(self_ctx(), GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=6), seed=0)
    with pytest.raises(CheckpointError, match=r"reading .* failed on rank 0: CheckpointError: .*: the checkpoint holds "
                                              r"shape \(.*\) for this rank, the model \(.*\) -- nothing was loaded$"):
        load_checkpoint(ckpt, wider, check_config=False)  # (without the config check: the shapes are compared)
    with monkeypatch.context() as m:
        m.setattr(load, "loaded_parameters", lambda model, meta: meta["no such field"])
        with pytest.raises(CheckpointError, match=r"meta.json cannot be used \(KeyError: 'no such field'\) -- "
                                                  "nothing was loaded$"):
            load_checkpoint(ckpt, other)

    def failing_read(self, r, key):  # (a disk error after the files were verified)
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(load.ShardReader, "get", failing_read)
        with pytest.raises(CheckpointError, match=r"reading .* failed on rank 0: OSError: \[Errno 5\] Input/output "
                                                  "error -- nothing was loaded$"):
            load_checkpoint(ckpt, other)
    assert all(np.array_equal(before[k], v) for k, v in _weights(other).items())
    # a shard without a tensor meta.json names (what the file check would have refused before)
    meta = read_meta(ckpt)
    first = next(iter(meta["params"]))
    renamed = dict(meta, params={("x." + k if k == first else k): v for k, v in meta["params"].items()})
    with pytest.raises(CheckpointError, match=rf"^{MODEL} has no tensor 'x.{first}'$"):
        load.ShardReader(ckpt, renamed, "model").get(0, "x." + first)


def test_per_parameter_reads_refuse_a_parameter_the_checkpoint_cannot_place(run):
    _, ckpt, model = run
    shard = load.checkpoint_shards(ckpt, model)  # checked now; each parameter read when asked
    p = model.parameters()[0]
    np.testing.assert_array_equal(shard(p), p.data)
    # (an API caller that reads another model's parameters: what the checkpoint lacks, another shape)
    deeper = GPT(self_ctx(), dataclasses.replace(CFG, n_layer=2), seed=0)
    extra = next(q for q in deeper.parameters() if q.name.startswith("layers.1."))
    with pytest.raises(CheckpointError, match=rf"^{ckpt} does not hold {extra.name}$"):
        shard(extra)
    wide = next(q for q in GPT(self_ctx(), dataclasses.replace(CFG, n_embd=16), seed=0).parameters()
                if q.name == p.name)
    with pytest.raises(CheckpointError, match="^" + re.escape(f"{p.name}: the checkpoint holds shape "
                                                              f"{tuple(p.data.shape)} for this rank, the model "
                                                              f"{tuple(wide.data.shape)}") + "$"):
        shard(wide)


def test_init_weights_of_a_model_with_deferred_parameters_load_the_rest_now(run):
    """load_weights (a run's init_from) into a model of which some parameters are deferred (ZeRO-3's
    model: their draw reads them from the files later) and some not (a buffer): those now."""
    _, ckpt, saved = run
    other = GPT(self_ctx(), CFG, seed=5)
    deferred, *rest = other.parameters()
    before = np.array(deferred.data)
    deferred.draw = lambda: None  # (what deferred_parameters sets; load_weights replaces it)
    load.load_weights(other, ckpt)
    want = _weights(saved)
    assert all(np.array_equal(p.data, want[p.name]) for p in rest)
    assert np.array_equal(deferred.data, before)  # not read yet: drawn when the optimizer takes it
    np.testing.assert_array_equal(deferred.draw(), want[deferred.name])


def test_files_that_cannot_be_opened_listed_named_or_parsed_are_named(run, tmp_path):
    out, ckpt, _ = run
    meta = read_meta(ckpt)
    assert verify_file(ckpt, meta, MODEL) is None and unlisted_files(ckpt, meta) == []
    assert verify_file(ckpt, meta, "../model.safetensors") == (
        f"{ckpt}: file name '../model.safetensors' is not a plain file name inside the checkpoint directory; the "
        "metadata was edited or damaged: use another checkpoint")
    assert verify_file(ckpt, meta, "optim-tp00-of-01.safetensors") == (
        f"{ckpt}/optim-tp00-of-01.safetensors: not listed in meta.json (the checkpoint's mesh does not have this shard)")
    assert unlisted_files(str(tmp_path / "gone"), meta) == [f"{tmp_path / 'gone'} cannot be listed (No such file or "
                                                            "directory)"]
    with pytest.raises(CheckpointError, match=r"^.*meta.json/x cannot be opened \(Not a directory\)$"):
        files.open_regular(os.path.join(ckpt, "meta.json", "x"))
    # a header damaged and meta.json's digest and size made to match: the header is still read
    damaged = str(tmp_path / "damaged")
    shutil.copytree(ckpt, damaged)
    path = os.path.join(damaged, MODEL)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"[")
    meta = json.load(open(os.path.join(damaged, "meta.json")))
    meta["files"][MODEL] = {"sha256": files.sha256_file(path), "bytes": os.path.getsize(path)}
    write_meta(os.path.join(damaged, "meta.json"), meta)
    assert verify_file(damaged, read_meta(damaged), MODEL).startswith(
        f"{path} is not a readable safetensors file (")
    # meta.json missing, of another version; 'latest' larger than any cutp writes
    os.remove(os.path.join(damaged, "meta.json"))
    with pytest.raises(CheckpointError, match=rf"^{damaged}/meta.json is missing: {damaged} is not a complete "
                                              "checkpoint$"):
        read_meta(damaged)
    versioned = dict(json.load(open(os.path.join(ckpt, "meta.json"))), version=99)
    write_meta(os.path.join(damaged, "meta.json"), versioned)
    with pytest.raises(CheckpointError, match=r"has format version 99; this cutp reads version \d+$"):
        read_meta(damaged)
    for other, shown in ((dict(versioned, format="other"), "'other'"), ([1, 2], "None")):
        if isinstance(other, dict):
            write_meta(os.path.join(damaged, "meta.json"), other)
        else:
            with open(os.path.join(damaged, "meta.json"), "w") as f:
                json.dump(other, f)
        with pytest.raises(CheckpointError, match=rf"^{damaged}/meta.json is not cutp checkpoint metadata \(format "
                                                  rf"{shown}\)$"):
            read_meta(damaged)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(" " * (1 << 17))
    with pytest.raises(CheckpointError, match=r"latest is malformed or unsafe \(.*latest is 131072 bytes, more than "
                                              r"the 65536 cutp writes; it is not cutp's: use another checkpoint\); "
                                              "pass a step-\\* directory explicitly$"):
        resolve_checkpoint(out)


def test_a_streamed_file_refuses_a_tensor_unlike_its_header_and_closes_only_when_complete_and_is_safetensors(tmp_path):
    w = StreamedSafetensors(str(tmp_path / "s.safetensors"), {"a": ((2, 3), "float32"), "b": ((4,), "float64")},
                            {"format": "x"})
    with pytest.raises(ValueError, match=r"^a: float64 of 48 bytes, the header says float32 of 24$"):
        w.put("a", np.zeros((2, 3)))
    w.put("a", np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"^tensors never written: \['b'\]$"):
        w.close()
    w.put("b", np.arange(4.0))
    w.close()
    assert load_file(str(tmp_path / "s.safetensors"))["b"].tolist() == [0, 1, 2, 3]
    # write_safetensors: safetensors' own bytes, streamed (float tensors with metadata) or through save_file
    floats = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2)}
    write_safetensors(str(tmp_path / "streamed.safetensors"), floats, {"format": "pt"})
    save_file(floats, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    ids = {"ids": np.arange(5, dtype=np.int64)}  # (a dtype checkpoints never hold, or no metadata: save_file's)
    for metadata in (None, {"format": "pt"}):
        write_safetensors(str(tmp_path / "ids.safetensors"), ids, metadata)
        assert load_file(str(tmp_path / "ids.safetensors"))["ids"].tolist() == [0, 1, 2, 3, 4]


def test_the_run_directory_lock_refuses_a_symlink_and_a_file_that_keeps_being_replaced(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(str(tmp_path / "elsewhere"), str(out / run_dir.LOCK_FILE))
    with pytest.raises(ConfigError, match=rf"^out {out}: cannot create its lock file {out / run_dir.LOCK_FILE} "
                                          r"\(Too many levels of symbolic links\); choose a writable directory$"):
        run_dir.lock_run_dir(str(out))
    os.remove(out / run_dir.LOCK_FILE)
    real_stat = os.stat

    def replaced(path, *a, **k):  # the lock file is gone each time we look: its holder removed it
        if str(path).endswith(run_dir.LOCK_FILE):
            raise FileNotFoundError(2, "No such file or directory")
        return real_stat(path, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(run_dir.os, "stat", replaced)
        with pytest.raises(ConfigError, match=r"its lock file .* keeps being replaced; choose another out$"):
            run_dir.lock_run_dir(str(out))
    lock = run_dir.lock_run_dir(str(out))
    os.remove(out / run_dir.LOCK_FILE)  # (removed under it: releasing still drops the lock)
    lock.release()
    assert lock.fd is None
    run_dir.lock_run_dir(str(out)).release()


def test_a_damaged_checkpoint_is_neither_counted_nor_pruned(run):
    out, first, model = run
    second, third = (save_checkpoint(out, s, model) for s in (2, 3))
    with open(os.path.join(second, "meta.json"), "w") as f:
        f.write("{")
    run_dir.prune_checkpoints(out, 1, newest_step=3)
    assert not os.path.exists(first) and os.path.isdir(second) and os.path.isdir(third)


def test_checkpoint_command_usage_export_dtype_range_and_a_taken_destination(run, tmp_path, capsys, monkeypatch):
    out, ckpt, model = run
    assert export.main(["inspect", ckpt]) == 2
    assert capsys.readouterr().err.startswith("usage: python -m cutp.checkpoint export SRC DST [--dtype ")
    with pytest.raises(CheckpointError, match=r"^export --dtype float16: w has values beyond float16's range$"), \
            np.errstate(all="raise"), warnings.catch_warnings():  # (the refusal only: no NumPy warning first)
        warnings.simplefilter("error")
        export.in_dtype(np.array([1.0, 1e6]), "float16", "w")
    assert export.in_dtype(np.array([1.0, np.inf]), "float16", "w")[1] == np.inf  # (already not finite: kept)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    with pytest.raises(CheckpointError, match=rf"^{taken} exists; export refuses to overwrite it$"):
        export.export_full(ckpt, str(taken))
    assert sorted(os.listdir(tmp_path)) == ["run", "taken"] and os.listdir(taken) == ["mine.txt"]  # (no temporary left)
    late = str(tmp_path / "late")
    real_write_meta = export.write_meta

    def made_meanwhile(path, meta):  # another process creates the destination while the copy is written
        real_write_meta(path, meta)
        os.makedirs(late)

    monkeypatch.setattr(export, "write_meta", made_meanwhile)
    with pytest.raises(CheckpointError, match=rf"^{late} exists; export refuses to overwrite it$"):
        export.export_full(ckpt, late)
    assert sorted(os.listdir(tmp_path)) == ["late", "run", "taken"] and not os.listdir(late)


def test_dp_sharded_optimizer_pieces_that_do_not_fit_or_cover_a_tensor_are_named():
    """(the pieces' offsets of a real dp 2 checkpoint, read against a meta.json whose shape is
    another: what a file check cannot see once meta.json and the files disagree so)"""
    fixture = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoint_gpt2_names")
    meta, name = read_meta(fixture), "layers.0.attn.qkv.weight"
    assert load.ShardReader(fixture, meta, "optim").get(0, "exp_avg." + name).shape == (16, 48)
    for rows, problem in ((32, "the optimizer shards of TP rank 0 hold 768 of the 1536 elements of exp_avg." + name),
                          (8, "optim-tp00-of-01-dp00-of-02.safetensors: the piece [0, 768) of exp_avg." + name +
                           " is missing or does not fit")):
        other = json.loads(json.dumps(meta))
        other["params"][name]["full_shape"] = [rows, 48]
        with pytest.raises(CheckpointError) as e:
            load.ShardReader(fixture, other, "optim").get(0, "exp_avg." + name)
        assert str(e.value) == problem
    # both namings of one parameter: the metadata is left as it is, for its checks to name
    with open(os.path.join(fixture, "meta.json")) as f:
        raw = json.load(f)
    both = dict(raw, params={**raw["params"], "tok_embed.weight": raw["params"]["wte.weight"]})
    assert names.stored_names_view(both) is both


def test_peft_adapters_of_a_family_peft_names_otherwise_are_refused_with_the_fix(tmp_path):
    model = GPT(self_ctx(), CFG, seed=0)  # (GPT-2's fused c_attn: PEFT's names are not cutp's q, k, v)
    with pytest.raises(ConfigError, match=r"^PEFT names the adapters of a gpt2 model's fused projections otherwise "
                                          "than cutp's q, k, v, o, gate, up, down: export the run merged with "
                                          "export-hf --merge-lora$"):
        write_peft_adapter(model, {}, "gpt2", str(tmp_path / "adapter"), str(tmp_path))
    assert not (tmp_path / "adapter").exists()


def test_a_frozen_run_loads_over_its_cutp_base_and_is_refused_once_the_base_is_gone(tmp_path):
    base = save_checkpoint(str(tmp_path / "base"), 1, GPT(self_ctx(), CFG, seed=3))
    tuned = GPT(self_ctx(), CFG, seed=4)
    load_checkpoint(base, tuned)
    args = {"init_from": str(tmp_path / "base"), "freeze": "embeddings"}
    set_up_trainable(tuned, args)
    for p in tuned.parameters():
        if p.trainable:
            p.data += 0.5  # (what training changed)
    ckpt = save_checkpoint(str(tmp_path / "tuned"), 2, tuned, train_args=args)
    assert read_meta(ckpt)["trainable_only"] and "tok_embed.weight" not in read_meta(ckpt)["params"]
    loaded, _ = load_model(ckpt, self_ctx())
    want = _weights(tuned)
    assert all(np.array_equal(want[k], v) for k, v in _weights(loaded).items()) and len(want) == len(_weights(loaded))
    assert not loaded.tok_embed.weight.trainable  # (frozen as the run had it)
    shutil.rmtree(tmp_path / "base")
    with pytest.raises(ConfigError, match=rf"^{ckpt} holds only the trainable tensors; its frozen base, the run's "
                                          rf"init_from {tmp_path / 'base'}, is gone: restore that directory to load "
                                          "the run$"):
        load_model(ckpt, self_ctx())


@pytest.mark.parametrize("failing", ["put", "close"])
def test_a_zero_3_save_whose_streamed_model_file_fails_is_one_error_and_writes_nothing(tmp_path, monkeypatch, failing):
    """(ZeRO-3 at dp 1: the model file streamed a unit at a time, as at any dp; its buffer, the
    router's score bias, written first, whole)"""
    cfg = GPTConfig.preset("tiny-moe", n_layer=1, n_embd=16, n_head=2, moe_score_bias=True, moe_scoring="sigmoid",
                           moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0, moe_bias_update_rate=0.001)
    model = GPT(self_ctx(), cfg, seed=0)
    out = str(tmp_path / "run")
    whole = save_checkpoint(out, 1, model)
    opt = ShardedAdamW(model, model.ctx, zero=3)

    class Failing(StreamedSafetensors):  # (the model file's writer only: the optimizer's file is written whole)
        def put(self, name, array):
            if failing == "put" and not name.endswith("score_bias"):
                raise OSError(28, "No space left on device")
            super().put(name, array)

        def close(self):
            raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(save, "StreamedSafetensors", Failing)
        with pytest.raises(CheckpointError, match=r"writing checkpoint shards into .*\.tmp-step-00000002 failed on "
                                                  r"rank 0: OSError: \[Errno 28\] No space left on device$"):
            save_checkpoint(out, 2, model, opt, by_unit=True)
    assert resolve_checkpoint(out) == whole
    with monkeypatch.context() as m:  # (an invariant: the model file's writer leads the groups ZeRO-3 shards over)
        m.setattr(opt, "leads_its_groups", lambda: False)
        with pytest.raises(CheckpointError, match=r"^rank 0 writes the model file but is not rank 0 of the groups "
                                                  r"ZeRO-3 shards over \(a bug\)"):
            save_checkpoint(out, 2, model, opt, by_unit=True)
    assert resolve_checkpoint(out) == whole
    streamed = save_checkpoint(out, 2, model, opt, by_unit=True)
    with open(os.path.join(streamed, MODEL), "rb") as a, open(os.path.join(whole, MODEL), "rb") as b:
        assert a.read() == b.read()  # (the same bytes as the whole model written at once)
    # `latest` names the step written (not the last parameter streamed): a run resumes by its directory
    assert os.path.basename(streamed) == "step-00000002" and resolve_checkpoint(out) == streamed
    assert json.loads((tmp_path / "run" / "latest").read_text())["path"] == "step-00000002"


def test_load_model_with_its_arguments_swapped_says_the_order(tmp_path):
    """load_model(ckpt, ctx) and from_hf(ctx, dir) take them the other way round: swapped, one
    TypeError naming the order (was AttributeError: 'str' object has no attribute 'world')."""
    ctx = self_ctx()
    with pytest.raises(TypeError, match=r"^load_model takes the checkpoint first, then the context"):
        load_model(ctx, str(tmp_path))
