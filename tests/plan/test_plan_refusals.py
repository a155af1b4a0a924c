"""The planner's refusals and paths the rest of the suite never reaches (cutp.plan), in process:
each refused setting ends `python -m cutp plan` with exit code 2 and one line naming the flag and
the fix; the API's own checks (`plan`, `check_cp`, `check_pipeline`, `planned_step`) for what the
command line's choices already exclude; the expected exposed DP communication of
--link-bandwidth, whose buckets hold every gradient byte of the memory table; the ZeRO-3 setup
note; the search's layouts where a TP does not split the heads or the sequence; and
`python -m cutp.plan` itself."""
import json
import runpy
import sys

import pytest

from cutp.models import GPTConfig
from cutp.plan import layout
from cutp.plan.cli import main
from cutp.plan.context import check_cp
from cutp.plan.finetune import spec_and_groups
from cutp.plan.moe import check_moe_layout, moe_counts
from cutp.plan.pipeline import check_pipeline
from cutp.plan.run import planned_step
from cutp.plan.search import _zero2_may_fit
from cutp.plan.zero import gathered_units_bytes
from cutp.runtime.errors import ConfigError


def _plan(capsys, *argv):
    rc = main([*argv, "--quiet"])
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("argv, message", [
    (("--params", "7B", "--search", "--lora-rank", "8"), "--search with --lora-rank or --freeze: the search plans "
                                                         "full training only"),
    (("--params", "7B", "--preset", "tiny"), "give --params or --preset, not both"),
    (("--preset", "tiny", "--tp", "1", "--dp", "2", "--ep", "2"),
     "--ep 2: the model has no experts (n_experts=0); drop --ep or --set n_experts=N"),
    # training's refusals, in its words (cutp.train.zero)
    (("--preset", "tiny", "--tp", "1", "--dp", "4", "--zero", "3", "--bucket-size", "1000"),
     "--bucket-size cuts the gradient buckets of zero 0 and 1, and zero 3 reduces unit by unit; omit --bucket-size, "
     "or use --zero 1"),
    (("--preset", "tiny", "--tp", "1", "--dp", "4", "--zero", "3", "--distributed-optimizer"),
     "--distributed-optimizer is zero 1, and --zero 3 is given too: two ZeRO stages; omit --distributed-optimizer"),
    (("--preset", "tiny", "--tp", "1", "--dp", "4", "--zero", "2", "--overlap-param-gather"),
     "--overlap-param-gather prefetches the parameter gathers of zero 3"),
    # --batch-size: the micro-batches training derives from it, or what would do
    (("--preset", "tiny", "--tp", "1", "--dp", "4", "--batch-size", "10"),
     "--batch-size 10 is not a multiple of --dp 4 x --micro-batch-size 1 = 4 (a step runs batch / (dp x "
     "micro-batch) micro-batches per DP rank); use --batch-size 8 or 12"),
    (("--preset", "tiny", "--tp", "1", "--dp", "4", "--batch-size", "8", "--accum", "3"),
     "--batch-size 8 at --dp 4 x --micro-batch-size 1 is 2 micro-batches per step, and --accum 3 is given; give one "
     "of them"),
    (("--preset", "tiny-moe", "--tp", "1", "--freeze", "layers.0.*,mlp"),
     "freeze 'layers.0.*': the plan of an MoE model counts its experts by formula and matches groups only"),
    # a traceback of float() before (found by a review helper, F6)
    (("--params", "abc"), "--params 'abc' is not a parameter count; give one of 7B, 8B, 13B, 70B, 175B (or e.g. 7e9)"),
    # a size the planner has no architecture of planned the nearest one (124M: Llama-2-7B; review F4)
    (("--params", "124M"), "--params 124M: the planner knows the architectures of 7B, 8B, 13B, 70B, 175B; for another "
                           "model give --preset NAME"),
    (("--params", "1T"), "--params 1T: the planner knows the architectures of 7B, 8B, 13B, 70B, 175B"),
    (("--params", "30B"), "--params 30B: the planner knows"),
    # numbers no plan takes (review F5, F8): a division by zero, negative times, --seq-len 0 planned 4096
    (("--params", "7B", "--dp", "2", "--link-bandwidth", "0", "--device-tflops", "100"),
     "--link-bandwidth 0: a link moves more than 0 GB/s"),
    (("--params", "7B", "--dp", "2", "--link-bandwidth", "-1", "--device-tflops", "100"),
     "--link-bandwidth -1: a link moves more than 0 GB/s"),
    (("--params", "7B", "--dp", "2", "--link-bandwidth", "50", "--device-tflops", "0"), "--device-tflops 0: give the"),
    (("--params", "7B", "--dp", "2", "--link-bandwidth", "50", "--link-latency", "-1", "--device-tflops", "10"),
     "--link-latency -1: a latency is >= 0 us"),
    (("--params", "7B", "--dp", "2", "--device-tflops", "100"), "no --link-bandwidth is given; give --link-bandwidth"),
    (("--params", "7B", "--seq-len", "0"), "--seq-len must be an integer >= 1, got 0"),
    (("--params", "7B", "--batch-size", "0"), "--batch-size must be an integer >= 1, got 0"),
    (("--params", "7B", "--markdown"), "--markdown prints --search's table of layouts; add --search"),
    (("--params", "0"), "--params '0' is not a parameter count"),
    (("--preset", "tiny", "--set", "n_layer=abc"), "--set 'n_layer=abc': 'abc' is not a value of n_layer (int)"),
])
def test_a_setting_the_plan_cannot_take_is_refused_in_one_line(capsys, argv, message):
    rc, err = _plan(capsys, *argv)
    assert rc == 2 and "\n" not in err and message in err, err


