"""Started in every Python process that has this directory on PYTHONPATH:

* ``$CUTP_CUPY_STANDIN=1``: installs the CuPy stand-in (tests/device_path/standin) as ``cupy``
  (the device-path tests and ``make test-device`` set it; a user's run never does);
* ``$COVERAGE_PROCESS_START``: starts coverage measurement (``make coverage``: MPI ranks included),
  and saves the data before cutp ends the job through MPI_Abort (`_SaveBeforeAbort`): MPICH's
  launcher kills every rank with SIGKILL then, so no exit handler runs, and the error paths of
  every multi-rank failure test were lost;
* then runs the ``sitecustomize`` this one shadows, the next one on sys.path (a distribution's or
  an environment's), as Python would have without this directory.
"""
import importlib.util
import os
import sys

sys._cutp_device_shim = True  # (tools/coverage_run.py's root sitecustomize: loaded, not again)

# cutp's functions after which the process may end by MPI_Abort (or the launcher's SIGKILL that
# follows it): {module: names}; the data collected until the call is saved first (what runs after
# it, MPI_Abort's own lines, stays unmeasured: tools/coverage_report.py lists them apart)
ABORT_PATHS = {"cutp.runtime.abort": ("abort_job", "wait_for_output_to_drain"),
               "cutp.runtime.failure": ("end_job_together",)}


class _SaveBeforeAbort:
    """A meta-path finder that wraps, in the modules of ABORT_PATHS as they are imported, the
    functions named there: each saves the coverage data, then runs."""

    def __init__(self, cov):
        self.cov = cov

    def find_spec(self, name, path, target=None):
        if name not in ABORT_PATHS:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None and spec.loader is not None:
                    exec_module = spec.loader.exec_module

                    def wrapped_exec(module, exec_module=exec_module):
                        exec_module(module)
                        for fn in ABORT_PATHS[name]:
                            setattr(module, fn, self._saving(getattr(module, fn)))

                    spec.loader.exec_module = wrapped_exec
                    return spec
        return None

    def _saving(self, fn):
        def call(*args, **kwargs):
            try:
                self.cov.save()
            except Exception:  # (measurement only: never in the way of the run)
                pass
            return fn(*args, **kwargs)

        call.__wrapped__ = fn
        return call


if os.environ.get("COVERAGE_PROCESS_START"):
    try:
        import coverage

        # (coverage 7.10+ installs a .pth that starts it before any sitecustomize: process_startup
        # then returns None, and the measurement already running is the one to save)
        _cov = coverage.process_startup() or coverage.Coverage.current()
        if _cov is not None:
            sys.meta_path.insert(0, _SaveBeforeAbort(_cov))
    except ImportError:
        pass


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(entry or os.getcwd()) != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_chain()

if os.environ.get("CUTP_CUPY_STANDIN") == "1":
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if _root not in sys.path:
        sys.path.insert(0, _root)
    from tests.device_path.standin import install

    install()
