#!/usr/bin/env bash
# The README's test command: set up the pinned environment, then run the whole suite (vLLM tests included).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not vllm"` to skip the slow vLLM tests locally.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing (exit 5)" >&2
  exit 1
fi
exit "$rc"
