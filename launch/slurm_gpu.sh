#!/usr/bin/env bash
# Multi-node GPU training under SLURM: one trainer process per node, all GPUs of a node in its mesh.
#   sbatch --nodes=2 --gpus-per-node=8 launch/slurm_gpu.sh configs/qwen3_4b_dapo_lr_decay.py [overrides...]
# jax.distributed.initialize() reads SLURM's environment; the device mesh spans every GPU of every node
# (config.trainer.mesh, e.g. {"data": 1, "fsdp": -1}). The rollout server runs on its own node(s):
# start it with launch/rollout_server.sh and pass --config.rollout.address / --config.rollout.token_file.
# Needs a GPU build of jax on the cluster (`pip install "jax[cuda12]==0.10.2"`), not the CPU wheel.
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
config=${1:?usage: sbatch launch/slurm_gpu.sh CONFIG [overrides...]}; shift
srun --kill-on-bad-exit=1 .venv/bin/jaxrl-mismatch train --config "$config" --config.distributed.initialize=always "$@"
