"""Hugging Face GPT-2 interop (cutp/hf.py).

(a) the committed golden fixture (a random GPT2LMHeadModel saved by transformers, with torch's
    logits and loss: tests/fixtures/make_hf_gpt2_fixture.py) loaded at TP=1, 2 and 4 gives the
    reference logits (relative 1e-5 of max |logit|) and loss (1e-5); no torch needed;
(b) export -> import is bitwise exact at TP=1 and from a TP=2 (x DP=2) model, and writes what
    save_pretrained writes (the fixture's own keys, shapes and config);
(c) with torch + transformers installed, a live comparison both ways (else skipped);
(d) clear errors for what cannot be read or written.
"""
import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

import cutp
from cutp.hf import (HFFormatError, check_state_dict, config_from_hf, config_to_hf, from_hf_gpt2, load_hf_gpt2,
                     load_hf_into, save_hf_gpt2)
from cutp.models import GPT, GPTConfig
from cutp.tensor_parallel.mappings import gather_from_tp_forward
from tests.mpirun import run_mpi
from tests.tp_utils import group_ctx, rel_err, self_ctx

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(HERE, "fixtures", "hf_gpt2_tiny")
REFERENCE = os.path.join(HERE, "fixtures", "hf_gpt2_tiny_reference.safetensors")
TOL = 1e-5


def _reference():
    from safetensors.numpy import load_file

    return load_file(REFERENCE)


def _logits_and_loss(model, idx, targets):
    """Full (gathered, unpadded) logits and the loss of a model, eval mode."""
    model.eval()
    logits = gather_from_tp_forward(model.ctx.tp, model.forward(idx))[..., : model.config.vocab_size]
    loss = model.forward(idx, targets)
    return np.asarray(model.ctx.to_numpy(logits)), loss


def _check_against_reference(model, what):
    ref = _reference()
    logits, loss = _logits_and_loss(model, ref["idx"], ref["targets"])
    e = rel_err(logits, ref["logits"])
    assert e <= TOL, f"{what}: logits differ from transformers' by {e:.2e} (relative to max |logit|)"
    assert abs(loss - float(ref["loss"])) <= TOL, f"{what}: loss {loss!r} vs transformers' {float(ref['loss'])!r}"


def _random_model(ctx, seed=3, **kw):
    """A random float32 GPT whose biases and LayerNorm parameters are not at their init values."""
    cfg = GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=32, vocab_size=101, block_size=32), **kw})
    model = GPT(ctx, cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for p in model.parameters():  # the same full (unpadded) tensors at any TP size
        shape = (cfg.vocab_size,) + p.full_shape[1:] if p.name in ("tok_embed.weight", "lm_head.weight") else p.full_shape
        full = rng.standard_normal(shape).astype(p.data.dtype) * 0.1
        model.load_full_state_dict({p.name: full}, strict=False)
    return model


def _assert_bitwise(a: dict, b: dict, what):
    assert sorted(a) == sorted(b), f"{what}: names differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k, a[k].dtype, b[k].dtype)
        assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), f"{what}: {k} is not bitwise equal"


# ---- (a) the golden fixture at TP=1, 2, 4 --------------------------------------------------------
def test_fixture_matches_transformers_tp1():
    ctx = self_ctx()
    _check_against_reference(from_hf_gpt2(ctx, FIXTURE), "tp=1 float32")
    _check_against_reference(from_hf_gpt2(ctx, FIXTURE, dtype="float64"), "tp=1 float64")
    cfg, sd = load_hf_gpt2(FIXTURE)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size, cfg.gelu, cfg.tie_embeddings,
            cfg.mlp_hidden, cfg.norm_eps, cfg.dropout) == (2, 4, 32, 32, 101, "tanh", True, None, 1e-5, 0.0)
    assert "lm_head.weight" not in sd and all(a.dtype == np.float32 for a in sd.values())


