"""Context parallelism (issue 29): `--cp N`, the zigzag split and the ring attention.

Each sequence is cut into 2*cp chunks, CP rank r holding chunks r and 2cp-1-r; the attention passes
K,V round the CP group (`cutp.tensor_parallel.context_parallel`). No layout changes the math: in
float64 the loss, every gradient and the updated weights of two training steps equal one rank's
within 1e-10, at cp 2 and 4, with tp 2 + sequence parallelism, pp 2, dp 2 + ZeRO, full
recomputation, dropout 0.1, GQA with fewer KV heads than tp, learned positions (GPT) and RoPE
(Llama), sequences whose chunks are one token, the all-to-all attention (Ulysses), also with
fewer TP-local KV heads than cp (each copied to the CP ranks of its query heads), and MoE models
(ep 2 over dp 2, tp 2 + SP with a capacity that drops, pp 2; the auxiliary and z-losses and the
gradient norms too). The ring's sends
and receives are posted before each step's attention compute and waited after it (an instrumented
communicator's event order), with the same bits as without the overlap; its bytes per layer are
(cp-1)/cp of a sequence's K,V each way. A checkpoint (of an MoE model at ep 2 with ZeRO) resumes at
other cp sizes. The activation memory per rank of a long sequence at cp 4 is <= 0.3x cp 1's, and the
planner's figure (it runs the same step on shape-only arrays) within its 10%. Refusals name the
numbers.
"""
import numpy as np
import pytest

from cutp.models import GPTConfig
from cutp.runtime.errors import ConfigError
from cutp.tensor_parallel import gather_full
from cutp.tensor_parallel.context_parallel import local_segments, take_local, zigzag_positions
from tests.mpirun import run_mpi
from tests.tp_utils import assert_close, on_rank_0

GPT_TINY = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, vocab_size=61, block_size=16, dtype="float64",
                dropout=0.1)
