"""Rotary position embedding (RoPE) in HF's ``rotate_half`` layout, with none/linear/llama3 scaling.

Layout (HF Llama, GPT-NeoX style; not Meta's interleaved pairs): over the first ``rotary_dim``
elements of the head dim, element ``i`` is paired with element ``i + rotary_dim/2``, both turned by
the angle ``position * inv_freq[i]``::

    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., h:], x[..., :h])

with ``cos = cos(cat(freqs, freqs))``, ``freqs = position * inv_freq`` (``h = rotary_dim / 2``).
Elements past ``rotary_dim`` (partial rotary) pass unchanged; V is never rotated (the caller's
business). HF checkpoints load unpermuted into this layout (Meta's need the q/k row permutation).

Positions are GLOBAL token positions ([T] or [B, T] integer ids), so a sequence split over
sequence-parallel ranks, pipeline micro-batches, a KV cache's later steps or context-parallel
chunks turns each token by the same angle as the whole sequence does.

Tables: :func:`rope_inv_freq` follows transformers' ``_compute_default_rope_parameters``,
``_compute_linear_scaling_rope_parameters`` and ``_compute_llama3_parameters`` operation by
operation; :func:`rope_tables` multiplies by the positions and takes cos/sin. They are computed
in float64 for a float64 model (float64 throughout) and in float32 otherwise, as HF does (HF
also computes them in float32 for a float64 model: pass ``dtype=float32`` to reproduce that).
For 16-bit inputs the rotation is computed in float32 from the float32 tables and rounded once
(HF rounds cos/sin to the 16-bit dtype and rounds after each 16-bit operation).
"""
from __future__ import annotations

import ctypes
import dataclasses
import math

import numpy as np

from cutp.kernels import dispatch_views as _kernels_views
from cutp.kernels.rotary import rotary_supported
from cutp.runtime.backend import get_array_module, on_host
from cutp.runtime.errors import ConfigError

from . import compiled
from .common import as_dtype, compute_dtype, even_row_blocks, parallel_map