def _worker_fixture_tp(tmpdir):
    from mpi4py import MPI

    for n in (2, 4):
        ctx, sub = group_ctx(n)
        model = from_hf_gpt2(ctx, FIXTURE)
        _check_against_reference(model, f"tp={n}")
        # every TP rank computes the same loss, bit for bit
        loss = _logits_and_loss(model, _reference()["idx"], _reference()["targets"])[1]
        allv = ctx.tp.all_gather(np.array([loss]))
        assert np.all(allv == allv[0]), allv
        ctx.close()

    # (b) export from a TP=2 x DP=2 model: gathered over TP, written once (world rank 0)
    ctx = cutp.init(tp=2, dp=2, device="cpu")
    for tie in (True, False):
        model = _random_model(ctx, tie_embeddings=tie, mlp_hidden=48, gelu="none", norm_eps=1e-6)
        out = os.path.join(tmpdir, f"tp2-tie{tie}")
        save_hf_gpt2(model, None, out)
        assert os.path.isfile(os.path.join(out, "model.safetensors"))  # on every rank once it returns
        assert not [f for f in os.listdir(out) if f.startswith(".")], os.listdir(out)
        want = model.gather_state_dict(rank=None)
        cfg, got = load_hf_gpt2(out)
        _assert_bitwise(got, want, f"tp=2 export tie={tie}")
        assert (cfg.mlp_hidden, cfg.gelu, cfg.norm_eps, cfg.tie_embeddings) == (48, "none", 1e-6, tie)
        # and back into a TP=2 model: the same shards
        again = from_hf_gpt2(ctx, out)
        for p, q in zip(model.parameters(), again.parameters()):
            assert p.name == q.name and np.array_equal(p.data, q.data), p.name
    # a failure to write on rank 0 reaches every rank (no hang)
    blocker = os.path.join(tmpdir, "a-file")
    if ctx.rank == 0:
        open(blocker, "w").close()
    MPI.COMM_WORLD.Barrier()
    with pytest.raises((OSError, RuntimeError)):
        save_hf_gpt2(model, None, blocker)
    ctx.close()


def test_fixture_tp2_tp4_and_export_from_tp2(tmp_path):
    run_mpi(4, "tests.models.test_hf:_worker_fixture_tp", str(tmp_path), timeout=120)


# ---- (b) round trip at TP=1, and the files are what save_pretrained writes ------------------------
@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=False, mlp_hidden=40, gelu="none", norm_eps=1e-6),
                                dict(dtype="float64")])
def test_round_trip_tp1_bitwise(tmp_path, kw):
    ctx = self_ctx()
    model = _random_model(ctx, **kw)
    save_hf_gpt2(model, None, str(tmp_path))
    cfg, got = load_hf_gpt2(str(tmp_path), dtype=model.config.dtype)
    _assert_bitwise(got, model.gather_state_dict(), f"tp=1 {kw}")
    for f in ("mlp_hidden", "gelu", "norm_eps", "tie_embeddings", "vocab_size", "block_size", "n_embd"):
        assert getattr(cfg, f) == getattr(model.config, f), f
    # the state-dict form writes the same thing
    save_hf_gpt2(model.gather_state_dict(), model.config, str(tmp_path / "sd"))
    _assert_bitwise(load_hf_gpt2(str(tmp_path / "sd"), dtype=model.config.dtype)[1], got, "state dict export")
    # load_hf_into an existing model of the same shape
    other = GPT(ctx, model.config, seed=99)
    load_hf_into(other, str(tmp_path))
    _assert_bitwise(other.gather_state_dict(), got, "load_hf_into")


def test_export_writes_what_save_pretrained_writes(tmp_path):
    from safetensors import safe_open

    ctx = self_ctx()
    save_hf_gpt2(from_hf_gpt2(ctx, FIXTURE), None, str(tmp_path))
    with safe_open(os.path.join(FIXTURE, "model.safetensors"), "numpy") as a, \
            safe_open(str(tmp_path / "model.safetensors"), "numpy") as b:
        assert sorted(a.keys()) == sorted(b.keys())  # transformer.-prefixed, no tied lm_head
        assert b.metadata() == {"format": "pt"}
        for k in a.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), k
    with open(os.path.join(FIXTURE, "config.json")) as f:
        theirs = json.load(f)
    with open(tmp_path / "config.json") as f:
        ours = json.load(f)
    assert set(theirs) - set(ours) == {"transformers_version"}, set(theirs) ^ set(ours)
    for k in theirs:
        if k != "transformers_version":
            assert ours[k] == theirs[k], (k, ours[k], theirs[k])


