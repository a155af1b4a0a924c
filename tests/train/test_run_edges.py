"""What a training run does at its edges, in process on one rank (cutp.train): a simulated link's
times in the metrics row, the run directory's lock freed when the build fails, the tokenizer of a
checkpoint's data that is no prepared directory, the prompt sampler's tokenizer and prompt
checks, the banner's trainable line, the state bytes of an optimizer without memory_bytes, and
set_up_trainable's refusals of a model other than the config's (an API caller's)."""
import dataclasses
import json
import types

import numpy as np
import pytest
from mpi4py import MPI

import cutp
from cutp import train
from cutp.checkpoint.files import write_meta
from cutp.checkpoint.run_dir import prepare_run_dir
from cutp.data import Dataset
from cutp.data.tokenizer import BYTES
from cutp.models import GPT, GPTConfig
from cutp.train.config import derive_run_config
from cutp.train.data_check import model_tokenizer
from cutp.train.finetune import set_up_trainable, trainable_line
from cutp.train.memory import format_bytes, state_bytes
from cutp.train.overlap import overlap_record
from cutp.train.sampling import PromptSampler

SMALL = dict(preset="tiny", set=["n_layer=1"], dtype="float64", seq_len=16, batch_size=2, eval_every=0,
             device="cpu", quiet=True, save_on_signal=False)


def test_a_simulated_link_reports_its_times_and_a_checkpoint_names_its_data(tmp_path):
    cfg = train.resolve_run_config(MPI.COMM_SELF, steps=1, out=str(tmp_path / "run"), link_bandwidth=10.0,
                                   link_latency=1.0, **SMALL)
    run = train.build_run(cfg, MPI.COMM_SELF)
    rec = train.train_step(run).record()
    saved = train.save(run)
    run.close()
    assert rec["link_ms"] >= 0 and rec["link_exposed_ms"] <= rec["link_ms"] + 1e-9
    assert "link_overlap_fraction" in rec  # (None: no time on the link of one rank)
    assert model_tokenizer(saved)["name"] == BYTES  # (the embedded corpus: bytes)
    meta = json.loads(open(f"{saved}/meta.json").read())
    meta["train_args"]["data"] = str(tmp_path)  # a directory that is no prepared data: unknown
    write_meta(f"{saved}/meta.json", meta)
    assert model_tokenizer(saved) is None


def test_a_build_that_fails_frees_the_run_directory(tmp_path):
    cfg = train.resolve_run_config(MPI.COMM_SELF, steps=1, out=str(tmp_path / "run"), data="x.txt", **SMALL)
    data = Dataset(np.arange(200) % 256, np.arange(200) % 256, 256, "bytes")
    with pytest.raises(cutp.ConfigError, match="not both"):
        train.build_run(cfg, MPI.COMM_SELF, dataset=data)
    lock, _ = prepare_run_dir(str(tmp_path / "run"))  # (would be refused as "in use by another job")
    lock.release()


def _run(tokenizer, records=None, **settings):
    cfg = derive_run_config({**SMALL, "sample_every": 5, "sample_prompt": "Hello", **settings}, 1, 1)
    return types.SimpleNamespace(config=cfg, dataset=types.SimpleNamespace(tokenizer=tokenizer, records=records))


def test_the_sampler_takes_the_data_s_tokenizer_and_a_prompt_that_fits():
    sampler = PromptSampler.for_run(_run({"name": BYTES}))
    assert sampler.ids == list(b"Hello") and not sampler.chat
    with pytest.raises(cutp.ConfigError, match=r"sample_every.? needs the data's tokenizer: give .?data.? a directory "
                                               r"written by python -m cutp prepare-data"):
        PromptSampler.for_run(_run({"name": "gpt2", "sha256": "0" * 64}))
    with pytest.raises(cutp.ConfigError, match=r"sample_prompt.?: .*block_size"):
        PromptSampler.for_run(_run({"name": BYTES}, sample_prompt="x" * 120, sample_tokens=20))
    assert PromptSampler.for_run(_run({"name": BYTES}, sample_every=0, sample_prompt=None)) is None


def test_the_banner_counts_what_trains_and_frozen_groups_must_match_the_model():
    ctx = cutp.init(device="cpu")
    cfg = derive_run_config({**SMALL, "set": ["n_layer=2"], "freeze": "layers.1.*", "lora_rank": 4}, 1, 1)
    model = GPT(ctx, cfg.model)
    assert trainable_line(cfg, model) is None  # (nothing frozen yet)
    set_up_trainable(model, cfg)
    params = model.parameters()
    n = sum(p.data.size for p in params if p.trainable)
    assert 0 < n < sum(p.data.size for p in params)
    assert trainable_line(cfg, model) == (f"trainable: {n:,} of {sum(p.data.size for p in params):,} parameters on "
                                          "this rank (LoRA rank 4, alpha 4 on q,k,v,o,gate,up,down; --freeze "
                                          "layers.1.*); the frozen ones have no gradients, masters or optimizer state")
    # a model other than cfg.model, as an API caller may pass: refused on every rank, naming why
    with pytest.raises(cutp.ConfigError, match=r"freeze.? 'layers.1.\*' matches no parameter of this model"):
        set_up_trainable(GPT(ctx, dataclasses.replace(cfg.model, n_layer=1)), cfg)
    everything = derive_run_config({**SMALL, "preset": "llama-tiny", "freeze": "embeddings,norms,attention,mlp"},
                                   1, 1)  # (llama's untied head stays)
    tied = GPT(ctx, GPTConfig.preset("llama-tiny", n_layer=1, tie_embeddings=True))
    with pytest.raises(cutp.ConfigError, match=r"freeze.? embeddings,norms,attention,mlp leaves no parameter to train"):
        set_up_trainable(tied, everything)
    ctx.close()


def test_state_bytes_of_an_optimizer_without_memory_bytes_count_its_moments():
    flat = types.SimpleNamespace(data=np.zeros(10, np.float32), grad=np.zeros(10, np.float32))
    frozen = types.SimpleNamespace(trainable=False, data=np.zeros(3, np.float64))
    run = types.SimpleNamespace(optimizer=types.SimpleNamespace(m=np.zeros(10, np.float32), v=np.zeros(10, np.float32)),
                                flat=flat, model=types.SimpleNamespace(parameters=lambda: [frozen]))
    assert state_bytes(run) == {"params": 40 + 24, "grads": 40, "optimizer": 80}
    assert [format_bytes(n) for n in (512, 1500, 2.5e6, 12e9)] == ["512 B", "1.50 kB", "2.50 MB", "12.0 GB"]


def test_the_dp_link_s_overlap_is_its_own_column():
    stats = types.SimpleNamespace(comm_ms=4.0, exposed_comm_ms=1.0, comm_ms_by_group={"dp": (4.0, 1.0)},
                                  link_ms_by_group={"dp": (3.0, 1.5), "tp": (1.0, 1.0)})
    rec = overlap_record(stats)
    assert (rec["link_ms"], rec["link_exposed_ms"]) == (4.0, 2.5)
    assert rec["dp_link_overlap_fraction"] == pytest.approx(0.5) and rec["dp_overlap_fraction"] == pytest.approx(0.75)
