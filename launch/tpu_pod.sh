#!/usr/bin/env bash
# Run the same `jaxrl-mismatch train` on every worker of a Cloud TPU pod slice.
#   launch/tpu_pod.sh TPU_NAME ZONE configs/qwen3_4b_dapo_lr_decay.py [--config.field=value ...]
# Every worker runs the identical command; jax.distributed.initialize() (config.distributed.initialize
# = "auto") discovers the slice from the TPU metadata. Process 0 talks to the rollout server, which must
# run elsewhere (a GPU box: launch/rollout_server.sh) and be named with --config.rollout.address=HOST:PORT
# plus --config.rollout.token_file. The repo and its .venv must already be on every worker
# (e.g. `gcloud compute tpus tpu-vm scp` or a shared disk), checkpoints on shared storage.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 TPU_NAME ZONE CONFIG [overrides...]" >&2; exit 2; }
name=$1 zone=$2 config=$3; shift 3
repo=${REPO_DIR:-\$HOME/jaxrl_mismatch}
gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all \
  --command "cd $repo && .venv/bin/jaxrl-mismatch train --config $config --config.distributed.initialize=always $*"
