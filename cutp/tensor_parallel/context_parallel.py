"""Context parallelism: each sequence split over the CP group, and the ring attention that joins it.

The split (Megatron's and ring-flash-attention's zigzag, for causal load balance): a sequence of
T tokens is cut into 2 cp chunks of c = T / (2 cp) tokens, and CP rank r holds chunks r and
2cp-1-r, in that order: its "local sequence" of T / cp tokens. Every module but the attention
works on its tokens alone; what depends on a token's place (learned positions, RoPE, the
dropout masks, which are keyed by global position) takes it from `zigzag_positions`, so the
model sees global positions and no layout changes the math. The token ids and the targets are
taken from the whole sequence with the same positions (`take_local`), after the targets' shift.

The ring attention (`ring_attention_forward` / `_backward`): the local queries meet the keys of
every rank, one rank's K,V at a time. Step i (0 <= i < cp) holds the K,V of rank (r - i) mod cp;
before computing on them it posts their send to rank r+1 and the receive of the next ones from
rank r-1 (`Communicator.start_exchange`: MPI Isend/Irecv, NCCL on a side stream), and waits for
those after its compute, so the transfer overlaps the attention. A pair (query chunk a, key
chunk b) is a full tile when a > b, the diagonal (causal) tile when a == b, and skipped when
a < b: with the zigzag every rank computes the same number of tiles (2 at step 0, 2 after).
The tiles' partial outputs merge by their log-sum-exp (`cutp.ops.attention_tiles`) in float32
(float64 for float64 models); on a GPU each tile runs on the fused attention kernels (its
positions their diagonal shift, nothing c x c in memory), elsewhere on array code. The backward runs the ring again with the merged o and lse: dQ
stays local, and the dK,dV of each K,V travel with it (each rank adds its tiles' part to the
partial it receives, and passes it on; after the last step one more shift brings every dK,dV
home). K and V travel as one flat message (`_pack_kv`; V's head dim may differ from K's, as MLA's
does). One message group per step, both directions of the same size: forward cp-1 sends of the
local K,V per layer ((cp-1)/cp of a sequence's K,V bytes each way), backward cp-1 of K,V and cp
of dK,dV.

The all-to-all attention (`--cp-comm a2a`, DeepSpeed-Ulysses: `ulysses_attention_forward` /
`_backward`): one all-to-all over the CP group turns q, k, v from this rank's tokens of every
(TP-local) head into every token of its cp-th of the query heads with their KV heads, the
attention runs on whole sequences there (the one-rank op, its dropout at the heads' global
places), and one all-to-all turns o back (the backward: do there, dq, dk, dv back). The query
heads must split over cp, and cp divide the KV heads or be a multiple of them
(`check_context_parallel` refuses otherwise, naming them): with fewer KV heads than cp each goes
to the cp / nkv ranks of its query heads (`ulysses_heads`, as TP copies a KV head when tp >
n_kv_head) and its dK,dV come back as the sum of theirs. Bytes per layer each way: q, k, v (k, v
once per copy) and o of the local sequence, (cp-1)/cp of them leaving.

Local attention and packed sequences (the mask rule of `cutp.ops.attention`: `window`,
`softcap`, `documents` [B, T] of the whole sequence, non-decreasing ids): each ring tile carries
its chunks' global first indices and its rows' and keys' document ids (`_tile_rule`); a tile whose
chunks lie wholly outside the window, or share no document in any batch row, is skipped in both
directions (no compute; its K,V still pass on). The all-to-all attention runs whole sequences, the
one-rank op with the whole documents.

`OVERLAP = False` (a module switch, for tests and measurements) posts each exchange after the
step's compute and finishes it at once: the same arithmetic in the same order, so bit-identical
results.
"""
from __future__ import annotations

import math

import numpy as np

from ..ops import attention_tiles as tiles
from ..ops.attention import causal_attention_backward, causal_attention_forward
from ..ops.common import as_dtype, compute_dtype
from ..runtime.backend import get_array_module, to_numpy
from ..runtime.errors import ConfigError

# Exchanges posted before each ring step's compute and waited after it (False: after it, at once).
OVERLAP = True
TAG_KV, TAG_DKV = 11, 12  # MPI tags of the ring's two streams of messages (NCCL matches by order)


