"""Every shader variant's push-constant block (its GLSL `P`, preprocessed with
the variant's defines) has exactly the fields, in order and type, that
vkengine/kernels/push.py packs for it."""
from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from shaders.variants import VARIANTS
from vkengine import spirv
from vkengine.kernels.push import LAYOUTS, Push, glsl_fields, push_for


def _preprocess(name: str) -> str:
    src, defines = VARIANTS[name]
    glslc = shutil.which("glslc")
    assert glslc, "glslc is needed (scripts/setup.sh installs it)"
    cmd = [glslc, "-E", "-fshader-stage=compute", f"-I{spirv.SHADER_DIR}", *(f"-D{k}={v}" for k, v in defines.items()),
           str(spirv.SHADER_DIR / src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_every_variant_packs_its_shaders_push_block():
    names = sorted(VARIANTS)
    with ThreadPoolExecutor(4) as ex:
        sources = dict(zip(names, ex.map(_preprocess, names)))
    bad = []
    for name in names:
        want = glsl_fields(sources[name])
        assert want, f"{name}: no push-constant block found"
        if list(push_for(name).fields) != want:
            bad.append(f"{name}: shader {want} != push.py {list(push_for(name).fields)}")
    assert not bad, "\n".join(bad[:5])
    assert {src for src, _ in VARIANTS.values()} == set(LAYOUTS)   # no layout without a shader, nor the reverse


def test_pack_by_name():
    p = Push("uint a, b; float eps; uint c")
    assert p.size == 16
    assert p.pack(b=2, eps=0.5) == Push("uint a, b").pack(a=0, b=2) + Push("float x").pack(x=0.5) + bytes(4)
    with pytest.raises(ValueError, match="not fields"):
        p.pack(d=1)
