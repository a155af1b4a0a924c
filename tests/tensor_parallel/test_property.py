"""Property-based: random GPT compositions at TP=N (N in 1..4) equal TP=1.

Hypothesis runs on rank 0 of a 4-rank MPI job and broadcasts each drawn configuration; the
first N ranks build the model at TP=N, every participating rank compares against its own TP=1
model, and the verdicts come back to rank 0, where a failure is raised inside the hypothesis
test so that it shrinks to a minimal failing composition.
"""
import json
import math

import numpy as np

from tests.mpirun import run_mpi

N_RANKS = 4


def _config_strategy():
    from hypothesis import strategies as st

    @st.composite
    def configs(draw):
        tp = draw(st.integers(1, N_RANKS))
        n_kv = draw(st.sampled_from([d for d in range(1, 9) if d % tp == 0 or tp % d == 0]))
        n_head = math.lcm(tp, n_kv) * draw(st.integers(1, 2))
        head_dim = draw(st.integers(1, 4))
        return dict(
            tp=tp,
            model=dict(
                n_layer=draw(st.integers(1, 2)), n_head=n_head, n_kv_head=n_kv, n_embd=n_head * head_dim,
                mlp_hidden=tp * draw(st.integers(1, 4)), vocab_size=draw(st.integers(2, 40)), block_size=8,
                bias=draw(st.booleans()), tie_embeddings=draw(st.booleans()),
                label_smoothing=draw(st.sampled_from([0.0, 0.1])), gelu=draw(st.sampled_from(["tanh", "none"])),
                vocab_multiple=draw(st.sampled_from([1, 4, 128])), dtype="float64"),
            batch=draw(st.integers(1, 2)), seq=draw(st.integers(1, 8)), seed=draw(st.integers(0, 2**16)),
        )

    return configs()


def _evaluate(example, ctxs, self_ctx):
    """Runs one example on this rank; returns an error string or ''."""
    from cutp.models import GPT, GPTConfig
    from cutp.tensor_parallel.mappings import gather_from_tp_forward
    from tests.tp_utils import full_grads, rel_err

    tp = example["tp"]
    ctx = ctxs[tp]
    if ctx is None:
        return ""
    cfg = GPTConfig(**example["model"])
    rng = np.random.default_rng(example["seed"])
    idx = rng.integers(0, cfg.vocab_size, (example["batch"], example["seq"]))
    tgt = rng.integers(0, cfg.vocab_size, idx.shape)
    out = []
    for c in (self_ctx, ctx):
        m = GPT(c, cfg, seed=example["seed"])
        loss = m.forward(idx, tgt)
        m.backward()
        g = full_grads(m, c)
        for name in ("tok_embed.weight", "lm_head.weight"):
            if name in g:
                if g[name][cfg.vocab_size:].any():
                    return f"padded rows of {name} got gradient"
                g[name] = g[name][: cfg.vocab_size]
        m.eval()
        logits = gather_from_tp_forward(c.tp, m.forward(idx))[..., : cfg.vocab_size]
        out.append((loss, logits, g))
    (l1, z1, g1), (ln, zn, gn) = out
    if abs(ln - l1) > 1e-10 * abs(l1):
        return f"loss {ln!r} != {l1!r}"
    if rel_err(zn, z1) > 1e-10:
        return f"logits differ: {rel_err(zn, z1):.2e}"
    for k in g1:
        e = rel_err(gn[k], g1[k])
        if e > 1e-10:
            return f"grad {k} differs: {e:.2e}"
    return ""


def _worker_property(max_examples):
    from hypothesis import HealthCheck, given, settings
    from mpi4py import MPI

    import cutp
    from tests.tp_utils import self_ctx

    world = MPI.COMM_WORLD
    ctxs = {}
    for n in range(1, N_RANKS + 1):  # TP=n over the first n ranks; the others idle for that example
        sub = world.Split(color=0 if world.rank < n else MPI.UNDEFINED, key=world.rank)
        ctxs[n] = cutp.init(comm=sub, tp=n, device="cpu") if sub != MPI.COMM_NULL else None
    ref = self_ctx()

    def run_everywhere(example):
        msg = world.bcast(json.dumps(example), root=0)  # test plumbing: a JSON string
        example = json.loads(msg)
        if example.get("stop"):
            return False
        errors = world.gather(_evaluate(example, ctxs, ref), root=0)
        return errors if world.rank == 0 else True

    if world.rank == 0:
        @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(_config_strategy())
        def prop(example):
            errors = run_everywhere(example)
            bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
            assert not bad, f"TP={example['tp']} differs from TP=1 for {example}: {bad}"

        try:
            prop()
        finally:
            run_everywhere({"stop": True})
    else:
        while run_everywhere(None):
            pass


def test_random_compositions_tp_n_equals_tp_1():
    run_mpi(N_RANKS, "tests.tensor_parallel.test_property:_worker_property", 45, timeout=300)
