#!/usr/bin/env bash
# Regenerate the gRPC/protobuf Python stubs of the rollout service from jaxrl_mismatch/rollout/rollout.proto.
# Run from anywhere; needs grpcio-tools (the `test` extra). The generated files are committed so that the
# runtime needs only grpcio + protobuf. The include root is the repository root, so the stubs import each
# other as `jaxrl_mismatch.rollout.rollout_pb2`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"  # PYTHON: an interpreter with grpcio-tools; default the repo's .venv/bin/python
command -v "$PY" >/dev/null 2>&1 \
  || { echo "gen_proto.sh: PYTHON '$PY': no such interpreter; set PYTHON, or run bash scripts/setup_env.sh test" >&2; exit 2; }
"$PY" -c 'import grpc_tools.protoc' >/dev/null 2>&1 \
  || { echo "gen_proto.sh: PYTHON '$PY' cannot import grpc_tools (grpcio-tools, the test extra); run bash scripts/setup_env.sh test" >&2; exit 2; }
"$PY" -m grpc_tools.protoc -I. \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  jaxrl_mismatch/rollout/rollout.proto
echo "regenerated jaxrl_mismatch/rollout/rollout_pb2{,_grpc}.py and rollout_pb2.pyi"
