"""Generation (cutp/generate.py), the tokenizers (cutp/data/tokenizer.py) and examples/generate.py.

Generation: the KV-cached path equals recomputing the whole sequence every step; every rank
draws the same tokens; the same seed gives the same tokens at TP=1, 2 and 4 (float64, GQA
included); sampling follows softmax(logits / T) restricted to the top k; requests past
block_size are refused. Tokenizers: GPT-2's byte-level BPE from a small vocab.json + merges.txt
built here, through the `tokenizers` library (hand-checked encodings; against transformers'
GPT2Tokenizer when it is installed), the byte tokenizer, and the choice between them. The example script runs end to
end at 2 ranks on the golden fixture (ids) and on an exported model with a tokenizer (text).
"""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cutp.runtime.errors import ConfigError
from cutp.generate import generate, sample_next
from cutp.models import GPT, GPTConfig
from cutp.data.tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer
from tests.data.tokenizer_files import bytes_to_unicode
from tests.mpirun import ROOT, find_mpiexec, run_mpi
from tests.tp_utils import group_ctx, self_ctx

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf_gpt2_tiny")
NEEDS_TOKENIZERS = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="the tokenizers library is not installed (pip install tokenizers)")

# a float64 model whose next-token distributions are neither flat nor one-hot
GEN_CFG = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, vocab_size=37, block_size=24, dtype="float64",
               vocab_multiple=1)


def _gen_model(ctx, cfg=None, seed=1, scale=6.0):
    cfg = GPTConfig(**(cfg or GEN_CFG))
    model = GPT(ctx, cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for p in model.parameters():  # TP-independent: the same full (unpadded) tensor, sharded
        shape = (cfg.vocab_size,) + p.full_shape[1:] if p.name in ("tok_embed.weight", "lm_head.weight") else p.full_shape
        full = rng.standard_normal(shape) * 0.02 * scale + (1.0 if p.name.endswith("attn_norm.weight") else 0.0)
        model.load_full_state_dict({p.name: full}, strict=False)
    return model


# ---- generation at TP=1 --------------------------------------------------------------------------
def test_cache_equals_no_cache_and_sampling_is_seeded():
    ctx = self_ctx()
    model = _gen_model(ctx)
    prompt = [1, 2, 3, 36]
    for kw in (dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(top_k=1)):
        a = generate(model, prompt, 20, seed=5, **kw)
        b = generate(model, prompt, 20, seed=5, use_cache=False, **kw)
        assert a == b, (kw, a, b)
        assert len(a) == 20 and all(0 <= t < 37 for t in a)
    greedy = generate(model, prompt, 20, temperature=0)
    assert generate(model, prompt, 20, top_k=1, seed=9) == greedy  # top-1 sampling is greedy
    s5, s6 = generate(model, prompt, 20, seed=5), generate(model, prompt, 20, seed=6)
    assert s5 == generate(model, prompt, 20, seed=5) and s5 != s6 and s5 != greedy
    # a batch: greedy rows equal each row alone; sampled rows are seeded as a whole
    rows = generate(model, [[1, 2, 3], [4, 5, 6]], 6, temperature=0)
    assert rows == [generate(model, [1, 2, 3], 6, temperature=0), generate(model, [4, 5, 6], 6, temperature=0)]
    assert generate(model, [[1, 2, 3], [4, 5, 6]], 6, seed=2) == generate(model, np.array([[1, 2, 3], [4, 5, 6]]), 6,
                                                                        seed=2, use_cache=False)
    # stop_token: the output ends at its first occurrence (kept)
    stop = greedy[3]
    assert generate(model, prompt, 20, temperature=0, stop_token=stop) == greedy[: greedy.index(stop) + 1]
    assert generate(model, prompt, 0) == []
    assert model.training  # restored
    model.eval()
    assert generate(model, prompt, 3, temperature=0) == greedy[:3] and not model.training


def test_cache_equals_no_cache_with_normalized_queries_and_keys():
    """Qwen3's and Gemma 3's qk_norm: the cached path normalizes each new position's q and k as the
    full forward does."""
    model = _gen_model(self_ctx(), dict(GEN_CFG, qk_norm=True))
    norms = [p for p in model.parameters() if p.name.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * GEN_CFG["n_layer"]
    rng = np.random.default_rng(3)
    model.load_full_state_dict({p.name: 1.0 + 0.5 * rng.standard_normal(p.full_shape) for p in norms}, strict=False)
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=4)):
        a = generate(model, [1, 2, 3, 36], 10, **kw)
        assert a == generate(model, [1, 2, 3, 36], 10, use_cache=False, **kw), kw
        assert len(set(a)) > 1  # (a sequence, not one token repeated)