def test_reads_prefixless_keys_buffers_and_tied_head_fp16_bf16(tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    cfg_ref, ref = load_hf_gpt2(FIXTURE)
    raw = load_file(os.path.join(FIXTURE, "model.safetensors"))
    # the original `gpt2` upload: GPT2Model keys (no prefix), attention buffers, an equal lm_head
    legacy = {k[len("transformer."):]: v for k, v in raw.items()}
    legacy["h.0.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
    legacy["h.1.attn.masked_bias"] = np.array(-1e4, np.float32)
    legacy["lm_head.weight"] = raw["transformer.wte.weight"].copy()
    d = tmp_path / "legacy"
    d.mkdir()
    shutil.copy(os.path.join(FIXTURE, "config.json"), d / "config.json")
    save_file(legacy, str(d / "model.safetensors"))
    _assert_bitwise(load_hf_gpt2(str(d))[1], ref, "legacy layout")
    # a tied head that differs is refused
    legacy["lm_head.weight"] = legacy["lm_head.weight"] + 1
    save_file(legacy, str(d / "model.safetensors"))
    with pytest.raises(HFFormatError, match="lm_head.weight differs from wte.weight"):
        load_hf_gpt2(str(d))
    # the same tensor with and without the prefix is ambiguous
    legacy["lm_head.weight"] = raw["transformer.wte.weight"]
    legacy["transformer.ln_f.bias"] = raw["transformer.ln_f.bias"]
    save_file(legacy, str(d / "model.safetensors"))
    with pytest.raises(HFFormatError, match=r"ln_f\.bias appears twice"):
        load_hf_gpt2(str(d))
    # half-precision checkpoints are converted to float32 (or float64)
    for half in (np.float16, ml_dtypes.bfloat16):
        save_file({k: v.astype(half) for k, v in raw.items()}, str(d / "model.safetensors"))
        for dt in ("float32", "float64"):
            got = load_hf_gpt2(str(d), dtype=dt)[1]
            for k, v in ref.items():
                assert got[k].dtype == np.dtype(dt) and np.array_equal(got[k], v.astype(half).astype(dt)), k


# ---- (c) live comparison with transformers ------------------------------------------------------
def _torch_transformers():
    try:
        import torch
        import transformers
    except ImportError:
        pytest.skip("torch/transformers not installed; the committed golden fixture covers the comparison")
    return torch, transformers


def test_live_comparison_with_transformers(tmp_path):
    torch, transformers = _torch_transformers()
    from tests.fixtures.make_hf_gpt2_fixture import build_model, reference_outputs

    ctx = self_ctx()
    config = dict(n_layer=2, n_head=2, n_embd=16, n_positions=12, vocab_size=37, n_inner=24,
                  activation_function="gelu", layer_norm_epsilon=1e-6, tie_word_embeddings=False,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = build_model(torch, transformers, config, seed=7)
    hf.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, 37, (3, 12)), rng.integers(0, 37, (3, 12))
    ref_logits, ref_loss = reference_outputs(torch, hf, idx, tgt)
    model = from_hf_gpt2(ctx, str(tmp_path / "hf"))
    logits, loss = _logits_and_loss(model, idx, tgt)
    assert rel_err(logits, ref_logits) <= TOL and abs(loss - ref_loss) <= TOL, (rel_err(logits, ref_logits), loss)

    # and the other way: transformers loads cutp's export with no missing/unexpected keys
    for kw in (dict(), dict(tie_embeddings=False, gelu="none", mlp_hidden=40)):
        ours = _random_model(ctx, **kw)
        save_hf_gpt2(ours, None, str(tmp_path / "ours"))
        back, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "ours"), output_loading_info=True)
        assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
        back.eval()
        idx = rng.integers(0, 101, (2, 10))
        with torch.no_grad():
            theirs = back(torch.as_tensor(idx)).logits.float().numpy()
        mine = _logits_and_loss(ours, idx, idx)[0]
        assert rel_err(mine, theirs) <= TOL, (kw, rel_err(mine, theirs))


