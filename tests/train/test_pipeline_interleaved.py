"""The interleaved pipeline schedule (issue 15): `--pp-schedule interleaved --pp-virtual V`, and
the schedule plans every pipeline schedule runs.

The plans of all stages are simulated together for many (schedule, p, m, V): no ordering
deadlocks, even if every send waits for its receive; the messages between two ranks are posted
in the same order on both sides (NCCL has no tags: this is what matches them); each
(micro-batch, chunk) runs forward once and backward once, each chunk's backwards in micro-batch
order; at most the schedule's bound is in flight. Then float64 runs: V = 2 model chunks per
stage at pp 2 and 4, with TP, DP, sequence parallelism, recomputation, dropout and uneven chunks,
equal one rank within 1e-10; checkpoints resume bit-identically at their mesh and load at other
PP and V; the command line gives one rank's losses.
"""
import json
import os

import numpy as np
import pytest

import cutp
from cutp.checkpoint.files import read_meta
from cutp.models import GPTConfig, stage_layers, virtual_stage_layers
from cutp.train import RunConfig
from cutp.train.pipeline import SCHEDULES, pipeline_bubble, plan
from tests.mpirun import run_mpi
from tests.tp_utils import on_rank_0
from tests.train.test_pipeline import TRAIN, _metrics, _train, assert_stages_equal_one_rank
from tests.checkpoint.test_pipeline_checkpoints import _run


# ---- the plans, simulated ----------------------------------------------------------------------
def _messages(kind, p, m, V):
    """Each stage's plan with the messages that cross stages resolved: ("X", [(tag, "send" or
    "recv", peer, message)]) in the order the stage posts them, and the computations."""
    progs = []
    for s in range(p):
        def takes(c, s=s):
            return s == 0 and c == 0

        def gives(c, s=s):
            return s == p - 1 and c == V - 1

        prog = []
        for op in plan(kind, p, s, m, V):
            if op[0] != "X":
                prog.append(op)
                continue
            ops = []  # a message is named by what its receiver runs: (what, micro-batch, receiving chunk)
            for what, i, c in op[1]:
                if what == "act" and not gives(c):
                    ops.append((0, "send", (s + 1) % p, ("act", i, c + (s == p - 1))))
                if what == "grad" and not takes(c):
                    ops.append((1, "send", (s - 1) % p, ("grad", i, c - (s == 0))))
            for what, i, c in op[2]:
                if what == "act" and not takes(c):
                    ops.append((0, "recv", (s - 1) % p, ("act", i, c)))
                if what == "grad" and not gives(c):
                    ops.append((1, "recv", (s + 1) % p, ("grad", i, c)))
            ops.sort(key=lambda o: o[0])  # as Schedule.exchange posts them
            if ops:
                prog.append(("X", ops))
        progs.append(prog)
    return progs


