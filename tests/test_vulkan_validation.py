"""Vulkan validation in CI (issue 37): a subset of the kernel and model tests
runs once more under the Khronos validation layer with synchronization
validation on, and fails on any error the layer reports; a positive control
(tests/validation_control.py: real Programs with their barriers left out)
proves the same setup reports missing barriers.

The layer is Debian's `vulkan-validationlayers` (scripts/setup.sh installs it)
or the folder of a layer manifest in VKENGINE_VALIDATION_LAYER_PATH (the GPU
kit points it at Debian 13's, see ../shared/notes/device.md). Its absence is a
failure that says how to install it, never a skip.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "VkLayer_khronos_validation.json"
SYSTEM_LAYER_DIRS = ("/usr/share/vulkan/explicit_layer.d", "/usr/local/share/vulkan/explicit_layer.d",
                     "/etc/vulkan/explicit_layer.d")

# What runs under the layer: the program tracker's ordering, transfers, and the
# kernels every model step uses (matvecs, norms, rope, attention at depth and in
# mixed batches, sampling), then whole tiny models through prefill, split-K
# decode attention at depth, batched rows and device sampling.
# Left out: test_mul_mat_rope, whose unfused programs run two matvecs with no
# barrier between them (disjoint outputs) while the shader's optional RoPE and
# KV-cache bindings, unused at run time, are bound to the same buffers: the
# layer takes every binding a shader could touch as touched (whole buffers) and
# reports six hazards that cannot happen (docs/reliability.md).
KERNEL_SUBSET = ("dependent_dispatch_chain or independent_dispatches or upload or test_copy or rope_kv "
                 "or attention_decode_depth or attention_mixed_batch or rms_norm or test_get_rows or argmax "
                 "or sample_greedy or swiglu "
                 "or (test_mul_mat and q4_0 and not norm_split and not coopmat and not columns_equal "
                 "and not mul_mat_rope)")
MODEL_SUBSET = ("tiny_prefill_matches or split_decode_attention_at_depth or batched_rows_equal "
                "or device_and_host_sampling")

# The layer's messages in its log file: 1.3.239 (Debian 12) writes
# "SYNC-HAZARD-READ-AFTER-WRITE(ERROR / SPEC): ...", 1.4.309 (Debian 13, the GPU kit)
# "Validation Error: [ SYNC-HAZARD-READ-AFTER-WRITE ] ...".
_ERROR = re.compile(r"^(\S+)\(ERROR\b|^Validation Error: \[ (\S+) \]", re.M)
_WARN = re.compile(r"^(\S+)\(WARN\b|^Validation Warning: \[ (\S+) \]", re.M)
# Warnings that are not ours: vulkan-hpp's dispatcher (inside kp) asks vkGetDeviceProcAddr for
# every function it knows, instance-level ones too; it gets null for those and never calls them.
# 1.4.309 warns once per such name, 1.3.239 does not check.
_NOT_OURS = {"WARNING-vkGetDeviceProcAddr-device"}


def _ids(pattern: re.Pattern, log: str) -> list[str]:
    return [m.group(1) or m.group(2) for m in pattern.finditer(log)]


def _layer_dir() -> str:
    env = os.environ.get("VKENGINE_VALIDATION_LAYER_PATH")
    dirs = [env] if env else list(SYSTEM_LAYER_DIRS)
    for d in dirs:
        if (Path(d) / MANIFEST).is_file():
            return d
    pytest.fail(f"the Khronos validation layer ({MANIFEST}) is not in {', '.join(dirs)}: install Debian's "
                "vulkan-validationlayers (scripts/setup.sh does) or set VKENGINE_VALIDATION_LAYER_PATH")


def _run(tmp: Path, args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, str]:
    """args under the layer; returns the process and what the layer logged."""
    log = tmp / "validation.log"
    log.unlink(missing_ok=True)
    (tmp / "vk_layer_settings.txt").write_text(
        # (1.3.239 reads enables; 1.4.309 ignores it and reads validate_sync: the H200's first run
        # under 1.4.309 reported no hazard in the positive control)
        "khronos_validation.enables = VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT\n"
        "khronos_validation.validate_sync = true\n"
        "khronos_validation.report_flags = error,warn\n"
        "khronos_validation.debug_action = VK_DBG_LAYER_ACTION_LOG_MSG\n"
        f"khronos_validation.log_filename = {log}\n")
    env = dict(os.environ, VK_LAYER_PATH=_layer_dir(), VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation",
               VK_LAYER_SETTINGS_PATH=str(tmp))
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p, log.read_text(errors="replace") if log.exists() else ""


def test_layer_reports_each_missing_barrier(tmp_path):
    """The positive control: the layer is loaded, synchronization validation is
    on, and a program that leaves barriers out is reported, once per hazard."""
    p, log = _run(tmp_path, ["-m", "tests.validation_control"], 300)
    assert p.returncode == 0, p.stdout + p.stderr
    found = sorted(_ids(_ERROR, log))
    assert found == ["SYNC-HAZARD-READ-AFTER-WRITE", "SYNC-HAZARD-WRITE-AFTER-READ",
                     "SYNC-HAZARD-WRITE-AFTER-WRITE"], log[:4000]
    p, log = _run(tmp_path, ["-m", "tests.validation_control", "--with-barriers"], 300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not _ids(_ERROR, log) and not set(_ids(_WARN, log)) - _NOT_OURS, log[:4000]


def test_kernel_and_model_tests_are_clean_under_the_layer(tmp_path):
    """The subset passes with the layer on, and the layer reports no error (a
    hazard, a wrong usage, a bad descriptor, an out-of-range dispatch)."""
    p, log = _run(tmp_path, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             "tests/test_kernels.py", "tests/test_models.py",
                             "-k", f"({KERNEL_SUBSET}) or ({MODEL_SUBSET})"], 1500)
    tail = (p.stdout + p.stderr)[-3000:]
    assert p.returncode == 0, tail
    ran = re.search(r"(\d+) passed", p.stdout)
    assert ran and int(ran.group(1)) >= 50, tail         # the subset did run
    errors = _ids(_ERROR, log)
    assert not errors, f"{len(errors)} validation errors, first ones:\n{log[:6000]}"
    assert not set(_ids(_WARN, log)) - _NOT_OURS, log[:6000]


def test_both_layer_versions_log_formats_are_read():
    """The log parser takes both layer versions' lines (1.4.309's were missed
    at first, so its errors would have passed unseen), and the one warning that
    is not ours is the only one let through."""
    log = ("SYNC-HAZARD-READ-AFTER-WRITE(ERROR / SPEC): msgNum: 1 - Validation Error: [ x ]\n"
           "UNASSIGNED-BestPractices-thing(WARN / SPEC): msgNum: 2 - text\n"
           "Validation Error: [ SYNC-HAZARD-WRITE-AFTER-WRITE ] Object 0: handle = 0x1 | MessageID = 0x5c0ec5d6\n"
           "Validation Warning: [ WARNING-vkGetDeviceProcAddr-device ] | MessageID = 0x22b1fbac\n"
           "Validation Warning: [ BestPractices-other ] | MessageID = 0x1\n")
    assert _ids(_ERROR, log) == ["SYNC-HAZARD-READ-AFTER-WRITE", "SYNC-HAZARD-WRITE-AFTER-WRITE"]
    assert set(_ids(_WARN, log)) - _NOT_OURS == {"UNASSIGNED-BestPractices-thing", "BestPractices-other"}
