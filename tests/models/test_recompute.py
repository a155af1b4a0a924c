"""Activation recomputation (issue 14, first part): `--recompute selective|full`, `--recompute-layers`.

Recomputation trades time for memory and must never change the math: with dropout on, the
gradients are bit-identical to those of a run that keeps everything (the recomputed forward
draws the same masks: OLMo-core #828 drew fresh ones), and each layer recomputes from its own
input (Megatron #290 fed a chunk's input to every layer of it)."""
import json

import numpy as np
import pytest

import cutp
from cutp.models import GPT, GPTConfig
from cutp.optim import FlatParameters
from tests.mpirun import run_mpi

TRAIN = "examples.train_gpt:main"


def _cached_bytes(model) -> int:
    """Bytes of the arrays the modules hold for backward (their _cache_* entries), each once."""
    seen, total = set(), 0

    def walk(v):
        nonlocal total
        if isinstance(v, np.ndarray):
            base = v if v.base is None else v.base
            while getattr(base, "base", None) is not None:
                base = base.base
            if id(base) not in seen:
                seen.add(id(base))
                total += base.nbytes
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif hasattr(v, "__dict__") and not isinstance(v, type):
            for x in vars(v).values():
                walk(x)
        elif hasattr(v, "__slots__"):
            for k in v.__slots__:
                walk(getattr(v, k, None))

    for m in model.modules():
        for k, v in vars(m).items():
            if k.startswith("_cache_") and v is not None:
                walk(v)
    return total


def _step(mode, layers, dtype="float32", tp_ctx=None):
    ctx = tp_ctx or cutp.init(tp=1)
    model = GPT(ctx, GPTConfig.preset("tiny", n_layer=3, dropout=0.1, dtype=dtype), seed=5)
    model.set_recompute(mode, layers)
    FlatParameters(model.parameters())
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 256, (4, 64)), rng.integers(0, 256, (4, 64))
    losses, stash = [], []
    for _ in range(2):  # two micro-batches: the dropout streams move on between them
        losses.append(model.forward(x, y))
        stash.append(_cached_bytes(model))
        model.backward(0.5)
    grads = {p.name: p.grad.copy() for p in model.parameters()}
    return losses, grads, stash, dict(model.rng.offsets)


@pytest.mark.parametrize("mode,layers", [("selective", None), ("full", None), ("full", 1), ("full", 2)])
def test_gradients_with_recomputation_are_bit_identical_dropout_on(mode, layers):
    losses, grads, stash, offsets = _step("none", None)
    r_losses, r_grads, r_stash, r_offsets = _step(mode, layers)
    assert r_losses == losses and r_offsets == offsets
    for name, g in grads.items():
        assert np.array_equal(r_grads[name], g), name
    assert r_stash[0] < stash[0], (mode, layers, r_stash, stash)  # and less is kept for backward


def test_the_stash_shrinks_as_promised():
    """full keeps a recomputed layer's input only; selective drops the attention probabilities
    (the T x T part), so it keeps less than none and more than full on every layer."""
    none, selective, full = (_step(m, None)[2][0] for m in ("none", "selective", "full"))
    assert full < selective < none
    ctx = cutp.init(tp=1)
    model = GPT(ctx, GPTConfig.preset("tiny", n_layer=2, dropout=0.1), seed=5)
    model.set_recompute("full", 1)
    x = np.random.default_rng(0).integers(0, 256, (2, 32))
    model.forward(x, x)
    cached = {m: [k for k, v in vars(m).items() if k.startswith("_cache_") and v is not None]
              for m in model.layers[0].modules()}
    assert cached[model.layers[0]] == ["_cache_input"] and all(not v for m, v in cached.items() if m is not model.layers[0])
    assert any(v for m, v in ((m, [k for k, v in vars(m).items() if k.startswith("_cache_") and v is not None])
                              for m in model.layers[1].modules()) if m is not model.layers[1])  # layer 2 keeps its own


def test_recompute_settings_are_checked():
    ctx = cutp.init(tp=1)
    model = GPT(ctx, GPTConfig.preset("tiny", n_layer=2), seed=0)
    with pytest.raises(cutp.ConfigError, match="recompute 'some'"):
        model.set_recompute("some")
    with pytest.raises(cutp.ConfigError, match="recompute_layers 3 needs recompute full and 1 <= N <= n_layer"):
        model.set_recompute("full", 3)
    with pytest.raises(cutp.ConfigError, match="recompute_layers 1 needs recompute full"):
        model.set_recompute("selective", 1)


