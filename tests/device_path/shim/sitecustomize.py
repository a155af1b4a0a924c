"""Installs the CuPy stand-in (tests/device_path/standin) as ``cupy`` in every Python process
started with this directory on PYTHONPATH and ``$CUTP_CUPY_STANDIN=1`` (the device-path tests and
``make test-device`` set both; a user's run never does)."""
import os
import sys

if os.environ.get("CUTP_CUPY_STANDIN") == "1":
    _root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if _root not in sys.path:
        sys.path.insert(0, _root)
    from tests.device_path.standin import install

    install()