@pytest.mark.parametrize("extra, micro, accum", [
    ((), 8, 1),  # training runs the per-DP batch at once (it planned micro-batch 1, 8 of them)
    (("--dp", "2"), 4, 1),
    (("--accum", "4"), 2, 4),
    (("--micro-batch-size", "2"), 2, 4),
])
def test_batch_size_without_micro_batch_size_plans_training_s_micro_batch(tmp_path, extra, micro, accum):
    out = tmp_path / "plan.json"
    assert main(["--preset", "llama-tiny", "--set", "n_layer=2", "--tp", "1", "--batch-size", "8", "--seq-len", "16",
                 *extra, "--json", str(out), "--quiet"]) == 0
    r = json.loads(out.read_text())["plan"]
    assert (r["micro_batch"], r["accum"]) == (micro, accum)


def test_batch_size_at_pp_plans_training_s_micro_batch(tmp_path):
    from cutp.train.defaults import default_micro_batch
    out = tmp_path / "plan.json"
    assert main(["--preset", "llama-tiny", "--tp", "1", "--pp", "2", "--batch-size", "8", "--seq-len", "16",
                 "--json", str(out), "--quiet"]) == 0
    r = json.loads(out.read_text())["plan"]
    assert r["micro_batches"] * default_micro_batch(8, 2, "1f1b") == 8 and r["micro_batches"] > 1


def test_help_states_the_planner_s_own_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: bfloat16, training's with fp32 master weights" in out
    assert "(default: float32" not in out and "gpt2 on GPUs" not in out and "(default: 8, rounded" not in out
    assert "(default: the model's block size)" in out


