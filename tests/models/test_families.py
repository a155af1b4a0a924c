"""Model families (issues 27, 37, 40): Llama-, Qwen2-, Mixtral-, Qwen3-, Gemma-, Qwen3-MoE- and DeepSeek-shaped tiny models on every layout.

float64, dropout 0.1: the losses, every gradient (unless ZeRO-1 kept only its shard) and the
parameters after the step of a TP x DP x PP (x EP) mesh equal one rank's within 1e-10: tp 2
and 4 (KV heads fewer than tp: replicated), sequence parallelism, 1F1B, GPipe and interleaved
pipelines, ZeRO-1, expert parallelism, context parallelism (ring and all-to-all), selective and full
recomputation. One mpiexec launch
runs them all.
"""
import numpy as np

from cutp.bench.model import random_tokens
from cutp.models import GPTConfig
from cutp.runtime.errors import ConfigError
from cutp.tensor_parallel import gather_full
from cutp.train import RunConfig, build_run, train_step
from tests.mpirun import run_mpi

# rmsnorm, rope with llama3 scaling whose bands fall inside the head (original context 8), swiglu,
# GQA, no biases, untied
LLAMA = dict(n_layer=4, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=24, vocab_size=97, block_size=16,
             dtype="float64", dropout=0.1, norm="rmsnorm", positions="rope", mlp="swiglu", bias=False,
             tie_embeddings=False, rope_theta=500.0, rope_scaling="llama3", rope_factor=8.0,
             rope_original_max_positions=8, norm_eps=1e-5)
# Qwen2: q/k/v biases only, tied; and a head_dim (12) apart from n_embd / n_head (8)
QWEN2 = dict(LLAMA, qkv_bias=True, tie_embeddings=True, head_dim=12, rope_scaling="none", norm_eps=1e-6)
# Mixtral: SwiGLU experts, softmax over the router logits, top-2, renormalised
MIXTRAL = dict(LLAMA, n_experts=4, moe_top_k=2, moe_ffn=16, moe_renormalize=True, rope_scaling="none")
# Qwen3: QK-norm (its weights moved off 1 by the first step), head_dim (12) apart from n_embd / n_head
QWEN3 = dict(LLAMA, qk_norm=True, head_dim=12, rope_scaling="none", norm_eps=1e-6)
def _window_applied() -> bool:
    """Whether cutp computes a window shorter than the sequence and the attention soft-cap (issue
    37's attention paths); until then a config with them is refused."""
    try:
        GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=8, block_size=16, sliding_window=4,
                  attn_softcap=20.0).validate()
    except ConfigError:
        return False
    return True


WINDOW_APPLIED = _window_applied()
# Gemma 3 (and 2's pieces): (1 + w) norms (zeros at first) before and after each branch, GeGLU, the
# embedding scaled, query_pre_attn_scalar, QK-norm, local layers with their own rope, the global
# ones' linearly scaled, the logits soft-capped, tied; the window shorter than the sequence once
# the attention applies it (WINDOW_APPLIED; until then the sequence's, which leaves no key out)
GEMMA = dict(LLAMA, mlp="geglu", norm_offset=True, embed_scale=True, post_norms=True, query_pre_attn_scalar=10.0,
             final_softcap=5.0, qk_norm=True, head_dim=12, rope_scaling="linear", rope_factor=4.0,
             rope_local_theta=100.0, layer_types=("sliding_attention", "full_attention") * 2, tie_embeddings=True,
             norm_eps=1e-6, sliding_window=8 if WINDOW_APPLIED else 16)
# Qwen3-MoE: QK-norm, 8 narrow experts, top-2 renormalised, layer 1 dense (mlp_only_layers)
QWEN3_MOE = dict(QWEN3, n_experts=8, moe_top_k=2, moe_ffn=16, moe_renormalize=True, moe_dense_layers=(1,),
                 family="qwen3_moe")
# DeepSeekMoE routing on Llama's attention: sigmoid scores, 4 groups of 2 with 2 kept, top-2 renormalised
# and scaled, a shared expert, layer 0 dense, and the correction bias moved after each step by the
# step's global counts (compared with the parameters: the same on every layout)
DEEPSEEK_MOE = dict(LLAMA, n_experts=8, moe_top_k=2, moe_ffn=16, moe_renormalize=True, moe_scoring="sigmoid",
                    moe_n_group=4, moe_topk_group=2, moe_routed_scaling=2.5, moe_score_bias=True,
                    moe_bias_update_rate=0.01, moe_shared_experts=1, moe_aux_loss_coeff=0.0, moe_dense_layers=(0,),
                    rope_scaling="none")
# DeepSeek-V3: that routing with multi-head latent attention (q through its low rank, v's head dim 6 apart
# from q and k's 8; its SP and CP layouts: tests/tensor_parallel/test_mla.py)
DEEPSEEK_V3 = dict(DEEPSEEK_MOE, n_kv_head=None, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                   qk_rope_head_dim=4, v_head_dim=6, family="deepseek_v3")
FAMILIES = {"llama": LLAMA, "qwen2": QWEN2, "mixtral": MIXTRAL, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE,
            "deepseek_moe": DEEPSEEK_MOE, "deepseek_v3": DEEPSEEK_V3, "gemma": GEMMA}


LAYOUT = ("tp", "dp", "pp", "ep", "micro", "schedule", "virtual", "sp", "recompute", "zero", "cp", "cp_comm")