# ---- (d) errors --------------------------------------------------------------------------------
def _copy_fixture(tmp_path, edit_config=None, edit_tensors=None):
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, d)
    if edit_config:
        with open(d / "config.json") as f:
            c = json.load(f)
        edit_config(c)
        with open(d / "config.json", "w") as f:
            json.dump(c, f)
    if edit_tensors:
        t = load_file(str(d / "model.safetensors"))
        edit_tensors(t)
        save_file(t, str(d / "model.safetensors"))
    return str(d)


def test_errors_missing_files(tmp_path):
    with pytest.raises(HFFormatError, match="is not a directory"):
        load_hf_gpt2(str(tmp_path / "nowhere"))
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(HFFormatError, match="config.json not found"):
        load_hf_gpt2(str(d))
    shutil.copy(os.path.join(FIXTURE, "config.json"), d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(HFFormatError, match=r"model.safetensors not found.*pytorch_model.bin"):
        load_hf_gpt2(str(d))
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HFFormatError, match="not a readable safetensors file"):
        load_hf_gpt2(str(d))
    (d / "config.json").write_text("{")
    with pytest.raises(HFFormatError, match="not valid JSON"):
        load_hf_gpt2(str(d))


def test_errors_shapes_and_keys(tmp_path):
    def bad_shape(t):
        t["transformer.h.1.mlp.c_fc.weight"] = t["transformer.h.1.mlp.c_fc.weight"][:, :100]

    with pytest.raises(HFFormatError, match=r"h\.1\.mlp\.c_fc\.weight has shape \(32, 100\).*needs \(32, 128\)"):
        load_hf_gpt2(_copy_fixture(tmp_path, edit_tensors=bad_shape))
    shutil.rmtree(tmp_path / "ckpt")

    def wrong_vocab(c):
        c["vocab_size"] = 100

    with pytest.raises(HFFormatError, match=r"wte\.weight has shape \(101, 32\).*needs \(100, 32\)"):
        load_hf_gpt2(_copy_fixture(tmp_path, edit_config=wrong_vocab))
    shutil.rmtree(tmp_path / "ckpt")

    def drop_and_add(t):
        del t["transformer.ln_f.bias"]
        t["transformer.h.0.attn.q_proj.weight"] = np.zeros((2, 2), np.float32)

    with pytest.raises(HFFormatError, match=r"missing \['ln_f\.bias'\], unexpected \['h\.0\.attn\.q_proj\.weight'\]"):
        load_hf_gpt2(_copy_fixture(tmp_path, edit_tensors=drop_and_add))
    shutil.rmtree(tmp_path / "ckpt")

    def untie(c):
        c["tie_word_embeddings"] = False

    with pytest.raises(HFFormatError, match=r"missing \['lm_head\.weight'\]"):
        load_hf_gpt2(_copy_fixture(tmp_path, edit_config=untie))
    shutil.rmtree(tmp_path / "ckpt")

    def int_tensor(t):
        t["transformer.ln_f.bias"] = np.zeros(32, np.int32)

    with pytest.raises(HFFormatError, match=r"transformer\.ln_f\.bias has dtype I32"):
        load_hf_gpt2(_copy_fixture(tmp_path, edit_tensors=int_tensor))

    with pytest.raises(HFFormatError, match=r"final_norm.weight has shape \(3,\)"):  # (a state dict: cutp's names)
        cfg, sd = load_hf_gpt2(FIXTURE)
        check_state_dict(cfg, {**sd, "final_norm.weight": np.zeros(3)})


