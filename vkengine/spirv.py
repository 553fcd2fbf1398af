"""Compile the shader variant table (shaders/variants.py) to SPIR-V with glslc.

SPIR-V is cached outside the working tree, under a name that carries a hash of
every shader source, the variant's defines and the compiler flags, so editing a
shader recompiles only what changed and stale binaries are never used.
`vkengine build-shaders` (run by scripts/setup.sh) compiles everything ahead of
use; a missing entry is compiled on first use. Machines without glslc (the GPU
machine) use a cache directory carried from one that has it
(VKENGINE_SPIRV_CACHE). Variants marked EXT_DEFINE (cooperative matrices) need
a newer glslc than Debian 12's: scripts/glslc-ext.sh installs one under
.glslc-ext/ (VKENGINE_GLSLC_EXT overrides); where it is missing, build_all
leaves them out and only devices that could run them would ask for them.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache, lru_cache
from pathlib import Path

from shaders.variants import EXT_DEFINE, EXT_V12_DEFINE, VARIANTS

from .errors import VkEngineError

SHADER_DIR = Path(__file__).resolve().parent.parent / "shaders"
GLSLC_FLAGS = ("-fshader-stage=compute", "--target-env=vulkan1.2", "-O")
GLSLC_EXT_FLAGS = ("-fshader-stage=compute", "--target-env=vulkan1.3", "-O")
REPO_GLSLC_EXT = SHADER_DIR.parent / ".glslc-ext" / "glslc"


def needs_ext(name: str) -> bool:
    """Whether a variant needs the newer glslc (scripts/glslc-ext.sh)."""
    return bool(VARIANTS[name][1].get(EXT_DEFINE))


def glslc_flags(name: str) -> tuple[str, ...]:
    """The compiler flags of a variant (part of its cache key): Vulkan 1.3's
    SPIR-V for the newer glslc's variants but those marked EXT_V12_DEFINE."""
    ext = needs_ext(name) and not VARIANTS[name][1].get(EXT_V12_DEFINE)
    return GLSLC_EXT_FLAGS if ext else GLSLC_FLAGS


def glslc_ext() -> str | None:
    """The newer glslc, or None where it is not installed."""
    env = os.environ.get("VKENGINE_GLSLC_EXT")
    if env:
        return env
    return str(REPO_GLSLC_EXT) if os.access(REPO_GLSLC_EXT, os.X_OK) else None


def default_cache_dir() -> Path:
    env = os.environ.get("VKENGINE_SPIRV_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vkengine" / "spirv"


@lru_cache(maxsize=1)
def _sources_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(SHADER_DIR.glob("*.comp")) + sorted(SHADER_DIR.glob("*.glsl")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def variant_key(name: str) -> str:
    if name not in VARIANTS:
        raise VkEngineError(f"unknown shader variant {name!r}")
    src, defines = VARIANTS[name]
    h = hashlib.sha256()
    h.update(_sources_digest().encode())
    h.update(src.encode())
    if Path(src).is_absolute():   # a probe's shader, kept beside its probe (bench/shaders)
        h.update(Path(src).read_bytes())
    h.update(repr(sorted(defines.items())).encode())
    h.update(repr(glslc_flags(name)).encode())
    return f"{name}-{h.hexdigest()[:16]}"


def cached_path(name: str, cache_dir: Path | None = None) -> Path:
    """Where a variant's SPIR-V sits in the cache (whether or not it is there yet)."""
    return (cache_dir or default_cache_dir()) / f"{variant_key(name)}.spv"


def compile_variant(name: str, cache_dir: Path | None = None) -> Path:
    cache_dir = cache_dir or default_cache_dir()
    out = cached_path(name, cache_dir)
    if out.exists():
        return out
    ext = needs_ext(name)
    glslc = glslc_ext() if ext else shutil.which("glslc")
    if glslc is None and ext:
        raise VkEngineError(
            f"shader {name} is not in the SPIR-V cache {cache_dir} and needs a newer glslc than the system's "
            "(cooperative matrices): run scripts/glslc-ext.sh, or set VKENGINE_GLSLC_EXT")
    if glslc is None:
        raise VkEngineError(
            f"shader {name} is not in the SPIR-V cache {cache_dir} and glslc is not installed: "
            "run scripts/setup.sh (it installs glslc), or point VKENGINE_SPIRV_CACHE at a cache "
            "built by `vkengine build-shaders` on a machine that has glslc")
    src, defines = VARIANTS[name]
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [glslc, *glslc_flags(name), f"-I{SHADER_DIR}"]
    cmd += [f"-D{k}={v}" for k, v in defines.items()]
    fd, tmp = tempfile.mkstemp(suffix=".spv", dir=cache_dir)
    os.close(fd)
    try:
        r = subprocess.run(cmd + [str(SHADER_DIR / src), "-o", tmp], capture_output=True, text=True)
        if r.returncode != 0:
            # glslc prints "file:line: error: ..." for each problem
            raise VkEngineError(f"shader {name} ({src}, defines {defines}) failed to compile:\n{r.stderr.strip()}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@cache
def _load(name: str, cache_dir: str) -> bytes:
    return compile_variant(name, Path(cache_dir)).read_bytes()


def spirv(name: str, cache_dir: Path | None = None) -> bytes:
    """SPIR-V words of a variant, compiling it first if it is not cached."""
    return _load(name, str(cache_dir or default_cache_dir()))


def build_all(cache_dir: Path | None = None, jobs: int | None = None) -> list[Path]:
    """Compile every variant (ahead of use; those needing the newer glslc only
    where it is installed); returns the cached files."""
    have_ext = glslc_ext() is not None
    names = sorted(n for n in VARIANTS if have_ext or not needs_ext(n))
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as ex:
        return list(ex.map(lambda n: compile_variant(n, cache_dir), names))
