"""A run setting written once: its name, type, default, allowed values, help text and check.

Each setting is a `RunConfig` field made with `setting(...)` (cutp.train.config), or, for the
few choices that are not fields of their own (the model's preset overrides, dtype, dropout), a
`Setting` in `EXTRA_CHOICES` there. From that one declaration:

- `RunConfig.__post_init__` runs its check (`Setting.check`: ranges, allowed values),
- `resolve_run_config` takes it as a keyword argument, None meaning "the default" (derived
  where `derived` says how),
- `command_line_parser` makes its flag (`--field-name`), type, choices and `--help` line with
  its default, in its group,
- `flag_of` names it in a command line's error messages (`cutp.runtime.errors`: the library
  writes `field_name`, the command line shows --field-name).

A new setting is one `setting(...)` field (and its uses).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from mpi4py import MPI

from ..runtime.errors import ConfigError
from ..runtime.failure import config_errors_exit, mark_raised_on_every_rank

# The --help sections, in their order.
GROUPS = {
    "model": "the model",
    "mesh": "parallel layout (none of it changes the math)",
    "pipeline": "pipeline parallelism",
    "memory": "memory and precision",
    "run": "the training (kept by checkpoints; fixed on resume, except --steps)",
    "invocation": "this invocation: stopping, evaluation, checkpoints",
    "logging": "logging",
}


@dataclass(frozen=True)
class Setting:
    """One setting's declaration (see the module docstring)."""

    help: str
    group: str
    kind: type = str  # the value's type on a command line (int, float, str, bool)
    choices: tuple | None = None  # the allowed values (None: any of `kind`)
    at_least: float | None = None  # numbers: the smallest allowed value
    above: float | None = None  # numbers: a bound the value must exceed
    below: float | None = None  # numbers: a bound the value must stay under
    optional: bool = False  # None is an allowed value (after derivation)
    derived: str | None = None  # how resolve_run_config derives it when not given (for --help)
    omitted: object = None  # what resolve_run_config uses when not given and not derived
    run: bool = False  # a run setting: kept by checkpoints, fixed on resume (except steps)
    flag: bool = True  # on the command line
    metavar: str | None = None
    repeat: bool = False  # the flag may be given several times (a list)

    def check(self, name: str, value) -> None:
        """Raises ConfigError naming the setting when `value` is not allowed."""
        if value is None and self.optional:
            return
        if self.choices is not None:
            if value not in self.choices:
                raise ConfigError(f"`{name}` must be one of {', '.join(map(str, self.choices))}, got {value!r}")
            return
        if self.kind is int:
            low = self.at_least
            if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
                raise ConfigError(f"`{name}` must be an integer" + (f" >= {low:g}" if low is not None else "")
                                  + f", got {value!r}")
        elif self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            ok = ok and (self.above is None or value > self.above) and (self.at_least is None or value >= self.at_least)
            ok = ok and (self.below is None or value < self.below)
            if not ok:
                raise ConfigError(f"`{name}` must be {self._range()}, got {value!r}")

    def _range(self) -> str:
        if self.at_least is not None and self.below is not None:
            return f"in [{self.at_least:g}, {self.below:g})"
        if self.above is not None:
            return f"a finite number > {self.above:g}"
        if self.at_least is not None:
            return f"a finite number >= {self.at_least:g}"
        return "a finite number"

    def help_text(self, default) -> str:
        """The --help line: what it does, then its default."""
        if self.kind is bool and not self.derived:
            return f"{self.help} (default: {'on' if default else 'off'})"
        if self.derived:
            shown = self.derived
        elif default is None or default == () or default == []:
            shown = "none"
        else:
            shown = f"{default:g}" if isinstance(default, float) else default
        return f"{self.help} (default: {shown})"


def setting(default, help: str, group: str, **declared) -> dataclasses.Field:
    """A RunConfig field with its declaration (`Setting`'s fields as keywords)."""
    return dataclasses.field(default=default, metadata={"setting": Setting(help, group, **declared)})


def declared(cls) -> dict[str, tuple[Setting, object]]:
    """{name: (its Setting, its field default)} of a dataclass's declared fields, in order."""
    return {f.name: (f.metadata["setting"], f.default) for f in dataclasses.fields(cls) if "setting" in f.metadata}


def flag_of(name: str) -> str:
    """A setting's command-line flag: micro_batch_size -> --micro-batch-size."""
    return "--" + name.replace("_", "-")


class OneLineParser(argparse.ArgumentParser):
    """A flag argparse refuses (`--cp-comm bogus`, `--cp abc`) ends the program as a setting cutp
    refuses does, through the same exit (`cutp.runtime.failure.config_errors_exit`): one line,
    `<prog>: error: ...`, printed once (by rank 0: every rank parses the same command line and
    refuses it), exit status 2, the ranks leaving together; no usage block from every rank."""

    def error(self, message):
        with config_errors_exit(self.prog):
            raise mark_raised_on_every_rank(ConfigError(message), MPI.COMM_WORLD, reporter=0)


def add_flag(parser, name: str, s: Setting, default, command_default=None, aliases=()) -> None:
    """Adds setting `name`'s flag to `parser` (or an argument group) as its declaration says:
    type, choices, metavar, --help line. `command_default`: another command's own default for it
    (`cutp bench model`, `cutp plan`: the flag then means what training's does, with that default
    stated); None: the flag defaults to None, "not given". `aliases`: older spellings kept."""
    shown = command_default if command_default is not None else (s.omitted if s.omitted is not None else default)
    help_text = (s.help_text(shown) if command_default is None else
                 dataclasses.replace(s, derived=None).help_text(shown))
    kw = {"help": help_text, "default": command_default}
    metavar = s.metavar or {int: "N", float: "X"}.get(s.kind)
    if metavar and s.kind is not bool:
        kw["metavar"] = metavar
    if s.kind is bool:
        kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
    else:
        kw["type"] = s.kind
        if s.choices is not None:
            kw["choices"] = list(s.choices)
        if s.repeat:
            kw.update(action="append", default=list(command_default or []))
    parser.add_argument(flag_of(name), *aliases, **kw)


def command_line_parser(settings: dict[str, tuple[Setting, object]], **parser_args) -> argparse.ArgumentParser:
    """The parser of every setting with a flag, by group, each defaulting to None ("not given":
    resolve_run_config derives or fills in the default, which --help states)."""
    p = OneLineParser(**parser_args)
    sections = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    for name, (s, default) in settings.items():
        if s.flag:
            add_flag(sections[s.group], name, s, default)
    return p
