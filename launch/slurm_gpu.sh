#!/usr/bin/env bash
# Multi-node GPU training under SLURM: one trainer process per node, all GPUs of a node in its mesh.
#   sbatch --nodes=2 --gpus-per-node=8 launch/slurm_gpu.sh configs/qwen3_4b_dapo_lr_decay.py [overrides...]
# jax.distributed.initialize() reads SLURM's environment; the device mesh spans every GPU of every node
# (config.trainer.mesh, e.g. {"data": 1, "fsdp": -1}). The rollout server runs on its own node(s):
# start it with launch/rollout_server.sh and pass --config.rollout.address / --config.rollout.token_file.
# Needs a GPU build of jax on the cluster (`pip install "jax[cuda12]==0.10.2"`), not the CPU wheel.
#
# Local mode (no SLURM, one machine, CPU): the same multi-process job, to test it before paying for nodes:
#   LOCAL_PROCESSES=2 LOCAL_DEVICES=4 bash launch/slurm_gpu.sh CONFIG [overrides...]
# starts LOCAL_PROCESSES trainer processes with LOCAL_DEVICES CPU devices each and a coordinator on a free
# loopback port (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); process 0 manages the rollout
# server as in a one-process run. Like srun --kill-on-bad-exit, one failing process stops the others; the exit
# code is the first failure's. PYTHON picks the interpreter (default .venv/bin/python).
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
config=${1:?usage: sbatch launch/slurm_gpu.sh CONFIG [overrides...]}; shift
if [ -z "${LOCAL_PROCESSES:-}" ]; then
  srun --kill-on-bad-exit=1 .venv/bin/jaxrl-mismatch train --config "$config" --config.distributed.initialize=always "$@"
  exit
fi
case "$LOCAL_PROCESSES" in ''|*[!0-9]*|0) echo "error: LOCAL_PROCESSES must be a positive integer, got '$LOCAL_PROCESSES'" >&2; exit 2 ;; esac
devices=${LOCAL_DEVICES:-1}
case "$devices" in ''|*[!0-9]*|0) echo "error: LOCAL_DEVICES must be a positive integer, got '$devices'" >&2; exit 2 ;; esac
py=${PYTHON:-.venv/bin/python}
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for ((i = 0; i < LOCAL_PROCESSES; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$devices" \
    JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$LOCAL_PROCESSES" JAX_PROCESS_ID="$i" \
    "$py" -m jaxrl_mismatch.cli train --config "$config" --config.distributed.initialize=always "$@" &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' INT TERM
rc=0
for ((n = 0; n < LOCAL_PROCESSES; n++)); do
  set +e
  wait -n "${pids[@]}"
  code=$?
  set -e
  if [ "$code" -ne 0 ] && [ "$rc" -eq 0 ]; then
    rc=$code
    kill "${pids[@]}" 2>/dev/null || true
  fi
done
exit "$rc"