def test_the_api_refuses_what_the_command_line_s_choices_exclude():
    a = GPTConfig.preset("tiny")
    common = dict(tp=1, dp=1, micro_batch=1, seq_len=16)
    for change, message in ((dict(device="tpu"), r"--device 'tpu': use cuda or cpu"),
                            (dict(dtype="int8"), r"--dtype 'int8': use one of \['float32', "),
                            (dict(precision="half"), r"--precision 'half': use one of \['fp32', 'mixed'\]"),
                            (dict(threads=0), r"--threads must be an integer >= 1, got 0")):
        with pytest.raises(ConfigError, match=message):
            layout.plan(a, **{**common, **change})
    for change, message in ((dict(cp=0), r"--cp must be an integer >= 1, got 0"),
                            (dict(cp_comm="tree"), r"--cp-comm 'tree': use one of ring, a2a")):
        with pytest.raises(ConfigError, match=message):
            check_cp(a, **{**dict(cp=2, cp_comm="ring", tp=1, seq_len=16, sequence_parallel=False), **change})
    with pytest.raises(ConfigError, match=r"--pp-schedule 'zigzag': use one of "):
        check_pipeline(n_layer=4, pp=2, m=4, schedule="zigzag")
    with pytest.raises(ConfigError, match=r"planned_step does not follow MoE routing .* planned by formula"):
        planned_step(GPTConfig.preset("tiny-moe"), tp=1, dp=1, micro_batch=1, seq_len=16)


def test_a_link_s_exposed_communication_covers_every_gradient_byte(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["--params", "7B", "--tp", "8", "--dp", "4", "--link-bandwidth", "50", "--device-tflops", "400",
                 "--json", str(out), "--quiet"]) == 0
    d = json.loads(out.read_text())
    r, rows = d["overlap"], {row["what"]: row["v"] for row in d["tables"]["overlap"]["rows"]}
    grads = next(row["gb"] for row in d["tables"]["memory"]["rows"] if row["what"] == "gradients")
    assert sum(r["bucket_bytes"]) == round(grads * 1e9) and len(r["bucket_bytes"]) == r["buckets"] > 1
    # each bucket: 5 us, then its fp32 gradients' all-reduce (2 (dp-1)/dp of them) at 50 GB/s
    assert r["link_ms"] == pytest.approx(r["buckets"] * 5e-3 + sum(r["bucket_bytes"]) * 1.5 / 50e9 * 1e3)
    assert r["exposed_ms_with_overlap"] < r["exposed_ms_without_overlap"] == r["link_ms"]
    assert rows["link time"] == f"{r['link_ms']:,.2f} ms per step" and rows["buckets"].startswith(f"{r['buckets']} of")


def test_zero_3_notes_its_setup(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["--preset", "llama-tiny", "--set", "n_layer=2", "--tp", "1", "--dp", "2", "--zero", "3", "--seq-len", "16",
                 "--device", "cpu",
                 "--dtype", "float32", "--json", str(out), "--quiet"]) == 0
    notes = json.loads(out.read_text())["tables"]["memory"]["notes"]
    assert any(n.startswith("setup (zero 3, built unit by unit): at most ") for n in notes), notes


def test_a2a_context_parallelism_says_its_traffic(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["--params", "8B", "--tp", "8", "--cp", "2", "--cp-comm", "a2a", "--seq-len", "8192", "--json",
                 str(out), "--quiet"]) == 0
    comm = json.loads(out.read_text())["tables"]["comm"]["rows"]
    assert any("(cp-1)/cp of them leaving" in row["formula"] for row in comm), comm


def test_the_search_skips_the_tps_that_do_not_split_the_model_or_the_sequence(tmp_path):
    out = tmp_path / "search.json"
    assert main(["--params", "7B", "--set", "mlp_hidden=11010", "--search", "--gpus", "4", "--seq-len", "4097",
                 "--json", str(out), "--quiet"]) == 0
    rows = json.loads(out.read_text())["search"]
    # tp 2 does not split 4097 tokens (sequence parallelism), tp 4 not the MLP's 11010, tp 8 is more than 4 GPUs
    assert {row["tp"] for row in rows} == {1} and len(rows) == 3
    assert _zero2_may_fit(None, 4, 80e9)  # (no ZeRO-1 plan to compare with: ZeRO-2 is tried)


