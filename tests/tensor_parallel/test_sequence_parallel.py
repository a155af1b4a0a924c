"""Sequence parallelism (issue 14): `--sequence-parallel` / `GPT.set_sequence_parallel`.

Between the tensor-parallel regions each sequence is split over the TP ranks; no layout changes
the math: float64 loss and every gradient equal one rank's (dropout on, every recompute mode, GQA
with KV heads replicated over TP, an odd vocabulary), at TP 2, 4, 8 and TP2 x DP2. The collectives
are 2 all-gathers + 2 reduce-scatters per layer each way, the wire bytes of today's all-reduces;
the replicated parameters used on sequence shards, the final LayerNorm included (Megatron #1446),
get their gradients summed over TP and stay bit-identical across TP ranks.
"""
import json

import numpy as np
import pytest

import cutp
from cutp.models import GPT, GPTConfig
from cutp.tensor_parallel import gather_full, tp_grad_sync
from cutp.tensor_parallel.mappings import gather_from_tp_forward
from tests.mpirun import SharedLaunch, run_mpi
from tests.tensor_parallel.test_layers import STACKS, TP8_STACKS
from tests.tp_utils import assert_close, full_grads, group_ctx, on_rank_0, self_ctx, tol

TRAIN = "examples.train_gpt:main"

# float64, dropout 0.1, GQA (n_kv_head 2 < tp 4, 8), an odd vocabulary, each recompute mode
SP_STACKS = [
    dict(n_layer=2, n_head=8, n_kv_head=2, n_embd=32, vocab_size=97, block_size=16, dtype="float64", dropout=0.1,
         sequence_parallel=True, seq_len=16, recompute=mode)
    for mode in ("none", "selective", "full")
] + [
    dict(STACKS[0], sequence_parallel=True, seq_len=8, n_head=8),  # without dropout, padded vocab rows
    dict(STACKS[3], sequence_parallel=True, seq_len=8),  # no bias, untied head, exact GeLU
    dict(STACKS[1], sequence_parallel=True, seq_len=8, n_head=8),  # float32 (1e-5)
]


def test_gpt_stack_with_sequence_parallelism_tp2_tp4():
    FOUR_RANKS.check("gpt_stack")


def test_tp8_layers_cross_entropy_and_gpt_stacks_with_and_without_sp():
    """One 8-rank launch: test_layers' layers, cross-entropy and stacks at TP=8, then the
    sequence-parallel stacks (16 tokens over 8 ranks, 2 each, and 8 tokens: one token per rank)."""
    run_mpi(8, "tests.tensor_parallel.test_layers:_worker_tp8", TP8_STACKS + SP_STACKS, timeout=300)


# ---- TP2 x DP2 through the training step: every gradient, each recompute mode ---------------------
def _run_config(tp, dp, recompute, sequence_parallel):
    from cutp.train import RunConfig

    model = GPTConfig(n_layer=2, n_head=8, n_kv_head=2, n_embd=32, vocab_size=97, block_size=16, dtype="float64",
                      dropout=0.1)
    return RunConfig(model=model, tp=tp, dp=dp, batch_size=8, micro_batch_size=2, seq_len=16, steps=4, warmup=1,
                     seed=3, recompute=recompute, sequence_parallel=sequence_parallel, eval_every=0, quiet=True,
                     save_on_signal=False)


def _step_grads(cfg, comm):
    from cutp.bench.model import random_tokens
    from cutp.train import build_run, train_step

    run = build_run(cfg, comm, dataset=random_tokens(97, 4096, 0))
    stats = [train_step(run) for _ in range(2)]  # the second step's gradients (after an update)
    ctx = run.ctx
    full = lambda p, a: np.asarray(gather_full(ctx.tp, a, p.sharding))[:p.real_rows]  # noqa: E731 (unpadded)
    grads = {p.name: full(p, p.grad) for p in run.model.parameters()}
    params = {p.name: full(p, p.data) for p in run.model.parameters()}
    return [s.loss for s in stats], grads, params, run


def _worker_tp2_dp2_training_step():
    from mpi4py import MPI

    def reference():  # one rank, no sequence parallelism: the same for every mode
        ref_losses, ref_grads, ref_params, ref_run = _step_grads(_run_config(1, 1, "none", False), MPI.COMM_SELF)
        ref_run.close()
        return ref_losses, ref_grads, ref_params

    ref_losses, ref_grads, ref_params = on_rank_0(reference)
    for mode in ("none", "selective", "full"):
        losses, grads, params, run = _step_grads(_run_config(2, 2, mode, True), MPI.COMM_WORLD)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0, err_msg=mode)
        assert_close(grads, ref_grads, 1e-10, f"tp2 x dp2 sequence-parallel {mode} grads")
        assert_close(params, ref_params, 1e-10, f"tp2 x dp2 sequence-parallel {mode} params")
        run.close()


