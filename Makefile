# Set-up and everyday commands. `make test` and `make serve` work on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
MODEL   := .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: install model test lint serve bench clean

# torch goes first, pinned to the CPU wheel; the rest must not replace it.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

$(MODEL): | $(STAMP)
	$(BIN)/python -m services.engine.default_model

model: $(MODEL)

test: $(STAMP) $(MODEL)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

serve: $(STAMP) $(MODEL)
	$(BIN)/python -m services.engine.demo

bench: $(STAMP) $(MODEL)
	$(BIN)/python -m services.bench.offline --workload w1

clean:
	rm -rf $(VENV) .cache .pytest_cache
