#!/usr/bin/env bash
# One GPU node, trainer and rollout server side by side:
#   launch/single_node_gpu.sh CONFIG [--config.overrides ...]
# e.g. on 8 GPUs (defaults): the rollout server (vLLM) on GPU 7, the trainer's mesh on GPUs 0-6. The step's rows
# must split over the trainer's devices: the 4B config's 64 prompts x 16 samples = 1024 rows do not divide by 7,
# so give it 56 prompts (896 rows), or 4 trainer GPUs (TRAINER_GPUS=0,1,2,3):
#   launch/single_node_gpu.sh configs/qwen3_4b_dapo_lr_decay.py --config.trainer.mesh.fsdp=-1 \
#       --config.trainer.mesh.data=1 --config.batch.prompts_per_step=56
#
# Environment (all optional):
#   TRAINER_GPUS    comma list for the trainer's mesh (CUDA_VISIBLE_DEVICES); default: all but the last GPU
#   ROLLOUT_GPU     the rollout server's GPU (one: the engines serve from one device); default: the last GPU.
#                   With one GPU on the node both default to GPU 0, shared (see the memory split below).
#   ROLLOUT_ENGINE  vllm (default) | jax          ROLLOUT_DTYPE  bfloat16 (default) | float16 | float32
#   ROLLOUT_MEM     fraction of the rollout GPU the server may use: vLLM's gpu_memory_utilization, or the JAX
#                   engine's XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.90 alone on its GPU, 0.45 when shared
#   TRAINER_MEM     XLA_PYTHON_CLIENT_MEM_FRACTION of the trainer; default 0.90 alone, 0.45 when shared
#   PORT            gRPC port of the server (loopback); default 50051
#   TOKEN_FILE      shared token for weight pushes; generated (mode 600) if missing; default ./rollout_token
#
# Memory: JAX preallocates 75 % of every visible GPU at start-up by default, which would leave a co-located
# vLLM nothing. The trainer therefore runs with XLA_PYTHON_CLIENT_MEM_FRACTION=$TRAINER_MEM, and, when it
# shares a GPU with the server, XLA_PYTHON_CLIENT_PREALLOCATE=false (allocate on demand, up to that fraction).
# The server starts first and takes its share before the trainer allocates anything.
# Needs the GPU stack: bash scripts/setup_gpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:?usage: launch/single_node_gpu.sh CONFIG [--config.overrides ...]}
shift
mapfile -t all_gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader | tr -d ' ')
n=${#all_gpus[@]}
if [ "$n" -eq 0 ]; then
  echo "single_node_gpu.sh: nvidia-smi lists no GPU" >&2
  exit 2
fi
if [ "$n" -eq 1 ]; then
  default_trainer=${all_gpus[0]}
  default_rollout=${all_gpus[0]}
else
  default_trainer=$(IFS=,; echo "${all_gpus[*]:0:n-1}")
  default_rollout=${all_gpus[n-1]}
fi
TRAINER_GPUS=${TRAINER_GPUS:-$default_trainer}
ROLLOUT_GPU=${ROLLOUT_GPU:-$default_rollout}
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-vllm}
ROLLOUT_DTYPE=${ROLLOUT_DTYPE:-bfloat16}
PORT=${PORT:-50051}
TOKEN_FILE=${TOKEN_FILE:-rollout_token}
case ",$TRAINER_GPUS," in *",$ROLLOUT_GPU,"*) shared=1 ;; *) shared=0 ;; esac
if [ "$shared" -eq 1 ]; then
  ROLLOUT_MEM=${ROLLOUT_MEM:-0.45}
  TRAINER_MEM=${TRAINER_MEM:-0.45}
else
  ROLLOUT_MEM=${ROLLOUT_MEM:-0.90}
  TRAINER_MEM=${TRAINER_MEM:-0.90}
fi
case "$ROLLOUT_GPU" in *,*) echo "single_node_gpu.sh: ROLLOUT_GPU takes one GPU, got '$ROLLOUT_GPU'" >&2; exit 2 ;; esac

# The checkpoint the server starts from: --config.model.path=... if given, else the config's model.path.
model=""
for arg in "$@"; do
  case "$arg" in --config.model.path=*) model=${arg#--config.model.path=} ;; esac
done
if [ -z "$model" ]; then
  model=$(.venv/bin/python - "$config" <<'PYEOF'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("launch_config", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(module.get_config().model.path)
PYEOF
)
fi
if [ ! -f "$model/config.json" ]; then
  echo "single_node_gpu.sh: model.path '$model' holds no HF checkpoint (config.json); set --config.model.path" >&2
  exit 2
fi
if [ ! -s "$TOKEN_FILE" ]; then
  (umask 077; python3 -c "import secrets; print(secrets.token_hex(32))" > "$TOKEN_FILE")
fi

ready=$(mktemp -u /tmp/rollout_ready.XXXXXX)
platforms=${JAX_PLATFORMS:-cuda}  # fail loudly rather than fall back to the CPU when CUDA is broken
server_env=(CUDA_VISIBLE_DEVICES="$ROLLOUT_GPU" JAX_PLATFORMS="$platforms")
serve_args=(--engine "$ROLLOUT_ENGINE" --model "$model" --dtype "$ROLLOUT_DTYPE" --port "$PORT"
            --token-file "$TOKEN_FILE" --ready-file "$ready")
if [ "$ROLLOUT_ENGINE" = jax ]; then
  server_env+=(XLA_PYTHON_CLIENT_MEM_FRACTION="$ROLLOUT_MEM")
  [ "$shared" -eq 1 ] && server_env+=(XLA_PYTHON_CLIENT_PREALLOCATE=false)
elif .venv/bin/jaxrl-mismatch serve --help 2>/dev/null | grep -q -- --gpu-memory-utilization; then
  serve_args+=(--gpu-memory-utilization "$ROLLOUT_MEM")
else
  echo "single_node_gpu.sh: this serve has no --gpu-memory-utilization flag; vLLM uses its default (0.9) of GPU $ROLLOUT_GPU" >&2
  if [ "$shared" -eq 1 ]; then
    echo "single_node_gpu.sh: sharing one GPU needs that flag (vLLM would take 90 %); give the server its own GPU" >&2
    exit 2
  fi
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
env "${trainer_env[@]}" .venv/bin/jaxrl-mismatch train --config "$config" \
  --config.rollout.address="127.0.0.1:$PORT" --config.rollout.token_file="$TOKEN_FILE" "$@"
