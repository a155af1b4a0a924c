"""End-to-end training: same losses at every mesh, exact resume, resharded checkpoints."""
import json
import os

import numpy as np
import pytest

from tests.mpirun import run_mpi

TRAIN = "examples.train_gpt:main"
BASE = ["--preset", "tiny", "--dtype", "float64", "--seq-len", "32", "--batch-size", "8", "--eval-every", "0",
        "--quiet", "--set", "n_layer=2"]


def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_twenty_steps_same_losses_at_tp1_tp2_tp4_and_tp2xdp2(tmp_path):
    runs = {"tp1": (1, ["--tp", "1"]), "tp2": (2, ["--tp", "2"]), "tp4": (4, ["--tp", "4"]),
            "tp2dp2": (4, ["--tp", "2", "--dp", "2", "--micro-batch-size", "2"])}
    losses = {}
    for name, (n, extra) in runs.items():
        m = tmp_path / f"{name}.jsonl"
        run_mpi(n, TRAIN, BASE + ["--steps", "20", "--metrics", str(m)] + extra, timeout=240)
        rows = _metrics(m)
        assert [r["step"] for r in rows] == list(range(1, 21))
        losses[name] = np.array([r["loss"] for r in rows])
        norms = np.array([r["grad_norm"] for r in rows])
        if name == "tp1":
            ref_norms = norms
        else:
            np.testing.assert_allclose(norms, ref_norms, rtol=1e-9, err_msg=name)
    for name, ls in losses.items():
        np.testing.assert_allclose(ls, losses["tp1"], rtol=1e-10, atol=0, err_msg=name)
    assert losses["tp1"][-1] < losses["tp1"][0] - 0.5, "the loss did not go down"


def test_tp8_runs(tmp_path):
    m = tmp_path / "tp8.jsonl"
    run_mpi(8, TRAIN, BASE + ["--steps", "3", "--tp", "8", "--metrics", str(m)], timeout=240)
    rows = _metrics(m)
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)


def test_resume_reproduces_steps_bit_identically(tmp_path):
    args = BASE + ["--dropout", "0.1", "--tp", "2", "--dp", "2", "--micro-batch-size", "2"]
    full, part = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    run_mpi(4, TRAIN, args + ["--steps", "20", "--save-every", "10", "--out", str(tmp_path / "run"),
                              "--metrics", str(full)], timeout=240)
    ckpt = tmp_path / "run" / "step-00000010"
    assert (ckpt / "meta.json").exists()
    run_mpi(4, TRAIN, args + ["--steps", "20", "--resume", str(ckpt), "--metrics", str(part)], timeout=240)
    a, b = _metrics(full)[10:], _metrics(part)
    assert [r["step"] for r in b] == list(range(11, 21))
    for ra, rb in zip(a, b):
        assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"], (ra, rb)
    # the run directory keeps the newest checkpoints and points `latest` at the last one
    latest = json.loads((tmp_path / "run" / "latest").read_text())
    assert latest == {"step": 20, "path": "step-00000020"}


def _worker_val_loss(ckpt, tp, out):
    import cutp
    from cutp.checkpoint import load_model
    from cutp.data import BatchSampler, load_dataset

    ctx = cutp.init(tp=tp, device="cpu")
    model, meta = load_model(ckpt, ctx)
    model.eval()
    sampler = BatchSampler(load_dataset(None), 32, 4, ctx.dp_size, ctx.dp_rank, 4, seed=0)
    losses = [model.forward(x, y) for i in range(2) for x, y in sampler.micro_batches(i, "val")]
    if ctx.rank == 0:
        with open(out, "w") as f:
            json.dump({"val": float(np.mean(losses)), "step": meta["step"]}, f)
    ctx.close()


def test_checkpoint_saved_at_tp4_loads_at_tp2_and_tp1(tmp_path):
    run_mpi(4, TRAIN, BASE + ["--steps", "3", "--tp", "4", "--out", str(tmp_path / "run")], timeout=240)
    ckpt = str(tmp_path / "run")
    vals = {}
    for tp in (4, 2, 1):
        out = tmp_path / f"val{tp}.json"
        run_mpi(tp, "tests.test_train:_worker_val_loss", ckpt, tp, str(out), timeout=120)
        vals[tp] = json.loads(out.read_text())
    assert vals[4]["step"] == 3
    assert abs(vals[2]["val"] - vals[4]["val"]) <= 1e-10 * vals[4]["val"]
    assert abs(vals[1]["val"] - vals[4]["val"]) <= 1e-10 * vals[4]["val"]

    # and an exported single-shard copy holds the same model
    from cutp.checkpoint import export_full, read_meta

    exported = export_full(ckpt, str(tmp_path / "full"))
    meta = read_meta(exported)
    assert meta["mesh"] == {"tp": 1, "dp": 1} and len(meta["files"]) == 2
    out = tmp_path / "val_export.json"
    run_mpi(2, "tests.test_train:_worker_val_loss", exported, 2, str(out), timeout=120)
    assert abs(json.loads(out.read_text())["val"] - vals[4]["val"]) <= 1e-10 * vals[4]["val"]


