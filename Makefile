# tinylm: the README's commands. Each target creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: help install browser demo test lint bench clean

help:
	@echo "make demo   set up .venv, prepare the built-in corpus, train ~3 min, print samples"
	@echo "make test   set up .venv (and Chromium for the browser tests) and run the whole test suite"
	@echo "make lint   ruff check"
	@echo "make bench  run the benchmarks and rewrite their tables in BENCHMARKS.md"

# constraints.txt pins torch==2.13.0 (a CPU build here); pyproject keeps torch>=2.4.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[dev,serve]'
	@touch $(STAMP)

install: $(STAMP)

# The real-browser tests drive Debian's Chromium (/usr/bin/chromium) through Playwright,
# which is pointed at it and never downloads a browser. Installed once, as root, when
# missing (a fresh Debian CI machine); a no-op where it is already there.
browser:
	@test -x /usr/bin/chromium || { apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

# data/ and runs/ are gitignored. The run is replaced on each `make demo`.
demo: $(STAMP)
	$(PY) -m tinylm prepare --corpus python-docs --tokenizer bpe --vocab-size 1024 \
		--out data/python-docs-bpe
	rm -rf runs/demo
	$(PY) -m tinylm train --data data/python-docs-bpe --out runs/demo --config configs/demo.toml
	$(PY) -m tinylm sample --model runs/demo --prompt "The" --num-samples 3 \
		--max-new-tokens 100 --temperature 0.8 --seed 0
	@echo "loss curve: runs/demo/loss.png"

test: $(STAMP) browser
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
