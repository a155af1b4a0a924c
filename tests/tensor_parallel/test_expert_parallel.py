"""Expert parallelism (issue 18): experts split over EP ranks, tokens moved by all-to-all.

float64: EP 2 and 4 on DP 2 and 4, TP 1 and 2 (with and without sequence parallelism), PP 2
with full recomputation, the distributed optimizer, top-1 and top-2, with and without capacity
dropping: losses (auxiliary and z-losses included), gradient norms, every gradient and every
parameter after two steps equal the same model at EP 1 on the same DP size within 1e-10, and one rank with the same global batch when nothing is
dropped; every expert identical on its expert-DP (and TP) replicas; the all-to-all bytes of a
step counted exactly; the all-to-all primitive itself (MPI, and the NCCL send/recv plan);
checkpoints written at EP 2 hold every expert and resume at EP 1 and back with equal losses
(plain and distributed optimizer, either way); `--ep` on the command line;
the refusals.

Megatron-LM bugs these cases would catch: PR #5956 (expert gradients not divided by the EP
size: the gradients and weights would differ from EP 1), PR #5916 (with EP > 1 and TP > 1 the
experts were left out of the gradient norm: the ep2 x tp2 norms would differ), #1628 (expert
TP > 1 with EP = 1 synchronised the wrong gradients: tests/tensor_parallel/test_moe.py's tp 2 cases). The
planner's all-to-all figure is checked against the counted bytes.
"""
import json
import os

import numpy as np
import pytest

import cutp
from cutp.bench.model import Dataset, random_tokens
from cutp.comm.nccl import all_to_all_plan
from cutp.runtime.mesh import validate_mesh
from cutp.train import RunConfig, build_run, save, train_step
from tests.mpirun import run_mpi
from cutp.plan import layout as plan
from tests.tensor_parallel.test_moe import _config


def _with(cfg, **kw):
    return RunConfig(**{**cfg.__dict__, **kw})


def _train(cfg, comm, steps=2):
    """(per step: loss, norm, aux, z), every rank's {name: (grad, data)}, the float64 all-to-all
    bytes of the last step summed over the world, and its MoE figures."""
    from mpi4py import MPI

    from cutp.tensor_parallel import gather_full

    run = build_run(cfg, comm, dataset=random_tokens(97, 4096, 0))
    stats = [train_step(run) for _ in range(steps - 1)]
    with run.ctx.counter.recording() as events:
        stats.append(train_step(run))
    ctx = run.ctx
    a2a = [e for e in events if e.op == "all_to_all"]
    assert all(e.group == "ep" for e in a2a), {e.group for e in a2a}
    data_bytes = sum(e.nbytes for e in a2a if e.dtype == "float64")
    data_bytes = comm.allreduce(data_bytes, op=MPI.SUM)
    # this rank's gradient reductions: {group.op: (calls, bytes)} (the DP all-reduce: its largest,
    # the gradient buffer; the others are statistics)
    reductions = {}
    for e in events:
        if e.group in ("dp", "expert_dp") and e.op in ("all_reduce", "reduce_scatter", "all_gather"):
            calls, nbytes = reductions.get(f"{e.group}.{e.op}", (0, 0))
            big = max(nbytes, e.nbytes) if (e.group, e.op) == ("dp", "all_reduce") else nbytes + e.nbytes
            reductions[f"{e.group}.{e.op}"] = (calls + 1, big)
    full = lambda p, a: np.asarray(gather_full(ctx.tp, a, p.sharding))[:p.real_rows]  # noqa: E731
    mine = {p.name: (full(p, p.grad), full(p, p.data)) for p in run.model.parameters()}
    everyone = comm.allgather(mine)
    run.close()
    return ([(s.loss, s.grad_norm, s.moe["aux_loss"], s.moe["z_loss"]) for s in stats], everyone, data_bytes,
            stats[-1].moe, reductions)


def _compare(kw, got, everyone, ref, ref_everyone, grads=True):
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-10, atol=1e-14, err_msg=str(kw))
    ref_params = {}  # (pipeline stages: each rank holds its stage's)
    for rank in ref_everyone:
        ref_params = {**rank, **ref_params}
    holders = {}
    for rank in everyone:
        for name, (g, w) in rank.items():
            holders.setdefault(name, []).append(w)
            rg, rw = ref_params[name]
            if grads:
                assert np.abs(g - rg).max() <= 1e-10 * np.abs(rg).max(), (kw, name)
            assert np.abs(w - rw).max() <= 1e-10 * np.abs(rw).max(), (kw, name)
    assert set(holders) == set(ref_params), (kw, set(ref_params) - set(holders))
    for name, copies in holders.items():  # every replica (expert-DP, TP, DP) of a parameter: the same bits
        assert all(np.array_equal(c, copies[0]) for c in copies), (kw, name)


