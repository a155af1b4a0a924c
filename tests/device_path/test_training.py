"""Issue 41: the GPU code path (``--device cuda``: CuPy arrays through every op, the kernels,
gemmEx into the gradients, NCCL groups, the communication stream and its events under overlap,
the memory pool) runs on the CPU through the CuPy stand-in and gives the NumPy path's losses and
gradients (float32: 1e-5 normwise; bfloat16: 2e-2), with no race reported; generation with the
sharded KV cache draws the same tokens; a checkpoint moves between the paths bit for bit. A
planted missing event wait, a wrong leading dimension and a missing NCCL group end each fail,
naming the place.
"""
import pytest

from tests.device_path.harness import ON_GPU, OVERLAP, ZERO3, run_device

pytestmark = [pytest.mark.device_path, pytest.mark.usefixtures("emulated_kernels")]
COMPARE = "tests.device_path.harness:worker_compare"
# what only the stand-in sees (make gpu-check runs the rest on a real GPU: CUTP_DEVICE_PATH=gpu)
standin_only = pytest.mark.skipif(ON_GPU, reason="the stand-in's own detectors (races, a missing group end, host "
                                  "syncs counted by place): not observable on a real GPU")


@pytest.mark.device_path_default
def test_llama_tp2_dp2_with_every_overlap_float32_equals_numpy():
    run_device(4, COMPARE, [["llama", "float32", {"tp": 2, "dp": 2}, OVERLAP]])


@pytest.mark.device_path_default
def test_gpt2_pp2_bfloat16_equals_numpy():
    run_device(2, COMPARE, [["gpt2", "bfloat16", {"pp": 2}, {}]])


def test_families_at_tp2_equal_numpy():
    run_device(2, COMPARE, [[f, dtype, {"tp": 2}, {}] for dtype in ("float32", "bfloat16")
                            for f in ("gpt2", "llama", "mixtral", "qwen3")]
               + [[f, "float32", {"tp": 2}, {"dropout": 0.1}] for f in ("gpt2", "llama")])  # the kernels' masks


def test_gemma_at_tp2_equals_numpy():
    run_device(2, COMPARE, [["gemma", dtype, {"tp": 2}, {}] for dtype in ("float32", "bfloat16")])


def test_windows_and_soft_capping_on_the_fused_kernels_equal_numpy():
    """Local layers and capped scores through the fused kernels' mask, one rank and the CP ring."""
    run_device(2, COMPARE, [["windowed", dtype, {"tp": 2}, {}] for dtype in ("float32", "bfloat16")]
               + [["windowed", "float32", {"cp": 2}, {"cp_comm": "ring"}]])


def test_tp2_dp2_overlap_gpt2_and_mixtral_equal_numpy():
    run_device(4, COMPARE, [[f, "float32", {"tp": 2, "dp": 2}, OVERLAP] for f in ("gpt2", "mixtral")]
               + [["llama", "bfloat16", {"tp": 2, "dp": 2}, OVERLAP]])


def test_pp2_cp2_ring_ep2_equal_numpy():
    run_device(2, COMPARE, [["llama", "float32", {"pp": 2}, {}], ["mixtral", "float32", {"pp": 2}, {}],
                            ["gpt2", "float32", {"cp": 2}, {"cp_comm": "ring"}],
                            ["llama", "float32", {"cp": 2}, {"cp_comm": "ring"}],
                            ["mixtral", "float32", {"dp": 2, "ep": 2}, {}]])
    # (not Mixtral in bfloat16 at dp2: its micro-batches hold a token whose two runner-up experts'
    # router probabilities are 2e-5 apart, and bfloat16's rounding upstream picks the other one on
    # each path: a routing discontinuity, not a difference of the paths; at tp2 it passes)


def test_zero_2_and_3_with_their_overlap_equal_numpy():
    """ZeRO-3 gathers each unit before its forward and its backward (resharded between), the next
    step's gathers during the forward, and reduce-scatters the gradient shards during the backward:
    the communication stream's events under all three; ZeRO-2 reduce-scatters every micro-batch."""
    run_device(4, COMPARE, [["llama", "float32", {"tp": 2, "dp": 2}, ZERO3],
                            ["llama", "bfloat16", {"tp": 2, "dp": 2}, ZERO3],
                            ["gpt2", "float32", {"tp": 2, "dp": 2}, {"zero": 2, "overlap_grad_reduce": True}]])


