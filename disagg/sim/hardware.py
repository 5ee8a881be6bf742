"""Accelerator presets for the cluster simulator: peak rates, efficiencies, overheads (S1, S9).

H100 and H200 constants come from NVIDIA datasheets; each efficiency factor (the share of a
peak that real kernels reach) cites the public measurement it is taken from. Nothing here
is tuned to the blog's results. The `cpu` preset is whatever `disagg calibrate` measured on
this machine, stored as JSON; without that file it does not exist.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from disagg.errors import ConfigError

CPU_CALIBRATION_ENV = "DISAGG_CPU_CALIBRATION"


@dataclass(frozen=True, slots=True)
class Hardware:
    """One node type: per-device peaks, what fraction of them kernels reach, fixed costs.

    Rates are per device (GPU) in FLOP/s and bytes/s; a node has `devices_per_node` devices
    and `nics_per_node` NICs. Overheads are seconds.
    """

    name: str
    devices_per_node: int
    bf16_flops: float  # dense tensor-core peak; attention runs at this rate
    fp8_flops: float  # dense fp8 peak; GEMMs with 1-byte weights run at this rate
    hbm_bandwidth: float
    hbm_capacity: float  # bytes per device
    nvlink_bandwidth: float  # per device, one direction
    nic_bandwidth: float  # per NIC, one direction
    nics_per_node: int
    nic_latency_s: float  # one RDMA write, end to end
    gemm_efficiency: float
    attention_efficiency: float
    memory_efficiency: float
    comm_efficiency: float
    collective_latency_s: float  # fixed cost of one all-reduce or all-to-all
    kernel_overhead_s: float  # launch gap plus ramp and tail of one kernel
    step_overhead_s: float  # host work per step not hidden behind the GPU
    seq_overhead_s: float = 0.0  # host work per sequence per step (batch preparation)
    seq_layer_overhead_s: float = 0.0  # per sequence per layer, for engines that loop in Python
    overlap_compute_memory: bool = True  # roofline max (True) or compute + memory (False)
    kv_read_passes: float = 1.0  # times attention moves each cached KV byte (1: read in place)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float | int) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"hardware {self.name}: {f.name} must be >= 0, got {value}")
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency",
                     "comm_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"hardware {self.name}: {name} must be in (0, 1]")

    @property
    def node_nic_bandwidth(self) -> float:
        """All NICs of a node together, one direction."""
        return self.nic_bandwidth * self.nics_per_node

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able fields."""
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, object]) -> Hardware:
        """Inverse of `to_dict`; unknown keys are an error."""
        known = {f.name for f in fields(Hardware)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"hardware JSON has unknown fields {sorted(unknown)}")
        return Hardware(**data)  # type: ignore[arg-type]


# Efficiency factors shared by both Hopper presets, each from a public measurement:
# - GEMM 0.7: DeepGEMM reports 1100-1550 fp8 TFLOPS on DeepSeek-V3 shapes on H800 (peak
#   1979), i.e. 0.56-0.78; we take 0.7.
# - attention 0.6: FlashMLA reaches 580 bf16 TFLOPS compute-bound on H800 (peak 989) = 0.59;
#   FlashAttention-3 reports 740 (0.75) for MHA, so this is the conservative end.
# - memory 0.9: FlashMLA reaches 3000 GB/s memory-bound on H800 (peak 3350) = 0.9.
# - comm 0.78: DeepEP's intranode all-to-all sustains 153-158 GB/s over H800's 200 GB/s
#   per-direction NVLink.
# - collective latency 15 us: small-message NCCL all-reduce inside one NVLink node is
#   10-20 us in nccl-tests; an all-to-all dispatch pays it too.
# - kernel overhead 3 us: a short kernel replayed from a CUDA graph still costs a few us of
#   launch gap, ramp-up and tail (NVIDIA, "Getting Started with CUDA Graphs").
# - step overhead 0.5 ms: sampling and batch metadata the overlap scheduler cannot hide.
_HOPPER_EFFICIENCY = dict(gemm_efficiency=0.7, attention_efficiency=0.6, memory_efficiency=0.9,
                          comm_efficiency=0.78, collective_latency_s=15e-6,
                          kernel_overhead_s=3e-6, step_overhead_s=0.5e-3)

PRESETS: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS bf16 / 1979 TFLOPS fp8 dense, 80 GB HBM3 at
    # 3.35 TB/s, NVLink 4 at 900 GB/s (both directions). DGX H100: 8 GPUs, 8 ConnectX-7
    # 400 Gb/s NICs (50 GB/s each) for the compute fabric.
    "h100": Hardware(name="h100", devices_per_node=8, bf16_flops=989e12, fp8_flops=1979e12,
                     hbm_bandwidth=3.35e12, hbm_capacity=80e9, nvlink_bandwidth=450e9,
                     nic_bandwidth=50e9, nics_per_node=8, nic_latency_s=10e-6,
                     **_HOPPER_EFFICIENCY),
    # NVIDIA H200 SXM datasheet: the H100's compute with 141 GB HBM3e at 4.8 TB/s; DGX H200
    # has the same 8 x 400 Gb/s NICs (AWS p5en: 3200 Gb/s EFA per node, the same total).
    "h200": Hardware(name="h200", devices_per_node=8, bf16_flops=989e12, fp8_flops=1979e12,
                     hbm_bandwidth=4.8e12, hbm_capacity=141e9, nvlink_bandwidth=450e9,
                     nic_bandwidth=50e9, nics_per_node=8, nic_latency_s=10e-6,
                     **_HOPPER_EFFICIENCY),
}


def cpu_calibration_path() -> Path:
    """Where `disagg calibrate --save` writes the `cpu` preset ($DISAGG_CPU_CALIBRATION wins)."""
    override = os.environ.get(CPU_CALIBRATION_ENV)
    if override:
        return Path(override)
    return Path.home() / ".cache" / "disagg" / "cpu_calibration.json"


def save_cpu_calibration(hardware: Hardware, path: Path | None = None) -> Path:
    """Store a measured `cpu` preset as JSON; returns the path."""
    path = path or cpu_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(hardware.to_dict(), indent=2) + "\n")
    return path


def hardware_from_name(name: str) -> Hardware:
    """`h100`, `h200`, or `cpu` (read from the calibration file)."""
    if name in PRESETS:
        return PRESETS[name]
    if name == "cpu":
        path = cpu_calibration_path()
        if not path.exists():
            raise ConfigError(f"no CPU calibration at {path}: run `disagg calibrate --save` "
                              "first")
        try:
            return Hardware.from_dict(json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as error:
            raise ConfigError(f"CPU calibration {path} is malformed: {error}") from error
    raise ConfigError(f"unknown hardware {name!r}: expected one of {[*sorted(PRESETS), 'cpu']}")
