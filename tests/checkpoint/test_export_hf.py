"""`python -m cutp export-hf RUN_OR_CHECKPOINT --out DIR` (cutp/checkpoint/export_hf.py): a run at
any layout written as the Hugging Face directory of its family, with the tokenizer its tokens came
from; refusals in one line, nothing overwritten. With transformers installed: from_pretrained
loads the source's class with the same logits, AutoTokenizer the same tokenizer."""
import json
import os

import numpy as np
import pytest
from safetensors import safe_open

import cutp
from cutp.checkpoint import save_checkpoint
from cutp.checkpoint.export_hf import export_hf, ids_from_tokenizer, main, tokenizer_source
from cutp.hf import from_hf, save_hf
from cutp.models import GPT, GPTConfig
from tests.data.tokenizer_files import sentencepiece_style
from tests.mpirun import run_mpi


def _tensors(path) -> dict:
    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _mistral_source(root) -> str:
    """A Hugging Face Mistral directory with a SentencePiece-style tokenizer (offline)."""
    tok = sentencepiece_style(os.path.join(root, "tok"))
    vocab = len(json.load(open(os.path.join(tok, "tokenizer.json")))["model"]["vocab"])
    cfg = GPTConfig.preset("llama-tiny", n_layer=2, vocab_size=vocab, block_size=32, dtype="float64",
                           family="mistral", bos_token_id=1, eos_token_id=2)
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, cfg, seed=5)
    src = os.path.join(root, "hf")
    save_hf(model, src, tokenizer_files={n: os.path.join(tok, n) for n in ("tokenizer.json", "tokenizer_config.json")})
    ctx.close()
    return src


def _worker_checkpoint_at_tp2(src, run):
    ctx = cutp.init(tp=2, device="cpu")
    model = from_hf(ctx, src, dtype="float64")
    save_checkpoint(run, 3, model, train_args={"init_from": src})
    ctx.close()


def test_a_tp2_run_of_a_mistral_model_exports_as_mistral_with_its_tokenizer(tmp_path, capsys):
    src = _mistral_source(str(tmp_path))
    run = str(tmp_path / "run")
    run_mpi(2, "tests.checkpoint.test_export_hf:_worker_checkpoint_at_tp2", src, run)
    out = str(tmp_path / "export")
    assert main([run, "--out", out]) == 0
    said = capsys.readouterr().out
    assert "MistralForCausalLM" in said and f"tokenizer from {src}" in said, said
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["model_type"], config["architectures"], config["bos_token_id"], config["eos_token_id"]) == \
        ("mistral", ["MistralForCausalLM"], 1, 2)
    generation = json.load(open(os.path.join(out, "generation_config.json")))
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert open(os.path.join(out, name), "rb").read() == open(os.path.join(src, name), "rb").read(), name
    # the tp 2 shards joined: the source's tensors under the source's names, bit for bit
    got, want = _tensors(out), _tensors(src)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    assert not any(n.endswith("tmp-export-hf") for n in os.listdir(tmp_path))
    # bfloat16 on request, from the same weights
    assert main([run, "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    bf16 = _tensors(str(tmp_path / "bf16"))
    assert all(str(a.dtype) == "bfloat16" for a in bf16.values())
    assert json.load(open(tmp_path / "bf16" / "config.json"))["torch_dtype"] == "bfloat16"
    _check_with_transformers(out, src)


def _check_with_transformers(out, src):
    transformers = pytest.importorskip("transformers", reason="transformers not installed: the export's files were "
                                                              "checked above; loading them needs transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float64).eval()
    assert type(model).__name__ == "MistralForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def read_config(path):\n    return path"
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and ids == transformers.AutoTokenizer.from_pretrained(src)(text)["input_ids"]
    ctx = cutp.init(device="cpu")
    ours = from_hf(ctx, src, dtype="float64")
    idx = np.array([ids[:16]])
    source = transformers.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float64).eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(idx)).logits.numpy()
        assert np.array_equal(ref, source(torch.from_numpy(idx)).logits.numpy())  # the export is the source, bit for bit
    assert model.generation_config.eos_token_id == source.generation_config.eos_token_id == 2
    got = ours.gather_logits(ours.forward(idx))
    # (transformers rounds norms and rotary tables to float32 inside a float64 model: the f64
    # comparison without those casts is tests/models/test_hf_llama.py's)
    assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()
    ctx.close()


def test_a_byte_level_run_exports_without_tokenizer_files_and_says_so(tmp_path, capsys):
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, GPTConfig.preset("tiny", n_layer=1), seed=1)
    save_checkpoint(str(tmp_path / "run"), 1, model)
    ctx.close()
    out = tmp_path / "export"
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "no tokenizer files" in said[0] and "byte-level" in said[0], said
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.load(open(out / "config.json"))["architectures"] == ["GPT2LMHeadModel"]