def _worker_batches():
    import cutp
    from cutp.data import BatchSampler, load_dataset

    ds = load_dataset(None)
    ctx = cutp.init(tp=2, dp=2, device="cpu")
    s = BatchSampler(ds, 16, 8, ctx.dp_size, ctx.dp_rank, 2, seed=5)
    mine = np.concatenate([x for x, _ in s.micro_batches(3)])  # [4, 16]: this DP rank's share
    tp_all = ctx.tp.all_gather(np.ascontiguousarray(mine))
    assert np.array_equal(tp_all[:4], tp_all[4:]), "TP ranks of one group saw different batches"
    dp_all = ctx.dp.all_gather(np.ascontiguousarray(mine))
    assert not np.array_equal(dp_all[:4], dp_all[4:]), "DP ranks saw the same batch"
    # the union over DP ranks is the single-rank global batch, in order
    ref = BatchSampler(ds, 16, 8, 1, 0, 8, seed=5)
    np.testing.assert_array_equal(dp_all, next(ref.micro_batches(3))[0])
    ctx.close()


def test_tp_ranks_share_batches_dp_ranks_split_them():
    run_mpi(4, "tests.test_train:_worker_batches", timeout=60)


def test_bad_arguments_are_refused_clearly(tmp_path):
    from examples.train_gpt import main

    with pytest.raises(Exception, match="--set 'bogus=1'"):
        main(BASE + ["--steps", "1", "--set", "bogus=1"])
    with pytest.raises(Exception, match="exceeds the model's block_size 128"):
        main(["--preset", "tiny", "--seq-len", "512", "--steps", "1", "--quiet"])
    with pytest.raises(Exception, match="micro-batch-size 3 must divide"):
        main(BASE + ["--steps", "1", "--micro-batch-size", "3"])


def _worker_repad_vocabulary(run):
    """A checkpoint whose vocabulary padding differs from the loading model's (97 real rows,
    padded to 256 at TP=2 but to 128 at TP=1): the real rows survive, the padding is rebuilt."""
    import cutp
    from cutp.checkpoint import export_full, load_checkpoint, save_checkpoint
    from cutp.model import GPT, GPTConfig
    from cutp.optim import AdamW, FlatParameters
    from tests.tp_utils import self_ctx

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=97, block_size=8, tie_embeddings=False)
    ctx = cutp.init(tp=2, device="cpu")
    model = GPT(ctx, cfg, seed=4)
    opt = AdamW(FlatParameters(model.parameters()))
    opt.m[...] = 1.5  # something to carry over
    path = save_checkpoint(run, 1, model, opt)
    want = model.gather_state_dict(rank=None)
    one = GPT(self_ctx(), cfg, seed=0, init=False)
    opt1 = AdamW(FlatParameters(one.parameters()))
    load_checkpoint(path, one, opt1)
    assert one.padded_vocab == 128 and model.padded_vocab == 256
    got = one.gather_state_dict()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not one.wte.weight.data[97:].any() and not one.lm_head.weight.data[97:].any()
    for key, m in opt1.state_dict().items():  # moments re-padded like the parameters
        if not key.startswith("exp_avg."):
            continue
        rows = one.named_parameters()[key[len("exp_avg."):]].real_rows
        assert (m[:rows] == 1.5).all() and not m[rows:].any() if rows else (m == 1.5).all(), key
    if ctx.rank == 0:
        exported = export_full(path, run + "-full")
        from cutp.checkpoint import read_meta

        assert read_meta(exported)["params"]["wte.weight"]["full_shape"] == [128, 8]
    ctx.close()


def test_checkpoint_repads_the_vocabulary_for_another_tp(tmp_path):
    run_mpi(2, "tests.test_train:_worker_repad_vocabulary", str(tmp_path / "run"), timeout=120)
