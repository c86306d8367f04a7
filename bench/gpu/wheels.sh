#!/usr/bin/env bash
# The Python packages the GPU machine's image lacks, as wheels for its Python (3.12), into
# .whl/ (ignored by git) for `run`'s carry; check.sh installs them there. Versions follow
# this checkout's .venv, so both sides run the same ones.
set -euo pipefail
cd "$(dirname "$0")/../.."
PKGS="grpcio grpcio-health-checking grpcio-reflection protobuf llguidance pydantic pydantic_core
annotated-types typing-inspection gguf opentelemetry-api opentelemetry-sdk
opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common
opentelemetry-proto opentelemetry-semantic-conventions googleapis-common-protos"
rm -rf .whl && mkdir -p .whl
for name in $PKGS; do
  version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$name'))")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$name==$version"
done
du -sh .whl
