"""The run settings' refusals the rest of the suite never reaches (cutp.train.config, defaults,
finetune, settings, model_choice), each resolved in process on one rank: one line naming the
setting, and where it proposes a fix, the fix accepted (tests/train/test_refusal_fixes.py's
reading of the fixes); RunConfig's own checks, which API callers meet when they build one
directly; and the helpers' edge cases (a checkpoint outside a run directory, a layout without
sizes, --tensorboard without its package, --verify-data on a prepared directory)."""
import dataclasses
import importlib.util
import io
import json
import sys

import pytest
from mpi4py import MPI

from cutp import train
from cutp.data.prepare import prepare
from cutp.runtime.errors import ConfigError, UserError
from cutp.train import config as config_module
from cutp.train.config import derive_run_config, resume_out
from cutp.train.defaults import saved_world
from cutp.train.model_choice import as_gpt_config
from cutp.train.pipeline import plan
from cutp.train.reporting import TensorBoardLog
from cutp.train.settings import Setting, flag_of
from tests.train.test_refusal_fixes import check_every_fix_is_accepted

TINY = {"preset": "tiny", "device": "cpu"}


@pytest.mark.parametrize("world, given, message", [
    (1, dict(dtype="float16", min_loss_scale=4096.0, initial_loss_scale=1024.0),
     "--min-loss-scale 4096 exceeds --initial-loss-scale 1024"),
    (1, dict(recompute_layers=2), "--recompute-layers 2 needs --recompute full and an integer in [1, n_layer=4]"),
    (1, dict(recompute="full", recompute_layers=5), "--recompute-layers 5 needs --recompute full"),
    (1, dict(sample_every=10), "--sample-every prints a generation from --sample-prompt: give --sample-prompt TEXT"),
    (2, dict(sample_every=10, sample_prompt="Hi", pp=2),
     "--sample-every generates on each TP group with the whole model, which pp 2 / cp 1 / ep 1 split; omit both "
     "--sample-every and --sample-prompt"),  # (the prompt alone is ignored without --sample-every: refused)
    (1, dict(pp=1, pp_layers="2,2"), "--pp-layers 2,2 needs --pp 2"),
    (1, dict(pp_layers="2,x"), "--pp-layers '2,x': expected comma-separated layer counts, e.g. 5,6,6,5"),
    (1, dict(freeze=","), "--freeze ',' names no group; give some of embeddings, norms, head, attention, mlp"),
    (4, dict(sequence_parallel=True, tp=1, set=["n_head=6", "n_embd=48"]),
     "--sequence-parallel needs tp > 1 (it splits the activations over the TP ranks), but tp is 1; give --tp 2, or "
     "omit --sequence-parallel"),  # (tp 4 divides the ranks, not the 6 heads: not proposed)
])
def test_each_refusal_names_the_setting_and_its_fixes_work(world, given, message):
    choices = {**TINY, **given}
    with pytest.raises(ConfigError) as e:
        derive_run_config(choices, world, world)
    text = e.value.render(flag_of)
    assert message in text and "\n" not in text, text
    if "; " in text:  # (fixes proposed in the form cutp.train.fixes reads: each accepted)
        assert check_every_fix_is_accepted([(world, choices)])[0] == 1


def test_run_config_checks_what_api_callers_build_directly():
    cfg = derive_run_config(TINY, 1, 1)
    with pytest.raises(ConfigError, match=r"RunConfig.model must be a GPTConfig, got dict"):
        dataclasses.replace(cfg, model=cfg.model.to_dict())
    with pytest.raises(ConfigError, match=r"sequence_parallel needs tp > 1 .* but tp is 1: give tp 2 or more, or "
                                          r"omit sequence_parallel"):
        dataclasses.replace(cfg, sequence_parallel=True)  # (derive_run_config refuses it earlier, with the fixes)
    with pytest.raises(ConfigError, match=r"model must be a GPTConfig or a dict of its fields, got str"):
        as_gpt_config("tiny")
    assert as_gpt_config(cfg.model.to_dict()) == cfg.model


