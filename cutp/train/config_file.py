"""Settings from a TOML file (`--config run.toml`) and back (`--print-config`).

    [model]
    preset = "tiny"
    set = ["n_layer=2"]
    [mesh]
    tp = 2
    [run]
    steps = 200
    lr = 1e-3

The sections are --help's groups (cutp.train.settings.GROUPS), the keys the settings' names
(`micro_batch_size`, or its flag's spelling `micro-batch-size`), the values TOML's (numbers,
strings, booleans, a list for `set` and `pp_layers`). A key the settings do not declare, in a
section or a section that is none of them, is refused naming the closest valid one. Flags given
on the command line override the file (`merged`).

`config_text(cfg)` writes a resolved RunConfig back as such a file: every setting whose value is
not its declared default (derived ones always: the mesh, the batch, the schedule), so that the
file reproduces the run on as many ranks; training with it gives the same RunConfig. A run with
`out` saves it there (`config.toml`).
"""
from __future__ import annotations

import difflib
import json
import os
import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package (setup.cfg installs it there)
    import tomli as tomllib

from ..runtime.errors import ConfigError
from .config import CHOICES, SETTINGS, RunConfig
from .settings import GROUPS

CONFIG_FILE = "config.toml"  # the resolved settings in a run directory
# The first line of the config.toml cutp writes: only a file that starts with it is cutp's to replace
SAVED_HEADER = "# the resolved settings of this run:"
_STEP_DIR = re.compile(r"step-\d+")


# What other trainers call some settings (Megatron, torchtitan, nanoGPT, HF Trainer): named as the fix
OTHER_NAMES = {"learning_rate": "lr", "lr_min": "min_lr", "min_learning_rate": "min_lr", "max_steps": "steps",
               "train_iters": "steps", "training_steps": "steps", "global_batch_size": "batch_size",
               "micro_batch": "micro_batch_size", "seq_length": "seq_len", "block_size": "seq_len",
               "tensor_parallel_size": "tp", "pipeline_parallel_size": "pp", "context_parallel_size": "cp",
               "expert_parallel_size": "ep", "data_parallel_size": "dp", "warmup_steps": "warmup",
               "lr_warmup_steps": "warmup", "clip_grad": "grad_clip", "max_grad_norm": "grad_clip",
               "output_dir": "out", "save_interval": "save_every", "eval_interval": "eval_every",
               "log_interval": "log_every", "eval_iters": "eval_batches"}


def _closest(word: str, names, section: str | None = None) -> str:
    """`; did you mean "x"?`: another trainer's name for it, else the nearest spelling in the
    section, else in any."""
    found = [OTHER_NAMES[word]] if word in OTHER_NAMES else []
    same = [n for n in names if section is not None and n in SETTINGS and SETTINGS[n][0].group == section]
    found = found or difflib.get_close_matches(word, same, n=1, cutoff=0.6) or \
        difflib.get_close_matches(word, list(names), n=1, cutoff=0.5)
    return f"; did you mean \"{found[0]}\"?" if found else ""


