"""A run setting is declared once (cutp.train.settings): its flag, --help line with its default,
check and RunConfig field all come from that one declaration."""
import argparse
import dataclasses

import pytest
from mpi4py import MPI

from cutp import train
from cutp.models import GPTConfig
from cutp.runtime.errors import ConfigError, settings_named
from cutp.train.config import RunConfig
from cutp.train.settings import command_line_parser, declared, flag_of, setting

TINY = GPTConfig.preset("tiny", n_layer=1)


def _help() -> str:
    """--help on one line per flag (no wrapping: a wrapped line may break a word at a hyphen)."""
    wide = train.command_line_parser(prog="train_gpt.py",
                                     formatter_class=lambda prog: argparse.HelpFormatter(prog, width=10_000))
    return " ".join(wide.format_help().split())


def test_every_setting_has_a_flag_whose_help_states_its_default():
    text = _help()
    for name, (declaration, default) in train.SETTINGS.items():
        if not declaration.flag:
            continue
        assert flag_of(name) in text, name
        shown = declaration.help_text(declaration.omitted if declaration.omitted is not None else default)
        assert " ".join(shown.split()) in text, (name, shown)
    assert "--eval-batches N validation batches (default: 4)" in text
    assert "--micro-batch-size N" in text and "with --pp, the largest that gives the schedule" in text
    assert "--dtype {float32,float64,bfloat16,float16}" in text
    assert "--quiet no progress lines (warnings are still printed) (default: off)" in text
    assert "--save-on-signal, --no-save-on-signal" in text


def test_a_value_on_the_command_line_reaches_the_run_config():
    args = train.command_line_parser().parse_args(
        ["--preset", "tiny", "--set", "n_layer=2", "--eval-batches", "7", "--grad-clip", "0.5", "--keep", "0",
         "--out", "out/not-written", "--recompute", "full", "--recompute-layers", "1", "--pp-layers", "2", "--no-save-on-signal", "--quiet",
         "--seq-len", "16", "--warmup", "0", "--device", "cpu", "--tp", "1"])
    cfg = train.resolve_run_config(MPI.COMM_SELF, **vars(args))
    assert (cfg.eval_batches, cfg.grad_clip, cfg.keep, cfg.recompute, cfg.recompute_layers) == (7, 0.5, 0, "full", 1)
    assert (cfg.pp_layers, cfg.save_on_signal, cfg.quiet, cfg.seq_len, cfg.warmup) == ((2,), False, True, 16, 0)
    assert cfg.model.n_layer == 2 and cfg.overrides == ("n_layer=2",)
    # not given: the declared default
    assert (cfg.log_every, cfg.max_skips, cfg.weight_decay, cfg.hysteresis) == (1, 5, 0.1, 2)


@pytest.mark.parametrize("argv,message", [
    (["--cp-comm", "bogus"], "argument --cp-comm: invalid choice: 'bogus' (choose from 'ring', 'a2a')"),
    (["--cp", "abc"], "argument --cp: invalid int value: 'abc'"),
])
def test_a_flag_argparse_refuses_is_one_line(argv, message, capsys):
    # as a setting cutp refuses (config_errors_exit): no usage block (25 lines on every rank before)
    with pytest.raises(SystemExit) as e:
        train.command_line_parser(prog="train_gpt.py").parse_args(argv)
    assert e.value.code == 2 and capsys.readouterr().err == f"train_gpt.py: error: {message}\n"


@pytest.mark.parametrize("name,bad,message", [
    ("eval_batches", 0, "eval_batches must be an integer >= 1, got 0"),
    ("grad_clip", -1.0, "grad_clip must be a finite number >= 0, got -1.0"),
    ("lr", float("nan"), "lr must be a finite number > 0, got nan"),
    ("recompute", "most", "recompute must be one of none, selective, full, got 'most'"),
    ("pp_schedule", "zigzag", "pp_schedule must be one of 1f1b, gpipe, interleaved, got 'zigzag'"),
    ("keep", True, "keep must be an integer >= 0, got True"),
])
def test_a_declared_check_refuses_in_the_librarys_terms_and_the_command_line_names_the_flag(name, bad, message):
    with pytest.raises(ConfigError) as e:
        RunConfig(model=TINY, **{name: bad})
    assert str(e.value) == message
    assert e.value.render(flag_of) == message.replace(name, flag_of(name), 1)
    with pytest.raises(ConfigError) as e:
        with settings_named(flag_of):
            train.resolve_run_config(MPI.COMM_SELF, preset="tiny", device="cpu", **{name: bad})
    assert str(e.value).startswith(flag_of(name)), str(e.value)


def test_a_new_setting_is_one_declaration():
    """One `setting(...)` field: a flag with its help and default, its check, its field."""

    @dataclasses.dataclass(frozen=True)
    class WithMore(RunConfig):
        hp: int = setting(1, "a made-up size: each sequence split over hp ranks", "mesh", kind=int,
                          at_least=1)

    settings = declared(WithMore)
    assert list(settings)[-1] == "hp"
    parser = command_line_parser(settings, prog="x")
    text = " ".join(parser.format_help().split())
    assert "--hp N a made-up size: each sequence split over hp ranks (default: 1)" in text
    assert parser.parse_args(["--hp", "2"]).hp == 2 and parser.parse_args([]).hp is None
    assert WithMore(model=TINY, hp=2).hp == 2
    with pytest.raises(ConfigError, match="^hp must be an integer >= 1, got 0$"):
        WithMore(model=TINY, hp=0)


def test_the_choices_and_run_settings_come_from_the_declarations():
    assert train.CHOICES["eval_batches"] == 4 and train.CHOICES["tp"] is None  # derived when not given
    assert train.CHOICES["device"] == "auto" and train.CHOICES["set"] == ()
    assert set(train.RUN_SETTINGS) == {"steps", "batch_size", "seq_len", "lr", "min_lr", "warmup", "weight_decay",
                                       "grad_clip", "dropout", "seed", "data", "pack", "freeze", "lora_rank", "lora_alpha",
                                       "lora_dropout", "lora_targets"}
    with pytest.raises(ConfigError, match=r"unknown run settings \['bogus'\]"):
        train.resolve_run_config(MPI.COMM_SELF, bogus=1)
