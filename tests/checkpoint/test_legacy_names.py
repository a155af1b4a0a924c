"""Checkpoints written before cutp's neutral parameter names still load, and the names map both ways.

tests/fixtures/checkpoint_gpt2_names is a real checkpoint of that older cutp (commit c9f8201),
written by

    mpiexec -n 2 python examples/train_gpt.py --device cpu --preset tiny --set n_layer=2 \
        --set n_embd=16 --set n_head=2 --set block_size=16 --dp 2 --distributed-optimizer \
        --steps 2 --batch-size 4 --seq-len 16 --out RUN --save-every 2

so its meta.json, model file and two ZeRO optimizer shards (with their offsets metadata) carry
GPT-2's names (wte.weight, h.0.attn.c_attn.weight, ...).
"""
import json
import os
import shutil

import numpy as np
import pytest
from safetensors import safe_open

import cutp
import cutp.hf
from cutp.checkpoint import load_checkpoint, load_model, read_meta, save_checkpoint, verify_checkpoint
from cutp.models import GPT, GPTConfig
from cutp.models.names import from_gpt2, is_gpt2_name, to_gpt2
from cutp.optim import AdamW, FlatParameters
from tests.mpirun import run_mpi

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoint_gpt2_names")
HF_GPT2 = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf_gpt2_tiny")


def _tensors(path):
    with safe_open(path, framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, json.loads((f.metadata() or {}).get("offsets", "{}"))


def test_names_round_trip_for_every_family():
    ctx = cutp.init(tp=1, device="cpu")
    configs = [GPTConfig.preset("tiny", n_layer=2), GPTConfig.preset("llama-tiny", n_layer=2),
               GPTConfig.preset("tiny-moe", n_layer=2)]
    for cfg in configs:
        for p in GPT(ctx, cfg, seed=0).parameters():
            assert not is_gpt2_name(p.name), p.name
            assert from_gpt2(to_gpt2(p.name)) == p.name, p.name
    # a GPT-2 model's names are exactly the ones a GPT2LMHeadModel file holds
    with safe_open(os.path.join(HF_GPT2, "model.safetensors"), framework="numpy") as f:
        hf = {k.removeprefix("transformer.") for k in f.keys() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    cfg = cutp.hf.load_hf_gpt2(HF_GPT2)[0]
    assert {to_gpt2(p.name) for p in GPT(ctx, cfg, seed=0).parameters()} == hf
    ctx.close()


def test_older_checkpoint_reads_under_neutral_names(tmp_path):
    meta = read_meta(FIXTURE)
    assert meta["stored_names"]["tok_embed.weight"] == "wte.weight"
    assert "layers.1.attn.qkv.weight" in meta["params"] and not any(is_gpt2_name(n) for n in meta["params"])
    assert verify_checkpoint(FIXTURE, meta) == []  # the files' GPT-2 names checked through the renaming

    ctx = cutp.init(tp=1, device="cpu")
    model, _ = load_model(FIXTURE, ctx)
    stored, _ = _tensors(os.path.join(FIXTURE, "model-tp00-of-01.safetensors"))
    params = model.named_parameters()
    assert set(params) == {from_gpt2(k) for k in stored}
    for name, p in params.items():
        assert np.array_equal(p.data, stored[to_gpt2(name)]), name

    # the ZeRO state of two DP ranks, put together from the pieces its offsets name
    opt = AdamW(FlatParameters(model.parameters()))
    load_checkpoint(FIXTURE, model, opt)
    assert opt.step_count == 2
    pieces = [_tensors(os.path.join(FIXTURE, f"optim-tp00-of-01-dp{d:02d}-of-02.safetensors")) for d in range(2)]
    state = opt.state_dict()
    for name, p in params.items():
        want = np.zeros(p.data.size, np.float32)
        for tensors, offsets in pieces:
            if to_gpt2(name) in offsets:
                a, b = offsets[to_gpt2(name)]
                want[a:b] = tensors["exp_avg." + to_gpt2(name)]
        assert np.array_equal(state["exp_avg." + name].reshape(-1), want), name
    assert np.any(state["exp_avg.tok_embed.weight"] != 0)

    # saved again: under today's names, and it loads as any checkpoint does
    path = save_checkpoint(str(tmp_path / "run"), 3, model, opt)
    again = read_meta(path)
    assert "stored_names" not in again and "tok_embed.weight" in again["params"]
    other = GPT(ctx, model.config, seed=5)
    load_checkpoint(path, other)
    for name, p in other.named_parameters().items():
        assert np.array_equal(p.data, params[name].data), name
    ctx.close()


def test_older_checkpoint_damage_is_still_found(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURE, ck)
    with open(ck / "model-tp00-of-01.safetensors", "r+b") as f:  # one byte of a tensor
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    problems = verify_checkpoint(str(ck), read_meta(str(ck)))
    assert len(problems) == 1 and "corrupted" in problems[0], problems


def test_resume_from_older_checkpoint_through_the_cli(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run / "step-00000002")
    (run / "latest").write_text(json.dumps({"path": "step-00000002", "step": 2}))
    out = tmp_path / "metrics.jsonl"
    run_mpi(1, "examples.train_gpt:main", ["--device", "cpu", "--resume", str(run), "--steps", "3", "--out", str(run),
                                           "--metrics", str(out)], timeout=120)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "loss" in r] == [3], rows
    assert set(read_meta(str(run / "step-00000003"))["params"]) == set(read_meta(str(run / "step-00000002"))["params"])
