"""CUDA C++ sources of cutp's kernels, installed as the package `cutp.kernels`.

Only data lives here: `cutp.cuda_kernels` reads the `.cu` files with importlib.resources and
compiles them with NVRTC through `cupy.RawModule` at first use.
"""
