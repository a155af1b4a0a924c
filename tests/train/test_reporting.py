"""What a run prints (issue 43): a one-line model summary of its family's fields, and step lines
with the elapsed time, the ETA and the MFU (n/a without a known peak); the metrics file of a
resumed run, the GPU's name, and the tables' cells and formats."""
import json
import sys
import types

import pytest

from cutp.models import GPTConfig
from cutp.train.reporting import (MetricsLog, Progress, Report, Table, gpu_name, human_bytes, known_peak_tflops,
                                  model_summary, parse_count, parse_size, progress_line)


def test_the_summary_holds_only_the_families_fields():
    llama = model_summary(GPTConfig.preset("llama3-8b"))
    assert llama.startswith("32 layers, n_embd 4096, 32 heads (8 KV) of 128, MLP swiglu 14336, RMSNorm, RoPE")
    assert "gelu" not in llama and "MoE" not in llama and "tanh" not in llama and "{" not in llama
    moe = model_summary(GPTConfig.preset("mixtral-8x7b"))
    assert "MoE: 8 swiglu experts of 14336, top-2, dropless" in moe and "MLP" not in moe
    assert "MLP gelu 3072 (tanh), LayerNorm, learned positions" in model_summary(GPTConfig.preset("gpt2"))


def test_step_lines_say_the_time_the_eta_and_the_mfu():
    p = Progress(flops_per_token=1e9, peak_tflops=100.0, ranks=4, start_step=10, end_step=20)
    p.start(0.0)
    base = {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "ms": 1000.0, "comm_mb": 0.0}
    first = p.add({**base, "step": 11, "tokens_per_s": 1e5}, 30.0)  # the first step: warm-ups included
    second = p.add({**base, "step": 12, "tokens_per_s": 2e5}, 40.0)
    assert (first["elapsed_s"], first["eta_s"]) == (30.0, 9 * 30.0)
    assert (second["elapsed_s"], second["eta_s"]) == (40.0, 8 * 10.0)  # the steps after the first
    assert second["mfu"] == 2e5 * 1e9 / (100e12 * 4)
    line = progress_line(second, 20)
    assert line.startswith("step    12/20 |") and "| MFU 50.0% |" in line and line.endswith("0:00:40 elapsed, ETA 0:01:20")
    none = Progress(1e9, None, 1, 0, 5)
    none.start(0.0)
    assert "| MFU n/a |" in progress_line(none.add({**base, "step": 1, "tokens_per_s": 1.0}, 1.0))


def test_the_peak_is_known_for_common_gpus_not_for_the_cpu():
    assert known_peak_tflops("NVIDIA H200", "bfloat16", False) == 989.0
    assert known_peak_tflops("NVIDIA A100-SXM4-80GB", "float32", True) == 156.0
    assert known_peak_tflops(None, "float32", False) is None
    assert known_peak_tflops("NVIDIA H100", "float64", False) is None


def test_tensorboard_scalars_read_back_by_tensorboards_own_loader(tmp_path):
    """The event files --tensorboard writes (tensorboardX), read with tensorboard's EventAccumulator;
    a resumed run drops the events after its step."""
    import pytest

    pytest.importorskip("tensorboardX", reason="the tensorboardX writer is not installed (pip install -e '.[tensorboard]')")
    pytest.importorskip("tensorboard", reason="the tensorboard reader is not installed (the test extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cutp.train.reporting import TensorBoardLog

    rows = [{"step": s, "loss": 5.0 - s, "lr": 1e-3, "grad_norm": 2.0, "ms": 10.0, "tokens_per_s": 100.0 * s,
             "mfu": 0.25, "comm_mb": 1.0, "exposed_comm_ms": 0.5, "moe_aux_loss": 0.01, "moe_dropped": 0.0,
             "moe_tokens_per_expert": [1.0, 2.0, 3.0]} for s in (1, 2, 3)]
    rows[0]["memory"] = {"params": 1000, "activations_peak": 5000, "ranks": 2}
    rows[1]["val_loss"] = 3.5
    log = TensorBoardLog(str(tmp_path), 0)
    for r in rows:
        log.write(r)
    log.close()
    resumed = TensorBoardLog(str(tmp_path), 0, resumed_step=2)  # step 3 again, another loss
    resumed.write({**rows[2], "loss": 1.5})
    resumed.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "val/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "memory/params",
            "memory/activations_peak", "moe/aux_loss", "moe/tokens_per_expert_max", "comm/exposed_ms"} <= tags, tags
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 4.0), (2, 3.0), (3, 1.5)]
    assert [(e.step, e.value) for e in acc.Scalars("val/loss")] == [(2, 3.5)]
    assert [e.value for e in acc.Scalars("perf/tokens_per_s")] == [100.0, 200.0, 300.0]
    assert "memory/ranks" not in tags and TensorBoardLog(str(tmp_path / "x"), 1).writer is None  # rank 0 only


