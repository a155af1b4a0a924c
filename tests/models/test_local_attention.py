"""Local attention, soft-capping and packed sequences (issues 37, 38) on every layout.

float64, dropout 0.1, a Llama-shaped tiny model whose layers alternate between a 5-token window
and global attention (T = 16), with the attention scores soft-capped; with and without packed rows
(several documents a row, one-token documents among them): the loss and every gradient of tp 2,
tp 2 + SP, cp 2 ring and all-to-all, pp 2, selective and full recomputation equal one rank's
within 1e-10; a GPT-2-shaped model (learned positions) too under SP and CP. One mpiexec launch
runs them all. Without MPI: the ring skips exactly the chunk pairs that see nothing, and the packed
loss is the documents' losses computed apart.
"""
import numpy as np
import pytest

from cutp.models import GPTConfig
from cutp.models.packing import check_documents, document_positions
from cutp.ops.attention import AttentionMask
from cutp.tensor_parallel.context_parallel import MaskRule
from tests.mpirun import run_mpi
from tests.tp_utils import rel_err

LOCAL = dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=24, vocab_size=97, block_size=16,
             dtype="float64", dropout=0.1, norm="rmsnorm", positions="rope", mlp="swiglu", bias=False,
             tie_embeddings=False, rope_theta=500.0, norm_eps=1e-5, sliding_window=5,
             layer_types=("sliding_attention", "full_attention") * 2, attn_softcap=3.0)
# learned positions (per token rows when packed), LayerNorm, GeLU, every layer local
GPT2 = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=97, block_size=16, dtype="float64", dropout=0.1,
            sliding_window=6)
# DeepSeek-V3-shaped (issue 40, the cases: tests/tensor_parallel/test_mla.py): multi-head latent attention
# (q through its low rank, v's head dim 6 apart from q and k's 8, YaRN's mscale^2 in the scale) with
# DeepSeekMoE (sigmoid group-limited routing, a shared expert, layer 0 dense); and with a plain q projection
MLA = dict(n_layer=2, n_head=4, n_embd=32, mlp_hidden=24, vocab_size=97, block_size=16, dtype="float64", dropout=0.1,
           norm="rmsnorm", positions="rope", mlp="swiglu", bias=False, tie_embeddings=False, rope_theta=500.0,
           rope_scaling="yarn", rope_factor=4.0, rope_original_max_positions=8, rope_mscale=1.0,
           rope_mscale_all_dim=1.0, norm_eps=1e-6, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
           qk_rope_head_dim=4, v_head_dim=6, n_experts=8, moe_top_k=2, moe_ffn=16, moe_renormalize=True,
           moe_scoring="sigmoid", moe_n_group=4, moe_topk_group=2, moe_routed_scaling=2.5, moe_score_bias=True,
           moe_shared_experts=1, moe_aux_loss_coeff=0.0, moe_dense_layers=(0,), family="deepseek_v3")
MODELS = {"local": LOCAL, "gpt2": GPT2, "mla": MLA, "mla_plain_q": dict(MLA, q_lora_rank=None)}
B, T = 4, 16


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, 97, (B, T))
    targets = rng.integers(0, 97, (B, T))
    starts = rng.random((B, T)) < 0.25
    starts[:, 0] = False
    starts[0, 3] = starts[0, 4] = True  # a one-token document
    starts[1, 8] = True  # a document starting at the zigzag chunks' edge
    return idx, targets, np.cumsum(starts, axis=1).astype(np.int32)


def _grads(model, ctx):
    """Every parameter's full gradient, the vocabulary padding dropped (none for a buffer: the
    DeepSeek correction bias)."""
    from tests.tp_utils import full_grads

    real = {p.name: p.real_rows for p in model.parameters() if p.grad is not None}
    return {k: g[:real[k]] for k, g in full_grads(model, ctx).items() if k in real}


