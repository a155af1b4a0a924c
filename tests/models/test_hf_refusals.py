"""The Hugging Face adapter's refusals on one rank (cutp.models.hf, hf_files): a bad dtype,
path, config or family, an index naming tensors its files do not hold, a checkpoint short of a
parameter, each refused with one line naming it; the one-family entry points (from_hf_llama,
save_hf_llama) read and write their families and refuse the others; a failed write leaves no
file behind; overrides that do not change the function apply."""
import json
import os

import numpy as np
import pytest
from safetensors import safe_open

import cutp
from cutp.hf import (HFFormatError, config_from_hf, from_hf, from_hf_gpt2, from_hf_llama, hf_state_dict, load_hf,
                     save_hf, save_hf_llama)
from cutp.models import GPT, GPTConfig
from cutp.models.hf_files import INDEX_FILE, WEIGHTS_FILE, load_streaming, write_hf_dir

LLAMA = GPTConfig.preset("llama-tiny", n_layer=1, dtype="float32")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    ctx = cutp.init(device="cpu")
    model = GPT(ctx, LLAMA, seed=2)
    save_hf_llama(model, path)
    yield path, model.gather_state_dict()
    ctx.close()


@pytest.fixture
def ctx():
    c = cutp.init(device="cpu")
    yield c
    c.close()


def test_the_llama_entry_points_read_and_write_their_families_only(llama_dir, ctx, tmp_path):
    path, full = llama_dir
    model = from_hf_llama(ctx, path, vocab_multiple=64)  # (an override that keeps the function)
    assert model.config.vocab_multiple == 64 and model.padded_vocab == 256
    got = model.gather_state_dict()
    assert all(np.array_equal(got[k], full[k]) for k in full)
    with pytest.raises(HFFormatError, match=r"config.json: model_type 'llama' is not gpt2's; use cutp.hf.from_hf, "
                                            r"which reads every family"):
        from_hf_gpt2(ctx, path)
    gpt2 = GPT(ctx, GPTConfig.preset("tiny", n_layer=1))
    with pytest.raises(HFFormatError, match=r"this model is written as gpt2, not llama; use cutp.hf.save_hf"):
        save_hf_llama(gpt2, str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")


def test_save_hf_refuses_a_missing_path_and_an_unknown_dtype(llama_dir, tmp_path):
    _, full = llama_dir
    with pytest.raises(cutp.ConfigError, match=r"save_hf needs the directory to write: save_hf\(model, path\)"):
        save_hf(full, LLAMA)
    with pytest.raises(cutp.ConfigError, match=r"dtype 'int8' cannot be saved; use one of .* or None \(keep\)"):
        save_hf(full, LLAMA, str(tmp_path), dtype="int8")
    with pytest.raises(cutp.ConfigError, match=r"save_hf needs the GPTConfig when given a state dict"):
        save_hf(full, str(tmp_path))
    save_hf(full, LLAMA, str(tmp_path / "sd"))  # (a state dict with its config is written)
    cfg, got = load_hf(str(tmp_path / "sd"))
    assert cfg.family == "llama" and all(np.array_equal(got[k], full[k]) for k in full)


def test_config_and_state_dict_refusals_name_what_is_wrong(llama_dir):
    _, full = llama_dir
    hf = dict(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
              vocab_size=64)
    with pytest.raises(HFFormatError, match=r"dtype 'int8' is not supported; use one of \['bfloat16', "):
        config_from_hf(hf, dtype="int8")
    short = {k: v for k, v in full.items() if k != "final_norm.weight"}
    with pytest.raises(HFFormatError, match=r"the state dict has no final_norm.weight"):
        hf_state_dict(LLAMA, short)


def test_an_index_must_be_a_json_object_whose_tensors_its_files_hold(llama_dir, tmp_path):
    path, _ = llama_dir
    shard = "model-00001-of-00001.safetensors"  # (a sharded directory: read through its index)
    os.symlink(os.path.join(path, WEIGHTS_FILE), tmp_path / shard)
    os.symlink(os.path.join(path, "config.json"), tmp_path / "config.json")
    index = tmp_path / INDEX_FILE
    index.write_text("[1, 2]")
    with pytest.raises(HFFormatError, match=rf"{INDEX_FILE} is not a JSON object: 'list' object has no attribute"):
        load_hf(str(tmp_path))
    index.write_text("{not json")
    with pytest.raises(HFFormatError, match=rf"{INDEX_FILE} is not a JSON object: Expecting property name"):
        load_hf(str(tmp_path))
    with safe_open(str(tmp_path / shard), "np") as f:
        keys = list(f.keys())
    weight_map = {k: shard for k in keys}
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert load_hf(str(tmp_path))[0] == load_hf(path)[0]  # (the whole index reads)
    weight_map["model.layers.7.mlp.up_proj.weight"] = shard
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(HFFormatError, match=rf"{INDEX_FILE} lists \['model.layers.7.mlp.up_proj.weight'\] in files "
                                            "that do not hold them"):
        load_hf(str(tmp_path))


def test_streaming_a_checkpoint_short_of_a_parameter_is_refused(llama_dir, ctx):
    _, full = llama_dir
    model = GPT(ctx, LLAMA, init=False)
    with pytest.raises(HFFormatError, match=r"the checkpoint has no tensors for \['final_norm.weight'\]"):
        load_streaming(model, ((k, v) for k, v in full.items() if k != "final_norm.weight"))


def test_a_failed_write_leaves_no_file_behind(tmp_path):
    tensors = {"w": np.ones((2, 2), dtype=np.float32)}
    with pytest.raises(FileNotFoundError):
        write_hf_dir(tensors, {"model_type": "llama"}, str(tmp_path), {"bos_token_id": 1},
                     tokenizer_files={"tokenizer.json": str(tmp_path / "absent.json")})
    assert os.listdir(tmp_path) == []  # (the weights and configs written first are removed with the rest)
