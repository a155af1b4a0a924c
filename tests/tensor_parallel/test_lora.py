"""LoRA adapters and frozen parameters (issue 38; cutp.tensor_parallel.lora, cutp.train.finetune).

float64 llama-tiny with adapters on q, k, v, o, gate, up, down (dropout 0.1): on tp 1/2/4 (KV heads
fewer than tp: replicated), tp 2 + SP, pp 2, dp 2 + ZeRO-1, cp 2, full
recomputation and a Mixtral-shaped ep 2 (adapters on the experts too), the losses of two steps
and every adapter's gradient equal one rank's within 1e-10, the frozen base weights are
bit-identical to their initial values, and the optimizer holds state (and gradients) for the
adapters alone. One rank, no MPI: the adapters' output equals the merged weights' model, and
their gradients equal central differences; --freeze's groups and refusals.
"""
import numpy as np
import pytest

from cutp.bench.model import random_tokens
from cutp.models import GPTConfig
from cutp.runtime.errors import ConfigError
from cutp.tensor_parallel import gather_full
from cutp.tensor_parallel.lora import LoraSpec, apply_lora, freeze
from cutp.train import RunConfig, build_run, train_step
from tests.mpirun import run_mpi

LLAMA = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=24, vocab_size=97, block_size=16,
             dtype="float64", dropout=0.1, norm="rmsnorm", positions="rope", mlp="swiglu", bias=False,
             tie_embeddings=False, norm_eps=1e-5)
MIXTRAL = dict(LLAMA, dropout=0.0, n_experts=4, moe_top_k=2, moe_ffn=16, moe_renormalize=True)
GPT2 = dict(n_layer=2, n_head=4, n_embd=32, vocab_size=97, block_size=16, dtype="float64", dropout=0.0)  # GeLU, biases
# DeepSeek-V3-shaped: multi-head latent attention (low-rank q), a dense layer, then shared + routed experts
DEEPSEEK = GPTConfig.preset("deepseek-tiny", n_layer=2, n_head=4, n_embd=32, mlp_hidden=24, vocab_size=97,
                            block_size=16, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                            v_head_dim=8, n_experts=4, moe_top_k=2, moe_ffn=16, moe_n_group=2, moe_topk_group=1,
                            moe_bias_update_rate=0.0, dtype="float64").to_dict()
GPT2_MOE = dict(GPT2, n_experts=4, moe_top_k=2, moe_ffn=16)  # GeLU experts with biases
FAMILIES = {"llama": LLAMA, "mixtral": MIXTRAL, "gpt2": GPT2, "deepseek": DEEPSEEK, "gpt2-moe": GPT2_MOE}
MLA_TARGETS = "q_a,q_b,kv_a,kv_b,o,gate,up,down"  # PEFT's names for DeepseekV3, less _proj


# what trains: LoRA (no dropout on the experts' adapters), or (GPT-2, tied embeddings) --freeze alone
TRAINS = {"llama": dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.1),
          "mixtral": dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0),
          "gpt2": dict(freeze="embeddings,norms,layers.1.mlp.*"),
          "deepseek": dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_targets=MLA_TARGETS)}


def _config(family="llama", tp=1, dp=1, pp=1, ep=1, cp=1, micro=2, sp=False, zero=False, recompute="none",
            cp_comm="ring", **kw):
    lora = TRAINS[family]
    return RunConfig(model=GPTConfig(**dict(FAMILIES[family], dropout=0.1 if family == "gpt2" else
                                            FAMILIES[family]["dropout"])), tp=tp, dp=dp, pp=pp, ep=ep, cp=cp, cp_comm=cp_comm,
                     batch_size=4, micro_batch_size=micro, seq_len=16, steps=3, warmup=1, lr=1e-2, seed=3,
                     sequence_parallel=sp, recompute=recompute, distributed_optimizer=zero, eval_every=0, quiet=True,
                     save_on_signal=False, **{**lora, **kw})


