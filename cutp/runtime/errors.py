"""Exceptions users see. Every message names the problem and a way to fix it."""


class ConfigError(ValueError):
    """A configuration that cannot run (mesh, model shape, device, ...)."""


class BackendError(ConfigError):
    """A requested backend (device, NCCL, kernels) cannot be used on this machine."""
