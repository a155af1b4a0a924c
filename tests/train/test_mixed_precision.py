"""Mixed precision (bfloat16, float16 with loss scaling, fp32 master weights and main_grad) and
the distributed optimizer (ZeRO-1): the same math as the plain float optimizer at every layout,
checkpoints that resume bit for bit and at another DP size, and the bytes per parameter of
Megatron's table. Issue 13; Megatron-LM bugs named where a test guards against one."""
import dataclasses
import json
import math
import shutil

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI
from safetensors import safe_open
from safetensors.numpy import load_file

import cutp
from cutp import train
from cutp.checkpoint import CheckpointError, export_full, load_model, read_meta, read_shard
from cutp.hf import save_hf_gpt2
from cutp.models import GPT, GPTConfig
from cutp.optim import AdamW, DistributedAdamW, DynamicLossScaler, FlatParameters, LossScaler
from tests.mpirun import SharedLaunch, run_mpi

TRAIN = "examples.train_gpt:main"
BASE = ["--preset", "tiny", "--seq-len", "32", "--eval-every", "0", "--quiet", "--set", "n_layer=2"]
LIB = dict(preset="tiny", set=["n_layer=2"], seq_len=32, eval_every=0, device="cpu", quiet=True,
           save_on_signal=False)


def _optim_state(ckpt, tp_rank=0) -> dict:
    """TP rank tp_rank's optimizer tensors of a checkpoint, flat, whether in one file or in the
    distributed optimizer's per-DP-rank shard files (pieces at the offsets in their metadata)."""
    meta = read_meta(str(ckpt))
    tp, dp = meta["mesh"]["tp"], meta["optimizer"].get("dp_shards", 1)
    if dp == 1:
        return {k: v.reshape(-1) for k, v in load_file(str(ckpt / f"optim-tp{tp_rank:02d}-of-{tp:02d}.safetensors")).items()}
    out = {}
    for d in range(dp):
        path = ckpt / f"optim-tp{tp_rank:02d}-of-{tp:02d}-dp{d:02d}-of-{dp:02d}.safetensors"
        with safe_open(str(path), framework="numpy") as f:
            offsets = json.loads(f.metadata()["offsets"])
            for key in f.keys():
                a, b = offsets[key.split(".", 1)[1]]
                out.setdefault(key, {})[a] = f.get_tensor(key)
    return {k: np.concatenate([pieces[a] for a in sorted(pieces)]) for k, pieces in out.items()}


def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---- the distributed optimizer: same math as the plain one ---------------------------------------
def _train(comm, **choices):
    cfg = train.resolve_run_config(comm, **{**LIB, **choices})
    run = train.build_run(cfg, comm)
    stats = [train.train_step(run) for _ in range(cfg.steps)]
    weights = run.model.gather_state_dict(rank=None)
    moments = run.optimizer.state_dict()  # collective (distributed): full on DP rank 0
    run.close()
    return stats, weights, moments


DIST_COMMON = dict(dtype="float64", steps=6, micro_batch_size=1, grad_clip=0.5, seq_len=16)


def _worker_one_rank_reference(batch, path):
    stats, _, _ = _train(MPI.COMM_WORLD, tp=1, dp=1, batch_size=batch, **DIST_COMMON)
    with open(path, "w") as f:
        json.dump({"loss": [s.loss for s in stats], "grad_norm": [s.grad_norm for s in stats]}, f)


def _worker_distributed_matches_plain(meshes, batch, reference, overrides, bucket):
    """For each (tp, dp) that splits the world: 6 float64 steps with the plain and with the
    distributed optimizer, gradient accumulation (micro-batch 1) and clipping active (norms 2-8
    against --grad-clip 0.5). Tied embeddings (the tiny preset's; Megatron #844). `reference`:
    a JSON file of one rank's losses and norms (#715: the norm is that of one rank's model).
    `bucket`: the DP collectives' bucket size (small: the chunked reduce-scatter/all-gather)."""
    world = MPI.COMM_WORLD
    common = dict(batch_size=batch, set=["n_layer=2"] + overrides, **DIST_COMMON)
    if bucket:
        cutp.optim.adamw.BUCKET_ELEMENTS = bucket
    for tp, dp in meshes:
        plain, w_plain, m_plain = _train(world, tp=tp, dp=dp, **common)
        dist, w_dist, m_dist = _train(world, tp=tp, dp=dp, distributed_optimizer=True, **common)
        for a, b in zip(plain, dist):
            assert not a.skipped and not b.skipped
            assert math.isclose(a.loss, b.loss, rel_tol=1e-12), (tp, dp, a.step, a.loss, b.loss)
            assert math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-12), (tp, dp, a.step)
        assert max(s.grad_norm for s in plain) > 4 * 0.5, "clipping was not active"
        for name, w in w_plain.items():
            # relative to the tensor's scale: Adam moves entries whose gradient is ~0 by rounding noise
            np.testing.assert_allclose(w_dist[name], w, rtol=1e-12, atol=1e-12 * np.abs(w).max(),
                                       err_msg=f"{name} tp{tp} dp{dp}")
        if m_dist:  # DP rank 0: the gathered shards are the plain optimizer's moments
            for key, m in m_plain.items():
                np.testing.assert_allclose(m_dist[key], m, rtol=1e-10, atol=1e-10 * np.abs(m).max(), err_msg=key)
        if reference:
            with open(reference) as f:
                ref = json.load(f)
            for key in ("loss", "grad_norm"):
                np.testing.assert_allclose([getattr(s, key) for s in dist], ref[key], rtol=1e-10, err_msg=key)


