# tinylm: the README's commands. Each target creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: help install demo test lint bench clean

help:
	@echo "make demo   set up .venv, prepare the built-in corpus, train ~3 min, print samples"
	@echo "make test   set up .venv and run the whole test suite"
	@echo "make lint   ruff check"
	@echo "make bench  run the benchmarks and rewrite their tables in BENCHMARKS.md"

# constraints.txt pins torch==2.13.0 (a CPU build here); pyproject keeps torch>=2.4.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m tinylm demo

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/prepare.py
	$(PY) benchmarks/train.py
	$(PY) benchmarks/sample.py

clean:
	rm -rf $(VENV) build dist .pytest_cache .ruff_cache src/*.egg-info
