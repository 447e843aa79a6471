"""What the planner knows of GPUs and the links between them: memory bandwidth and size per GPU, and
per link its bandwidth and an all-reduce latency model. Every number names its source; a measured
`eaglet bench-comm` curve (`plan --comm`) replaces a link's model, `--efficiency` the default
fraction of peak bandwidth a decode step reaches."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidInput


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth_gb_s: float  # peak memory bandwidth, 1e9 bytes/s
    memory_gb: float
    source: str


@dataclass(frozen=True)
class Link:
    """A GPU-to-GPU link and NCCL's latency model of a ring all-reduce over it for small messages:
    t(N, n) = base + 2(N - 1) x hop + n x 2(N - 1)/N / bandwidth (a ring all-reduce takes 2(N - 1)
    steps, each moving 1/N of the message; the bus bandwidth is taken as the link's own)."""
    name: str
    bandwidth_gb_s: float  # per direction, per GPU
    base_us: float  # fixed cost of one all-reduce
    hop_us: float  # each of its 2(N - 1) ring steps
    source: str

    def allreduce_us(self, ranks: int, nbytes: float) -> float:
        if ranks == 1:
            return 0.0
        steps = 2 * (ranks - 1)
        return self.base_us + steps * self.hop_us + nbytes * steps / ranks / (self.bandwidth_gb_s * 1e3)


GPUS = {g.name: g for g in (
    GPU("h100-sxm", 3350, 80, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s "
                              "(https://www.nvidia.com/en-us/data-center/h100/)"),
    GPU("h100-pcie", 2000, 80, "NVIDIA H100 Tensor Core GPU datasheet (2022), H100 PCIe: 80 GB HBM2e, 2 TB/s "
                               "(https://www.nvidia.com/en-us/data-center/h100/)"),
    GPU("h200", 4800, 141, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 141 GB HBM3e, 4.8 TB/s "
                           "(https://www.nvidia.com/en-us/data-center/h200/)"),
    GPU("b200", 8000, 180, "NVIDIA DGX B200 datasheet: 8 GPUs, 1,440 GB HBM3e and 64 TB/s in all, 180 GB and "
                           "8 TB/s each (https://www.nvidia.com/en-us/data-center/dgx-b200/)"),
    GPU("rtx-pro-6000", 1597, 96, "NVIDIA RTX PRO 6000 Blackwell Server Edition datasheet: 96 GB GDDR7, "
                                  "1,597 GB/s (https://www.nvidia.com/en-us/data-center/rtx-pro-6000-blackwell-"
                                  "server-edition/)"),
    GPU("rtx-pro-6000-ws", 1792, 96, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition datasheet: 96 GB GDDR7, "
                                     "512-bit, 1,792 GB/s (https://www.nvidia.com/en-us/products/workstations/"
                                     "professional-desktop-gpus/rtx-pro-6000/)"),
    GPU("l40s", 864, 48, "NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s "
                         "(https://www.nvidia.com/en-us/data-center/l40s/)"),
)}

# Latency: NCCL's own model, the one it picks algorithm and protocol by (NVIDIA/nccl
# src/graph/tuning.cc, `baseLat` and `hwLat`, ring algorithm, LL protocol: what small messages run):
# 6.6 us a call plus 0.6 us a ring step over NVLink, 1.0 us over PCI. Over PCIe this is a floor: boxes
# whose GPUs talk through a host bridge or across CPU sockets measure more (an engineering estimate
# from NCCL's model alone; `eaglet bench-comm --tp N` measures the real curve, `plan --comm` uses it).
NCCL_RING_LL_BASE_US = 6.6
NCCL_NVLINK_HOP_US = 0.6
NCCL_PCI_HOP_US = 1.0

LINKS = {link.name: link for link in (
    Link("nvlink4", 450, NCCL_RING_LL_BASE_US, NCCL_NVLINK_HOP_US,
         "NVLink 4 as on H100/H200 HGX: 900 GB/s a GPU, both directions (H100 and H200 datasheets); latency: "
         "NCCL tuning.cc"),
    Link("nvlink5", 900, NCCL_RING_LL_BASE_US, NCCL_NVLINK_HOP_US,
         "NVLink 5 as on HGX B200: 1.8 TB/s a GPU, both directions (DGX B200 datasheet); latency: NCCL tuning.cc"),
    Link("pcie4", 31.5, NCCL_RING_LL_BASE_US, NCCL_PCI_HOP_US,
         "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b coding, 31.5 GB/s a direction (PCI-SIG PCI Express Base "
         "Specification 4.0); latency: NCCL tuning.cc"),
    Link("pcie5", 63, NCCL_RING_LL_BASE_US, NCCL_PCI_HOP_US,
         "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b coding, 63 GB/s a direction (PCI-SIG PCI Express Base "
         "Specification 5.0); latency: NCCL tuning.cc"),
)}

# The fraction of peak bandwidth a decode step streams weights at, eaglet's own: the Llama-3.1-8B shape
# decodes at 243.8 tok/s on one H200, reading 15,085,346,816 bytes a token (weights and cache), 3.68 TB/s:
# 0.766 of the datasheet's 4.8 TB/s (93% of the 3.95 TB/s the same run's copy measured). Record
# bench/results/bench-shape-llama-3.1-8b-gpu-20261201-092450.json, BENCHMARKS.md "Llama-3.1-8B shape".
DEFAULT_EFFICIENCY = 0.766


def gpu(name: str) -> GPU:
    if name not in GPUS:
        raise InvalidInput(f"--gpu {name}: unknown (choose from {', '.join(GPUS)})")
    return GPUS[name]


def link(name: str) -> Link:
    if name not in LINKS:
        raise InvalidInput(f"--link {name}: unknown (choose from {', '.join(LINKS)})")
    return LINKS[name]
