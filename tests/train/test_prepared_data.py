"""Training from `python -m cutp prepare-data` shards (--data DIR): the same losses at tp1 and
tp2 x dp2 in float64, a bit-identical resume, and the data's tokenizer checked against the
model's (--init-from a directory with another tokenizer is refused naming both)."""
import io
import json
import os
import re

import numpy as np
import pytest

from cutp.data.prepare import prepare
from cutp.runtime.errors import ConfigError
from tests.data import tokenizer_files
from tests.mpirun import run_mpi

pytest.importorskip("tokenizers", reason="the tokenizers library is not installed (pip install tokenizers)")

TRAIN = "examples.train_gpt:main"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """GPT-2-style shards (a 601-token vocabulary, uint16) of ~100 KB of text, 3 shards for train."""
    root = tmp_path_factory.mktemp("prepared")
    lines = tokenizer_files.corpus_lines()
    (root / "in").mkdir()
    for i in range(12):
        (root / "in" / f"{i:02d}.txt").write_text("".join(lines[i * 250:(i + 1) * 250]), encoding="utf-8")
    tok = tokenizer_files.gpt2_style(str(root / "gpt2"))
    meta = prepare([str(root / "in")], tok, str(root / "data"), shard_tokens=10_000, val_fraction=0.2, workers=1,
                   stream=io.StringIO())
    assert len(meta["splits"]["train"]["shards"]) >= 3 and meta["dtype"] == "uint16"
    return root, tok, str(root / "data"), meta


def _metrics(path):
    return [json.loads(line) for line in open(path)]


def test_same_losses_at_tp1_and_tp2xdp2_and_an_exact_resume(prepared, tmp_path):
    _, _, data, meta = prepared
    base = ["--preset", "tiny", "--dtype", "float64", "--seq-len", "32", "--batch-size", "8", "--eval-every", "0",
            "--quiet", "--set", "n_layer=1", "--set", f"vocab_size={meta['vocab_size']}", "--data", data,
            "--steps", "3"]
    mesh = ["--tp", "2", "--dp", "2", "--micro-batch-size", "2"]
    m1, m4, resumed = tmp_path / "tp1.jsonl", tmp_path / "tp2dp2.jsonl", tmp_path / "resumed.jsonl"
    run_mpi(1, TRAIN, base + ["--tp", "1", "--metrics", str(m1)], timeout=240)
    run_mpi(4, TRAIN, base + mesh + ["--metrics", str(m4), "--save-every", "2", "--out", str(tmp_path / "run")],
            timeout=240)
    a, b = _metrics(m1), _metrics(m4)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-10, atol=0)
    np.testing.assert_allclose([r["grad_norm"] for r in b], [r["grad_norm"] for r in a], rtol=1e-9)
    assert abs(a[0]["loss"] - np.log(meta["vocab_size"])) < 0.5  # the model's vocabulary is the tokenizer's
    run_mpi(4, TRAIN, base + mesh + ["--resume", str(tmp_path / "run" / "step-00000002"), "--metrics", str(resumed),
                                     "--out", str(tmp_path / "rerun")], timeout=240)
    c = _metrics(resumed)
    assert [r["step"] for r in c] == [3] and c[0]["loss"] == b[2]["loss"] and c[0]["grad_norm"] == b[2]["grad_norm"]
    # fine-tuning this run's checkpoint on data of another tokenizer: refused, naming the run's
    from cutp import train

    other = str(tmp_path / "bytes-data")
    prepare([str(prepared[0] / "in")], "bytes", other, val_fraction=0.2, workers=1, stream=io.StringIO())
    cfg = train.resolve_run_config(init_from=str(tmp_path / "run"), data=other, seq_len=16, batch_size=2, steps=1,
                                   device="cpu")
    with pytest.raises(ConfigError, match=r"was tokenized by bytes \(the byte tokenizer\), but init_from .*run/step-"
                                          r"00000003 uses gpt2 \(sha256 \w+, 601 tokens\); prepare the data with that "
                                          rf"model's tokenizer: python -m cutp prepare-data ... --tokenizer {prepared[1]}"):
        train.build_run(cfg)


def _hf_dir(path, vocab_size, tokenizer_style):
    from cutp.hf import save_hf_gpt2
    from cutp.models import GPT, GPTConfig
    from tests.tp_utils import self_ctx

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=vocab_size, block_size=32, dtype="float64")
    tokenizer_style(str(path))  # (its config.json replaced by the model's next)
    save_hf_gpt2(GPT(self_ctx(), cfg, seed=0), str(path))
    return str(path)


