"""Started in every Python process that has this directory on PYTHONPATH:

* ``$CUTP_CUPY_STANDIN=1``: installs the CuPy stand-in (tests/device_path/standin) as ``cupy``
  (the device-path tests and ``make test-device`` set it; a user's run never does);
* ``$COVERAGE_PROCESS_START``: starts coverage measurement (``make coverage``: MPI ranks included).
"""
import os
import sys

if os.environ.get("COVERAGE_PROCESS_START"):
    try:
        import coverage

        coverage.process_startup()
    except ImportError:
        pass

if os.environ.get("CUTP_CUPY_STANDIN") == "1":
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if _root not in sys.path:
        sys.path.insert(0, _root)
    from tests.device_path.standin import install

    install()
