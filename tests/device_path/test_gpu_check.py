"""`make gpu-check`'s summary of the device-path tests (tools/device_path_check.py), checked on two
stand-in runs (no GPU needed): pytest's own junit files of the same test ids (the second run with
one test failing and one skipped), and the figures files the harness's `record` writes."""
import os
import runpy
import subprocess
import sys

import pytest

from tests.device_path import harness
from tests.mpirun import ROOT

TESTS = '''
import os
import pytest

def test_llama_equals_numpy():
    pass

def test_gpt2_equals_numpy():
    assert os.environ.get("BREAK") != "1", "loss 3.2 on the device path, 3.1 on NumPy's"

@pytest.mark.skipif(os.environ.get("BREAK") == "1", reason="the stand-in's own detectors")
def test_planted_race():
    pass
'''


def _pytest(tmp_path, name, broken):
    """pytest on TESTS writing its junit file to tmp_path/name (started, not waited for)."""
    (tmp_path / name).mkdir()
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_case.py",
                             f"--junitxml={tmp_path / name / 'junit.xml'}"], cwd=tmp_path,
                            env=dict(os.environ, BREAK=broken), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _results(tmp_path, monkeypatch, name, backend, figures):
    out = tmp_path / name
    (out / "backend").write_text(backend)
    monkeypatch.setenv(harness.FIGURES, str(out / "figures.jsonl"))
    for case, values in figures.items():
        harness.record(case, **values)
    return str(out)


def test_the_summary_names_what_differs_between_two_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "test_case.py").write_text(TESTS)
    for run in [_pytest(tmp_path, "a", "0"), _pytest(tmp_path, "b", "1")]:  # (side by side)
        run.wait()
    a = _results(tmp_path, monkeypatch, "a", "standin",
                 {"llama float32": dict(losses=[4.0, 3.5], grad_norm=2.0, kernel_launches=120),
                  "gpt2 pp2": dict(losses=[4.1], grad_norm=1.0)})
    b = _results(tmp_path, monkeypatch, "b", "gpu",
                 {"llama float32": dict(losses=[4.0, 3.5000035], grad_norm=2.0),
                  "mixtral ep2": dict(losses=[4.2])})
    main = runpy.run_path(os.path.join(ROOT, "tools", "device_path_check.py"))["main"]
    assert main(["diff", a, a]) == 0
    assert "no test that passed on stand-in fails on stand-in" in capsys.readouterr().out
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    assert "3 test ids; same outcome 1; different 2" in out, out
    assert "stand-in: 3 passed, 0 failed, 0 skipped" in out and "GPU: 1 passed, 1 failed, 1 skipped" in out, out
    assert "test_case.py::test_gpt2_equals_numpy: passed -> failed  [AssertionError: loss 3.2 on the device path" \
           in out, out
    assert "test_case.py::test_planted_race: passed -> skipped  [the stand-in's own detectors]" in out, out
    assert "losses: [4.0, 3.5] | [4.0, 3.5000035] (largest relative difference 1.0e-06)" in out, out
    assert "grad_norm: 2 | 2 (equal)" in out and "only stand-in records: kernel_launches" in out, out
    assert "cases only stand-in ran: gpt2 pp2" in out and "cases only GPU ran: mixtral ep2" in out, out
    assert "2 test(s) that passed on stand-in do not pass on GPU" in out, out
    assert main(["diff", a, str(tmp_path / "none")]) == 2
    assert "no results in" in capsys.readouterr().out


def test_the_gpu_s_run_without_a_usable_gpu_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """(review F13) It ran the tests, 70 s of them failing on `import cupy`."""
    from cutp.runtime import backend

    main = runpy.run_path(os.path.join(ROOT, "tools", "device_path_check.py"))["main"]
    monkeypatch.setattr(backend, "cupy_status", lambda: (False, "cupy does not import (test)"))
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("ran the tests"))
    for argv in (["run", "gpu", str(tmp_path / "gpu")], ["gpu", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == ("device_path_check: no usable GPU here: cupy does not import (test); the stand-in runs the "
                       "same tests without one: python tools/device_path_check.py run standin OUT\n"), err
    assert not os.listdir(tmp_path)
