"""cutp.generate.generate_text: a prompt through a cutp.data.tokenizer tokenizer (Llama-3-style,
BOS by its template), greedy ids decoded, stopped at the tokenizer's EOS."""
import numpy as np
import pytest

from cutp.data.tokenizer import load_tokenizer
from cutp.generate import generate, generate_text
from cutp.models import GPT, GPTConfig
from tests.data import tokenizer_files
from tests.tp_utils import self_ctx

pytest.importorskip("tokenizers", reason="the tokenizers library is not installed (pip install tokenizers)")


def test_generate_text_encodes_stops_at_eos_and_decodes(tmp_path):
    tok = load_tokenizer(tokenizer_files.llama3_style(str(tmp_path)))
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=1024, block_size=48, dtype="float64")
    model = GPT(self_ctx(), cfg, seed=0)
    prompt = tok.encode("def main():")
    assert prompt[0] == tok.bos_id
    free = generate(model, prompt, 8, temperature=0)
    # make EOS the argmax where the third greedy token was: generation stops there, EOS kept
    head = model.gather_state_dict()["tok_embed.weight"]
    head[tok.eos_id] = 1.5 * head[free[2]]
    model.load_full_state_dict({"tok_embed.weight": head}, strict=False)
    ids = generate(model, prompt, 8, temperature=0, stop_token=tok.eos_id)
    assert ids[-1] == tok.eos_id and len(ids) <= 3
    assert generate_text(model, tok, "def main():", 8, temperature=0) == tok.decode(ids)
    assert generate_text(model, tok, "def main():", 8, temperature=0, stop_token=None) == tok.decode(
        generate(model, prompt, 8, temperature=0))
    assert np.all(np.array(ids) < tok.vocab_size)


def test_generate_script_takes_the_tokenizer_from_another_directory(tmp_path, capsys):
    import importlib.util
    import os

    from cutp.hf import from_hf_gpt2, save_hf_gpt2
    from tests.mpirun import ROOT

    tok_dir = tokenizer_files.sentencepiece_style(str(tmp_path / "tok"))
    tok = load_tokenizer(tok_dir)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=tok.vocab_size, block_size=32, dtype="float64")
    save_hf_gpt2(GPT(self_ctx(), cfg, seed=1), str(tmp_path / "model"))  # weights only, no tokenizer files
    spec = importlib.util.spec_from_file_location("cutp_example_generate_tok", os.path.join(ROOT, "examples",
                                                                                             "generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--ckpt", str(tmp_path / "model"), "--tokenizer", tok_dir, "--prompt", "def f", "--temperature", "0",
              "--max-new-tokens", "5", "--device", "cpu", "--dtype", "float64", "--print-ids", "--no-stop"])
    text, ids = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    model = from_hf_gpt2(self_ctx(), str(tmp_path / "model"), dtype="float64")
    new = generate(model, tok.encode("def f"), 5, temperature=0)
    assert tok.encode("def f")[0] == tok.bos_id  # the SentencePiece template's BOS: the model's input ...
    assert ids == "ids:" + ",".join(map(str, new)) and text == tok.decode(tok.encode("def f")[1:] + new)
    assert not text.startswith("<s>") and text.lstrip().startswith("def f")  # ... not printed (issue 43)
