#!/usr/bin/env bash
# The README's run command: set up the pinned environment, then the tiny CPU demo end to end —
# warm start (if runs/tiny_cpu_base is missing) → RL with the built-in JAX engine over gRPC → report PNG.
# Extra arguments are config overrides, e.g. `bash scripts/demo.sh --config.steps=50`.
# It runs from the repo root, wherever you call it from: a relative path in an override (e.g.
# --config.run_dir=myrun) is the repo root's (<repo>/myrun), not your current directory's; give an absolute path
# (--config.run_dir="$PWD/myrun") for one of yours.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/jaxrl-mismatch train --config configs/tiny_cpu.py "$@"
