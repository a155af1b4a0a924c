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
    from safetensors.numpy import load_file

    args = BASE + ["--dropout", "0.1", "--tp", "2", "--dp", "2", "--micro-batch-size", "2"]
    full, part = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    run, rerun = tmp_path / "run", tmp_path / "rerun"
    run_mpi(4, TRAIN, args + ["--steps", "20", "--save-every", "5", "--keep", "2", "--out", str(run),
                              "--metrics", str(full)], timeout=240)
    # --keep 2: the run directory keeps the two newest checkpoints and points `latest` at the last
    assert sorted(p.name for p in run.iterdir()) == ["latest", "step-00000015", "step-00000020"]
    assert json.loads((run / "latest").read_text()) == {"step": 20, "path": "step-00000020"}
    ckpt = run / "step-00000015"
    run_mpi(4, TRAIN, args + ["--steps", "20", "--resume", str(ckpt), "--metrics", str(part), "--out", str(rerun)],
            timeout=240)
    a, b = _metrics(full)[15:], _metrics(part)
    assert [r["step"] for r in b] == list(range(16, 21))
    for ra, rb in zip(a, b):
        assert ra["loss"] == rb["loss"] and ra["grad_norm"] == rb["grad_norm"], (ra, rb)
    # and the final weights and optimizer moments are bit-identical too
    files = sorted(p.name for p in (run / "step-00000020").glob("*.safetensors"))
    assert files == sorted(p.name for p in (rerun / "step-00000020").glob("*.safetensors")) and len(files) == 4
    for name in files:
        x, y = load_file(run / "step-00000020" / name), load_file(rerun / "step-00000020" / name)
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x), name
    # a checkpoint is safetensors and JSON only, and records the library version and the data position
    assert sorted(p.name for p in (run / "step-00000020").iterdir()) == sorted(files + ["meta.json"])
    import cutp

    meta = json.loads((run / "step-00000020" / "meta.json").read_text())
    assert meta["cutp_version"] == cutp.__version__ and meta["step"] == 20
    assert meta["data"]["next_step"] == 20 and meta["data"]["global_batch"] == 8 and meta["data"]["seq_len"] == 32


def test_progress_lines_metrics_and_validation(tmp_path):
    """One line and one JSONL row per step with the fields users plot, validation every
    --eval-every steps, a text file as --data, and a start-up banner that says what runs."""
    import re

    from cutp.models import GPTConfig

    data = tmp_path / "corpus.txt"
    data.write_text(open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()[:20000])
    m = tmp_path / "m.jsonl"
    b, s, h = 4, 16, 128
    res = run_mpi(2, TRAIN, ["--preset", "tiny", "--seq-len", str(s), "--batch-size", str(b), "--set", "n_layer=1",
                             "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--tp", "2",
                             "--data", str(data), "--metrics", str(m), "--collective-timeout", "77"], timeout=120)
    rows = _metrics(m)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {"loss", "lr", "grad_norm", "ms", "tokens_per_s", "comm_mb"} <= r.keys(), r
        assert r["lr"] > 0 and r["ms"] > 0 and np.isclose(r["tokens_per_s"], b * s / (r["ms"] / 1000))
        # per layer 2 all-reduces of b*s*h forward and 2 backward, plus the embedding's forward and the
        # tied head's dX backward; the vocab-parallel CE adds 3 floats per token; then a few scalars
        layers = (4 * 1 + 2) * b * s * h * 4 + 3 * b * s * 4
        assert 0 <= r["comm_mb"] * 1e6 - layers < 1024, r["comm_mb"]
    assert ["val_loss" in r for r in rows] == [False, True, False, True]
    assert all(np.isfinite(r["val_loss"]) for r in rows if "val_loss" in r)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 4, res.stdout
    pattern = r"step +\d+ \| loss [\d.]+ \| lr [\d.e+-]+ \| norm [\d.]+ \| +[\d.]+ ms \| +[\d,]+ tok/s \| comm [\d.]+ MB"
    assert all(re.match(pattern, ln) for ln in lines), lines
    assert [" | val " in ln for ln in lines] == [False, True, False, True]
    total = GPTConfig.preset("tiny").with_overrides(["n_layer=1"]).num_parameters()
    banner = re.search(r"parameters: ([\d,]+) total, ([\d,]+) on this rank", res.stdout)
    assert banner and int(banner[1].replace(",", "")) == total and int(banner[2].replace(",", "")) < total
    assert "mesh tp=2 x dp=1" in res.stdout and "device=cpu comm=mpi watchdog=77s" in res.stdout
    # memory per rank: the banner's state, measured, and the first record's (with the step's peak)
    mem = rows[0]["memory"]
    assert all("memory" not in r for r in rows[1:])
    local = int(banner[2].replace(",", ""))
    assert mem["params_local"] == local and mem["ranks"] == 2
    assert mem["params"] == mem["grads"] == 4 * local and mem["optimizer"] == 8 * local and mem["bytes_per_param"] == 16
    assert mem["activations_peak"] > b * s * h * 4 and mem["total"] >= 16 * local + mem["activations_peak"]
    assert re.search(r"memory per rank \(largest of 2\): params [\d.]+ [kMG]?B, grads [\d.]+ [kMG]?B, optimizer "
                     r"[\d.]+ [kMG]?B = 16\.00 B/param \(" + banner[2] + r" params\)", res.stdout), res.stdout
    assert re.search(r"memory per rank \(largest of 2\): activations peak [\d.]+ [kMG]?B in step 1", res.stdout)
    assert re.search(r"\| \d+ BLAS thread\(s\) per rank", res.stdout) and f"data: {data}" in res.stdout


