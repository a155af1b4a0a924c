from tests.device_path.harness import run_device


def test_gpt2_tp2_float32_device_path_equals_numpy():
    run_device(2, "tests.device_path.harness:worker_compare", [["gpt2", "float32", {"tp": 2}, {}]])
