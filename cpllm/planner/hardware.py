"""What one device of a cluster can do: published figures, a JSON spec, or this machine measured (calibrate.py).

Bandwidths are per device and per direction, in bytes/s. The built-in figures are the vendors' published peaks
(dense matmul without sparsity, HBM, NVLink, NIC line rate; each spec names its sources). What real kernels reach
is kept apart from the peaks, per kind of work: `gemm_utilization` (projections and MLP, of the weight format's
peak), `attention_utilization` (the attention kernel's matmuls, of the 16-bit peak) and `collective_utilization`
(of the link bandwidths). The built-in GPUs carry the two compute utilisations fitted on the paper's runs
(fit.py, `FITTED`); `efficiency` is the user's one-factor override of both (`--efficiency`).
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
    """Latency of one hop of a message between two devices of a node (on the built-in GPUs NCCL's own figure for a
    ring hop over NVLink; on CPUs the measured latency of a whole message)."""
    inter_node_latency_s: float = 15e-6
    """Latency of one hop of a message to another node (on the built-in GPUs NCCL's figure for a network hop)."""
    collective_base_latency_s: float = 0.0
    """Fixed cost of one collective call or ring step's send and receive, on top of its hops (NCCL's base latency
    on the built-in GPUs; 0 on CPU specs, whose measured message latency holds all of it)."""
    kernel_launch_s: float = 0.0
    """Host cost of launching one kernel, paid once per kernel of a prefill step (a layer's kernels, a ring step's
    attention call and merge, the step's embedding, head and sampling); 0: not modelled (CPU specs measure the
    layers' whole cost instead)."""
    efficiency: float = 1.0
    """A further factor on both compute rates (`--efficiency` sets it and resets the two utilisations to 1, so the
    kernels run at efficiency x peak; 1 = the utilisations below alone)."""
    gemm_utilization: float = 1.0
    """Share of the weight format's peak the projections and MLP GEMMs reach (fitted for the built-in GPUs)."""
    attention_utilization: float = 1.0
    """Share of the attention peak the attention kernel's matmuls reach on long blocks (fitted for the built-in
    GPUs); short blocks reach less, by `attention_row_traffic`."""
    collective_utilization: float = 1.0
    """Share of the link bandwidths the collectives and ring transfers reach (1: line rate; not fitted)."""
    attention_row_traffic: bool = False
    """Count each query row's memory traffic per attention call at memory_bw (its Q read, its float32 partial and
    log-sum-exp written, and, past a ring's first step, the merge's read and write of the running output): what
    makes short key blocks per call reach less of peak on GPUs, and on a CPU what a ring's extra calls and merges
    cost against the all-gather's one call per rank."""
    shared_memory_bw: float | None = None
    """Bytes/s of the all-gathers and all-to-alls between ranks of one node where they go through shared memory
    (cpllm/distributed/shm_group.py: each rank's part copied into its slot and every part out again); None: they
    cross the node's links as its point-to-point messages do. The ring's messages stay on intra_node_bw."""
    utilization_source: str = ""
    """What the utilisations were fitted on ("" where they are not fitted); `cpllm plan` prints it."""
    source: str = ""
    """Where the peak figures come from (the built-in specs name the vendor's datasheet of each)."""
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
        if self.shared_memory_bw is not None and not self.shared_memory_bw > 0:
            raise ValueError(f"hardware {self.name!r}: shared_memory_bw must be > 0 or None, "
                             f"got {self.shared_memory_bw!r}")
        for name in ("intra_node_latency_s", "inter_node_latency_s", "collective_base_latency_s", "kernel_launch_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"hardware {self.name!r}: {name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("efficiency", "gemm_utilization", "attention_utilization", "collective_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"hardware {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)!r}")
        if not 0 < self.busy_node_fraction <= 1:
            raise ValueError(f"hardware {self.name!r}: busy_node_fraction must be in (0, 1], "
                             f"got {self.busy_node_fraction!r}")

    def with_efficiency(self, efficiency: float) -> "HardwareSpec":
        """The one-factor override: both compute rates at `efficiency` x peak (the fitted utilisations dropped)."""
        return dataclasses.replace(self, efficiency=efficiency, gemm_utilization=1.0, attention_utilization=1.0,
                                   utilization_source=f"--efficiency {efficiency:g} (one factor for GEMMs and "
                                                      "attention)")

    def with_utilizations(self, gemm: float, attention: float, source: str) -> "HardwareSpec":
        return dataclasses.replace(self, efficiency=1.0, gemm_utilization=gemm, attention_utilization=attention,
                                   utilization_source=source)

    def gemm_rate(self, weight_format: str) -> float:
        """FLOP/s the projections reach with weights in `weight_format`."""
        return self.linear_flops(weight_format) * self.gemm_utilization * self.efficiency

    def attention_rate(self) -> float:
        """FLOP/s the attention kernel's matmuls reach on long blocks."""
        return self.attention_peak() * self.attention_utilization * self.efficiency

    def linear_flops(self, weight_format: str) -> float:
        """Peak FLOP/s of the linear layers for weights in `weight_format` ("fp8", "bf16", "fp32")."""
        if weight_format == "fp8" and self.peak_flops_fp8 is not None:
            return self.peak_flops_fp8
        return self.peak_flops

    def attention_peak(self) -> float:
        return self.attention_flops if self.attention_flops is not None else self.peak_flops


GB = 1e9
FITTED_GEMM_UTILIZATION = 0.302
FITTED_ATTENTION_UTILIZATION = 0.572
FITTED_ON = ("fitted on arXiv 2411.01783: Table 7 CP1 (128K tokens, 1 node, 42.0 s) and the abstract's 1M tokens "
             "on 16 nodes (77 s); Llama 3 405B, FP8 weights, H100")
"""The H100's compute utilisations, fitted by fit.py on the two points FITTED_ON names (tests/test_planner.py
checks these constants are what the fit gives)."""
NCCL_LATENCY = dict(collective_base_latency_s=8.4e-6, intra_node_latency_s=3.4e-6, inter_node_latency_s=14e-6)
"""NCCL's latency figures for the protocol large messages take (Simple, ring): 8.4 us per call, 3.4 us per NVLink
hop, 14 us per network hop (InfiniBand / RoCE). Source: NCCL's own cost model, src/graph/tuning.cc (`baseLat`,
`hwLat`, ring / Simple), which NCCL measured on its hardware to choose between algorithms (NVIDIA/nccl, 2.18 to
2.2x). The same for H100, H200, H800 and A100 nodes (NCCL keeps one table for these GPUs)."""
CUDA_KERNEL_LAUNCH_S = 4e-6
"""Host cost of one CUDA kernel launch: a few microseconds per launch, the overhead NVIDIA measures for a stream of
short kernels launched one by one in "Getting Started with CUDA Graphs" (NVIDIA Technical Blog, 2019,
developer.nvidia.com/blog/cuda-graphs/); 4 us is taken, the upper end of that range (eager prefill, no graph)."""
_GPU_FIXED = dict(NCCL_LATENCY, kernel_launch_s=CUDA_KERNEL_LAUNCH_S)
_H100_FITTED = dict(gemm_utilization=FITTED_GEMM_UTILIZATION, attention_utilization=FITTED_ATTENTION_UTILIZATION,
                    attention_row_traffic=True, utilization_source=FITTED_ON, **_GPU_FIXED)
_CARRIED = dict(_H100_FITTED, utilization_source="the H100's, carried over (not fitted on this device): " + FITTED_ON)
BUILTIN: dict[str, HardwareSpec] = {
    "h100": HardwareSpec(
        name="h100", peak_flops=989.4e12, peak_flops_fp8=1978.9e12, memory_bytes=80 * GB, memory_bw=3.35e12,
        intra_node_bw=450 * GB, inter_node_bw=50 * GB, devices_per_node=8, **_H100_FITTED,
        source="NVIDIA H100 Tensor Core GPU datasheet, SXM5: 989 TFLOP/s BF16 and 1,979 FP8 dense (half the "
               "with-sparsity figures), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 each way); NVIDIA DGX H100 "
               "datasheet: one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s each way)"),
    "h200": HardwareSpec(
        name="h200", peak_flops=989.4e12, peak_flops_fp8=1978.9e12, memory_bytes=141 * GB, memory_bw=4.8e12,
        intra_node_bw=450 * GB, inter_node_bw=50 * GB, devices_per_node=8, **_CARRIED,
        source="NVIDIA H200 Tensor Core GPU datasheet, SXM: the H100's 989 / 1,979 TFLOP/s BF16 / FP8 dense, "
               "141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; NVIDIA DGX H200: one 400 Gb/s NIC per GPU"),
    "h800": HardwareSpec(
        name="h800", peak_flops=989.4e12, peak_flops_fp8=1978.9e12, memory_bytes=80 * GB, memory_bw=3.35e12,
        intra_node_bw=200 * GB, inter_node_bw=50 * GB, devices_per_node=8, **_CARRIED,
        source="NVIDIA H800 SXM5 (the export H100): the H100's 989 / 1,979 TFLOP/s BF16 / FP8 dense, 80 GB HBM3 "
               "at 3.35 TB/s, NVLink 400 GB/s (200 each way); one 400 Gb/s InfiniBand NIC per GPU, 50 GB/s, as "
               "the DeepSeek-V3 technical report (arXiv 2412.19437, section 3.2.2) states for its H800 nodes"),
    "a100": HardwareSpec(
        name="a100", peak_flops=312e12, memory_bytes=80 * GB, memory_bw=2.039e12, intra_node_bw=300 * GB,
        inter_node_bw=25 * GB, devices_per_node=8, **_CARRIED,
        source="NVIDIA A100 Tensor Core GPU datasheet, SXM4 80 GB: 312 TFLOP/s BF16 dense, no FP8, HBM2e at "
               "2,039 GB/s, NVLink 600 GB/s (300 each way); NVIDIA DGX A100 datasheet: one 200 Gb/s HDR "
               "InfiniBand NIC per GPU (25 GB/s each way)"),
    # This 2-core CPU machine, one rank per core (docs/platform.md "The CPUs"): fp32 matmul ~90 GFLOP/s on one thread,
    # memory copy ~11 GB/s, gloo point-to-point ~810 MiB/s, collective latency ~0.1 ms.
    # All-gathers and all-to-alls between ranks of one host go through shared memory: about 5 GB/s of a 2K-token
    # prefill's K/V parts copied in and out on one core (a step's gather profiled, docs/benchmarks.md issue 43).
    "cpu": HardwareSpec(name="cpu", peak_flops=90e9, memory_bytes=16 * GB, memory_bw=11 * GB,
                        intra_node_bw=0.85 * GB, inter_node_bw=0.85 * GB, devices_per_node=2,
                        intra_node_latency_s=100e-6, inter_node_latency_s=100e-6,
                        attention_row_traffic=True, shared_memory_bw=5 * GB,
                        source="measured on this machine (docs/platform.md)"),
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