def test_init_from_another_tokenizer_is_refused_naming_both(prepared, tmp_path):
    from cutp import train

    root, gpt2_tok, data, meta = prepared
    llama = _hf_dir(tmp_path / "Llama-tiny", 1000, tokenizer_files.llama3_style)
    cfg = train.resolve_run_config(init_from=llama, data=data, seq_len=16, batch_size=2, steps=1, device="cpu")
    with pytest.raises(ConfigError) as e:
        train.build_run(cfg)
    msg = str(e.value)
    sha = meta["tokenizer"]["sha256"]
    assert f"data {data} was tokenized by gpt2 (sha256 {sha[:12]}, 601 tokens)" in msg
    assert f"init_from {llama} uses Llama-tiny (sha256 " in msg and f"--tokenizer {llama}" in msg
    # the same tokenizer file in the model's directory: accepted (the identity is the file's hash)
    gpt2_model = _hf_dir(tmp_path / "gpt2-tiny", 640, tokenizer_files.gpt2_style)
    with open(f"{gpt2_tok}/tokenizer.json", "rb") as f, open(f"{gpt2_model}/tokenizer.json", "rb") as g:
        assert f.read() == g.read()  # trained alike
    run = train.build_run(train.resolve_run_config(init_from=gpt2_model, data=data, seq_len=16, batch_size=2,
                                                   steps=1, device="cpu"))
    assert run.dataset.tokenizer == meta["tokenizer"] and run.model.config.vocab_size == 640
    run.close()
    # shards of a larger vocabulary than the model's: refused naming the tokenizer
    small = _hf_dir(tmp_path / "small", 500, lambda d: None)  # no tokenizer files: the vocabulary alone
    with pytest.raises(ConfigError, match=r"the data was tokenized by gpt2 \(sha256 \w+, 601 tokens\), whose ids go up "
                                          r"to 600 but the model's vocabulary is 500"):
        train.build_run(train.resolve_run_config(init_from=small, data=data, seq_len=16, batch_size=2, steps=1,
                                                 device="cpu"))


def test_init_from_a_bpe_model_on_the_byte_corpus_is_refused_naming_both(tmp_path):
    """`--init-from` a model with a BPE tokenizer and no `--data` (the embedded byte corpus) or a
    text file: one line naming both tokenizers and the prepare-data command."""
    from cutp.data import load_dataset
    from cutp.data.dataset import default_corpus
    from cutp.models import GPTConfig
    from cutp.train.data_check import check_data_fits_model

    bpe = _hf_dir(tmp_path / "gpt2-bpe", 640, tokenizer_files.gpt2_style)
    model = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=640, block_size=32)
    corpus = default_corpus(max_bytes=1 << 20)
    with pytest.raises(ConfigError) as e:
        check_data_fits_model(corpus, model, bpe, None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the embedded corpus (no data given) was tokenized by bytes (the byte "
                                              f"tokenizer), but init_from {bpe} uses gpt2-bpe (sha256 ")
    assert msg.endswith(f"python -m cutp prepare-data ... --tokenizer {bpe} --out DIR")
    text = tmp_path / "notes.txt"
    text.write_text("some text " * 100)
    with pytest.raises(ConfigError, match=rf"data {text} was tokenized by bytes .* but init_from {bpe} uses"):
        check_data_fits_model(load_dataset(str(text)), model, bpe, str(text))
    check_data_fits_model(corpus, model, str(tmp_path / "no-such-model"), None)  # tokenizer unknown: not refused


def test_an_id_outside_the_vocabulary_names_the_shard_the_offset_and_the_fix(prepared, tmp_path):
    """Bytes overwritten in a shard: the step reading them is refused in one line (every rank
    checks the whole global batch, so all refuse it together)."""
    import shutil

    from cutp.data import BatchSampler, load_dataset
    from cutp.data.shards import HEADER_BYTES

    data = str(tmp_path / "data")
    shutil.copytree(prepared[2], data)
    shard = os.path.join(data, "train_000001.bin")
    with open(shard, "r+b") as f:  # every token of the shard after its 5th: 65535
        size = f.seek(0, 2)
        f.seek(HEADER_BYTES + 10)
        f.write(b"\xff" * (size - HEADER_BYTES - 10))
    sampler = BatchSampler(load_dataset(data), 64, 64, 2, 1, 32, seed=0)
    with pytest.raises(ConfigError) as e:
        list(sampler.micro_batches(0))
    msg = str(e.value)
    assert re.fullmatch(rf"{re.escape(shard)}: token [0-9,]+ \(byte [0-9,]+\) is id 65535, outside the data's "
                        rf"vocabulary of 601: the shard is damaged; check the data with python -m cutp verify-data "
                        rf"{re.escape(data)} and prepare it again with python -m cutp prepare-data", msg), msg
    at = int(re.search(r"token ([0-9,]+)", msg).group(1).replace(",", ""))
    assert at >= 5 and int(re.search(r"byte ([0-9,]+)", msg).group(1).replace(",", "")) == HEADER_BYTES + 2 * at