def test_lora_mla_and_packed_rows_equal_numpy():
    """LoRA's adapters on every projection (the base frozen: no gradient on either path); MLA with
    the grouped experts (DeepSeek-V3's block); packed rows (the document mask) through the fused
    attention kernels."""
    run_device(2, COMPARE, [["llama", "float32", {"tp": 2}, {"lora_rank": 4}],
                            ["deepseek", "float32", {"tp": 2}, {}], ["deepseek", "bfloat16", {"tp": 2}, {}],
                            ["llama", "float32", {"tp": 2}, {"pack": True}],
                            ["llama", "bfloat16", {"tp": 2}, {"pack": True}]])


def test_generation_with_the_sharded_kv_cache_draws_the_numpy_paths_tokens():
    run_device(2, "tests.device_path.harness:worker_generate", "llama", "float32")
    run_device(2, "tests.device_path.harness:worker_generate", "gpt2", "float32")


def test_a_device_checkpoint_loads_on_the_cpu_and_back_bit_for_bit(tmp_path):
    proc = run_device(2, "tests.device_path.harness:worker_checkpoint", str(tmp_path), "llama", "float32")
    assert "same bits" in proc.stdout


def test_a_zero3_device_checkpoint_loads_on_the_cpu_and_back_bit_for_bit(tmp_path):
    """ZeRO-3 (each rank's parameter shards, gathered to save) at tp2 x dp2 with its overlap."""
    proc = run_device(4, "tests.device_path.harness:worker_checkpoint", str(tmp_path), "llama", "float32",
                      {"tp": 2, "dp": 2}, ZERO3)
    assert "same bits" in proc.stdout


PLANTED = {  # the bug, the layout it shows in, what the failure must say
    "missing event wait": (4, ["llama", "float32", {"tp": 2, "dp": 2}, OVERLAP],
                           ["RaceError", "does not wait for", "cutp/comm/nccl.py", "cutp/optim/buckets.py"]),
    "wrong leading dimension": (2, ["gpt2", "float32", {"tp": 2}, {}],
                                ["CUBLASError", "gemmEx at cutp/ops/gemm.py", "ldB = "]),
    "missing group end": (2, ["gpt2", "float32", {"pp": 2}, {}],
                          ["was never ended (groupEnd missing)", "in exchange"]),
}


@standin_only
@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_a_planted_bug_fails_naming_the_place(plant):
    n, case, says = PLANTED[plant]
    proc = run_device(n, "tests.device_path.harness:worker_planted", plant, case, expect_failure=True, timeout=120)
    for s in says:
        assert s in proc.stdout, (plant, s, proc.stdout[-3000:])


@standin_only
def test_host_syncs_per_step_are_the_known_ones():
    proc = run_device(4, "tests.device_path.harness:worker_syncs",
                      [["gpt2", "float32", {"tp": 2, "dp": 2}, {}], ["llama", "float32", {"tp": 2, "dp": 2}, OVERLAP],
                       ["mixtral", "float32", {"tp": 2, "dp": 2, "ep": 2}, {}], ["gpt2", "float32", {"pp": 2, "dp": 2}, {"micro_batch_size": 1}],
                       ["mixtral", "float32", {"tp": 2, "dp": 2}, {}],  # (ep 1: the grouped pass's row counts)
                       # two micro-batches: the counting pass, and the routing statistics of 2 x 2 forwards read once
                       ["mixtral", "float32", {"tp": 2, "dp": 2, "ep": 2}, {"micro_batch_size": 1}]])
    print(proc.stdout)
    assert "host syncs of one step" in proc.stdout


MEMORY = [  # tests/plan/test_memory.py's cases, on the device path: the pool's counts against the plan
    dict(tp=2, dp=1, B=4, T=64, dtype="float32", device="cuda"),
    dict(tp=2, dp=1, B=4, T=32, dtype="bfloat16", device="cuda", set=["n_layer=2", "n_kv_head=1", "vocab_size=301"]),
    dict(tp=1, dp=2, B=4, T=64, dtype="bfloat16", distributed=True, device="cuda"),
    dict(preset="llama-tiny", tp=2, dp=1, B=2, T=64, dtype="float32", sequence_parallel=True, device="cuda"),
    dict(tp=2, dp=1, B=2, T=64, dtype="float32", recompute="selective", device="cuda"),
]


def test_measured_memory_equals_the_plan_on_the_device_path():
    """Parameters, gradients and optimizer state exactly, each layer's stash exactly, the step's
    activation peak within 10%: measured through the pool (cutp.train.memory's CuPy hook)."""
    run_device(2, "tests.plan.test_memory:_worker_measured_equals_planned", MEMORY, env={"CUTP_OP_THREADS": "1"})
