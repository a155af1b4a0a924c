"""Issue 16, what a Hugging Face or nanoGPT user expects (no network: the Hugging Face
directories are written by cutp's own save_hf_gpt2, the tokenizer files by hand):

1. forward(idx) pads the vocabulary with -inf logits; GPT.gather_logits gives [..., vocab_size];
2. from_hf_gpt2 returns the model in eval mode (as transformers' from_pretrained);
3. transformers 5 directories: tokenizer.json alone, sharded weights (model.safetensors.index.json);
4. fine-tuning from an HF directory or a cutp checkpoint: resolve_run_config(init_from=DIR),
   train_gpt.py --init-from;
5. examples/generate.py: greedy (--temperature 0), stop at <|endoftext|>, --no-stop, --stop-token.
"""
import importlib.util
import json
import os

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from cutp import ConfigError, train
from cutp.generate import generate
from cutp.hf import HFFormatError, from_hf_gpt2, load_hf_gpt2, save_hf_gpt2
from cutp.models import GPT, GPTConfig
from cutp.data.tokenizer import HFTokenizer, get_tokenizer
from tests.data.tokenizer_files import bytes_to_unicode
from tests.mpirun import ROOT, run_mpi
from tests.tp_utils import self_ctx

MERGES = [("h", "e"), ("Ġ", "l"), ("l", "l"), ("Ġl", "o"), ("Ġlo", "w"), ("e", "r"), ("Ġlow", "er")]


def _random_model(ctx, seed=3, **kw):
    cfg = GPTConfig(**{**dict(n_layer=1, n_head=2, n_embd=16, vocab_size=300, block_size=32), **kw})
    model = GPT(ctx, cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for p in model.parameters():  # the same full tensors at any TP size
        shape = (cfg.vocab_size,) + p.full_shape[1:] if p.name in ("tok_embed.weight", "lm_head.weight") else p.full_shape
        model.load_full_state_dict({p.name: rng.standard_normal(shape).astype(p.data.dtype) * 0.3}, strict=False)
    return model


def _vocab(merges=MERGES):
    be = bytes_to_unicode()
    vocab = {be[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return vocab


def _write_tokenizer_json(d, list_merges=False, **model_extra):
    """A tokenizers-library tokenizer.json as transformers 5 writes GPT-2's (no vocab.json/merges.txt)."""
    vocab = _vocab()
    eot = len(vocab)
    merges = [[a, b] if list_merges else f"{a} {b}" for a, b in MERGES]
    spec = {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": eot, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": True, "special": True}],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges, **model_extra}}
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    return eot


def _shard(d, split_after=3):
    """Rewrites d/model.safetensors as two shards and model.safetensors.index.json (as save_pretrained
    does for a large model)."""
    with safe_open(os.path.join(d, "model.safetensors"), framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[:split_after],
             "model-00002-of-00002.safetensors": names[split_after:]}
    for fname, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(d, fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    os.remove(os.path.join(d, "model.safetensors"))
    return index


# ---- 1. logits ------------------------------------------------------------------------------------
def test_forward_logits_padding_is_minus_inf_and_gather_logits_tp1():
    ctx = self_ctx()
    model = _random_model(ctx, vocab_size=101).eval()
    idx = np.array([[1, 2, 3, 100], [5, 6, 7, 8]])
    targets = np.array([[2, 3, 100, 4], [6, 7, 8, 9]])
    loss_before = model.forward(idx, targets)
    shard = model.forward(idx)
    assert shard.shape == (2, 4, 128)
    assert np.all(shard[..., 101:] == -np.inf) and np.all(np.isfinite(shard[..., :101]))
    full = model.gather_logits(shard)
    assert full.shape == (2, 4, 101) and np.array_equal(full, shard[..., :101])
    assert model.gather_logits(shard, rank=0) is not None
    # the loss is that of the real vocabulary, and computing logits changed nothing
    lp = full.astype(np.float64) - np.log(np.exp(full.astype(np.float64)).sum(-1, keepdims=True))
    ref = -np.take_along_axis(lp, targets[..., None], -1).mean()
    assert abs(model.forward(idx, targets) - ref) < 1e-5 and model.forward(idx, targets) == loss_before
    with pytest.raises(ValueError, match="columns"):
        model.gather_logits(full)


# ---- 2. from_hf_gpt2 in eval mode -------------------------------------------------------------------
def test_from_hf_gpt2_returns_eval_mode(tmp_path):
    ctx = self_ctx()
    save_hf_gpt2(_random_model(ctx), str(tmp_path))
    model = from_hf_gpt2(ctx, str(tmp_path), dropout=0.5)
    assert not any(m.training for m in model.modules())
    idx = np.array([[1, 2, 3]])
    assert np.array_equal(model.forward(idx), model.forward(idx))  # no dropout
    with pytest.raises(RuntimeError, match="model.train()"):  # nothing kept for backward in eval mode
        model.forward(idx, idx)
        model.backward()
    model.train()  # fine-tuning
    model.forward(idx, idx)
    model.backward()
    assert np.any(model.tok_embed.weight.grad != 0)


# ---- 3. transformers 5 directories --------------------------------------------------------------------
NEEDS_TOKENIZERS = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="the tokenizers library is not installed (pip install tokenizers)")