# ---- the zigzag split ----------------------------------------------------------------------
def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) CP rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_positions(T: int, cp: int, rank: int) -> np.ndarray:
    """The global positions [T / cp] of CP rank `rank`'s tokens of a T-token sequence, in its
    local order (chunk r, then chunk 2cp-1-r)."""
    c = T // (2 * cp)
    a, b = zigzag_chunks(cp, rank)
    return np.concatenate([np.arange(a * c, (a + 1) * c), np.arange(b * c, (b + 1) * c)])


def take_local(a, cp: int, rank: int):
    """This CP rank's tokens of [B, T] token ids or targets (a copy; any array module)."""
    xp = get_array_module(a)
    return a[:, xp.asarray(zigzag_positions(a.shape[1], cp, rank))]


def local_segments(local_len: int, cp: int, rank: int, start: int, stop: int) -> list[tuple[int, int, int]]:
    """Tokens [start, stop) of CP rank `rank`'s local sequence (of local_len = T / cp tokens) as
    runs of consecutive global positions: [(offset in [start, stop), first global position,
    tokens)]. One run, or two where the range crosses from the first chunk into the second."""
    c = local_len // 2
    a, b = zigzag_chunks(cp, rank)
    runs = []
    for lo, hi, first in ((0, c, a * c), (c, local_len, b * c)):
        s, e = max(start, lo), min(stop, hi)
        if e > s:
            runs.append((s - start, first + s - lo, e - s))
    return runs


def check_sequence_splits(T: int, cp: int) -> None:
    """ValueError naming the numbers when T does not split into 2 cp equal chunks."""
    if T % (2 * cp):
        raise ValueError(f"sequence length {T} is not divisible by 2*cp = {2 * cp}: context parallelism cuts each "
                         f"sequence into 2*cp chunks; use a multiple of {2 * cp}")


COMMS = ("ring", "a2a")


def _ulysses_fits(cp: int, local_q: int, local_kv: int) -> bool:
    """Whether the all-to-all attention splits local_q query heads of local_kv KV heads over cp
    ranks (`ulysses_heads`)."""
    return local_q % cp == 0 and (local_kv % cp == 0 or cp % local_kv == 0)


