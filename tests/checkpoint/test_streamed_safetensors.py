"""StreamedSafetensors (cutp/checkpoint/files.py): the file a tensor at a time, in any order, is
byte for byte what safetensors writes for the same tensors, and a put copies nothing."""
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from cutp.checkpoint.files import StreamedSafetensors


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "b.weight": rng.standard_normal((3, 5)),
        "a.bias": rng.standard_normal(7).astype(np.float32),
        "c.half": rng.standard_normal((2, 2)).astype(np.float16),
        "d.bf16": rng.standard_normal((4, 3)).astype(ml_dtypes.bfloat16),
        "e.scalar": np.array(2.5, np.float32),
        "f.empty": np.zeros((0, 4), np.float32),
    }


def test_streamed_file_equals_safetensors_bytes(tmp_path):
    tensors = _tensors()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "np"})
    out = StreamedSafetensors(str(tmp_path / "s.safetensors"),
                              {k: (v.shape, str(v.dtype)) for k, v in tensors.items()}, {"format": "np"})
    for name in sorted(tensors, reverse=True):  # not the file's order
        # a transposed view twice: the writer makes it contiguous itself
        out.put(name, tensors[name].T.copy().T if tensors[name].ndim == 2 else tensors[name])
    out.close()
    assert (tmp_path / "s.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_put_writes_without_copying_the_tensor(tmp_path):
    big = np.ones((512, 1024), np.float32)  # 2 MiB
    out = StreamedSafetensors(str(tmp_path / "big.safetensors"), {"w": (big.shape, "float32")}, {})
    tracemalloc.start()
    try:
        out.put("w", big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out.close()
    assert peak < big.nbytes // 4, f"put allocated {peak} bytes for a {big.nbytes}-byte tensor"


def test_put_and_close_refuse_what_the_header_does_not_say(tmp_path):
    out = StreamedSafetensors(str(tmp_path / "x.safetensors"),
                              {"w": ((2, 2), "float32"), "v": ((3,), "float64")}, {})
    with pytest.raises(ValueError, match="w: float64 of 32 bytes, the header says float32 of 16"):
        out.put("w", np.zeros((2, 2)))
    out.put("w", np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"never written: \['v'\]"):
        out.close()
    out.f.close()