DIST_CASES = [
    (2, [(1, 2)], 8, [], 0),
    # an odd DP size (Megatron #792): shards padded to 64 * 3 elements; buckets of 1000 elements,
    # 333 columns of the [3, shard] view per collective
    (3, [(1, 3)], 6, [], 1000),
    (4, [(2, 2), (1, 4)], 8, [], 0),
    (4, [(2, 2)], 8, ["n_kv_head=1"], 0),  # the KV head replicated over the TP pair: the norm's masks
]


@pytest.mark.parametrize("ranks,meshes,batch,overrides,bucket", DIST_CASES)
def test_distributed_optimizer_gives_the_plain_optimizers_losses_and_weights(request, ranks, meshes, batch,
                                                                              overrides, bucket):
    if ranks == 4:  # the 4-rank cases share a launch
        request.getfixturevalue("four_rank_distributed").check(" ".join(overrides) or "preset")
        return
    run_mpi(ranks, "tests.train.test_mixed_precision:_worker_distributed_matches_plain", meshes, batch, "",
            overrides, bucket, timeout=300)


@pytest.fixture(scope="module")
def four_rank_distributed(tmp_path_factory):
    """The 4-rank cases above in one launch (SharedLaunch), the preset's against a one-rank
    reference run first (the one-rank reference is of the preset itself)."""
    reference = str(tmp_path_factory.mktemp("dist") / "one_rank.json")
    (batch,) = {batch for ranks, _, batch, overrides, _ in DIST_CASES if ranks == 4 and not overrides}
    run_mpi(1, "tests.train.test_mixed_precision:_worker_one_rank_reference", batch, reference, timeout=120)
    return SharedLaunch(4, {
        " ".join(overrides) or "preset": ("tests.train.test_mixed_precision:_worker_distributed_matches_plain",
                                          [meshes, batch, "" if overrides else reference, overrides, bucket])
        for ranks, meshes, batch, overrides, bucket in DIST_CASES if ranks == 4}, timeout=600)


# ---- bfloat16: every layout within Megatron's tolerance of one rank ------------------------------
def test_bf16_losses_at_tp4_match_tp1_within_1e_2(tmp_path):
    """Through the CLI; tp2, dp2 with the distributed optimizer and tp2 x dp2 are compared with tp1
    in one launch by tests/acceptance/test_mixed_precision.py."""
    args = BASE + ["--dtype", "bfloat16", "--steps", "20", "--batch-size", "8"]
    losses = {}
    for name, n, extra in (("tp1", 1, ["--tp", "1"]), ("tp4", 4, ["--tp", "4"])):
        m = tmp_path / f"{name}.jsonl"
        run_mpi(n, TRAIN, args + ["--metrics", str(m)] + extra, timeout=240)
        losses[name] = np.array([r["loss"] for r in _metrics(m)])
    assert len(losses["tp1"]) == 20 and losses["tp1"][-1] < losses["tp1"][0] - 1.0
    for name, ls in losses.items():
        np.testing.assert_allclose(ls, losses["tp1"], rtol=1e-2, err_msg=name)
    # not float32 in disguise: the bf16 losses differ from one another in the low bits
    assert not np.array_equal(losses["tp4"], losses["tp1"])


# ---- checkpoints: bit-identical resume, another DP size, export precision -------------------------
RESUME_CASES = [
    ("bfloat16", 2, ["--tp", "2"]),
    ("bfloat16", 2, ["--tp", "1", "--dp", "2", "--distributed-optimizer"]),
    ("float16", 2, ["--tp", "1", "--dp", "2", "--distributed-optimizer"]),
]


def _resume_args(dtype, mesh):
    return BASE + ["--dtype", dtype, "--batch-size", "8", "--steps", "6"] + mesh