def _split_fixes(seq_len: int, cp: int, tp: int, sequence_parallel: bool, fit_ranks) -> str:
    """"a multiple of N, or a `cp` from [...]": the seq_len and the cp sizes (fit_ranks(c)) that
    pass every rule: 2cp chunks (none at cp 1) and, under sequence parallelism, seq_len / cp over tp."""
    multiple = math.lcm(2 * cp, cp * tp) if sequence_parallel else 2 * cp
    options = [c for c in range(1, seq_len + 1) if (c == 1 or seq_len % (2 * c) == 0) and fit_ranks(c)
               and (not sequence_parallel or (seq_len // c) % tp == 0)]
    return f"a multiple of {multiple}" + (f", or a `cp` from {options}" if options else "")


def check_context_parallel(seq_len: int, cp: int, tp: int, sequence_parallel: bool, comm: str = "ring",
                           n_head: int = 1, n_kv_head: int | None = None, ranks: int | None = None) -> None:
    """A run's context parallelism (RunConfig's check): ConfigError naming the numbers and a fix.
    ranks: the run's cp x dp, which another cp would share (the cp sizes offered divide it; None:
    any, the planner's)."""
    if cp == 1:
        return
    fit_ranks = lambda c: ranks is None or ranks % c == 0  # noqa: E731
    if comm == "a2a":
        n_kv_head = n_kv_head or n_head
        local_q = n_head // tp
        local_kv = n_kv_head // tp if tp <= n_kv_head else 1  # (tp > n_kv_head: one replicated KV head a rank)
        if not _ulysses_fits(cp, local_q, local_kv):
            fits = [c for c in range(1, local_q + 1) if _ulysses_fits(c, local_q, local_kv) and fit_ranks(c)]
            why = (f"does not divide {local_q}" if local_q % cp else
                   f"neither divides {local_kv} nor is a multiple of it")
            raise ConfigError(f"`cp_comm` a2a splits each TP rank's query heads over the CP ranks, with their KV heads "
                              f"(or copies of one): n_head {n_head} and n_kv_head {n_kv_head} / tp {tp} leave "
                              f"{local_q} query and {local_kv} KV head(s) a rank, and `cp` {cp} {why}; use a `cp` "
                              f"from {fits} or `cp_comm` ring")
    if seq_len % (2 * cp):
        raise ConfigError(f"`seq_len` {seq_len} is not divisible by 2*cp = {2 * cp}: context parallelism cuts each "
                          f"sequence into 2*cp chunks (CP rank r holds chunks r and 2cp-1-r); use a `seq_len` that is "
                          + _split_fixes(seq_len, cp, tp, sequence_parallel, fit_ranks))
    if sequence_parallel and (seq_len // cp) % tp:
        raise ConfigError(f"`seq_len` {seq_len} / cp {cp} = {seq_len // cp} tokens per CP rank is not divisible by "
                          f"`tp` {tp}: `sequence_parallel` splits them over the TP ranks; use a `seq_len` that is "
                          + _split_fixes(seq_len, cp, tp, sequence_parallel, fit_ranks))


# ---- ring attention -----------------------------------------------------------------------
class RingCtx:
    """What the ring attention's backward needs: the local q, k, v, the merged o (q's dtype) and
    the log-sum-exp of each local query chunk (a pair of [B, nkv, g, c] arrays, compute dtype),
    the scale, the dropout and the mask rule (`MaskRule`)."""

    fused = False

    def __init__(self, q, k, v, o, lse, scale, dropout, rule=None):
        self.q, self.k, self.v, self.o, self.lse = q, k, v, o, lse
        self.scale, self.dropout, self.rule = scale, dropout, rule


def _tile_kind(query_chunk: int, key_chunk: int):
    """'full', 'causal' (the diagonal) or None (every key after every query: skipped)."""
    if query_chunk > key_chunk:
        return "full"
    return "causal" if query_chunk == key_chunk else None


_LAST_IDS: list = [None, None]  # the last documents array seen and its host copy


def _host_ids(documents):
    """A host copy of the documents (a device array read once: every layer of a forward gets the
    same one, which the model makes afresh for each forward)."""
    if isinstance(documents, np.ndarray):
        return documents
    if _LAST_IDS[0] is not documents:
        _LAST_IDS[:] = [documents, to_numpy(documents)]
    return _LAST_IDS[1]


class MaskRule:
    """The ring's window, soft-cap and documents (the whole sequences' ids [B, T], and a host
    copy of them for the skipping decisions), per chunk of c tokens."""

    def __init__(self, window=None, softcap=None, documents=None):
        self.window, self.softcap, self.documents = window, softcap, documents
        self.host = None if documents is None else _host_ids(documents)

    def visible(self, query_chunk: int, key_chunk: int, c: int) -> bool:
        """Whether any query of the chunk may see any key of the other (else the tile is skipped)."""
        if _tile_kind(query_chunk, key_chunk) is None:
            return False
        if self.window is not None and query_chunk * c - ((key_chunk + 1) * c - 1) >= self.window:
            return False  # the chunk's first query is past its last key's window
        if self.host is not None:  # ids are non-decreasing: the key chunk's last against the query chunk's first
            q_first = self.host[:, query_chunk * c]
            k_last = self.host[:, (key_chunk + 1) * c - 1]
            if query_chunk != key_chunk and not (q_first == k_last).any():
                return False
        return True

    def tile(self, query_chunk: int, key_chunk: int, c: int) -> dict:
        """The tile's keyword arguments for `attention_tiles` (window, softcap, its documents)."""
        docs = None
        if self.documents is not None:
            docs = (self.documents[:, query_chunk * c:(query_chunk + 1) * c],
                    self.documents[:, key_chunk * c:(key_chunk + 1) * c])
        return dict(window=self.window, softcap=self.softcap, documents=docs)


# ---- all-to-all (Ulysses) ---------------------------------------------------------------------
def ulysses_heads(cp: int, nkv: int, g: int) -> tuple[int, int, int]:
    """(KV heads, query heads of each, copies of a KV head) of one CP rank's cp-th of the TP
    rank's nkv KV heads with their g query heads each: nkv / cp whole groups where cp divides
    nkv; else (nkv divides cp) one KV head on cp / nkv ranks, each a contiguous block of its
    query heads. `check_context_parallel` refuses the other cases."""
    if nkv % cp == 0:
        return nkv // cp, g, 1
    rep = cp // nkv
    return 1, g // rep, rep


def _seq_to_heads(group, parts):
    """One all-to-all for several arrays. parts: (a, rep) with a [B, n, *mid, Tl, hd] this rank's
    tokens of n = cp / rep head blocks, block b going to CP ranks b*rep .. (b+1)*rep - 1 (rep > 1:
    a replicated KV head) -> [B, *mid, T, hd] each: every token of the sequence in order, the
    block this rank received."""
    xp = get_array_module(parts[0][0])
    cp = group.size
    sizes = [a.size // a.shape[1] for a, _ in parts]  # the elements of one block: what each rank gets
    send = xp.empty((cp, sum(sizes)), parts[0][0].dtype)
    at = 0
    for (a, rep), size in zip(parts, sizes):  # ranks b*rep+i (i < rep) get block b
        dst = send[:, at:at + size].reshape((a.shape[1], rep, a.shape[0]) + a.shape[2:])
        dst[...] = xp.expand_dims(xp.moveaxis(a, 1, 0), 1)
        at += size
    got = group.all_to_all(send, [1] * cp, [1] * cp)  # [i]: rank i's tokens
    Tl = parts[0][0].shape[-2]
    order = xp.asarray(np.concatenate([zigzag_positions(Tl * cp, cp, i) for i in range(cp)]))
    outs, at = [], 0
    for (a, _), size in zip(parts, sizes):
        mine = got[:, at:at + size].reshape((cp, a.shape[0]) + a.shape[2:])
        out = xp.empty(mine.shape[1:-2] + (Tl * cp, a.shape[-1]), a.dtype)
        out[..., order, :] = xp.moveaxis(mine, 0, -3).reshape(out.shape)
        outs.append(out)
        at += size
    return outs


def _heads_to_seq(group, parts):
    """The inverse of `_seq_to_heads`, one all-to-all: parts (a, rep) with a [B, *mid, T, hd]
    (this rank's head block, every token) -> [B, cp / rep, *mid, Tl, hd] each: this rank's tokens
    of every block, the rep ranks' parts of a replicated block summed (in the compute dtype)."""
    xp = get_array_module(parts[0][0])
    cp = group.size
    T = parts[0][0].shape[-2]
    Tl = T // cp
    order = xp.asarray(np.concatenate([zigzag_positions(T, cp, i) for i in range(cp)]))
    sizes = [a.size // cp for a, _ in parts]
    send = xp.empty((cp, sum(sizes)), parts[0][0].dtype)
    at = 0
    for (a, _), size in zip(parts, sizes):  # [j]: rank j's tokens
        by_rank = a[..., order, :].reshape(a.shape[:-2] + (cp, Tl, a.shape[-1]))
        send[:, at:at + size].reshape((cp,) + a.shape[:-2] + (Tl, a.shape[-1]))[...] = xp.moveaxis(by_rank, -3, 0)
        at += size
    got = group.all_to_all(send, [1] * cp, [1] * cp)  # [j]: head block j
    outs, at = [], 0
    for (a, rep), size in zip(parts, sizes):
        blocks = xp.moveaxis(got[:, at:at + size].reshape((cp,) + a.shape[:-2] + (Tl, a.shape[-1])), 0, 1)
        if rep > 1:  # [B, cp / rep, rep, *mid, Tl, hd]: the copies' contributions
            blocks = blocks.reshape((blocks.shape[0], cp // rep, rep) + blocks.shape[2:])
            blocks = as_dtype(blocks.sum(axis=2, dtype=compute_dtype(a.dtype)), a.dtype)
        outs.append(blocks)
        at += size
    return outs


class UlyssesCtx:
    """The all-to-all attention's backward needs: the whole-sequence attention's own context and
    the copies of each KV head (`ulysses_heads`)."""

    fused = False

    def __init__(self, attention_ctx, rep):
        self.attention, self.rep = attention_ctx, rep


def ulysses_attention_forward(group, q, k, v, scale: float, dropout=None, rule: MaskRule | None = None):
    """(o, UlyssesCtx): q [B, nkv, g, Tl, hd], k and v [B, nkv, Tl, hd] (v's head dim may differ)
    this rank's tokens of the TP-local heads (nkv g divisible by cp, and cp dividing nkv or nkv dividing cp) -> o of
    q's shape; dropout: None or (p, seed, per-batch-row counter offsets of this rank's first
    head, global T); rule: the window, soft-cap and whole documents (`MaskRule`)."""
    cp = group.size
    B, nkv, g, Tl, hd = q.shape
    nkv_r, g_r, rep = ulysses_heads(cp, nkv, g)
    qh, kh, vh = _seq_to_heads(group, [(q.reshape(B, cp, nkv_r, g_r, Tl, hd), 1),
                                       (k.reshape(B, cp // rep, nkv_r, Tl, hd), rep),
                                       (v.reshape(B, cp // rep, nkv_r, Tl, v.shape[-1]), rep)])
    p, seed, offsets = (0.0, 0, 0) if dropout is None else dropout[:3]
    if p:  # this rank's query heads (a contiguous block of the TP rank's) start cp_rank * nkv g / cp heads in
        T = dropout[3]
        first = group.rank * nkv_r * g_r * T * T
        offsets = [o + first for o in offsets]
    mask = {}
    if rule is not None:
        docs = rule.documents
        mask = dict(window=rule.window, softcap=rule.softcap, documents=None if docs is None else (docs, docs))
    o, attention_ctx = causal_attention_forward(qh, kh, vh, scale=scale, dropout_p=p, seed=seed, offset=offsets,
                                                **mask)
    (o,) = _heads_to_seq(group, [(o, 1)])
    return o.reshape(q.shape[:-1] + (v.shape[-1],)), UlyssesCtx(attention_ctx, rep)


def ulysses_attention_backward(group, do, ctx: UlyssesCtx, out=None):
    """(dq, dk, dv) of the forward that made ctx (out: optional arrays to write them into); dk, dv
    of a replicated KV head: the sum of its copies' parts."""
    cp, rep = group.size, ctx.rep
    B, nkv, g, Tl, dv_dim = do.shape  # (v's head dim, which may differ from q's and k's: MLA)
    nkv_r, g_r, _ = ulysses_heads(cp, nkv, g)
    (doh,) = _seq_to_heads(group, [(do.reshape(B, cp, nkv_r, g_r, Tl, dv_dim), 1)])
    dq, dk, dv = causal_attention_backward(doh, ctx.attention)
    dq, dk, dv = _heads_to_seq(group, [(dq, 1), (dk, rep), (dv, rep)])
    grads = (dq.reshape(B, nkv, g, Tl, -1), dk.reshape(B, nkv, Tl, -1), dv.reshape(B, nkv, Tl, dv_dim))
    if out is None:
        return grads
    for dst, grad in zip(out, grads):
        dst[...] = grad
    return out


def _pack_kv(xp, k, v, dtype):
    """k and v in one flat buffer (one message; v's head dim may differ from k's: MLA)."""
    kv = xp.empty(k.size + v.size, dtype)
    kv[:k.size].reshape(k.shape)[...] = k
    kv[k.size:].reshape(v.shape)[...] = v
    return kv


def _unpack_kv(kv, k_shape, v_shape):
    """The (k, v) views of a `_pack_kv` buffer (each contiguous)."""
    n = int(np.prod(k_shape))
    return kv[:n].reshape(k_shape), kv[n:].reshape(v_shape)


def _ring_step(group, sends, recvs, compute):
    """One ring step: the exchange posted before `compute()` and waited after it (OVERLAP), or
    posted and finished after it."""
    if not sends and not recvs:
        compute()
        return []
    if OVERLAP:
        pending = group.start_exchange(sends, recvs)
        compute()
        return pending.wait()
    compute()
    return group.exchange(sends, recvs)


def ring_attention_forward(group, q, k, v, scale: float, dropout=None, rule: MaskRule | None = None):
    """(o, RingCtx): causal attention of this CP rank's queries against the whole sequence's
    keys, over `group` (the CP group; module docstring). q [B, nkv, g, Tl, hd], k and v
    [B, nkv, Tl, hd] this rank's local sequence; dropout: None or (p, seed, per-batch-row
    counter offsets of this rank's first head, global T); rule: the window, soft-cap and
    documents (`MaskRule`; None: the causal rule alone)."""
    rule = rule or MaskRule()
    xp = get_array_module(q, k, v)
    cp, r = group.size, group.rank
    Tl = q.shape[3]
    c = Tl // 2
    mine = zigzag_chunks(cp, r)
    kv = _pack_kv(xp, k, v, k.dtype)  # one message
    acc = [(None, None), (None, None)]
    for step in range(cp):
        theirs = zigzag_chunks(cp, (r - step) % cp)
        sends, recvs = [], []
        if step < cp - 1:
            incoming = xp.empty_like(kv)
            sends, recvs = [(kv, (r + 1) % cp, TAG_KV)], [(incoming, (r - 1) % cp, TAG_KV)]

        def compute(kv=kv, theirs=theirs):
            held_k, held_v = _unpack_kv(kv, k.shape, v.shape)
            for a in range(2):
                qa = q[..., a * c:(a + 1) * c, :]
                for b in range(2):
                    if not rule.visible(mine[a], theirs[b], c):
                        continue
                    o_t, lse_t = tiles.tile_forward(qa, held_k[:, :, b * c:(b + 1) * c], held_v[:, :, b * c:(b + 1) * c],
                                                    scale, (mine[a] * c, theirs[b] * c), dropout,
                                                    **rule.tile(mine[a], theirs[b], c))
                    acc[a] = tiles.merge(*acc[a], o_t, lse_t)

        received = _ring_step(group, sends, recvs, compute)
        if received:
            kv = received[0]
    o = as_dtype(xp.concatenate([acc[0][0], acc[1][0]], axis=3), q.dtype)
    return o, RingCtx(q, k, v, o, (acc[0][1], acc[1][1]), scale, dropout, rule)


def ring_attention_backward(group, do, ctx: RingCtx, out=None):
    """(dq, dk, dv) of the forward that made ctx, for do shaped like o (any strides); out:
    optional arrays of q's, k's and v's shapes (any strides) to write them into."""
    q, k, v = ctx.q, ctx.k, ctx.v
    xp = get_array_module(q, k, v)
    cdt = compute_dtype(q.dtype)
    cp, r = group.size, group.rank
    Tl = q.shape[3]
    c = Tl // 2
    mine = zigzag_chunks(cp, r)
    chunks = [slice(a * c, (a + 1) * c) for a in range(2)]
    rowdot = [(as_dtype(do[..., rows, :], cdt) * as_dtype(ctx.o[..., rows, :], cdt)).sum(axis=-1)  # [B, nkv, g, c]
              for rows in chunks]
    dq = xp.zeros(q.shape, cdt)
    kv = _pack_kv(xp, k, v, k.dtype)
    partial = None  # dK,dV of the K,V held at the previous step, on its way to their owner
    for step in range(cp):
        theirs = zigzag_chunks(cp, (r - step) % cp)
        # the messages to a neighbour in one order on both sides (NCCL matches them by order):
        # the previous step's partial dK,dV first, then the next K,V
        sends, recvs = [], []
        if step > 0:
            partial_in = xp.empty(k.size + v.size, cdt)
            sends.append((partial, (r + 1) % cp, TAG_DKV))
            recvs.append((partial_in, (r - 1) % cp, TAG_DKV))
        if step < cp - 1:
            incoming = xp.empty_like(kv)
            sends.append((kv, (r + 1) % cp, TAG_KV))
            recvs.append((incoming, (r - 1) % cp, TAG_KV))
        dkv = xp.zeros(k.size + v.size, cdt)  # this rank's tiles' part of the held K,V's gradient

        def compute(kv=kv, theirs=theirs, dkv=dkv):
            (held_k, held_v), (dk_t, dv_t) = _unpack_kv(kv, k.shape, v.shape), _unpack_kv(dkv, k.shape, v.shape)
            for a, rows in enumerate(chunks):
                for b, keys in enumerate(chunks):
                    if not ctx.rule.visible(mine[a], theirs[b], c):
                        continue
                    # the tile's gradients added into dq and the held K,V's dK,dV (fused: by the kernels)
                    tiles.tile_backward(do[..., rows, :], q[..., rows, :], held_k[:, :, keys], held_v[:, :, keys],
                                        rowdot[a], ctx.lse[a], ctx.scale, (mine[a] * c, theirs[b] * c), ctx.dropout,
                                        out=(dq[..., rows, :], dk_t[:, :, keys], dv_t[:, :, keys]),
                                        **ctx.rule.tile(mine[a], theirs[b], c))

        received = _ring_step(group, sends, recvs, compute)
        if step > 0:
            dkv += received[0]
        if step < cp - 1:
            kv = received[-1]
        partial = dkv
    # the last partial belongs to rank r + 1: one more shift brings every rank's own home
    mine_total = xp.empty(k.size + v.size, cdt)
    group.exchange([(partial, (r + 1) % cp, TAG_DKV)], [(mine_total, (r - 1) % cp, TAG_DKV)])
    grads = (dq,) + _unpack_kv(mine_total, k.shape, v.shape)
    if out is None:
        return tuple(as_dtype(g, q.dtype) for g in grads)
    for dst, g in zip(out, grads):
        dst[...] = g
    return out
