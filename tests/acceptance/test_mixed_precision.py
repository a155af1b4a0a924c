"""Issue 13 acceptance, written from the issue and the README alone (a second, independent suite):
mixed precision (bfloat16, float16 with a dynamic loss scale) through fp32 master weights, and the
distributed optimizer (ZeRO-1). Configurations deliberately differ from the obvious ones: GQA,
no biases, untied embeddings, odd DP sizes, micro-batching, TP x DP meshes.

Everything runs on the CPU with tiny models (2 layers, 32 tokens, a handful of sequences)."""
from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from cutp import train
from tests.mpirun import ROOT, run_mpi

HERE = "tests.acceptance.test_mixed_precision"
PY = sys.executable
TRAIN_PY = os.path.join(ROOT, "examples", "train_gpt.py")
BASE = ["--preset", "tiny", "--set", "n_layer=2", "--seq-len", "32", "--eval-every", "0", "--quiet",
        "--device", "cpu", "--no-save-on-signal"]
LIB = dict(preset="tiny", seq_len=32, eval_every=0, device="cpu", quiet=True, save_on_signal=False)


# ---- helpers ------------------------------------------------------------------------------------------
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "U16": "uint16", "U8": "uint8"}


def read_safetensors(path) -> dict:
    """name -> (dtype string as stored, array); reads bfloat16 through ml_dtypes (safetensors.numpy cannot)."""
    import ml_dtypes

    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES[info["dtype"]]
        np_dt = ml_dtypes.bfloat16 if dt == "bfloat16" else np.dtype(dt)
        a, b = info["data_offsets"]
        arr = np.frombuffer(raw[8 + n + a: 8 + n + b], dtype=np_dt).reshape(info["shape"])
        out[name] = (info["dtype"], arr)
    return out


def ckpt_dir(run_dir) -> str:
    """A run directory's latest checkpoint (or the checkpoint directory itself)."""
    if os.path.exists(os.path.join(run_dir, "meta.json")):
        return str(run_dir)
    with open(os.path.join(run_dir, "latest")) as f:
        return os.path.join(run_dir, json.load(f)["path"])


def ckpt_tensors(run_dir) -> dict:
    """(kind, tensor name) -> array over the checkpoint's model and optimizer state (TP rank 0's),
    however the optimizer saved it (cutp.checkpoint.read_shard)."""
    from cutp.checkpoint import read_shard

    d = ckpt_dir(run_dir)
    return {(kind, k): np.asarray(v) for kind in ("model", "optim") for k, v in read_shard(d, kind).items()}


def rel_close(a, b, rtol):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = max(np.abs(b).max(initial=0.0), 1e-300)
    return np.abs(a - b).max(initial=0.0) <= rtol * scale


