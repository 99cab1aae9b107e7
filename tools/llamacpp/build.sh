#!/usr/bin/env bash
# Builds llama.cpp for this CPU (llama-bench, llama-batched-bench) from the source that PyPI's llama-cpp-python
# 0.3.36 vendors (llama.cpp 0c1e570, which has Kimi K3), and a converter venv (torch CPU, its gguf-py,
# transformers 4.57.6, which convert_hf_to_gguf.py imports). Used by `k3compile bench --llama-bench` (README,
# "Benchmark"). Usage: tools/llamacpp/build.sh [DIR=$HOME/.cache/k3-llamacpp]; ~10 minutes on 2 cores.
set -euo pipefail
D=${1:-$HOME/.cache/k3-llamacpp}
mkdir -p "$D" && cd "$D"
[ -d llama_cpp_python-0.3.36 ] || { pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d . \
    && tar xzf llama_cpp_python-0.3.36.tar.gz; }
L=$D/llama_cpp_python-0.3.36/vendor/llama.cpp
if [ ! -x build/bin/llama-bench ] || [ ! -x build/bin/llama-batched-bench ]; then
  command -v cmake >/dev/null || { echo "needs cmake and a C++ compiler (apt-get install cmake build-essential)"; exit 1; }
  nice -n 19 cmake -S "$L" -B build -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
  nice -n 19 cmake --build build -j "$(nproc)" --target llama-bench llama-batched-bench >/dev/null
fi
if [ ! -x venv/bin/python ]; then
  python3 -m venv venv
  venv/bin/pip install -q torch==2.13.0
  venv/bin/pip install -q -e "$L/gguf-py" numpy safetensors "transformers==4.57.6" "numpy~=2.2.6"
fi
echo "llama-bench: $D/build/bin/llama-bench"
echo "convert:     LLAMA_SRC=$L $D/venv/bin/python tools/llamacpp/convert.py CKPT --outtype bf16 --outfile X.gguf"
