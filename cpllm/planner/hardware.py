"""What one device of a cluster can do: published figures, a JSON spec, or this machine measured (calibrate.py).

Bandwidths are per device and per direction, in bytes/s. The built-in figures are the vendors' published peaks
(dense matmul without sparsity); `efficiency` is the one factor a user may fit (the fraction of peak compute
the kernels reach) and defaults to 1.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True, slots=True)
class HardwareSpec:
    """One device and how devices are wired together."""

    name: str
    """Short name, e.g. "h100"."""
    peak_flops: float
    """Dense 16-bit (or, on CPU, float32) matmul FLOP/s of one device."""
    peak_flops_fp8: float | None = None
    """Dense FP8 matmul FLOP/s (None: no FP8 units; FP8 weights then run at peak_flops)."""
    attention_flops: float | None = None
    """FLOP/s the attention kernel reaches, when measured (calibration); None: peak_flops."""
    memory_bytes: float
    """Device memory (HBM, or this machine's RAM share) in bytes."""
    memory_bw: float
    """Device memory bandwidth, bytes/s."""
    intra_node_bw: float
    """Bandwidth between two devices of one node (NVLink; loopback on CPU), bytes/s per direction."""
    inter_node_bw: float
    """Network bandwidth of one device to another node (its NIC), bytes/s per direction."""
    devices_per_node: int
    """Devices sharing the fast intra-node links."""
    intra_node_latency_s: float = 5e-6
    """Fixed cost of one intra-node message."""
    inter_node_latency_s: float = 15e-6
    """Fixed cost of one inter-node message."""
    efficiency: float = 1.0
    """Fraction of peak compute reached by real kernels (the one factor a user may fit; 1 = peak)."""
    attention_row_overhead: float = 0.0
    """Extra key positions of work per query row of a causal attention call (the kernel works in blocks, and the
    diagonal's blocks are computed whole), measured by calibration; 0: none."""
    elementwise_bw: float | None = None
    """Bytes/s a layer's elementwise ops (norms, rope, activation, residual adds, layout copies) reach, measured by
    calibration; None: not modelled (fused into the matmul kernels' shadow on GPUs)."""
    busy_node_fraction: float = 1.0
    """Share of its compute rate a device keeps while the other devices of its node compute too (CPU cores
    share memory bandwidth and clocks; measured by calibration, 1 for GPUs). Applies to layouts of more than
    one device."""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bytes", "memory_bw", "intra_node_bw", "inter_node_bw"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(f"hardware {self.name!r}: devices_per_node must be an integer >= 1, "
                             f"got {self.devices_per_node!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"hardware {self.name!r}: efficiency must be in (0, 1], got {self.efficiency!r}")
        if not 0 < self.busy_node_fraction <= 1:
            raise ValueError(f"hardware {self.name!r}: busy_node_fraction must be in (0, 1], "
                             f"got {self.busy_node_fraction!r}")

    def with_efficiency(self, efficiency: float) -> "HardwareSpec":
        return dataclasses.replace(self, efficiency=efficiency)

    def linear_flops(self, weight_format: str) -> float:
        """Peak FLOP/s of the linear layers for weights in `weight_format` ("fp8", "bf16", "fp32")."""
        if weight_format == "fp8" and self.peak_flops_fp8 is not None:
            return self.peak_flops_fp8
        return self.peak_flops

    def attention_peak(self) -> float:
        return self.attention_flops if self.attention_flops is not None else self.peak_flops


GB = 1e9
BUILTIN: dict[str, HardwareSpec] = {
    # NVIDIA H100 SXM5 80 GB: 989 TFLOP/s BF16, 1979 FP8 (dense), HBM3 3.35 TB/s, NVLink 4 900 GB/s
    # (450 each way), one 400 Gb/s ConnectX-7 NIC per GPU (DGX H100).
    "h100": HardwareSpec(name="h100", peak_flops=989.4e12, peak_flops_fp8=1978.9e12, memory_bytes=80 * GB,
                         memory_bw=3.35e12, intra_node_bw=450 * GB, inter_node_bw=50 * GB, devices_per_node=8),
    # H200 SXM: the H100's compute with 141 GB of HBM3e at 4.8 TB/s.
    "h200": HardwareSpec(name="h200", peak_flops=989.4e12, peak_flops_fp8=1978.9e12, memory_bytes=141 * GB,
                         memory_bw=4.8e12, intra_node_bw=450 * GB, inter_node_bw=50 * GB, devices_per_node=8),
    # A100 SXM4 80 GB: 312 TFLOP/s BF16, no FP8, HBM2e 2.039 TB/s, NVLink 3 600 GB/s (300 each way),
    # one 200 Gb/s HDR NIC per GPU (DGX A100).
    "a100": HardwareSpec(name="a100", peak_flops=312e12, memory_bytes=80 * GB, memory_bw=2.039e12,
                         intra_node_bw=300 * GB, inter_node_bw=25 * GB, devices_per_node=8),
    # This 2-core CPU machine, one rank per core (docs/platform.md "The CPUs"): fp32 matmul ~90 GFLOP/s on one thread,
    # memory copy ~11 GB/s, gloo point-to-point ~810 MiB/s, collective latency ~0.1 ms.
    "cpu": HardwareSpec(name="cpu", peak_flops=90e9, memory_bytes=16 * GB, memory_bw=11 * GB,
                        intra_node_bw=0.85 * GB, inter_node_bw=0.85 * GB, devices_per_node=2,
                        intra_node_latency_s=100e-6, inter_node_latency_s=100e-6),
}


def builtin_hardware(name: str) -> HardwareSpec:
    key = name.lower()
    if key not in BUILTIN:
        raise ValueError(f"unknown hardware {name!r}; built in: {', '.join(BUILTIN)} (or pass --hardware spec.json)")
    return BUILTIN[key]


def load_hardware(path: str) -> HardwareSpec:
    """A spec from JSON: the HardwareSpec fields by name; "base" names a built-in spec the others override."""
    with open(path) as handle:
        fields = json.load(handle)
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: a hardware spec is a JSON object, got {type(fields).__name__}")
    known = {f.name for f in dataclasses.fields(HardwareSpec)}
    unknown = sorted(set(fields) - known - {"base"})
    if unknown:
        raise ValueError(f"{path}: unknown hardware fields {unknown}; known: {sorted(known)}")
    base = fields.pop("base", None)
    if base is not None:
        return dataclasses.replace(builtin_hardware(base), **fields)
    fields.setdefault("name", path)
    return HardwareSpec(**fields)


def save_hardware(spec: HardwareSpec, path: str) -> None:
    with open(path, "w") as handle:
        json.dump(dataclasses.asdict(spec), handle, indent=2)
        handle.write("\n")
