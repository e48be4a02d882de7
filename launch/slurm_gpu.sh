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
# starts LOCAL_PROCESSES trainer processes with LOCAL_DEVICES CPU devices each (the caller's XLA_FLAGS are kept,
# the device count appended) and a coordinator on a free
# loopback port (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); process 0 manages the rollout
# server as in a one-process run. Like srun --kill-on-bad-exit, one failing process stops the others; the exit
# code is the first failure's. PYTHON picks the interpreter (default .venv/bin/python). LOCAL_PROCESSES and
# LOCAL_DEVICES (default 1) are positive integers written without leading zeros; LOCAL_PROCESSES set but
# empty is an error (unset it for SLURM mode); LOCAL_PROCESSES may be at most 4 x the machine's cores and
# LOCAL_PROCESSES x LOCAL_DEVICES at most 256. Local mode needs bash >= 5.1 (wait -n -p).
#   LOCAL_STOP_GRACE  seconds a process gets to exit after SIGTERM before SIGKILL (default 30; a
#                     non-negative integer). The processes are stopped when one fails, when the launcher gets
#                     SIGINT, SIGTERM or SIGHUP, and when it exits for any other reason.
#
# Both modes check, once and before anything starts (one line, exit 2): the config file, the config and the
# overrides as `train` loads them, the interpreter (local: PYTHON) and, under SLURM, srun and
# .venv/bin/jaxrl-mismatch. The default .venv is the repo's: the one above this script, or under sbatch
# (which runs a copy of it) the repo in SLURM_SUBMIT_DIR, the directory sbatch was called from.
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
if [ $# -lt 1 ] || [ -z "$1" ]; then
  echo "usage: sbatch launch/slurm_gpu.sh CONFIG[:VARIANT] [overrides...]  (local mode: LOCAL_PROCESSES=N bash launch/slurm_gpu.sh CONFIG ...)" >&2
  exit 2
fi
config=$1; shift
me=slurm_gpu.sh
die() { echo "error: $*" >&2; exit 2; }
# The repo: this script's parent, unless this is sbatch's copy of it (then the submit directory).
case "$0" in */*) here=${0%/*} ;; *) here=. ;; esac
repo=$(cd "$here/.." && pwd)
if [ ! -f "$repo/launch/slurm_gpu.sh" ] && [ -n "${SLURM_SUBMIT_DIR:-}" ]; then
  repo=$SLURM_SUBMIT_DIR
fi
check_config() {  # once, before anything starts (CONFIG may be FILE:VARIANT: the file part)
  if [ ! -f "${config%%:*}" ]; then
    echo "error: CONFIG '${config%%:*}': no such file" >&2
    exit 2
  fi
}
check_overrides() {  # the config and the overrides, loaded once as `train` loads them (as single_node_gpu.sh)
  local py=$1
  shift
  "$py" "$repo/launch/config_model_path.py" "$me" "$config" "$@" >/dev/null || exit 2
}
if [ -z "${LOCAL_PROCESSES+x}" ]; then
  check_config
  command -v srun >/dev/null 2>&1 || die "srun: not found; submit with sbatch on a SLURM cluster, or set LOCAL_PROCESSES for local mode"
  [ -x "$repo/.venv/bin/jaxrl-mismatch" ] || die "$repo/.venv/bin/jaxrl-mismatch: missing; set up the environment there (bash scripts/setup_gpu.sh)"
  check_overrides "$repo/.venv/bin/python" "$@"
  srun --kill-on-bad-exit=1 "$repo/.venv/bin/jaxrl-mismatch" train --config "$config" --config.distributed.initialize=always "$@"
  exit
fi
if [ -z "$LOCAL_PROCESSES" ]; then
  echo "error: LOCAL_PROCESSES is set but empty: give a positive integer, or unset it to run under SLURM" >&2
  exit 2
fi
[[ $LOCAL_PROCESSES =~ ^[1-9][0-9]*$ ]] || { echo "error: LOCAL_PROCESSES must be a positive integer, got '$LOCAL_PROCESSES'" >&2; exit 2; }
devices=${LOCAL_DEVICES-1}
[[ $devices =~ ^[1-9][0-9]*$ ]] || { echo "error: LOCAL_DEVICES must be a positive integer, got '$devices'" >&2; exit 2; }
cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
[[ $cores =~ ^[1-9][0-9]*$ ]] || cores=1
max_procs=$((4 * cores))
if [ ${#LOCAL_PROCESSES} -gt 6 ] || [ "$LOCAL_PROCESSES" -gt "$max_procs" ]; then
  die "LOCAL_PROCESSES=$LOCAL_PROCESSES is more than 4 x this machine's $cores cores ($max_procs)"
fi
if [ ${#devices} -gt 6 ] || [ $((LOCAL_PROCESSES * devices)) -gt 256 ]; then
  die "LOCAL_PROCESSES x LOCAL_DEVICES = $LOCAL_PROCESSES x $devices is more than 256 devices"
fi
grace=${LOCAL_STOP_GRACE-30}
[[ $grace =~ ^(0|[1-9][0-9]{0,5})$ ]] || die "LOCAL_STOP_GRACE must be a non-negative integer (seconds), got '$grace'"
if [ "${BASH_VERSINFO[0]}" -lt 5 ] || { [ "${BASH_VERSINFO[0]}" -eq 5 ] && [ "${BASH_VERSINFO[1]}" -lt 1 ]; }; then
  echo "error: local mode needs bash >= 5.1 (wait -n -p), this is $BASH_VERSION" >&2
  exit 2
fi
check_config
py=${PYTHON-$repo/.venv/bin/python}
[ -n "$py" ] || die "PYTHON is set but empty; unset it for $repo/.venv/bin/python"
command -v "$py" >/dev/null 2>&1 || die "PYTHON '$py': no such interpreter (set PYTHON, or set up $repo/.venv)"
check_overrides "$py" "$@"
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') \
  || die "PYTHON '$py' could not pick a free port"
running=()
timer=""  # a `sleep $grace` started by the first stop: when it ends, SIGKILL whatever still runs
stop_all() {  # SIGTERM the processes still running; the main loop SIGKILLs them when $timer ends
  [ ${#running[@]} -gt 0 ] || return 0
  kill -TERM "${running[@]}" 2>/dev/null || true
  if [ -z "$timer" ]; then
    sleep "$grace" </dev/null >/dev/null 2>&1 &
    timer=$!
  fi
}
on_exit() {  # the launcher's own exit (a failure of its own included): no process outlives it
  local code=$? pid left t
  trap - EXIT INT TERM HUP
  if [ ${#running[@]} -gt 0 ]; then
    kill -TERM "${running[@]}" 2>/dev/null || true
    for ((t = 0; t < grace * 10; t++)); do
      left=0
      for pid in "${running[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
      [ "$left" -eq 1 ] || break
      sleep 0.1
    done
    kill -KILL "${running[@]}" 2>/dev/null || true
  fi
  [ -z "$timer" ] || kill -TERM "$timer" 2>/dev/null || true
  exit "$code"
}
trap on_exit EXIT
trap stop_all INT TERM HUP
for ((i = 0; i < LOCAL_PROCESSES; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$devices" \
    JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES="$LOCAL_PROCESSES" JAX_PROCESS_ID="$i" \
    "$py" -m jaxrl_mismatch.cli train --config "$config" --config.distributed.initialize=always "$@" &
  running+=($!)
done
rc=0
escalated=0
while [ ${#running[@]} -gt 0 ]; do
  finished=""
  set +e
  # the next of the still-running processes (or the stop timer) to end, and which one it was
  if [ -n "$timer" ] && [ "$escalated" -eq 0 ]; then
    wait -n -p finished "${running[@]}" "$timer"
  else
    wait -n -p finished "${running[@]}"
  fi
  code=$?
  set -e
  if [ -n "$finished" ] && [ "$finished" = "$timer" ]; then  # the grace period is over
    escalated=1
    kill -KILL "${running[@]}" 2>/dev/null || true
    continue
  fi
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
