#!/usr/bin/env bash
# Regenerate the gRPC modules from src/llmserve/server/grpc_service/llmserve.proto (needs grpcio-tools, a
# build-time tool only: `pip install grpcio-tools`); the generated files are committed.
set -euo pipefail
cd "$(dirname "$0")/../../src"
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. llmserve/server/grpc_service/llmserve.proto
