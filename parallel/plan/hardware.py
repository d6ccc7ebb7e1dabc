"""GPU kinds and clusters: the constants the planner's cost model reads, with where each was read.

Per GPU: dense 16-bit matrix peak, memory, HBM bandwidth, NVLink bandwidth per direction, and the inter-node
bandwidth of the NIC each GPU has (rail-optimised clusters: one NIC per GPU). Sources are in
../shared/planner/published.md, table D, which cites each (NVIDIA datasheets as quoted by torchtitan's
`tools/utils.py`, glennklockwood.com, Narayanan et al. 2021 section 5 for Selene's InfiniBand).

The efficiencies are what a kind reaches of those peaks in training, named and set once per kind. They
were set for the A100 by fitting the 18 published A100 rows (docs/planner.md says how): matrix
multiplies follow eff(x) = MM_MAX x / (x + MM_HALF), x the width a GPU's share of a layer's matrices has
(h / tp), which is why wide models reach more of the peak. The H100, H200 and B200 take the A100's
efficiencies (the H100's and H200's NVLink excepted, from NCCL's measured bus bandwidth; and their matrix
multiplies, which reach less of their higher peak at a given width, timed on one H100): no published
training run of theirs was read (docs/planner.md, "what it does not model").

A step also pays the host: every kernel is launched from Python through the dispatcher, about 29 µs each
in eager PyTorch (`launch_s`, fitted to a bare loop on one H100). A calibration on the user's GPU scales
the compute and the overhead of a kind with `Efficiency.scaled` (docs/planner.md, "One GPU").
"""

from __future__ import annotations

import dataclasses

from parallel.measure.formulas import ring_seconds

GiB = 2**30


# Fitted to a bare loop on GPT-2 small, one H100 (docs/planner.md, "One GPU"): a host's figure, so every kind
# takes it until calibrated.
LAUNCH_S = 29e-6


@dataclasses.dataclass(frozen=True)
class Efficiency:
    mm_max: float = 0.80  # matrix multiplies: the share of peak a very wide one reaches
    mm_half: float = 50.0  # ... and the width h/tp at which it reaches half of that
    memory: float = 0.90  # elementwise kernels (norms, softmax, dropout, GELU, Adam): share of HBM bandwidth
    nvlink: float = 0.65  # NCCL ring collectives inside a node: share of NVLink's bandwidth per direction
    network: float = 0.85  # ... across nodes: share of the NIC's bandwidth
    latency_s: float = 20e-6  # per ring step of a collective, and per pipeline hand-off
    launch_s: float = LAUNCH_S  # host seconds per kernel launched (eager PyTorch), the floor under each piece
    gap_s: float = 0.0  # the GPU idle between two kernels back to back (the A100's fitted efficiencies hold it)
    per_gemm: bool = False  # matmul(x): x each product's contraction (timed so) or the layer's width h/tp (fitted)
    attention: float = 0.0  # the share of peak a fused attention kernel reaches; 0: matmul(h/tp)'s (fitted so)

    def matmul(self, width: float) -> float:
        return self.mm_max * width / (width + self.mm_half)

    def scaled(self, compute: float = 1.0, overhead: float = 1.0) -> Efficiency:
        """These efficiencies for a GPU whose device work takes `compute` times the predicted time (matrix
        multiplies and memory-bound kernels alike) and whose per-kernel costs (the host's launch, the GPU's
        gap) take `overhead` times: what a calibration on a measured step sets."""
        if compute <= 0 or overhead < 0:
            raise ValueError(f"compute {compute:g} must be positive and overhead {overhead:g} not negative")
        return dataclasses.replace(self, mm_max=self.mm_max / compute, memory=self.memory / compute,
                                   attention=self.attention / compute,
                                   launch_s=self.launch_s * overhead, gap_s=self.gap_s * overhead)


