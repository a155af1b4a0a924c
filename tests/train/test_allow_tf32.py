"""--allow-tf32: off by default, a flag of the command line, refused for 16-bit models (their GEMMs
run on tensor cores already) in one line naming the fix, and handed to cutp.ops.gemm by a run."""
import importlib

import pytest
from mpi4py import MPI

from cutp import train
from cutp.bench.model import random_tokens
from cutp.runtime.errors import ConfigError
from cutp.train.config import derive_run_config
from cutp.train.settings import flag_of

GEMM = importlib.import_module("cutp.ops.gemm")
TINY = {"preset": "tiny", "device": "cpu", "set": ["n_layer=1"]}


def test_allow_tf32_is_off_by_default_and_a_flag():
    assert derive_run_config(dict(TINY), 1, 1).allow_tf32 is False
    assert train.command_line_parser().parse_args(["--allow-tf32"]).allow_tf32 is True
    assert derive_run_config({**TINY, "allow_tf32": True}, 1, 1).allow_tf32 is True


def test_allow_tf32_is_refused_for_16_bit_models():
    with pytest.raises(ConfigError) as e:
        derive_run_config({**TINY, "allow_tf32": True, "dtype": "bfloat16"}, 1, 1)
    assert e.value.render(flag_of).startswith("--allow-tf32 rounds float32 GEMM operands to TF32; a bfloat16 model")
    assert "omit --allow-tf32, or train in float32" in e.value.render(flag_of)


def test_a_run_hands_the_setting_to_the_gemms(monkeypatch):
    monkeypatch.setattr(GEMM, "_tf32", False)
    for allowed in (True, False):
        cfg = train.resolve_run_config(MPI.COMM_SELF, **TINY, allow_tf32=allowed, seq_len=16, batch_size=1, steps=1,
                                       eval_every=0, quiet=True, save_on_signal=False)
        run = train.build_run(cfg, MPI.COMM_SELF, dataset=random_tokens(cfg.model.vocab_size, 1 << 12, 0))
        assert GEMM.tf32_allowed() is allowed
        run.close()