def _train(cfg, comm, steps=2):
    """Losses; every rank's {name: (full gradient or None, full parameter)}; the base weights
    unchanged bit for bit on every rank; the optimizer's and gradients' elements."""
    run = build_run(cfg, comm, dataset=random_tokens(97, 4096, 0))
    ctx = run.ctx
    before = {p.name: np.array(p.data) for p in run.model.parameters() if not p.trainable}
    losses = [train_step(run).loss for _ in range(steps)]
    run.gather_params()  # (--overlap-param-gather: the last update's gathers)
    full = lambda p, a: np.asarray(gather_full(ctx.tp, a, p.sharding))[:p.real_rows]  # noqa: E731
    mine = {p.name: (full(p, p.grad) if p.trainable else None, full(p, p.data)) for p in run.model.parameters()}
    for p in run.model.parameters():
        if not p.trainable:
            assert p.grad is None and np.array_equal(p.data, before[p.name]), p.name
    trainable = sum(p.data.size for p in run.model.parameters() if p.trainable)
    mem = run.optimizer.memory_bytes()
    assert mem["grads"] <= 8 * (trainable + 64 * ctx.dp_cp_size), (mem, trainable)  # the adapters' only (+ padding)
    assert mem["optimizer"] <= 16 * (trainable + 64 * ctx.dp_cp_size), (mem, trainable)
    everyone = comm.allgather(mine)
    run.close()
    return losses, everyone


def _worker_layouts_equal_one_rank(cases, refs_path):
    import pickle

    from mpi4py import MPI

    with open(refs_path, "rb") as f:
        refs = pickle.load(f)  # one rank's run of each family (the test's own process ran them)
    for kw in cases:
        cfg = _config(**kw)
        losses, everyone = _train(cfg, MPI.COMM_WORLD)
        ref_losses, ref = refs[kw.get("family", "llama")]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, atol=0, err_msg=str(kw))
        seen = set()
        for rank in everyone:
            for name, (g, w) in rank.items():
                seen.add(name)
                rg, rw = ref[name]
                assert (g is None) == (rg is None), (kw, name)
                if g is not None and not cfg.distributed_optimizer:  # (ZeRO-1: its shard of the reduced gradient)
                    assert np.abs(g).max() > 0, (kw, name)  # (B is no longer 0 after the first step)
                    assert np.abs(g - rg).max() <= 1e-10 * np.abs(rg).max(), (kw, name)
                if g is None:
                    assert np.array_equal(w, rw), (kw, name)  # the frozen base: bit for bit
                else:
                    assert np.abs(w - rw).max() <= 1e-10 * np.abs(rw).max(), (kw, name)
        assert seen == set(ref), (kw, sorted(set(ref) ^ seen))


def test_lora_on_every_layout_equals_one_rank(tmp_path):
    import pickle

    from mpi4py import MPI

    cases = [dict(tp=4, recompute="full"),  # 2 KV heads over 4 ranks: replicated, their B columns too
             dict(tp=2, dp=2, sp=True, tp_comm_overlap=True), dict(tp=2, pp=2, micro=1),
             dict(dp=2, pp=2, micro=1, zero=True, overlap_grad_reduce=True, overlap_param_gather=True),
             dict(tp=2, cp=2),  # (the ring: the all-to-all changes the attention only, not the linears)
             dict(family="mixtral", tp=2, dp=2, ep=2, micro=1),
             dict(family="gpt2", tp=2, pp=2, micro=1),  # the frozen tied table on both pipeline ends
             dict(family="deepseek", tp=2, dp=2, sp=True, micro=1)]  # MLA: replicated q_a / kv_a pairs (+ SP), column, row
    # one rank with the same global batch (an MoE model's auxiliary losses cover the DP group's
    # micro-batch: its reference takes it whole)
    refs = {family: (lambda r: (r[0], r[1][0]))(_train(_config(family, micro=2), MPI.COMM_SELF))
            for family in TRAINS}
    with open(tmp_path / "refs.pkl", "wb") as f:
        pickle.dump(refs, f)
    run_mpi(4, "tests.tensor_parallel.test_lora:_worker_layouts_equal_one_rank", cases, str(tmp_path / "refs.pkl"),
            timeout=400)


