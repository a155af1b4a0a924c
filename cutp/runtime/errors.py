"""Exceptions users see. Every message names the problem and a way to fix it.

A message names a setting in the library's terms, as its field name in backquotes:
"`micro_batch_size` 3 must divide ...". `str(error)` shows the name ("micro_batch_size 3 must
divide ..."); a command line shows its own name for it instead (`settings_named`,
`UserError.render`: the flag, "--micro-batch-size 3 must divide ..."), so the library never
names a flag.
"""
import contextlib
import re

# a setting's name in a message: `name`
SETTING = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


class UserError(Exception):
    """Something the user gave cannot be used (a setting, a file). Command-line entry points
    print its message as one line, no traceback, and exit with `exit_status`
    (`cutp.runtime.failure.config_errors_exit`)."""

    exit_status = 1  # a run-time problem (a damaged checkpoint, ...)

    name_of = None  # how str() writes a setting (`settings_named`); None: its field name

    def render(self, name_of=None) -> str:
        """The message with each setting written as name_of(field name) (default: the one
        `settings_named` gave, else the field name)."""
        name_of = name_of or self.name_of
        return SETTING.sub(lambda m: m.group(1) if name_of is None else name_of(m.group(1)), super().__str__())

    def __str__(self):
        return self.render()


@contextlib.contextmanager
def settings_named(name_of):
    """A UserError leaving the block names its settings as name_of(field name) (a command
    line: its flags), in str() and wherever it is printed."""
    try:
        yield
    except UserError as e:
        if e.name_of is None:
            e.name_of = name_of
        raise


class ConfigError(UserError, ValueError):
    """A configuration that cannot run (mesh, model shape, device, ...)."""

    exit_status = 2  # a usage error: argparse's convention


class BackendError(ConfigError):
    """A requested backend (device, NCCL, kernels) cannot be used on this machine."""
