"""A resumed run goes on as it ran (issue 43): its run directory (`resume` without `out` writes
there), its layout when the world has its size and no mesh size is given (another layout is
allowed, said in one line), its cadence of checkpoints, evaluations and logs. In-process: the
settings resolver on a checkpoint whose recorded settings are a 4-rank run's."""
import os

from cutp.checkpoint import save_checkpoint
from cutp.models import GPT, GPTConfig
from cutp.train.config import derive_run_config, resume_note, resume_out
from tests.tp_utils import self_ctx

TINY = {"preset": "tiny", "device": "cpu", "set": ["n_layer=1"]}


def _saved_run(tmp_path):
    """A run directory holding step 2 of a run whose settings say tp 2 x dp 2 on 4 ranks."""
    out = str(tmp_path / "run")
    settings = derive_run_config({**TINY, "tp": 2, "dp": 2, "micro_batch_size": 2, "save_every": 2, "eval_every": 5,
                                  "steps": 6, "seq_len": 16, "metrics": str(tmp_path / "m.jsonl"), "out": out}, 4, 4)
    ctx = self_ctx()
    model = GPT(ctx, GPTConfig.preset("tiny").with_overrides(["n_layer=1"]), seed=0)
    save_checkpoint(out, 2, model, train_args=settings.checkpoint_settings())
    ctx.close()
    return out


def test_resume_keeps_the_run_directory_layout_and_cadence(tmp_path):
    run = _saved_run(tmp_path)
    cfg = derive_run_config(resume_out({"resume": run, "device": "cpu"}), 4, 4)  # (the command line's out)
    assert cfg.out == run and cfg.resume == os.path.join(run, "step-00000002")  # checkpoints go on in run/
    assert derive_run_config({"resume": run, "device": "cpu"}, 4, 4).out is None  # a library caller's: none
    assert (cfg.tp, cfg.dp, cfg.micro_batch_size) == (2, 2, 2)  # not tp 4, the machine's choice on 4 ranks
    assert (cfg.save_every, cfg.eval_every, cfg.metrics, cfg.steps, cfg.seq_len) == \
        (2, 5, str(tmp_path / "m.jsonl"), 6, 16)
    assert resume_note(cfg) is None
    # told otherwise: another directory, another layout (said in one line)
    other = derive_run_config({"resume": run, "device": "cpu", "out": str(tmp_path / "b"), "tp": 4}, 4, 4)
    assert other.out == str(tmp_path / "b") and (other.tp, other.dp) == (4, 1)
    assert resume_note(other) == "layout: tp 4 x dp 1, the resumed run's was tp 2 x dp 2 (the math is the same)"
    # on another number of ranks the layout cannot be the run's: derived, and said
    two = derive_run_config(resume_out({"resume": run, "device": "cpu"}), 2, 2)
    assert (two.tp * two.dp, two.save_every) == (2, 2)
    assert resume_note(two).startswith(f"layout: tp {two.tp} x dp {two.dp}, the resumed run's was tp 2 x dp 2")


def test_the_help_example_of_resume_keeps_its_checkpoints():
    import examples.train_gpt as script

    assert "--resume out/tiny" in script.__doc__ and "--tp 2 --dp 2 --resume" not in script.__doc__


def test_resume_keeps_zero_3s_replicas_and_reshard_choice_unless_another_stage_is_given(tmp_path):
    """HSDP's replicas and zero 3's reshard choice are the run's memory layout: a resume without
    them keeps them (a silently plain zero 3 changes memory and communication), a stage given
    that does not take them drops them instead of being refused for them."""
    out = str(tmp_path / "run")
    settings = derive_run_config({**TINY, "dp": 4, "zero": 3, "dp_replicate": 2, "reshard_after_forward": False,
                                  "steps": 4, "seq_len": 16, "out": out}, 4, 4)
    ctx = self_ctx()
    save_checkpoint(out, 2, GPT(ctx, GPTConfig.preset("tiny").with_overrides(["n_layer=1"]), seed=0),
                    train_args=settings.checkpoint_settings())
    ctx.close()
    resumed = derive_run_config(resume_out({"resume": out, "device": "cpu"}), 4, 4)
    assert (resumed.zero, resumed.dp, resumed.dp_replicate, resumed.reshard_after_forward) == (3, 4, 2, False)
    two = derive_run_config(resume_out({"resume": out, "device": "cpu", "zero": 2}), 4, 4)
    assert (two.zero, two.dp_replicate, two.reshard_after_forward) == (2, 2, True)
    for given in ({"zero": 1}, {"distributed_optimizer": True}, {"zero": 0}):
        lower = derive_run_config(resume_out({"resume": out, "device": "cpu", **given}), 4, 4)
        assert (lower.zero, lower.dp_replicate, lower.reshard_after_forward) == (given.get("zero", 1), 1, True)
