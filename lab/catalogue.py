"""RTX cards the lab can simulate, with public figures and where each comes from.

Sources (public product and architecture documents):
- [ada-wp] NVIDIA Ada GPU Architecture whitepaper v2.1 (2023), appendix tables for RTX 4090,
  RTX 4080 and RTX 6000 Ada: CUDA cores, boost clock, memory size, memory bandwidth, TGP/TBP,
  peak FP16 tensor TFLOPS with FP32 accumulate (dense).
- [ampere-wp] NVIDIA Ampere GA102 GPU Architecture whitepaper v2 (2021), table 9: RTX 3090.
- [nv-4070ti] nvidia.com GeForce RTX 4070 Ti product specifications page (2023).
- [pci-ids] The PCI ID Repository (pci-ids.ucw.cz), vendor 10de: device ids.
- [smi] Memory totals as nvidia-smi reports them (MiB), from public nvidia-smi captures of these
  cards: a card shows slightly less than its nominal size.

Relative throughput is what the lab's service-time model scales by. LLM decode is bound by
memory bandwidth and prefill by tensor throughput, so both figures are kept; ``relative_decode``
and ``relative_prefill`` are normalised to the RTX 4090.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Card:
    model: str  # as NVML names it
    architecture: str
    pci_device_id: int  # [pci-ids], vendor 0x10de
    cuda_cc: str
    memory_total_bytes: int  # [smi]
    memory_bandwidth_gbps: float  # GB/s
    fp16_tensor_tflops: float  # dense, FP32 accumulate
    cuda_cores: int
    boost_clock_mhz: int
    max_sm_clock_mhz: int  # highest SM clock NVML reports (above boost: GPU Boost headroom)
    memory_clock_mhz: int  # as nvidia-smi shows it (effective / 2 for GDDR6X)
    power_limit_watts: float  # default TGP / TBP
    source: str

    @property
    def relative_decode(self) -> float:
        return self.memory_bandwidth_gbps / CARDS["RTX 4090"].memory_bandwidth_gbps

    @property
    def relative_prefill(self) -> float:
        return self.fp16_tensor_tflops / CARDS["RTX 4090"].fp16_tensor_tflops


CARDS: dict[str, Card] = {
    "RTX 4090": Card(
        model="NVIDIA GeForce RTX 4090",
        architecture="Ada Lovelace",
        pci_device_id=0x2684,
        cuda_cc="8.9",
        memory_total_bytes=24564 * MIB,
        memory_bandwidth_gbps=1008.0,
        fp16_tensor_tflops=165.2,
        cuda_cores=16384,
        boost_clock_mhz=2520,
        max_sm_clock_mhz=3120,
        memory_clock_mhz=10501,
        power_limit_watts=450.0,
        source="[ada-wp] table 2; [pci-ids]; [smi]",
    ),
    "RTX 4080": Card(
        model="NVIDIA GeForce RTX 4080",
        architecture="Ada Lovelace",
        pci_device_id=0x2704,
        cuda_cc="8.9",
        memory_total_bytes=16376 * MIB,
        memory_bandwidth_gbps=716.8,
        fp16_tensor_tflops=97.5,
        cuda_cores=9728,
        boost_clock_mhz=2505,
        max_sm_clock_mhz=3105,
        memory_clock_mhz=11201,
        power_limit_watts=320.0,
        source="[ada-wp] table 3; [pci-ids]; [smi]",
    ),
    "RTX 3090": Card(
        model="NVIDIA GeForce RTX 3090",
        architecture="Ampere",
        pci_device_id=0x2204,
        cuda_cc="8.6",
        memory_total_bytes=24576 * MIB,
        memory_bandwidth_gbps=936.2,
        fp16_tensor_tflops=35.6,
        cuda_cores=10496,
        boost_clock_mhz=1695,
        max_sm_clock_mhz=2100,
        memory_clock_mhz=9751,
        power_limit_watts=350.0,
        source="[ampere-wp] table 9; [pci-ids]; [smi]",
    ),
    "RTX 4070 Ti": Card(
        model="NVIDIA GeForce RTX 4070 Ti",
        architecture="Ada Lovelace",
        pci_device_id=0x2782,
        cuda_cc="8.9",
        memory_total_bytes=12282 * MIB,
        memory_bandwidth_gbps=504.2,
        fp16_tensor_tflops=80.2,
        cuda_cores=7680,
        boost_clock_mhz=2610,
        max_sm_clock_mhz=3105,
        memory_clock_mhz=10501,
        power_limit_watts=285.0,
        source="[nv-4070ti]; [pci-ids]; [smi]",
    ),
    "RTX 6000 Ada": Card(
        model="NVIDIA RTX 6000 Ada Generation",
        architecture="Ada Lovelace",
        pci_device_id=0x26B1,
        cuda_cc="8.9",
        memory_total_bytes=49140 * MIB,
        memory_bandwidth_gbps=960.0,
        fp16_tensor_tflops=364.2,
        cuda_cores=18176,
        boost_clock_mhz=2505,
        max_sm_clock_mhz=3105,
        memory_clock_mhz=10001,
        power_limit_watts=300.0,
        source="[ada-wp] table 4; [pci-ids]; [smi]",
    ),
}


def card(name: str) -> Card:
    try:
        return CARDS[name]
    except KeyError:
        raise ValueError(f"unknown card {name!r}; known: {', '.join(CARDS)}") from None