LLAMA_TINY = dict(GPT_TINY, positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
MOE = dict(n_experts=4, moe_top_k=2, moe_ffn=16, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=1e-3)
MOE_GPT, MOE_LLAMA = dict(GPT_TINY, **MOE), dict(LLAMA_TINY, n_kv_head=4, **MOE)

# (model, layout, seq_len): 4 ranks each
LAYOUTS = [
    (GPT_TINY, dict(cp=2, dp=2, distributed_optimizer=True), 16),
    (GPT_TINY, dict(cp=4), 8),  # seq_len / (2 cp) = 1 token per chunk
    (dict(LLAMA_TINY, n_kv_head=1), dict(cp=2, tp=2, sequence_parallel=True), 16),  # GQA: 1 KV head < tp 2
    (LLAMA_TINY, dict(cp=4, recompute="full"), 16),
    (MOE_GPT, dict(cp=2, pp=2, recompute="selective"), 16),  # MoE: the counting pass through the pipeline's CP ranks
    (dict(LLAMA_TINY, n_layer=4), dict(cp=2, pp=2, pp_schedule="interleaved", pp_virtual=2), 8),
    # the all-to-all attention (Ulysses): the KV heads split over cp
    (GPT_TINY, dict(cp=2, dp=2, cp_comm="a2a"), 8),
    (dict(LLAMA_TINY, n_kv_head=4), dict(cp=2, tp=2, sequence_parallel=True, cp_comm="a2a"), 16),
    (dict(LLAMA_TINY, n_kv_head=4), dict(cp=4, cp_comm="a2a", recompute="full"), 8),
    # ... and fewer TP-local KV heads than cp: each KV head copied to the CP ranks of its query heads
    (dict(GPT_TINY, n_kv_head=1, dropout=0.0), dict(cp=2, dp=2, cp_comm="a2a"), 8),  # 1 KV head, 2 copies
    (dict(LLAMA_TINY, n_kv_head=1), dict(cp=4, cp_comm="a2a"), 8),  # 4 copies, 1 query head each
    (LLAMA_TINY, dict(cp=4, cp_comm="a2a"), 8),  # 2 KV heads, 2 copies each: CP ranks 0, 1 take head 0
    (LLAMA_TINY, dict(cp=2, tp=2, sequence_parallel=True, cp_comm="a2a"), 16),  # 1 KV head per TP rank, 2 copies
    # MoE: the routers' statistics over DP x CP, the experts' gradients over expert-DP x CP (ep 2:
    # the CP pair), the counting pass of a step of 2 micro-batches on CP ranks; with a capacity,
    # the dropping decided over the whole micro-batch (TP shards and CP chunks put together)
    (MOE_GPT, dict(cp=2, dp=2, ep=2, micro_batch_size=1, recompute="full"), 16),
    (dict(MOE_LLAMA, moe_capacity_factor=0.75), dict(cp=2, tp=2, sequence_parallel=True, overlap_grad_reduce=True),
     16),  # (ep 1: the experts' gradients in the buckets over DP x CP)
    (MOE_GPT, dict(cp=2, dp=2, ep=2, cp_comm="a2a", distributed_optimizer=True, overlap_grad_reduce=True,
                   overlap_param_gather=True, bucket_size=200), 8),  # (the experts' buckets over expert-DP x CP)
]


def _run_config(model, layout, seq_len, comm_size):
    from cutp.train import resolve_run_config

    return resolve_run_config(comm=None, model=GPTConfig(**model), **{**dict(
        batch_size=4, micro_batch_size=2, seq_len=seq_len, steps=4, warmup=1, seed=3, eval_every=0, quiet=True,
        save_on_signal=False), **layout})


def _step(cfg, comm):
    """Two steps: (per step: the loss, the gradient norm and, for an MoE model, the auxiliary
    losses and the dropped fraction), the last gradients and the weights, full."""
    from cutp.bench.model import random_tokens
    from cutp.train import build_run, train_step

    run = build_run(cfg, comm, dataset=random_tokens(61, 4096, 0))
    stats = [train_step(run) for _ in range(2)]
    losses = [(s.loss, s.grad_norm) + ((s.moe["aux_loss"], s.moe["z_loss"], s.moe["dropped"]) if s.moe else ())
              for s in stats]
    run.gather_params()  # (--overlap-param-gather: the last update's broadcasts in flight)
    ctx = run.ctx
    full = lambda p, a: np.asarray(gather_full(ctx.tp, a, p.sharding))[:p.real_rows]  # noqa: E731
    grads = {p.name: full(p, p.grad) for p in run.model.parameters()}
    params = {p.name: full(p, p.data) for p in run.model.parameters()}
    run.close()
    return losses, grads, params


def _worker_layouts(layouts):
    from mpi4py import MPI
    from cutp.train import RunConfig

    for model, layout, seq_len in layouts:
        def reference():
            cfg = RunConfig(model=GPTConfig(**model), batch_size=4, micro_batch_size=2, seq_len=seq_len, steps=4,
                            warmup=1, seed=3, eval_every=0, quiet=True, save_on_signal=False)
            return _step(cfg, MPI.COMM_SELF)

        ref_losses, ref_grads, ref_params = on_rank_0(reference)
        cfg = _run_config(model, layout, seq_len, MPI.COMM_WORLD.Get_size())
        losses, grads, params = _step(cfg, MPI.COMM_WORLD)
        kind = ("MoE " if model.get("n_experts") else "") + model.get("positions", "learned")
        what = f"{kind} {layout} seq_len {seq_len}"
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0, err_msg=what)  # (norms, MoE losses too)
        if model.get("moe_capacity_factor"):
            assert all(step[-1] > 0 for step in losses), (what, losses)  # the capacity drops some
        if not layout.get("distributed_optimizer"):  # (ZeRO: each rank's gradient buffer is reduced in its shard)
            assert_close(grads, {k: ref_grads[k] for k in grads}, 1e-10, f"{what} grads")  # (pp: this stage's)
        assert_close(params, {k: ref_params[k] for k in params}, 1e-10, f"{what} params")


def test_every_layout_gives_one_ranks_loss_gradients_and_weights_and_the_ring_overlaps(tmp_path):
    # one launch: the layouts, the ring's order and bytes at cp 4, the library's finish_grad_sync at
    # cp 2 x dp 2, a checkpoint resumed at other cp sizes
    # and the activation memory of a 256-token sequence at cp 4 (<= 0.3x cp 1's, measured, and planned)
    run_mpi(4, "tests.tensor_parallel.test_context_parallel:_worker_all", LAYOUTS, 4, str(tmp_path / "run"),
            timeout=300, env={"CUTP_OP_THREADS": "1"})