@NEEDS_TOKENIZERS
@pytest.mark.parametrize("list_merges", [False, True])
def test_tokenizer_json_alone(tmp_path, list_merges):
    eot = _write_tokenizer_json(str(tmp_path), list_merges=list_merges)
    tok = get_tokenizer(str(tmp_path), 300)
    assert isinstance(tok, HFTokenizer) and tok.eos_id == eot == 263
    # the same encoder as vocab.json + merges.txt
    slow_dir = tmp_path / "slow"
    slow_dir.mkdir()
    (slow_dir / "vocab.json").write_text(json.dumps({**_vocab(), "<|endoftext|>": eot}, ensure_ascii=False),
                                         encoding="utf-8")
    (slow_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES),
                                         encoding="utf-8")
    slow = get_tokenizer(str(slow_dir), 300)
    for text in ("the lower hello", "  the", "it's 123!", "héllo<|endoftext|>lower"):
        assert tok.encode(text) == slow.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hello lower<|endoftext|>") == [256, 258, 111, 262, eot]  # he ll o Ġlower


@NEEDS_TOKENIZERS
def test_tokenizer_json_the_library_cannot_read_is_refused(tmp_path):
    """Any model type, normalizer or subword prefix is the library's to run; a file it cannot
    read (an unknown model type; merges that make it panic) is refused in one line naming it."""
    _write_tokenizer_json(str(tmp_path), type="NoSuchModel")
    with pytest.raises(ConfigError, match=f"{tmp_path}: the tokenizers library cannot read its tokenizer"):
        get_tokenizer(str(tmp_path), 300)
    _write_tokenizer_json(str(tmp_path), continuing_subword_prefix="##")  # merges without the prefix
    with pytest.raises(ConfigError, match="the tokenizers library cannot read its tokenizer"):
        get_tokenizer(str(tmp_path), 300)


def test_sharded_safetensors(tmp_path):
    ctx = self_ctx()
    d = str(tmp_path / "hf")
    for tie in (True, False):
        save_hf_gpt2(_random_model(ctx, tie_embeddings=tie), d)
        want = load_hf_gpt2(d)[1]
        index = _shard(d)
        got = load_hf_gpt2(d)[1]
        assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
    model = from_hf_gpt2(ctx, d)
    assert np.array_equal(model.gather_state_dict()["lm_head.weight"], want["lm_head.weight"])

    def refused(weight_map, match):
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": weight_map}, f)
        with pytest.raises(HFFormatError, match=match):
            load_hf_gpt2(d)

    wm = index["weight_map"]
    k0 = sorted(wm)[0]
    open(tmp_path / "outside.safetensors", "wb").close()
    refused({**wm, k0: "../outside.safetensors"}, "not a file name inside")
    refused({**wm, k0: str(tmp_path / "outside.safetensors")}, "not a file name inside")
    refused({**wm, k0: "model-00003-of-00002.safetensors"}, "does not exist")
    other = "model-00002-of-00002.safetensors" if wm[k0] != "model-00002-of-00002.safetensors" else \
        "model-00001-of-00002.safetensors"
    refused({**wm, k0: other}, f"holds {k0}")
    refused({}, "weight_map")