def test_block_size_and_argument_errors():
    ctx = self_ctx()
    model = _gen_model(ctx)
    assert len(generate(model, list(range(20)), 4, temperature=0)) == 4  # exactly block_size (24)
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ max_new_tokens \(5\) = 25 exceeds the model's "
                                         r"block_size \(24\); use at most 4 new tokens"):
        generate(model, list(range(20)), 5)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [], 3)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        generate(model, [1], 3, temperature=-1)
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        generate(model, [1], 3, top_k=0)
    with pytest.raises(ValueError, match=r"token id 37 is outside the vocabulary \[0, 37\)"):
        generate(model, [1, 37], 3)
    with pytest.raises(ValueError, match=r"^prompt_ids must be a list of ids or a \[batch, seq\] array, got shape "
                                         r"\(1, 1, 2\)$"):
        generate(model, [[[1, 2]]], 3)
    with pytest.raises(ValueError, match="^prompt_ids must be integers, got dtype float64$"):
        generate(model, [1.0, 2.0], 3)
    with pytest.raises(ValueError, match="^max_new_tokens must be an integer >= 0, got -1$"):
        generate(model, [1], -1)


def test_a_draw_at_the_top_of_the_distribution_lands_on_the_last_token_kept():
    """u = r * total rounds to the total for r close to 1: the search then passes the last
    token, masked here by top_k; the draw steps back to the last token kept."""
    class Top:
        def random(self, n):
            return np.ones(n)

    logits = np.array([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    assert sample_next(logits, Top(), top_k=2).tolist() == [2, 3]


def test_sample_next_follows_softmax_and_top_k():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0]]) + 1e-300)
    rng = np.random.default_rng(0)
    draws = np.array([sample_next(logits, rng)[0] for _ in range(20000)])
    freq = np.bincount(draws, minlength=6) / draws.size
    assert np.allclose(freq, [0.5, 0.2, 0.15, 0.1, 0.05, 0.0], atol=0.015), freq
    draws = np.array([sample_next(logits, rng, top_k=2)[0] for _ in range(5000)])
    freq = np.bincount(draws, minlength=6) / draws.size
    assert set(np.unique(draws)) == {0, 1} and abs(freq[0] - 0.5 / 0.7) < 0.03, freq
    # temperature sharpens: T=0.5 squares the probabilities (renormalised)
    draws = np.array([sample_next(logits, rng, temperature=0.5)[0] for _ in range(20000)])
    p2 = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0.0]) ** 2
    assert np.allclose(np.bincount(draws, minlength=6) / draws.size, p2 / p2.sum(), atol=0.015)
    assert list(sample_next(np.array([[0.0, 3.0, 1.0], [5.0, 0.0, 5.0]]), rng, temperature=0)) == [1, 0]