def _worker_resume_cases(d):
    """Every case of RESUME_CASES (all on 2 ranks) in one launch, each in d/case<i>: 6 steps saving
    at step 3, a copy of that checkpoint as saved (the resume writes beside it), then the resume
    from it. A case that fails names itself."""
    from mpi4py import MPI

    from examples.train_gpt import main

    for i, (dtype, n, mesh) in enumerate(RESUME_CASES):
        assert n == MPI.COMM_WORLD.size
        case, args = f"{d}/case{i}", _resume_args(dtype, mesh)
        try:
            main(args + ["--save-every", "3", "--keep", "0", "--out", f"{case}/run", "--metrics", f"{case}/full.jsonl"])
            MPI.COMM_WORLD.Barrier()
            if MPI.COMM_WORLD.rank == 0:
                shutil.copytree(f"{case}/run/step-00000003", f"{case}/saved")
            MPI.COMM_WORLD.Barrier()
            main(args + ["--resume", f"{case}/run/step-00000003", "--metrics", f"{case}/part.jsonl"])
        except BaseException as e:
            raise RuntimeError(f"resume case {i} {dtype} {mesh} failed: {e}") from e


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    run_mpi(2, "tests.train.test_mixed_precision:_worker_resume_cases", str(d), timeout=300)
    return d


@pytest.mark.parametrize("case", range(len(RESUME_CASES)), ids=[
    f"{dtype}-{n}-mesh{i}" for i, (dtype, n, _) in enumerate(RESUME_CASES)])
def test_resume_is_bit_identical_with_master_weights_and_the_distributed_optimizer(resume_runs, tmp_path, case):
    """The runs are _worker_resume_cases' (one launch for the three cases)."""
    dtype, n, mesh = RESUME_CASES[case]
    full, part = resume_runs / f"case{case}" / "full.jsonl", resume_runs / f"case{case}" / "part.jsonl"
    ckpt = resume_runs / f"case{case}" / "saved"  # step-00000003 as saved
    meta = read_meta(str(ckpt))
    assert meta["config"]["dtype"] == dtype and meta["optimizer"]["master_weights"]
    model = load_file(str(ckpt / f"model-tp00-of-{meta['mesh']['tp']:02d}.safetensors"))
    optim = _optim_state(ckpt)
    if "--distributed-optimizer" in mesh:  # one file per DP rank, nothing gathered
        assert meta["optimizer"]["dp_shards"] == 2 and "optim-tp00-of-01-dp01-of-02.safetensors" in meta["files"]
        whole = read_shard(str(ckpt), "optim")  # the pieces put back together = the tensors of each parameter
        assert all(np.array_equal(whole[k].reshape(-1), v) for k, v in optim.items()) and whole.keys() == optim.keys()
        broken = tmp_path / "broken"
        shutil.copytree(ckpt, broken)
        (broken / "optim-tp00-of-01-dp01-of-02.safetensors").unlink()
        with pytest.raises(CheckpointError, match="dp01-of-02.safetensors is missing"):
            read_shard(str(broken), "optim")
    w = model["layers.0.mlp.fc1.weight"]
    assert w.dtype == np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    master = optim["master.layers.0.mlp.fc1.weight"].reshape(w.shape)
    assert master.dtype == np.float32 and np.array_equal(master.astype(w.dtype), w)  # params = rounded masters
    assert not np.array_equal(master, w.astype(np.float32))  # and the masters keep more bits
    if dtype == "float16":
        assert meta["loss_scaler"]["kind"] == "dynamic" and meta["loss_scaler"]["scale"] == 2.0 ** 16
    a, b = _metrics(full), _metrics(part)
    assert [r["step"] for r in b] == [4, 5, 6]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in a[3:]] == [r[key] for r in b], key  # bit for bit


SCALERS = {"static": ["--loss-scale", "128"],  # (settings other than the defaults, each of them)
           "dynamic": ["--initial-loss-scale", "1024", "--loss-scale-window", "2", "--hysteresis", "3",
                       "--min-loss-scale", "2"]}


def _worker_resume_loss_scale(d):
    """Each SCALERS case: 5 steps, and 3 then `--resume` with nothing else; then resumes of the
    dynamic run's checkpoint at step 3 with a static scale, and the static run's with a dynamic
    setting (each kind switch said in one line)."""
    import contextlib
    import io

    from examples.train_gpt import main

    args = BASE + ["--dtype", "float16", "--batch-size", "4", "--steps", "5", "--no-save-on-signal"]
    for name, flags in SCALERS.items():
        main(args + flags + ["--out", f"{d}/{name}-full", "--metrics", f"{d}/{name}-full.jsonl"])
        main(args + flags + ["--out", f"{d}/{name}", "--run-steps", "3", "--metrics", f"{d}/{name}.jsonl"])
        shutil.copytree(f"{d}/{name}/step-00000003", f"{d}/{name}-step3")
        main(["--resume", f"{d}/{name}", "--device", "cpu", "--no-save-on-signal"])
    for name, flags in (("dynamic", ["--loss-scale", "64"]), ("static", ["--hysteresis", "1"])):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            main(["--resume", f"{d}/{name}-step3", "--out", f"{d}/{name}-switched", "--device", "cpu", "--quiet",
                  "--no-save-on-signal", "--metrics", f"{d}/{name}-switched.jsonl"] + flags)
        with open(f"{d}/{name}-switched.txt", "w") as f:
            f.write(err.getvalue())


