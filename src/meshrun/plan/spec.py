"""The cluster and the training settings a plan is made for (validated, frozen)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import bad_value
from ..vocab import AC_MODES, FLOAT8_PRECISIONS, PRECISIONS
from .adapters import Adapters
from .cards import ASSUMED, Card

# Per-GPU bandwidths in bytes/s, the "bus bandwidth" a ring collective reaches (what
# nccl-tests reports as busbw). Datasheet-derived defaults; `meshrun doctor` measures them.
INTRA_NODE = {"nvlink": 360e9, "pcie": 20e9}
INTER_NODE = {"ib": 45e9, "efa": 40e9, "ethernet": 10e9}  # per GPU: 400 Gb/s IB per GPU, 100 Gb/s shared
# optimizer-state bytes per parameter (fp32 m, v / momentum / 8-bit m, v)
OPTIMIZERS = {"adamw": 8, "sgd": 4, "adam8bit": 2}


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    gpus_per_node: int
    gpu_mem: int  # bytes per GPU
    cpu_mem: int | None = None  # bytes per node, for offload
    intra_bw: float = INTRA_NODE["nvlink"]
    inter_bw: float = INTER_NODE["ib"]
    card: Card | None = None  # the GPU model, for its peaks; None: not known (ASSUMED's peaks)
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_flops(self) -> float:
        """The card's dense bf16 peak, FLOP/s (an unknown card's: ASSUMED's)."""
        return (self.card or ASSUMED).bf16_flops

    @property
    def gpu_bandwidth(self) -> float:
        """The card's memory bandwidth, bytes/s (an unknown card's: ASSUMED's)."""
        return (self.card or ASSUMED).bandwidth

    @property
    def gpu_fp32_flops(self) -> float:
        """The card's fp32 peak (no tensor cores: meshrun leaves TF32 off), FLOP/s."""
        return (self.card or ASSUMED).fp32_flops

    @property
    def gpu_fp8_flops(self) -> float | None:
        """The card's dense float8 peak, FLOP/s; None: it has no float8 matmuls."""
        return (self.card or ASSUMED).fp8_flops

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "flag")


@dataclass(frozen=True)
class TrainSpec:
    seq_len: int
    micro_batch: int | None  # None: the planner picks the largest that fits
    global_batch: int | None  # None: micro x data-parallel size (no accumulation)
    precision: str = "bf16"  # or fp8 / fp8-rowwise: bf16 with float8 matmuls (plan/float8.py)
    optimizer: str = "adamw"
    activation_checkpointing: str | None = None  # None: try both
    compile: bool = True  # meshrun train compiles on GPUs by default
    max_micro_batch: int | None = None  # when the planner picks the micro-batch: no larger than this
    # compiled in one graph under single/DDP (meshrun's GPT, a user's module); a Hugging Face
    # model is compiled block by block, its forward and loss eager (training/parallel/apply.py)
    whole_compile: bool = True
    adapters: Adapters | None = None  # low-rank adapters train, the rest frozen (plan/adapters.py); None: all trains

    @property
    def dtype(self) -> str:
        """The dtype the model computes in: fp32, or bf16 (float8 runs keep bf16 elsewhere)."""
        return "fp32" if self.precision == "fp32" else "bf16"

    @property
    def float8(self) -> bool:
        return self.precision in FLOAT8_PRECISIONS

    @property
    def optimizer_bytes(self) -> int:
        return OPTIMIZERS[self.optimizer]


def validate_cluster(c: ClusterSpec) -> ClusterSpec:
    for name in ("nodes", "gpus_per_node"):
        value = getattr(c, name)
        if value < 1:
            raise bad_value(f"--{name.replace('_', '-')}", value, "must be >= 1")
    return c


def validate_train(t: TrainSpec, max_seq: int | None) -> TrainSpec:
    if t.seq_len < 1:
        raise bad_value("--seq-len", t.seq_len, "must be >= 1")
    for name in ("micro_batch", "global_batch"):
        value = getattr(t, name)
        if value is not None and value < 1:
            raise bad_value(f"--{name.replace('_', '-')}", value, "must be >= 1")
    if t.precision not in (*PRECISIONS, *FLOAT8_PRECISIONS):
        raise bad_value("--precision", t.precision, "unknown", f"one of {', '.join((*PRECISIONS, *FLOAT8_PRECISIONS))}")
    if t.optimizer not in OPTIMIZERS:
        raise bad_value("--optimizer", t.optimizer, "unknown", f"one of {', '.join(OPTIMIZERS)}")
    if t.activation_checkpointing not in (None, *AC_MODES):
        raise bad_value("--activation-checkpointing", t.activation_checkpointing, "unknown",
                        f"one of {', '.join(AC_MODES)}")
    if max_seq is not None and t.seq_len > max_seq and max_seq > 0:
        raise bad_value("--seq-len", t.seq_len, f"is longer than the model's {max_seq} positions",
                        f"use --seq-len {max_seq} or less")
    return t