def test_tensorboard_without_its_package_is_refused_naming_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(config_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        derive_run_config({**TINY, "tensorboard": "tb"}, 1, 1)
    assert e.value.render(flag_of) == ("--tensorboard writes through the tensorboardX package, which is not "
                                       "installed: pip install tensorboardX (cutp's extra: pip install -e "
                                       "'.[tensorboard]'), or omit --tensorboard")
    # the writer itself, for an API caller that skipped the check: the same install named
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # (its import fails)
    assert TensorBoardLog("tb", 1).writer is None  # (rank 0 alone writes: nothing imported elsewhere)
    with pytest.raises(UserError, match=r"^--tensorboard needs the tensorboardX package: pip install tensorboardX "
                                        r"\(cutp's extra: pip install -e '\.\[tensorboard\]'\)$"):
        TensorBoardLog("tb", 0)


def test_verify_data_checks_the_prepared_directory_once_per_node(tmp_path):
    for i in range(5):  # (a text file is one document)
        (tmp_path / f"in{i}.txt").write_text(f"document {i}, some text to train on. " * 100)
    prepare([str(tmp_path / f"in{i}.txt") for i in range(5)], "bytes", str(tmp_path / "data"), val_fraction=0.2, workers=1,
            stream=io.StringIO())
    cfg = train.resolve_run_config(MPI.COMM_SELF, **TINY, data=str(tmp_path / "data"), verify_data=True,
                                   seq_len=16)
    assert cfg.verify_data and cfg.data == str(tmp_path / "data")
    shard = next(p for p in (tmp_path / "data").iterdir() if p.suffix == ".bin")
    shard.write_bytes(bytes(reversed(shard.read_bytes())))  # same size, other bytes
    with pytest.raises(ConfigError, match=shard.name):
        train.resolve_run_config(MPI.COMM_SELF, **TINY, data=str(tmp_path / "data"), verify_data=True, seq_len=16)


def test_a_checkpoint_outside_a_run_directory_keeps_out_unset(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps({"step": 3}))
    choices = {"resume": str(tmp_path / "ckpt")}
    assert resume_out(choices) is choices  # (not a step-* directory: no run directory to go on in)
    (tmp_path / "run" / "step-3").mkdir(parents=True)
    (tmp_path / "run" / "step-3" / "meta.json").write_text(json.dumps({"step": 3}))
    assert resume_out({"resume": str(tmp_path / "run" / "step-3")})["out"] == str(tmp_path / "run")


def test_a_layout_without_its_sizes_has_no_world():
    assert saved_world({}) is None and saved_world({"tp": 2, "dp": "2", "pp": 1}) is None
    assert saved_world({"tp": 2, "dp": 2, "pp": 1}) == 4 and saved_world({"tp": 2, "dp": 2, "pp": 1, "cp": 2}) == 8


def test_an_unbounded_number_setting_says_a_finite_number():
    with pytest.raises(ConfigError, match=r"x.? must be a finite number, got nan"):
        Setting(help="x", group="test", kind=float).check("x", float("nan"))


def test_an_unknown_pipeline_schedule_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'zigzag'"):
        plan("zigzag", 2, 0, 4)


def test_min_lr_above_lr_is_refused():
    """The cosine "decay" raised the learning rate to min_lr, and the loss jumped (found by a review
    helper, F7)."""
    with pytest.raises(ConfigError, match=r"^min_lr 1 is above lr 0.001: the cosine decay ends at min_lr; give "
                                          r"min_lr <= 0.001, or omit it \(lr / 10\)$"):
        train.resolve_run_config(MPI.COMM_SELF, preset="tiny", device="cpu", lr=1e-3, min_lr=1.0)
    assert train.resolve_run_config(MPI.COMM_SELF, preset="tiny", device="cpu", lr=1e-3, min_lr=1e-3).min_lr == 1e-3


def test_a_resume_with_nothing_left_to_train_is_refused(tmp_path):
    """--resume with --steps at or below the checkpoint's step exited 0 having trained nothing (and
    rewrote config.toml with the lower steps) (found by a review helper, F7)."""
    small = dict(preset="tiny", set=["n_layer=1"], device="cpu", batch_size=2, seq_len=8, eval_every=0)
    run = train.build_run(train.resolve_run_config(MPI.COMM_SELF, steps=3, out=str(tmp_path), **small), MPI.COMM_SELF)
    try:
        train.train_step(run)
        train.save(run)
    finally:
        run.close()
    with pytest.raises(ConfigError, match="^the resumed run is at step 1, and steps 1 leaves nothing to train; "
                                          "give steps above 1 to continue it$"):
        train.resolve_run_config(MPI.COMM_SELF, resume=str(tmp_path), steps=1, device="cpu")
    assert train.resolve_run_config(MPI.COMM_SELF, resume=str(tmp_path), device="cpu").steps == 3  # its own: goes on
