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
# code is the first failure's. PYTHON picks the interpreter (default .venv/bin/python). LOCAL_PROCESSES and
# LOCAL_DEVICES (default 1) are positive integers written without leading zeros; LOCAL_PROCESSES set but
# empty is an error (unset it for SLURM mode). Local mode needs bash >= 5.1 (wait -n -p).
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
if [ $# -lt 1 ] || [ -z "$1" ]; then
  echo "usage: sbatch launch/slurm_gpu.sh CONFIG[:VARIANT] [overrides...]  (local mode: LOCAL_PROCESSES=N bash launch/slurm_gpu.sh CONFIG ...)" >&2
  exit 2
fi
config=$1; shift
check_config() {  # once, before anything starts (CONFIG may be FILE:VARIANT: the file part)
  if [ ! -f "${config%%:*}" ]; then
    echo "error: CONFIG '${config%%:*}': no such file" >&2
    exit 2
  fi
}
if [ -z "${LOCAL_PROCESSES+x}" ]; then
  check_config
  srun --kill-on-bad-exit=1 .venv/bin/jaxrl-mismatch train --config "$config" --config.distributed.initialize=always "$@"
  exit
fi
if [ -z "$LOCAL_PROCESSES" ]; then
  echo "error: LOCAL_PROCESSES is set but empty: give a positive integer, or unset it to run under SLURM" >&2
  exit 2
fi
[[ $LOCAL_PROCESSES =~ ^[1-9][0-9]*$ ]] || { echo "error: LOCAL_PROCESSES must be a positive integer, got '$LOCAL_PROCESSES'" >&2; exit 2; }
devices=${LOCAL_DEVICES-1}
[[ $devices =~ ^[1-9][0-9]*$ ]] || { echo "error: LOCAL_DEVICES must be a positive integer, got '$devices'" >&2; exit 2; }
if [ "${BASH_VERSINFO[0]}" -lt 5 ] || { [ "${BASH_VERSINFO[0]}" -eq 5 ] && [ "${BASH_VERSINFO[1]}" -lt 1 ]; }; then
  echo "error: local mode needs bash >= 5.1 (wait -n -p), this is $BASH_VERSION" >&2
  exit 2
fi
check_config
py=${PYTHON:-.venv/bin/python}
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
running=()
for ((i = 0; i < LOCAL_PROCESSES; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$devices" \
    JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$LOCAL_PROCESSES" JAX_PROCESS_ID="$i" \
    "$py" -m jaxrl_mismatch.cli train --config "$config" --config.distributed.initialize=always "$@" &
  running+=($!)
done
stop_all() { [ ${#running[@]} -eq 0 ] || kill "${running[@]}" 2>/dev/null || true; }
trap stop_all INT TERM
rc=0
while [ ${#running[@]} -gt 0 ]; do
  finished=""
  set +e
  wait -n -p finished "${running[@]}"  # the next of the still-running processes to end, and which one it was
  code=$?
  set -e
  if [ -z "$finished" ]; then  # a signal interrupted the wait (the trap has stopped the others), or no job left
    [ "$rc" -ne 0 ] || rc=$code
    [ "$code" -gt 128 ] && continue
    break
  fi
  left=()
  for pid in "${running[@]}"; do [ "$pid" = "$finished" ] || left+=("$pid"); done
  running=("${left[@]}")
  if [ "$code" -ne 0 ] && [ "$rc" -eq 0 ]; then
    rc=$code
    stop_all
  fi
done
exit "$rc"