def test_per_parameter_reads_refuse_a_model_unlike_the_checked_one_and_tied_heads_compare_whole(tmp_path):
    from safetensors.numpy import save_file

    from cutp.models.hf import _same_tensor, hf_shards

    ctx = self_ctx()
    model = GPT(ctx, config_from_hf(json.load(open(os.path.join(FIXTURE, "config.json")))), seed=0)
    shard = hf_shards(model, FIXTURE)  # checked now; each parameter read when asked
    p = model.parameters()[0]
    full = load_hf_gpt2(FIXTURE)[1][p.name]
    np.testing.assert_array_equal(shard(p)[:len(full)], full)  # (the vocabulary's rows padded past the file's)
    # (an API caller that reads another model's parameter: each read refuses what it cannot place)
    q = GPT(ctx, dataclasses.replace(model.config, n_embd=64), seed=0).parameters()[0]
    with pytest.raises(HFFormatError, match=rf"^{q.name}: expected full shape \({q.full_shape[0]}, 64\), got \("):
        shard(q)
    p.name = "h.9.extra.weight"
    with pytest.raises(HFFormatError, match=r"^the checkpoint has no tensors for \['h\.9\.extra\.weight'\]$"):
        hf_shards(model, FIXTURE)
    # a tied head compared with the embedding: another shape is another tensor; 0-d tensors whole
    save_file({"a": np.zeros((2, 3), np.float32), "b": np.zeros((3, 2), np.float32), "s": np.array(2.0, np.float32),
               "t": np.array(2.0, np.float32), "u": np.array(3.0, np.float32)}, str(tmp_path / "w.safetensors"))
    w = str(tmp_path / "w.safetensors")
    assert not _same_tensor((w, "a"), (w, "b"))
    assert _same_tensor((w, "s"), (w, "t")) and not _same_tensor((w, "s"), (w, "u"))


def test_errors_unsupported_config():
    base = json.load(open(os.path.join(FIXTURE, "config.json")))
    for edit, pattern in [
        ({"activation_function": "relu"}, r"activation_function 'relu' is not supported"),
        ({"activation_function": "gelu_fast_or_what"}, r"activation_function"),
        ({"scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx=True is not supported"),
        ({"reorder_and_upcast_attn": True}, r"reorder_and_upcast_attn=True is not supported"),
        ({"scale_attn_weights": False}, r"scale_attn_weights=False is not supported"),
        ({"add_cross_attention": True}, r"add_cross_attention=True"),
        ({"model_type": "gpt_neo"}, r"model_type is 'gpt_neo'"),
        ({"n_head": 5}, r"n_embd=32 is not divisible by n_head=5"),
    ]:
        with pytest.raises(HFFormatError, match=pattern):
            config_from_hf({**base, **edit})
    assert config_from_hf({**base, "activation_function": "gelu_pytorch_tanh"}).gelu == "tanh"
    assert config_from_hf({**base, "activation_function": "gelu", "n_inner": 64}).mlp_hidden == 64


def test_errors_export_gqa_and_no_bias(tmp_path):
    ctx = self_ctx()
    gqa = GPT(ctx, GPTConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=16, vocab_size=20, block_size=8))
    with pytest.raises(HFFormatError, match=r"grouped-query attention model \(n_kv_head=2 != n_head=4\) cannot be "
                                            r"exported as GPT-2"):
        save_hf_gpt2(gqa, None, str(tmp_path / "gqa"))
    assert not (tmp_path / "gqa").exists()
    with pytest.raises(HFFormatError, match="bias=False"):
        config_to_hf(GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=20, block_size=8, bias=False))
    with pytest.raises(cutp.ConfigError, match="needs the GPTConfig"):
        save_hf_gpt2({}, None, str(tmp_path / "x"))
    small = GPT(ctx, GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=20, block_size=8))
    with pytest.raises(HFFormatError, match=r"differs from the checkpoint's: n_layer: model 1 vs"):
        load_hf_into(small, FIXTURE)
    with pytest.raises(cutp.ConfigError, match="fixed by the checkpoint"):
        from_hf_gpt2(ctx, FIXTURE, n_layer=3)