def _config(family, tp=1, dp=1, pp=1, ep=1, micro=2, schedule="1f1b", virtual=1, sp=False, recompute="none",
            zero=False, cp=1, cp_comm="ring", **model):
    """`zero`: False, True (ZeRO-1) or a stage; `model`: fields over the family's."""
    stage = {} if isinstance(zero, bool) else {"zero": zero}
    return RunConfig(model=GPTConfig(**dict(FAMILIES[family], **model)), tp=tp, dp=dp, pp=pp, ep=ep, cp=cp,
                     cp_comm=cp_comm, pp_schedule=schedule,
                     pp_virtual=virtual, batch_size=8, micro_batch_size=micro, seq_len=16, steps=3, warmup=1,
                     seed=3, sequence_parallel=sp, recompute=recompute, distributed_optimizer=zero is True,
                     eval_every=0, quiet=True, save_on_signal=False, **stage)


def _train(cfg, comm, steps=2):
    """The losses (with an MoE model's sequence-wise balance loss), and every rank's {name: (full
    gradient or None (a buffer), full parameter)} after `steps` steps."""
    run = build_run(cfg, comm, dataset=random_tokens(97, 4096, 0))
    losses = []
    for _ in range(steps):
        s = train_step(run)
        losses.append((s.loss, s.moe["seq_aux_loss"]) if s.moe else s.loss)
    run.gather_params()  # (ZeRO-3: every parameter whole)
    ctx = run.ctx
    full = lambda p, a: np.asarray(gather_full(ctx.tp, a, p.sharding))[:p.real_rows]  # noqa: E731
    mine = {p.name: (None if p.grad is None else full(p, p.grad), full(p, p.data)) for p in run.model.parameters()}
    everyone = comm.allgather(mine)
    run.close()
    return losses, everyone


def _worker_layouts_equal_one_rank(cases, steps=2):
    from mpi4py import MPI

    for kw in cases:
        cfg = _config(**kw)
        losses, everyone = _train(cfg, MPI.COMM_WORLD, steps)
        # one rank with the same global batch (an MoE model's auxiliary losses cover the DP group's
        # micro-batch: the reference takes it whole)
        micro = cfg.micro_batch_size * (cfg.dp if cfg.model.n_experts else 1)
        model = {k: v for k, v in kw.items() if k not in LAYOUT + ("family",)}
        ref_losses, ref = _train(_config(kw["family"], micro=micro, **model), MPI.COMM_SELF, steps)
        ref = ref[0]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0, err_msg=str(kw))
        seen = set()
        for rank in everyone:
            for name, (g, w) in rank.items():
                seen.add(name)
                rg, rw = ref[name]
                assert (g is None) == (rg is None), (kw, name)
                # (ZeRO keeps only its shard of the reduced gradient)
                if g is not None and not (cfg.distributed_optimizer or cfg.zero):
                    assert np.abs(g - rg).max() <= 1e-10 * np.abs(rg).max(), (kw, name)
                assert np.abs(w - rw).max() <= 1e-10 * np.abs(rw).max(), (kw, name)
        assert seen == set(ref), (kw, sorted(set(ref) ^ seen))


def test_llama_qwen2_mixtral_qwen3_gemma_on_every_layout_equal_one_rank():
    cases = [dict(family="llama", tp=4, recompute="full"),  # 2 KV heads over 4 ranks: replicated
             dict(family="llama", tp=2, dp=2, sp=True),
             dict(family="llama", tp=2, pp=2, micro=1),  # 1F1B
             dict(family="llama", dp=2, pp=2, micro=1, schedule="interleaved", virtual=2, zero=True),
             dict(family="llama", tp=2, dp=2, recompute="selective"),
             dict(family="qwen2", dp=2, pp=2, micro=1, schedule="gpipe"),
             dict(family="qwen2", tp=4),
             dict(family="qwen2", tp=2, pp=2, sp=True, micro=1, recompute="full"),
             dict(family="mixtral", tp=2, dp=2, ep=2, micro=1),
             dict(family="qwen3", tp=4, recompute="full"),  # QK-norm of replicated KV heads
             dict(family="qwen3", tp=2, dp=2, sp=True, recompute="selective"),
             dict(family="qwen3", tp=2, cp=2, cp_comm="a2a"),
             dict(family="qwen3", cp=2, dp=2, zero=True),  # the ring
             dict(family="qwen3", dp=2, pp=2, micro=1, schedule="interleaved", virtual=2),
             dict(family="gemma", tp=4, recompute="full"),  # (every config here has dropout 0.1)
             dict(family="gemma", tp=2, pp=2, micro=1, schedule="interleaved", virtual=2, sp=True),
             dict(family="gemma", cp=2, dp=2, zero=True),  # the ring
             dict(family="gemma", tp=2, cp=2, cp_comm="a2a"),
             # (issue 40: grouped experts and their routing; EP 4 is tests/tensor_parallel/test_expert_parallel.py's)
             # the sequence-wise balance loss with sequences split by SP, and by CP (zigzag chunks)
             dict(family="qwen3_moe", tp=2, dp=2, ep=2, sp=True, zero=True, micro=1, moe_seq_aux_loss=0.01),
             dict(family="deepseek_v3", tp=2, pp=2, sp=True, micro=1),  # MLA by heads (+ SP), the bias over the pipeline
             dict(family="deepseek_moe", dp=2, ep=2, cp=2, micro=1, moe_seq_aux_loss=0.01)]  # the bias from every
    # CP and EP rank
    run_mpi(4, "tests.models.test_families:_worker_layouts_equal_one_rank", cases, timeout=400)