ROPE_TYPES = ("none", "linear", "llama3", "yarn")
_HF_NAMES = {"default": "none", "none": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How inv_freq is rescaled for long contexts.

    ``none``: HF's default RoPE. ``linear``: ``inv_freq / factor`` (position interpolation).
    ``llama3`` (Llama 3.1: factor 8, Llama 3.2 1B/3B: factor 32; low 1, high 4, original 8192):
    wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided
    by ``factor``, shorter than ``original / high_freq_factor`` kept, the band between blended.
    """

    rope_type: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (DeepSeek-V3: factor 40, original 4096, beta 32 / 1, mscale 1 / 1): the frequencies
    # blended between interpolation and extrapolation over the band beta_fast..beta_slow rotations,
    # the tables multiplied by `attention_factor` (0: unset, as transformers' None)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    @property
    def attention_factor(self) -> float:
        """What transformers multiplies cos and sin by (YaRN's; 1 otherwise)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return float(yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim))
        return yarn_mscale(self.factor)

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope scaling type {self.rope_type!r} is not supported; use one of {ROPE_TYPES}")
        if self.rope_type == "none":
            return
        for name in ("factor", "low_freq_factor", "high_freq_factor"):  # Python floats (see rope_inv_freq)
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
                raise ConfigError(f"rope scaling {name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if isinstance(self.original_max_position_embeddings, np.integer):
            object.__setattr__(self, "original_max_position_embeddings", int(self.original_max_position_embeddings))
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor >= 1.0):
            raise ConfigError(f"rope scaling factor must be a number >= 1, got {self.factor!r}")
        if self.rope_type == "yarn" and not (isinstance(self.original_max_position_embeddings, int)
                                             and self.original_max_position_embeddings > 0):
            raise ConfigError("yarn rope scaling needs original_max_position_embeddings a positive integer, got "
                              f"{self.original_max_position_embeddings!r} (DeepSeek-V3 ships 4096)")
        if self.rope_type == "llama3":
            if not self.high_freq_factor > self.low_freq_factor > 0:
                raise ConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                                  f"low {self.low_freq_factor!r}, high {self.high_freq_factor!r} "
                                  "(Llama 3.1/3.2 ship low 1.0, high 4.0)")
            if not (isinstance(self.original_max_position_embeddings, int)
                    and self.original_max_position_embeddings > 0):
                raise ConfigError("llama3 rope scaling needs original_max_position_embeddings a positive integer, "
                                  f"got {self.original_max_position_embeddings!r} (Llama 3.1/3.2 ship 8192)")

    @classmethod
    def from_hf(cls, rope_scaling) -> "RopeScaling":
        """From a ``config.json``'s ``rope_scaling`` (None, or a dict with ``rope_type`` or the old
        key ``type``). llama3 needs ``factor``, ``low_freq_factor``, ``high_freq_factor`` and
        ``original_max_position_embeddings``; linear needs ``factor`` (as transformers requires)."""
        if rope_scaling is None:
            return cls()
        if not isinstance(rope_scaling, dict):
            raise ConfigError(f"rope_scaling must be null or an object, got {rope_scaling!r}")
        name = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if name not in _HF_NAMES:
            raise ConfigError(f"rope_scaling type {name!r} is not supported; cutp implements "
                              f"{sorted(_HF_NAMES)} (set rope_scaling to null or one of these)")
        kind = _HF_NAMES[name]
        need = {"none": (), "linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[kind]
        missing = [k for k in need if rope_scaling.get(k) is None]
        if missing:
            raise ConfigError(f"rope_scaling of type {name!r} lacks {missing}; add them to config.json's rope_scaling")
        if kind == "yarn":
            if rope_scaling.get("attention_factor") is not None or rope_scaling.get("truncate", True) is not True:
                raise ConfigError("yarn rope_scaling with attention_factor or truncate=false is not supported; "
                                  "cutp derives the factor from mscale / mscale_all_dim, as DeepSeek-V3's")
            defaults = (("beta_fast", 32.0), ("beta_slow", 1.0), ("mscale", 0.0), ("mscale_all_dim", 0.0))
            extra = {k: float(rope_scaling.get(k) or default) for k, default in defaults}
            return cls(kind, **{k: rope_scaling[k] for k in need}, **extra)
        return cls(kind, **{k: rope_scaling[k] for k in need})


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * log(scale) + 1 (1 for scale <= 1), as transformers' yarn_get_mscale."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _as_scaling(scaling) -> RopeScaling:
    if scaling is None or scaling == "none":
        return RopeScaling()
    if isinstance(scaling, RopeScaling):
        return scaling
    if isinstance(scaling, dict):
        return RopeScaling.from_hf(scaling)
    raise ConfigError(f"rope scaling must be None, a RopeScaling or an HF rope_scaling dict, got {scaling!r}")


def table_dtype(dtype) -> np.dtype:
    """The dtype RoPE tables are computed in for a model of ``dtype``: float64 for float64, else float32."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def rope_inv_freq(rotary_dim: int, theta: float = 10000.0, scaling=None, dtype=np.float32) -> np.ndarray:
    """HF's ``inv_freq`` [rotary_dim / 2] (host NumPy array in :func:`table_dtype` of ``dtype``).

    ``inv_freq[i] = 1 / theta ** (2i / rotary_dim)``, then the ``scaling`` (None / ``"none"``, a
    :class:`RopeScaling`, or an HF ``rope_scaling`` dict). Each step is the same operation, in the
    same order and the same precision, as in transformers' functions, except that the pow is
    rounded once from double (torch's float32 pow is within an ulp of it): measured equal to
    transformers' 4.57 float32 inv_freq bit for bit wherever the two default inv_freq agree.
    """
    if not (isinstance(rotary_dim, (int, np.integer)) and rotary_dim > 0 and rotary_dim % 2 == 0):
        raise ConfigError(f"rotary dim must be a positive even integer, got {rotary_dim!r} "
                          "(RoPE turns pairs of elements of each head)")
    if isinstance(theta, bool) or not (isinstance(theta, (int, float, np.integer, np.floating)) and theta > 0):
        raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
    sc = _as_scaling(scaling)
    fdt = table_dtype(dtype).type
    # Python numbers, as in HF: NumPy casts them to the arrays' dtype (a NumPy float64 scalar would promote)
    rotary_dim, theta = int(rotary_dim), float(theta)
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(fdt) / rotary_dim
    # theta ** exponents in double, rounded once: NumPy's float32 pow is off by an ulp or two for
    # a sixth of the exponents (measured against torch's, 821 of 4736 elements over 8 thetas x 11
    # head dims); the rounded double agrees with torch's for all but 43 (torch's is within an ulp)
    inv_freq = 1.0 / (theta ** exponents.astype(np.float64)).astype(fdt)
    if sc.rope_type == "linear":
        inv_freq = inv_freq / sc.factor
    elif sc.rope_type == "llama3":
        # HF's code line by line; its Python-number operands stay Python numbers here, so NumPy (like
        # torch) casts each to the array's dtype at the operation (and HF's scalar-only ones run in double)
        factor = sc.factor
        low_freq_factor, high_freq_factor = sc.low_freq_factor, sc.high_freq_factor
        old_context_len = sc.original_max_position_embeddings
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        # torch's `number / tensor` is `tensor.reciprocal() * number` (Tensor.__rdiv__): two roundings
        wavelen = (1.0 / inv_freq) * (2 * math.pi)
        inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = ((1.0 / wavelen) * old_context_len - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, inv_freq_llama)
    elif sc.rope_type == "yarn":  # transformers' _compute_yarn_parameters (truncate=True)
        def correction_dim(rotations):
            return (rotary_dim * math.log(sc.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(theta))

        low = max(math.floor(correction_dim(sc.beta_fast)), 0)
        high = min(math.ceil(correction_dim(sc.beta_slow)), rotary_dim - 1)
        pos_freqs = (theta ** exponents.astype(np.float64)).astype(fdt)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (sc.factor * pos_freqs)
        ramp = np.clip((np.arange(rotary_dim // 2, dtype=fdt) - low) / ((high + 0.001 if low == high else high) - low),
                       0, 1)
        kept = 1 - ramp  # the extrapolation's share
        inv_freq = interpolation * (1 - kept) + extrapolation * kept
    return inv_freq.astype(fdt)


def rope_tables(head_dim: int, positions, theta: float = 10000.0, scaling=None, dtype=np.float32, *,
                rotary_dim: int | None = None, xp=None):
    """``(cos, sin)`` for the given positions: HF's ``cos(cat(freqs, freqs))``, ``freqs = p * inv_freq``.

    ``positions``: an int ``max_len`` (rows for positions ``0..max_len-1``: the table that
    :func:`rotary_forward` indexes with ``positions``), or an integer array of position ids (its
    shape + ``[rotary_dim]``: per-token tables, to pass with ``positions=None``). ``rotary_dim``
    defaults to ``head_dim`` (``< head_dim``: partial rotary, HF's
    ``int(head_dim * partial_rotary_factor)``). Computed in :func:`table_dtype` of ``dtype``, on the
    array module of ``positions`` (NumPy, or ``xp`` when ``positions`` is an int).
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if not (isinstance(head_dim, (int, np.integer)) and 0 < rotary_dim <= head_dim):
        raise ConfigError(f"rotary dim {rotary_dim!r} must lie in 1..head_dim ({head_dim!r})")
    fdt = table_dtype(dtype)
    inv_freq = rope_inv_freq(rotary_dim, theta, scaling, fdt)
    if isinstance(positions, (int, np.integer)):
        if positions < 0:
            raise ConfigError(f"rope table length must be >= 0, got {positions}")
        xp = np if xp is None else xp
        pos = xp.arange(int(positions), dtype=np.int64)
    else:
        xp = get_array_module(positions)
        pos = positions
        _check_positions(pos)
    # HF: inv_freq (float32) @ positions.float() -- a K=1 product, one rounding per element
    freqs = pos.astype(fdt)[..., None] * xp.asarray(inv_freq)
    c, s = xp.cos(freqs), xp.sin(freqs)
    factor = _as_scaling(scaling).attention_factor
    if factor != 1.0:  # (YaRN: transformers multiplies cos and sin)
        c, s = c * factor, s * factor
    return xp.concatenate((c, c), axis=-1), xp.concatenate((s, s), axis=-1)


class RotaryCtx:
    """What ``rotary_backward`` needs (the rotation is linear: no activation is kept): the
    tables, the positions (None: per-token tables), the sequence axis and ``x``'s dtype/shape."""

    __slots__ = ("cos", "sin", "positions", "seq_axis", "dtype", "shape")

    def __init__(self, cos, sin, positions, seq_axis, dtype, shape):
        self.cos, self.sin, self.positions = cos, sin, positions
        self.seq_axis, self.dtype, self.shape = seq_axis, dtype, shape


def _check_positions(positions):
    if not np.issubdtype(positions.dtype, np.integer):
        raise ValueError(f"rotary: positions must be integer position ids, got dtype {positions.dtype}")


def _check_tables(x_shape, cos, sin, positions, seq_axis):
    """The checks of the tables and positions against x (one device sync for the positions' range)."""
    ndim = len(x_shape)
    if not 0 < seq_axis < ndim - 1:
        raise ValueError(f"rotary: seq_axis {seq_axis} must lie strictly between the batch axis 0 and the "
                         f"head-dim axis {ndim - 1} of x {tuple(x_shape)}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    rd = cos.shape[-1]
    if rd % 2 or not 0 < rd <= x_shape[-1]:
        raise ValueError(f"rotary: table width {rd} must be even and at most the head dim {x_shape[-1]}")
    if positions is not None:
        _check_positions(positions)
        if cos.ndim != 2:
            raise ValueError(f"rotary: with positions, cos/sin must be [max_len, rotary_dim] tables, got {cos.shape}")
        if positions.size:
            lo, hi = (int(v) for v in get_array_module(positions).stack([positions.min(), positions.max()]).tolist())
            if lo < 0 or hi >= cos.shape[0]:  # one device sync for both ends
                raise ValueError(f"rotary: positions lie in [{lo}, {hi}] but the tables hold {cos.shape[0]} positions; "
                                 "build them with rope_tables(head_dim, max_len) for a larger max_len")
        T = positions.shape[-1]
        if positions.ndim not in (1, 2) or T != x_shape[seq_axis] or (
                positions.ndim == 2 and positions.shape[0] not in (1, x_shape[0])):
            raise ValueError(f"rotary: positions/tables {tuple(positions.shape)} do not match x {tuple(x_shape)} "
                             f"(sequence axis {seq_axis}, batch axis 0)")
    else:
        if cos.ndim not in (2, 3):
            raise ValueError(f"rotary: per-token cos/sin must be [T, rd] or [B, T, rd], got {tuple(cos.shape)}")
        T = cos.shape[-2]
        if T != x_shape[seq_axis] or (cos.ndim == 3 and cos.shape[0] not in (1, x_shape[0])):
            raise ValueError(f"rotary: positions/tables {tuple(cos.shape[:-1])} do not match x {tuple(x_shape)} "
                             f"(sequence axis {seq_axis}, batch axis 0)")


def _per_token(x_shape, cos, sin, positions, seq_axis):
    """cos/sin per token, shaped to broadcast against x: [T] -> T at ``seq_axis``; [B, T] -> B at axis 0."""
    _check_tables(x_shape, cos, sin, positions, seq_axis)
    ndim = len(x_shape)
    rd = cos.shape[-1]
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    T = cos.shape[-2]
    shape = [1] * ndim
    shape[seq_axis], shape[-1] = T, rd
    if cos.ndim == 3:
        shape[0] = cos.shape[0]
    return cos.reshape(shape), sin.reshape(shape)


def _rotation_tables(xp, x_shape, c, s, transpose):
    """The per-token tables tiled to ``[c's batch, *x_shape[1:-1], rd]`` (C-contiguous), as
    ``(cos, signed_swapped_sin)``: ``cos`` as it is; the sin table with its halves in the order the
    swapped halves of x meet them and the sign of the rotation folded in, ``[-s1, s2]`` (``R``) or
    ``[s2, -s1]`` (``R^T``). Negation is exact, so ``x2 * -s1`` is ``-(x2 * s1)`` to the bit."""
    rd = c.shape[-1]
    h = rd // 2
    shape = (c.shape[0],) + tuple(x_shape[1:-1]) + (rd,)
    ct = xp.ascontiguousarray(xp.broadcast_to(c, shape))
    st = xp.empty(shape, s.dtype)
    if transpose:
        st[..., :h] = s[..., h:]
        xp.negative(s[..., :h], out=st[..., h:])
    else:
        xp.negative(s[..., :h], out=st[..., :h])
        st[..., h:] = s[..., h:]
    return ct, st


def _rotate(xp, x, ct, st, out):
    """out[..., :rd] = R x[..., :rd] (R^T when the tables are R^T's), out[..., rd:] = x[..., rd:].

    R on a pair (x1, x2) = (x[i], x[i + h]): y1 = c1 x1 - s1 x2, y2 = s2 x1 + c2 x2 (c1/c2, s1/s2
    the tables' two halves, equal for HF's tables); R^T: y1 = c1 x1 + s2 x2, y2 = c2 x2 - s1 x1.
    Computed as ``x * cos + swap(x) * st`` with ``st`` from :func:`_rotation_tables` (the same
    products and one addition each: the bits of the pairwise formula). Readability paid for
    speed: each pass over a half of the head dim runs NumPy inner loops of rd/2 elements (8 at
    head dim 16), so only the swap copies x by halves and every product and the sum run over
    whole tiled rows (measured 2.3 -> 0.85 ms for llama-tiny's [16, 128, 12, 16] q/k heads, one
    thread). ``out`` may be ``x`` itself (every read of x comes before the write)."""
    cdt = compute_dtype(x.dtype)
    rd = ct.shape[-1]
    h = rd // 2
    xr = as_dtype(x[..., :rd], cdt)
    y = xr * as_dtype(ct, cdt)
    swapped = xp.empty(xr.shape, cdt)
    swapped[..., :h] = xr[..., h:]
    swapped[..., h:] = xr[..., :h]
    swapped *= as_dtype(st, cdt)
    if out.dtype == cdt:
        xp.add(y, swapped, out=out[..., :rd])
    else:
        y += swapped
        out[..., :rd] = y
    if rd < x.shape[-1]:
        out[..., rd:] = x[..., rd:]  # a no-op copy when out is x
    return out


def _rotate_blocks(xp, x, c, s, out, transpose):
    """:func:`_rotate` over blocks of the batch axis, on the ops' threads (NumPy). Tables shared by
    the batch rows are tiled once; per-row tables block by block."""
    batched = c.shape[0] > 1
    tables = None if batched else _rotation_tables(xp, x.shape, c, s, transpose)

    def block(sl):
        ct, st = _rotation_tables(xp, x[sl].shape, c[sl], s[sl], transpose) if batched else tables
        _rotate(xp, x[sl], ct, st, out[sl])

    # the blocks' split changes no bit (each element is computed alone): equal blocks, an even
    # number of them, so that two threads get the same work
    parallel_map(xp, block, even_row_blocks(xp, x.shape[0], x.size // max(x.shape[0], 1)))
    return out


def _output(xp, x, out, what):
    if out is None:
        return xp.empty(x.shape, dtype=x.dtype)
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        raise ValueError(f"{what}: out {tuple(out.shape)} {out.dtype} must match the input {tuple(x.shape)} {x.dtype}")
    return out


def _rotary_kernel(x, ctx: RotaryCtx, out, transpose):
    """The CUDA kernel's result (kernels/rotary.cu) when it takes these operands (CuPy, float32 /
    bfloat16, [B, T, heads, hd] views with a contiguous head dim, float32 tables), else None."""
    k = _kernels_views(x, out, ctx.cos, ctx.sin)
    if k is None or rotary_supported(x, ctx.cos, ctx.sin, ctx.positions, ctx.seq_axis, out) is not None:
        return None
    _check_tables(x.shape, ctx.cos, ctx.sin, ctx.positions, ctx.seq_axis)
    if out is not None and (tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype):
        _output(k.xp, x, out, "rotary")  # its error
    return k.rotary(x, ctx.cos, ctx.sin, ctx.positions, out=out, transpose=transpose)


# The compiled CPU path (kernels/cpu/rotary.c): both halves of each pair in one pass over x, in
# place on the QKV buffer's heads, for float32 / float64 host x [B, T, heads, hd] with a contiguous
# head dim and tables of x's dtype shared by the batch rows (positions None or [T]); the NumPy code
# above is its reference (per-row tables, other layouts and dtypes stay there).
_SYMBOLS = ("rotary_f32", "rotary_f64")


def _rotate_compiled(xp, x, ctx: RotaryCtx, out, transpose):
    """The compiled rotation's result when it takes these operands, else None."""
    if x.ndim != 4 or ctx.seq_axis != 1 or compiled.suffix(x.dtype) is None or ctx.cos.dtype != x.dtype or (
            ctx.positions is not None and ctx.positions.ndim != 1) or (ctx.positions is None and ctx.cos.ndim != 2):
        return None
    outs = () if out is None else (out,)
    if not on_host(xp) or not compiled.rows_contiguous(x, *outs) or not compiled.writable(*outs):
        return None
    lib = compiled.host_library("rotary", _SYMBOLS, ctx.cos, ctx.sin)
    if lib is None:
        return None
    y = _output(xp, x, out, "rotary")
    _check_tables(x.shape, ctx.cos, ctx.sin, ctx.positions, ctx.seq_axis)
    c, s = (ctx.cos, ctx.sin) if ctx.positions is None else (ctx.cos[ctx.positions], ctx.sin[ctx.positions])
    B, T, heads, hd = x.shape
    if xp is np:
        fn = compiled.entry(lib, "rotary", x.dtype)
        c, s = np.ascontiguousarray(c), np.ascontiguousarray(s)  # (named: the pointers must outlive the call)
        args = [compiled.ptr(x), compiled.strides(x), compiled.ptr(y), compiled.strides(y), *compiled.pointers(c, s),
                *compiled.int64s(T, heads, hd, c.shape[-1]), ctypes.c_int(int(transpose))]
        parallel_map(xp, lambda sl: fn(*args, *compiled.int64s(sl.start, sl.stop)),
                     even_row_blocks(xp, B * T, heads * hd))
    return y


def rotary_forward(x, cos, sin, positions=None, *, seq_axis: int = 1, out=None):
    """Rotate the head dim of ``x`` [B, T, *heads, head_dim] by its tokens' positions.

    ``cos``/``sin``: a table [max_len, rotary_dim] from :func:`rope_tables` indexed by
    ``positions`` (global integer ids, [T] shared by the batch or [B, T]), or, with
    ``positions=None``, per-token tables [T, rotary_dim] / [B, T, rotary_dim]. ``seq_axis``: where
    T is in ``x`` (1 for [B, T, heads, hd], the QKV projection's output viewed per head; 3 for
    the attention op's [B, nkv, g, T, hd]). Any number of heads (GQA: q and k alike).
    ``out``: where to write (may be ``x`` itself: in place). The tables live on ``x``'s device
    (``rope_tables(..., xp=cupy)``); host position ids are moved there.

    Returns ``(y, ctx)``; ``y`` in ``x``'s dtype (16-bit computed in float32).
    """
    xp = get_array_module(x, cos, sin, positions)
    if positions is not None:
        positions = xp.asarray(positions)  # host ids index device tables as device ids
    ctx = RotaryCtx(cos, sin, positions, seq_axis, x.dtype, tuple(x.shape))
    y = _rotary_kernel(x, ctx, out, transpose=False)
    if y is None:
        y = _rotate_compiled(xp, x, ctx, out, transpose=False)
    if y is not None:
        return y, ctx
    c, s = _per_token(x.shape, cos, sin, positions, seq_axis)
    y = _rotate_blocks(xp, x, c, s, _output(xp, x, out, "rotary_forward"), transpose=False)
    return y, ctx


def rotary_backward(dy, ctx: RotaryCtx, *, out=None):
    """``dx = R^T dy``: the transpose (inverse) rotation, in ``x``'s dtype; ``out`` may be ``dy``."""
    if tuple(dy.shape) != ctx.shape:
        raise ValueError(f"rotary_backward: dy shape {tuple(dy.shape)} != x shape {ctx.shape}")
    xp = get_array_module(dy, ctx.cos, ctx.sin, ctx.positions)
    if dy.dtype != ctx.dtype:
        dy = dy.astype(ctx.dtype)
    y = _rotary_kernel(dy, ctx, out, transpose=True)
    if y is None:
        y = _rotate_compiled(xp, dy, ctx, out, transpose=True)
    if y is not None:
        return y
    c, s = _per_token(dy.shape, ctx.cos, ctx.sin, ctx.positions, ctx.seq_axis)
    return _rotate_blocks(xp, dy, c, s, _output(xp, dy, out, "rotary_backward"), transpose=True)
