"""Run directories (`--out DIR`): their checkpoints, `latest`, pruning, and the start-up checks.

    DIR/.cutp-lock          held (fcntl.flock) by rank 0 of the job writing into DIR, for its
                            lifetime; it names the holder's host and pid, and is removed at the
                            end. The kernel drops the lock when the holder dies, so the file a
                            killed job leaves behind is no lock: the next job takes it.
    DIR/step-NNNNNNNN/      checkpoints (cutp.checkpoint)
    DIR/latest              JSON naming the newest complete checkpoint: a plain `step-*` name

`prepare_run_dir` runs on rank 0 before any training (build_run): DIR must be a directory that
can be written, no other job may hold it, and checkpoints already in it must be the ones this run
resumes (`--resume` names DIR or one of its checkpoints) or `--overwrite` must say they may go
(they are removed once this run's first checkpoint is complete; never before).
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import sys
import tempfile
import time

from .files import CheckpointError, read_json, read_meta, safe_path
from ..runtime.errors import ConfigError

LOCK_FILE = ".cutp-lock"
_STEP_RE = re.compile(r"step-(\d{1,18})")


def list_checkpoints(out_root: str) -> list[tuple[int, str]]:
    """Complete checkpoints (they have meta.json) under a run directory, oldest first."""
    out = []
    if not os.path.isdir(out_root):
        return out
    for d in os.listdir(out_root):
        m = _STEP_RE.fullmatch(d)
        if m and os.path.isfile(os.path.join(out_root, d, "meta.json")):
            out.append((int(m.group(1)), os.path.join(out_root, d)))
    return sorted(out)


def _healthy(path: str) -> bool:
    """Whether a checkpoint's meta.json reads and checks (a damaged one is neither counted nor removed)."""
    try:
        read_meta(path)
        return True
    except CheckpointError:
        return False


def prune_checkpoints(out_root: str, keep: int, newest_step: int | None = None) -> None:
    """Keeps the `keep` newest healthy checkpoints at or before `newest_step` (the one just
    written) and removes the older healthy ones; `keep` 0 or None keeps all. A checkpoint whose
    meta.json does not check is neither counted nor removed (what is left of it is the user's).
    Checkpoints of later steps (left by an abandoned run that went further) are never pruned in
    its favour: they are kept, and a warning names them."""
    if not keep:
        return
    found = list_checkpoints(out_root)
    if newest_step is not None:
        later = [path for step, path in found if step > newest_step]
        if later:
            print(f"cutp checkpoint: warning: {out_root} holds checkpoints of later steps than the one just "
                  f"written ({', '.join(os.path.basename(p) for p in later)}); 'latest' points to step "
                  f"{newest_step}. Remove them or use another run directory.", file=sys.stderr)
        found = [(step, path) for step, path in found if step <= newest_step]
    healthy = [path for _, path in found if _healthy(path)]
    for path in healthy[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, or a run directory whose `latest` (or newest step-*) is used.
    `latest` may only name a step-* directory inside the run directory."""
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.lexists(latest):
        try:
            name = read_json(safe_path(path, "latest"), 1 << 16)["path"]
            if not (isinstance(name, str) and _STEP_RE.fullmatch(name)):
                raise ValueError(f"it names {name!r}, not a step-* directory of {path}")
            target = safe_path(path, name, "checkpoint")
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError, CheckpointError) as e:
            raise CheckpointError(f"{latest} is malformed or unsafe ({e}); pass a step-* directory explicitly") from None
        if os.path.exists(os.path.join(target, "meta.json")):
            return target
    found = list_checkpoints(path)
    if found:
        return found[-1][1]
    raise CheckpointError(f"no checkpoint in {path}: it has no meta.json, no 'latest' and no complete step-* "
                          "directory")


class RunDirLock:
    """The exclusive lock on a run directory; `release()` (or the process's end) frees it."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Removes the lock file (while still holding it), then drops the lock."""
        if self.fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def lock_run_dir(out: str) -> RunDirLock:
    """Takes DIR/.cutp-lock (non-blocking) and writes this host and pid into it; ConfigError
    naming the holder when another live process has it."""
    path = os.path.join(out, LOCK_FILE)
    for _ in range(10):  # the file may be removed by its holder between our open and our flock
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise ConfigError(f"`out` {out}: cannot create its lock file {path} ({e.strerror}); choose a writable "
                              "directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "host and pid not yet written"
            finally:
                os.close(fd)
            raise ConfigError(f"`out` {out} is in use by another job ({holder}); wait until it ends, or choose "
                              "another `out`") from None
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except OSError:
            same = False
        if same:
            break
        os.close(fd)  # we locked a file its holder had just removed: take the new one
    else:
        raise ConfigError(f"`out` {out}: its lock file {path} keeps being replaced; choose another `out`")
    info = f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)
    return RunDirLock(path, fd)


def prepare_run_dir(out: str, *, resume: str | None = None, overwrite: bool = False):
    """Rank 0's start-up checks of `--out` (module docstring): returns (the lock, the checkpoints
    of another run that --overwrite lets this run replace). Raises ConfigError."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"`out` {out} is a file, not a directory; choose a directory for the checkpoints")
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".cutp-write-test-", dir=out)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"`out` {out} cannot be written ({e.strerror}); choose a writable directory") from None
    lock = lock_run_dir(out)
    try:
        found = [path for _, path in list_checkpoints(out)]
        mine = resume is not None and os.path.realpath(os.path.dirname(os.path.abspath(resume))) == os.path.realpath(out)
        if found and not mine and not overwrite:
            names = ", ".join(os.path.basename(p) for p in found[-3:])
            raise ConfigError(f"`out` {out} holds checkpoints of another run ({names}); pass `resume` {out} to "
                              "continue it, or `overwrite` to replace them")
        return lock, ([] if mine else found)
    except BaseException:
        lock.release()
        raise

