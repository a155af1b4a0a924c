"""Entry point of every rank started by tests.mpirun.run_mpi: `python -m tests._mpi_entry mod:fn '[args]'`."""
import importlib
import json
import os
import sys


def main():
    from mpi4py import MPI

    from cutp.runtime.failure import install_abort_on_error

    install_abort_on_error()
    from tests.transformers_compat import hide_cutp_kernels_from_transformers

    hide_cutp_kernels_from_transformers()
    target, args = sys.argv[1], json.loads(sys.argv[2])
    module, _, func = target.partition(":")
    fn = getattr(importlib.import_module(module), func)
    fn(*args)
    done = os.environ.get("CUTP_TEST_DONE_DIR")
    if done:
        open(os.path.join(done, f"rank{MPI.COMM_WORLD.Get_rank()}.done"), "w").close()


if __name__ == "__main__":
    main()
