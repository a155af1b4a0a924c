"""End-to-end training through examples/train_gpt.py: same losses at every mesh, progress lines, metrics and
validation, batches per rank, refusals. Resume and resharded checkpoints: tests/checkpoint/test_checkpoint.py."""
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
    argv = {name: BASE + ["--steps", "20", "--metrics", str(tmp_path / f"{name}.jsonl")] + extra
            for name, (_, extra) in runs.items()}
    run_mpi(1, TRAIN, argv["tp1"], timeout=240)
    run_mpi(2, TRAIN, argv["tp2"], timeout=240)
    run_mpi(4, "tests.acceptance.test_mixed_precision:_worker_two_mains", str(tmp_path / "h.json"),
            [(name, argv[name]) for name in ("tp4", "tp2dp2")], timeout=480)  # the 4-rank runs in one launch
    losses = {}
    for name in runs:
        rows = _metrics(tmp_path / f"{name}.jsonl")
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


def test_progress_lines_metrics_and_validation(tmp_path):
    """One line and one JSONL row per step with the fields users plot, validation every
    --eval-every steps, a text file as --data, and a start-up banner that says what runs."""
    import re

    from cutp.models import GPTConfig

    data = tmp_path / "corpus.txt"
    data.write_text(open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()[:20000])
    m = tmp_path / "m.jsonl"
    b, s, h = 4, 16, 128
    import importlib.util

    board = importlib.util.find_spec("tensorboardX") and importlib.util.find_spec("tensorboard")  # (the extras)
    res = run_mpi(2, TRAIN, ["--preset", "tiny", "--seq-len", str(s), "--batch-size", str(b), "--set", "n_layer=1",
                             "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--tp", "2",
                             "--data", str(data), "--metrics", str(m), "--collective-timeout", "77"]
                  + (["--tensorboard", str(tmp_path / "tb")] if board else []), timeout=120)
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
    pattern = (r"step +\d+/4 \| loss [\d.]+ \| lr [\d.e+-]+ \| norm [\d.]+ \| +[\d.]+ ms \| +[\d,]+ tok/s \| MFU n/a \| "
               r"comm [\d.]+ MB \| \d+:\d\d:\d\d elapsed, ETA \d+:\d\d:\d\d")  # (no known peak on the CPU)
    assert all(re.match(pattern, ln) for ln in lines), lines
    assert all(r["mfu"] is None and r["elapsed_s"] > 0 and r["eta_s"] >= 0 for r in rows) and rows[-1]["eta_s"] == 0
    # a short, readable header (issue 43): the model in a line of its family's fields, not a JSON dump
    assert ("model: preset tiny with ['n_layer=1']: 1 layer, n_embd 128, 8 heads of 16, MLP gelu 512 (tanh), "
            "LayerNorm" in res.stdout)
    assert '"n_layer"' not in res.stdout and "experts" not in res.stdout, res.stdout
    if board:  # --tensorboard: the same rows' scalars, read back by TensorBoard's own loader
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        assert [e.value for e in acc.Scalars("train/loss")] == [np.float32(r["loss"]) for r in rows]
        assert [e.step for e in acc.Scalars("val/loss")] == [2, 4] and "memory/activations_peak" in acc.Tags()["scalars"]
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


def test_freed_host_memory_is_kept_for_the_next_step_on_glibc():
    """build_run's CPU setting (backward frees activations early; glibc would otherwise hand the
    memory back to the kernel at every step and fault it in again at the next)."""
    import platform

    from cutp.runtime.threads import keep_freed_host_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip(f"mallopt is glibc's; this C library is {platform.libc_ver()[0] or 'unknown'}")
    assert keep_freed_host_memory() is True