def test_a_float16_resume_keeps_its_loss_scale_settings_bit_for_bit(tmp_path):
    """F2 (layouts review): `--resume` alone took the defaults (a static 128 became a dynamic 65536,
    window 2 became 1000); it keeps the checkpoint's, and a kind given anew is said in one line."""
    run_mpi(1, "tests.train.test_mixed_precision:_worker_resume_loss_scale", str(tmp_path), timeout=240)
    for name in SCALERS:
        full, head = _metrics(tmp_path / f"{name}-full.jsonl"), _metrics(tmp_path / f"{name}.jsonl")
        assert [r["step"] for r in head] == [1, 2, 3, 4, 5]  # (the resume appends to the run's metrics)
        for key in ("loss", "grad_norm", "loss_scale"):
            assert [r[key] for r in full] == [r[key] for r in head], (name, key)  # bit for bit
        a, b = (tmp_path / name / "step-00000005", tmp_path / f"{name}-full" / "step-00000005")
        wa, wb = (load_file(str(c / "model-tp00-of-01.safetensors")) for c in (a, b))
        assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa), name
        ma, mb = read_meta(str(a)), read_meta(str(b))
        assert ma["loss_scaler"] == mb["loss_scaler"], name
        keys = ("loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale")
        assert {k: ma["train_args"][k] for k in keys} == {k: mb["train_args"][k] for k in keys}, name
    assert [r["loss_scale"] for r in _metrics(tmp_path / "static-full.jsonl")] == [128.0] * 5
    assert [r["loss_scale"] for r in _metrics(tmp_path / "dynamic-full.jsonl")] == [1024.0] * 2 + [2048.0] * 2 + [4096.0]
    # a kind given anew: taken, and said in one line; the other kind's settings not kept
    switched = (tmp_path / "dynamic-switched.txt").read_text().strip().splitlines()
    assert switched == ["loss scale: the checkpoint's dynamic loss scale (at 2048) is not continued; this run uses "
                        "static loss scale of 64, as its settings say"], switched
    assert [r["loss_scale"] for r in _metrics(tmp_path / "dynamic-switched.jsonl")] == [64.0, 64.0]
    switched = (tmp_path / "static-switched.txt").read_text().strip().splitlines()
    assert switched == ["loss scale: the checkpoint's static loss scale of 128 is not continued; this run uses "
                        "dynamic loss scale (at 65536), as its settings say"], switched
    meta = read_meta(str(tmp_path / "static-switched" / "step-00000005"))
    assert meta["loss_scaler"]["kind"] == "dynamic" and meta["train_args"]["hysteresis"] == 1
    assert meta["train_args"]["loss_scale"] is None


def test_a_resume_keeps_each_loss_scale_setting_not_given_again(tmp_path):
    from cutp.checkpoint import save_checkpoint
    from cutp.train.config import derive_run_config
    from tests.tp_utils import self_ctx

    def saved(name, **choices):
        out = str(tmp_path / name)
        cfg = derive_run_config({**LIB, "steps": 4, "out": out, **choices}, 1, 1)
        ctx = self_ctx()
        save_checkpoint(out, 2, GPT(ctx, cfg.model, seed=0), train_args=cfg.checkpoint_settings())
        ctx.close()
        return out

    dynamic = saved("dynamic", dtype="float16", loss_scale_window=2, hysteresis=3, min_loss_scale=2.0)
    cfg = derive_run_config({"resume": dynamic, "device": "cpu", "loss_scale_window": 4}, 1, 1)
    assert (cfg.loss_scale, cfg.loss_scale_window, cfg.hysteresis, cfg.min_loss_scale) == (None, 4, 3, 2.0)
    cfg = derive_run_config({"resume": dynamic, "device": "cpu", "loss_scale": 8.0}, 1, 1)
    assert (cfg.loss_scale, cfg.loss_scale_window, cfg.hysteresis) == (8.0, 1000, 2)  # static: the dynamic unset
    static = saved("static", dtype="float16", loss_scale=128.0)
    assert derive_run_config({"resume": static, "device": "cpu"}, 1, 1).loss_scale == 128.0
    assert derive_run_config({"resume": static, "device": "cpu", "loss_scale": 64.0}, 1, 1).loss_scale == 64.0
    bf16 = saved("bf16", dtype="bfloat16")  # (train_args records the dynamic defaults: not taken as given)
    cfg = derive_run_config({"resume": bf16, "device": "cpu"}, 1, 1)
    assert cfg.model.dtype == "bfloat16" and cfg.loss_scale is None