def test_tp2_x_dp2_training_step_every_gradient_equals_one_rank():
    FOUR_RANKS.check("tp2_dp2_training_step")


# ---- communication counted per layer ----------------------------------------------------------
B, T, H = 2, 8, 16


def _worker_comm_counts(tp):
    ctx = cutp.init(tp=tp, device="cpu")
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=H, vocab_size=97, block_size=T, dtype="float64", dropout=0.1)
    idx = np.random.default_rng(0).integers(0, 97, (B, T))
    bsh, shard = B * T * H, B * T * H // tp
    wire = {}
    for sp in (False, True):
        model = GPT(ctx, cfg)
        model.set_sequence_parallel(sp)
        x = model.tok_embed.forward(idx)
        x = x + model.pos_embed.forward(T)
        for direction in ("forward", "backward"):
            with ctx.counter.recording() as ev:
                y = model.layers[0].forward(x) if direction == "forward" else model.layers[0].backward(np.ones_like(x))
            ops = [(e.op, e.numel) for e in ev]
            if sp:  # the input of each column projection gathered, each row projection's output scattered
                assert y.shape == (B, T // tp, H), y.shape
                expect = [("all_gather", shard), ("reduce_scatter", bsh)] * 2
                if direction == "backward":  # mirrored: dy of a row gathered, dx of a column scattered
                    expect = [("all_gather", shard), ("reduce_scatter", bsh)] * 2
                assert ops == expect, (direction, ops)
            else:
                assert ops == [("all_reduce", bsh)] * 2, (direction, ops)
            wire[sp, direction] = sum(e.wire_bytes for e in ev)
    for direction in ("forward", "backward"):  # the same bytes on the wire as the all-reduces
        assert wire[True, direction] == pytest.approx(wire[False, direction], rel=1e-12), wire
        assert wire[True, direction] == pytest.approx(2 * 2 * (tp - 1) / tp * bsh * 8, rel=1e-12)
    # the embedding reduce-scatters into sequence shards; the LM head gathers, its dx scatters
    model = GPT(ctx, cfg)
    model.set_sequence_parallel(True)
    with ctx.counter.recording() as ev:
        x = model.tok_embed.forward(idx)
    assert [(e.op, e.numel) for e in ev] == [("reduce_scatter", bsh)] and x.shape == (B, T // tp, H)
    with ctx.counter.recording() as ev:
        logits = model.lm_head.forward(x)
    assert [(e.op, e.numel) for e in ev] == [("all_gather", shard)] and logits.shape[:2] == (B, T)
    with ctx.counter.recording() as ev:
        dx = model.lm_head.backward(np.ones_like(logits))
    assert [(e.op, e.numel) for e in ev] == [("reduce_scatter", bsh)] and dx.shape == (B, T // tp, H)
    ctx.close()


def test_two_all_gathers_and_two_reduce_scatters_per_layer_each_way():
    FOUR_RANKS.check("comm_counts")
    TWO_RANKS.check("comm_counts")


# ---- replicated parameters on sequence shards: gradients summed over TP (Megatron #1446) -------
def _worker_replicated_grads_summed():
    ctx, _ = group_ctx(2)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=16, vocab_size=97, block_size=8, dtype="float64", dropout=0.1,
                    vocab_multiple=1)
    model = GPT(ctx, cfg, seed=1)
    model.set_sequence_parallel(True)
    model.rng.set_position(0, 0, 2)
    idx = np.random.default_rng(4).integers(0, 97, (2, 8))
    model.forward(idx, idx)
    model.backward()
    marked = sorted(p.name for p in model.parameters() if p.sequence_parallel)
    assert "final_norm.weight" in marked and "final_norm.bias" in marked and "pos_embed.weight" in marked, marked
    assert "layers.1.attn.proj.bias" in marked and "layers.0.mlp.fc2.bias" in marked and "layers.0.mlp_norm.weight" in marked
    assert all(p.sharding is None for p in model.parameters() if p.sequence_parallel)
    # before the sum each rank holds its own tokens' part: the two ranks' final_norm gradients differ
    mine = model.named_parameters()["final_norm.weight"].grad.copy()
    other = np.empty_like(mine)
    ctx.tp.mpi_comm.Sendrecv(mine, dest=1 - ctx.tp_rank, recvbuf=other, source=1 - ctx.tp_rank)
    assert not np.array_equal(mine, other)
    grads = full_grads(model, ctx)  # finish_grad_sync: the sum over TP
    ref = GPT(self_ctx(), cfg, seed=1)
    ref.rng.set_position(0, 0, 2)
    ref.forward(idx, idx)
    ref.backward()
    grads["tok_embed.weight"] = grads["tok_embed.weight"][:97]  # (98 rows at tp 2: one of padding)
    assert_close(grads, {p.name: p.grad for p in ref.parameters()}, 1e-10, "sequence-parallel grads")
    for p in model.parameters():  # and identical bits on both TP ranks
        if p.sequence_parallel:
            theirs = np.empty_like(p.grad)
            ctx.tp.mpi_comm.Sendrecv(np.ascontiguousarray(p.grad), dest=1 - ctx.tp_rank, recvbuf=theirs,
                                     source=1 - ctx.tp_rank)
            assert np.array_equal(theirs, p.grad), p.name
    with pytest.raises(ValueError, match="pass the TP group"):
        tp_grad_sync(model.parameters())
    ctx.close()


def test_replicated_parameters_get_the_sum_over_tp_final_layernorm_included():
    TWO_RANKS.check("replicated_grads_summed")


def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _worker_replicas_after_training(out):
    """After a CLI-like run: every replicated parameter bit-identical on the TP ranks."""
    from mpi4py import MPI

    from cutp.bench.model import random_tokens
    from cutp.train import build_run, train_step

    run = build_run(_run_config(2, 1, "selective", True), MPI.COMM_WORLD, dataset=random_tokens(97, 4096, 0))
    for _ in range(4):
        train_step(run)
    for p in run.model.parameters():
        if p.sharding is None:
            mine = np.ascontiguousarray(p.data)
            theirs = np.empty_like(mine)
            run.ctx.tp.mpi_comm.Sendrecv(mine, dest=1 - run.ctx.tp_rank, recvbuf=theirs, source=1 - run.ctx.tp_rank)
            assert np.array_equal(mine, theirs), p.name
    run.close()


def test_layernorm_replicas_stay_bit_identical_through_training():
    TWO_RANKS.check("replicas_after_training")


# ---- the command line --------------------------------------------------------------------------
def test_cli_losses_with_sequence_parallelism_equal_one_rank(tmp_path):
    """float64, dropout 0.1, GQA with replicated KV heads, an odd vocabulary, 8 steps with an
    evaluation: TP4 with SP and full recomputation, TP2 x DP2 with SP, selective recomputation and
    micro-batches: the losses of one rank within 1e-10."""
    base = ["--preset", "tiny", "--set", "n_layer=2", "--set", "n_kv_head=2", "--set", "vocab_size=259",
            "--dtype", "float64", "--seq-len", "32", "--batch-size", "8", "--dropout", "0.1", "--steps", "8",
            "--eval-every", "4", "--eval-batches", "1", "--quiet"]
    rows = {}
    for name, n, extra in (("tp1", 1, ["--tp", "1"]),
                           ("tp4", 4, ["--tp", "4", "--sequence-parallel", "--recompute", "full"]),
                           ("tp2dp2", 4, ["--tp", "2", "--dp", "2", "--micro-batch-size", "2", "--sequence-parallel",
                                          "--recompute", "selective"])):
        m = tmp_path / f"{name}.jsonl"
        run_mpi(n, TRAIN, base + ["--metrics", str(m)] + extra, timeout=240)
        rows[name] = _metrics(m)
    ref = np.array([r["loss"] for r in rows["tp1"]])
    ref_val = [r["val_loss"] for r in rows["tp1"] if "val_loss" in r]
    assert len(ref) == 8 and len(ref_val) == 2
    for name in ("tp4", "tp2dp2"):
        np.testing.assert_allclose([r["loss"] for r in rows[name]], ref, rtol=1e-10, atol=0, err_msg=name)
        np.testing.assert_allclose([r["val_loss"] for r in rows[name] if "val_loss" in r], ref_val, rtol=1e-10,
                                   err_msg=name)


def test_a_sequence_that_does_not_split_is_refused_naming_both_numbers():
    from cutp.train import RunConfig

    with pytest.raises(cutp.ConfigError, match=r"seq_len 30 is not divisible by tp 4"):
        RunConfig(model=GPTConfig.preset("tiny"), tp=4, seq_len=30, sequence_parallel=True)
    RunConfig(model=GPTConfig.preset("tiny"), tp=4, seq_len=30)  # without it, fine
    proc = run_mpi(2, TRAIN, ["--preset", "tiny", "--tp", "2", "--sequence-parallel", "--seq-len", "33",
                              "--steps", "1", "--quiet"], timeout=120, expect_failure=True)
    assert "--seq-len 33 is not divisible by --tp 2" in proc.stdout, proc.stdout


def _worker_library_forward_checks():
    ctx = cutp.init(tp=2)
    model = GPT(ctx, GPTConfig(n_layer=1, n_head=4, n_embd=16, vocab_size=50, block_size=16), seed=0)
    model.set_sequence_parallel(True)
    idx = np.random.default_rng(0).integers(0, 50, (2, 7))
    with pytest.raises(ValueError, match="sequence length 7 is not divisible by tp=2"):
        model.forward(idx, idx)
    ctx.close()


def test_a_training_forward_whose_sequence_does_not_split_is_refused():
    TWO_RANKS.check("library_forward_checks")


# ---- generation and evaluation ------------------------------------------------------------------
def _worker_generation_without_sequence_parallelism():
    from cutp.generate import generate

    ctx, _ = group_ctx(2)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=16, vocab_size=50, block_size=32, dtype="float64", dropout=0.1)
    model = GPT(ctx, cfg, seed=2)
    model.set_sequence_parallel(True)
    ref = GPT(self_ctx(), cfg, seed=2)
    prompt = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]]  # 5 tokens: no split over 2 ranks
    for cache in (True, False):
        got = generate(model, prompt, 6, temperature=0, use_cache=cache)
        assert got == generate(ref, prompt, 6, temperature=0, use_cache=cache), cache
    assert model.sequence_parallel and model.layers[0].attn.qkv.sequence_parallel  # restored afterwards
    assert model.training
    # evaluation forwards: a length that splits runs sequence-parallel, one that does not runs whole
    model.eval()
    ref.eval()
    for n in (8, 7):
        idx = np.random.default_rng(n).integers(0, 50, (2, n))
        logits = gather_from_tp_forward(ctx.tp, model.forward(idx))[..., :50]
        assert_close(logits, ref.forward(idx)[..., :50], tol(np.float64), f"eval logits T={n}")
        assert abs(model.forward(idx, idx) - ref.forward(idx, idx)) <= 1e-10 * ref.forward(idx, idx)
    ctx.close()


