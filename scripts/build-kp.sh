#!/usr/bin/env bash
# Build Kompute (kp 0.9.0) from its PyPI sdist with vkengine's patch set
# (patches/kp/*.patch), offline-friendly, and leave the wheel in a cache.
#
#   scripts/build-kp.sh PYTHON WHEEL_DIR
#
# PYTHON is the interpreter the wheel is for (a venv's python: it must have
# setuptools, wheel, numpy and pybind11>=2.12 installed). The wheel's name
# carries a hash of the patch set, so editing a patch rebuilds and an
# unchanged one is reused. Why each step is needed: patches/kp/README.md.
set -euo pipefail
py=$1
out=$2
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
tag=$(cat "$here"/patches/kp/*.patch | sha256sum | cut -c1-12)
pyver=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
done_marker="$out/kp-$tag-$pyver.ok"
if [ -f "$done_marker" ] && ls "$out"/kp-$tag-$pyver/kp-*.whl >/dev/null 2>&1; then
  ls "$out"/kp-$tag-$pyver/kp-*.whl
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist_dir="$out/sdist"
mkdir -p "$sdist_dir"
if [ ! -f "$sdist_dir/kp-0.9.0.tar.gz" ]; then
  "$py" -m pip download -q --no-deps --no-binary :all: -d "$sdist_dir" kp==0.9.0
fi
tar -xzf "$sdist_dir/kp-0.9.0.tar.gz" -C "$work"
src="$work/kp-0.9.0"
for p in "$here"/patches/kp/*.patch; do
  patch -s -p1 -d "$src" < "$p"
done
# Debian's pybind11 2.10 makes Tensor.data() return stride-0 views under
# numpy 2 (shared notes): build against the venv's pybind11 from PyPI.
pbdir=$("$py" -m pybind11 --cmakedir)
cat > "$work/kp-offline.cmake" <<CM
set(KOMPUTE_OPT_USE_BUILT_IN_VULKAN_HEADER OFF CACHE BOOL "" FORCE)
set(KOMPUTE_OPT_USE_BUILT_IN_FMT OFF CACHE BOOL "" FORCE)
set(KOMPUTE_OPT_USE_BUILT_IN_PYBIND11 OFF CACHE BOOL "" FORCE)
set(KOMPUTE_OPT_DISABLE_VULKAN_VERSION_CHECK ON CACHE BOOL "" FORCE)
set(KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS ON CACHE BOOL "" FORCE)
set(KOMPUTE_OPT_INSTALL OFF CACHE BOOL "" FORCE)
set(KOMPUTE_OPT_LOG_LEVEL "Off" CACHE STRING "" FORCE)
set(pybind11_DIR "$pbdir" CACHE PATH "" FORCE)
set(PYTHON_EXECUTABLE "$py" CACHE FILEPATH "" FORCE)
CM
pydir=$(dirname "$py")
rm -rf "$out/kp-$tag-$pyver"
mkdir -p "$out/kp-$tag-$pyver"
PATH="$pydir:$PATH" CMAKE_TOOLCHAIN_FILE="$work/kp-offline.cmake" \
  "$py" -m pip wheel -q --no-cache-dir --no-build-isolation --no-deps "$src" -w "$out/kp-$tag-$pyver"
touch "$done_marker"
ls "$out"/kp-$tag-$pyver/kp-*.whl
