"""Tensor-parallel layers at TP=2, 4 and 8 equal TP=1: outputs, input gradients and every
parameter gradient (shards gathered), within 1e-10 relative in float64 and 1e-5 in float32."""
import functools

import numpy as np
import pytest

import cutp
import cutp.ops.attention as attention_op
from cutp import ops
from cutp.ops import compiled as compiled_ops
from cutp.models import GPT, GPTConfig
from cutp.tensor_parallel import (BlockSpec, ColumnParallelLinear, ParallelAttention, ParallelMLP,
                                  ParallelTransformerBlock, RNGTracker, RowParallelLinear, VocabParallelCrossEntropy, VocabParallelEmbedding,
                                  gather_full, pad_vocab)
from cutp.tensor_parallel.mappings import gather_from_tp_forward
from cutp.tensor_parallel.specs import AttentionSpec, MLPSpec, NormSpec
from tests.mpirun import SharedLaunch, run_mpi
from tests.tp_utils import assert_close, full_grads, group_ctx, self_ctx, tol

B, T = 2, 5


def _rand(seed, shape, dtype):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _run_dense(ctx, build, x, dtype, sharded_out=False):
    """forward, a fixed random upstream gradient, backward; returns full output, dx, full grads."""
    m = build(ctx)
    y = m.forward(x.copy() if x.dtype.kind == "f" else x)
    y_full = gather_from_tp_forward(ctx.tp, y) if sharded_out else y
    dout = _rand(99, y_full.shape, dtype)
    if sharded_out:
        k = y.shape[-1]
        dout_local = np.ascontiguousarray(dout[..., ctx.tp_rank * k:(ctx.tp_rank + 1) * k])
    else:
        dout_local = dout
    dx = m.backward(dout_local)
    grads = full_grads(m, ctx)
    if isinstance(m, VocabParallelEmbedding):  # padding differs with TP: compare the real rows
        g = grads["tok_embed.weight"]
        assert not g[m.vocab_size:].any(), "padded vocabulary rows received gradient"
        grads["tok_embed.weight"] = g[: m.vocab_size]
    return {"out": y_full, "dx": dx, "grads": grads}


def _compare(n, build, x, dtype, sharded_out=False, what=""):
    ctx, sub = group_ctx(n)
    ref = _run_dense(self_ctx(), build, x, dtype, sharded_out)
    got = _run_dense(ctx, build, x, dtype, sharded_out)
    t = tol(dtype)
    assert_close(got["out"], ref["out"], t, f"{what} tp={n} output")
    if ref["dx"] is not None:
        assert_close(got["dx"], ref["dx"], t, f"{what} tp={n} dx")
    assert_close(got["grads"], ref["grads"], t, f"{what} tp={n} grads")
    ctx.close()


# ---- workers ---------------------------------------------------------------------------------
def _worker_layers(n):
    cols = 12 if 12 % n == 0 else 24  # column outputs split evenly over TP (TP=8: 3 columns per rank)
    for dtype in (np.float64, np.float32):
        h = 8  # at TP=8 the row-parallel input is one feature per rank
        x = _rand(1, (B, T, h), dtype)
        _compare(n, lambda c: ColumnParallelLinear(c, h, cols, name="col", gather_output=True, dtype=dtype, seed=3),
                 x, dtype, what="column(gather)")
        _compare(n, lambda c: ColumnParallelLinear(c, h, cols, name="col", bias=False, dtype=dtype, seed=3),
                 x, dtype, sharded_out=True, what="column(sharded,no bias)")
        _compare(n, lambda c: RowParallelLinear(c, h, 6, name="row", input_is_parallel=False, dtype=dtype, seed=3),
                 x, dtype, what="row(replicated input)")
        _compare(n, lambda c: ParallelMLP(c, h, 16, name="mlp", dtype=dtype, seed=4), x, dtype, what="mlp")
        _compare(n, lambda c: ParallelMLP(c, h, 16, name="mlp", bias=False, gelu="none", dtype=dtype, seed=4),
                 x, dtype, what="mlp(erf,no bias)")
        ids = np.random.default_rng(2).integers(0, 97, (B, T))
        vp = pad_vocab(97, n, 8)
        _compare(n, lambda c: VocabParallelEmbedding(c, 97, vp if c.tp_size > 1 else pad_vocab(97, 1, 8), h,
                                                     name="tok_embed", dtype=dtype, seed=5),
                 ids, dtype, what="embedding(vocab 97)")