def test_python_m_cutp_plan_runs_the_planner(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["python -m cutp.plan", "--params", "7B", "--tp", "8", "--quiet"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("cutp.plan", run_name="__main__", alter_sys=False)
    assert e.value.code == 0


def test_auto_plans_the_gpu_path(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["--params", "7B", "--tp", "8", "--device", "auto", "--json", str(out), "--quiet"]) == 0
    cuda = tmp_path / "cuda.json"
    assert main(["--params", "7B", "--tp", "8", "--device", "cuda", "--json", str(cuda), "--quiet"]) == 0
    assert json.loads(out.read_text())["tables"] == json.loads(cuda.read_text())["tables"]


def test_api_helpers_at_their_edges(monkeypatch):
    with pytest.raises(ConfigError, match=r"--ep must be an integer >= 1, got 0"):
        check_moe_layout(GPTConfig.preset("tiny-moe"), 0, 1)
    dense = GPTConfig.preset("tiny-moe", moe_dense_layers=(0, 1, 2, 3))  # experts declared, every layer dense
    assert moe_counts(dense)["total"] == 0 and layout.param_count(dense, 1, 1)["total"] == dense.num_parameters()
    assert spec_and_groups(None) == (None, ())
    monkeypatch.setattr(layout, "_PARAM_COUNTS", {})
    tiny = GPTConfig.preset("tiny")
    first = layout.param_count(tiny, 1, 1)
    for n in range(255):  # with 255 others the cache is full; the next new one empties it first
        layout.param_count(GPTConfig.preset("tiny", vocab_size=300 + n), 1, 1)
    assert len(layout._PARAM_COUNTS) == 256 and layout.param_count(tiny, 1, 1) == first
    layout.param_count(tiny, 2, 1)
    assert len(layout._PARAM_COUNTS) == 1


def test_a_frozen_moe_model_and_a_float32_mla_model_are_planned(capsys, tmp_path):
    rc, err = _plan(capsys, "--preset", "tiny-moe", "--tp", "1", "--freeze", "attention", "--seq-len", "16",
                    "--device", "cpu")
    assert rc == 0, err
    mla = ["--params", "7B", "--set", "kv_lora_rank=512", "--set", "qk_nope_head_dim=128", "--set",
           "qk_rope_head_dim=64", "--set", "v_head_dim=128"]
    stash = {}
    for dtype in ("float32", "bfloat16"):
        assert main([*mla, "--dtype", dtype, "--json", str(tmp_path / f"{dtype}.json"), "--quiet"]) == 0
        stash[dtype] = json.loads((tmp_path / f"{dtype}.json").read_text())["plan"]["activations"]["stash_per_layer"][0]
    # float32 activations twice bfloat16's, but for the 1-byte dropout masks (float32: not quite twice)
    assert stash["bfloat16"] < stash["float32"] < 2 * stash["bfloat16"]


def test_a_zero_3_pipeline_stage_of_a_params_model_holds_its_gathered_units(tmp_path):
    """(A regression: fine-tuning by stage put this under `if finetune:`, where no --params model
    reaches, so a --params ZeRO-3 stage's peak left out the units it gathers.)"""
    stages = {}
    for zero in (2, 3):
        out = tmp_path / f"zero{zero}.json"
        assert main(["--params", "7B", "--tp", "8", "--dp", "2", "--pp", "2", "--zero", str(zero), "--json", str(out),
                     "--quiet"]) == 0
        stages[zero] = json.loads(out.read_text())["plan"]["stages"]
    a = layout.pick_arch("7B")
    for two, three in zip(stages[2], stages[3]):
        units = gathered_units_bytes(layout.param_count(a, 8, 1)["layer_per_rank"], three["params_local"],
                                     dtype="bfloat16")
        assert units > 0 and three["activations"]["bytes"] == two["activations"]["bytes"] + units