def _one_rank(model_name, packed):
    import cutp
    from mpi4py import MPI

    from cutp.models import GPT

    ctx = cutp.init(comm=MPI.COMM_SELF, device="cpu")
    model = GPT(ctx, GPTConfig(**MODELS[model_name]), seed=4)
    model.train()
    idx, targets, docs = _batch()
    model.rng.set_position(0, 0, B)
    loss = model.forward(idx, targets, documents=docs if packed else None)
    model.backward()
    return loss, _grads(model, ctx)


def _pipeline(model, ctx, idx, targets, docs):
    """One micro-batch through 2 stages by hand (activations over MPI): the loss on the last."""
    from mpi4py import MPI

    comm, other = MPI.COMM_WORLD, 1 - MPI.COMM_WORLD.rank
    if ctx.pp_rank == 0:
        x = np.ascontiguousarray(model.stage_forward(idx, documents=docs))
        comm.Send(x, dest=other)
        dx = np.empty_like(x)
        comm.Recv(dx, source=other)
        model.stage_backward(dx)
        return None
    x = np.empty((B, T, model.config.n_embd))
    comm.Recv(x, source=other)
    loss = model.stage_forward(x, targets, documents=docs)
    comm.Send(np.ascontiguousarray(model.stage_backward(1.0)), dest=other)
    return loss


def _worker_layouts_equal_one_rank(cases):
    import cutp
    from mpi4py import MPI

    from cutp.models import GPT

    world = MPI.COMM_WORLD
    refs = {}
    for case in cases:
        name, packed = case["model"], case["packed"]
        if (name, packed) not in refs:
            refs[(name, packed)] = _one_rank(name, packed)
        ref_loss, ref = refs[(name, packed)]
        ctx = cutp.init(tp=case.get("tp", 1), cp=case.get("cp", 1), pp=case.get("pp", 1), device="cpu")
        model = GPT(ctx, GPTConfig(**MODELS[name]), seed=4)
        model.train()
        model.set_sequence_parallel(case.get("sp", False))
        model.set_recompute(case.get("recompute", "none"))
        if case.get("cp", 1) > 1:
            model.set_context_parallel_comm(case.get("cp_comm", "ring"))
        idx, targets, docs = _batch()
        docs = docs if packed else None
        model.rng.set_position(0, 0, B)
        if case.get("pp", 1) > 1:
            loss = _pipeline(model, ctx, idx, targets, docs)
        else:
            loss = model.forward(idx, targets, documents=docs)
            model.backward()
        grads = _grads(model, ctx)
        losses = [x for x in world.allgather(loss) if x is not None]
        # (cp: each rank's mean over its half of the targets, all of them counted)
        assert abs(np.mean(losses) - ref_loss) <= 1e-10 * abs(ref_loss), (case, losses, ref_loss)
        seen = set()
        for rank in world.allgather(grads):
            for k, g in rank.items():
                seen.add(k)
                err = rel_err(g, ref[k])  # (relative to the largest; a zero one exactly: MoE's correction bias)
                assert err <= 1e-10, (case, k, err)
        assert seen == set(ref), case


def test_local_attention_and_packing_on_every_layout_equal_one_rank():
    cases = [dict(model="local", packed=True, tp=2, sp=True),
             dict(model="local", packed=False, cp=2),
             dict(model="local", packed=True, cp=2),
             dict(model="local", packed=True, cp=2, cp_comm="a2a"),
             dict(model="local", packed=True, pp=2),
             dict(model="local", packed=False, tp=2, recompute="full"),
             dict(model="local", packed=True, tp=2, recompute="full"),
             dict(model="local", packed=True, tp=2, recompute="selective"),
             dict(model="gpt2", packed=True, tp=2, sp=True),
             dict(model="gpt2", packed=True, cp=2)]
    run_mpi(2, "tests.models.test_local_attention:_worker_layouts_equal_one_rank", cases, timeout=300)