def _worker_attention(n, cases):
    for n_head, n_kv, dtype in cases:
        dtype = np.dtype(dtype).type
        h = 4 * n_head
        x = _rand(7, (B, T, h), dtype)

        def build(c, n_head=n_head, n_kv=n_kv, dtype=dtype):
            return ParallelAttention(c, h, n_head, n_kv, name="attn", rng=RNGTracker(0, c.tp_rank), dtype=dtype, seed=6)

        _compare(n, build, x, dtype, what=f"attention(n_head={n_head}, n_kv={n_kv})")

        def build_block(c, n_head=n_head, n_kv=n_kv, dtype=dtype):
            spec = BlockSpec(h, NormSpec(), AttentionSpec(h, n_head, n_kv, h // n_head, n_layer=2),
                             MLPSpec(h, 4 * h, n_layer=2))
            return ParallelTransformerBlock(c, spec,
                                            name="layers.0", rng=RNGTracker(0, c.tp_rank), dtype=dtype, seed=8)

        _compare(n, build_block, x, dtype, what=f"block(n_head={n_head}, n_kv={n_kv})")


def _ce_run(ctx, V, smoothing, dtype, ignore):
    vp = pad_vocab(V, ctx.tp_size, 4)
    rng = np.random.default_rng(11)
    real = rng.standard_normal((B * T, V)) * 3
    # padded columns hold large values: they must still never win the softmax
    full = np.concatenate([real, np.full((B * T, vp - V), 50.0)], axis=1).astype(dtype)
    targets = rng.integers(0, V, B * T)
    if ignore:
        targets[::3] = -100
    per = vp // ctx.tp_size
    shard = np.ascontiguousarray(full[:, ctx.tp_rank * per:(ctx.tp_rank + 1) * per])
    ce = VocabParallelCrossEntropy(ctx, V, vp, label_smoothing=smoothing)
    loss = ce.forward(shard, targets)
    d = ce.backward(1.0)
    dfull = gather_from_tp_forward(ctx.tp, d)
    return loss, dfull[:, :V], dfull[:, V:], full[:, :V], targets


def _worker_cross_entropy(n):
    from cutp import ops

    ctx, _ = group_ctx(n)
    for dtype in (np.float64, np.float32):
        for smoothing in (0.0, 0.1):
            for ignore in (False, True):
                ref = _ce_run(self_ctx(), 97, smoothing, dtype, ignore)
                got = _ce_run(ctx, 97, smoothing, dtype, ignore)
                t = tol(dtype)
                assert abs(got[0] - ref[0]) <= t * abs(ref[0]), (got[0], ref[0])
                assert_close(got[1], ref[1], t, f"ce grad tp={n} eps={smoothing}")
                assert not got[2].any(), "padded vocabulary columns received gradient"
                # and both equal the plain single-device reference over the real classes
                loss, cctx = ops.cross_entropy_forward(got[3], got[4], label_smoothing=smoothing)
                assert abs(float(loss) - got[0]) <= t * abs(got[0])
                assert_close(got[1], ops.cross_entropy_backward(1.0, cctx), t, "ce vs ops reference")
                # the loss is identical on every TP rank, bit for bit
                allv = ctx.tp.all_gather(np.array([got[0]]))
                assert np.all(allv == allv[0]), allv
    ctx.close()


def _worker_layers_and_cross_entropy(n):
    """Both standalone checks in one job (one mpiexec start fewer)."""
    _worker_layers(n)
    _worker_cross_entropy(n)


def _gpt_run(ctx, cfg, seed=0, recompute="none", sequence_parallel=False, T=T):
    model = GPT(ctx, cfg, seed=seed)
    model.set_recompute(recompute)
    model.set_sequence_parallel(sequence_parallel)
    model.rng.set_position(0, 0, B)  # dropout by global position, as train_step draws it
    rng = np.random.default_rng(21)
    idx = rng.integers(0, cfg.vocab_size, (B, T))
    tgt = rng.integers(0, cfg.vocab_size, (B, T))
    tgt[0, 0] = -100
    model.eval()
    logits = gather_from_tp_forward(ctx.tp, model.forward(idx))[..., : cfg.vocab_size]
    model.train()
    loss = model.forward(idx, tgt)
    model.backward()
    grads = full_grads(model, ctx)
    from cutp.tensor_parallel import global_grad_norm

    norm = global_grad_norm(model.parameters(), ctx)
    for name in ("tok_embed.weight", "lm_head.weight"):
        if name in grads:
            assert not grads[name][cfg.vocab_size:].any(), f"padded rows of {name} received gradient"
            grads[name] = grads[name][: cfg.vocab_size]
    return {"loss": loss, "logits": logits, "grads": grads, "norm": norm}


def _worker_gpt_stack(n, cases):
    for kw in cases:
        kw = dict(kw)
        # at TP=n only: the reference keeps everything, with whole sequences
        recompute = kw.pop("recompute", "none")
        sequence_parallel = kw.pop("sequence_parallel", False)
        seq = kw.pop("seq_len", T)
        cfg = GPTConfig(**kw)
        dtype = np.float64 if cfg.dtype == "float64" else np.float32
        ctx, _ = group_ctx(n)
        ref = _gpt_run(self_ctx(), cfg, T=seq)
        got = _gpt_run(ctx, cfg, recompute=recompute, sequence_parallel=sequence_parallel, T=seq)
        t = tol(dtype)
        assert abs(got["loss"] - ref["loss"]) <= t * abs(ref["loss"]), (got["loss"], ref["loss"], kw)
        assert_close(got["logits"], ref["logits"], t, f"gpt tp={n} {kw} logits")
        assert_close(got["grads"], ref["grads"], t, f"gpt tp={n} {kw} grads")
        # each parameter counted once: sharded summed over TP, replicated (and GQA copies) once
        assert abs(got["norm"] - ref["norm"]) <= t * ref["norm"], (got["norm"], ref["norm"], kw)
        ctx.close()


STACKS = [
    dict(n_layer=2, n_head=4, n_embd=16, vocab_size=97, block_size=8, dtype="float64", vocab_multiple=1),
    dict(n_layer=2, n_head=4, n_embd=16, vocab_size=97, block_size=8, dtype="float32"),
    dict(n_layer=2, n_head=8, n_kv_head=2, n_embd=32, vocab_size=97, block_size=8, dtype="float64",
         label_smoothing=0.1, mlp_hidden=24),
    dict(n_layer=2, n_head=8, n_kv_head=8, n_embd=16, vocab_size=50, block_size=8, dtype="float64", bias=False,
         tie_embeddings=False, gelu="none"),
    # dropout 0.1 (masks by global position) with recomputation at TP=n, GQA, an odd vocabulary:
    # loss and every gradient as one rank's, which keeps everything
    dict(n_layer=2, n_head=8, n_kv_head=2, n_embd=32, vocab_size=97, block_size=8, dtype="float64", dropout=0.1,
         recompute="full"),
    dict(n_layer=2, n_head=8, n_embd=32, vocab_size=97, block_size=8, dtype="float64", dropout=0.1,
         recompute="selective"),
]


def _worker_at_sizes(worker, sizes, *args):
    """`worker`(n, *args) for each TP size n of sizes, in one launch (its groups of n ranks split
    the world: a size smaller than the world runs on every group)."""
    for n in sizes:
        globals()[worker](n, *args)


# ---- tests -------------------------------------------------------------------------------------
def test_linear_mlp_embedding_tp2_tp4():
    FOUR_RANKS.check("layers")


def _worker_tp8(stacks):
    """The TP=8 job (one 8-rank launch, tests/tensor_parallel/test_sequence_parallel.py): the
    layers and the cross-entropy on the vocabulary of 97 (rank 7's shard, rows/columns 112..127,
    is all padding), then the GPT stacks."""
    _worker_layers_and_cross_entropy(8)
    _worker_gpt_stack(8, stacks)


def test_attention_and_block_gqa_cases_tp4():
    # n_kv < TP (replicated KV heads), = TP, > TP; float64 and float32
    FOUR_RANKS.check("attention")


def test_attention_gqa_tp2():
    cases = [(4, 2, "float64"), (4, 1, "float64"), (8, 4, "float32")]  # n_kv = TP, < TP, > TP
    run_mpi(2, "tests.tensor_parallel.test_layers:_worker_attention", 2, cases, timeout=120)


def test_vocab_parallel_cross_entropy_tp2_tp4():
    FOUR_RANKS.check("cross_entropy")


def test_gpt_stack_tp2_tp4():
    FOUR_RANKS.check("gpt_stack")


# The layers, the cross-entropy and the GPT stacks at TP=8 (TP8_STACKS) run in one 8-rank launch
# with the sequence-parallel stacks (`_worker_tp8`):
# tests/tensor_parallel/test_sequence_parallel.py::test_tp8_layers_cross_entropy_and_gpt_stacks_with_and_without_sp
TP8_STACKS = [dict(STACKS[0], n_head=8), dict(STACKS[1], n_head=8), STACKS[2], STACKS[3], STACKS[4], STACKS[5]]


# ---- communication counted -------------------------------------------------------------------
def _worker_comm_counts():
    ctx = cutp.init(tp=4, device="cpu")
    h = 16
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=h, vocab_size=97, block_size=8, dtype="float64")
    model = GPT(ctx, cfg)
    idx = np.random.default_rng(0).integers(0, 97, (B, T))
    bsh = B * T * h
    ar = lambda ev: [(e.group, e.numel) for e in ev if e.op == "all_reduce"]  # noqa: E731

    with ctx.counter.recording() as ev:
        x = model.tok_embed.forward(idx)
    assert ar(ev) == [("tp", bsh)] and len(ev) == 1, ev
    x = x + model.pos_embed.forward(T)
    with ctx.counter.recording() as ev:
        y = model.layers[0].forward(x)
    assert ar(ev) == [("tp", bsh)] * 2 and len(ev) == 2, ev
    with ctx.counter.recording() as ev:
        model.layers[0].backward(np.ones_like(y))
    assert ar(ev) == [("tp", bsh)] * 2 and len(ev) == 2, ev

    logits = model.lm_head.forward(model.final_norm.forward(y))
    tgt = np.random.default_rng(1).integers(0, 97, (B, T))
    for eps in (0.0, 0.1):
        model.loss_fn.label_smoothing = eps
        with ctx.counter.recording() as ev:
            model.loss_fn.forward(logits.copy(), tgt)
            model.loss_fn.backward()
        assert all(e.op == "all_reduce" for e in ev), ev
        # max of the row maxima, then one fused sum of (sum of exps, target logit[, sum of logits])
        assert [e.numel for e in ev] == [B * T, (3 if eps else 2) * B * T], ev
        assert not any(e.op == "all_gather" for e in ev)

    # the whole model: forward 1 + 2 per block, +2 in the loss; backward 1 (head) + 2 per block
    with ctx.counter.recording() as ev:
        model.forward(idx, tgt)
    assert len(ev) == 1 + 2 * cfg.n_layer + 2, ev
    with ctx.counter.recording() as ev:
        model.backward()
    assert ar(ev) == [("tp", bsh)] * (1 + 2 * cfg.n_layer), ev
    ctx.close()