def test_threads_per_rank_shares_the_cores():
    from cutp.runtime.threads import available_cores, threads_per_rank

    cores = available_cores()
    assert threads_per_rank(1) == cores
    assert threads_per_rank(cores) == 1 and threads_per_rank(4 * cores) == 1
    assert threads_per_rank(2) == max(1, cores // 2)


def test_preset_parameter_counts_match_gpt2():
    from cutp.models import GPTConfig

    # the parameter counts of OpenAI's GPT-2 checkpoints (tied embeddings, vocabulary 50257)
    expected = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
                "gpt2-xl": 1_557_611_200}
    for name, n in expected.items():
        assert GPTConfig.preset(name).num_parameters() == n, name


def test_nothing_users_load_can_execute_code():
    """Checkpoints, data and tokenizers are read with safetensors, JSON and raw arrays: no pickle."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    forbidden = re.compile(r"\bimport pickle\b|\bpickle\.|allow_pickle\s*=\s*True|torch\.load\(|np\.load\(|numpy\.load\(")
    offenders = [f"{p.relative_to(root)}:{i}" for p in [*root.glob("cutp/**/*.py"), *root.glob("examples/*.py")]
                 for i, line in enumerate(p.read_text().splitlines(), 1) if forbidden.search(line)]
    assert not offenders, offenders


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
        run_mpi(tp, "tests.acceptance.test_train_cli:_worker_val_loss", ckpt, tp, str(out), timeout=120)
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
    run_mpi(2, "tests.acceptance.test_train_cli:_worker_val_loss", exported, 2, str(out), timeout=120)
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
    # the union over DP ranks is the single-rank global batch: micro-batch k of DP rank r is its
    # rows [(k * dp + r) * b, (k * dp + r + 1) * b)
    ref = next(BatchSampler(ds, 16, 8, 1, 0, 8, seed=5).micro_batches(3))[0]
    order = [(k * 2 + r) * 2 + j for r in range(2) for k in range(2) for j in range(2)]
    np.testing.assert_array_equal(dp_all, ref[order])
    ctx.close()


def test_tp_ranks_share_batches_dp_ranks_split_them():
    run_mpi(4, "tests.acceptance.test_train_cli:_worker_batches", timeout=60)


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
    from cutp.models import GPT, GPTConfig
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
    run_mpi(2, "tests.acceptance.test_train_cli:_worker_repad_vocabulary", str(tmp_path / "run"), timeout=120)


def test_freed_host_memory_is_kept_for_the_next_step_on_glibc():
    """build_run's CPU setting (backward frees activations early; glibc would otherwise hand the
    memory back to the kernel at every step and fault it in again at the next)."""
    import platform

    from cutp.runtime.threads import keep_freed_host_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip(f"mallopt is glibc's; this C library is {platform.libc_ver()[0] or 'unknown'}")
    assert keep_freed_host_memory() is True
