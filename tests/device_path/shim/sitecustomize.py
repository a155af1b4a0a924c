"""Started in every Python process that has this directory on PYTHONPATH:

* ``$CUTP_CUPY_STANDIN=1``: installs the CuPy stand-in (tests/device_path/standin) as ``cupy``
  (the device-path tests and ``make test-device`` set it; a user's run never does);
* ``$COVERAGE_PROCESS_START``: starts coverage measurement (``make coverage``: MPI ranks included);
* then runs the ``sitecustomize`` this one shadows, the next one on sys.path (a distribution's or
  an environment's), as Python would have without this directory.
"""
import importlib.util
import os
import sys

if os.environ.get("COVERAGE_PROCESS_START"):
    try:
        import coverage

        coverage.process_startup()
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
