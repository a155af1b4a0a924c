"""`cutp plan` and `cutp bench model` take the training settings through the same declarations as
examples/train_gpt.py (issue 43): one name, type, allowed values and meaning in all three; the
planner's older --micro-batch still works."""
import argparse

from cutp import train
from cutp.bench.__main__ import build_parser
from cutp.plan import cli as plan_cli


def _actions(parser) -> dict:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def test_plan_and_bench_model_declare_the_training_flags_as_training_does(capsys):
    trained = _actions(train.command_line_parser())
    bench = _actions(build_parser()._subparsers._group_actions[0].choices["model"])
    plan = argparse.ArgumentParser()
    plan_cli.add_arguments(plan)
    planned = _actions(plan)
    shared = 0
    for flag in ("--tp", "--dp", "--cp", "--cp-comm", "--pp", "--pp-schedule", "--micro-batch-size", "--batch-size",
                 "--seq-len", "--recompute", "--sequence-parallel", "--bucket-size", "--link-latency", "--set", "--dtype",
                 "--device"):
        for other in (bench, planned):
            if flag in other:
                a, b = trained[flag], other[flag]
                assert (a.type, a.choices, a.dest) == (b.type, b.choices, b.dest), flag
                assert a.help.split(" (default")[0] == b.help.split(" (default")[0], flag
                shared += 1
    assert shared >= 30
    for flag in ("--dtype", "--device", "--batch-size"):  # the planner's own once
        assert flag in planned, flag
    # bench model's timed and untimed steps have names of their own: training's --steps and --warmup
    # (the run's length, the learning-rate warmup) are refused there by name
    model = build_parser()
    assert model.parse_args(["model", "--timed-steps", "3", "--untimed-steps", "1"]).steps == 3
    for flag, instead in (("--steps", "--timed-steps"), ("--warmup", "--untimed-steps")):
        try:
            model.parse_args(["model", flag, "3"])
        except SystemExit as e:
            assert e.code == 2 and instead in capsys.readouterr().err, flag
        else:
            raise AssertionError(f"{flag} was accepted by bench model")
    assert "global sequences per optimizer step" in bench["--batch-size"].help  # not per DP rank any more
    assert planned["--micro-batch"] is planned["--micro-batch-size"]
    assert plan.parse_args(["--micro-batch", "4"]).micro_batch_size == 4