# ---- generation at TP=2 and 4: identical tokens on every rank and at every TP size ----------------
def _worker_generate_tp(cases):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    for cfg in cases:
        results = {}
        for n in (1, 2, 4):
            ctx, sub = group_ctx(n)
            model = _gen_model(ctx, cfg)
            out = [generate(model, [1, 2, 3, 36], 16, seed=11),
                   generate(model, [[5, 6], [7, 8]], 8, temperature=0.8, top_k=6, seed=3),
                   generate(model, [1, 2, 3, 36], 16, temperature=0)]
            if n == 2:  # the cache is sharded by heads; without it the whole sequence is recomputed
                assert generate(model, [1, 2, 3, 36], 16, seed=11, use_cache=False) == out[0]
            results[n] = out
            ctx.close()
        mine = json.dumps(results, sort_keys=True)
        every = world.allgather(mine)  # every rank, every TP size
        assert all(e == mine for e in every), f"ranks disagree: {every}"
        assert results[1] == results[2] == results[4], results
        assert results[1][0] != results[1][2]  # sampling did not degenerate to greedy


def test_same_tokens_every_rank_and_tp_1_2_4():
    gqa_replicated = dict(GEN_CFG, n_kv_head=2)  # at TP=4 each KV head lives on 2 ranks
    mha_padded = dict(GEN_CFG, n_kv_head=None, vocab_multiple=8, tie_embeddings=False)  # vocab 37 -> padded
    run_mpi(4, "tests.models.test_generate:_worker_generate_tp", [gqa_replicated, mha_padded], timeout=120)


# ---- tokenizers ----------------------------------------------------------------------------------
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l"), ("o", "w"), ("ll", "ow"), ("e", "r"), ("Ġ", "l"),
          ("Ġl", "ow"), ("Ġlow", "er")]


