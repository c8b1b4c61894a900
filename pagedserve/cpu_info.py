"""What this machine's CPU computes fast, as torch and oneDNN will actually use it.

Two decisions hang on it: the dtype `auto` picks on CPU (bf16 only where the CPU has
bf16 instructions: elsewhere oneDNN emulates bf16 matmuls at about an eighth of fp32's
speed), and the instruction set the C++ decode kernel is built for.  Both honour the
switches that cap torch itself, so that `ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2` makes an AVX-512 machine behave like an AVX2-only one
throughout (how the AVX2 figures in docs/performance.md were taken).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo ("flags" on x86, "Features" on Arm);
    empty where that file does not exist."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def torch_cpu_capability() -> str:
    """The vector ISA torch's own CPU kernels run with ("AVX512", "AVX2", "DEFAULT", ...),
    after ATEN_CPU_CAPABILITY."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _onednn_allows_bf16() -> bool:
    """ONEDNN_MAX_CPU_ISA below the bf16 ISAs (e.g. AVX2, AVX512_CORE) switches oneDNN's
    bf16 instructions off even where the CPU has them."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return not cap or cap == "ALL" or "BF16" in cap or "AMX" in cap


@dataclass(frozen=True)
class Bf16Support:
    native: bool
    reason: str


@functools.cache
def bf16_support() -> Bf16Support:
    """Whether bf16 matmuls run natively here, and why (for the start-up log)."""
    flags = cpu_flags()
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        isa = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
        if not isa:
            return Bf16Support(False, "this CPU has no bf16 instructions (no avx512_bf16 or amx_bf16)")
        if not torch_cpu_capability().startswith("AVX512"):
            return Bf16Support(False, f"torch runs with {torch_cpu_capability()} kernels (ATEN_CPU_CAPABILITY)")
        if not _onednn_allows_bf16():
            return Bf16Support(False, f"ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} disables bf16")
        return Bf16Support(True, f"this CPU has {' and '.join(isa)}")
    if "bf16" in flags:
        return Bf16Support(True, "this CPU has bf16 instructions")
    return Bf16Support(False, f"no bf16 instructions found for this {machine or 'unknown'} CPU")


def kernel_isa_cflags() -> tuple[str, ...]:
    """Extra compiler flags that keep a -march=native build of our C++ kernels within the
    ISA torch itself was capped to (none when torch runs at the CPU's best)."""
    cap = torch_cpu_capability()
    if "avx512f" in cpu_flags() and not cap.startswith("AVX512"):
        return ("-mno-avx512f",) if cap == "AVX2" else ("-mno-avx512f", "-mno-avx2", "-mno-fma")
    return ()


def describe_cpu() -> str:
    """One line for logs and benchmark output: model name and vector ISA in use."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.partition(":")[2].strip()
                    break
    except OSError:
        pass
    flags = cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else platform.machine())
    bf16 = bf16_support()
    return (f"{name or platform.processor() or platform.machine()} ({isa}, "
            f"{'native' if bf16.native else 'no native'} bf16; torch kernels: {torch_cpu_capability()})")
