"""Entry point of every rank started by tests.mpirun.run_mpi: `python -m tests._mpi_entry mod:fn '[args]'`."""
import importlib
import json
import os
import sys
import tempfile


def run_cases(cases):
    """SharedLaunch's worker: each [name, "module:function", args] in turn, every rank finishing a
    case before any starts the next (a barrier); this rank marks each case done, or failed, in the
    launch's marker directory (`<name>.rank<r>`, `<name>.failed.rank<r>`)."""
    from mpi4py import MPI

    done = os.environ.get("CUTP_TEST_DONE_DIR") or tempfile.mkdtemp()
    rank = MPI.COMM_WORLD.Get_rank()
    for name, target, args in cases:
        if rank == 0:
            print(f"--- shared launch: case {name!r} ({target}) ---", flush=True)
        module, _, func = target.partition(":")
        try:
            getattr(importlib.import_module(module), func)(*args)
        except BaseException:
            open(os.path.join(done, f"{name}.failed.rank{rank}"), "w").close()
            raise
        MPI.COMM_WORLD.Barrier()
        open(os.path.join(done, f"{name}.rank{rank}"), "w").close()


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
