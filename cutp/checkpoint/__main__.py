"""`python -m cutp.checkpoint export SRC DST [--dtype D] | verify CKPT` (cutp.checkpoint.export)."""
import sys

from ..runtime.failure import config_errors_exit
from .export import main

if __name__ == "__main__":
    with config_errors_exit("python -m cutp.checkpoint"):  # a user error: one line, no traceback
        sys.exit(main())
