#!/usr/bin/env bash
# One GPU node, trainer and rollout server side by side:
#   launch/single_node_gpu.sh CONFIG [--config.overrides ...]
# e.g. on 8 GPUs (defaults): the rollout server (vLLM) on GPU 7, the trainer's mesh on GPUs 0-6. The step's rows
# must split over the trainer's devices: the 4B config's 64 prompts x 16 samples = 1024 rows do not divide by 7,
# so give it 56 prompts (896 rows), or 4 trainer GPUs (TRAINER_GPUS=0,1,2,3):
#   launch/single_node_gpu.sh configs/qwen3_4b_dapo_lr_decay.py --config.trainer.mesh.fsdp=-1 \
#       --config.trainer.mesh.data=1 --config.batch.prompts_per_step=56
#
# CONFIG (FILE or FILE:VARIANT, as `train --config`) and a relative TOKEN_FILE are taken from the directory you
# run the script from; the server and the trainer then run in the repo root (a relative model.path is the repo's).
#
# Environment (all optional; each is checked before anything starts: one line naming it, exit 2):
#   TRAINER_GPUS    comma list of GPU indices for the trainer's mesh (CUDA_VISIBLE_DEVICES); default: all but
#                   the last GPU
#   ROLLOUT_GPU     the rollout server's GPU index (one: the engines serve from one device); default: the last
#                   GPU. With one GPU on the node both default to GPU 0, shared (see the memory split below).
#   ROLLOUT_ENGINE  vllm | jax; ROLLOUT_DTYPE  bfloat16 | float16 | float32: the server's engine and precision,
#                   by default the config's rollout.engine and rollout.dtype; when set, also given to the trainer
#                   (--config.rollout.engine/dtype), whose run record then says what the server serves. The
#                   server's weight quantization and context limit are the config's rollout.quantize and
#                   rollout.max_model_len
#   ROLLOUT_MEM     fraction in (0, 1] of the rollout GPU the server may use: vLLM's gpu_memory_utilization
#                   (serve --gpu-memory-utilization), or the JAX engine's XLA_PYTHON_CLIENT_MEM_FRACTION;
#                   default 0.90 alone on its GPU, 0.45 when shared
#   TRAINER_MEM     fraction in (0, 1]: XLA_PYTHON_CLIENT_MEM_FRACTION of the trainer; default 0.90 alone, 0.45
#                   when shared
#   PORT            gRPC port of the server (loopback), 1-65535; default 50051
#   TOKEN_FILE      shared token for weight pushes; generated (mode 600) if missing, refused if it exists but is
#                   empty; default rollout_token in the repo root
#
# Memory: JAX preallocates 75 % of every visible GPU at start-up by default, which would leave a co-located
# vLLM nothing. The trainer therefore runs with XLA_PYTHON_CLIENT_MEM_FRACTION=$TRAINER_MEM, and, when it
# shares a GPU with the server, XLA_PYTHON_CLIENT_PREALLOCATE=false (allocate on demand, up to that fraction).
# The server starts first and takes its share before the trainer allocates anything.
# Needs the GPU stack: bash scripts/setup_gpu.sh.
#
# Signals: SIGTERM, SIGINT or SIGHUP to the launcher is passed to the trainer as SIGTERM (it writes a checkpoint
# and exits 143); the launcher waits for it, then stops the rollout server and exits with the trainer's code.
set -euo pipefail
me=single_node_gpu.sh
die() { echo "$me: $*" >&2; exit 2; }
if [ $# -lt 1 ] || [ -z "$1" ]; then
  echo "usage: launch/single_node_gpu.sh CONFIG[:VARIANT] [--config.overrides ...]" >&2
  exit 2
fi
config=$1
shift
# Relative paths are the caller's: resolve them before the cd below (CONFIG's path part; a :VARIANT stays).
case "$config" in /*) ;; *) config="$PWD/$config" ;; esac
repo=$(cd "$(dirname "$0")/.." && pwd)
TOKEN_FILE=${TOKEN_FILE:-$repo/rollout_token}
case "$TOKEN_FILE" in /*) ;; *) TOKEN_FILE="$PWD/$TOKEN_FILE" ;; esac

fraction='^(0*\.[0-9]*[1-9][0-9]*|0*1(\.0*)?)$'  # a decimal number in (0, 1]
gpu_index='^(0|[1-9][0-9]*)$'
rollout_overrides=()  # ROLLOUT_ENGINE / ROLLOUT_DTYPE given: the trainer's config says the same
if [ -n "${ROLLOUT_ENGINE:-}" ]; then
  case "$ROLLOUT_ENGINE" in vllm|jax) ;; *) die "ROLLOUT_ENGINE must be vllm or jax, got '$ROLLOUT_ENGINE'" ;; esac
  rollout_overrides+=(--config.rollout.engine="$ROLLOUT_ENGINE")
fi
if [ -n "${ROLLOUT_DTYPE:-}" ]; then
  case "$ROLLOUT_DTYPE" in bfloat16|float16|float32) ;;
    *) die "ROLLOUT_DTYPE must be bfloat16, float16 or float32, got '$ROLLOUT_DTYPE'" ;; esac
  rollout_overrides+=(--config.rollout.dtype="$ROLLOUT_DTYPE")
fi
PORT=${PORT:-50051}
if ! [[ $PORT =~ ^[1-9][0-9]{0,4}$ ]] || [ "$PORT" -gt 65535 ]; then
  die "PORT must be an integer in 1-65535, got '$PORT'"
fi
for var in ROLLOUT_MEM TRAINER_MEM; do
  if [ -n "${!var:-}" ] && ! [[ ${!var} =~ $fraction ]]; then
    die "$var must be a number in (0, 1] (e.g. 0.45), got '${!var}'"
  fi
done
if [ -n "${TRAINER_GPUS:-}" ] && ! [[ $TRAINER_GPUS =~ ^(0|[1-9][0-9]*)(,(0|[1-9][0-9]*))*$ ]]; then
  die "TRAINER_GPUS must be a comma list of GPU indices (e.g. 0,1,2), got '$TRAINER_GPUS'"
fi
if [ -n "${ROLLOUT_GPU:-}" ] && ! [[ $ROLLOUT_GPU =~ $gpu_index ]]; then
  die "ROLLOUT_GPU takes one GPU index (the engines serve from one device), got '$ROLLOUT_GPU'"
fi
if [ -e "$TOKEN_FILE" ] && [ ! -s "$TOKEN_FILE" ]; then
  die "TOKEN_FILE '$TOKEN_FILE' exists but is empty; remove it (a token is generated) or put the token in it"
fi
[ -d "$(dirname "$TOKEN_FILE")" ] || die "TOKEN_FILE '$TOKEN_FILE': no such directory '$(dirname "$TOKEN_FILE")'"

cd "$repo"
[ -x .venv/bin/python ] || die ".venv/bin/python: missing; set up the GPU stack first (bash scripts/setup_gpu.sh)"
command -v nvidia-smi >/dev/null 2>&1 || die "nvidia-smi: not found; this launcher needs an NVIDIA GPU node"
# nvidia-smi's own exit status counts (a process substitution would lose it), and each line must be an index.
listing=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null) \
  || die "nvidia-smi --query-gpu=index failed; check the NVIDIA driver (nvidia-smi -L)"
all_gpus=()
while IFS= read -r line; do
  line=${line//[[:space:]]/}
  [ -n "$line" ] || continue
  [[ $line =~ $gpu_index ]] || die "nvidia-smi --query-gpu=index printed '$line', not a GPU index; check the NVIDIA driver"
  all_gpus+=("$line")
done <<< "$listing"
n=${#all_gpus[@]}
[ "$n" -gt 0 ] || die "nvidia-smi lists no GPU"
if [ "$n" -eq 1 ]; then
  default_trainer=${all_gpus[0]}
  default_rollout=${all_gpus[0]}
else
  default_trainer=$(IFS=,; echo "${all_gpus[*]:0:n-1}")
  default_rollout=${all_gpus[n-1]}
fi
TRAINER_GPUS=${TRAINER_GPUS:-$default_trainer}
ROLLOUT_GPU=${ROLLOUT_GPU:-$default_rollout}
listed=",$(IFS=,; echo "${all_gpus[*]}"),"
IFS=, read -ra trainer_list <<< "$TRAINER_GPUS"
for g in "${trainer_list[@]}"; do
  case "$listed" in *",$g,"*) ;; *) die "TRAINER_GPUS: GPU $g is not on this node (nvidia-smi lists ${listed:1:-1})" ;; esac
done
case "$listed" in *",$ROLLOUT_GPU,"*) ;; *) die "ROLLOUT_GPU: GPU $ROLLOUT_GPU is not on this node (nvidia-smi lists ${listed:1:-1})" ;; esac
case ",$TRAINER_GPUS," in *",$ROLLOUT_GPU,"*) shared=1 ;; *) shared=0 ;; esac
if [ "$shared" -eq 1 ]; then
  ROLLOUT_MEM=${ROLLOUT_MEM:-0.45}
  TRAINER_MEM=${TRAINER_MEM:-0.45}
else
  ROLLOUT_MEM=${ROLLOUT_MEM:-0.90}
  TRAINER_MEM=${TRAINER_MEM:-0.90}
fi

# The checkpoint the server starts from: the config's model.path after the overrides (as `train` reads them),
# loaded by the project's own config loader; a bad config or override is one line naming it, exit 2.
line=$(.venv/bin/python launch/config_model_path.py \
  --fields model.path,rollout.engine,rollout.dtype,rollout.quantize,rollout.max_model_len "$me" "$config" \
  ${rollout_overrides[@]+"${rollout_overrides[@]}"} "$@")
line=${line##*$'\n'}  # the last line: whatever get_config() printed comes before it
IFS=$'\t' read -r model ROLLOUT_ENGINE ROLLOUT_DTYPE quantize max_model_len <<< "$line"
[ -f "$model/config.json" ] || die "model.path '$model' holds no HF checkpoint (config.json); set --config.model.path"
if [ ! -s "$TOKEN_FILE" ]; then
  (umask 077; python3 -c "import secrets; print(secrets.token_hex(32))" > "$TOKEN_FILE")
fi

ready=$(mktemp -u /tmp/rollout_ready.XXXXXX)
platforms=${JAX_PLATFORMS:-cuda}  # fail loudly rather than fall back to the CPU when CUDA is broken
server_env=(CUDA_VISIBLE_DEVICES="$ROLLOUT_GPU" JAX_PLATFORMS="$platforms")
# The config's weight quantization and context limit too, as the trainer's own server gets them (the trainer
# refuses a server of another quantization: that was after the server had loaded, up to 20 minutes in).
serve_args=(--engine "$ROLLOUT_ENGINE" --model "$model" --dtype "$ROLLOUT_DTYPE" --quantize "$quantize" --port "$PORT"
            --token-file "$TOKEN_FILE" --ready-file "$ready")
if [ "$max_model_len" != 0 ]; then serve_args+=(--max-model-len "$max_model_len"); fi
if [ "$ROLLOUT_ENGINE" = jax ]; then
  server_env+=(XLA_PYTHON_CLIENT_MEM_FRACTION="$ROLLOUT_MEM")
  [ "$shared" -eq 1 ] && server_env+=(XLA_PYTHON_CLIENT_PREALLOCATE=false)
else
  serve_args+=(--gpu-memory-utilization "$ROLLOUT_MEM")
fi

echo "rollout server: $ROLLOUT_ENGINE on GPU $ROLLOUT_GPU (memory fraction $ROLLOUT_MEM), port $PORT"
env "${server_env[@]}" .venv/bin/jaxrl-mismatch serve "${serve_args[@]}" &
server_pid=$!
stop_server() {
  kill -TERM "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  rm -f "$ready"
}
trap stop_server EXIT
# A signal before the trainer starts: exit (the EXIT trap stops the server) with the shell's 128+N.
trap 'exit 143' TERM; trap 'exit 130' INT; trap 'exit 129' HUP
for _ in $(seq 1 1200); do  # up to 20 min: vLLM compiles CUDA graphs at start-up
  [ -s "$ready" ] && break
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "single_node_gpu.sh: the rollout server exited before it was ready" >&2
    exit 3
  fi
  sleep 1
done
[ -s "$ready" ] || { echo "single_node_gpu.sh: the rollout server was not ready after 20 min" >&2; exit 3; }

trainer_env=(CUDA_VISIBLE_DEVICES="$TRAINER_GPUS" JAX_PLATFORMS="$platforms" XLA_PYTHON_CLIENT_MEM_FRACTION="$TRAINER_MEM")
[ "$shared" -eq 1 ] && trainer_env+=(XLA_PYTHON_CLIENT_PREALLOCATE=false)
echo "trainer: GPUs $TRAINER_GPUS (memory fraction $TRAINER_MEM$([ "$shared" -eq 1 ] && echo ', no preallocation'))"
# The trainer runs in the background so that a signal to the launcher reaches it: TERM, INT and HUP are
# forwarded as SIGTERM (the trainer checkpoints and exits 143; a background job of a script ignores SIGINT, and
# the trainer handles SIGTERM only). The launcher waits for it, then stops the server and exits with its code.
trainer_pid="" pending=0 signalled=0
forward() {
  signalled=1
  if [ -n "$trainer_pid" ]; then kill -TERM "$trainer_pid" 2>/dev/null || true; else pending=1; fi
}
trap forward TERM INT HUP  # before the trainer starts: a signal in between is forwarded once it has a pid
env "${trainer_env[@]}" .venv/bin/jaxrl-mismatch train --config "$config" \
  ${rollout_overrides[@]+"${rollout_overrides[@]}"} \
  --config.rollout.address="127.0.0.1:$PORT" --config.rollout.token_file="$TOKEN_FILE" "$@" &
trainer_pid=$!
[ "$pending" -eq 0 ] || forward
code=""
while :; do  # a trapped signal interrupts `wait` (128+N): wait again for the trainer's own status
  signalled=0
  set +e
  wait "$trainer_pid" 2>/dev/null
  c=$?
  set -e
  [ "$c" -ne 127 ] || [ -z "$code" ] || break  # its status was already collected
  code=$c
  [ "$signalled" -eq 1 ] || break
done
exit "$code"
