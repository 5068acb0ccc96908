"""The GPUs the planner knows by name: their dense matmul peaks and memory (pure).

The step-time estimate divides a step's work by the card's peak (plan/steptime.py), so a plan
for an L4 must not assume an H100's. Figures are the vendors' datasheets' dense (no
structured sparsity: the datasheets' starred figures halved) tensor-core peaks with fp32
accumulation, the precision training accumulates in:

* H100 SXM, H100 PCIe, H100 NVL: NVIDIA H100 Tensor Core GPU datasheet (BF16 1,979 / 1,513 /
  1,671 and FP8 3,958 / 3,026 / 3,341 TFLOPS with sparsity; FP32 67 / 51 / 60);
* H200 SXM, H200 NVL: NVIDIA H200 Tensor Core GPU datasheet (the H100 SXM's and H100 NVL's
  figures, 141 GB);
* A100: NVIDIA A100 Tensor Core GPU datasheet (BF16 312 TFLOPS dense; no FP8; FP32 19.5);
* A10: NVIDIA A10 datasheet (BF16 125 TFLOPS dense; no FP8; FP32 31.2);
* L4: NVIDIA L4 datasheet (BF16 242, FP8 485 TFLOPS with sparsity; FP32 30.3);
* L40S: NVIDIA L40S datasheet (BF16 362.05, FP8 733 TFLOPS dense; FP32 91.6);
* GeForce RTX 4090: NVIDIA Ada Lovelace architecture whitepaper, appendix A (BF16 165.2, FP8
  330.3 TFLOPS dense with FP32 accumulate: half of its FP16-accumulate rate; FP32 82.6).

FP32 is the cards' non-tensor peak: meshrun leaves torch's default of full-precision fp32
matmuls (no TF32), so ``--precision fp32`` runs at it.

Memory bandwidth is the same datasheets' (H100 SXM 3.35, PCIe 2.0, NVL 3.9 TB/s; H200 4.8;
A100 80GB 2.039, 40GB 1.555; A10 600, L4 300, L40S 864, RTX 4090 1,008 GB/s); an unknown card
is assumed the slower H100 SXM's.

Memory is the datasheet's size read in GiB (the binary size the cards report to within 1%);
a --gpu-mem given, or the memory read on the machine, replaces it."""

from __future__ import annotations

import re
from dataclasses import dataclass

TERA = 1e12


@dataclass(frozen=True)
class Card:
    name: str  # as --gpu takes it
    title: str  # as the plan prints it
    bf16_tflops: float  # dense peak
    fp8_tflops: float | None  # dense peak; None: no float8 tensor cores (compute capability below 8.9)
    fp32_tflops: float  # non-tensor peak
    memory_gib: int
    bandwidth_tbs: float  # memory bandwidth, TB/s (what NF4's dequantization is bound by)

    @property
    def bf16_flops(self) -> float:
        return self.bf16_tflops * TERA

    @property
    def fp8_flops(self) -> float | None:
        return None if self.fp8_tflops is None else self.fp8_tflops * TERA

    @property
    def fp32_flops(self) -> float:
        return self.fp32_tflops * TERA

    @property
    def bandwidth(self) -> float:
        """Memory bandwidth, bytes/s."""
        return self.bandwidth_tbs * TERA

    @property
    def memory(self) -> int:
        return self.memory_gib * 2**30


CARDS: dict[str, Card] = {c.name: c for c in (
    Card("h100", "H100 SXM", 989.4, 1978.9, 67.0, 80, 3.35),
    Card("h100-pcie", "H100 PCIe", 756.5, 1513.0, 51.0, 80, 2.0),
    Card("h100-nvl", "H100 NVL", 835.5, 1670.5, 60.0, 94, 3.9),
    Card("h200", "H200 SXM", 989.4, 1978.9, 67.0, 141, 4.8),
    Card("h200-nvl", "H200 NVL", 835.5, 1670.5, 60.0, 141, 4.8),
    Card("a100", "A100 80GB", 312.0, None, 19.5, 80, 2.039),
    Card("a100-40gb", "A100 40GB", 312.0, None, 19.5, 40, 1.555),
    Card("a10", "A10", 125.0, None, 31.2, 24, 0.6),
    Card("l4", "L4", 121.0, 242.5, 30.3, 24, 0.3),
    Card("l40s", "L40S", 362.05, 733.0, 91.6, 48, 0.864),
    Card("rtx4090", "RTX 4090", 165.2, 330.3, 82.6, 24, 1.008),
)}

# What the step-time estimate assumes of a card it does not know (--gpu-mem alone, or a device
# name not in CARDS): the peaks of the cards meshrun's planner constants were measured on.
ASSUMED = Card("assumed", "H100/H200 SXM", 989.4, 1978.9, 67.0, 80, 3.35)

# A device's name as CUDA reports it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB",
# "NVIDIA GeForce RTX 4090") -> CARDS' name; the more specific patterns first.
_DEVICE_NAMES = (
    (r"\bh100\b.*\bnvl\b", "h100-nvl"), (r"\bh100\b.*\bpcie\b", "h100-pcie"), (r"\bh100\b", "h100"),
    (r"\bh200\b.*\bnvl\b", "h200-nvl"), (r"\bh200\b", "h200"),
    (r"\ba100\b.*\b40\s*gb\b", "a100-40gb"), (r"\ba100\b", "a100"),
    (r"\bl40s\b", "l40s"), (r"\bl4\b", "l4"), (r"\ba10\b", "a10"), (r"\brtx 4090\b", "rtx4090"),
)


def card_of_device(device_name: str) -> Card | None:
    """The card a CUDA device name is (None: one CARDS does not hold, such as an A10G, whose
    peaks NVIDIA does not publish)."""
    name = re.sub(r"[-_]", " ", device_name.lower())
    return next((CARDS[card] for pattern, card in _DEVICE_NAMES if re.search(pattern, name)), None)
