"""cutp's CUDA kernels (kernels/*.cu through cutp.kernels' launchers), one test module per op.

Every test that takes the ``backend`` fixture runs on each backend: ``emulated`` (the CUDA
emulation of tests/cuda_emu on the CPU, every CI run) and ``cuda`` (a GPU through CuPy, skipped
with the reason where there is none). conftest.py and helpers.py say how.
"""
