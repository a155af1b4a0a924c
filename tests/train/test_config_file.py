"""Config files (issue 43): `--config run.toml` holds any setting in sections as --help groups
them; flags override it; a config file and the equivalent flags give bit-identical runs;
`--print-config` writes a file that gives the same run again; unknown keys are refused by name
with the closest valid one. In process, through the script's own parser and the resolver."""
import importlib.util
import os
import sys

import pytest
from mpi4py import MPI

from cutp import train
from cutp.runtime.errors import ConfigError
from cutp.train import config_file
from cutp.train.config_file import CONFIG_FILE, config_text, read_config_file, save_config

FILE = """
[model]
preset = "tiny"
set = ["n_layer=1"]
dtype = "float64"

[mesh]
tp = 1

[run]
steps = 3
batch-size = 4
seq_len = 16
lr = 2e-3
dropout = 0.1

[invocation]
eval_every = 0
"""
FLAGS = ["--preset", "tiny", "--set", "n_layer=1", "--dtype", "float64", "--tp", "1", "--steps", "3", "--batch-size",
         "4", "--seq-len", "16", "--lr", "2e-3", "--dropout", "0.1", "--eval-every", "0"]


def _script():
    import examples.train_gpt as script

    return script


def _config(script, argv):
    choices, _ = script.parse_command_line(argv + ["--device", "cpu"])
    return train.resolve_run_config(MPI.COMM_SELF, **choices)


def _losses(cfg):
    run = train.build_run(cfg, MPI.COMM_SELF)
    try:
        return [train.train_step(run).loss for _ in range(2)]
    finally:
        run.close()


def test_a_file_and_the_same_flags_give_the_same_run_and_print_config_gives_it_again(tmp_path):
    script = _script()
    path = tmp_path / "run.toml"
    path.write_text(FILE)
    from_file, from_flags = _config(script, ["--config", str(path)]), _config(script, FLAGS)
    assert from_file == from_flags and from_file.lr == 2e-3 and from_file.model.dropout == 0.1
    assert _losses(from_file) == _losses(from_flags)  # bit for bit
    # flags override the file
    assert _config(script, ["--config", str(path), "--lr", "1e-3"]).lr == 1e-3
    # --print-config's file gives the same run
    printed = tmp_path / "printed.toml"
    printed.write_text(config_text(from_file))
    assert _config(script, ["--config", str(printed)]) == from_file
    # and a run directory keeps it
    assert open(save_config(from_file, str(tmp_path))).read().endswith(config_text(from_file))
    assert os.path.exists(tmp_path / CONFIG_FILE)


@pytest.mark.parametrize("text,expect", [
    ("[run]\nlearning_rate = 1e-3\n", 'unknown setting "learning_rate" in [run]; did you mean "lr"?'),
    ("[run]\nseq-lenght = 16\n", 'unknown setting "seq-lenght" in [run]; did you mean "seq_len"?'),
    ("[mesh]\nlr = 1e-3\n", '"lr" belongs in [run], not [mesh]'),
    ("[trainer]\nlr = 1e-3\n", 'unknown section [trainer]; the sections are [model], [mesh], [pipeline], [memory], '
                               '[run], [invocation], [logging]'),
    ("lr = 1e-3\n", '"lr" is outside any section; the settings go in the sections [model], [mesh], [pipeline], '
                    '[memory], [run], [invocation], [logging] (it belongs in [run])'),
])
def test_an_unknown_or_misplaced_key_is_refused_by_name(tmp_path, text, expect):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_config_file(str(path))
    assert str(e.value) == f"--config {path}: {expect}"


@pytest.mark.parametrize("text,expect", [
    (None, "cannot be read (No such file or directory)"),
    ("[run\nlr = 1\n", "is not TOML: "),
    ('[model]\nset = "n_layer=2"\n', '"set" is a list of strings, e.g. ["n_layer=2"], got \'n_layer=2\''),
])
def test_a_file_that_cannot_be_read_or_a_list_given_as_a_string_is_refused(tmp_path, text, expect):
    path = tmp_path / "run.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_config_file(str(path))
    assert str(e.value).startswith(f"--config {path}") and expect in str(e.value) and "\n" not in str(e.value)


