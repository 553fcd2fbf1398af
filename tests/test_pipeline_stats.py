"""bench/pipeline_stats.c (the driver's compiler statistics of a shader, run 20
of docs/bench/notes.md) builds against the system's Vulkan headers and runs on
the device present: statistics for a real shader where the driver has
VK_KHR_pipeline_executable_properties (NVIDIA), else a clear error (lavapipe)."""
import shutil
import subprocess
from pathlib import Path

import pytest

from vkengine import spirv

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tool(tmp_path_factory):
    out = tmp_path_factory.mktemp("ps") / "pipeline_stats"
    cc = [shutil.which("cc") or shutil.which("gcc") or "g++", "-x", "c"]
    subprocess.run([*cc, "-O2", "-Wall", "-Werror", "-o", str(out), str(ROOT / "bench" / "pipeline_stats.c"),
                    "-x", "none", "-l:libvulkan.so.1"], check=True)
    return out


def test_usage_errors(tool):
    r = subprocess.run([str(tool)], capture_output=True, text=True)
    assert r.returncode == 2 and "usage:" in r.stderr
    r = subprocess.run([str(tool), "0", "4", "x.spv"], capture_output=True, text=True)
    assert r.returncode == 2 and "positive integers" in r.stderr


def test_statistics_or_clear_error(tool, device):
    spv = spirv.compile_variant("mul_mvk_q8_0")
    r = subprocess.run([str(tool), "128", "4", str(spv)], capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        line = r.stdout.strip().splitlines()[-1]
        assert line.startswith(str(spv)) and "=" in line, r.stdout
    else:
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "lacks VK_KHR_pipeline_executable_properties" in r.stderr
