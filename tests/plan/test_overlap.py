"""Issue 30: the planner's expected exposed DP communication (cutp.plan.overlap)."""
import pytest

from cutp.plan import cli
from cutp.plan.layout import ARCHITECTURES, param_count
from cutp.plan.overlap import backward_units, expected_exposed


def test_without_overlap_everything_is_exposed_and_with_it_only_what_ends_after_the_backward():
    # three units of 1 GFLOP forward each (2 ms backward at 1 TFLOP/s), 1M elements final after each
    units = [("head", 1_000_000, 1e9), ("layer 0", 1_000_000, 1e9), ("embeddings", 1_000_000, 1e9)]
    r = expected_exposed(units, dp=2, bucket_size=1_000_000, bandwidth_gbs=1.0, latency_us=0.0, device_tflops=1.0,
                         distributed_optimizer=False)
    # each bucket: 4 MB x 2 (2-1)/2 = 4 MB at 1 GB/s = 4 ms on the link, one after another
    assert r["buckets"] == 3 and r["link_ms"] == pytest.approx(12.0) and r["backward_ms"] == pytest.approx(6.0)
    assert r["exposed_ms_without_overlap"] == pytest.approx(12.0)
    # buckets ready at 2, 4, 6 ms; the link busy 2-6, 6-10, 10-14: 8 ms after the backward's end
    assert r["exposed_ms_with_overlap"] == pytest.approx(8.0) and r["overlap_fraction"] == pytest.approx(1 / 3)
    zero = expected_exposed(units, dp=2, bucket_size=1_000_000, bandwidth_gbs=1.0, latency_us=0.0, device_tflops=1.0,
                            distributed_optimizer=True)  # a reduce: half the all-reduce's wire bytes
    assert zero["link_ms"] == pytest.approx(6.0) and zero["exposed_ms_with_overlap"] == pytest.approx(2.0)


def test_units_cover_every_parameter_of_the_rank_and_the_tied_table_comes_last():
    a = ARCHITECTURES["175B"]
    units = backward_units(a, 8, 1, 2048, param_count)
    assert [u[0] for u in units[:2]] == ["head + final norm", "layer 95"] and units[-1][0] == "embeddings"
    assert sum(u[1] for u in units) == param_count(a, 8)["per_rank"]


def test_a_link_without_a_device_throughput_is_refused_before_any_planning(capsys):
    assert cli.main(["--params", "7B", "--dp", "2", "--link-bandwidth", "25"]) == 2
    assert "--link-bandwidth needs --device-tflops" in capsys.readouterr().err