def read_config_file(path: str) -> dict:
    """The choices a TOML file gives ({setting: value}); ConfigError naming the file and the key."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path} is not TOML: {e}") from None
    names = {name for name, (s, _) in SETTINGS.items() if s.flag}
    choices = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            name = section.replace("-", "_")
            where = f" (it belongs in [{SETTINGS[name][0].group}])" if name in names else _closest(name, names)
            raise ConfigError(f"--config {path}: \"{section}\" is outside any section; the settings go in the sections "
                              f"{', '.join(f'[{g}]' for g in GROUPS)}{where}")
        if section not in GROUPS:
            raise ConfigError(f"--config {path}: unknown section [{section}]; the sections are "
                              f"{', '.join(f'[{g}]' for g in GROUPS)}" + _closest(section, GROUPS))
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in names:
                raise ConfigError(f"--config {path}: unknown setting \"{key}\" in [{section}]"
                                  + _closest(name, names, section))
            group = SETTINGS[name][0].group
            if group != section:
                raise ConfigError(f"--config {path}: \"{key}\" belongs in [{group}], not [{section}]")
            choices[name] = _value(name, value, path)
    return choices


def _value(name: str, value, path: str):
    s = SETTINGS[name][0]
    if s.kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if s.repeat:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"--config {path}: \"{name}\" is a list of strings, e.g. [\"n_layer=2\"], got {value!r}")
        return list(value)
    if name == "pp_layers" and isinstance(value, list):
        return tuple(value)
    return value


def merged(file_choices: dict, flag_choices: dict) -> dict:
    """The file's choices with the flags given on the command line (not None, not an empty list)
    over them."""
    given = {k: v for k, v in flag_choices.items() if v is not None and v != []}
    return {**file_choices, **given}


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))


def resolved_choices(cfg: RunConfig) -> dict:
    """{setting: value} that gives `cfg` again: each declared setting whose value is not its
    default (the derived ones always), the model as its preset, overrides, dtype and dropout."""
    values = {name: getattr(cfg, name) for name in SETTINGS if hasattr(cfg, name) and name != "model"}
    values.update(set=list(cfg.overrides), dtype=cfg.model.dtype, dropout=cfg.model.dropout)
    if cfg.resume is not None and _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(cfg.resume))):
        # the run directory (its `latest`), not the step resumed: --keep may prune that one
        values.update(resume=os.path.dirname(os.path.normpath(cfg.resume)))
    out = {}
    for name, value in values.items():
        s, default = SETTINGS[name]
        if not s.flag or value is None or value == () or value == []:
            continue
        if CHOICES[name] is not None and value == CHOICES[name]:
            continue  # the declared default: the file need not say it (and a setting it needs is not implied)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def config_text(cfg: RunConfig, header: str | None = None) -> str:
    """`cfg` as a TOML file that reproduces it (module docstring)."""
    choices = resolved_choices(cfg)
    lines = [f"# {line}" for line in (header or "").splitlines()]
    for group in GROUPS:
        keys = [n for n in SETTINGS if n in choices and SETTINGS[n][0].group == group]
        if keys:
            lines += ([""] if lines else []) + [f"[{group}]"] + [f"{k} = {_toml(choices[k])}" for k in keys]
    return "\n".join(lines) + "\n"


def check_saved_config(directory: str) -> None:
    """Refuses a `directory`/config.toml that cutp did not write (it lacks SAVED_HEADER): the
    user's own file, which save_config would replace. Run before any work."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.lexists(path):
        return
    try:
        with open(path, errors="replace") as f:
            first = f.readline()
    except OSError:
        first = ""  # (a directory or an unreadable file by that name is not cutp's either)
    if not first.startswith(SAVED_HEADER):
        raise ConfigError(f"`out` {directory} holds a {CONFIG_FILE} that cutp did not write ({path}): the run "
                          "would replace it with its settings; rename or move that file, or choose another `out`")


def save_config(cfg: RunConfig, directory: str) -> str:
    """Writes `config_text(cfg)` as `directory`/config.toml (atomically); returns the path."""
    path = os.path.join(directory, CONFIG_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(config_text(cfg, SAVED_HEADER[2:] + " train_gpt.py --config " + path + " reproduces it"))
    os.replace(path + ".tmp", path)
    return path


def add_config_flags(parser) -> None:
    """--config FILE and --print-config on a command line's parser (examples/train_gpt.py's)."""
    parser.add_argument("--config", metavar="FILE", help="a TOML file of settings, in sections "
                        f"{', '.join(f'[{g}]' for g in GROUPS)} named as --help groups them, keys as the flags "
                        "(flags given too override it; --print-config writes one)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings as a --config "
                        "file that reproduces this run, and exit")


def command_line_choices(args) -> tuple[dict, bool]:
    """(the choices of a parsed command line, its --config file's under its flags; --print-config)."""
    flags = dict(vars(args))
    path, show = flags.pop("config", None), bool(flags.pop("print_config", False))
    return (merged(read_config_file(path), flags) if path else flags), show
