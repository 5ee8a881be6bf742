"""The CPU kernels are built and in use wherever the CPU can run them (X8): a failed build
would otherwise skip every kernel test and leave the PyTorch path running unnoticed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from disagg.model import cpu_kernels


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(os.environ.get("DISAGG_CPU_KERNELS") == "0", reason="turned off on purpose")
def test_a_cpu_with_avx512_runs_the_kernels() -> None:
    flags = _cpu_flags()
    if not {"avx512f", "avx512bw", "avx512vl"} <= flags:
        pytest.skip("this CPU has no AVX-512")
    assert cpu_kernels.lib is not None, "disagg.model._cpu_kernels was not built"
    assert cpu_kernels.AVX512
    assert cpu_kernels.AVX512_BF16 == ("avx512_bf16" in flags)