def _simulate(progs):
    """Runs the stages' programs with rendezvous messages (a send completes only once its receive
    is posted): raises AssertionError on a deadlock or a message matched out of order. Returns
    each stage's most (micro-batch, chunk) pairs in flight."""
    p = len(progs)
    order = {}
    for s, prog in enumerate(progs):
        for op in prog:
            for _, d, peer, msg in op[1] if op[0] == "X" else ():
                pair = (s, peer) if d == "send" else (peer, s)
                order.setdefault((pair, d), []).append(msg)
    for (pair, d), msgs in order.items():
        if d == "send":
            assert msgs == order.get((pair, "recv")), f"{pair}: sent {msgs}, received {order.get((pair, 'recv'))}"
    pc, kept, most = [0] * p, [set() for _ in range(p)], [0] * p
    while any(pc[s] < len(progs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(progs[s]) and progs[s][pc[s]][0] != "X":
                kind, i, c = progs[s][pc[s]]
                if kind == "F":
                    assert (i, c) not in kept[s]
                    kept[s].add((i, c))
                    most[s] = max(most[s], len(kept[s]))
                else:
                    kept[s].remove((i, c))
                pc[s] += 1
                moved = True
        posted = {(s, d, peer, msg) for s in range(p) if pc[s] < len(progs[s]) for _, d, peer, msg in progs[s][pc[s]][1]}
        done = [s for s in range(p) if pc[s] < len(progs[s]) and all(
            (peer, "recv" if d == "send" else "send", s, msg) in posted for _, d, peer, msg in progs[s][pc[s]][1])]
        for s in done:
            pc[s] += 1
        assert moved or done, f"deadlock: the stages wait in {[progs[s][pc[s]] for s in range(p) if pc[s] < len(progs[s])]}"
    assert not any(kept), kept
    return most


def _bound(kind, p, s, m, V):
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - s, m)
    return m * V if m == p else min(m * V, 2 * (p - s - 1) + (V - 1) * p + 1)


CASES = [(kind, p, m, V) for p in (2, 3, 4, 8) for m in range(1, 3 * p + 1) for kind, V in
         [("gpipe", 1), ("1f1b", 1)] + [("interleaved", V) for V in (2, 3, 4)]
         if not (kind == "1f1b" and m < p) and not (kind == "interleaved" and m % p)]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_every_schedule_plan_runs_without_deadlock_in_order_within_its_bound(p):
    cases = [c for c in CASES if c[1] == p]
    assert {kind for kind, *_ in cases} == set(SCHEDULES)
    for kind, p, m, V in cases:
        most = _simulate(_messages(kind, p, m, V))
        assert most == [_bound(kind, p, s, m, V) for s in range(p)], (kind, p, m, V, most)
        for s in range(p):
            ops = plan(kind, p, s, m, V)
            forwards = [op[1:] for op in ops if op[0] == "F"]
            backwards = [op[1:] for op in ops if op[0] == "B"]
            assert sorted(forwards) == sorted(backwards) == [(i, c) for i in range(m) for c in range(V)]
            for c in range(V):  # the gradients are summed in one order, whatever the schedule
                assert [i for i, cc in backwards if cc == c] == list(range(m)), (kind, p, m, V, s)


def test_the_simulation_finds_a_deadlock_and_messages_out_of_order():
    act, grad = ("act", 0, 0), ("grad", 0, 0)
    stage1 = [("X", [(0, "recv", 0, act)]), ("F", 0, 0), ("B", 0, 0), ("X", [(1, "send", 0, grad)])]
    _simulate([[("F", 0, 0), ("X", [(0, "send", 1, act)]), ("X", [(1, "recv", 1, grad)]), ("B", 0, 0)], stage1])
    with pytest.raises(AssertionError, match="deadlock"):  # stage 0 waits for the gradient before sending
        _simulate([[("F", 0, 0), ("X", [(1, "recv", 1, grad)]), ("X", [(0, "send", 1, act)]), ("B", 0, 0)], stage1])
    good = _messages("1f1b", 2, 2, 1)
    swapped = [list(good[0]), good[1]]
    xs = [k for k, op in enumerate(swapped[0]) if op[0] == "X" and op[1][0][1] == "send"]
    swapped[0][xs[0]], swapped[0][xs[1]] = swapped[0][xs[1]], swapped[0][xs[0]]
    with pytest.raises(AssertionError, match="sent"):
        _simulate(swapped)


def test_chunks_layers_bubble_and_the_settings_interleaving_refuses():
    assert virtual_stage_layers(8, 2, virtual=2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(8, 2, virtual=2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert stage_layers(5, 2, (2, 1, 1, 1), virtual=2) == [[0, 1, 3], [2, 4]]
    with pytest.raises(cutp.ConfigError, match=r"n_layer=6 does not split evenly over pp=2 x pp_virtual 2 = 4"):
        stage_layers(6, 2, virtual=2)
    with pytest.raises(cutp.ConfigError, match=r"pp_layers 3,3: needs pp=2 x pp_virtual 2 = 4 model chunks"):
        stage_layers(6, 2, (3, 3), virtual=2)
    assert pipeline_bubble(4, 8) == pytest.approx(3 / 11) and pipeline_bubble(4, 8, 2) == pytest.approx(3 / 19)
    with pytest.raises(cutp.ConfigError, match=r"multiple of pp=4 micro-batches per step.* gives 6"):
        _config(pp=4, micro=1, batch=6, n_layer=8)
    with pytest.raises(cutp.ConfigError, match="pp_virtual 2 with pp_schedule 1f1b"):
        _config(pp=2, schedule="1f1b")
    with pytest.raises(cutp.ConfigError, match="pp_virtual 1 with pp_schedule interleaved"):
        _config(pp=2, virtual=1)
    with pytest.raises(cutp.ConfigError, match="pp_virtual 2 needs pipeline stages"):
        _config(pp=1)


# ---- float64: equal to one rank -----------------------------------------------------------------
def _config(tp=1, dp=1, pp=2, virtual=2, micro=1, batch=8, schedule="interleaved", pp_layers=None, sp=False,
            recompute="none", zero=False, out=None, resume=None, resumed_step=None, **model):
    m = dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, vocab_size=97, block_size=16, dtype="float64", dropout=0.1)
    m.update(model)
    return RunConfig(model=GPTConfig(**m), tp=tp, dp=dp, pp=pp, pp_virtual=virtual, pp_layers=pp_layers,
                     pp_schedule=schedule, batch_size=batch, micro_batch_size=micro, seq_len=16, steps=4, warmup=1,
                     seed=3, sequence_parallel=sp, recompute=recompute, distributed_optimizer=zero, eval_every=0,
                     quiet=True, save_on_signal=False, out=out, resume=resume, resumed_step=resumed_step,
                     eval_batches=2)


def _worker_equals_one_rank(cases):
    from mpi4py import MPI

    for kw in cases:
        cfg = _config(**kw)
        losses, stages, in_flight = _train(cfg, MPI.COMM_WORLD)
        ref_kw = {k: v for k, v in kw.items() if k in ("tie_embeddings", "n_layer")}
        ref_losses, ref_stages, _ = on_rank_0(lambda: _train(_config(pp=1, virtual=1, schedule="1f1b",
                                                                     batch=cfg.batch_size, **ref_kw), MPI.COMM_SELF))
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0, err_msg=str(kw))
        assert_stages_equal_one_rank(stages, ref_stages[0], cfg, kw)
        p, V, m = cfg.pp, cfg.pp_virtual, cfg.accum_steps
        assert in_flight == [_bound("interleaved", p, s, m, V) for s in range(p)], (kw, in_flight)


def test_interleaved_pp2_equals_one_rank():
    """m = p (every forward first) and m = 4p (a steady state), untied and uneven chunks."""
    run_mpi(2, "tests.train.test_pipeline_interleaved:_worker_equals_one_rank",
            [dict(micro=4), dict(tie_embeddings=False), dict(n_layer=5, pp_layers=(2, 1, 1, 1), micro=2)],
            timeout=300)


def test_interleaved_pp4_tp2_sp_dp2_equal_one_rank():
    run_mpi(4, "tests.train.test_pipeline_interleaved:_worker_equals_one_rank",
            [dict(pp=4, n_layer=8),
             dict(tp=2, pp=2, sp=True, recompute="full", micro=2),
             dict(dp=2, pp=2, recompute="selective", zero=True, micro=1)], timeout=300)


# ---- checkpoints and the command line ------------------------------------------------------------
def _worker_checkpoints(tmp):
    from mpi4py import MPI

    world = MPI.COMM_WORLD

    def run(cfg, steps, save_at=None, comm=world):
        return _run(cfg, comm, steps, save_at)

    ref, ref_val = run(_config(pp=2, out=os.path.join(tmp, "v2")), 4, save_at=2)
    ckpt = os.path.join(tmp, "v2", "step-00000002")
    again, _ = run(_config(pp=2, resume=ckpt, resumed_step=2), 2)
    assert again == ref[2:], (again, ref[2:])  # the same mesh: bit-identical (dropout included)
    for mesh in (dict(pp=2, virtual=1, schedule="1f1b", pp_layers=(3, 1)), dict(pp=1, dp=2, virtual=1,
                                                                                schedule="1f1b")):
        losses, val = run(_config(resume=ckpt, resumed_step=2, **mesh), 2)
        np.testing.assert_allclose(losses, ref[2:], rtol=1e-10, atol=0, err_msg=str(mesh))
        np.testing.assert_allclose(val, ref_val, rtol=1e-10, err_msg=str(mesh))
    if world.Get_rank() == 0:  # one rank, pp 1
        losses, val = run(_config(pp=1, virtual=1, schedule="1f1b", resume=ckpt, resumed_step=2), 2,
                          comm=MPI.COMM_SELF)
        np.testing.assert_allclose(losses, ref[2:], rtol=1e-10, atol=0)
        np.testing.assert_allclose(val, ref_val, rtol=1e-10)
    world.Barrier()


def test_interleaved_checkpoints_resume_and_load_at_other_layouts(tmp_path):
    tmp = str(tmp_path)
    run_mpi(2, "tests.train.test_pipeline_interleaved:_worker_checkpoints", tmp, timeout=300)
    meta = read_meta(os.path.join(tmp, "v2", "step-00000002"))
    assert meta["mesh"] == {"tp": 1, "dp": 1, "pp": 2, "pp_layers": [1, 1, 1, 1], "pp_virtual": 2}
    stages = {name: info["stage"] for name, info in meta["params"].items()}
    assert [stages[f"layers.{i}.attn_norm.weight"] for i in range(4)] == [0, 1, 0, 1]
    assert stages["tok_embed.weight"] == 0 and stages["final_norm.weight"] == 1


def test_cli_interleaved_losses_equal_one_rank(tmp_path):
    base = ["--preset", "tiny", "--set", "n_layer=4", "--set", "vocab_size=259", "--dtype", "float64",
            "--seq-len", "32", "--batch-size", "8", "--dropout", "0.1", "--steps", "8", "--eval-every", "4",
            "--eval-batches", "1", "--quiet"]
    rows = {}
    for name, n, extra in (("tp1", 1, ["--tp", "1"]),
                           ("pp2v2", 2, ["--tp", "1", "--pp", "2", "--pp-virtual", "2", "--micro-batch-size", "2"])):
        m = tmp_path / f"{name}.jsonl"
        run_mpi(n, TRAIN, base + ["--metrics", str(m)] + extra, timeout=300)
        rows[name] = _metrics(m)
    ref = [r["loss"] for r in rows["tp1"]]
    assert len(ref) == 8
    np.testing.assert_allclose([r["loss"] for r in rows["pp2v2"]], ref, rtol=1e-10, atol=0)
    np.testing.assert_allclose([r["val_loss"] for r in rows["pp2v2"] if "val_loss" in r],
                               [r["val_loss"] for r in rows["tp1"] if "val_loss" in r], rtol=1e-10)
    assert all(r["pipeline_wait_ms"] >= 0 for r in rows["pp2v2"] if "pipeline_wait_ms" in r)
    assert json.dumps(rows["pp2v2"][0])  # plain JSON records
    # the memory report says what each stage held: m = 4, V = 2: min(8, 2 (p-s-1) + (V-1) p + 1) = 5, 3
    out = run_mpi(2, TRAIN, base[:base.index("--steps")] + ["--steps", "1", "--eval-every", "0", "--pp", "2",
                                                             "--pp-virtual", "2", "--micro-batch-size", "2"],
                  timeout=120).stdout
    assert "forwards in flight at most: 5, 3 (stages 0..1)" in out, out