# ---- one rank ------------------------------------------------------------------------------------
def _model(family="llama", **kw):
    from mpi4py import MPI
    from cutp.comm.context import init
    from cutp.models import GPT

    ctx = init(comm=MPI.COMM_SELF, tp=1, device="cpu")
    return GPT(ctx, GPTConfig(**dict(FAMILIES[family], dropout=0.0, **kw)), seed=5)


def _randomize_adapters(model, seed=0):
    rng = np.random.default_rng(seed)
    for p in model.parameters():
        if p.trainable:
            p.data[...] = rng.standard_normal(p.data.shape) * 0.3


@pytest.mark.parametrize("family", ["llama", "mixtral", "gpt2", "deepseek", "gpt2-moe"])
def test_adapters_equal_the_merged_weights_and_central_differences(family):
    kw = dict(moe_aux_loss_coeff=0.0) if "n_experts" in FAMILIES[family] else {}  # (backward includes the auxiliary losses)
    model, plain = _model(family, **kw), _model(family, **kw)
    spec = LoraSpec(rank=3, alpha=6.0, **(dict(targets=tuple(MLA_TARGETS.split(","))) if family == "deepseek" else {}))
    pairs = apply_lora(model, spec)
    assert {p.proj for p in pairs} == (set(MLA_TARGETS.split(",")) if family == "deepseek" else
                                       {"q", "k", "v", "o", "up", "down"} | ({"gate"} if "gpt2" not in family else set()))
    _randomize_adapters(model)
    weights = {p.name: p for p in plain.parameters()}
    for pair in pairs:  # W[:, cols] += scale * A @ B, in the fused weights' columns
        base = weights[pair.A.name.split(".lora_A.")[0] + ".weight"]
        width, start = pair.B.data.shape[1], pair.out.start  # (one rank: the shard's columns are the whole's)
        base.data[:, start:start + width] += spec.scale * pair.A.data @ pair.B.data
    idx = np.random.default_rng(1).integers(0, 97, (2, 16))
    tgt = np.roll(idx, -1, axis=1)
    a = model.gather_logits(model.forward(idx))
    b = plain.gather_logits(plain.forward(idx))
    assert np.abs(a - b).max() <= 1e-12 * np.abs(b).max()
    model.train()
    model.forward(idx, tgt)
    model.backward()
    rng = np.random.default_rng(2)
    for pair in pairs[:3] + pairs[-2:]:
        for p in (pair.A, pair.B):
            assert p.grad is not None and np.abs(p.grad).max() > 0
            i = tuple(int(rng.integers(0, n)) for n in p.data.shape)
            h, keep = 1e-5, p.data[i]
            p.data[i] = keep + h
            up = model.forward(idx, tgt)
            p.data[i] = keep - h
            down = model.forward(idx, tgt)
            p.data[i] = keep
            assert abs((up - down) / (2 * h) - p.grad[i]) <= 1e-7 * max(1.0, abs(p.grad[i])), (p.name, i)
    for p in model.parameters():
        assert p.trainable == (".lora_" in p.name) and (p.grad is None) == (not p.trainable)


def test_freeze_groups_and_refusals():
    model = _model()
    frozen = freeze(model, ["embeddings", "norms", "layers.1.mlp.*"])
    assert "tok_embed.weight" in frozen and "final_norm.weight" in frozen and "layers.1.mlp.fc2.weight" in frozen
    assert "layers.0.mlp.fc1.weight" not in frozen and "lm_head.weight" not in frozen
    assert all((p.grad is None) == (p.name in frozen) for p in model.parameters())
    with pytest.raises(ConfigError, match="freeze 'decoder' matches no parameter"):
        freeze(model, ["decoder"])
    with pytest.raises(ConfigError, match="lora_targets q,qq: .*qq.* is no projection"):
        LoraSpec(4, 8.0, targets=("q", "qq"))
    with pytest.raises(ConfigError, match="lora_alpha sets up LoRA adapters, which need lora_rank"):
        _config(lora_rank=None, lora_alpha=16.0, lora_dropout=0.0)
    with pytest.raises(ConfigError, match="freeze 'decoder' matches no parameter"):  # (before anything is built)
        _config(lora_rank=None, lora_alpha=None, lora_dropout=0.0, freeze="norms,decoder")
    with pytest.raises(ConfigError, match="leaves no parameter to train"):
        _config(lora_rank=None, lora_alpha=None, lora_dropout=0.0, freeze="embeddings,head,norms,attention,mlp")
    with pytest.raises(ConfigError, match="adapters on MoE experts take no dropout"):
        _config("mixtral", lora_dropout=0.1)
    with pytest.raises(ConfigError, match="lora_targets q,k,v,o,gate,up,down: q,k,v is no projection of this model "
                                          r"\(it has multi-head latent attention\); use some of q_a,q_b,kv_a,kv_b,o"):
        _config("deepseek", lora_targets="q,k,v,o,gate,up,down")
    with pytest.raises(ConfigError, match="q_a is no projection of this model"):
        _config(lora_targets="q_a,o")


