# Two commands set up and run everything on a fresh machine with Python 3.11:
#   make train   the default training job (CPU, 2 ranks, tiny preset) on the embedded corpus
#   make test    the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP  := $(VENV)/.installed

.PHONY: test train bench gpu-check venv clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpich,test,plot]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# The default job: the tiny GPT on the Python standard library's sources, 2 CPU ranks (TP=2).
TRAIN_OUT ?= out/tiny
train: $(STAMP)
	mkdir -p $(TRAIN_OUT)
	$(MPIEXEC) -n 2 $(PY) examples/train_gpt.py --device cpu --preset tiny --steps 1000 --batch-size 16 \
		--eval-every 100 --save-every 500 --out $(TRAIN_OUT) --metrics $(TRAIN_OUT)/metrics.jsonl --log-every 10
	$(PY) examples/plot_metrics.py $(TRAIN_OUT)/metrics.jsonl $(TRAIN_OUT)/loss.png

clean:
	rm -rf $(VENV) build dist *.egg-info out