def test_resume_at_another_dp_size_with_the_distributed_optimizer_continues_the_run(tmp_path):
    """Saved at dp=2, resumed at dp=3 (shards of other lengths, another padding: Megatron #552),
    at tp=2 (resharded over TP too) and at dp=1 with the plain optimizer: the next steps' losses
    equal continuing (float64)."""
    args = BASE + ["--dtype", "float64", "--batch-size", "12", "--micro-batch-size", "2", "--steps", "5"]
    full = tmp_path / "full.jsonl"
    run_mpi(2, TRAIN, args + ["--tp", "1", "--dp", "2", "--distributed-optimizer", "--save-every", "3", "--keep", "0",
                              "--out", str(tmp_path / "run"), "--metrics", str(full)], timeout=180)
    ckpt = str(tmp_path / "run" / "step-00000003")
    reference = [r["loss"] for r in _metrics(full)][3:]
    for i, (n, extra) in enumerate(((3, ["--tp", "1", "--dp", "3", "--distributed-optimizer"]),
                                    (1, ["--tp", "1", "--dp", "1"]),
                                    (2, ["--tp", "2", "--dp", "1", "--distributed-optimizer"]))):
        m = tmp_path / f"resumed{i}.jsonl"
        run_mpi(n, TRAIN, args + ["--resume", ckpt, "--metrics", str(m)] + extra, timeout=180)
        np.testing.assert_allclose([r["loss"] for r in _metrics(m)], reference, rtol=1e-12, err_msg=str(extra))


def test_export_writes_the_precision_asked_for_from_the_master_weights(tmp_path):
    run_mpi(1, TRAIN, BASE + ["--dtype", "bfloat16", "--batch-size", "4", "--steps", "2", "--out",
                              str(tmp_path / "run")], timeout=120)
    src = tmp_path / "run" / "step-00000002"
    master = load_file(str(src / "optim-tp00-of-01.safetensors"))["master.tok_embed.weight"]
    export_full(str(src), str(tmp_path / "fp32"), "float32")
    out = load_file(str(tmp_path / "fp32" / "model-tp00-of-01.safetensors"))
    assert out["tok_embed.weight"].dtype == np.float32 and np.array_equal(out["tok_embed.weight"], master)
    meta = read_meta(str(tmp_path / "fp32"))
    assert meta["config"]["dtype"] == "float32" and not meta["optimizer"]["master_weights"]
    assert "master.tok_embed.weight" not in load_file(str(tmp_path / "fp32" / "optim-tp00-of-01.safetensors"))
    # loading the bf16 checkpoint into a float32 model takes the masters, not their rounding
    model, _ = load_model(str(src), cutp.init(tp=1), dtype="float32")
    assert np.array_equal(model.tok_embed.weight.data, master)
    save_hf_gpt2(model, None, str(tmp_path / "hf"), dtype="float32")  # and so does a Hugging Face export
    assert np.array_equal(load_file(str(tmp_path / "hf" / "model.safetensors"))["transformer.wte.weight"], master)
    export_full(str(src), str(tmp_path / "bf16"))  # default: the checkpoint's own precision
    again = load_file(str(tmp_path / "bf16" / "model-tp00-of-01.safetensors"))["tok_embed.weight"]
    assert again.dtype == np.dtype(ml_dtypes.bfloat16) and np.array_equal(again, master.astype(again.dtype))


# ---- float16: an overflow is skipped on every rank and the scale halves ---------------------------
class InfGradient(train.StepHooks):
    """An inf in one gradient element on one rank in the given steps (an fp16 overflow); and a
    check at every step that every rank holds the same loss-scaler state (Megatron-Bridge #5591:
    scales updated before the global overflow decision diverged across ranks)."""

    def __init__(self, steps, rank):
        self.steps, self.rank = set(steps), rank

    def before_grad_sync(self, run):
        mine = json.dumps(run.loss_scaler.state_dict())
        assert set(MPI.COMM_WORLD.allgather(mine)) == {mine}, mine
        if run.step + 1 in self.steps and run.ctx.rank == self.rank:
            run.model.named_parameters()["layers.1.mlp.fc1.weight"].grad.reshape(-1)[3] = float("inf")


def _worker_fp16_overflow(argv, rank):
    from examples.train_gpt import main

    main(argv, hooks=InfGradient([3, 4], rank))