def test_communication_counts():
    FOUR_RANKS.check("comm_counts")


# ---- dropout streams ---------------------------------------------------------------------------
def _worker_dropout_streams():
    ctx = cutp.init(tp=2, dp=2, device="cpu")
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=31, block_size=8, dtype="float64", dropout=0.5)
    model = GPT(ctx, cfg, seed=3)
    x = np.ones((B, T, 8))
    rep = model.layers[0].attn_dropout.forward(x)            # replicated region
    attn = model.layers[0].attn.attn_dropout.forward(np.ones((B, 1, 1, T, T)))  # sharded region
    reps = ctx.tp.all_gather(np.ascontiguousarray(rep)[None])
    atts = ctx.tp.all_gather(np.ascontiguousarray(attn)[None])
    assert np.array_equal(reps[0], reps[1]), "replicated-region masks differ across TP ranks"
    assert not np.array_equal(atts[0], atts[1]), "sharded-region masks are identical across TP ranks"
    dps = ctx.dp.all_gather(np.ascontiguousarray(rep)[None])
    assert not np.array_equal(dps[0], dps[1]), "DP ranks (different data) share masks"
    # the tracker's state round-trips: restoring it reproduces the next mask exactly
    state = model.rng.state_dict()
    a = model.layers[0].attn_dropout.forward(x)
    model.rng.load_state_dict(state)
    b = model.layers[0].attn_dropout.forward(x)
    assert np.array_equal(a, b)
    assert 0.3 < float((a == 0).mean()) < 0.7
    ctx.close()


