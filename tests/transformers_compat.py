"""transformers (>= 5) looks for Hugging Face's `kernels` package by import name and imports it
when found; in a checkout of cutp that name is cutp's own kernels/ directory (installed as
cutp.kernels, but importable as `kernels` from the repository root, where the tests run). Told
that the hub's kernels are absent, transformers uses its own PyTorch code, as it does wherever
that package is not installed. Called before any test imports transformers (conftest.py, and
the ranks' entry point); a no-op without transformers."""
import importlib.util
import os


def hide_cutp_kernels_from_transformers() -> None:
    if importlib.util.find_spec("transformers") is None:
        return
    os.environ.setdefault("USE_HUB_KERNELS", "NO")  # from_pretrained would otherwise ask for the hub's kernels
    import transformers.utils as utils
    import transformers.utils.import_utils as import_utils

    def absent(*_args, **_kwargs) -> bool:
        return False

    import_utils.is_kernels_available = absent
    utils.is_kernels_available = absent