def test_generation_runs_without_sequence_parallelism():
    TWO_RANKS.check("generation_without_sequence_parallelism")


# ---- activation memory ------------------------------------------------------------------------
def _worker_layernorm_dropout_residual_bytes(tp):
    """The bytes LayerNorm and the block's dropouts keep for backward are 1/tp of those without
    sequence parallelism (each rank keeps its own tokens only)."""
    from cutp.bench.model import cached_activation_bytes
    from cutp.tensor_parallel import Dropout, LayerNorm

    ctx = cutp.init(tp=tp)
    cfg = GPTConfig(n_layer=2, n_head=8, n_embd=32, vocab_size=97, block_size=16, dropout=0.1)
    idx = np.random.default_rng(0).integers(0, 97, (2, 16))
    kept = {}
    for sp in (False, True):
        model = GPT(ctx, cfg, seed=0)
        model.set_sequence_parallel(sp)
        model.forward(idx, idx)
        parts = [m for b in model.layers for m in (b.attn_norm, b.mlp_norm, b.attn_dropout, b.mlp_dropout)] + [model.final_norm, model.drop]
        assert all(isinstance(m, (LayerNorm, Dropout)) for m in parts)
        weights = [p.data for p in model.parameters()]  # (held by the LayerNorms' contexts: not activations)
        kept[sp] = sum(cached_activation_bytes(m, exclude=weights) for m in parts)
        model.backward()
    assert kept[False] > 0 and kept[True] * tp == kept[False], kept
    ctx.close()