def test_values_take_the_settings_types(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[run]\nlr = 1\n[model]\nset = ["n_layer=2"]\n[pipeline]\npp_layers = [1, 3]\n')
    choices = read_config_file(str(path))
    assert choices == {"lr": 1.0, "set": ["n_layer=2"], "pp_layers": (1, 3)} and isinstance(choices["lr"], float)


def test_python_3_10_reads_the_file_through_tomli(tmp_path, monkeypatch):
    """Python 3.10 has no tomllib: the module takes tomli (setup.cfg installs it there), the same
    parser, and reads a file as on 3.11+ (simulated: tomllib unimportable, tomli its module)."""
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11: the fallback is what runs here already")
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", tomllib)
    spec = importlib.util.spec_from_file_location("cutp.train._config_file_py310", config_file.__file__)
    py310 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(py310)
    assert py310.tomllib is tomllib
    path = tmp_path / "run.toml"
    path.write_text('[run]\nlr = 1\n[model]\nset = ["n_layer=2"]\n')
    assert py310.read_config_file(str(path)) == read_config_file(str(path)) == {"lr": 1.0, "set": ["n_layer=2"]}


def test_a_count_of_the_wrong_type_in_a_file_is_refused_in_one_line(tmp_path):
    """`steps = "ten"` reached a `steps // 20` before the check of steps and warmup: a TypeError
    traceback (found by a review helper, F4)."""
    path = tmp_path / "run.toml"
    path.write_text('[run]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="^steps must be an integer >= 0, got 'ten'$"):
        _config(_script(), ["--config", str(path), "--preset", "tiny"])


SMALL = ["--device", "cpu", "--preset", "tiny", "--set", "n_layer=1", "--seq-len", "16", "--batch-size", "4",
         "--eval-every", "0", "--quiet"]


def test_a_config_toml_in_out_that_cutp_did_not_write_is_refused_before_any_work(tmp_path):
    """`--out DIR` replaced the user's own DIR/config.toml with the run's settings, silently (found
    by a review helper, F2): now refused in one line, and nothing in DIR is touched."""
    from tests.mpirun import run_mpi

    out = tmp_path / "run"
    out.mkdir()
    (out / CONFIG_FILE).write_text("# my notes\n[run]\nsteps = 3\n")
    res = run_mpi(1, "examples.train_gpt:main", SMALL + ["--steps", "2", "--out", str(out)], timeout=120,
                  expect_failure=True)
    assert (f"holds a config.toml that cutp did not write ({out / CONFIG_FILE}): the run would replace it with its "
            "settings; rename or move that file, or choose another --out") in res.stdout, res.stdout[-2000:]
    assert os.listdir(out) == [CONFIG_FILE] and (out / CONFIG_FILE).read_text() == "# my notes\n[run]\nsteps = 3\n"
    config_file.check_saved_config(str(tmp_path))  # none there: nothing to refuse
    save_config(_config(_script(), SMALL), str(tmp_path))
    config_file.check_saved_config(str(tmp_path))  # cutp's own file is cutp's to replace


def test_a_resumed_runs_config_toml_still_reproduces_it(tmp_path):
    """On resume, config.toml dropped the model's preset and `set` and named the resumed step
    directory, which --keep then pruned: fed back, the file failed (found by a review helper, F2)."""
    from tests.mpirun import run_mpi

    out = str(tmp_path / "run")
    run_mpi(1, "examples.train_gpt:main", SMALL + ["--steps", "4", "--run-steps", "2", "--save-every", "1", "--keep",
                                                    "1", "--out", out], timeout=120)
    run_mpi(1, "examples.train_gpt:main", ["--device", "cpu", "--resume", out, "--steps", "3", "--quiet"], timeout=120)
    choices = read_config_file(os.path.join(out, CONFIG_FILE))
    assert (choices["preset"], choices["set"], choices["resume"]) == ("tiny", ["n_layer=1"], out)
    assert not os.path.exists(os.path.join(out, "step-00000002"))  # (pruned: the file must not name it)
    cfg = _config(_script(), ["--config", os.path.join(out, CONFIG_FILE), "--steps", "4"])
    assert cfg.resumed_step == 3 and cfg.model.n_layer == 1 and cfg.overrides == ("n_layer=1",)
