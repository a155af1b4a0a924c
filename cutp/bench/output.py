"""Where `python -m cutp bench` and `python -m cutp plan` write (--json, --plot): checked before
any work, so that a path they cannot write is one line at the start, not a traceback after the
benchmark (and a stray PATH.tmp), and a file of the user's is not replaced by a report."""
from __future__ import annotations

import json
import os
import tempfile

from ..runtime.errors import ConfigError


def is_report(path: str) -> bool:
    """Whether `path` holds a JSON report these commands wrote (Report.as_dict: its "suite" and
    "tables"), which a rerun may replace."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):  # (UnicodeDecodeError is a ValueError)
        return False
    return isinstance(d, dict) and isinstance(d.get("suite"), str) and isinstance(d.get("tables"), dict)


def check_writable(path: str | None, flag: str, report: bool = False) -> None:
    """ConfigError when `path` cannot be written: a directory, a directory that cannot be made or
    written in (tried: a temporary file made and removed), or (report=True: --json) an existing
    file, not empty, that is not one of these commands' JSON reports."""
    if not path:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; give a file in it, e.g. {flag} "
                          f"{os.path.join(path, 'report.json' if report else 'report.png')}")
    # (an empty file holds nothing to lose: a caller's tempfile.NamedTemporaryFile, say)
    if report and os.path.exists(path) and os.path.getsize(path) > 0 and not is_report(path):
        raise ConfigError(f"{flag} {path} exists and is not a cutp bench or plan JSON report, so it was not "
                          "replaced; give a new path, or remove that file first")
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".cutp-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write in {d} ({e.strerror or e}); give a path in a writable "
                          "directory") from None