# ---- the ring: overlap order, bits without overlap, bytes per layer ---------------------------
def _worker_ring(cp):
    import cutp
    from cutp.comm.base import Request, WrappedCommunicator
    from cutp.models import GPT
    from cutp.ops import attention_tiles
    from cutp.tensor_parallel import context_parallel

    events = []

    class Recording(WrappedCommunicator):  # logs when each exchange is posted and waited for
        def start_exchange(self, sends, recvs):
            events.append("post")
            return Logged(self.inner.start_exchange(sends, recvs))

    class Logged(Request):
        def __init__(self, inner):
            self.inner, self.op = inner, inner.op

        def test(self):
            return self.inner.test()

        def wait(self):
            events.append("wait")
            return self.inner.wait()

    for name in ("tile_forward", "tile_backward"):  # logs each tile's compute
        def logged(*args, _fn=getattr(attention_tiles, name), **kw):
            events.append("compute")
            return _fn(*args, **kw)
        setattr(attention_tiles, name, logged)

    ctx = cutp.init(cp=cp, device="cpu")
    B, T = 2, 8 * cp
    model = GPT(ctx, GPTConfig(**dict(GPT_TINY, block_size=T)), seed=1)
    model._lay_out_context(True)
    block = model.layers[0]
    nkv, hd = 2, GPT_TINY["n_embd"] // GPT_TINY["n_head"]
    x = np.random.default_rng(0).standard_normal((B, T // cp, GPT_TINY["n_embd"]))
    dy = np.random.default_rng(1).standard_normal(x.shape)
    model.rng.set_position(0, 0, B)
    ctx.cp = Recording(ctx.cp)
    results = {}
    for overlap in (True, False):
        context_parallel.OVERLAP = overlap
        events.clear()
        with ctx.counter.recording() as comm_events:
            y = block.forward(x)
            forward_events = list(events)
            dx = block.backward(dy)
        results[overlap] = (y, dx, {p.name: p.grad.copy() for p in block.parameters()})
        for p in block.parameters():
            p.grad[...] = 0
        if overlap:
            # each ring step with a transfer: posted, the step's tiles (step 0: the two diagonal
            # halves and one full tile; then two full tiles), then waited; the last step has none
            step = ["post", "compute", "compute", "wait"]
            first = ["post", "compute", "compute", "compute", "wait"]
            assert forward_events == first + step * (cp - 2) + ["compute", "compute"], forward_events
            assert events[len(forward_events):] == first + step * (cp - 1), events  # backward: dK,dV travel too
            kv_bytes = 2 * B * nkv * T * hd * 8  # a sequence's K and V (float64)
            sent = [e for e in comm_events if e.group == "cp" and e.op == "send"]
            got = [e for e in comm_events if e.group == "cp" and e.op == "recv"]
            fwd = sent[:cp - 1]
            assert sum(e.nbytes for e in fwd) == (cp - 1) * kv_bytes // cp  # (cp-1)/cp of K,V each way
            assert sum(e.nbytes for e in got[:cp - 1]) == sum(e.nbytes for e in fwd)
            assert sum(e.nbytes for e in sent[cp - 1:]) == (2 * cp - 1) * kv_bytes // cp  # backward: K,V, then dK,dV
        else:
            assert "post" not in events  # no exchange in flight during a compute
    (y1, dx1, g1), (y0, dx0, g0) = results[True], results[False]
    assert np.array_equal(y1, y0) and np.array_equal(dx1, dx0)
    assert all(np.array_equal(g1[k], g0[k]) for k in g1)
    context_parallel.OVERLAP = True


def _worker_library():
    """The library's recipe (docs/library.md): forward, backward, finish_grad_sync at cp 2 x dp 2,
    each DP rank on its half of the batch: every gradient one rank's (finish_grad_sync averages
    over DP x CP, the ranks that hold the same weights; it once averaged over DP only)."""
    import cutp
    from cutp.models import GPT
    from cutp.tensor_parallel import finish_grad_sync
    from tests.tp_utils import full_grads, self_ctx

    config = GPTConfig(**dict(GPT_TINY, dropout=0.0))
    rng = np.random.default_rng(5)
    idx, targets = rng.integers(0, 61, (2, 4, 16))

    def reference():
        model = GPT(self_ctx(), config, seed=2)
        model.forward(idx, targets)
        model.backward()
        return full_grads(model, model.ctx)

    ref = on_rank_0(reference)
    ctx = cutp.init(cp=2, dp=2, device="cpu")
    model = GPT(ctx, config, seed=2)
    half = slice(2 * ctx.dp_rank, 2 * ctx.dp_rank + 2)
    model.forward(idx[half], targets[half])
    model.backward()
    finish_grad_sync(model.parameters(), ctx)
    assert_close(full_grads(model, ctx, sync=False), ref, 1e-10, "finish_grad_sync at cp 2 x dp 2")


def _worker_all(layouts, cp, out):
    _worker_layouts(layouts)
    _worker_ring(cp)
    _worker_library()
    _worker_checkpoint(out)
    _worker_memory(256)


# ---- the split and the refusals (no MPI) ------------------------------------------------------
def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(np.concatenate([zigzag_positions(16, 4, r) for r in range(4)]).tolist()) == list(range(16))
    ids = np.arange(16).reshape(2, 8)
    assert take_local(ids, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    # a TP shard of the local sequence [0, 1 | 6, 7] crossing into the second chunk: two runs
    assert local_segments(4, 2, 0, 1, 3) == [(0, 1, 1), (1, 6, 1)]
    assert local_segments(4, 2, 1, 0, 2) == [(0, 2, 2)]


def test_refusals_name_the_numbers():
    from cutp.runtime.mesh import validate_mesh
    from cutp.train import RunConfig

    # the cp sizes offered divide the run's cp x dp ranks (4 here: not 3 or 6, which split 12 tokens too)
    with pytest.raises(ConfigError, match=r"^seq_len 12 is not divisible by 2\*cp = 8: .* a multiple of 8, or a "
                                          r"cp from \[1, 2\]$"):
        RunConfig(model=GPTConfig(**GPT_TINY), cp=4, seq_len=12)
    with pytest.raises(ConfigError, match=r"^seq_len 12 / cp 2 = 6 tokens per CP rank is not divisible by tp 4: .* "
                                          r"a multiple of 8, or a cp from \[1\]$"):
        RunConfig(model=GPTConfig(**dict(GPT_TINY, n_kv_head=4)), cp=2, tp=4, seq_len=12, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"^seq_len 4 / cp 2 = 2 tokens per CP rank is not divisible by tp 3: .* "
                                          r"a multiple of 12$"):  # (12: 2cp chunks and 12 / cp over tp)
        RunConfig(model=GPTConfig(**dict(GPT_TINY, n_head=3, n_kv_head=3, n_embd=12)), cp=2, tp=3, seq_len=4,
                  sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"^cp 3 does not divide the 8 ranks; use a cp from \[1, 2, 4, 8\]"):
        validate_mesh(8, 1, None, cp=3)
    assert repr(validate_mesh(8, 2, None, cp=2)) == "Mesh(tp=2, cp=2, dp=2, pp=1)"
    # the mesh's refusals name the ranks started and cp (they once named world / cp: "tp*dp = 2*2 = 4
    # but the communicator has 2 ranks; start 4 ranks" on 4 ranks)
    with pytest.raises(ConfigError, match=r"^tp\*cp\*dp = 2\*2\*2 = 8 but the communicator has 4 ranks; start 8 ranks"):
        validate_mesh(4, 2, 2, cp=2)
    with pytest.raises(ConfigError, match=r"^tp\*cp = 4\*2 does not divide the world size 4, so dp cannot be derived; "
                                          r"use a tp from \[1, 2\] or start a multiple of 8 ranks$"):
        validate_mesh(4, 4, None, cp=2)
    with pytest.raises(ConfigError, match=r"^pp 4 does not divide the 4 ranks / cp 2 = 2; use a pp from \[1, 2\] or "
                                          r"start a multiple of 8 ranks$"):
        validate_mesh(4, 1, None, pp=4, cp=2)
    with pytest.raises(ConfigError, match=r"^cp_comm a2a splits each TP rank's query heads over the CP ranks, .*: "
                                          r"n_head 4 and n_kv_head 2 / tp 1 leave 4 query and 2 KV head\(s\) a rank, "
                                          r"and cp 8 does not divide 4; use a cp from \[1, 2, 4\] or cp_comm ring$"):
        RunConfig(model=GPTConfig(**GPT_TINY), cp=8, seq_len=16, cp_comm="a2a")
    with pytest.raises(ConfigError, match=r"n_kv_head 2 / tp 1 leave 6 query and 2 KV head\(s\) a rank, and cp 3 "
                                          r"neither divides 2 nor is a multiple of it; use a cp from \[1, 2, 6\]"):
        RunConfig(model=GPTConfig(**dict(GPT_TINY, n_head=6, n_embd=24)), cp=3, dp=2, seq_len=12, cp_comm="a2a")


# ---- checkpoints: the cp size is a layout -------------------------------------------------------
def _worker_checkpoint(out):
    """An MoE model saved at cp 2 x dp 2 x ep 2 with ZeRO (the dense state in 4 shards over
    DP x CP, the experts' in 2 over expert-DP x CP), resumed at cp 4 with ZeRO, at cp 1 x dp 4 x
    ep 2 without and at tp 2 x cp 2: the next step's loss and weights are the uninterrupted
    run's, and so is the validation loss (whole sequences on every CP rank)."""
    from mpi4py import MPI
    from cutp.bench.model import random_tokens
    from cutp.train import build_run, evaluate, resolve_run_config, save, train_step

    data = random_tokens(61, 4096, 0)
    kw = dict(batch_size=4, micro_batch_size=1, seq_len=16, steps=4, warmup=1, seed=3, eval_every=0, quiet=True,
              save_on_signal=False, distributed_optimizer=True, eval_batches=1)
    run = build_run(resolve_run_config(model=GPTConfig(**MOE_GPT), cp=2, dp=2, ep=2, out=out, **kw), dataset=data)
    for _ in range(2):
        train_step(run)
    path = save(run)
    expected = train_step(run).loss
    val = evaluate(run)  # evaluation runs whole sequences on every CP rank
    weights = {}  # every rank's (ep 2: each EP rank's experts), vocabulary padding off
    for mine in MPI.COMM_WORLD.allgather({p.name: p.data[:p.real_rows].copy() for p in run.model.parameters()}):
        weights.update(mine)
    run.close()
    MPI.COMM_WORLD.Barrier()
    for layout in (dict(cp=4, distributed_optimizer=True), dict(cp=1, dp=4, ep=2), dict(tp=2, cp=2)):
        again = build_run(resolve_run_config(resume=path, **layout, **{k: kw[k] for k in ("eval_every", "quiet",
                                                                                          "save_on_signal",
                                                                                          "eval_batches")}),
                          dataset=data)
        assert again.step == 2 and again.ctx.cp_size == layout["cp"]
        loss = train_step(again).loss
        assert abs(loss - expected) <= 1e-10 * abs(expected), (layout, loss, expected)
        full = {p.name: np.asarray(gather_full(again.ctx.tp, p.data, p.sharding))[:p.real_rows]
                for p in again.model.parameters()}
        assert_close(full, {k: weights[k] for k in full}, 1e-10, f"weights after {layout}")
        assert abs(evaluate(again) - val) <= 1e-10 * val, layout
        again.close()


# ---- memory: measured at cp 4 against cp 1, and against the planner -----------------------------
def _measure(comm, cp, seq_len):
    from cutp import train
    from cutp.bench.model import random_tokens
    from cutp.plan.run import planned_step

    cfg = train.resolve_run_config(comm, preset="tiny", set=["n_layer=2", f"block_size={seq_len}"], dtype="float32",
                                   cp=cp, batch_size=1, micro_batch_size=1, seq_len=seq_len, steps=4, device="cpu",
                                   eval_every=0, quiet=True, save_on_signal=False)
    run = train.build_run(cfg, comm, dataset=random_tokens(cfg.model.vocab_size, 1 << 14, 0))
    _, largest = train.measured_step(run)
    planned = planned_step(cfg.model, cp=cp, rank=run.ctx.rank, micro_batch=1, seq_len=seq_len, device="cpu",
                           threads=1)["activations_peak"]
    run.close()
    return largest["activations_peak"], planned


def _worker_memory(seq_len):
    from mpi4py import MPI
    from tests.plan.test_memory import TOLERANCE

    one, one_planned = on_rank_0(lambda: _measure(MPI.COMM_SELF, 1, seq_len))
    four, four_planned = _measure(MPI.COMM_WORLD, 4, seq_len)
    assert four <= 0.3 * one, (four, one)
    for measured, planned in ((one, one_planned), (four, four_planned)):
        assert abs(planned - measured) <= TOLERANCE * measured, (measured, planned)