def _worker_equals_ep1(cases):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    for kw in cases:
        kw = dict(kw)
        ep = kw.pop("ep")
        cfg = _config(**kw)
        got, everyone, a2a_bytes, moe, reductions = _train(_with(cfg, ep=ep), world)
        # each rank holds its EP group's share of the experts
        E, n_moe = cfg.model.n_experts, sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.n_layer))
        experts = {n.split(".experts.")[1].split(".")[0] for n in everyone[world.rank] if ".experts." in n}
        assert len(experts) == E // ep, (kw, experts)
        ref, ref_everyone, ref_bytes, ref_moe, _ = _train(cfg, world)
        assert ref_bytes == 0, kw  # (no all-to-all at ep 1; the routing is the same)
        assert moe["tokens_per_expert"] == ref_moe["tokens_per_expert"] and moe["dropped"] == ref_moe["dropped"], kw
        _compare(kw, got, everyone, ref, ref_everyone, grads=not cfg.distributed_optimizer)
        # all-to-all bytes of the step: per MoE layer and micro-batch forward, dispatch and combine
        # each move every kept assignment's row once (tokens x k - dropped, h float64 each); the
        # backward moves as many again; full recomputation, and the counting pass of a step of
        # several micro-batches (cutp.train.moe), dispatch and combine once more
        assignments = moe["tokens_per_expert"][1] * E * n_moe  # over the step, all layers
        kept = round(assignments * (1 - moe["dropped"]))
        moves = 4 + 2 * (cfg.recompute == "full") + 2 * (cfg.accum_steps > 1)
        assert a2a_bytes == moves * kept * cfg.model.n_embd * 8, (kw, a2a_bytes, kept)
        if kw.get("moe_capacity_factor") is None:
            assert kept == cfg.batch_size * cfg.seq_len * cfg.model.moe_top_k * n_moe, kw
            if cfg.pp == 1:  # the planner's figure (balanced), over every rank
                planned = plan.plan(cfg.model, tp=cfg.tp, dp=cfg.dp, ep=ep,
                                    micro_batch=cfg.micro_batch_size, seq_len=cfg.seq_len, accum=cfg.accum_steps,
                                    config=cfg.model, dtype="float64", recompute=cfg.recompute,
                                    sequence_parallel=cfg.sequence_parallel,
                                    distributed_optimizer=cfg.distributed_optimizer)
                assert planned["ep_all_to_all"]["bytes"] * world.Get_size() == a2a_bytes, (kw, planned["ep_all_to_all"])
                # the gradient reductions: the dense buffer over DP, the experts' over expert-DP
                for key, (calls, nbytes) in reductions.items():
                    if key == "dp.all_reduce" and cfg.distributed_optimizer:
                        continue  # (statistics only)
                    if key != "dp.all_reduce":
                        assert calls == 1, (kw, key, calls)
                    row = planned[key.replace(".", "_").replace("all_reduce", "allreduce")]
                    assert (row["calls"] > 0, row["bytes"]) == (True, nbytes), (kw, key, row, nbytes)
                for key in ("dp", "expert_dp"):  # and nothing planned that did not happen
                    for op in ("allreduce", "reduce_scatter", "all_gather"):
                        if planned[f"{key}_{op}"]["calls"]:
                            assert f"{key}.{op.replace('allreduce', 'all_reduce')}" in reductions, (kw, key, op)
        else:
            assert moe["dropped"] > 0, kw  # the capacity drops some: dropping is decided at the source
        if kw.get("moe_capacity_factor") is None:  # nothing dropped: one rank with the global batch
            model_kw = {k: v for k, v in kw.items() if k.startswith("moe_") or k == "n_experts"}
            one, one_everyone, _, _, _ = _train(_config(micro=cfg.micro_batch_size * cfg.dp, **model_kw), MPI.COMM_SELF)
            _compare(kw, got, everyone, one, one_everyone, grads=not cfg.distributed_optimizer)


