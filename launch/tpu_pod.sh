#!/usr/bin/env bash
# Run the same `jaxrl-mismatch train` on every worker of a Cloud TPU pod slice.
#   launch/tpu_pod.sh TPU_NAME ZONE configs/qwen3_4b_dapo_lr_decay.py [--config.field=value ...]
# Every worker runs the identical command with --config.distributed.initialize=always (not the config's
# default "auto", which looks for a multi-host job in environment variables that an ssh command need not
# have): jax.distributed.initialize() runs on every worker and discovers the slice from the TPU metadata.
# Process 0 talks to the rollout server, which must run elsewhere (a GPU box: launch/rollout_server.sh) and be
# named with --config.rollout.address=HOST:PORT plus --config.rollout.token_file. The repo and its .venv must
# already be on every worker (e.g. `gcloud compute tpus tpu-vm scp` or a shared disk), checkpoints on shared
# storage. CONFIG and the overrides reach the workers' shell (bash, quoted by printf %q) exactly as given (a value
# may hold spaces or shell characters); relative paths are the workers' repo directory's.
#
# Environment:
#   REPO_DIR  the repo's directory on the workers; default $HOME/jaxrl_mismatch (the workers' $HOME); a
#             leading ~/ or $HOME/ is the workers' home too, the rest is taken literally; set but empty is
#             an error (unset it for the default)
# TPU_NAME, ZONE and CONFIG must be non-empty, and gcloud must be on PATH (checked before it runs: one line,
# exit 2).
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 TPU_NAME ZONE CONFIG [overrides...]" >&2; exit 2; }
name=$1 zone=$2 config=$3; shift 3
[ -n "$name" ] || { echo "tpu_pod.sh: TPU_NAME (argument 1) is empty" >&2; exit 2; }
[ -n "$zone" ] || { echo "tpu_pod.sh: ZONE (argument 2) is empty" >&2; exit 2; }
[ -n "$config" ] || { echo "tpu_pod.sh: CONFIG (argument 3) is empty" >&2; exit 2; }
repo=${REPO_DIR-\$HOME/jaxrl_mismatch}
[ -n "$repo" ] || { echo "tpu_pod.sh: REPO_DIR is set but empty; unset it for the default \$HOME/jaxrl_mismatch" >&2; exit 2; }
command -v gcloud >/dev/null 2>&1 || { echo "tpu_pod.sh: gcloud: not found; install the Google Cloud CLI" >&2; exit 2; }
case "$repo" in  # the workers' home expands on the workers; everything else is quoted
  '~/'*) remote_repo="\"\$HOME\"/$(printf '%q' "${repo#'~/'}")" ;;
  '$HOME/'*) remote_repo="\"\$HOME\"/$(printf '%q' "${repo#'$HOME/'}")" ;;
  *) remote_repo=$(printf '%q' "$repo") ;;
esac
remote="cd $remote_repo && .venv/bin/jaxrl-mismatch train --config $(printf '%q' "$config")"
remote+=" --config.distributed.initialize=always"
[ $# -eq 0 ] || remote+=" $(printf '%q ' "$@")"
gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command "${remote% }"
