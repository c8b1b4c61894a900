"""cpu_info: what the CPU computes fast, honouring the switches that cap torch itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pagedserve import cpu_info
from pagedserve.model_loader.loader import resolve_dtype

PROBE = ("import json; from pagedserve import cpu_info as c; b = c.bf16_support(); "
         "print(json.dumps([b.native, b.reason, list(c.kernel_isa_cflags()), c.torch_cpu_capability()]))")


def probe(**env) -> list:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif("avx2" not in cpu_info.cpu_flags(), reason="an x86 CPU with AVX2")
def test_avx2_emulation_switches_bf16_and_the_kernel_isa_off():
    native, reason, cflags, cap = probe(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    assert not native and cap == "AVX2"
    assert ("ATEN_CPU_CAPABILITY" in reason) or ("no bf16 instructions" in reason)
    assert cflags == (["-mno-avx512f"] if "avx512f" in cpu_info.cpu_flags() else [])


def test_native_bf16_needs_the_instructions():
    native, reason, _, _ = probe()
    flags = cpu_info.cpu_flags()
    has_isa = bool({"avx512_bf16", "amx_bf16"} & flags) or ("bf16" in flags)
    assert native == (has_isa and not os.environ.get("ATEN_CPU_CAPABILITY")
                      and not os.environ.get("ONEDNN_MAX_CPU_ISA")), reason


@pytest.mark.parametrize("native,expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_bf16_support(monkeypatch, native, expected):
    from pagedserve.model_loader import loader

    monkeypatch.setattr(loader, "bf16_support", lambda: cpu_info.Bf16Support(native, "test"))
    assert resolve_dtype("auto", None, torch.device("cpu")) is expected
    assert resolve_dtype("bfloat16", None, torch.device("cpu")) is torch.bfloat16  # explicit stays
    assert resolve_dtype("float32", None, torch.device("cpu")) is torch.float32