def test_ep2_dp2_top1_top2_with_and_without_dropping_equal_ep1_and_one_rank():
    run_mpi(2, "tests.tensor_parallel.test_expert_parallel:_worker_equals_ep1",
            [dict(ep=2, dp=2, micro=1), dict(ep=2, dp=2, micro=2, moe_top_k=1, moe_capacity_factor=1.0, zero=True),
             dict(ep=2, dp=2, micro=1, moe_capacity_factor=0.75, moe_renormalize=True)], timeout=240)


def _worker_all_to_all_then_equals_ep1(cases):
    _worker_all_to_all()
    _worker_equals_ep1(cases)


def test_all_to_all_then_ep2_dp4_ep4_dp4_tp2_and_pp2_equal_ep1_and_one_rank():
    """(One job of 4 ranks for both: the all-to-all primitive, then the layouts.)"""
    run_mpi(4, "tests.tensor_parallel.test_expert_parallel:_worker_all_to_all_then_equals_ep1",
            [dict(ep=2, dp=4, micro=1, moe_top_k=1), dict(ep=2, dp=4, micro=1, zero=True),
             dict(ep=4, dp=4, micro=1, moe_capacity_factor=1.0),
             dict(ep=2, dp=2, tp=2, micro=1, moe_capacity_factor=1.0),
             dict(ep=2, dp=2, tp=2, sp=True, micro=2, moe_top_k=1),
             dict(ep=2, dp=2, pp=2, micro=1, recompute="full", moe_capacity_factor=1.0)], timeout=300)


def test_ep2_dp4_tp2_on_8_ranks_equals_ep1():
    """Experts summed over TP, then over their expert-DP pairs, divided by dp 4."""
    run_mpi(8, "tests.tensor_parallel.test_expert_parallel:_worker_equals_ep1", [dict(ep=2, dp=4, tp=2, micro=1, moe_capacity_factor=1.0)],
            timeout=240)


# ---- capacity ties under RoPE ----------------------------------------------------------------------
def _runs_of_tokens():
    """Runs of 12 equal tokens: under RoPE (no position added to the residual) a sequence that
    starts inside a run has its first tokens' hidden states, and router probabilities, equal but
    for the rounding of the layout's reductions."""
    t = np.repeat(np.random.default_rng(0).integers(0, 97, 400), 12)
    return Dataset(t, t, 97, "runs of tokens")


def _worker_capacity_ties(cases):
    from mpi4py import MPI

    from cutp.tensor_parallel import gather_full

    def train(cfg, comm):
        run = build_run(cfg, comm, dataset=_runs_of_tokens())
        stats = [train_step(run) for _ in range(2)]
        full = lambda p, a: np.asarray(gather_full(run.ctx.tp, a, p.sharding))[:p.real_rows]  # noqa: E731
        everyone = comm.allgather({p.name: (full(p, p.grad), full(p, p.data)) for p in run.model.parameters()})
        run.close()
        return [(s.loss, s.grad_norm, s.moe["aux_loss"], s.moe["dropped"]) for s in stats], everyone

    # Qwen3-MoE's shape: RoPE, QK-norm, RMSNorm, SwiGLU, 16 experts top-4, no dropout (so the run's
    # first tokens are equal)
    model = dict(positions="rope", norm="rmsnorm", qk_norm=True, mlp="swiglu", bias=False, dropout=0.0, n_embd=128,
                 n_head=8, n_kv_head=2, head_dim=32, n_experts=16, moe_top_k=4, moe_ffn=64, moe_capacity_factor=1.25)
    for kw in cases:
        kw = dict(kw)
        ep = kw.pop("ep", 1)
        cfg = _with(_config(**kw, **model), ep=ep)
        got, everyone = train(cfg, MPI.COMM_WORLD)
        # one rank with each DP rank's micro-batch (the capacity's group)
        ref, ref_everyone = train(_config(micro=cfg.micro_batch_size, **model), MPI.COMM_SELF)
        assert all(row[3] > 0 for row in ref), ref  # some are dropped
        _compare(kw, got, everyone, ref, ref_everyone)


def test_capacity_drops_the_same_tied_tokens_at_tp2_sp_and_dp2_ep2_as_one_rank():
    """F1 (layouts review): equal router probabilities of a RoPE model's repeated tokens differed in
    their last bit between layouts, and the capacity's ranking dropped different tokens (loss 1e-4
    apart); ranked in a narrower float they tie and go in token order at every layout."""
    run_mpi(2, "tests.tensor_parallel.test_expert_parallel:_worker_capacity_ties",
            [dict(tp=2, sp=True, micro=4), dict(dp=2, ep=2, micro=2)], timeout=120)


