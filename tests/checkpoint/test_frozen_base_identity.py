"""A LoRA / --freeze run's frozen base is the run's base, found from anywhere (cutp.checkpoint.base_identity).

Its checkpoints record the base's absolute path and a fingerprint of its weights; a resume, a
`--resume --init-from` and an `export-hf` refuse a directory holding other weights (another
model of the same shapes put where the base was) in one line naming both directories and the
fix, and take the base found elsewhere. A checkpoint of older cutp (a relative path, no
fingerprint) still loads from where its run started. An export that cannot find the run's
tokenizer says which recorded path is missing instead of claiming byte-level data.
"""
import json
import os
import shutil

import numpy as np
import pytest
from mpi4py import MPI
from safetensors.numpy import load_file

import cutp
from cutp.bench.model import random_tokens
from cutp.checkpoint import read_meta, save_checkpoint
from cutp.checkpoint.base_identity import BASE_SHA256, FULL_HASH_BYTES, base_fingerprint
from cutp.checkpoint.export_hf import export_hf, main
from cutp.checkpoint.files import write_meta
from cutp.hf import save_hf
from cutp.models import GPT, GPTConfig
from cutp.models.hf import config_from_hf
from cutp.models.hf_files import read_hf_config
from cutp.runtime.errors import ConfigError
from cutp.train import RunConfig, build_run, resolve_run_config, train_step
from cutp.train.step import save

TINY = dict(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, mlp_hidden=24, vocab_size=97, block_size=16,
            dtype="float64", dropout=0.0, norm="rmsnorm", positions="rope", mlp="swiglu", bias=False,
            tie_embeddings=False, norm_eps=1e-5)


def _write_base(path, seed):
    ctx = cutp.init(comm=MPI.COMM_SELF, device="cpu")
    save_hf(GPT(ctx, GPTConfig(**TINY), seed=seed), str(path))
    ctx.close()


def _lora_run(tmp_path, init_from):
    """One LoRA step from the Hugging Face base `init_from` (as given: maybe relative), saved."""
    model = config_from_hf(read_hf_config(init_from), dtype="float64")
    cfg = RunConfig(model=model, init_from=init_from, batch_size=2, micro_batch_size=2, seq_len=8, steps=2,
                    warmup=1, lr=3e-2, seed=3, eval_every=0, quiet=True, save_on_signal=False,
                    out=str(tmp_path / "run"), lora_rank=2, lora_alpha=4.0)
    run = build_run(cfg, MPI.COMM_SELF, dataset=random_tokens(97, 1024, 0))
    train_step(run)
    path = save(run)
    run.close()
    return path


def test_the_checkpoint_records_the_bases_absolute_path_and_fingerprint(tmp_path, monkeypatch):
    _write_base(tmp_path / "base", seed=7)
    monkeypatch.chdir(tmp_path)
    ckpt = _lora_run(tmp_path, "base")  # (typed relative)
    args = read_meta(ckpt)["train_args"]
    assert args["init_from"] == str(tmp_path / "base")
    assert args[BASE_SHA256] == base_fingerprint(str(tmp_path / "base"))
    # from another directory, the export finds that base
    monkeypatch.chdir(tmp_path / "run")
    export_hf(ckpt, str(tmp_path / "hf"))
    base, exported = load_file(str(tmp_path / "base" / "model.safetensors")), load_file(
        str(tmp_path / "hf" / "model.safetensors"))
    assert all(np.array_equal(exported[k], base[k]) for k in base)