def test_a_resumed_metrics_file_keeps_its_rows_up_to_the_step_and_skips_blank_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3}\n')
    log = MetricsLog(str(path), rank=0, resumed_step=2)
    log.write({"step": 3, "loss": 1.0})
    log.close()
    assert [json.loads(ln) for ln in path.read_text().splitlines()] == [{"step": 1}, {"step": 2},
                                                                        {"step": 3, "loss": 1.0}]


def test_the_gpu_name_comes_from_cupy_and_is_none_where_cupy_cannot_say(monkeypatch):
    assert gpu_name("cpu") is None
    props = {"name": b"NVIDIA H100 80GB HBM3"}
    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceProperties=lambda i: props),
                                 Device=lambda: types.SimpleNamespace(id=0))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    assert gpu_name("cuda") == "NVIDIA H100 80GB HBM3"
    props["name"] = "NVIDIA A100-SXM4-80GB"  # (a str where CuPy gives one)
    assert gpu_name("cuda") == "NVIDIA A100-SXM4-80GB"
    monkeypatch.setitem(sys.modules, "cupy", None)  # not installed
    assert gpu_name("cuda") is None


def test_cells_sizes_and_counts_format_as_the_tables_print_them():
    assert [Table.cell(v, ".2f") for v in (None, float("nan"), float("inf"), -float("inf"), 1.5, True)] == \
        ["-", "-", "inf", "-inf", "1.50", "True"]
    assert [human_bytes(n) for n in (512, 1536, 1 << 20, 3 << 40, 5 << 50)] == \
        ["512 B", "1.5 KiB", "1 MiB", "3 TiB", "5120 TiB"]
    assert (parse_size("4K"), parse_size("1.5GiB"), parse_size("4096")) == (4096, 3 << 29, 4096)
    with pytest.raises(ValueError, match=r"negative size '-1M'"):
        parse_size("-1M")
    assert (parse_count("70B"), parse_count("1.5T"), parse_count("12345")) == (7e10, 1.5e12, 12345.0)


def test_a_report_finds_its_tables_by_name_and_writes_other_values_as_text(tmp_path):
    report = Report("plan")
    report.table("memory", [("what", "what", "", "<")]).add(what="params")
    assert report.get("memory").rows == [{"what": "params"}]
    with pytest.raises(KeyError, match="overlap"):
        report.get("overlap")
    report.extra["where"] = tmp_path  # (a Path: written as its text)
    report.write_json(str(tmp_path / "r.json"))
    assert json.loads((tmp_path / "r.json").read_text())["where"] == str(tmp_path)


def test_the_banners_counts_are_both_of_parameters_and_the_buffers_are_said_apart():
    """(layouts review, F4: "500,544 total, 500,560 on this rank": the rank's count held the
    correction biases, which the total leaves out as transformers does.)"""
    from cutp.models import GPT
    from cutp.train.reporting import parameter_counts
    from tests.tp_utils import self_ctx

    config = GPTConfig.preset("deepseek-tiny").with_overrides(["n_layer=2"])  # (layer 0 dense, one MoE layer)
    model = GPT(self_ctx(), config, seed=0)
    total = config.num_parameters()
    assert model.num_parameters_local() == total + 16  # (what the banner printed as the rank's)
    assert parameter_counts(config, model) == (f"{total:,} total, {total:,} on this rank (vocab padded to 256; the "
                                               "correction biases' 16 values, buffers, not counted)")
    tiny = GPTConfig.preset("tiny").with_overrides(["n_layer=1"])
    n = tiny.num_parameters()
    assert parameter_counts(tiny, GPT(self_ctx(), tiny, seed=0)) == f"{n:,} total, {n:,} on this rank (vocab padded to 256)"


def test_docs_moe_md_names_the_sequence_loss_metric_as_the_metrics_rows_do():
    """(layouts review, F4: docs/moe.md said `seq_aux_loss`; the metrics rows have moe_seq_aux_loss.)"""
    import os
    import re

    from cutp.train.step import StepStats

    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "moe.md")).read()
    named = re.search(r"The step's metrics report it as\s+`(\w+)`", text).group(1)
    row = StepStats(step=1, loss=1.0, grad_norm=1.0, lr=1e-3, skipped=False, ms=1.0, tokens_per_s=1.0, comm_bytes=0,
                    moe={"aux_loss": 0.0, "z_loss": 0.0, "seq_aux_loss": 0.5, "dropped": 0.0}).record()
    assert row.get(named) == 0.5, (named, sorted(row))