def _write_tokenizer(d, merges=MERGES):
    """vocab.json: the 256 byte tokens (id = byte value), one id per merge, then <|endoftext|>."""
    be = bytes_to_unicode()
    vocab = {be[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(d, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return len(vocab)


def test_bytes_to_unicode():
    be = bytes_to_unicode()
    assert len(be) == 256 and len(set(be.values())) == 256
    assert be[ord("A")] == "A" and be[ord(" ")] == "Ġ" and be[ord("\n")] == "Ċ"
    assert all(c.isprintable() and not c.isspace() for c in be.values())


@NEEDS_TOKENIZERS
def test_bpe_encodings_checked_by_hand(tmp_path):
    """GPT-2's vocab.json + merges.txt through the tokenizers library: the ids worked out by hand."""
    n = _write_tokenizer(str(tmp_path))
    tok = HFTokenizer.from_dir(str(tmp_path))
    assert tok.vocab_size == n == 267 and tok.eos_id == 266
    cases = {
        "the lower hello": [116, 257, 265, 32, 257, 259, 111],  # "t" "he" | "Ġlower" | "Ġ" "he" "ll" "o"
        "  the": [32, 258],  # \s+(?!\S) leaves the last space to " the"
        "it's 123!": [105, 116, 39, 115, 32, 49, 50, 51, 33],
        "héllo": [104, 0xC3, 0xA9, 259, 111],  # é is a letter: one pre-token, two bytes
        "hi<|endoftext|>the": [104, 105, 266, 116, 257],
        "a\n\nb": [97, 10, 10, 98],
        "": [],
    }
    for text, ids in cases.items():
        assert tok.encode(text) == ids, (text, tok.encode(text))
        assert tok.decode(ids) == text
    assert tok.decode([0xC3]) == "\ufffd"  # half a character
    with pytest.raises(ValueError, match="token id 999 is not in the tokenizer's vocabulary"):
        tok.decode([999])


@NEEDS_TOKENIZERS
def test_bpe_matches_transformers_gpt2tokenizer(tmp_path):
    try:
        from transformers import GPT2Tokenizer
    except ImportError:
        pytest.skip("transformers not installed; the hand-checked encodings cover the algorithm")
    merges = MERGES + [("i", "n"), ("Ġ", "w"), ("Ġw", "or"), ("o", "r"), ("Ġ", "a"), ("a", "n"), ("Ġ", "Ġ"),
                       ("ĠĠ", "ĠĠ"), ("Ã", "©"), ("e", "s"), ("Ġt", "es")]
    _write_tokenizer(str(tmp_path), merges)
    ours = HFTokenizer.from_dir(str(tmp_path))
    hf = GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    rng = np.random.default_rng(1)
    alphabet = list("the lower world and in test orés  \n\t,.!?'0123456789") + ["'s", "'ll", "é", "€", "三", "😀",
                                                                                 "<|endoftext|>", "    "]
    texts = ["".join(rng.choice(alphabet, rng.integers(1, 40))) for _ in range(300)]
    for t in texts:
        ids = ours.encode(t)
        assert ids == hf.encode(t), t
        assert ours.decode(ids) == hf.decode(ids, clean_up_tokenization_spaces=False) == t


@NEEDS_TOKENIZERS
def test_byte_tokenizer_and_get_tokenizer(tmp_path):
    bt = ByteTokenizer()
    assert bt.encode("hé") == [104, 0xC3, 0xA9] and bt.decode([104, 0xC3, 0xA9]) == "hé"
    assert bt.decode([104, 0xC3]) == "h\ufffd"
    with pytest.raises(ValueError, match="token id 256 is not a byte"):
        bt.decode([256])
    assert isinstance(get_tokenizer(None, 256), ByteTokenizer)
    assert isinstance(get_tokenizer(FIXTURE, 256), ByteTokenizer)  # no tokenizer files there
    with pytest.raises(ConfigError, match=r"no tokenizer for a vocabulary of 101 tokens.*--prompt-ids"):
        get_tokenizer(FIXTURE, 101)
    _write_tokenizer(str(tmp_path))
    assert isinstance(get_tokenizer(str(tmp_path), 300), HFTokenizer)
    with pytest.raises(ConfigError, match="has ids up to 266, but the model's vocabulary has 101 tokens"):
        get_tokenizer(str(tmp_path), 101)


# ---- examples/generate.py ------------------------------------------------------------------------
def _run_example(nranks, *args, timeout=60):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH="")
    cmd = [find_mpiexec(), "-n", str(nranks), sys.executable, os.path.join(ROOT, "examples", "generate.py"), *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_example_script_fixture_ids_two_ranks():
    from cutp.hf import from_hf_gpt2

    out = _run_example(2, "--ckpt", FIXTURE, "--tp", "2", "--device", "cpu", "--prompt-ids", "1,2,3",
                       "--max-new-tokens", "12", "--temperature", "0.9", "--top-k", "20", "--seed", "4",
                       "--print-ids")
    lines = out.strip().splitlines()
    assert len(lines) == 2, out  # printed by rank 0 only
    ref = generate(from_hf_gpt2(self_ctx(), FIXTURE), [1, 2, 3], 12, temperature=0.9, top_k=20, seed=4)
    assert lines[0] == ",".join(map(str, [1, 2, 3] + ref)) and lines[1] == "ids:" + ",".join(map(str, ref)), out


@NEEDS_TOKENIZERS
def test_example_script_text_prompt_two_ranks(tmp_path):
    from cutp.hf import from_hf_gpt2, save_hf_gpt2

    n = _write_tokenizer(str(tmp_path))
    ctx = self_ctx()
    save_hf_gpt2(_gen_model(ctx, dict(n_layer=1, n_head=2, n_embd=16, vocab_size=n, block_size=32), scale=3.0),
                 None, str(tmp_path))
    out = _run_example(2, "--ckpt", str(tmp_path), "--device", "cpu", "--prompt", "the lower", "--max-new-tokens",
                       "10", "--seed", "1", "--dtype", "float64", "--print-ids")
    tok = HFTokenizer.from_dir(str(tmp_path))
    prompt = tok.encode("the lower")
    ref = generate(from_hf_gpt2(ctx, str(tmp_path), dtype="float64"), prompt, 10, seed=1)
    text, ids = out.rstrip("\n").rsplit("\n", 1)
    assert ids == "ids:" + ",".join(map(str, ref)) and text == tok.decode(prompt + ref), out


def _load_example_module():
    spec = importlib.util.spec_from_file_location("cutp_example_generate", os.path.join(ROOT, "examples",
                                                                                         "generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_cutp_checkpoint_two_ranks(tmp_path):
    """A cutp run directory (byte-level `tiny`-style model, saved at TP=1) sampled at TP=2 with a text prompt."""
    mod = _load_example_module()
    assert not mod.is_cutp_checkpoint(FIXTURE)
    ctx = self_ctx()
    try:
        from cutp.checkpoint import save_checkpoint
    except ImportError:  # the example then names the missing function
        (tmp_path / "meta.json").write_text("{}")
        assert mod.is_cutp_checkpoint(str(tmp_path))
        with pytest.raises(ImportError, match="cutp.checkpoint.load_model is not available"):
            mod.load(str(tmp_path), ctx, "float32")
        return
    cfg = dict(n_layer=1, n_head=4, n_embd=16, vocab_size=256, block_size=32, dtype="float64", vocab_multiple=1)
    model = _gen_model(ctx, cfg, scale=3.0)
    save_checkpoint(str(tmp_path), 7, model)
    assert mod.is_cutp_checkpoint(str(tmp_path))  # the run directory (latest / step-*)
    out = _run_example(2, "--ckpt", str(tmp_path), "--tp", "2", "--device", "cpu", "--prompt", "héllo",
                       "--max-new-tokens", "12", "--seed", "3", "--temperature", "0.8", "--print-ids")
    prompt = list("héllo".encode())
    ref = generate(model, prompt, 12, seed=3, temperature=0.8)
    text, ids = out.rstrip("\n").rsplit("\n", 1)
    assert ids == "ids:" + ",".join(map(str, ref)), out
    assert text == ByteTokenizer().decode(prompt + ref), out


def test_example_arguments():
    mod = _load_example_module()
    args = mod.parse_args(["--ckpt", "x", "--prompt-ids", "1,2", "--top-k", "3"])
    assert args.prompt_ids == "1,2" and args.top_k == 3 and args.prompt is None and args.device == "auto"
    with pytest.raises(SystemExit):
        mod.parse_args(["--ckpt", "x", "--prompt", "a", "--prompt-ids", "1"])  # one or the other


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "500"], "prompt (2 tokens) + --max-new-tokens (500) = 502 exceeds the model's block_size "
                                  "(32); use at most 30 new tokens or a shorter prompt"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0, got -1"),
    (["--top-k", "0"], "--top-k must be >= 1 (the tokens sampled from), got 0; omit it to sample from every token"),
    (["--prompt-ids", "1,999,3"], "--prompt-ids: token id 999 is outside the model's vocabulary [0, 101); use ids "
                                  "below 101"),
    (["--prompt-ids", ","], "--prompt-ids holds no token; give a prompt of at least one"),
    (["--tokenizer", "nope"], "--tokenizer nope: no such directory with tokenizer.json (or vocab.json + merges.txt); "
                              "give one, or 'bytes' for the byte tokenizer"),  # was ignored: byte tokens
])
def test_example_refuses_a_bad_argument_in_one_line(args, message):
    """Each was a ValueError traceback from cutp.generate (or, for --tokenizer, silently ignored)
    (found by a review helper, F5)."""
    mod = _load_example_module()
    with pytest.raises(ConfigError) as e:
        mod.main(["--ckpt", FIXTURE, "--device", "cpu", "--prompt-ids", "1,2", *args])
    assert str(e.value) == message


def test_example_prints_a_refusal_once_on_two_ranks():
    """The line is printed by one rank, exit status 2, no traceback (argparse's error printed the
    usage block on every rank)."""
    for bad in (["--temperature", "-1"], ["--prompt-ids", "1,999"]):  # before the model, and after it loads
        cmd = [find_mpiexec(), "-n", "2", sys.executable, os.path.join(ROOT, "examples", "generate.py"), "--ckpt",
               FIXTURE, "--device", "cpu", "--prompt-ids", "1,2", *bad]
        r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                           timeout=60)
        lines = (r.stdout + r.stderr).strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("generate.py: error: "), (r.returncode,
                                                                                                      lines)
