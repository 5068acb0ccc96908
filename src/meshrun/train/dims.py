"""Parallel dimensions: how the world splits into pipeline stages, data-parallel replicas,
data-parallel shards and tensor-parallel groups. Pure and validated (torchtitan's
ParallelDims is the model): one degree may be -1 and is inferred; an impossible layout is
refused with the whole product in the message."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MeshrunError

ORDER = ("pp", "dp_replicate", "dp_shard", "tp")  # outermost first: TP innermost, on NVLink neighbours


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world: int
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                "tp": self.tp}

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The device mesh's shape and names, degree-1 dimensions left out (a 1-D mesh for
        plain FSDP, 2-D for FSDP x TP, ...)."""
        dims = [(name, size) for name, size in self.sizes().items() if size > 1]
        if not dims:
            return (1,), ("dp_shard",)
        return tuple(s for _, s in dims), tuple(n for n, _ in dims)


def make_dims(world: int, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1, pp: int = 1,
              source: str = "flags", cp: int = 1) -> ParallelDims:
    values = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp}
    if cp != 1:
        values["cp"] = cp
    for name, v in values.items():
        if v == 0 or v < -1:
            raise MeshrunError(f"--{name.replace('_', '-')}={v}: must be >= 1, or -1 to infer it ({source})")
    unknown = [n for n, v in values.items() if v == -1]
    if len(unknown) > 1:
        raise MeshrunError(f"{' and '.join(unknown)} are both -1: only one degree can be inferred (hint: give the others)")
    known = 1
    for v in values.values():
        if v != -1:
            known *= v
    if unknown:
        if world % known:
            raise MeshrunError(f"{_product(values)} cannot equal WORLD_SIZE({world}): {world} is not divisible by "
                               f"{known} (hint: choose degrees whose product divides {world})")
        values[unknown[0]] = world // known
    total = values["dp_replicate"] * values["dp_shard"] * values["tp"] * values["pp"] * values.get("cp", 1)
    if total != world:
        raise MeshrunError(f"{_product(values)} = {total} != WORLD_SIZE({world}) "
                           "(hint: the degrees must multiply to the number of processes)")
    return ParallelDims(values["dp_replicate"], values["dp_shard"], values["tp"], values["pp"], world,
                        values.get("cp", 1))


def _product(values: dict[str, int]) -> str:
    return " * ".join(f"{n}({'?' if v == -1 else v})" for n, v in values.items())


def check_model_fits_dims(dims: ParallelDims, heads: int | None, layers: int | None,
                          micro_batch: int, pp_microbatches: int | None) -> None:
    """The model-side impossibilities, each with its numbers."""
    if dims.tp > 1 and heads is not None and heads % dims.tp:
        raise MeshrunError(f"--tp={dims.tp}: the model's {heads} attention heads do not split over {dims.tp} ranks "
                           f"(hint: a --tp that divides {heads})")
    if dims.pp > 1 and layers is not None and layers < dims.pp:
        raise MeshrunError(f"--pp={dims.pp}: the model has {layers} blocks, fewer than {dims.pp} stages "
                           f"(hint: --pp {layers} or less)")
    if dims.pp > 1:
        n = pp_microbatches or dims.pp
        if micro_batch % n:
            raise MeshrunError(f"--micro-batch={micro_batch}: does not split into {n} pipeline micro-batches "
                               f"(hint: a micro-batch that is a multiple of {n}, or --pp-microbatches)")
