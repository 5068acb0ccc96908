"""Parallel dimensions: how the world splits into pipeline stages, data-parallel replicas,
data-parallel shards and tensor-parallel groups. Pure and validated (torchtitan's
ParallelDims is the model): one degree may be -1 and is inferred; an impossible layout is
refused with the whole product in the message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import MeshrunError

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first: TP innermost, on NVLink neighbours


@dataclass(frozen=True)
class ParallelDims:
    """The degrees; ``ep`` splits the data-parallel shard ranks into expert groups (edp x ep)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world: int
    cp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Ranks that read different data (context-parallel ranks read parts of the same)."""
        return self.dp_replicate * self.dp_shard

    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                "tp": self.tp}

    def build(self, device_type: str, keep: tuple[str, ...] = ("dp_shard",)) -> Meshes:
        """The one world mesh every sub-mesh comes from: the dimensions of degree > 1 in ORDER,
        and those in ``keep`` at any degree (tensor parallelism wants FSDP2 over a data-parallel
        dimension even of one rank, so that every parameter is a DTensor of one mesh). Under
        expert parallelism dp_shard is laid out as (edp, ep): ep consecutive ranks share out
        the experts, edp holds the ranks with the same ones."""
        from torch.distributed.device_mesh import init_device_mesh

        dims: list[tuple[str, int]] = []
        for name, size in self.sizes().items():
            if size == 1 and name not in keep:
                continue
            if name == "dp_shard" and self.ep > 1:
                dims += [("edp", size // self.ep), ("ep", self.ep)]
            else:
                dims.append((name, size))
        if not dims:
            dims = [("dp_shard", 1)]
        world = init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        return Meshes(world, self)


class Meshes:
    """Named views of the world mesh: each dimension, and the flattened ones the layouts need
    ("dp_shard" under expert parallelism, "dp_shard_cp" for FSDP2 under context parallelism,
    "dp_shard_tp" for the gradient norm under FSDP2 x TP)."""

    def __init__(self, world: Any, dims: ParallelDims) -> None:
        self.world, self.dims = world, dims
        self.names: tuple[str, ...] = tuple(world.mesh_dim_names)
        self._flat: dict[str, Any] = {}
        if "ep" in self.names:
            self._flat["dp_shard"] = world[("edp", "ep")]._flatten("dp_shard")
        if "cp" in self.names and "dp_shard" in self.names:
            self._flat["dp_shard_cp"] = world[("dp_shard", "cp")]._flatten("dp_shard_cp")
        if "tp" in self.names and "dp_shard" in self.names:
            # FSDP2 x TP: the tensor-parallel parameters are DTensors of (dp_shard, tp), and
            # their gradient norm is partial over both. With this flattened mesh at hand
            # DTensor sums it in one all-reduce over both instead of one per dimension in turn.
            self._flat["dp_shard_tp"] = world[("dp_shard", "tp")]._flatten("dp_shard_tp")

    def __getitem__(self, name: str) -> Any:
        return self._flat[name] if name in self._flat else self.world[name]

    def fsdp(self) -> Any:
        """The mesh FSDP2 shards over: (dp_replicate, dp_shard) for hybrid sharding, the
        data- and context-parallel ranks together under CP (both average gradients), else
        dp_shard."""
        if "dp_replicate" in self.names:
            return self.world[("dp_replicate", "dp_shard")]
        return self["dp_shard_cp" if "cp" in self.names else "dp_shard"]

    def data_rank(self) -> int:
        """This rank's place among the ranks that read different data (dp_replicate x dp_shard)."""
        coord = dict(zip(self.names, self.world.get_coordinate() or ()))
        shard = coord.get("edp", 0) * self.dims.ep + coord.get("ep", 0) if "ep" in self.names \
            else coord.get("dp_shard", 0)
        return int(coord.get("dp_replicate", 0) * self.dims.dp_shard + shard)


def make_dims(world: int, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1, pp: int = 1,
              source: str = "flags", cp: int = 1, ep: int = 1) -> ParallelDims:
    values = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp}
    if cp != 1:
        values["cp"] = cp
    for name, v in values.items():
        if v == 0 or v < -1:
            raise MeshrunError(f"--{name.replace('_', '-')}={v}: must be >= 1, or -1 to infer it ({source})")
    unknown = [n for n, v in values.items() if v == -1]
    if len(unknown) > 1:
        raise MeshrunError(f"{' and '.join(unknown)} are both -1: only one degree can be inferred "
                           "(hint: give the others)")
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
    if ep > 1 and values["dp_shard"] % ep:
        raise MeshrunError(f"--ep={ep}: does not divide the {values['dp_shard']} data-parallel ranks ({source}) "
                           "(hint: a divisor)")
    return ParallelDims(values["dp_replicate"], values["dp_shard"], values["tp"], values["pp"], world,
                        values.get("cp", 1), ep)


def _product(values: dict[str, int]) -> str:
    return " * ".join(f"{n}({'?' if v == -1 else v})" for n, v in values.items())