def test_fp16_overflow_is_skipped_on_every_rank_and_the_scale_halves(tmp_path):
    m = tmp_path / "m.jsonl"
    res = run_mpi(2, "tests.train.test_mixed_precision:_worker_fp16_overflow",
                  BASE + ["--dtype", "float16", "--batch-size", "8", "--steps", "6", "--tp", "1", "--dp", "2",
                          "--distributed-optimizer", "--metrics", str(m), "--max-skips", "1",
                          "--save-every", "1", "--keep", "0", "--out", str(tmp_path / "run")], 1, timeout=180)
    rows = _metrics(m)
    assert [bool(r.get("skipped")) for r in rows] == [False, False, True, True, False, False]
    assert [bool(r.get("overflow")) for r in rows] == [False, False, True, True, False, False]
    # hysteresis 2: the second overflow in a row halves the scale; --max-skips 1 is not hit, as
    # overflow skips are the scaler's business while it can still shrink
    assert [r["loss_scale"] for r in rows] == [2.0 ** 16] * 4 + [2.0 ** 15] * 2
    assert "warning" not in res.stdout  # (--quiet: an overflow skip is routine, not a warning)
    # the learning-rate schedule moves with the updates made, as Megatron's: steps 3 and 4 leave
    # it where it was (layouts review, F5: it went on, 1e-3 down to 1.9e-4 over skipped steps)
    from cutp.optim import lr_schedule

    assert [r["lr"] for r in rows] == [lr_schedule(k, 1e-3, 1, 6) for k in (0, 1, 2, 2, 2, 3)]
    # skipped steps touch neither weights nor moments: the checkpoints of steps 2, 3 and 4 agree
    run = tmp_path / "run"
    m2, m4 = (load_file(str(run / f"step-0000000{k}" / "model-tp00-of-01.safetensors")) for k in (2, 4))
    o2, o4 = (_optim_state(run / f"step-0000000{k}") for k in (2, 4))
    assert all(np.array_equal(m2[k], m4[k]) for k in m2) and all(np.array_equal(o2[k], o4[k]) for k in o2)
    assert read_meta(str(run / "step-00000004"))["optimizer"]["step"] == 2
    assert read_meta(str(run / "step-00000004"))["loss_scaler"]["scale"] == 2.0 ** 15