def _dump(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def _load(path):
    with open(path) as f:
        return json.load(f)


def _cli(args, timeout=60):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([PY] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---- float64: the distributed optimizer is the plain optimizer's math ----------------------------------
def _worker_two_mains(out_json, runs):
    """Calls examples.train_gpt.main once per (name, argv) in `runs`; rank 0 writes the histories."""
    from examples.train_gpt import main
    from mpi4py import MPI

    histories = {}
    for name, argv in runs:
        histories[name] = main(argv)
    if MPI.COMM_WORLD.rank == 0:
        _dump(out_json, histories)


def _check_distributed_equals_plain(tmp_path, nprocs, mesh):
    common = BASE + ["--dtype", "float64", "--steps", "10", "--grad-clip", "0.5", "--weight-decay", "0.1"] + mesh
    runs = [("plain", common + ["--out", str(tmp_path / "plain")]),
            ("dist", common + ["--distributed-optimizer", "--out", str(tmp_path / "dist")])]
    out = tmp_path / "h.json"
    run_mpi(nprocs, f"{HERE}:_worker_two_mains", str(out), runs, timeout=240)
    h = _load(out)
    plain, dist = h["plain"], h["dist"]
    assert [r["step"] for r in plain] == [r["step"] for r in dist] == list(range(1, 11))
    lp, ld = np.array([r["loss"] for r in plain]), np.array([r["loss"] for r in dist])
    gp, gd = np.array([r["grad_norm"] for r in plain]), np.array([r["grad_norm"] for r in dist])
    np.testing.assert_allclose(ld, lp, rtol=1e-12, atol=0)
    np.testing.assert_allclose(gd, gp, rtol=1e-12, atol=0)
    assert (gp > 0.5).sum() >= 3, f"clipping was not active: norms {gp}"
    assert lp[-1] < lp[0], "the loss did not go down"
    # and the final weights and the optimizer state (per parameter) agree too
    tp_, td = ckpt_tensors(tmp_path / "plain"), ckpt_tensors(tmp_path / "dist")
    assert tp_.keys() == td.keys() and len(tp_) > 0
    for key in tp_:
        assert tp_[key].shape == td[key].shape, key
        assert rel_close(td[key], tp_[key], 1e-12), key
    return h


def test_float64_distributed_optimizer_matches_plain_at_odd_dp3_gqa_untied_no_bias(tmp_path):
    """#792 (odd DP sizes): dp=3 with accumulation (micro-batch 1 of 2 per rank), GQA, no biases,
    untied embeddings, a narrower MLP (361,088 parameters: the flat buffer is padded, so the last
    shard is short), clipping active: losses, norms, weights and moments within 1e-12."""
    _check_distributed_equals_plain(tmp_path, 3, ["--tp", "1", "--dp", "3", "--batch-size", "6",
                                                  "--micro-batch-size", "1", "--set", "n_kv_head=2",
                                                  "--set", "bias=false", "--set", "tie_embeddings=false",
                                                  "--set", "mlp_hidden=384"])


def test_float64_distributed_optimizer_matches_plain_at_tp2_dp2_tied(tmp_path):
    """#844 (tied embeddings under the distributed optimizer) at TP=2 x DP=2, GQA split over TP,
    micro-batching: the grad norm counts every element once (same norm as the plain optimizer)."""
    _check_distributed_equals_plain(tmp_path, 4, ["--tp", "2", "--dp", "2", "--batch-size", "8",
                                                  "--micro-batch-size", "2", "--set", "n_kv_head=2"])


# ---- bfloat16: every layout matches TP=1 bfloat16 within 1e-2 ------------------------------------------
def _bf16_run(comm, **mesh):
    from cutp import train

    cfg = train.resolve_run_config(comm, **LIB, set=["n_layer=2", "n_kv_head=2"], dtype="bfloat16", batch_size=8,
                                   steps=20, **mesh)
    run = train.build_run(cfg, comm)
    assert str(run.flat.data.dtype) == "bfloat16", run.flat.data.dtype
    assert all(str(p.data.dtype) == "bfloat16" for p in run.model.parameters())
    assert run.flat.grad.dtype == np.float32, "the main_grad must be float32"
    losses = []
    while run.step < run.end_step:
        s = train.train_step(run)
        assert not s.skipped and np.isfinite(s.loss), s
        losses.append(float(s.loss))
    run.close()
    return losses


def _worker_bf16_layouts(out_json):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    mine = {}
    mine["tp2xdp2 distributed accum2"] = _bf16_run(world, tp=2, dp=2, distributed_optimizer=True, micro_batch_size=2)
    half = world.Split(world.rank // 2, world.rank)
    if world.rank < 2:
        mine["tp2"] = _bf16_run(half, tp=2)
    else:
        mine["dp2 distributed"] = _bf16_run(half, tp=1, dp=2, distributed_optimizer=True)
    if world.rank == 0:
        mine["tp1"] = _bf16_run(MPI.COMM_SELF, tp=1)
    elif world.rank >= 2:
        mine["dp2 bf16 grad reduce"] = _bf16_run(half, tp=1, dp=2, grad_reduce_dtype="bfloat16", micro_batch_size=2)
    every = world.gather(mine, root=0)
    if world.rank == 0:
        merged = {}
        for d in every:
            for k, v in d.items():
                assert k not in merged or merged[k] == v, f"ranks of {k} disagree on the losses"
                merged[k] = v
        _dump(out_json, merged)
    half.Free()


def test_bfloat16_tp2_dp2_and_distributed_match_tp1_bfloat16_within_1e_2(tmp_path):
    out = tmp_path / "bf16.json"
    run_mpi(4, f"{HERE}:_worker_bf16_layouts", str(out), timeout=300)
    h = _load(out)
    ref = np.array(h.pop("tp1"))
    assert len(ref) == 20 and ref[-1] < ref[0] - 0.3, ref
    assert set(h) == {"tp2xdp2 distributed accum2", "tp2", "dp2 distributed", "dp2 bf16 grad reduce"}
    for name, losses in h.items():
        losses = np.array(losses)
        assert len(losses) == 20, name
        np.testing.assert_allclose(losses, ref, rtol=1e-2, atol=0, err_msg=name)


# ---- float16: an injected overflow is skipped on every rank, the scale halves -----------------------------
class _Inject(train.StepHooks):
    """Puts an Inf into this rank's main_grad at chosen steps (on chosen ranks) and snapshots the
    parameters and the optimizer state before chosen steps."""

    def __init__(self, steps, on_rank, index, snap_before=()):
        self.steps, self.on_rank, self.index = set(steps), on_rank, index
        self.snap_before, self.snaps = set(snap_before), {}

    def after_forward(self, run, micro):
        step = run.step + 1  # the step in progress
        if micro == 0 and step in self.snap_before:
            opt = {k: np.array(v, copy=True) for k, v in run.optimizer.state_dict().items()}
            self.snaps[step] = (np.array(run.flat.data, copy=True), opt)

    def before_grad_sync(self, run):
        if run.step + 1 in self.steps and self.on_rank(run.ctx):
            idx = self.index if self.index >= 0 else run.flat.size + self.index
            run.flat.grad[idx] = np.inf


def _same_state(a, b):
    pa, oa = a
    pb, ob = b
    return np.array_equal(pa.view(np.uint16), pb.view(np.uint16)) and oa.keys() == ob.keys() and all(
        np.array_equal(oa[k], ob[k]) for k in oa)


def _worker_fp16_overflow(out_dir):
    from examples.train_gpt import main
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    common = BASE + ["--dtype", "float16", "--batch-size", "8"]
    result = {}

    # (a) dp=2, distributed optimizer, hysteresis 1: an Inf on DP rank 1 only, in the element DP rank 0
    # owns after the reduce-scatter; both ranks must skip step 3 and halve the scale together
    hooks = _Inject([3], lambda ctx: ctx.dp_rank == 1, 0, snap_before=(3, 4, 5))
    loud = [a for a in common if a != "--quiet"]  # the overflow is reported on the progress output
    hist = main(loud + ["--tp", "1", "--dp", "2", "--distributed-optimizer", "--micro-batch-size", "2",
                        "--hysteresis", "1", "--steps", "6"], hooks=hooks)
    assert _same_state(hooks.snaps[3], hooks.snaps[4]), "the overflowed step 3 changed weights or optimizer state"
    assert not _same_state(hooks.snaps[4], hooks.snaps[5]), "training did not continue after the overflow"
    assert str(hooks.snaps[3][0].dtype) == "float16"
    result["a"] = [(r["step"], r["loss"], r.get("loss_scale")) for r in hist]

    # (b) tp=2, plain optimizer, default hysteresis 2: Infs on TP rank 0 only at steps 3 and 4:
    # the first overflow keeps the scale, the second halves it
    hooks = _Inject([3, 4], lambda ctx: ctx.tp_rank == 0, -1, snap_before=(3, 4, 5, 6))
    hist = main(common + ["--tp", "2", "--set", "n_kv_head=4", "--steps", "7"], hooks=hooks)
    assert _same_state(hooks.snaps[3], hooks.snaps[4]) and _same_state(hooks.snaps[4], hooks.snaps[5])
    assert not _same_state(hooks.snaps[5], hooks.snaps[6])
    result["b"] = [(r["step"], r["loss"], r.get("loss_scale")) for r in hist]

    # (c) the floor: start at 4, floor 2, overflows at steps 2 and 3 (TP rank 1 only)
    hooks = _Inject([2, 3], lambda ctx: ctx.tp_rank == 1, 5)
    hist = main(common + ["--tp", "2", "--initial-loss-scale", "4", "--min-loss-scale", "2", "--hysteresis", "1",
                          "--steps", "5"], hooks=hooks)
    result["c"] = [(r["step"], r["loss"], r.get("loss_scale")) for r in hist]

    # (d) overflow skips do not count toward --max-skips while the scale can still shrink: three in a row
    # with --max-skips 2 (DP rank 0 only, distributed optimizer) and the run goes on
    hooks = _Inject([2, 3, 4], lambda ctx: ctx.dp_rank == 0, 7)
    hist = main(common + ["--tp", "1", "--dp", "2", "--distributed-optimizer", "--hysteresis", "1",
                          "--max-skips", "2", "--steps", "6"], hooks=hooks)
    result["d"] = [(r["step"], r["loss"], r.get("loss_scale")) for r in hist]

    every = world.allgather(result)
    assert all(e == every[0] for e in every), f"ranks disagree on the loss scales or losses: {every}"
    if world.rank == 0:
        _dump(os.path.join(out_dir, "fp16.json"), result)


def test_float16_injected_overflow_is_skipped_on_every_rank_and_the_scale_halves(tmp_path):
    res = run_mpi(2, f"{HERE}:_worker_fp16_overflow", str(tmp_path), timeout=240)
    h = _load(tmp_path / "fp16.json")
    scale = {name: {s: sc for s, _, sc in rows} for name, rows in h.items()}
    loss = {name: {s: lo for s, lo, _ in rows} for name, rows in h.items()}
    for name, rows in h.items():
        assert all(np.isfinite(lo) for _, lo, _ in rows), (name, rows)
    # (a) hysteresis 1: 2^16 before, 2^15 from the step after the overflow on (the row of step 3 may show
    # either the scale it used or the one after its update)
    a = scale["a"]
    assert a[1] == a[2] == 65536.0 and a[3] in (65536.0, 32768.0) and a[4] == a[5] == a[6] == 32768.0, a
    # (b) hysteresis 2: no halving after the first overflow, once after the second, none after
    b = scale["b"]
    assert b[2] == b[3] == 65536.0 and b[5] == b[6] == b[7] == 32768.0, b
    # (c) never below the floor
    c = scale["c"]
    assert c[1] == 4.0 and c[4] == c[5] == 2.0 and min(c.values()) >= 2.0, c
    # (d) three overflows in a row under --max-skips 2: the run finishes, the scale halved three times
    d = scale["d"]
    assert sorted(d) == [1, 2, 3, 4, 5, 6] and d[1] == 65536.0 and d[6] == 8192.0, d
    assert loss["a"][6] < loss["a"][1] and loss["b"][7] < loss["b"][1]
    # the overflow is said, with the step and the scale (README: "step N: float16 gradients overflowed at
    # loss scale S: step skipped, scale now S/2")
    said = [ln for ln in res.stdout.splitlines() if "overflow" in ln.lower()]
    assert any(re.search(r"\bstep 3\b", ln) and "65536" in ln and "32768" in ln for ln in said), res.stdout[-3000:]


# ---- resume bit-identically in bfloat16 / float16 with the distributed optimizer -------------------------
def _worker_resume_16bit(d):
    from examples.train_gpt import main
    from mpi4py import MPI

    bf = BASE + ["--dtype", "bfloat16", "--tp", "1", "--dp", "2", "--distributed-optimizer", "--batch-size", "8",
                 "--micro-batch-size", "2", "--set", "tie_embeddings=false", "--steps", "6", "--dropout", "0.1"]
    fp = BASE + ["--dtype", "float16", "--tp", "2", "--batch-size", "8", "--set", "n_kv_head=2",
                 "--initial-loss-scale", "1024", "--loss-scale-window", "2", "--steps", "6"]
    h = {}
    h["bf16"] = main(bf + ["--save-every", "3", "--out", f"{d}/bf16"])
    h["bf16 resumed"] = main(bf + ["--resume", f"{d}/bf16/step-00000003", "--out", f"{d}/bf16-resumed"])
    h["fp16"] = main(fp + ["--save-every", "3", "--out", f"{d}/fp16"])
    h["fp16 resumed"] = main(fp + ["--resume", f"{d}/fp16/step-00000003", "--out", f"{d}/fp16-resumed"])
    if MPI.COMM_WORLD.rank == 0:
        _dump(f"{d}/histories.json", h)


@pytest.fixture(scope="module")
def runs16(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs16")
    run_mpi(2, f"{HERE}:_worker_resume_16bit", str(d), timeout=300)
    return d


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_16bit_resume_is_bit_identical(runs16, name):
    """bfloat16 with the distributed optimizer at dp=2 (untied, dropout); float16 at tp=2 whose loss
    scale grows every 2 clean steps: the scale and its growth tracker must come back from the checkpoint."""
    h = _load(runs16 / "histories.json")
    full, resumed = h[name], h[f"{name} resumed"]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(full[3:], resumed):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
        assert a.get("loss_scale") == b.get("loss_scale"), (a, b)
    if name == "fp16":
        scales = [r["loss_scale"] for r in full]
        assert scales[-1] > scales[0] == 1024.0, f"the dynamic scale never grew: {scales}"
    x, y = ckpt_tensors(runs16 / name), ckpt_tensors(runs16 / f"{name}-resumed")
    assert x.keys() == y.keys() and x
    for k in x:
        assert x[k].dtype == y[k].dtype and np.array_equal(x[k].view(np.uint8), y[k].view(np.uint8)), k
    if name == "bf16":  # the masters are kept, in float32; the parameters in bfloat16
        masters = {k: v for k, v in x.items() if k[1].startswith("master.")}
        assert masters and all(v.dtype == np.float32 for v in masters.values())
        params = {k: v for k, v in x.items() if k[0].startswith("model")}
        assert params and all(str(v.dtype) == "bfloat16" for v in params.values())
    meta = _load(os.path.join(ckpt_dir(runs16 / name), "meta.json"))
    assert meta["step"] == 6 and meta["mesh"] == ({"tp": 1, "dp": 2} if name == "bf16" else {"tp": 2, "dp": 1})
    if name == "fp16":  # the scale came from the checkpoint, not from --initial-loss-scale 1024
        assert resumed[0]["loss_scale"] == full[3]["loss_scale"] > 1024.0


# ---- export writes the precision asked for --------------------------------------------------------------
def test_export_writes_the_precision_asked_for_from_the_masters(runs16, tmp_path):
    import ml_dtypes

    src = ckpt_dir(runs16 / "bf16")
    tensors = ckpt_tensors(src)
    masters = {k[1][len("master."):]: v for k, v in tensors.items() if k[1].startswith("master.")}
    params = {k[1]: v for k, v in tensors.items() if k[0].startswith("model")}
    assert masters.keys() == params.keys()
    # the bf16 parameters are the round-to-nearest-even of the fp32 masters
    for n in params:
        assert np.array_equal(masters[n].astype(ml_dtypes.bfloat16).view(np.uint16), params[n].view(np.uint16)), n
    # and the masters carry more than bf16 holds (so a float32 export is not a widened bf16)
    assert any(not np.array_equal(masters[n], params[n].astype(np.float32)) for n in masters)

    want = {"float32": ("F32", lambda m: m), "bfloat16": ("BF16", lambda m: m.astype(ml_dtypes.bfloat16)),
            "float16": ("F16", lambda m: m.astype(np.float16))}
    for dtype, (tag, convert) in want.items():
        dst = tmp_path / f"export-{dtype}"
        r = _cli(["-m", "cutp.checkpoint", "export", str(runs16 / "bf16"), str(dst), "--dtype", dtype])
        assert r.returncode == 0, r.stdout + r.stderr
        files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
        model_files = [f for f in files if f.startswith("model")]
        assert len(model_files) == 1, files
        got = read_safetensors(dst / model_files[0])
        assert got.keys() == params.keys(), dtype
        for n, (stored, arr) in got.items():
            assert stored == tag, (dtype, n, stored)
            exp = convert(masters[n])
            assert np.array_equal(arr.view(np.uint8), np.ascontiguousarray(exp).view(np.uint8)), (dtype, n)
        if dtype == "float32":
            v = _cli(["-m", "cutp.checkpoint", "verify", str(dst)])
            assert v.returncode == 0, v.stdout + v.stderr
    # without --dtype: the model's own precision
    dst = tmp_path / "export-default"
    r = _cli(["-m", "cutp.checkpoint", "export", str(runs16 / "bf16"), str(dst)])
    assert r.returncode == 0, r.stdout + r.stderr
    got = read_safetensors(dst / [f for f in os.listdir(dst) if f.startswith("model")][0])
    assert {stored for stored, _ in got.values()} == {"BF16"}
    for n, (_, arr) in got.items():
        assert np.array_equal(arr.view(np.uint16), params[n].view(np.uint16)), n
    v = _cli(["-m", "cutp.checkpoint", "verify", src])
    assert v.returncode == 0, v.stdout + v.stderr
    # a dtype export cannot write is refused, with the message naming it, and nothing is written
    dst = tmp_path / "export-int8"
    r = _cli(["-m", "cutp.checkpoint", "export", str(runs16 / "bf16"), str(dst), "--dtype", "int8"])
    assert r.returncode in (1, 2) and "int8" in (r.stdout + r.stderr).strip().splitlines()[-1], r.stdout + r.stderr
    assert not dst.exists() or not any(dst.iterdir())


# ---- resume at another DP size (float64, the distributed optimizer) --------------------------------------
def _worker_resume_other_dp(out_dir):
    from cutp import train
    from mpi4py import MPI

    world = MPI.COMM_WORLD  # 3 ranks
    model = dict(set=["n_layer=2", "n_kv_head=2", "tie_embeddings=false"], preset="tiny")
    run_opts = dict(LIB, dtype="float64", batch_size=6, micro_batch_size=1, grad_clip=0.5)
    run_opts.pop("preset")
    cfg = train.resolve_run_config(world, **model, **run_opts, tp=1, dp=3, distributed_optimizer=True, steps=5,
                                   out=f"{out_dir}/run")
    run = train.build_run(cfg, world)
    losses, saved = {}, None
    while run.step < run.end_step:
        stats = train.train_step(run)
        losses[stats.step] = float(stats.loss)
        if run.step == 2:
            saved = train.save(run)
    run.close()
    assert saved
    # ranks 0-1 resume at dp=2 with the distributed optimizer; rank 2 at dp=1 with the plain one
    half = world.Split(0 if world.rank < 2 else 1, world.rank)
    if world.rank < 2:
        mesh, comm, name = dict(tp=1, dp=2, distributed_optimizer=True), half, "dp2 distributed"
    else:
        mesh, comm, name = dict(tp=1, dp=1, distributed_optimizer=False), MPI.COMM_SELF, "dp1 plain"
    again = train.resolve_run_config(comm, resume=saved, **run_opts, **mesh, steps=5)
    assert again.resumed_step == 2
    rerun = train.build_run(again, comm)
    assert rerun.step == 2
    got = {}
    while rerun.step < rerun.end_step:
        stats = train.train_step(rerun)
        got[stats.step] = float(stats.loss)
    rerun.close()
    every = world.gather((name, got), root=0)
    if world.rank == 0:
        _dump(f"{out_dir}/resumed.json", {"continued": losses, **{n: g for n, g in every}})
    half.Free()


def test_float64_distributed_resume_at_another_dp_size_continues_within_1e_12(tmp_path):
    """#552: saved at dp=3 (a short last shard: the buffer is padded to 64*3), loaded at dp=2
    (distributed) and dp=1 (plain): the next steps' losses equal those of the run that continued."""
    run_mpi(3, f"{HERE}:_worker_resume_other_dp", str(tmp_path), timeout=240)
    h = _load(tmp_path / "resumed.json")
    cont = {int(k): v for k, v in h.pop("continued").items()}
    assert sorted(cont) == [1, 2, 3, 4, 5]
    assert set(h) == {"dp2 distributed", "dp1 plain"}
    for name, got in h.items():
        got = {int(k): v for k, v in got.items()}
        assert sorted(got) == [3, 4, 5], name
        for s in got:
            assert abs(got[s] - cont[s]) <= 1e-12 * abs(cont[s]), (name, s, got[s], cont[s])


# ---- bytes per parameter and rank: Megatron's table ------------------------------------------------------
def _worker_bytes(out_json):
    from cutp import train
    from mpi4py import MPI

    world = MPI.COMM_WORLD  # 3 ranks: dp=3
    rows = []
    for dtype in ("float32", "bfloat16", "float16", "float64"):
        for dist in (False, True):
            # 429,184 parameters: not a multiple of 64 x 3, so the distributed buffers are padded
            cfg = train.resolve_run_config(world, **LIB, set=["n_layer=2", "n_kv_head=2", "tie_embeddings=false"],
                                           dtype=dtype, tp=1, dp=3, batch_size=6, steps=2, distributed_optimizer=dist)
            run = train.build_run(cfg, world)
            before = run.optimizer.memory_bytes()
            if dtype == "bfloat16" and dist:  # live buffers do not grow with training
                train.train_step(run)
                assert run.optimizer.memory_bytes() == before
            rows.append({"dtype": dtype, "dist": dist, "n": int(run.model.num_parameters_local()),
                         "flat_dtype": str(run.flat.data.dtype), "grad_dtype": str(run.flat.grad.dtype),
                         **{k: int(v) for k, v in before.items()}})
            run.close()
    every = world.gather(rows, root=0)
    if world.rank == 0:
        _dump(out_json, every)


def test_bytes_per_parameter_and_rank_match_megatrons_table(tmp_path):
    out = tmp_path / "bytes.json"
    run_mpi(3, f"{HERE}:_worker_bytes", str(out), timeout=240)
    d = 3
    # (params, grads, optimizer) bytes per parameter
    table = {("float32", False): (4, 4, 8), ("float32", True): (4, 4, 8 / d),
             ("bfloat16", False): (2, 4, 12), ("bfloat16", True): (2, 4, 12 / d),
             ("float16", False): (2, 4, 12), ("float16", True): (2, 4, 12 / d),
             ("float64", False): (8, 8, 16), ("float64", True): (8, 8, 16 / d)}
    totals = {("float32", False): 16, ("float32", True): 8 + 8 / d, ("bfloat16", False): 18,
              ("bfloat16", True): 6 + 12 / d, ("float64", False): 32, ("float64", True): 16 + 16 / d}
    for rank, rows in enumerate(_load(out)):
        assert len(rows) == 8
        for r in rows:
            key = (r["dtype"], r["dist"])
            assert {"params", "grads", "optimizer"} <= r.keys(), r
            assert r["flat_dtype"] == r["dtype"]
            assert r["grad_dtype"] == ("float32" if r["dtype"] in ("bfloat16", "float16") else r["dtype"])
            n = r["n"]
            for field, want in zip(("params", "grads", "optimizer"), table[key]):
                # padding of the flat buffer (to 64 x dp elements) is the only slack allowed
                assert abs(r[field] / n - want) <= 2e-3 * want, (rank, key, field, r[field] / n, want)
            total = (r["params"] + r["grads"] + r["optimizer"]) / n
            if key in totals:
                assert abs(total - totals[key]) <= 2e-3 * totals[key], (rank, key, total)


# ---- refusals ------------------------------------------------------------------------------------------
BAD_FLAGS = [["--grad-reduce-dtype", "float8"], ["--loss-scale", "-1"], ["--hysteresis", "0"], ["--dtype", "int8"],
             ["--initial-loss-scale", "0"], ["--loss-scale-window", "0"], ["--min-loss-scale", "-2"],
             ["--loss-scale", "inf"]]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    d = tmp_path_factory.mktemp("refusals")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=ROOT)
    procs = []
    for i, flag in enumerate(BAD_FLAGS):
        argv = [PY, TRAIN_PY] + BASE + ["--dtype", "float16", "--steps", "1", "--batch-size", "8",
                                        "--out", str(d / f"run{i}")] + flag
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = {}
    for i, (flag, p) in enumerate(zip(BAD_FLAGS, procs)):
        out, err = p.communicate(timeout=120)
        results[" ".join(flag)] = (p.returncode, out, err, d / f"run{i}")
    return results


@pytest.mark.parametrize("flag", [" ".join(f) for f in BAD_FLAGS])
def test_bad_flag_values_are_refused_with_one_line(refusals, flag):
    rc, out, err, run_dir = refusals[flag]
    text = (out + err).strip()
    assert rc in (1, 2), (rc, text)
    name, value = flag.split()
    last = text.splitlines()[-1]
    assert name in last and value in last, f"the last line does not name {flag}: {last!r}"
    assert not run_dir.exists(), "a refused run wrote a run directory"
    assert "step " not in out


# ---- the memory you can see: banner, metrics, planner ----------------------------------------------------
def test_banner_and_first_metrics_record_report_measured_memory(tmp_path):
    m = tmp_path / "m.jsonl"
    argv = [TRAIN_PY] + [a for a in BASE if a != "--quiet"] + ["--dtype", "bfloat16", "--steps", "1",
                                                                "--batch-size", "4", "--metrics", str(m)]
    r = _cli(argv, timeout=120)
    assert r.returncode == 0, r.stderr
    banner = r.stdout.split("\nstep ")[0].lower()
    assert "optimizer" in banner and "grad" in banner, f"no memory in the banner:\n{r.stdout}"
    first = json.loads(m.read_text().splitlines()[0])
    assert any("mem" in k or "bytes" in k for k in first), f"no memory in the first record: {first}"


def test_bench_plan_bf16_distributed_70b_fits():
    r = _cli(["-m", "cutp", "bench", "plan", "--params", "70B", "--tp", "8", "--dtype", "bfloat16",
              "--distributed-optimizer", "--dp", "8"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "80" in r.stdout and "141" in r.stdout, r.stdout


def test_bench_plan_refuses_a_mesh_the_model_cannot_take_in_one_line():
    r = _cli(["-m", "cutp", "bench", "plan", "--preset", "gpt2", "--tp", "8"])
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "tp=8" in r.stderr.strip().splitlines()[-1]
