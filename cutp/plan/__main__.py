"""`python -m cutp.plan ...`: the planner's command line (cutp.plan.cli)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
