"""The planner books what the Llama family's kernels allocate (issue 28).

`cutp plan` runs the kernels' launchers on shape-only GPU arrays (`shape_only_launchers`): for
RMSNorm (forward, the fused residual forward, backward with its per-block partials), SwiGLU and
rotary, what the planner's heap books during each launch and keeps after it must be what the
same launchers allocate on the emulated kernels at the same shapes, in CuPy's 512-byte pool
granularity (as tests/kernels/test_attention.py checks for the fused attention).
"""
import numpy as np
import pytest

from cutp.kernels import Launchers, shape_only_launchers
from cutp.ops import rope_tables
from cutp.runtime.shape_only import ShapeOnly

from .helpers import BF16, F32, RecordingAllocations, randn

ROWS, C, F = 37, 96, 80  # rows not a multiple of a block; odd widths
B, T, HQ, HKV, HD = 2, 12, 4, 2, 64  # a fused QKV buffer under GQA


def _inputs(make, dtype):
    """The launches' inputs, made by `make(shape, dtype, seed)`: NumPy arrays or shape-only ones."""
    qkv = make((B, T, HQ + 2 * HKV, HD), dtype, 6)
    return {"x": make((ROWS, C), dtype, 0), "branch": make((ROWS, C), dtype, 1), "w": make((C,), dtype, 2),
            "dy": make((ROWS, C), dtype, 3), "gate_up": make((ROWS, 2 * F), dtype, 4),
            "dy_f": make((ROWS, F), dtype, 5), "qk": qkv[:, :, :HQ + HKV]}


def _launches(k, a, rstd, cos, sin, positions):
    """(name, call) per launch; each call returns what the launch keeps."""
    return [
        ("rmsnorm_forward", lambda: k.rmsnorm_forward(a["x"], a["w"], 1e-5)),
        ("residual_rmsnorm_forward", lambda: k.residual_rmsnorm_forward(a["x"], a["branch"], a["w"], 1e-5)),
        ("rmsnorm_backward", lambda: k.rmsnorm_backward(a["dy"], a["x"], a["w"], rstd)),
        ("swiglu_forward", lambda: (k.swiglu_forward(a["gate_up"]),)),
        ("swiglu_backward", lambda: (k.swiglu_backward(a["dy_f"], a["gate_up"]),)),
        ("rotary in place", lambda: (k.rotary(a["qk"], cos, sin, positions, out=a["qk"]),)),
        ("rotary into a new array", lambda: (k.rotary(a["qk"], cos, sin, positions),)),
    ]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_the_planner_books_what_the_llama_kernels_allocate(emulated_module, dtype):
    cos, sin = rope_tables(HD, 64, 10000.0, None, np.float32)
    positions = np.arange(3, 3 + T)

    xp = ShapeOnly("cuda")
    heap = xp.heap
    planned = shape_only_launchers(xp)
    shaped = _inputs(lambda shape, dt, seed: xp.empty(shape, dt), dtype)
    s_cos, s_sin, s_rstd = xp.asarray(cos), xp.asarray(sin), xp.empty((ROWS,), np.float32)
    plan = {}
    for name, call in _launches(planned, shaped, s_rstd, s_cos, s_sin, positions):
        start = heap.cur
        heap.reset_peak()
        kept = call()
        plan[name] = (heap.peak - start, heap.cur - start, kept)

    rec = RecordingAllocations()
    k = Launchers(lambda name: emulated_module, rec)
    real = _inputs(lambda shape, dt, seed: randn(shape, dt, seed=seed), dtype)
    rstd = k.rmsnorm_forward(real["x"], real["w"], 1e-5)[1]
    size = heap.size
    for name, call in _launches(k, real, rstd, cos, sin, positions):
        rec.nbytes.clear()
        outputs = [o for o in call() if o is not None]
        peak, kept, _ = plan[name]
        assert peak == sum(size(n) for n in rec.nbytes), name
        new = [o for o in outputs if o is not real["qk"]]  # (in place: nothing new kept)
        assert kept == sum(size(o.nbytes) for o in new), name
