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

clean:
	rm -rf $(VENV) build dist *.egg-info out