def _metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_cli_runs_with_recomputation_give_the_same_losses_at_tp2_x_dp2(tmp_path):
    """float64, dropout 0.1, micro-batches, 8 steps: every recompute mode, the same losses and
    norms bit for bit as keeping everything."""
    base = ["--preset", "tiny", "--set", "n_layer=2", "--dtype", "float64", "--seq-len", "32", "--batch-size", "8",
            "--micro-batch-size", "2", "--tp", "2", "--dp", "2", "--dropout", "0.1", "--steps", "8",
            "--eval-every", "0", "--quiet"]
    rows = {}
    for name, extra in (("none", []), ("selective", ["--recompute", "selective"]),
                        ("full1", ["--recompute", "full", "--recompute-layers", "1"])):
        m = tmp_path / f"{name}.jsonl"
        run_mpi(4, TRAIN, base + ["--metrics", str(m)] + extra, timeout=240)
        rows[name] = [(r["loss"], r["grad_norm"]) for r in _metrics(m)]
    assert len(rows["none"]) == 8
    assert rows["selective"] == rows["none"] and rows["full1"] == rows["none"]


# ---- dropout that no layout changes (issue 14, second part) -------------------------------------
def test_dropout_rows_at_their_own_offsets():
    from cutp import ops

    x = np.random.default_rng(0).standard_normal((3, 4, 5))
    y, ctx = ops.dropout_forward(x, 0.3, 7, 100)
    y2, ctx2 = ops.dropout_forward_rows(x, 0.3, 7, [100, 120, 140])  # rows that follow each other
    assert np.array_equal(y, y2) and np.array_equal(ctx.mask, ctx2.mask)
    y3, ctx3 = ops.dropout_forward_rows(x, 0.3, 7, [100, 500, 140])
    assert np.array_equal(ctx3.mask[0], ctx.mask[0]) and np.array_equal(ctx3.mask[2], ctx.mask[2])
    assert np.array_equal(ctx3.mask[1], ops.dropout_mask(np, (4, 5), 0.3, 7, 500))
    assert np.array_equal(ops.dropout_backward(np.ones_like(x), ctx3), ctx3.mask / 0.7)


def test_cli_losses_with_dropout_are_the_same_at_every_layout(tmp_path):
    """float64, --dropout 0.1, 8 steps: tp 1, tp2 x dp2 with micro-batches, dp 2 with
    micro-batch 1 and full recomputation, GQA with KV heads replicated over TP: the losses of one
    rank within 1e-10 (the masks are functions of the global positions, not of the layout)."""
    base = ["--preset", "tiny", "--set", "n_layer=2", "--dtype", "float64", "--seq-len", "32", "--batch-size", "8",
            "--dropout", "0.1", "--steps", "8", "--eval-every", "0", "--quiet"]
    losses = {}
    for name, n, extra in (("tp1", 1, ["--tp", "1"]),
                           ("tp2dp2", 4, ["--tp", "2", "--dp", "2", "--micro-batch-size", "2"]),
                           ("dp2", 2, ["--tp", "1", "--dp", "2", "--micro-batch-size", "1", "--recompute", "full"]),
                           ("gqa1", 1, ["--tp", "1", "--set", "n_kv_head=2"]),
                           ("gqa4", 4, ["--tp", "4", "--set", "n_kv_head=2"])):
        m = tmp_path / f"{name}.jsonl"
        run_mpi(n, TRAIN, base + ["--metrics", str(m)] + extra, timeout=240)
        losses[name] = np.array([r["loss"] for r in _metrics(m)])
    assert len(losses["tp1"]) == 8
    for name in ("tp2dp2", "dp2"):
        np.testing.assert_allclose(losses[name], losses["tp1"], rtol=1e-10, atol=0, err_msg=name)
    np.testing.assert_allclose(losses["gqa4"], losses["gqa1"], rtol=1e-10, atol=0)
    assert not np.allclose(losses["gqa1"], losses["tp1"])  # (another model: the comparison is not vacuous)


def test_full_recompute_keeps_the_position_of_its_forward():
    """Backward may run after the next micro-batch's forward has moved the dropout position on
    (pipeline schedules do that): the recomputed forward still draws the first pass's masks."""
    grads = {}
    for mode in ("none", "full"):
        ctx = cutp.init(tp=1)
        model = GPT(ctx, GPTConfig.preset("tiny", n_layer=2, dropout=0.1, dtype="float64"), seed=5)
        model.set_recompute(mode)
        x = np.random.default_rng(1).integers(0, 256, (2, 32))
        model.rng.set_position(0, 0, 2)
        model.forward(x, x)
        model.rng.set_position(1, 0, 2)
        model.backward()
        grads[mode] = {p.name: p.grad.copy() for p in model.parameters()}
    assert all(np.array_equal(grads["full"][k], g) for k, g in grads["none"].items())
