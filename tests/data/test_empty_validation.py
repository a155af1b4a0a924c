"""A validation split left empty (fine-tuning review, finding 4): prepare-data drops every record
chosen for validation (longer than --max-seq-len) and says so in a warning line; a run with
`eval_every` 0 trains on that data, packed or not, and a run that evaluates is refused in one line
naming `eval_every` 0 as a fix; a sampler set up without validation refuses the empty split when
first asked for it."""
import io
import json

import numpy as np
import pytest
from mpi4py import MPI

from cutp.data.dataset import BatchSampler, Dataset
from cutp.data.prepare import RecordSettings, prepare
from cutp.models import GPTConfig
from cutp.runtime.errors import ConfigError
from cutp.train import RunConfig, build_run, train_step


@pytest.fixture(scope="module")
def no_val_data(tmp_path_factory):
    """Byte-level JSONL documents; the first (the only one validation takes) too long: dropped."""
    root = tmp_path_factory.mktemp("noval")
    with open(root / "docs.jsonl", "w") as f:
        f.write(json.dumps({"text": "x" * 200}) + "\n")
        for k in range(12):
            f.write(json.dumps({"text": f"short document {k}"}) + "\n")
    said = io.StringIO()
    meta = prepare([str(root / "docs.jsonl")], "bytes", str(root / "out"), workers=1, stream=said,
                   records=RecordSettings(max_seq_len=40))
    return str(root / "out"), meta, said.getvalue()


def test_prepare_data_warns_when_the_validation_split_ends_up_empty(no_val_data):
    _, meta, said = no_val_data
    assert meta["splits"]["val"]["documents"] == 0 and meta["splits"]["train"]["documents"] == 12
    warnings = [line for line in said.splitlines() if "warning" in line]
    assert warnings == ["prepare-data: warning: the val split is empty: every record chosen for validation was "
                        "dropped; train on this data with --eval-every 0 (no validation), or prepare it again with a "
                        "larger --max-seq-len or --val-fraction"], said


@pytest.mark.parametrize("pack", [False, True])
def test_a_run_without_validation_trains_on_it_and_one_with_validation_is_refused(no_val_data, pack):
    data = no_val_data[0]
    cfg = dict(model=GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=256, block_size=32, dtype="float64"),
               data=data, pack=pack, seq_len=8 if not pack else 24, batch_size=2, micro_batch_size=2, steps=1,
               warmup=1, quiet=True, save_on_signal=False)
    run = build_run(RunConfig(**cfg, eval_every=0), MPI.COMM_SELF)
    assert np.isfinite(train_step(run).loss)
    run.close()
    refusal = (r"^pack: the val split has no documents, or eval_every 0 to train without validation; give more data"
               if pack else r"^the val split has 0 tokens, fewer than seq_len\+2 = 10; use a shorter seq_len or more "
               "data, or eval_every 0 to train without validation$")
    with pytest.raises(ConfigError, match=refusal):
        build_run(RunConfig(**cfg, eval_every=1), MPI.COMM_SELF)


def test_a_sampler_without_validation_refuses_the_empty_split_when_asked_for_it():
    tokens = np.arange(100, dtype=np.uint16) % 50
    d = Dataset(tokens, tokens[:0], 256, "x")
    sampler = BatchSampler(d, 8, 2, 1, 0, 2, evaluate=False)
    assert next(sampler.micro_batches(0))[0].shape == (2, 8)
    with pytest.raises(ConfigError, match="the val split has 0 tokens"):
        next(sampler.micro_batches(0, "val"))
    with pytest.raises(ConfigError, match="the val split has 0 tokens"):
        BatchSampler(d, 8, 2, 1, 0, 2)