# ---- 5. examples/generate.py ---------------------------------------------------------------------
def _load_example(name):
    spec = importlib.util.spec_from_file_location(f"cutp_example_{name}", os.path.join(ROOT, "examples", name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@NEEDS_TOKENIZERS
def test_generate_script_tokenizer_json_sharded_greedy_stops_at_eot(tmp_path, capsys):
    d = str(tmp_path)
    eot = _write_tokenizer_json(d)
    ctx = self_ctx()
    model = _random_model(ctx, vocab_size=eot + 1, tie_embeddings=False)
    tok = HFTokenizer.from_dir(d)
    prompt = tok.encode("hello")
    # <|endoftext|> made the argmax where the third greedy token was (or sooner)
    head = model.gather_state_dict()["lm_head.weight"]
    head[eot] = 1.5 * head[generate(model, prompt, 3, temperature=0)[2]]
    model.load_full_state_dict({"lm_head.weight": head}, strict=False)
    save_hf_gpt2(model, d)
    _shard(d)
    mod = _load_example("generate.py")
    common = ["--ckpt", d, "--device", "cpu", "--prompt", "hello", "--temperature", "0", "--print-ids",
              "--max-new-tokens", "6", "--dtype", "float64"]
    greedy = generate(from_hf_gpt2(ctx, d, dtype="float64"), prompt, 6, temperature=0)
    assert eot in greedy[1:], greedy

    def run(*extra):
        mod.main(common + list(extra))
        text, ids = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
        new = [int(i) for i in ids[len("ids:"):].split(",")]
        assert text == tok.decode(prompt + new)  # the prompt, then its continuation
        return new

    assert run() == run("--seed", "7") == greedy[: greedy.index(eot) + 1]  # greedy: the seed changes nothing
    assert run("--stop-token", str(greedy[0])) == greedy[:1]
    assert run("--no-stop") == greedy
    with pytest.raises(ConfigError, match=r"--stop-token 9999 is outside the model's vocabulary"):
        mod.main(common + ["--stop-token", "9999"])
    with pytest.raises(SystemExit):
        mod.main(common + ["--stop-token", "3", "--no-stop"])


# ---- 4. fine-tuning: init_from -------------------------------------------------------------------
def _data(path):
    with open(path, "w") as f:
        f.write("def read_config(path):\n    return open(path).read()\n" * 60)
    return path


def test_init_from_config_errors(tmp_path):
    ctx = self_ctx()
    d = str(tmp_path / "hf")
    save_hf_gpt2(_random_model(ctx), d)
    data = _data(str(tmp_path / "data.txt"))
    cfg = train.resolve_run_config(init_from=d, tp=1, data=data, dropout=0.1, dtype="float64", set=["vocab_multiple=1"])
    assert (cfg.model.n_layer, cfg.model.vocab_size, cfg.model.dropout, cfg.model.dtype, cfg.init_from, cfg.preset) \
        == (1, 300, 0.1, "float64", d, None)
    assert cfg.checkpoint_settings()["init_from"] == d
    mod = _load_example("train_gpt.py")
    args = vars(mod.parse_args(["--init-from", d, "--set", "n_layer=2", "--set", "dropout=0.2"]))
    with pytest.raises(ConfigError, match=r"preset/set change the model of init_from .*n_layer 1 \(flags: 2\)"):
        train.resolve_run_config(source="command line", **args)
    with pytest.raises(ConfigError, match="n_embd 16 .flags: 128"):
        train.resolve_run_config(init_from=d, preset="tiny")
    with pytest.raises(ConfigError, match="give only one of them"):
        train.resolve_run_config(init_from=d, resume=d)
    with pytest.raises(ConfigError, match="not a directory"):
        train.resolve_run_config(init_from=str(tmp_path / "nothing"))


def _worker_init_from(tmpdir):
    from cutp.tensor_parallel.mappings import gather_from_tp_forward
    import cutp

    ctx = cutp.init(tp=2, device="cpu")
    # 1. at tp 2: rank 1's shard of the padded vocabulary (300 -> 512) ends in -inf columns
    model = _random_model(ctx).eval()
    idx = np.array([[1, 2, 299, 4]])
    shard = model.forward(idx)
    assert shard.shape == (1, 4, 256)
    real = 256 if ctx.tp_rank == 0 else 300 - 256
    assert np.all(np.isfinite(shard[..., :real])) and np.all(shard[..., real:] == -np.inf)
    full = model.gather_logits(shard)
    assert full.shape == (1, 4, 300) and np.array_equal(full, gather_from_tp_forward(ctx.tp, shard)[..., :300])
    on0 = model.gather_logits(shard, rank=0)
    assert (on0 is None) == (ctx.tp_rank == 1) and (on0 is None or np.array_equal(on0, full))

    # 4. fine-tune from an HF directory at tp 2
    data = os.path.join(tmpdir, "data.txt")
    if ctx.rank == 0:
        _data(data)
    hf = os.path.join(tmpdir, "hf")
    save_hf_gpt2(model, hf)
    out = os.path.join(tmpdir, "run")
    cfg = train.resolve_run_config(init_from=hf, tp=2, steps=2, batch_size=2, seq_len=16, lr=1e-2, out=out,
                                   data=data, eval_every=0)
    run = train.build_run(cfg)
    assert run.step == 0 and run.model.training
    loaded = from_hf_gpt2(run.ctx, hf)
    (x, y), = run.sampler.micro_batches(0)
    direct = loaded.forward(x, y)
    first = train.train_step(run)
    assert first.loss == direct, (first.loss, direct)
    second = train.train_step(run)
    assert np.isfinite(second.loss) and second.loss != first.loss and run.step == 2
    train.save(run)
    weights = run.model.gather_state_dict(rank=None)
    run.close()

    # ... and from the cutp run directory it wrote: its weights, step 0
    cfg2 = train.resolve_run_config(init_from=out, tp=2, steps=1, batch_size=2, seq_len=16,
                                    data=data, eval_every=0)
    run2 = train.build_run(cfg2)
    assert run2.step == 0 and cfg2.init_from.endswith("step-00000002")
    again = run2.model.gather_state_dict(rank=None)
    assert all(np.array_equal(again[k], weights[k]) for k in weights)
    run2.close()
    ctx.close()


def test_init_from_hf_and_cutp_checkpoint_tp2(tmp_path):
    run_mpi(2, "tests.acceptance.test_hugging_face_user:_worker_init_from", str(tmp_path), timeout=120)
