"""What the CPU offers for bf16 (AMX tiles, AVX512-BF16, or nothing: emulated) and for int8 (AMX-INT8, VNNI)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuInfo:
    model: str
    flags: frozenset[str]

    @property
    def amx_bf16(self) -> bool:
        return {"amx_bf16", "amx_tile"} <= self.flags

    @property
    def native_bf16(self) -> str | None:
        """The fastest native bf16 matmul path: "AMX", "AVX512-BF16", or None (bf16 is emulated, and slow)."""
        if self.amx_bf16:
            return "AMX"
        if "avx512_bf16" in self.flags:
            return "AVX512-BF16"
        return None

    @property
    def native_int8(self) -> str | None:
        """The fastest int8 dot-product path: "AMX-INT8", "AVX512-VNNI", "AVX-VNNI", or None (no int8 units)."""
        if {"amx_int8", "amx_tile"} <= self.flags:
            return "AMX-INT8"
        if "avx512_vnni" in self.flags:
            return "AVX512-VNNI"
        if "avx_vnni" in self.flags:
            return "AVX-VNNI"
        return None


def parse_cpuinfo(text: str) -> CpuInfo:
    model, flags = "unknown", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model, flags)


@functools.cache
def cpu_info() -> CpuInfo:
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuInfo("unknown", frozenset())
