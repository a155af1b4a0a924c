"""The runtime: what every other part of cutp stands on. It imports nothing above it.

errors       ConfigError, BackendError: the exceptions users see (settings named by field; a
             command line renders its flags, `settings_named`)
backend      NumPy or CuPy: the array module of an array, the device a run uses, GPU facts
mesh         the mesh of named dimensions (tp, dp, pp; ep carved from dp): ranks, groups, split
             colours, the sizes derived from those given (pure), and the GPU-per-rank rule
threads      BLAS threads per rank and the ops' host thread pool (`parallel_map`)
abort        ending every rank of the job: `abort_job`, after the launcher has read our output
watchdog     the timer that aborts the job when a collective waits on a dead or stuck peer
failure      an error on any rank ends the whole job (excepthook; errors agreed across ranks)
consistency  every rank runs the same configuration (a hash compared across ranks)

`import cutp` loads only the MPI-free ones (errors, backend, mesh): it must work where MPI is
broken, so that `python -m cutp info` can say why. Those that talk to other ranks import mpi4py.
"""