def test_capacity_ranks_probabilities_equal_but_for_rounding_in_token_order():
    from cutp.tensor_parallel.moe_capacity import accepted

    p = np.array([0.3, np.nextafter(0.3, 1.0), 0.3, 0.6])  # tokens 0-2 tie but for the last bit
    e = np.array([1, 1, 1, 1])
    np.testing.assert_array_equal(accepted(np, e, p, 2, 2), [True, False, False, True])
    p32 = p.astype(np.float32)
    p32[1] = np.nextafter(p32[0], np.float32(1))
    np.testing.assert_array_equal(accepted(np, e, p32, 2, 2), [True, False, False, True])  # float32: the same
    np.testing.assert_array_equal(accepted(np, e, np.array([0.3, 0.31, 0.3, 0.6]), 2, 2),
                                  [False, True, False, True])  # a real difference still ranks


# ---- the all-to-all ------------------------------------------------------------------------------
def _worker_all_to_all():
    import ml_dtypes
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ctx = cutp.init(comm=world, dp=world.size, ep=2)
    n, r = world.size, world.rank
    assert (ctx.ep_size, ctx.ep_rank, ctx.ep.size, ctx.expert_dp.size) == (2, r % 2, 2, n // 2)
    assert ctx.ep.rank == r % 2 and ctx.expert_dp.rank == r // 2
    counts = lambda src, dst: (3 * src + dst) % 4  # noqa: E731  (rows src sends to dst; some 0)
    for dt in (np.float64, np.float32, ml_dtypes.bfloat16, np.int64):
        send = [counts(r, d) for d in range(n)]
        recv = [counts(s, r) for s in range(n)]
        x = np.concatenate([np.full((counts(r, d), 3), 10 * r + d) for d in range(n)] + [np.zeros((0, 3))])
        ctx.counter.reset()
        y = ctx.world.all_to_all(np.ascontiguousarray(x.astype(dt)), send, recv)
        want = np.concatenate([np.full((counts(s, r), 3), 10 * s + r) for s in range(n)] + [np.zeros((0, 3))])
        assert y.dtype == np.dtype(dt) and y.shape == want.shape
        np.testing.assert_array_equal(y.astype(np.float64), want)
        assert ctx.counter.bytes("world", "all_to_all") == x.astype(dt).nbytes
        assert ctx.counter.calls("world", "all_to_all") == 1
    empty = ctx.ep.all_to_all(np.zeros((0, 3)), [0, 0], [0, 0])  # a rank with nothing to send or receive
    assert empty.shape == (0, 3)
    with pytest.raises(cutp.comm.CommError, match="send_counts sum to 5 rows but x has shape"):
        ctx.world.all_to_all(np.zeros((4, 2)), [5] + [0] * (n - 1), [0] * n)
    ctx.close()


def test_nccl_all_to_all_plan():
    """NCCL has no all-to-all: one send and one receive per peer with rows, in one group, and
    this rank's own rows copied (the GPU path runs this plan)."""
    send, recv = [2, 0, 3, 1], [1, 4, 0, 2]
    plan = all_to_all_plan(send, recv, rank=2)
    assert plan == [("send", 0, 0, 2), ("recv", 0, 0, 1), ("recv", 1, 1, 4), ("copy", 2, (2, 5), 3),
                    ("send", 3, 5, 1), ("recv", 3, 5, 2)]
    assert all_to_all_plan([0, 0], [0, 0], 0) == []


def _worker_nccl_all_to_all():
    import cupy

    ctx = cutp.init(dp=2, ep=2, device="cuda")
    r = ctx.rank
    send, recv = ([1, 3], [1, 2]) if r == 0 else ([2, 0], [3, 0])  # rank 1 sends itself nothing
    x = cupy.asarray(np.concatenate([np.full((c, 4), 10 * r + d) for d, c in enumerate(send)]))
    y = cupy.asnumpy(ctx.ep.all_to_all(x, send, recv))
    want = np.concatenate([np.full((c, 4), 10 * s + r) for s, c in enumerate(recv)])
    np.testing.assert_array_equal(y, want)
    ctx.close()


@pytest.mark.skipif(not cutp.runtime.backend.cuda_device_count(), reason="needs an NVIDIA GPU with CuPy and NCCL; "
                    "the NCCL send/recv plan is checked on the CPU above")
def test_nccl_all_to_all_on_gpu():
    from cupy.cuda import nccl

    from cutp.runtime import backend

    if backend.cuda_device_count() < 2 and nccl.get_version() < 23000:
        pytest.skip("one GPU and NCCL < 2.30: two ranks cannot share a GPU")
    run_mpi(2, "tests.tensor_parallel.test_expert_parallel:_worker_nccl_all_to_all", timeout=120,
            env={"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if backend.cuda_device_count() < 2 else None)


# ---- checkpoints ---------------------------------------------------------------------------------
def _worker_checkpoints(tmp):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    data = random_tokens(97, 4096, 0)
    base = _with(_config(dp=2, micro=1, moe_capacity_factor=1.25), steps=3)

    def losses(cfg, steps):
        run = build_run(cfg, world, dataset=data)
        out = [train_step(run).loss for _ in range(steps)]
        if cfg.out:
            save(run)
        run.close()
        return out

    ref = losses(base, 3)
    # (ep, distributed optimizer) saved -> resumed: the plain optimizer's state gathered with the
    # experts, or the distributed optimizer's pieces written by every DP rank
    saved = set()
    for (first, zero_first), (then, zero_then) in (((2, False), (1, False)), ((1, False), (2, True)),
                                                   ((2, True), (1, True)), ((2, True), (2, False))):
        out = os.path.join(tmp, f"ep{first}{'-zero' if zero_first else ''}")
        if out not in saved:
            saved.add(out)
            head = losses(_with(base, ep=first, out=out, run_steps=2, distributed_optimizer=zero_first), 2)
            np.testing.assert_allclose(head, ref[:2], rtol=1e-10)
        ckpt = os.path.join(out, "step-00000002")
        tail = losses(_with(base, ep=then, resume=ckpt, resumed_step=2, distributed_optimizer=zero_then), 1)
        np.testing.assert_allclose(tail, ref[2:], rtol=1e-10, err_msg=f"ep {first} -> {then}")
    metas = [json.load(open(os.path.join(tmp, d, "step-00000002", "meta.json"))) for d in ("ep1", "ep2", "ep2-zero")]
    # every expert, in the order of EP 1
    assert list(metas[0]["params"]) == list(metas[1]["params"]) == list(metas[2]["params"])
    ctx = cutp.init(comm=world, dp=2, ep=2)
    from cutp.checkpoint import load_model
    from cutp.generate import generate

    model = load_model(os.path.join(tmp, "ep2", "step-00000002"), ctx)[0]
    with pytest.raises(cutp.ConfigError, match="generation with expert parallelism"):
        generate(model, [1, 2, 3], 2)
    ctx.close()
    # the command line: --ep, and its metrics
    from examples.train_gpt import main

    rows = main(["--preset", "tiny-moe", "--tp", "1", "--dp", "2", "--ep", "2", "--steps", "2", "--batch-size", "4",
                 "--seq-len", "32", "--set", "moe_capacity_factor=1.0", "--eval-every", "1", "--eval-batches", "1", "--quiet"])
    assert [r["step"] for r in rows] == [1, 2] and all(r["moe_aux_loss"] > 0 for r in rows), rows


def test_checkpoints_hold_every_expert_and_resume_across_ep_sizes(tmp_path):
    run_mpi(2, "tests.tensor_parallel.test_expert_parallel:_worker_checkpoints", str(tmp_path), timeout=180)


# ---- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(dp=2, ep=2, n_experts=0), r"ep 2 splits the experts of an MoE model over ranks, but the model is dense"),
    (dict(dp=4, ep=3), r"ep 3 must divide dp=4 and n_experts=4"),
    (dict(dp=4, ep=4, n_experts=6), r"ep 4 must divide dp=4 and n_experts=6"),
    (dict(dp=2, ep=0), r"ep must be an integer >= 1, got 0"),
])
def test_refusals(kw, message):
    ep = kw.pop("ep")
    with pytest.raises(cutp.ConfigError, match=message):
        _with(_config(**kw), ep=ep)


def test_mesh_refuses_an_ep_that_does_not_divide_dp():
    with pytest.raises(cutp.ConfigError, match=r"ep=3 does not divide dp=4"):
        validate_mesh(4, 1, 4, 1, 3)
    assert validate_mesh(8, 2, 4, 1, 2).coords(7)["ep"] == 1  # rank 7: tp 1, dp 3, ep_rank 1
