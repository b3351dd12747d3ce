#!/usr/bin/env bash
# The GPU check: a few minutes on one CUDA GPU. Prints a report to paste into
# docs/benchmarks.md (section "GPU check").
#
#   scripts/gpu_check.sh                 # PYTHON=... picks the interpreter (default python3)
#
# Needs torch with CUDA, triton, transformers, tokenizers, safetensors and pytest.
# Optional: flash-attn (or vLLM's vllm_flash_attn), nixl-cu12 (NIXL VRAM transfer), gguf
# plus the cached default model (.cache/models/; otherwise a random-weight model of the
# same shapes stands in). Nothing is downloaded.
#
# 1. The tests that need a GPU: Triton kernels compiled for real, CUDA-graph capture and
#    replay, the sampler under CUDA's sync debug mode, NIXL between VRAM tensors.
# 2. scripts/gpu_check.py: kernel errors, greedy equality, step times, W1 throughput.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=".:protos${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
start=$(date +%s)

echo "== machine =="
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY - <<'PY'
import importlib
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
for name in ("triton", "flash_attn", "vllm_flash_attn", "nixl_cu12", "gguf", "transformers"):
    try:
        print(f"  {name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except ImportError:
        print(f"  {name}: not installed")
PY

echo
echo "== tests that need a GPU =="
tests=(tests/unit/test_triton_kernels.py tests/unit/test_sampler.py
       tests/unit/test_backend_selection.py)
select=()
if [ -f .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf ] && $PY -c "import gguf" 2>/dev/null; then
    tests+=(tests/unit/test_cuda_graphs.py)  # these build engines on the default model
else
    echo "(no cached default model: tests that load it are left out)"
    select=(-k "not engine")
fi
$PY -m pytest -q -p no:cacheprovider "${tests[@]}" "${select[@]}" 2>&1 | tail -n 15
if $PY -c "import nixl_cu12" 2>/dev/null; then
    BATON_TEST_KV_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
        tests/integration/test_nixl_connector.py 2>&1 | tail -n 5
else
    echo "nixl_cu12 not installed: the NIXL VRAM transfer is not checked"
fi

$PY scripts/gpu_check.py "$@"
echo
echo "total: $(( $(date +%s) - start )) s"
