"""DeepSeek-V3's correction bias in a 16-bit model (issue 40): a buffer kept in float32, outside
the optimizer (no master weights to undo its moves), saved and resumed with the weights.

A DeepSeekMoE-routed tiny model trained 3 steps in bfloat16, as in float32, ends with each bias
exactly the sum of its steps' moves, rate x sign(mean load - load) from the step's global counts;
its checkpoint holds the biases in float32 (and no optimizer state for them), and the resumed
run reads them back exactly.
"""
import numpy as np
from mpi4py import MPI

from cutp.bench.model import random_tokens
from cutp.checkpoint import read_meta
from cutp.checkpoint.load import read_shard
from cutp.models import GPTConfig
from cutp.train import RunConfig, build_run, save, train_step
from tests.models.test_families import DEEPSEEK_MOE

RATE = DEEPSEEK_MOE["moe_bias_update_rate"]


def _run(dtype, steps, **run):
    """(each MoE layer's bias after `steps` steps, the bias its steps' loads give: the sum of
    rate x sign(mean load - load) added in float32, the checkpoint saved at the end or None)."""
    cfg = RunConfig(model=GPTConfig(**dict(DEEPSEEK_MOE, n_layer=2, dtype=dtype, dropout=0.0)), batch_size=4,
                    micro_batch_size=4, seq_len=16, steps=4, warmup=1, seed=3, eval_every=0, quiet=True,
                    save_on_signal=False, **run)
    r = build_run(cfg, MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
    expected = []
    for m in r.model.moe_layers:  # the step's global counts, as the layer plans its move from them
        expected.append(m.score_bias.data.copy())
        m.plan_score_bias = _recording(m.plan_score_bias, expected[-1])
    try:
        for _ in range(steps):
            train_step(r)
        biases = [m.score_bias.data.copy() for m in r.model.moe_layers]
        path = save(r) if run.get("out") else None
    finally:
        r.close()
    return biases, expected, path


def _recording(plan, bias):
    def plan_and_record(assigned):
        load = np.asarray(assigned, np.float64)
        bias[...] += (RATE * np.sign(load.mean() - load)).astype(bias.dtype)
        return plan(assigned)
    return plan_and_record


def test_the_correction_bias_moves_in_bfloat16_as_in_float32_and_is_checkpointed(tmp_path):
    for dtype in ("float32", "bfloat16"):
        got, want, ckpt = _run(dtype, 3, out=str(tmp_path / dtype))
        for b, w in zip(got, want):
            # (a bfloat16 bias would round a move of 0.01 near 1 away; float32 masters undid it)
            assert b.dtype == np.float32
            np.testing.assert_array_equal(b, w)
            moves = np.round(b / RATE)  # a sum of three moves of +-1 (0 at exactly the mean load)
            assert np.abs(moves).max() <= 3 and moves.any()
    meta = read_meta(ckpt)
    names = [n for n in meta["params"] if n.endswith("router.score_bias")]
    assert len(names) == 1 and meta["params"][names[0]]["dtype"] == "float32"
    optim = read_shard(ckpt, "optim")  # master weights, but none for the bias (no optimizer state)
    assert "master.layers.0.attn_norm.weight" in optim and not [k for k in optim if k.endswith(names[0])]
    back, _, _ = _run("bfloat16", 0, resume=ckpt, resumed_step=3)
    for b, w in zip(back, got):
        np.testing.assert_array_equal(b, w)
