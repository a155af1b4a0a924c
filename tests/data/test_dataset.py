"""Data sources, the mesh-independent batch sampler, default mesh choice and the metrics plot."""
import json
import os

import numpy as np
import pytest

from cutp.data import BatchSampler, default_corpus, load_dataset
from cutp.runtime.errors import ConfigError
from cutp.models import GPTConfig
from tests.mpirun import run_mpi


def test_default_corpus_is_the_stdlib_split_by_file():
    d = default_corpus(max_bytes=1 << 20)
    assert d.vocab_size == 256 and "standard library" in d.description
    assert len(d.train) > 8 * len(d.val) / 2 > 0
    text = bytes(d.train[:20000]).decode("utf-8", "replace")
    assert "def " in text or "import " in text
    d2 = default_corpus(max_bytes=1 << 20)
    assert np.array_equal(d.train, d2.train) and np.array_equal(d.val, d2.val)


def test_text_file_and_nanogpt_bin(tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_text("hello world, " * 1000)
    d = load_dataset(str(txt))
    assert d.vocab_size == 256 and len(d.train) == 11700 and bytes(d.train[:5]) == b"hello"
    tokens = (np.arange(5000) * 7 % 50257).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    (tokens[:800]).tofile(tmp_path / "val.bin")
    d = load_dataset(str(tmp_path / "train.bin"))
    assert d.vocab_size == 4999 * 7 + 1 and len(d.train) == 5000 and len(d.val) == 800  # the largest id + 1
    assert int(d.train[3]) == 21
    with pytest.raises(ConfigError, match="no such file"):
        load_dataset(str(tmp_path / "missing.txt"))


def test_token_files_checked_when_loaded(tmp_path):
    """Issue 16: an empty or odd-sized .bin is refused naming the file; the vocabulary a .bin
    needs is its largest id + 1 over both splits (not 50257 whatever the ids), so a validation
    id beyond the model's vocabulary is refused at start-up, not at the first evaluation."""
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="empty.bin is empty"):
        load_dataset(str(tmp_path / "empty.bin"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ConfigError, match="has 3 bytes, not a whole number of uint16"):
        load_dataset(str(tmp_path / "odd.bin"))
    small = tmp_path / "small"
    small.mkdir()
    (np.arange(3000) % 97).astype(np.uint16).tofile(small / "train.bin")
    (np.arange(600) % 97).astype(np.uint16).tofile(small / "val.bin")
    assert load_dataset(str(small / "train.bin")).vocab_size == 97
    np.concatenate([np.arange(599) % 97, [300]]).astype(np.uint16).tofile(small / "val.bin")
    d = load_dataset(str(small / "train.bin"))
    assert d.vocab_size == 301  # the validation split's id 300
    from cutp.train import RunConfig, build_run

    cfg = RunConfig(model=GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=128, block_size=16), seq_len=16,
                    batch_size=2, micro_batch_size=2, data=str(small / "train.bin"))
    with pytest.raises(ConfigError, match="the data has token ids up to 300 but the model's vocabulary is 128"):
        build_run(cfg)


def test_sampler_is_independent_of_dp_and_micro_batch():
    d = default_corpus(max_bytes=1 << 20)
    ref = np.concatenate([x for x, _ in BatchSampler(d, 16, 8, 1, 0, 8, seed=3).micro_batches(5)])
    for dp, micro in ((2, 1), (2, 4), (4, 2), (8, 1)):
        ranks = [list(BatchSampler(d, 16, 8, dp, r, micro, seed=3).micro_batches(5)) for r in range(dp)]
        # micro-batch k of all DP ranks together is micro-batch k of one rank with dp x micro rows
        got = np.concatenate([ranks[r][k][0] for k in range(len(ranks[0])) for r in range(dp)])
        np.testing.assert_array_equal(got, ref)
        one = list(BatchSampler(d, 16, 8, 1, 0, dp * micro, seed=3).micro_batches(5))
        for k in range(len(one)):
            np.testing.assert_array_equal(np.concatenate([ranks[r][k][0] for r in range(dp)]), one[k][0])
    x, y = next(BatchSampler(d, 16, 8, 1, 0, 8, seed=3).micro_batches(5))
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    other = np.concatenate([x for x, _ in BatchSampler(d, 16, 8, 1, 0, 8, seed=3).micro_batches(6)])
    assert not np.array_equal(other, ref)
    with pytest.raises(ValueError, match="must be divisible by dp=3"):
        BatchSampler(d, 16, 8, 3, 0, 1)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        BatchSampler(d, len(d.val), 8, 1, 0, 8)


def test_default_tp_choice():
    from cutp.train import choose_tp

    tiny, gpt2 = GPTConfig.preset("tiny"), GPTConfig.preset("gpt2")
    assert choose_tp(8, 8, gpt2, "cuda") == 4  # 12 heads: 8 does not divide them
    assert choose_tp(16, 8, GPTConfig.preset("gpt2-medium"), "cuda") == 8
    assert choose_tp(8, 8, tiny, "cpu") == 4  # the CPU keeps some DP
    assert choose_tp(2, 2, tiny, "cpu") == 2
    assert choose_tp(6, 6, tiny, "cpu") == 2
    assert choose_tp(1, 1, tiny, "cpu") == 1


def test_eight_ranks_with_no_mesh_flags(tmp_path):
    m = tmp_path / "m.jsonl"
    res = run_mpi(8, "examples.train_gpt:main", ["--steps", "2", "--eval-every", "0", "--metrics", str(m)],
                  timeout=240)
    assert "mesh tp=4 x dp=2" in res.stdout and "BLAS thread(s) per rank" in res.stdout
    assert "model: preset tiny: 4 layers," in res.stdout  # tiny on the CPU
    assert len(m.read_text().splitlines()) == 2


def test_plot_metrics_writes_a_png(tmp_path):
    from examples.plot_metrics import main

    rows = [{"step": i, "loss": 5.0 / i, "lr": 1e-3, "grad_norm": 1.0, "ms": 10.0, "tokens_per_s": 1000.0}
            for i in range(1, 30)]
    rows[-1]["val_loss"] = 0.3
    src = tmp_path / "m.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows))
    assert main([str(src), str(tmp_path / "loss.png")]) == 0
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10000


def test_plot_metrics_compares_several_runs(tmp_path):
    from examples.plot_metrics import main

    for name, scale in (("fp32", 5.0), ("bf16", 5.1)):
        rows = [{"step": i, "loss": scale / i, "val_loss": scale / i} for i in range(1, 30)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "cmp.png"
    assert main([str(tmp_path / "fp32.jsonl"), str(tmp_path / "bf16.jsonl"), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "fp32.jsonl"), str(tmp_path / "bf16.jsonl"), str(tmp_path / "x.txt")]) == 2
