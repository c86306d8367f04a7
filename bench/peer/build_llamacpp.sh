#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-bench from the source that the llama-cpp-python
# sdist vendors, for side-by-side benchmarks (`specd bench sweep --peer llamacpp`).
# Never part of `make test`. Output: $SPECD_CACHE/peer/llama.cpp/build/bin/.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
ROOT=${SPECD_CACHE:-$HOME/.cache/specd}/peer
PY=${PYTHON:-python3}
mkdir -p "$ROOT"
cd "$ROOT"
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  "$PY" -m pip download -q --no-binary :all: --no-deps -d . "llama-cpp-python==$VERSION"
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
ln -sfn "llama_cpp_python-$VERSION/vendor/llama.cpp" llama.cpp
# make, not ninja: ninja loops on "build.ninja still dirty" when the clock skews (seen
# on these VMs). ggml's AMX kernels fault under the hypervisor here: build without them
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S llama.cpp -B llama.cpp/build -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >/dev/null
cmake --build llama.cpp/build -j2 --target llama-server llama-bench
echo "built: $ROOT/llama.cpp/build/bin/{llama-server,llama-bench}"