def test_dropout_masks_shared_and_distinct():
    FOUR_RANKS.check("dropout_streams")


# ---- the same model at every TP size; state_dict holds this rank's shards -----------------------
def _shard_shapes(cfg, tp):
    """The local shapes of the sharded parameters, worked out from the config by hand."""
    E, H, hd = cfg.n_embd, cfg.hidden, cfg.n_embd // cfg.n_head
    qkv = (cfg.n_head // tp + 2 * max(cfg.kv_heads // tp, 1)) * hd  # KV heads replicated when tp > n_kv_head
    vocab = (cfg.padded_vocab(tp) // tp, E)
    return {"attn.qkv.weight": (E, qkv), "attn.qkv.bias": (qkv,), "attn.proj.weight": (E // tp, E),
            "mlp.fc1.weight": (E, H // tp), "mlp.fc1.bias": (H // tp,), "mlp.fc2.weight": (H // tp, E),
            "tok_embed.weight": vocab, "lm_head.weight": vocab}


def _assemble_by_hand(name, shards, cfg, tp):
    """The full (padded) tensor from every TP rank's shard [tp, *shard], without cutp's sharding code."""
    if name.endswith(("qkv.weight", "qkv.bias")):
        axis = shards[0].ndim - 1
        hd = cfg.n_embd // cfg.n_head
        q, kv = cfg.n_head // tp * hd, max(cfg.kv_heads // tp, 1) * hd
        part = lambda s, lo, n: np.take(s, np.arange(lo, lo + n), axis=axis)  # noqa: E731
        if tp <= cfg.kv_heads:
            holders = list(range(tp))
        else:  # each KV head is held by tp // n_kv_head consecutive ranks: identical copies
            reps = tp // cfg.kv_heads
            holders = [g * reps for g in range(cfg.kv_heads)]
            for r in range(tp):
                for lo in (q, q + kv):
                    assert np.array_equal(part(shards[r], lo, kv), part(shards[holders[r // reps]], lo, kv)), \
                        f"{name}: replicated KV head differs on TP rank {r}"
        return np.concatenate([part(s, 0, q) for s in shards] + [part(shards[r], q, kv) for r in holders]
                              + [part(shards[r], q + kv, kv) for r in holders], axis=axis)
    if name.endswith(("attn.proj.weight", "mlp.fc2.weight", "mlp.fc1.bias", "tok_embed.weight", "lm_head.weight")):
        return np.concatenate(list(shards), axis=0)
    if name.endswith("mlp.fc1.weight"):
        return np.concatenate(list(shards), axis=1)
    for r in range(1, tp):  # replicated
        assert np.array_equal(shards[r], shards[0]), f"replicated {name} differs on TP rank {r}"
    return shards[0]


def _worker_same_model_at_every_tp(sizes, cases):
    for kw in cases:
        cfg = GPTConfig(**kw)
        dtype = np.dtype(cfg.dtype)
        ref = GPT(self_ctx(), cfg, seed=11).gather_state_dict(rank=None)  # TP=1, on every rank
        assert all(a.dtype == dtype for a in ref.values())
        assert ref["tok_embed.weight"].shape == (cfg.vocab_size, cfg.n_embd)
        for n in sizes:
            ctx, sub = group_ctx(n)
            model = GPT(ctx, cfg, seed=11)
            full = model.gather_state_dict(rank=None)
            assert list(full) == list(ref), (n, kw)
            for k in ref:  # exactly the same model: same names, shapes, dtypes and bits
                assert full[k].dtype == ref[k].dtype and full[k].shape == ref[k].shape, (n, k, full[k].shape)
                assert np.array_equal(full[k], ref[k]), f"tp={n} {kw}: {k} differs from TP=1"
            on_root = model.gather_state_dict()  # default: TP rank 0 only
            if ctx.tp_rank == 0:
                assert set(on_root) == set(ref) and all(np.array_equal(on_root[k], ref[k]) for k in ref)
            else:
                assert on_root is None, f"gather_state_dict() returned a dict on TP rank {ctx.tp_rank}"

            # state_dict(): this rank's shards, which reassemble (over the TP group) into the gathered dict
            local = model.state_dict()
            assert list(local) == list(ref), (n, kw)
            expect = _shard_shapes(cfg, n)
            for k, shard in local.items():
                rule = next((v for suffix, v in expect.items() if k.endswith(suffix)), ref[k].shape)
                assert shard.shape == rule, f"tp={n} rank {ctx.tp_rank}: {k} has local shape {shard.shape}, not {rule}"
                assert shard.dtype == dtype, (k, shard.dtype)
                shards = ctx.tp.all_gather(np.ascontiguousarray(shard)[None])
                assembled = _assemble_by_hand(k, shards, cfg, n)
                if k in ("tok_embed.weight", "lm_head.weight"):
                    assert assembled.shape[0] == cfg.padded_vocab(n)
                    assert not assembled[cfg.vocab_size:].any(), f"tp={n}: padded rows of {k} are not zero"
                    assembled = assembled[: cfg.vocab_size]
                assert np.array_equal(assembled, full[k]), f"tp={n}: {k} shards do not assemble into the gathered one"
            assert sum(a.size for a in local.values()) == model.num_parameters_local()
            ctx.close()
            sub.Free()


SAME_MODEL_CASES = [
    # GQA: KV heads replicated at TP=4 (> n_kv_head), split at TP=2; untied head; default vocab padding
    dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, mlp_hidden=24, vocab_size=97, block_size=8,
         dtype="float32", tie_embeddings=False),
    # MHA, no biases, tied embeddings, padding that differs by TP (50 -> 52 at TP=4)
    dict(n_layer=1, n_head=8, n_embd=32, vocab_size=50, block_size=8, dtype="float64", bias=False,
         vocab_multiple=1),
]


def test_same_model_at_tp1_tp2_tp4_and_state_dict_holds_shards():
    FOUR_RANKS.check("same_model")


# ---- in-process: validation, sharding, finite differences ---------------------------------
def test_validation_messages_name_the_numbers():
    from cutp.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tp=3 does not divide n_head=4.*\[1, 2, 4\]"):
        GPTConfig(n_head=4, n_embd=16).validate(3)
    with pytest.raises(ConfigError, match="n_kv_head=5 must divide n_head=12"):
        GPTConfig(n_head=12, n_kv_head=5, n_embd=48).validate(1)
    with pytest.raises(ConfigError, match="tp=4 and n_kv_head=6"):
        GPTConfig(n_head=12, n_kv_head=6, n_embd=48).validate(4)
    with pytest.raises(ConfigError, match="does not divide the MLP width 10"):
        GPTConfig(n_head=4, n_embd=16, mlp_hidden=10).validate(4)
    with pytest.raises(ConfigError, match="n_embd=18 is not divisible by n_head=4"):
        GPTConfig(n_head=4, n_embd=18).validate(1)
    with pytest.raises(ConfigError, match="dtype 'int8' is not supported"):
        GPTConfig(dtype="int8").validate(1)
    GPTConfig(n_head=8, n_kv_head=2, n_embd=32).validate(8)  # replicated KV heads: fine


def test_qkv_shards_hold_whole_heads():
    from cutp.tensor_parallel.sharding import qkv_columns

    hd, nh = 3, 4
    cols = qkv_columns(nh, nh, hd, 2)
    # rank 0: q heads 0-1, k heads 0-1, v heads 0-1; not a contiguous third
    assert list(cols[0]) == list(range(0, 6)) + list(range(12, 18)) + list(range(24, 30))
    assert list(cols[1]) == list(range(6, 12)) + list(range(18, 24)) + list(range(30, 36))
    # GQA, 1 KV head, TP=2: both ranks hold KV head 0
    cols = qkv_columns(4, 1, hd, 2)
    assert list(cols[0][6:]) == list(cols[1][6:]) == list(range(12, 15)) + list(range(15, 18))


def test_padded_vocabulary_and_init_independent_of_tp():
    assert pad_vocab(50257, 1) == 50304 and pad_vocab(50257, 8) == 51200 and pad_vocab(97, 4, 1) == 100
    ctx = self_ctx()
    a = GPT(ctx, GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=97, block_size=8), seed=5).gather_state_dict()
    b = GPT(ctx, GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=97, block_size=8), seed=5).gather_state_dict()
    c = GPT(ctx, GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=97, block_size=8), seed=6).gather_state_dict()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["tok_embed.weight"], c["tok_embed.weight"])
    assert a["tok_embed.weight"].shape == (97, 8)


def check_module_gradients(model, loss_fn, backward, rtol, samples, step=1e-6):
    """Central differences of loss_fn() for `samples` random entries of every parameter."""
    model.zero_grad()
    loss_fn()
    backward()
    rng = np.random.default_rng(123)
    for p in model.parameters():
        analytic = p.grad.copy()
        flat = p.data.reshape(-1)
        if p.name == "tok_embed.weight":  # rows of real tokens only (padding rows get no gradient)
            candidates = np.arange(13 * p.data.shape[1])
        else:
            candidates = np.arange(flat.size)
        for i in rng.choice(candidates, min(samples, candidates.size), replace=False):
            old = flat[i]
            flat[i] = old + step
            up = loss_fn()
            flat[i] = old - step
            down = loss_fn()
            flat[i] = old
            numeric = (up - down) / (2 * step)
            a = analytic.reshape(-1)[i]
            err = abs(a - numeric) / max(abs(a), abs(numeric), 1e-3)  # floor: exact zeros (key bias)
            assert err < rtol, f"{p.name}[{i}]: analytic {a:.10e} numeric {numeric:.10e} rel err {err:.2e}"


def test_gpt_finite_differences_float64():
    ctx = self_ctx()
    cfg = GPTConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=8, vocab_size=13, block_size=6, dtype="float64",
                    label_smoothing=0.1)
    model = GPT(ctx, cfg, seed=1)
    rng = np.random.default_rng(0)
    for p in model.parameters():  # O(1) weights, so that gradients are far above rounding noise
        p.data += rng.normal(0, 0.5, p.data.shape)
    model.tok_embed.weight.data[13:] = 0
    idx = rng.integers(0, 13, (2, 6))
    tgt = rng.integers(0, 13, (2, 6))
    tgt[1, 2] = -100
    check_module_gradients(model, lambda: model.forward(idx, tgt), model.backward, rtol=1e-6, samples=6)


def test_micro_batch_accumulation_adds_gradients():
    ctx = self_ctx()
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=13, block_size=6, dtype="float64")
    model = GPT(ctx, cfg, seed=1)
    rng = np.random.default_rng(0)
    idx, tgt = rng.integers(0, 13, (4, 6)), rng.integers(0, 13, (4, 6))
    model.forward(idx[:2], tgt[:2]); model.backward(0.5)  # noqa: E702
    model.forward(idx[2:], tgt[2:]); model.backward(0.5)  # noqa: E702
    acc = {p.name: p.grad.copy() for p in model.parameters()}
    model.zero_grad()
    model.forward(idx, tgt); model.backward(1.0)  # noqa: E702
    for p in model.parameters():
        np.testing.assert_allclose(acc[p.name], p.grad, rtol=1e-10, atol=1e-14, err_msg=p.name)
    model.free_cache()
    with pytest.raises(RuntimeError, match="without a training-mode forward"):
        model.backward()


def test_init_false_allocates_zeros_of_the_shard_shapes():
    ctx = self_ctx()
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=4)
    a, b = GPT(ctx, cfg, seed=3), GPT(ctx, cfg, seed=3, init=False)
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.name == q.name and p.data.shape == q.data.shape and p.data.dtype == q.data.dtype
        assert not q.data.any() and (q.sharding is None) == (p.sharding is None)
    b.load_full_state_dict(a.gather_state_dict())
    assert all(np.array_equal(p.data, q.data) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("B,T,nh,nkv,h", [(2, 64, 4, 2, 32), (3, 100, 4, 4, 16), (1, 40, 2, 1, 8), (2, 160, 8, 2, 32)])
def test_blocked_cpu_attention_equals_the_plain_path(B, T, nh, nkv, h, monkeypatch):
    """The CPU attention op splits long sequences into pieces and causal query blocks (or runs the
    compiled kernels on the QKV buffer's strided views), and the layer packs its gradients in
    place; the layer must equal the one-shot path (forward, dx and the weight gradients)."""
    ctx = self_ctx()
    plain_forward = ops.causal_attention_forward
    res = []
    built = compiled_ops.library("attention", attention_op._ATTENTION_SYMBOLS)  # (tests/ops/test_cpu_kernels: why not)
    paths = ("blocked", "plain") + (("compiled",) if built else ())
    for path in paths:
        m = ParallelAttention(ctx, h, nh, nkv, name="attn", rng=RNGTracker(0), dtype=np.float64, seed=1)
        if path == "blocked":  # force several pieces and query blocks
            monkeypatch.setattr(attention_op, "PIECE_ELEMS", 1 << 12)
            monkeypatch.setattr(attention_op, "QBLOCK_ELEMS", 1 << 10)
        monkeypatch.setattr(ops, "causal_attention_forward",
                            functools.partial(plain_forward, blocked={"blocked": True, "plain": False}.get(path)))
        x = np.random.default_rng(0).standard_normal((B, T, h))
        y = m.forward(x)
        assert (m._cache_attn[0].blocked, m._cache_attn[0].compiled) == (path == "blocked", path == "compiled")
        dx = m.backward(np.random.default_rng(1).standard_normal(y.shape))
        res.append((y, dx, m.qkv.weight.grad.copy(), m.qkv.bias.grad.copy(), m.proj.weight.grad.copy()))
    for other, path in zip(res[:1] + res[2:], paths[:1] + paths[2:]):
        for a, b, what in zip(other, res[1], ("y", "dx", "dW_qkv", "db_qkv", "dW_proj")):
            assert_close(a, b, 1e-12, f"{path} attention {what}")


def _worker_two_gqa_layouts_on_one_context():
    ctx = cutp.init(tp=4, device="cpu")
    for n_kv in (2, 1, 4):  # different replica groups on the same context
        cfg = GPTConfig(n_layer=1, n_head=4, n_kv_head=n_kv, n_embd=16, vocab_size=13, block_size=6, dtype="float64")
        got = _gpt_run(ctx, cfg)
        ref = _gpt_run(self_ctx(), cfg)
        assert_close(got["grads"], ref["grads"], 1e-10, f"n_kv_head={n_kv} after other layouts on one context")
    ctx.close()


def test_gqa_replica_groups_per_layout_on_one_context():
    FOUR_RANKS.check("gqa_layouts")


HERE = "tests.tensor_parallel.test_layers"
# The 4-rank tests above in one launch (the ranks' start-up is most of each one's time); each test
# checks its case: n_kv < TP (replicated KV heads), = TP, > TP in the attention cases, f64 and f32.
FOUR_RANKS = SharedLaunch(4, {
    "layers": (f"{HERE}:_worker_at_sizes", ["_worker_layers", [2, 4]]),
    "attention": (f"{HERE}:_worker_attention", [4, [(4, 2, "float64"), (4, 4, "float64"), (8, 8, "float64"),
                                                  (8, 2, "float32"), (4, 1, "float64")]]),
    "cross_entropy": (f"{HERE}:_worker_at_sizes", ["_worker_cross_entropy", [4, 2]]),
    "gpt_stack": (f"{HERE}:_worker_at_sizes", ["_worker_gpt_stack", [2, 4], STACKS]),
    "comm_counts": (f"{HERE}:_worker_comm_counts", []),
    "dropout_streams": (f"{HERE}:_worker_dropout_streams", []),
    "same_model": (f"{HERE}:_worker_same_model_at_every_tp", [[4, 2], SAME_MODEL_CASES]),
    "gqa_layouts": (f"{HERE}:_worker_two_gqa_layouts_on_one_context", []),
}, timeout=900)


def test_config_rejects_out_of_range_fields():
    from cutp.runtime.errors import ConfigError

    for kw, msg in ((dict(n_kv_head=0), "n_kv_head must be a positive integer or None"),
                    (dict(mlp_hidden=0), "mlp_hidden must be a positive integer or None"),
                    (dict(label_smoothing=1.5), r"label_smoothing must be in \[0, 1\)"),
                    (dict(vocab_multiple=-3), "vocab_multiple must be an integer >= 1"),
                    (dict(norm_eps=-1.0), "norm_eps must be > 0")):
        with pytest.raises(ConfigError, match=msg):
            GPTConfig(n_head=4, n_embd=16, **kw).validate(1)


def _worker_one_full_weight_at_a_time():
    import tracemalloc

    from cutp.models import GPT, GPTConfig

    ctx = cutp.init(tp=2, device="cpu")
    cfg = GPTConfig(n_layer=16, n_head=4, n_embd=128, vocab_size=1024, block_size=16)
    largest_full = cfg.vocab_size * cfg.n_embd * 8  # the embedding, drawn in float64 before the cast
    tracemalloc.start()
    model = GPT(ctx, cfg, seed=0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    kept = sum(p.data.nbytes + p.grad.nbytes for p in model.parameters())  # the shards and their grads
    full_bytes = cfg.num_parameters() * 4
    # building a rank's shards never holds more than about one full weight besides what it keeps
    # (plus small buffers); holding every full weight would take full_bytes more
    slack = 2 * largest_full + (2 << 20)
    assert peak < kept + slack, (peak, kept, largest_full)
    assert full_bytes > 2 * slack  # so the check above can tell the two apart
    ctx.close()


def test_a_rank_materialises_one_full_weight_at_a_time():
    run_mpi(2, "tests.tensor_parallel.test_layers:_worker_one_full_weight_at_a_time", timeout=60)