def test_sequence_parallelism_divides_the_layernorm_and_dropout_stash_by_tp():
    FOUR_RANKS.check("layernorm_dropout_residual_bytes")


# The passing 4-rank and 2-rank tests above, each set in one launch (the ranks' start-up is most of
# each one's time); each test checks its case.
HERE = "tests.tensor_parallel.test_sequence_parallel"
FOUR_RANKS = SharedLaunch(4, {
    "gpt_stack": ("tests.tensor_parallel.test_layers:_worker_at_sizes", ["_worker_gpt_stack", [2, 4], SP_STACKS]),
    "tp2_dp2_training_step": (f"{HERE}:_worker_tp2_dp2_training_step", []),
    "comm_counts": (f"{HERE}:_worker_comm_counts", [4]),
    "layernorm_dropout_residual_bytes": (f"{HERE}:_worker_layernorm_dropout_residual_bytes", [4]),
}, timeout=780)
TWO_RANKS = SharedLaunch(2, {
    "comm_counts": (f"{HERE}:_worker_comm_counts", [2]),
    "replicated_grads_summed": (f"{HERE}:_worker_replicated_grads_summed", []),
    "replicas_after_training": (f"{HERE}:_worker_replicas_after_training", [""]),
    "library_forward_checks": (f"{HERE}:_worker_library_forward_checks", []),
    "generation_without_sequence_parallelism": (f"{HERE}:_worker_generation_without_sequence_parallelism", []),
}, timeout=540)
