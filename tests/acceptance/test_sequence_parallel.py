"""Acceptance tests for issue 14's sequence parallelism (`--sequence-parallel`), written from the
issue text alone, through the public CLI (examples/train_gpt.py, `python -m cutp bench model`)
and the Python API (cutp.init, GPT, set_sequence_parallel, cutp.train).

- loss and every gradient equal TP=1 within 1e-10 (float64, dropout 0.1, GQA with kv_heads < TP,
  an odd vocabulary, untied head, bias=False) at tp 2, 4, 8 and tp 2 x dp 2, each recompute mode;
- replicated parameters (LayerNorms, final LayerNorm included, row biases) hold the same full
  gradient on every TP rank, and stay bit-identical over steps (bf16 + distributed optimizer);
- 2 all-gathers + 2 reduce-scatters of s*b*h per layer in forward and the same in backward, no
  TP all-reduce in the layers, the all-reduces' wire bytes;
- float32: each recompute mode's gradients bit-identical to those without;
- a sequence length not divisible by tp refused in one line naming both numbers;
- generation and non-splitting evaluation run whole; checkpoints of an SP run resume with and
  without SP at another tp; `cutp bench model --sequence-parallel` runs.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.mpirun import SharedLaunch, run_mpi

TRAIN = "examples.train_gpt:main"
HERE = "tests.acceptance.test_sequence_parallel"


# ---- helpers used inside the MPI workers ------------------------------------------------------
def _cfg(**kw):
    from cutp.models import GPTConfig

    base = dict(n_layer=2, n_embd=64, n_head=8, block_size=32, dropout=0.1, dtype="float64")
    base.update(kw)
    return GPTConfig.preset("tiny", **base)


def _full(ctx, p, what):
    from cutp.tensor_parallel import gather_full

    a = np.asarray(ctx.to_numpy(gather_full(ctx.tp, getattr(p, what), p.sharding)))
    if p.real_rows is not None:
        assert not np.any(a[p.real_rows:]) if what == "grad" else True, f"{p.name}: padding rows got gradient"
        a = a[:p.real_rows]
    return a


def _rel(got, ref):
    scale = max(float(np.abs(ref).max()), 1e-30)
    return float(np.abs(np.asarray(got, np.float64) - ref).max()) / scale


def _same_on_tp_ranks(ctx, a, what):
    """a (host array) bit-identical on every TP rank."""
    a = np.ascontiguousarray(np.asarray(a))
    every = ctx.tp.all_gather(a[None])
    for r in range(ctx.tp_size):
        assert np.array_equal(every[r], every[0]), f"{what}: TP rank {r} differs from rank 0"


def _one_step(model, x, y, row0, batch):
    model.rng.set_position(0, row0, batch)
    loss = model.forward(x, y)
    model.backward()
    return loss


# ---- float64: loss and every gradient equal tp 1 ----------------------------------------------
CASES = {
    "gqa_odd_vocab_tied": dict(n_kv_head=2, vocab_size=97),
    "untied_nobias_odd_vocab": dict(vocab_size=101, tie_embeddings=False, bias=False),
}


def _worker_grads_equal_tp1(tp, modes, cases):
    from mpi4py import MPI

    import cutp
    from cutp.models import GPT
    from cutp.tensor_parallel import finish_grad_sync

    ctx = cutp.init(tp=tp, device="cpu")
    ref_ctx = cutp.init(comm=MPI.COMM_SELF, tp=1, device="cpu")
    B, T = 4, 16
    bl = B // ctx.dp_size
    row0 = ctx.dp_rank * bl
    for case in cases:
        cfg = _cfg(**CASES[case])
        rng = np.random.default_rng(7)
        x, y = rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T))
        ref = GPT(ref_ctx, cfg, seed=3)
        ref_loss = _one_step(ref, x, y, 0, B)
        ref_grads = {p.name: ref.ctx.to_numpy(p.grad).copy() for p in ref.parameters()}
        for mode in modes:
            model = GPT(ctx, cfg, seed=3)
            model.set_sequence_parallel(True)
            model.set_recompute(mode)
            before = ctx.counter.calls("tp", "reduce_scatter")
            loss = _one_step(model, x[row0:row0 + bl], y[row0:row0 + bl], row0, B)
            assert ctx.counter.calls("tp", "reduce_scatter") > before, "no reduce-scatter: SP not on"
            loss = float(ctx.dp.all_reduce(np.array([loss], np.float64), "avg")[0])
            assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss), (case, mode, loss, ref_loss)
            finish_grad_sync(model.parameters(), ctx)
            names = set()
            for p in model.parameters():
                names.add(p.name)
                g = _full(ctx, p, "grad")
                e = _rel(g, ref_grads[p.name])
                assert e <= 1e-10, f"{case} {mode} tp={tp} dp={ctx.dp_size}: {p.name} relative error {e:.2e}"
                if p.sharding is None:  # replicated: the same full gradient on every TP rank
                    _same_on_tp_ranks(ctx, ctx.to_numpy(p.grad), f"{case} {mode}: {p.name}.grad")
            assert names == set(ref_grads)
            assert "final_norm.weight" in names


GRAD_LAYOUTS = [
    (2, 2, ["none", "selective", "full"]),
    (4, 4, ["none", "full"]),
    (4, 2, ["none", "selective", "full"]),  # tp 2 x dp 2
]


@pytest.mark.parametrize("n,tp,modes", GRAD_LAYOUTS)
def test_loss_and_every_gradient_equal_tp1(n, tp, modes):
    (FOUR_RANKS if n == 4 else TWO_RANKS).check(f"grads tp{tp}")


def test_tp8_gradients_equal_tp1():
    run_mpi(8, f"{HERE}:_worker_grads_equal_tp1", 8, ["selective"], ["gqa_odd_vocab_tied"], timeout=120)


# ---- communication per layer --------------------------------------------------------------------
def _worker_comm_per_layer():
    import cutp
    from cutp.models import GPT

    ctx = cutp.init(tp=2, device="cpu")
    B, T, h = 2, 16, 64
    x = np.random.default_rng(0).integers(0, 97, (B, T))
    OPS = ("all_gather", "reduce_scatter", "all_reduce")

    def totals(n_layer, sp):
        """{phase: {op: (calls, elements, wire bytes)}} on the TP group."""
        model = GPT(ctx, _cfg(n_layer=n_layer, vocab_size=97, dropout=0.0), seed=1)
        model.set_sequence_parallel(sp)
        out = {}
        for phase in ("fwd", "bwd"):
            with ctx.counter.recording() as ev:
                if phase == "fwd":
                    model.forward(x, x)
                else:
                    model.backward()
            out[phase] = {op: np.array([sum(1 for e in ev if e.group == "tp" and e.op == op),
                                        sum(e.numel for e in ev if e.group == "tp" and e.op == op),
                                        sum(e.wire_bytes for e in ev if e.group == "tp" and e.op == op)])
                          for op in OPS}
        return out

    sbh = B * T * h
    per_layer = {}
    for sp in (True, False):
        one, two = totals(1, sp), totals(2, sp)
        per_layer[sp] = {ph: {op: two[ph][op] - one[ph][op] for op in OPS} for ph in ("fwd", "bwd")}
        if sp:  # and outside the layers: the embedding reduce-scatters, the LM head all-gathers (each way)
            for ph in ("fwd", "bwd"):
                assert (int(two[ph]["all_gather"][0]), int(two[ph]["reduce_scatter"][0])) == (5, 5), (ph, two[ph])
    for ph in ("fwd", "bwd"):
        s, a = per_layer[True][ph], per_layer[False][ph]
        calls = {op: int(s[op][0]) for op in OPS}
        assert calls == {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 0}, (ph, calls)
        # each all-gather brings s*b*h together (this rank's s*b*h/t), each reduce-scatter takes s*b*h
        assert s["all_gather"][1] * ctx.tp_size == 2 * sbh and s["reduce_scatter"][1] == 2 * sbh, (ph, s)
        assert {op: int(a[op][0]) for op in OPS} == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2}
        assert a["all_reduce"][1] == 2 * sbh
        # the same bytes on the wire as the all-reduces they replace
        wire_sp = s["all_gather"][2] + s["reduce_scatter"][2]
        assert wire_sp > 0 and wire_sp == pytest.approx(a["all_reduce"][2], rel=1e-12), (ph, wire_sp, a)


def test_two_all_gathers_and_two_reduce_scatters_of_sbh_per_layer():
    TWO_RANKS.check("comm_per_layer")


# ---- float32 recompute bitwise; errors; eval; generation ---------------------------------------
def _worker_library_misc():
    from mpi4py import MPI

    import cutp
    from cutp.generate import generate
    from cutp.models import GPT

    ctx = cutp.init(tp=2, device="cpu")
    # float32 under SP: every recompute mode's gradients bit-identical to none's (dropout on)
    cfg32 = _cfg(dtype="float32", n_kv_head=1)
    x = np.random.default_rng(3).integers(0, 256, (2, 16))
    grads = {}
    for mode in ("none", "selective", "full", "full1"):
        m = GPT(ctx, cfg32, seed=2)
        m.set_sequence_parallel()
        m.set_recompute("full", 1) if mode == "full1" else m.set_recompute(mode)
        _one_step(m, x, x, 0, 2)
        _one_step(m, x[::-1].copy(), x, 2, 4)  # a second micro-batch accumulates
        from cutp.tensor_parallel import finish_grad_sync
        finish_grad_sync(m.parameters(), ctx)
        grads[mode] = {p.name: ctx.to_numpy(p.grad).copy() for p in m.parameters()}
    for mode in ("selective", "full", "full1"):
        for k, g in grads["none"].items():
            assert np.array_equal(grads[mode][k], g), (mode, k)

    # a training sequence not divisible by tp: one line naming both numbers
    cfg = _cfg(vocab_size=97)
    m = GPT(ctx, cfg, seed=4)
    m.set_sequence_parallel()
    with pytest.raises(ValueError) as ei:
        m.forward(np.zeros((2, 7), np.int64), np.zeros((2, 7), np.int64))
    msg = str(ei.value)
    assert "\n" not in msg and "7" in msg and "2" in msg, msg

    # evaluation and logits of a length that does not split: run whole, equal tp 1
    ref = GPT(cutp.init(comm=MPI.COMM_SELF, tp=1, device="cpu"), cfg, seed=4)
    ids = np.random.default_rng(5).integers(0, 97, (2, 7))
    m.eval()
    ref.eval()
    assert abs(m.forward(ids, ids) - ref.forward(ids, ids)) <= 1e-10 * abs(ref.forward(ids, ids))
    ids8 = np.random.default_rng(6).integers(0, 97, (2, 8))  # splits: an SP eval forward
    assert abs(m.forward(ids8, ids8) - ref.forward(ids8, ids8)) <= 1e-10 * abs(ref.forward(ids8, ids8))
    m.train()

    # generation (KV cache and without) runs without SP and gives tp 1's tokens
    prompt = np.array([[5, 6, 7]])
    for cache in (True, False):
        got = generate(m, prompt, 6, temperature=0.0, use_cache=cache)
        want = generate(ref, prompt, 6, temperature=0.0, use_cache=cache)
        assert np.array_equal(np.asarray(got), np.asarray(want)), (cache, got, want)
    assert m.sequence_parallel and m.training
    # ... and training afterwards is still sequence-parallel, gradients still those of tp 1
    ref.train()
    rx = np.random.default_rng(8).integers(0, 97, (2, 16))
    lr_ = _one_step(ref, rx, rx, 0, 2)
    before = ctx.counter.calls("tp", "reduce_scatter")
    l_ = _one_step(m, rx, rx, 0, 2)
    assert ctx.counter.calls("tp", "reduce_scatter") > before
    assert abs(l_ - lr_) <= 1e-10 * abs(lr_)
    from cutp.tensor_parallel import finish_grad_sync
    finish_grad_sync(m.parameters(), ctx)
    for p, q in zip(m.parameters(), ref.parameters()):
        assert _rel(_full(ctx, p, "grad"), ctx.to_numpy(q.grad)) <= 1e-10, p.name


def test_float32_recompute_bitwise_errors_eval_and_generation():
    TWO_RANKS.check("library_misc")


# The library tests above, on 4 and on 2 ranks, each set in one launch (the ranks' start-up is most
# of each one's time); each test checks its case.
FOUR_RANKS = SharedLaunch(4, {f"grads tp{tp}": (f"{HERE}:_worker_grads_equal_tp1", [tp, modes, list(CASES)])
                              for n, tp, modes in GRAD_LAYOUTS if n == 4}, timeout=240)
TWO_RANKS = SharedLaunch(2, {
    **{f"grads tp{tp}": (f"{HERE}:_worker_grads_equal_tp1", [tp, modes, list(CASES)])
       for n, tp, modes in GRAD_LAYOUTS if n == 2},
    "comm_per_layer": (f"{HERE}:_worker_comm_per_layer", []),
    "library_misc": (f"{HERE}:_worker_library_misc", []),
}, timeout=270)


# ---- bf16 + distributed optimizer + SP + recompute + micro-batches through cutp.train -----------
def _worker_bf16_distopt(out):
    from mpi4py import MPI

    from cutp import train

    world = MPI.COMM_WORLD
    common = dict(preset="tiny", set=["n_layer=2", "n_embd=64", "n_head=8", "n_kv_head=1"], dtype="bfloat16",
                  seq_len=32, batch_size=8, steps=5, eval_every=0, device="cpu", quiet=True, save_on_signal=False,
                  dropout=0.1)
    cfg = train.resolve_run_config(world, tp=2, dp=2, micro_batch_size=1, distributed_optimizer=True,
                                   sequence_parallel=True, recompute="full", **common)
    run = train.build_run(cfg, world)
    assert run.model.sequence_parallel
    ctx = run.ctx
    losses = []
    while run.step < run.end_step:
        losses.append(train.train_step(run).loss)
    assert ctx.counter.calls("tp", "reduce_scatter") > 0
    for p in run.model.parameters():  # replicated parameters: bit-identical on every TP (and DP) rank
        if p.sharding is None:
            _same_on_tp_ranks(ctx, ctx.to_numpy(p.data).astype(np.float32), f"{p.name} after 5 steps")
            every = world.allgather(ctx.to_numpy(p.data).astype(np.float32))
            assert all(np.array_equal(e, every[0]) for e in every), p.name
    run.close()
    if world.rank == 0:
        ref_cfg = train.resolve_run_config(MPI.COMM_SELF, tp=1, dp=1, **common)
        ref = train.build_run(ref_cfg, MPI.COMM_SELF)
        ref_losses = []
        while ref.step < ref.end_step:
            ref_losses.append(train.train_step(ref).loss)
        ref.close()
        np.testing.assert_allclose(losses, ref_losses, rtol=5e-3)
        assert losses[-1] < losses[0]


def test_bf16_distributed_optimizer_sp_recompute_microbatches_match_tp1(tmp_path):
    run_mpi(4, f"{HERE}:_worker_bf16_distopt", str(tmp_path), timeout=120)


# ---- CLI: losses, resume across SP on/off and tp, errors, bench --------------------------------
CLI = ["--preset", "tiny", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_kv_head=2", "--set",
       "vocab_size=259", "--dtype", "float64", "--seq-len", "32", "--batch-size", "8", "--dropout", "0.1",
       "--steps", "8", "--eval-every", "0", "--quiet"]


def _losses(path):
    with open(path) as f:
        return np.array([json.loads(line)["loss"] for line in f])


@pytest.fixture(scope="module")
def tp1_losses(tmp_path_factory):
    m = tmp_path_factory.mktemp("tp1") / "m.jsonl"
    run_mpi(1, TRAIN, CLI + ["--tp", "1", "--metrics", str(m)], timeout=60)
    losses = _losses(m)
    assert len(losses) == 8
    return losses


def test_cli_sp_losses_equal_tp1_over_8_steps(tmp_path, tp1_losses):
    """tp 2 x dp 2, micro-batches of 1, full recomputation, the distributed optimizer."""
    m = tmp_path / "m.jsonl"
    run_mpi(4, TRAIN, CLI + ["--sequence-parallel", "--metrics", str(m), "--tp", "2", "--dp", "2",
                             "--micro-batch-size", "1", "--recompute", "full", "--distributed-optimizer"], timeout=90)
    np.testing.assert_allclose(_losses(m), tp1_losses, rtol=1e-10, atol=0)


def test_cli_resume_sp_checkpoint_without_sp_and_at_other_tp(tmp_path, tp1_losses):
    """Steps 1-4 at tp 2 with SP and selective recomputation, saved; steps 5-8 resumed at tp 4
    without SP, and at tp 2 x dp 2 with SP: tp 1's losses throughout."""
    import shutil

    ck = tmp_path / "ck"
    run_mpi(2, TRAIN, CLI + ["--tp", "2", "--sequence-parallel", "--recompute", "selective", "--run-steps", "4",
                             "--out", str(ck), "--metrics", str(tmp_path / "a.jsonl")], timeout=60)
    np.testing.assert_allclose(_losses(tmp_path / "a.jsonl"), tp1_losses[:4], rtol=1e-10, atol=0)
    shutil.copytree(ck, tmp_path / "ck2")
    run_mpi(4, TRAIN, ["--resume", str(ck), "--tp", "4", "--quiet", "--metrics", str(tmp_path / "b.jsonl")],
            timeout=60)  # SP off, tp 4
    np.testing.assert_allclose(_losses(tmp_path / "b.jsonl"), tp1_losses[4:], rtol=1e-10, atol=0)
    run_mpi(4, TRAIN, ["--resume", str(tmp_path / "ck2"), "--tp", "2", "--dp", "2", "--sequence-parallel",
                       "--quiet", "--metrics", str(tmp_path / "c.jsonl")], timeout=60)
    np.testing.assert_allclose(_losses(tmp_path / "c.jsonl"), tp1_losses[4:], rtol=1e-10, atol=0)


def test_cli_refuses_seq_len_not_divisible_by_tp_in_one_line():
    res = run_mpi(2, TRAIN, CLI + ["--tp", "2", "--seq-len", "31", "--sequence-parallel"], timeout=60,
                  expect_failure=True)
    lines = [ln for ln in res.stdout.splitlines() if "31" in ln and "tp" in ln.lower() and "2" in ln.replace("31", "")]
    assert lines, res.stdout[-3000:]
    assert "Traceback" not in res.stdout or any("Error" in ln for ln in lines), res.stdout[-3000:]


def test_bench_model_sequence_parallel(tmp_path):
    j = tmp_path / "b.json"
    run_mpi(2, "cutp.bench.__main__:main", ["model", "--preset", "tiny", "--tp", "2", "--sequence-parallel",
                                            "--timed-steps", "1", "--untimed-steps", "1", "--seq-len", "32", "--batch-size", "2",
                                            "--json", str(j)], timeout=60)
    text = j.read_text()
    assert "reduce_scatter" in text and "all_gather" in text, text[:2000]