# NVLink 4 through NVSwitch (H100, H200): NCCL's all-reduce bus bandwidth on 8 x H200 is 347 GB/s at 64 MiB
# (stas00/ml-engineering, as ../shared/FIELD-NOTES.md quotes it), 0.77 of 450 GB/s per direction. Their
# matrix multiplies, timed in bf16 on one H100 (torch 2.11, 2026-11-26, 16384 or 8192 rows), follow
# 0.80 w / (w + 256) of the 989 peak, w the contraction: 593 TFLOP/s at 768 (timed 567-679 as the output
# widens from 768 to 50304), 730 at 3072 (727), 760 at 6144 (764), 767 at 8192 (718). The A100's
# half-width, 50, would give 742 at 768. Between kernels the H100 idled 2.7 µs each (GPT-2 small, micro-batch
# 16: 55.6 ms a step, 52.2 of them in its 1,278 kernels, the profiler's sum).
# The rest of their efficiencies are the A100's (no published run of theirs was read).
# Their flash attention: FlashAttention-2 on an H100 SXM5 ran 319 TFLOP/s forward at head dim 128, causal, 4K
# tokens (Shah et al. 2024, FlashAttention-3, its figure of attention forward speed; causal FLOPs halved, as
# the planner counts them under flash): 0.32 of the peak, which the planner takes forward and backward.
GH100 = Efficiency(nvlink=0.77, mm_half=256.0, gap_s=2.7e-6, per_gemm=True, attention=0.32)


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    peak: float  # dense bf16/fp16 matrix FLOP/s
    peak_fp32: float  # TF32 matrix FLOP/s (what fp32 matmuls run at with TF32 allowed)
    memory_gib: float
    hbm: float  # bytes/s
    nvlink: float  # bytes/s per direction per GPU
    network: float  # bytes/s per GPU across nodes
    source: str
    efficiency: Efficiency = Efficiency()


GPUS = {g.name: g for g in (
    Gpu("a100-40gb", 312e12, 156e12, 40, 1555e9, 300e9, 25e9,
        "312 TF (Narayanan §5, torchtitan); 1,555 GB/s, NVLink 600 GB/s both ways (NVIDIA datasheet via "
        "glennklockwood.com); HDR 200 Gb/s per GPU (Selene, Narayanan §5)"),
    Gpu("a100-80gb", 312e12, 156e12, 80, 2039e9, 300e9, 25e9,
        "as the 40 GB; HBM2e 2,039 GB/s (NVIDIA datasheet via glennklockwood.com)"),
    Gpu("h100", 989e12, 494.5e12, 80, 3350e9, 450e9, 50e9,
        "H100 SXM: 989 TF dense (torchtitan utils), 3.35 TB/s, NVLink 900 GB/s both ways, 400 Gb/s NIC",
        GH100),
    Gpu("h200", 989e12, 494.5e12, 141, 4800e9, 450e9, 50e9,
        "H200 SXM: 989 TF dense (torchtitan utils; 1,979 is the sparse figure), 141 GB, 4.8 TB/s, 400 Gb/s",
        GH100),
    Gpu("b200", 2250e12, 1125e12, 180, 8000e9, 900e9, 50e9,
        "HGX B200: 2,250 TF dense (torchtitan utils, NVIDIA Blackwell datasheet), 180 GB (sources differ: "
        "179-192), 8 TB/s, NVLink 1.8 TB/s both ways; 400 Gb/s NIC assumed (no source read)"),
)}


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: Gpu
    gpus: int
    per_node: int = 8

    def peak(self, precision: str) -> float:
        return self.gpu.peak_fp32 if precision == "fp32" else self.gpu.peak

    def matmul_rate(self, precision: str, width: float) -> float:
        """FLOP/s a GPU's matrix multiplies reach on a layer `width` wide on it (h / tp)."""
        return self.peak(precision) * self.gpu.efficiency.matmul(width)

    def link(self, span: int) -> float:
        """Bytes/s a ring of `span` consecutive ranks moves per GPU: a group that fits in a node rides
        NVLink; one that spans nodes is held to each GPU's NIC."""
        e = self.gpu.efficiency
        return self.gpu.nvlink * e.nvlink if span <= self.per_node else self.gpu.network * e.network

    def collective_s(self, kind: str, nbytes: float, n: int, span: int | None = None) -> float:
        """Seconds of one ring collective of `nbytes` (the whole tensor) over `n` ranks whose group spans
        `span` consecutive ranks (n by default): all-reduce moves 2(n-1)/n of it per GPU, all-gather and
        reduce-scatter (n-1)/n, all-to-all (n-1)/n, send 1."""
        return ring_seconds(kind, nbytes, n, self.gpu.efficiency.latency_s, 1 / self.link(span or n))


def cluster(gpus: int, gpu: str = "a100-80gb", per_node: int = 8, **override) -> Cluster:
    """A cluster of `gpus` of a kind, with any Gpu field (nvlink, network, hbm, peak...) overridden."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu}: not a GPU kind the planner knows ({', '.join(GPUS)})")
    kind = dataclasses.replace(GPUS[gpu], **{k: v for k, v in override.items() if v is not None})
    return Cluster(kind, gpus, per_node)