def test_a_float16_overflow_is_said_in_a_line_of_its_own_without_numpys_warnings(monkeypatch):
    """(layouts review, F5: the message and its newline were two writes, the progress line came
    between them; NumPy's "overflow encountered in cast" and "invalid value encountered in matmul"
    on every rank at every overflow.) A real overflow: the loss scale 2^40."""
    import io
    import warnings

    from cutp.optim import lr_schedule

    cfg = train.resolve_run_config(MPI.COMM_SELF, **{**LIB, "quiet": False}, dtype="float16", batch_size=4, steps=4,
                                   initial_loss_scale=2.0 ** 40, hysteresis=1)
    run = train.build_run(cfg, MPI.COMM_SELF)
    writes = []

    class Stderr(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.setattr("sys.stderr", Stderr())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = [train.train_step(run) for _ in range(2)]
    run.close()
    assert all(s.overflow and s.skipped for s in stats)
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert writes == [f"step {i + 1}: float16 gradients overflowed at loss scale {2.0 ** (40 - i):g}: step skipped, "
                      f"scale now {2.0 ** (39 - i):g}\n" for i in range(2)]
    assert [s.lr for s in stats] == [lr_schedule(0, cfg.lr, cfg.warmup, cfg.steps)] * 2  # (no update made)


def test_dynamic_loss_scaler_follows_megatron():
    s = DynamicLossScaler(2.0 ** 4, growth_interval=3, hysteresis=2, min_scale=2.0)
    s.update(True)
    assert s.scale == 16 and s.hysteresis_tracker == 1  # hysteresis: the first overflow is tolerated
    s.update(True)
    assert s.scale == 8
    s.update(True)
    assert s.scale == 4  # the tracker is reset only by growth
    for _ in range(3):
        s.update(True)
    assert s.scale == 2 and s.at_floor  # never below the floor
    for _ in range(3):
        s.update(False)
    assert s.scale == 4 and s.hysteresis_tracker == 2 and s.growth_tracker == 0
    s.update(False)
    s.update(True)
    assert s.growth_tracker == 0 and s.scale == 4
    again = DynamicLossScaler()
    again.load_state_dict(s.state_dict())
    assert again.state_dict() == s.state_dict()
    assert LossScaler().scale == 1.0 and not LossScaler().dynamic
    with pytest.raises(ValueError):
        LossScaler(0.0)


# ---- memory: Megatron's bytes per parameter, measured on the live buffers ---------------------------
class _Ctx:
    """What DistributedAdamW asks of a context before any step: the DP rank and size."""

    def __init__(self, dp_size, dp_rank=0):
        self.dp_size, self.dp_rank = dp_size, dp_rank


@pytest.mark.parametrize("dtype,distributed,want", [
    ("float32", False, lambda d: 16), ("bfloat16", False, lambda d: 18), ("float16", False, lambda d: 18),
    ("float32", True, lambda d: 8 + 8 / d), ("bfloat16", True, lambda d: 6 + 12 / d),
    ("float64", False, lambda d: 32),
])
@pytest.mark.parametrize("dp", [1, 2, 8])
def test_bytes_per_parameter_match_megatrons_table(dtype, distributed, want, dp):
    ctx = cutp.init(tp=1)
    model = GPT(ctx, GPTConfig.preset("tiny", dtype=dtype), seed=0)
    n = model.num_parameters_local()
    if distributed:
        flat = FlatParameters(model.parameters(), pad_to=DistributedAdamW.pad_multiple(dp))
        opt = DistributedAdamW(flat, _Ctx(dp))
    else:
        flat = FlatParameters(model.parameters())
        opt = AdamW(flat)
    mem = opt.memory_bytes()
    padded = flat.padded_size
    assert padded - n < 64 * dp and padded % dp == 0
    assert sum(mem.values()) / padded == pytest.approx(want(dp), rel=1e-12)
    assert flat.grad.dtype == (np.float64 if dtype == "float64" else np.float32)  # main_grad in fp32
    assert (opt.master is not None) == (dtype in ("bfloat16", "float16"))
    if opt.master is not None:  # weights changed outside the optimizer: resync_masters takes them
        for p in model.parameters():
            p.data[...] = 1
        opt.resync_masters()
        assert np.all(opt.master[:min(opt.hi, flat.size) - opt.lo] == 1)


def test_gradients_are_reduced_in_fp32_unless_bf16_is_asked_for():
    """Megatron #6199: a bf16 reduction rounds (NCCL: at every hop of its ring); cutp reduces the
    float32 main_grad in float32 by default, bf16 only with grad_reduce_dtype='bfloat16'."""
    ctx = cutp.init(tp=1)
    model = GPT(ctx, GPTConfig.preset("tiny", dtype="bfloat16"), seed=0)
    flat = FlatParameters(model.parameters())
    assert AdamW(flat).reduce_dtype == np.float32
    assert AdamW(flat, grad_reduce_dtype="bfloat16").reduce_dtype == np.dtype(ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="grad_reduce_dtype"):
        AdamW(flat, grad_reduce_dtype="float8")


def _worker_grad_reduce_bytes():
    world = MPI.COMM_WORLD
    out = {}
    for reduce in ("float32", "bfloat16"):
        cfg = train.resolve_run_config(world, **LIB, dtype="bfloat16", tp=1, dp=4, batch_size=4, steps=1,
                                       grad_reduce_dtype=reduce, distributed_optimizer=True)
        run = train.build_run(cfg, world)
        g = np.random.default_rng(world.rank).standard_normal(run.flat.padded_size).astype(np.float32)
        run.flat.grad[...] = g
        c = run.ctx.counter
        before = c.bytes(group="dp", op="reduce_scatter")
        run.optimizer.reduce_gradients(run.ctx)
        out[reduce] = c.bytes(group="dp", op="reduce_scatter") - before
        every = np.empty((world.size, g.size), np.float32)
        world.Allgather(g, every)
        exact = every.astype(np.float64).mean(axis=0)[run.optimizer.lo:run.optimizer.hi]
        mine = run.flat.grad[run.optimizer.lo:run.optimizer.hi].astype(np.float64)
        err = np.abs(mine - exact).max() / np.abs(exact).max()
        if reduce == "float32":
            assert err < 1e-6, err  # float32 sums of 4 values: within fp32 rounding
        else:
            assert 1e-4 < err < 1e-2, err  # bf16: 8 bits of mantissa
        run.close()
    assert out["bfloat16"] * 2 == out["float32"] > 0


def test_grad_reduce_in_bf16_halves_the_bytes_and_rounds():
    run_mpi(4, "tests.train.test_mixed_precision:_worker_grad_reduce_bytes", timeout=120)


def test_a_bf16_model_generates_with_its_kv_cache_as_without():
    """Generation in bfloat16: the cached path gives the tokens of the uncached one (greedy)."""
    from cutp.generate import generate

    ctx = cutp.init(tp=1)
    model = GPT(ctx, GPTConfig.preset("tiny", dtype="bfloat16"), seed=3).eval()
    cached = generate(model, [10, 20, 30], max_new_tokens=8, top_k=1, seed=0)
    uncached = generate(model, [10, 20, 30], max_new_tokens=8, top_k=1, seed=0, use_cache=False)
    assert len(cached) == 8 and list(cached) == list(uncached)


def test_bf16_training_ends_within_2_percent_of_fp32(tmp_path):
    """A shorter version of the README's 300-step comparison: the same seed and data, the
    validation loss after 40 steps in bfloat16 within 2% of float32's."""
    val = {}
    for dtype in ("float32", "bfloat16"):
        m = tmp_path / f"{dtype}.jsonl"
        run_mpi(1, TRAIN, ["--preset", "tiny", "--set", "n_layer=2", "--seq-len", "64", "--quiet", "--dtype", dtype,
                           "--steps", "40", "--batch-size", "8", "--eval-every", "40", "--metrics", str(m)], timeout=240)
        val[dtype] = _metrics(m)[-1]["val_loss"]
    assert val["float32"] < 3.5  # it learned something (5.5 at the start)
    assert abs(val["bfloat16"] - val["float32"]) < 0.02 * val["float32"], val


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.02), ("float16", 0.01)])
def test_every_16bit_gradient_is_close_to_float64s(dtype, tol):
    """The same weights (the 16-bit model's, exactly representable in float64) and batch: every
    parameter's gradient in the float32 main_grad is within `tol` (relative, in norm) of the
    float64 model's. Sums over the b*s rows done in 16 bits (a row-parallel bias, the position
    embedding) were 5-16% off in bfloat16 at 1024 rows."""
    ctx = cutp.init(tp=1)
    cfg = GPTConfig.preset("tiny", n_layer=2)
    low = GPT(ctx, dataclasses.replace(cfg, dtype=dtype), seed=0)
    ref = GPT(ctx, dataclasses.replace(cfg, dtype="float64"), seed=0, init=False)
    ref.load_full_state_dict({k: v.astype(np.float64) for k, v in low.gather_state_dict().items()})
    FlatParameters(low.parameters())  # float32 gradients, as in training
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (8, 128)), rng.integers(0, 256, (8, 128))
    for m in (low, ref):
        m.forward(x, y)
        m.backward()
    worst = {}
    for p, q in zip(low.parameters(), ref.parameters()):
        assert p.grad.dtype == np.float32
        worst[p.name] = np.linalg.norm(p.grad - q.grad) / np.linalg.norm(q.grad)
    assert max(worst.values()) < tol, sorted(worst.items(), key=lambda kv: -kv[1])[:4]