def test_a_base_replaced_by_other_weights_is_refused_by_resume_and_export(tmp_path, capsys):
    _write_base(tmp_path / "base", seed=7)
    ckpt = _lora_run(tmp_path, str(tmp_path / "base"))
    shutil.copytree(tmp_path / "base", tmp_path / "kept")
    shutil.rmtree(tmp_path / "base")
    _write_base(tmp_path / "base", seed=8)  # another model, the same shapes, where the base was
    base = str(tmp_path / "base")
    assert main([ckpt, "--out", str(tmp_path / "merged"), "--merge-lora"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"frozen base {base} " in err[0] and f"{base} now holds other weights" in err[0] \
        and "put the run's base back" in err[0], err
    assert not (tmp_path / "merged").exists()
    with pytest.raises(ConfigError, match=f"now holds other weights .*: give the directory that holds the run's "
                                          "base as init_from together with resume"):
        resolve_run_config(MPI.COMM_SELF, resume=ckpt, device="cpu")
    other = str(tmp_path / "other")
    shutil.copytree(base, other)
    with pytest.raises(ConfigError, match=f"frozen base {base} .*, but {other} holds other weights"):
        resolve_run_config(MPI.COMM_SELF, resume=ckpt, init_from=other, device="cpu")
    # the run's base, found where it was kept: accepted, and the run's next checkpoints record it
    kept = str(tmp_path / "kept")
    assert resolve_run_config(MPI.COMM_SELF, resume=ckpt, init_from=kept, device="cpu").init_from == kept


def test_an_older_checkpoints_relative_base_loads_from_where_its_run_started(tmp_path, monkeypatch):
    _write_base(tmp_path / "base", seed=7)
    ckpt = _lora_run(tmp_path, str(tmp_path / "base"))
    meta = read_meta(ckpt)  # as cutp before fingerprints wrote it: the path as typed, no fingerprint
    meta["train_args"] = {**{k: v for k, v in meta["train_args"].items() if k != BASE_SHA256}, "init_from": "base"}
    write_meta(os.path.join(ckpt, "meta.json"), {k: v for k, v in meta.items() if k != "meta_sha256"})
    monkeypatch.chdir(tmp_path)
    export_hf(ckpt, str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path / "run")
    with pytest.raises(ConfigError, match="the run's init_from base, is gone .a relative path, found from the "
                                          "directory the run was started in"):
        export_hf(ckpt, str(tmp_path / "hf2"))
    with pytest.raises(ConfigError, match="its frozen base base is not a directory .moved or deleted; a relative "
                                          "path, found from the directory the run was started in.: give the"):
        resolve_run_config(MPI.COMM_SELF, resume=ckpt, device="cpu")


def test_a_large_bases_fingerprint_reads_spread_blocks_and_still_tells_same_shaped_models_apart(tmp_path, monkeypatch):
    _write_base(tmp_path / "a", seed=7)
    _write_base(tmp_path / "b", seed=8)
    monkeypatch.setattr("cutp.checkpoint.base_identity.FULL_HASH_BYTES", 1024)  # (the tiny files: "large")
    monkeypatch.setattr("cutp.checkpoint.base_identity._BLOCK", 8)  # (8 KiB of 8-byte blocks: a sample of them)
    assert os.path.getsize(tmp_path / "a" / "model.safetensors") > 1024 < FULL_HASH_BYTES
    assert base_fingerprint(str(tmp_path / "a")) != base_fingerprint(str(tmp_path / "b"))
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    assert base_fingerprint(str(tmp_path / "a")) == base_fingerprint(str(tmp_path / "c"))


def test_an_export_whose_recorded_data_is_not_found_says_so_not_byte_level(tmp_path, capsys):
    ctx = cutp.init(comm=MPI.COMM_SELF, device="cpu")
    model = GPT(ctx, GPTConfig.preset("tiny", n_layer=1), seed=1)
    save_checkpoint(str(tmp_path / "run"), 1, model, train_args={"data": "data/sft", "init_from": None})
    ctx.close()
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "byte-level" not in said[0] and "data/sft, recorded by the run, not found" in said[0] \
        and "export from the directory the run was started in" in said[0], said
    assert json.load(open(tmp_path / "export" / "config.json"))["architectures"] == ["GPT2LMHeadModel"]
