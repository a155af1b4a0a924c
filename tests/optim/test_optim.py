"""AdamW, the flat parameter buffer, clipping and the learning-rate schedule."""
import math

import numpy as np
import pytest

from cutp import ops
from cutp.models import GPT, GPTConfig
from cutp.optim import AdamW, FlatParameters, clip_scale, lr_schedule
from tests.tp_utils import self_ctx


def _adamw_reference(p, g, m, v, decay, lr, b1, b2, eps, wd, t, scale):
    """Textbook AdamW, one element at a time in float64 (PyTorch's torch.optim.AdamW formula)."""
    p, m, v = p.astype(np.float64).copy(), m.astype(np.float64).copy(), v.astype(np.float64).copy()
    for i in range(p.size):
        gi = float(g[i]) * scale
        m[i] = b1 * m[i] + (1 - b1) * gi
        v[i] = b2 * v[i] + (1 - b2) * gi * gi
        p[i] *= 1 - lr * wd * decay[i]
        p[i] -= lr * (m[i] / (1 - b1 ** t)) / (math.sqrt(v[i] / (1 - b2 ** t)) + eps)
    return p, m, v


@pytest.mark.parametrize("dtype,rtol,atol", [(np.float64, 1e-13, 1e-15), (np.float32, 2e-6, 1e-7)])
def test_adamw_update_matches_textbook(dtype, rtol, atol):
    rng = np.random.default_rng(0)
    n = 1000
    p = rng.standard_normal(n).astype(dtype)
    m = (rng.standard_normal(n) * 0.1).astype(dtype)
    v = (rng.random(n) * 0.01).astype(dtype)
    g = rng.standard_normal(n).astype(dtype)
    decay = (rng.random(n) < 0.5).astype(dtype)
    kw = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=7, grad_scale=0.5)
    ref = _adamw_reference(p, g, m, v, decay, 3e-3, 0.9, 0.95, 1e-8, 0.1, 7, 0.5)
    g0 = g.copy()
    ops.adamw_update(p, g, m, v, decay, **kw)
    for got, want in zip((p, m, v), ref):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    assert np.array_equal(g, g0), "the gradient was modified"


def test_flat_parameters_are_views_and_weight_decay_is_one_range():
    ctx = self_ctx()
    model = GPT(ctx, GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=4), seed=0)
    before = {p.name: p.data.copy() for p in model.parameters()}
    flat = FlatParameters(model.parameters())
    for p in model.parameters():
        np.testing.assert_array_equal(p.data, before[p.name])
        assert np.shares_memory(p.data, flat.data) and np.shares_memory(p.grad, flat.grad)
        s = flat.slices[p.name]
        assert (s.stop <= flat.n_decay) == p.weight_decay and (s.start >= flat.n_decay) != p.weight_decay
    assert flat.decay_ranges() == [(0, flat.n_decay, True), (flat.n_decay, flat.size, False)]
    assert flat.decay_ranges(3, flat.n_decay) == [(3, flat.n_decay, True)]
    assert not hasattr(flat, "decay_mask")  # no buffer the size of the model: fp32 state is 16 B/param
    decayed = {p.name for p in model.parameters() if p.weight_decay}
    assert decayed == {"layers.0.attn.qkv.weight", "layers.0.attn.proj.weight", "layers.0.mlp.fc1.weight",
                       "layers.0.mlp.fc2.weight", "tok_embed.weight", "pos_embed.weight"}, decayed  # no biases or LayerNorm
    # an optimizer step through the flat buffer moves the model's own parameters
    flat.grad[...] = 1.0
    opt = AdamW(flat, lr=0.1)
    opt.step()
    assert not np.array_equal(model.tok_embed.weight.data, before["tok_embed.weight"])
    state = opt.state_dict()
    assert set(state) == {f"{k}.{p.name}" for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")}
    opt2 = AdamW(FlatParameters(GPT(ctx, GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=4)).parameters()))
    opt2.load_state(state, opt.step_count)
    np.testing.assert_array_equal(opt2.m, opt.m)
    assert opt2.step_count == 1


def test_clip_scale():
    assert clip_scale(0.5, 1.0) == 1.0
    assert abs(clip_scale(4.0, 1.0) - 0.25) < 1e-6
    assert clip_scale(4.0, 0) == 1.0 and clip_scale(float("nan"), 1.0) == 1.0


def test_lr_schedule_warmup_then_cosine():
    lrs = [lr_schedule(s, 1.0, 10, 110) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55)
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
