#!/usr/bin/env bash
# The README's test command: set up the pinned environment, then run the whole suite (vLLM tests included).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not vllm"` to skip the slow vLLM tests locally,
# `bash scripts/test.sh -n 0 tests/train` for one folder serially.
#
# Environment:
#   PYTEST_WORKERS  pytest-xdist workers (-n): a number (0: serially), auto or logical; default 2
# In a .venv set up by scripts/setup_gpu.sh, setup_env.sh refuses (it would put the CPU stack over the GPU one):
# there run `.venv/bin/python -m pytest ...` directly.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=${PYTEST_WORKERS:-2}
if ! [[ $workers =~ ^([0-9]+|auto|logical)$ ]]; then
  echo "test.sh: PYTEST_WORKERS must be a number of workers, auto or logical, got '$workers'" >&2
  exit 2
fi
bash scripts/setup_env.sh test
set +e
# Two workers, whole files per worker (module fixtures stay shared): the tests spend much of their time in
# single-threaded start-up, compilation and server round trips, so 2 workers use 2 cores (measured: 14 min
# vs 23 min serially). `-n 0` (given after, it wins) runs serially. --durations lists the 25 slowest tests.
.venv/bin/python -m pytest -n "$workers" --dist loadfile --durations=25 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing (exit 5)" >&2
  exit 1
fi
exit "$rc"