def test_dynamic_loss_scale_flags_are_refused_where_they_do_nothing():
    with pytest.raises(cutp.ConfigError, match="hysteresis 3 sets the dynamic float16 loss scale, but the model "
                                             "is bfloat16"):
        train.resolve_run_config(MPI.COMM_SELF, **LIB, dtype="bfloat16", hysteresis=3)
    with pytest.raises(cutp.ConfigError, match="a static loss_scale is set"):
        train.resolve_run_config(MPI.COMM_SELF, **LIB, dtype="float16", loss_scale=128.0, min_loss_scale=2.0)
    cfg = train.resolve_run_config(MPI.COMM_SELF, **LIB, dtype="float16", hysteresis=1, initial_loss_scale=1024.0)
    scaler = train.step.make_loss_scaler(cfg)
    assert scaler.dynamic and scaler.scale == 1024.0 and scaler.hysteresis == 1
    assert not train.step.make_loss_scaler(dataclasses.replace(cfg, loss_scale=8.0)).dynamic


def _worker_dp_comm_against_the_plan():
    """A step's counted DP collectives equal `cutp bench plan`'s, plain and distributed, bf16."""
    from cutp.plan.layout import plan

    world = MPI.COMM_WORLD
    for distributed in (False, True):
        cfg = train.resolve_run_config(world, **LIB, dtype="bfloat16", tp=1, dp=2, batch_size=4, steps=2,
                                       distributed_optimizer=distributed)
        run = train.build_run(cfg, world)
        train.train_step(run)  # warm: the same collectives every step
        c = run.ctx.counter
        ops = ("all_reduce", "reduce_scatter", "all_gather")
        before = {op: (c.calls(group="dp", op=op), c.bytes(group="dp", op=op)) for op in ops}
        train.train_step(run)
        got = {op: (c.calls(group="dp", op=op) - before[op][0], c.bytes(group="dp", op=op) - before[op][1])
               for op in ops}
        p = plan(cfg.model, tp=1, dp=2, micro_batch=cfg.micro_batch_size,
                 seq_len=cfg.seq_len, accum=cfg.accum_steps, dtype="bfloat16", distributed_optimizer=distributed,
                 config=cfg.model, device="cpu")
        if distributed:
            assert got["reduce_scatter"] == (1, p["dp_reduce_scatter"]["bytes"]) > (1, 0), got
            assert got["all_gather"] == (1, p["dp_all_gather"]["bytes"]), got
            assert got["all_reduce"] == (1, 16), got  # the norm's [sum of squares, non-finite count], float64
        else:
            assert got["all_reduce"] == (1, p["dp_allreduce"]["bytes"]) and got["reduce_scatter"][0] == 0, got
        run.close()


def test_dp_communication_is_what_the_planner_says():
    run_mpi(2, "tests.train.test_mixed_precision:_worker_dp_comm_against_the_plan", timeout=120)
