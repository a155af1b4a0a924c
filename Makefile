# Two commands set up and run everything on a fresh machine with Python 3.11:
#   make train   the default training job (CPU, 2 ranks, tiny preset) on the embedded corpus
#   make test    the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP  := $(VENV)/.installed

.PHONY: test test-device coverage train bench compare-torch gpu-check venv clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpich,test,plot,tokenizers,tensorboard,chat]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The GPU code path (--device cuda) on the CPU: cutp's CuPy code run through the stand-in of
# tests/device_path/standin (kernels in the CUDA emulator, gemmEx from pointers, NCCL over MPI,
# streams with race checks), every configuration of issue 41 (< 15 minutes on 2 cores).
# Results (pytest's junit file, each case's figures) kept in $(DEVICE_OUT)/standin for gpu-check.
DEVICE_OUT ?= out/device-path
test-device: $(STAMP)
	$(PY) tools/device_path_check.py run standin $(DEVICE_OUT)/standin

# Which Python lines of cutp/ and kernels/*.py the whole suite and the device-path tests never
# execute (every process, MPI ranks included); the report names the lines only a GPU runs apart.
# Not part of `make test`. The suite runs in parts (each directory of tests/), each resumable: a
# `make coverage` stopped half-way goes on from the first part not done (COV_FRESH=1 starts over;
# COV_PARTS="device_path ops" runs only those). Data and report in $(COV_OUT).
COV_OUT ?= out/coverage
COV_PARTS ?=
coverage: $(STAMP)
	$(PY) -m pip install -q 'coverage>=7'
	$(PY) tools/coverage_run.py $(COV_OUT) $(if $(COV_FRESH),--fresh) $(if $(COV_PARTS),--parts $(COV_PARTS))
	COV_ROOT=$(CURDIR) $(PY) tools/coverage_report.py $(COV_OUT) | tee $(COV_OUT)/report.txt

# The default job: the tiny GPT on the Python standard library's sources, 2 CPU ranks (TP=2).
TRAIN_OUT ?= out/tiny
train: $(STAMP)
	mkdir -p $(TRAIN_OUT)
	$(MPIEXEC) -n 2 $(PY) examples/train_gpt.py --device cpu --preset tiny --steps 1000 --batch-size 16 \
		--eval-every 100 --save-every 500 --out $(TRAIN_OUT) --metrics $(TRAIN_OUT)/metrics.jsonl --log-every 10
	$(PY) examples/plot_metrics.py $(TRAIN_OUT)/metrics.jsonl $(TRAIN_OUT)/loss.png

# On a lent GPU machine: python3 with cupy, mpi4py, pytest, ... preinstalled, no package registry,
# so no venv and no pip here. GPU kernel tests, a short GPU training run (kernels on and off), the
# 2-rank NCCL checks on one GPU (NCCL >= 2.30), the attention benchmark (fused vs unfused: TFLOP/s,
# speed-up), the kernel benchmark; < 5 minutes. The summary
# goes to stdout and, when OUT is set, to $(OUT)/gpu_check_summary.txt. Then the device-path tests
# on the GPU (CUTP_DEVICE_PATH=gpu) and what differs from the stand-in's run (make test-device's
# results in $(DEVICE_OUT)/standin, else run there first): $(DEVICE_OUT)/summary.txt.
gpu-check:
	PYTHONPATH=$(CURDIR) python3 tools/gpu_check.py; status=$$?; \
	PYTHONPATH=$(CURDIR) python3 tools/device_path_check.py gpu $(DEVICE_OUT) || status=1; exit $$status

# The CPU benchmark suites, all tables on stdout (< 5 minutes on 2 cores); JSON and PNG figures in
# $(BENCH_OUT). compare-torch needs the optional torch (it prints why it skipped otherwise).
BENCH_OUT ?= out/bench
bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(PY) -m cutp bench kernels --device cpu --min-time 0.2 --json $(BENCH_OUT)/kernels.json --plot $(BENCH_OUT)/kernels.png
	$(MPIEXEC) -n 2 $(PY) -m cutp bench comm --device cpu --json $(BENCH_OUT)/comm.json --plot $(BENCH_OUT)/comm.png
	$(MPIEXEC) -n 2 $(PY) -m cutp bench model --device cpu --preset tiny --tp 2 --batch-size 16 --seq-len 128 \
		--json $(BENCH_OUT)/model-tiny-tp2.json --plot $(BENCH_OUT)/model-tiny-tp2.png
	$(PY) -m cutp bench model --device cpu --preset gpt2 --batch-size 4 --seq-len 256 --timed-steps 3 --untimed-steps 1 \
		--json $(BENCH_OUT)/model-gpt2.json --plot $(BENCH_OUT)/model-gpt2.png
	$(PY) -m cutp bench plan --params 70B --tp 8 --dp 4 --json $(BENCH_OUT)/plan-70b.json
	$(MAKE) compare-torch

# cutp's CPU step against torch eager (SDPA), the four presets of issue 44, float32, 2 threads, the
# median of interleaved repeats (losses and gradients checked first): the one command for its table.
COMPARE_REPEAT ?= 7
compare-torch: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(PY) -m cutp bench compare-torch --presets tiny gpt2 llama-tiny llama-gpt2 --threads 2 --repeat $(COMPARE_REPEAT) \
		--json $(BENCH_OUT)/compare-torch.json --plot $(BENCH_OUT)/compare-torch.png

clean:
	rm -rf $(VENV) build dist *.egg-info out