def test_empty_lora_targets_are_refused_not_taken_for_all_projections():
    with pytest.raises(ConfigError, match=r"^lora_targets is empty: give the projections to adapt, some of "
                                          r"q,k,v,o,gate,up,down,q_a,q_b,kv_a,kv_b \(e.g. q,v\), or omit lora_targets "
                                          "for q,k,v,o,gate,up,down$"):
        _config(lora_targets="")
    with pytest.raises(ConfigError, match="lora_targets is empty"):
        LoraSpec(4, 8.0, targets=())
    assert _config(lora_targets=None).lora_targets is None  # (not given: every projection)


def test_a_rank_above_a_projections_dimensions_is_accepted_with_one_warning_naming_them():
    from mpi4py import MPI

    from cutp.train.finetune import _ranges, oversized_rank_line

    # LLAMA: n_embd 32; q and o 32 -> 32, k and v 32 -> 16 (2 KV heads of 8), gate and up 32 -> 24, down 24 -> 32
    run = build_run(_config(lora_rank=20, lora_dropout=0.0), MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
    assert np.isfinite(train_step(run).loss)  # (accepted, as PEFT accepts it)
    assert oversized_rank_line(run.config, run.model) == (
        "warning: --lora-rank 20 exceeds min(in, out) of k (32 -> 16) of layers 0-1, v (32 -> 16) of layers 0-1: "
        "their updates cannot exceed that rank, so the rest of those adapters is memory and compute for nothing; "
        "--lora-rank 16 or less avoids it")  # (gate, up, down: min 24, q and o 32: not named)
    run.close()
    run = build_run(_config(lora_rank=16, lora_dropout=0.0), MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
    assert oversized_rank_line(run.config, run.model) is None  # (16 = min(32, 16): a full-rank update, no waste)
    run.close()
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


@pytest.mark.parametrize("kw,match", [
    (dict(rank=0), "lora_rank 0: the adapters' rank is an integer >= 1"),
    (dict(rank=2.0), "lora_rank 2.0: the adapters' rank is an integer >= 1"),
    (dict(alpha=0.0), "lora_alpha 0.0: use a number > 0"),
    (dict(dropout=1.0), r"lora_dropout 1.0: use a probability in \[0, 1\)"),
])
def test_a_lora_spec_refuses_its_bad_fields(kw, match):
    with pytest.raises(ConfigError, match=match):
        LoraSpec(**{**dict(rank=4, alpha=8.0), **kw})


def test_apply_lora_refuses_what_the_run_settings_refuse_earlier():
    """An API caller's spec (the run's settings refuse these before any model is built)."""
    with pytest.raises(ConfigError, match="lora_targets q_a matches no projection of this model"):
        apply_lora(_model(), LoraSpec(4, 8.0, targets=("q_a",)))
    with pytest.raises(ConfigError, match="lora_dropout 0.1: adapters on MoE experts take no dropout"):
        apply_lora(_model("mixtral"), LoraSpec(4, 8.0, dropout=0.1, targets=("up",)))


def test_lora_dropout_on_an_moe_models_attention_alone_is_accepted():
    """The fix the refusal names (and the run's settings accept): adapters with dropout on the
    attention of an MoE model, none on its experts."""
    model = _model("mixtral")
    pairs = apply_lora(model, LoraSpec(4, 8.0, dropout=0.1, targets=("q", "k", "v", "o")))
    assert {p.proj for p in pairs} == {"q", "k", "v", "o"} and all(p.dropout.p == 0.1 for p in pairs)
    experts = [e for layer in model.moe_layers for e in layer.experts]
    assert experts and all(e.fc1_lora is None and e.fc2_lora is None for e in experts)
    from mpi4py import MPI

    run = build_run(_config("mixtral", lora_dropout=0.1, lora_targets="q,k,v,o"), MPI.COMM_SELF,
                    dataset=random_tokens(97, 4096, 0))  # (and the run's settings, and a run: it trains)
    assert all(np.isfinite(train_step(run).loss) for _ in range(2))
    assert all(".lora_" in p.name for p in run.model.parameters() if p.trainable)


def test_lora_dropout_on_mlas_down_projections_is_refused_under_sequence_parallelism():
    model = _model("deepseek")
    apply_lora(model, LoraSpec(4, 8.0, dropout=0.1, targets=("q_a", "kv_a")))
    attn = model.layers[0].attn
    attn.lay_out_sequence(False, None)  # (whole sequences: accepted)
    with pytest.raises(ConfigError, match="lora_dropout on q_a / kv_a of multi-head latent attention runs on each "
                                          "rank's tokens under sequence parallelism; set lora_dropout=0"):
        attn.lay_out_sequence(True, None)
    # the run's settings refuse it before anything is built (every rank alike: one line, no abort), and take each fix
    with pytest.raises(ConfigError, match="lora_dropout 0.1 on q_a / kv_a of multi-head latent attention .* set "
                                          "lora_dropout 0, or drop q_a,kv_a from lora_targets, or omit sequence_parallel"):
        _config("deepseek", tp=2, sp=True, lora_dropout=0.1, lora_targets="q_a,kv_a,o")
    for fix in (dict(lora_dropout=0.0), dict(lora_targets="o"), dict(sp=False)):
        _config("deepseek", **{**dict(tp=2, sp=True, lora_dropout=0.1, lora_targets="q_a,kv_a,o"), **fix})


def test_checkpoint_holds_the_adapters_and_resumes_bit_for_bit(tmp_path):
    import dataclasses

    from mpi4py import MPI
    from cutp.checkpoint import read_meta
    from cutp.train.step import save

    cfg = _config(lora_targets="q,v,down", freeze=None)
    run = build_run(cfg, MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
    straight = [train_step(run).loss for _ in range(3)]
    want = {p.name: np.array(p.data) for p in run.model.parameters()}
    run.close()
    run = build_run(dataclasses.replace(cfg, out=str(tmp_path), run_steps=2), MPI.COMM_SELF,
                    dataset=random_tokens(97, 4096, 0))
    first = [train_step(run).loss for _ in range(2)]
    path = save(run)
    run.close()
    meta = read_meta(path)
    assert meta["trainable_only"] and sorted(meta["params"]) == sorted(
        p.name for p in run.model.parameters() if p.trainable)
    assert {n.rsplit(".", 1)[1] for n in meta["params"]} == {"q", "v", "down"}
    run = build_run(dataclasses.replace(cfg, resume=path, resumed_step=2), MPI.COMM_SELF,
                    dataset=random_tokens(97, 4096, 0))
    last = train_step(run).loss
    assert first + [last] == straight
    for p in run.model.parameters():
        assert np.array_equal(p.data, want[p.name]), p.name
    run.close()


def test_a_pipeline_stage_left_with_nothing_to_train_is_refused_naming_it():
    from types import SimpleNamespace

    from cutp.train.finetune import set_up_trainable

    model = _model("gpt2")  # this rank's stage, all of whose parameters the groups below freeze
    pp = SimpleNamespace(Allreduce=lambda a, b: None, allgather=lambda mine: [mine, (5, [2, 3])])
    model.ctx = SimpleNamespace(pp_size=2, pp=SimpleNamespace(mpi_comm=pp))
    run = SimpleNamespace(freeze="embeddings,norms,layers.*", lora_rank=None, lora_alpha=None, lora_dropout=0.0,
                          lora_targets="q", seed=0)
    with pytest.raises(ConfigError, match=r"leaves pipeline stage 0 \(layers \[0, 1\]\) nothing to train"):
        set_up_trainable(model, run)


def test_a_run_saved_without_its_base_is_refused_as_init_from(tmp_path):
    import dataclasses

    from mpi4py import MPI
    from cutp.train.step import save

    cfg = _config(lora_targets="q", out=str(tmp_path / "run"))
    run = build_run(cfg, MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
    train_step(run)
    path = save(run)
    run.close()
    again = dataclasses.replace(cfg, out=None, init_from=path)
    with pytest.raises(ConfigError, match="holds only what its run trained.*--merge-lora"):
        build_run(again, MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))


def test_a_lora_run_whose_base_moved_is_refused_naming_the_fix_or_resumes_from_init_from(tmp_path):
    import dataclasses
    import os

    from mpi4py import MPI
    from cutp.train import resolve_run_config
    from cutp.train.step import save

    plain = _config(lora_rank=None, lora_alpha=None, lora_dropout=0.0, out=str(tmp_path / "base"))
    run = build_run(plain, MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
    base = save(run)  # (the frozen base: a cutp checkpoint)
    run.close()
    cfg = _config(lora_targets="q,v", init_from=base)
    run = build_run(cfg, MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
    straight = [train_step(run).loss for _ in range(2)]
    run.close()
    run = build_run(dataclasses.replace(cfg, out=str(tmp_path / "lora"), run_steps=1), MPI.COMM_SELF,
                    dataset=random_tokens(97, 4096, 0))
    train_step(run)
    path = save(run)
    run.close()
    moved = str(tmp_path / "moved")
    os.rename(tmp_path / "base", moved)
    with pytest.raises(ConfigError, match=r"holds only what its run trained; its frozen base .* is not a directory "
                                          r"\(moved or deleted\): give the directory it moved to as init_from"):
        resolve_run_config(MPI.COMM_SELF, resume=path, device="cpu")
    again = os.path.join(moved, os.path.basename(base))
    assert resolve_run_config(MPI.COMM_SELF, resume=path, init_from=again, device="cpu").init_from == again
    run = build_run(dataclasses.replace(cfg, init_from=again, resume=path, resumed_step=1), MPI.COMM_SELF,
                    dataset=random_tokens(97, 4096, 0))
    assert train_step(run).loss == straight[1]  # the adapters on the base, found where it moved
    run.close()
    with pytest.raises(ConfigError, match="starts a new run from its weights"):  # (a whole checkpoint: refused)
        resolve_run_config(MPI.COMM_SELF, resume=again, init_from=again, device="cpu")


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_backward_skips_the_leading_layers_nothing_before_trains_bit_for_bit(recompute, monkeypatch):
    """LoRA with --freeze embeddings,layers.0.* (layer 0's adapters frozen too): layer 0's
    and the embeddings' backward is skipped; every gradient is bit-identical to the full backward."""
    from mpi4py import MPI
    from cutp.models import GPT

    cfg = _config(lora_targets="q,v,down", freeze="embeddings,layers.0.*", recompute=recompute)  # (its adapters too)
    grads = []
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(GPT, "_frozen_lead", lambda self, chunk: 0)
        run = build_run(cfg, MPI.COMM_SELF, dataset=random_tokens(97, 4096, 0))
        assert not any(p.trainable for p in run.model.layers[0].parameters())
        calls = []
        block = run.model.layers[0]
        monkeypatch.setattr(block, "backward", lambda dy, _b=block.backward: calls.append(1) or _b(dy))
        run.model.train()
        idx = np.random.default_rng(1).integers(0, 97, (2, 16))
        run.model.forward(idx, np.roll(idx, -1, axis=1))
        for p in run.model.parameters():
            if p.trainable:
                p.grad[...] = 0
        run.model.backward()
        assert bool(calls) != skip and run.model._frozen_lead(0) == (1 if skip else 0)
        assert not [k for m in run.model.modules() for k, v in vars(m).items() if k.startswith("_cache") and v]
        grads.append({p.name: np.array(p.grad) for p in run.model.parameters() if p.trainable})
        run.close()
    assert grads[0].keys() == grads[1].keys() and any(".lora_" in n for n in grads[0])
    assert all(np.array_equal(grads[0][n], grads[1][n]) for n in grads[0])
