"""Exceptions users see. Every message names the problem and a way to fix it."""


class UserError(Exception):
    """Something the user gave cannot be used (a setting, a file). Command-line entry points
    print its message as one line, no traceback, and exit with `exit_status`
    (`cutp.runtime.failure.config_errors_exit`)."""

    exit_status = 1  # a run-time problem (a damaged checkpoint, ...)


class ConfigError(UserError, ValueError):
    """A configuration that cannot run (mesh, model shape, device, ...)."""

    exit_status = 2  # a usage error: argparse's convention


class BackendError(ConfigError):
    """A requested backend (device, NCCL, kernels) cannot be used on this machine."""