# ---- without MPI --------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 3, 5, 9])
def test_the_ring_skips_exactly_the_chunk_pairs_that_see_nothing(window):
    _, _, docs = _batch(1)
    c = 2  # 8 chunks of 2 tokens: cp 4
    for packed in (False, True):
        rule = MaskRule(window, None, docs if packed else None)
        for qc in range(8):
            for kc in range(8):
                hidden = AttentionMask(c, c, qc * c, kc * c, window, None if not packed else
                                       (docs[:, qc * c:(qc + 1) * c], docs[:, kc * c:(kc + 1) * c])).hidden(
                    np, (0, c), (0, c))
                assert rule.visible(qc, kc, c) == bool((~hidden).any()), (window, packed, qc, kc)


def test_packed_rows_are_the_documents_apart_and_positions_restart():
    import cutp
    from cutp.models import GPT

    assert document_positions(np.array([[0, 0, 1, 1, 1, 2, 3, 3]])).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]
    with pytest.raises(ValueError, match="non-decreasing along each row"):
        check_documents(np.array([[0, 1, 0]]), np.zeros((1, 3), int))
    with pytest.raises(ValueError, match="differs from the token ids"):
        check_documents(np.zeros((1, 2), int), np.zeros((1, 3), int))
    ctx = cutp.init(device="cpu")
    for name in MODELS:
        model = GPT(ctx, GPTConfig(**dict(MODELS[name], dropout=0.0)), seed=2)
        idx, targets, docs = _batch(3)
        packed = model.forward(idx, targets, documents=docs)
        total, count = 0.0, 0
        for b in range(B):
            for d in np.unique(docs[b]):
                sel = docs[b] == d
                total += model.forward(idx[b:b + 1, sel], targets[b:b + 1, sel]) * sel.sum()
                count += sel.sum()
        assert abs(packed - total / count) <= 1e-12 * abs(packed), name
        assert abs(packed - model.forward(idx, targets)) > 1e-6  # the documents changed something


def test_generation_with_the_kv_cache_sees_only_the_window():
    """Greedy generation 36 tokens past the window (5) with the KV cache equals recomputing the whole
    sequence every step, and the cached logits (a prompt fed in two pieces, then one token at a
    time) equal the whole forward's rows within 1e-12; the local layers' caches hold 4 positions."""
    import cutp
    from cutp.generate import generate
    from cutp.models import GPT

    ctx = cutp.init(device="cpu")
    model = GPT(ctx, GPTConfig(**dict(LOCAL, block_size=48, dropout=0.0)), seed=5)
    model.eval()
    idx = np.random.default_rng(6).integers(0, 97, (2, 40))
    whole = model.gather_logits(model.forward(idx))
    caches = model.new_kv_cache(2, 40)
    got = [model.gather_logits(model.forward_cached(idx[:, :7], caches)),
           model.gather_logits(model.forward_cached(idx[:, 7:12], caches))]
    got += [model.gather_logits(model.forward_cached(idx[:, t:t + 1], caches)) for t in range(12, 40)]
    np.testing.assert_allclose(np.concatenate(got, axis=1), whole, rtol=1e-12, atol=1e-12)
    assert [c["k"].shape[2] for c in caches] == [4, 40, 4, 40]  # a local layer holds window - 1 positions
    assert not np.allclose(whole, model.gather_logits(GPT(ctx, GPTConfig(**dict(
        LOCAL, block_size=48, dropout=0.0, sliding_window=None, layer_types=None)), seed=5).forward(idx)))
    prompt = idx[:, :8]
    cached = generate(model, prompt, 36, temperature=0.0)
    assert cached == generate(model, prompt, 36, temperature=0.0, use_cache=False)
    assert len(set(cached[0])) > 1


# ---- families: Mistral's window, Qwen2's window layers ---------------------------------------
HF_COMMON = dict(hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, rms_norm_eps=1e-5)