def test_refusals_are_one_line_and_write_nothing(tmp_path, capsys):
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, GPTConfig.preset("tiny-moe", n_layer=1), seed=1)
    save_checkpoint(str(tmp_path / "moe"), 1, model)
    ctx.close()
    assert main([str(tmp_path / "moe"), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mixture-of-experts" in err[0] and "GPT-2" in err[0], err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp-export-hf").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    assert main([str(tmp_path / "moe"), "--out", str(tmp_path / "taken")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists" in err[0] and "never overwrites" in err[0], err
    assert os.listdir(tmp_path / "taken") == ["mine.txt"]
    assert main([str(tmp_path / "nothing-here"), "--out", str(tmp_path / "y")]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    with pytest.raises(cutp.ConfigError, match="--dtype"):
        export_hf(str(tmp_path / "moe"), str(tmp_path / "z"), dtype="int8")
    with pytest.raises(cutp.ConfigError, match=r"load_model returns \(model, meta\); pass the model"):
        save_hf((model, {}), str(tmp_path / "z"))


def test_ids_the_config_lacks_come_from_the_tokenizers_special_tokens(tmp_path):
    """A run from a preset knows no bos/eos ids: the export takes them from the tokenizer it ships
    (else transformers' generate runs past the end of a turn); ids the config has are kept."""
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "model": {"vocab": {"a": 0, "b": 1}},
        "added_tokens": [{"id": 250, "content": "<|begin|>"}, {"id": 251, "content": "<|eot|>"}]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin|>", "eos_token": {"content": "<|eot|>"}, "pad_token": "<|missing|>"}))
    found = {n: str(tmp_path / n) for n in ("tokenizer.json", "tokenizer_config.json")}
    cfg = ids_from_tokenizer(found, GPTConfig.preset("llama-tiny"))
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (250, 251, None)
    kept = ids_from_tokenizer(found, GPTConfig.preset("llama-tiny", eos_token_id=7))
    assert (kept.bos_token_id, kept.eos_token_id) == (250, 7)


def test_the_tokenizer_of_prepared_data_reached_through_a_cutp_init_from_is_exported_with_a_config(tmp_path, capsys):
    """A run fine-tuned from a cutp run that was trained on prepared data: the tokenizer is the
    one the data's meta.json names (a tokenizer.json given as a file), found through the first
    run; with no tokenizer_config.json beside it, one (and special_tokens_map.json) is written
    from the config's special ids; a source generation_config.json that does not read is not
    copied (the export writes its own)."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                                    "added_tokens": [{"id": 9, "content": "<|end|>"}]}))
    (tok / "generation_config.json").write_text("{")
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"format": "cutp-token-shards", "version": 2,
                                                "tokenizer": {"path": str(tok / "tokenizer.json")}}))
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, GPTConfig.preset("tiny", n_layer=1, vocab_size=16, eos_token_id=9, bos_token_id=0), seed=1)
    first = save_checkpoint(str(tmp_path / "first"), 1, model, train_args={"data": str(data)})
    save_checkpoint(str(tmp_path / "second"), 2, model, train_args={"init_from": str(tmp_path / "first")})
    ctx.close()
    assert tokenizer_source(first) == str(tok)
    out = tmp_path / "export"
    assert main([str(tmp_path / "second"), "--out", str(out)]) == 0
    assert f"tokenizer from {tok}" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    made = json.load(open(out / "tokenizer_config.json"))
    assert (made["bos_token"], made["eos_token"], made["model_max_length"]) == ("a", "<|end|>", model.config.block_size)
    assert "pad_token" not in made and json.load(open(out / "special_tokens_map.json")) == {
        "bos_token": "a", "eos_token": "<|end|>"}
    assert json.load(open(out / "generation_config.json"))["eos_token_id"] == 9
    # a directory named by the data is the tokenizer's directory; --merge-lora of a run without adapters is refused
    (data / "meta.json").write_text(json.dumps({"format": "cutp-token-shards", "version": 2,
                                                "tokenizer": {"path": str(tok)}}))
    assert tokenizer_source(first) == str(tok)
    with pytest.raises(cutp.ConfigError, match=r"^--merge-lora: .*step-00000002 is not of a LoRA run \(no adapters to "
                                               r"merge\); omit --merge-lora$"):
        export_hf(str(tmp_path / "second"), str(tmp_path / "merged"), merge_lora=True)
