"""The planner's fine-tuning (cutp.plan.finetune): LoRA's elements per rank by formula equal the
adapters the model declares (column, row, GQA-replicated KV heads, MoE experts, MLA's replicated
down-projections); `cutp plan --lora-rank/--freeze` plans the state of what trains only. (That the
plan equals a measured LoRA and --freeze run: tests/plan/test_memory.py's two-rank cases.)"""
import json

import pytest

from cutp.models import GPTConfig
from cutp.plan import layout
from cutp.plan.cli import main as plan_main
from cutp.plan.finetune import lora_elements
from cutp.plan.run import planned_parameters
from cutp.tensor_parallel.lora import LoraSpec

MIXTRAL = dict(n_layer=2, n_experts=4, moe_top_k=2, moe_ffn=48)


@pytest.mark.parametrize("preset, over, targets, tps", [
    ("llama-tiny", {}, "q,k,v,o,gate,up,down", (1, 2, 4)),  # tp 4 > 2 KV heads: one replicated head's B
    ("tiny", dict(n_layer=2), "q,v,o,up,down", (1, 2)),  # GPT-2's GeLU MLP: up and down
    ("llama-tiny", MIXTRAL, "q,o,gate,up,down", (1, 2)),  # the experts' pairs, replicated over TP
    ("deepseek-tiny", dict(n_layer=2), "q_a,q_b,kv_a,kv_b,o,gate,up,down", (1, 2)),  # MLA; shared + routed experts
])
def test_lora_elements_per_rank_are_the_adapters_the_model_declares(preset, over, targets, tps):
    config = GPTConfig.preset(preset, **over)
    spec = LoraSpec(rank=4, alpha=8.0, targets=tuple(targets.split(",")))
    for tp in tps:
        for rank in range(tp):
            got = planned_parameters(config, tp=tp, rank=rank, finetune=dict(lora_rank=4, lora_targets=targets))
            declared = sum(p.numel for p in got if p.trainable)
            assert all(p.trainable == (".lora_" in p.name) for p in got)
            want = lora_elements(config, spec, tp)
            assert want["trainable"] == declared, (tp, rank)
            experts = sum(p.numel for p in got if p.trainable and ".experts." in p.name)
            assert want["experts"] == experts > 0 if config.n_experts else want["experts"] == 0


def test_cutp_plan_plans_lora_and_freeze_from_what_trains(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["--preset", "llama-tiny", "--tp", "2", "--seq-len", "32", "--device", "cpu", "--dtype",
                      "bfloat16", "--lora-rank", "8", "--lora-alpha", "16", "--lora-targets", "q,v",
                      "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "trains per GPU     10,752 (LoRA rank 8, alpha 16 on q,v)" in text
    assert "the 10,752 trainable x 4 B (fp32 main grads)" in text
    r = json.loads(out.read_text())["plan"]
    assert r["params_per_gpu"] == layout.parameters_per_rank(GPTConfig.preset("llama-tiny"), 2) + 10_752
    assert (r["grad_bytes"], r["optim_bytes"]) == (4 * 10_752, 12 * 10_752)  # fp32 gradients, master, m, v
    assert r["param_bytes"] == 2 * r["params_per_gpu"]
    # a --params architecture (by formula): --freeze's groups frozen, the rest trains
    frozen = layout.plan(GPTConfig.preset("llama2-7b"), tp=2, dp=2, micro_batch=1, seq_len=4096, dtype="bfloat16",
                         distributed_optimizer=True, finetune=dict(freeze="embeddings,head"))
    whole = layout.plan(GPTConfig.preset("llama2-7b"), tp=2, dp=2, micro_batch=1, seq_len=4096, dtype="bfloat16",
                        distributed_optimizer=True)
    V, h = 32000, 4096
    assert frozen["trainable_per_gpu"] == whole["params_per_gpu"] - 2 * V * h // 2 - h
    assert frozen["grad_bytes"] == 4 * frozen["padded_params"] and frozen["padded_params"] % 128 == 0
    assert frozen["param_bytes"] == 2 * (frozen["params_per_gpu"] - frozen["trainable_per_gpu"] + frozen["padded_params"])
    assert frozen["dp_reduce_scatter"]["elements"] == frozen["padded_params"]
    # training's refusals, by the plan's flags
    assert plan_main(["--params", "7B", "--lora-alpha", "16", "--quiet"]) == 2
    assert plan_main(["--params", "7B", "--lora-rank", "8", "--pp", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--lora-alpha sets up LoRA adapters, which need --lora-rank" in err
    assert "--pp with --lora-rank or --freeze" in err


def test_zero_3_plans_the_state_of_what_trains_from_the_models_units():
    """At zero 2/3 the plan's state is cutp.plan.zero's, with the frozen base sharded (zero 3)
    but given no gradient shard, master or moments; the formula path likewise."""
    from cutp.plan.zero import zero_plan

    config = GPTConfig.preset("llama-tiny", dtype="bfloat16")
    lora = dict(lora_rank=8)
    for zero in (2, 3):
        whole, tuned = (layout.plan(config, config=config, tp=1, dp=4, micro_batch=1, seq_len=64, dtype="bfloat16",
                                    zero=zero, device="cpu", finetune=ft)["memory"] for ft in (None, lora))
        want = zero_plan(config, dp=4, zero=zero, finetune={**layout.FINETUNE_DEFAULTS, **lora}, prefetch=True)
        assert {k: tuned[k] for k in ("params", "grads", "optimizer")} == want["state"], zero
        assert tuned["grads"] < whole["grads"] / 5 and tuned["params"] >= whole["params"], zero
    a = layout.pick_arch("8B")  # (by formula: the trainable elements' shard)
    whole, tuned = (layout.plan(a, tp=1, dp=8, micro_batch=1, seq_len=512, dtype="bfloat16", zero=3,
                                finetune=ft)["memory"] for ft in (None, dict(lora_rank=16)))
    assert tuned["grads"] < whole["grads"] / 50 and tuned["optimizer"] < whole["optimizer"] / 50