def test_windows_read_and_written_as_transformers_configs_have_them():
    from cutp.hf import HFFormatError, config_from_hf
    from cutp.models.families import family_of

    cfg = config_from_hf(dict(HF_COMMON, model_type="mistral", sliding_window=7))
    assert cfg.sliding_window == 7 and cfg.layer_types is None and [cfg.layer_window(i) for i in range(4)] == [7] * 4
    assert config_from_hf(dict(HF_COMMON, model_type="mistral")).sliding_window == 4096  # MistralConfig's default
    assert config_from_hf(dict(HF_COMMON, model_type="mistral", sliding_window=None)).sliding_window is None
    assert family_of(cfg).config_to_hf(cfg)["sliding_window"] == 7
    qwen = config_from_hf(dict(HF_COMMON, model_type="qwen2", use_sliding_window=True, sliding_window=5,
                               max_window_layers=2))
    assert [qwen.layer_window(i) for i in range(4)] == [None, None, 5, 5]
    back = family_of(qwen).config_to_hf(qwen)
    assert (back["use_sliding_window"], back["sliding_window"], back["max_window_layers"]) == (True, 5, 2)
    assert config_from_hf(dict(HF_COMMON, model_type="qwen2", **{k: back[k] for k in (
        "use_sliding_window", "sliding_window", "max_window_layers", "layer_types")})).layer_types == qwen.layer_types
    assert config_from_hf(dict(HF_COMMON, model_type="qwen2", sliding_window=5)).sliding_window is None  # not used
    qwen3 = config_from_hf(dict(HF_COMMON, model_type="qwen3", use_sliding_window=True, sliding_window=3,
                                layer_types=["sliding_attention", "full_attention"] * 2))
    assert [qwen3.layer_window(i) for i in range(4)] == [3, None, 3, None]
    assert family_of(qwen3).config_to_hf(qwen3)["layer_types"] == list(qwen3.layer_types)
    mixtral = config_from_hf(dict(HF_COMMON, model_type="mixtral", sliding_window=6))
    assert mixtral.sliding_window == 6 and family_of(mixtral).config_to_hf(mixtral)["sliding_window"] == 6
    for bad, message in ((dict(cfg.to_dict(), family="llama"), "written as Mistral"),
                         (dict(cfg.to_dict(), layer_types=("full_attention", "sliding_attention") * 2),
                          "applies its window to every layer"),
                         (dict(cfg.to_dict(), sliding_window=None, attn_softcap=5.0), "no attention soft-capping")):
        with pytest.raises(HFFormatError, match=message):
            family_of(GPTConfig.from_dict(bad))


def test_the_mistral_v0_1_preset_counts_transformers_parameters():
    preset = GPTConfig.preset("mistral-7b-v0.1")
    assert preset.sliding_window == 4096 and preset.layer_window(31) == 4096
    try:
        import torch  # optional: the count from transformers itself
        import transformers  # optional
    except ImportError as e:
        pytest.skip(f"torch and transformers do not import here ({e})")
    from cutp.models.families import family_of

    hf = transformers.MistralConfig(**{k: v for k, v in family_of(preset).config_to_hf(preset).items()
                                       if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("meta"):
        model = transformers.MistralForCausalLM(hf)
    assert preset.num_parameters() == sum(p.numel() for p in model.parameters())


def test_a_local_layer_counts_the_window_s_keys_in_the_flops_and_the_planner_s_backward_units():
    from cutp.models.flops import forward_flops_per_token

    cfg = GPTConfig(**dict(LOCAL, block_size=64))
    glob = GPTConfig(**dict(LOCAL, block_size=64, sliding_window=None, layer_types=None))
    per_key = 2 * 2 * cfg.n_head * cfg.head_size  # scores and weighted sum, 2 FLOPs a multiply-add
    assert forward_flops_per_token(glob, 64) - forward_flops_per_token(cfg, 64) == 2 * per_key * (64 - 5)
    assert forward_flops_per_token(glob, 4) == forward_flops_per_token(cfg, 4)  # (a window past the sequence)
    from cutp.plan.layout import param_count
    from cutp.plan.overlap import backward_units

    flops = {name: f for name, _, f in backward_units(cfg, 1, 1, 64, param_count)}
    assert flops["layer 1"] - flops["layer 0"] == 4 * 64 * (64 - 5) * cfg.n_embd  # the global layer's extra keys
