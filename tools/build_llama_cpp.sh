#!/usr/bin/env bash
# Build llama.cpp's tools: the references of benchmarks/latency.py (llama-bench) and benchmarks/quantized.py
# (llama-bench, llama-quantize, llama-server, llama-perplexity).
#
# Usage: tools/build_llama_cpp.sh [TARGET ...]        (default target: llama-bench)
#   e.g. tools/build_llama_cpp.sh llama-bench llama-quantize llama-server llama-perplexity llama-completion
#
# llama.cpp is not a kvflow dependency and is never built in CI. The source is the llama.cpp that the
# llama-cpp-python sdist vendors (vendor/llama.cpp), fetched with pip, so this needs only the package registry.
# It is built for this CPU (GGML_NATIVE=ON, Release, static), without HTTPS/curl, tests or examples, at low
# priority (nice 19) with JOBS parallel jobs (default 2: the machine is shared). The HTTP server (plain HTTP only)
# is configured only when llama-server is among the targets. Everything goes under
# $LLAMA_CPP_DIR (default .cache/llama.cpp, gitignored); the binaries end up in $LLAMA_CPP_DIR/bin and their
# paths are printed on stdout, one a line (the build's log goes to stderr).
#
# Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), LLAMA_CPP_DIR, JOBS, PYTHON (default: the repository's
# .venv, else python3 from PATH).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
out_dir="${LLAMA_CPP_DIR:-$repo_root/.cache/llama.cpp}"
jobs="${JOBS:-2}"
python="${PYTHON:-$repo_root/.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)" || { echo "no python3 on PATH: set PYTHON" >&2; exit 1; }
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(llama-bench)
build_server=OFF
for target in "${targets[@]}"; do
    [[ "$target" != llama-server ]] || build_server=ON
done

command -v cmake >/dev/null || { echo "cmake not found: pip install cmake (or apt-get install cmake)" >&2; exit 1; }
command -v c++ >/dev/null || { echo "no C++ compiler (c++) found" >&2; exit 1; }

mkdir -p "$out_dir/src" "$out_dir/bin"
sdist="$out_dir/src/llama_cpp_python-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
    "$python" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$out_dir/src" >&2
fi
source_dir="$out_dir/src/llama_cpp_python-$version/vendor/llama.cpp"
if [[ ! -f "$source_dir/CMakeLists.txt" ]]; then
    tar -xzf "$sdist" -C "$out_dir/src"
fi

build_dir="$out_dir/build-$version"
nice -n 19 cmake -S "$source_dir" -B "$build_dir" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER="$build_server" \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_CURL=OFF >&2
nice -n 19 cmake --build "$build_dir" --config Release -j "$jobs" --target "${targets[@]}" >&2
for target in "${targets[@]}"; do
    cp -f "$build_dir/bin/$target" "$out_dir/bin/$target"
    echo "$out_dir/bin/$target"
done
