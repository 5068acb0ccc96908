"""The topology options (--nnodes, --nproc, --master-addr, ...): declared with ``option()`` as
every other option, read from a flag, a MESHRUN_<NAME> variable, a config file's key or a
``meshrun.train(...)`` keyword by ``options.read``, and turned into the overrides detection
applies (detect.Overrides), each remembering where it came from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..errors import bad_value
from ..options import ENV_PREFIX, INTERNAL_VARIABLES, check_all, flag, option, option_fields, read, where
from .detect import PLATFORMS, Overrides

_PLATFORM_HELP = f"skip detection: one of {', '.join(PLATFORMS)}, or a platform of MESHRUN_PLATFORMS"


@dataclass(frozen=True)
class TopologyOptions:
    """What the user may say of the topology, over what the platform says."""

    platform: str | None = option(None, _PLATFORM_HELP, metavar="NAME")
    nnodes: str | None = option(None, "number of nodes; MIN:MAX for an elastic job", metavar="N|MIN:MAX")
    node_rank: int | None = option(None, "this node's rank, 0..nnodes-1", metavar="R", minimum=0)
    nproc_per_node: int | None = option(None, "processes on this node (default: one per visible GPU; 2 on a "
                                        "CPU-only machine)", metavar="G", minimum=1)
    master_addr: str | None = option(None, "node 0's address (rendezvous host)", metavar="HOST")
    master_port: int | None = option(None, "rendezvous port (default 29500)", metavar="PORT", minimum=1,
                                     maximum=65535)
    hosts: str | None = option(None, "every node's address in node-rank order", metavar="H0,H1,..", listed=True)
    run_id: str | None = option(None, "rendezvous id shared by the job's nodes", metavar="ID")


TOPOLOGY_OPTIONS = tuple(f.name for f in fields(TopologyOptions))


@dataclass(frozen=True)
class UserTopology:
    platform: str | None
    overrides: Overrides
    elastic: tuple[int, int] | None  # torchrun's MIN:MAX node range, when given


def parse_int(raw: str, source: str, minimum: int = 0) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise bad_value(source, raw, "not an integer", "give a whole number") from None
    if value < minimum:
        raise bad_value(source, raw, f"must be >= {minimum}")
    return value


def provenance(name: str, source: str) -> str:
    """Where a topology value came from, as `meshrun env` shows it beside the platform's own
    (``flag --nnodes``, ``env MESHRUN_NNODES``; ``--nnodes (from config FILE)``)."""
    return f"flag {flag(name)}" if source == "flag" else source if source.startswith("env ") else where(name, source)


def user_topology(given: Mapping[str, Any], env: Mapping[str, str], given_source: str = "flag",
                  file_values: Mapping[str, Any] | None = None, file_name: str | None = None,
                  fixed_nodes: str | None = None) -> UserTopology:
    """The topology options a user set (options.read: a config file's keys < MESHRUN_<NAME> <
    ``given``), checked, as the overrides detection applies. ``fixed_nodes``: the command, when
    it takes a fixed node count (a node range MIN:MAX is for torchrun's elastic jobs)."""
    values, sources = read(TopologyOptions, file_values or {}, file_name, env, given, given_source)
    check_all(TopologyOptions, values, sources)
    nnodes, elastic = None, None
    if "nnodes" in values:
        raw, src = values["nnodes"], where("nnodes", sources["nnodes"])
        if ":" in raw and fixed_nodes:
            raise bad_value(src, raw, f"{fixed_nodes} takes a fixed number of nodes", "give N, not MIN:MAX")
        if ":" in raw:
            lo_s, _, hi_s = raw.partition(":")
            lo, hi = parse_int(lo_s, src, 1), parse_int(hi_s, src, 1)
            if lo > hi:
                raise bad_value(src, raw, "MIN is larger than MAX", "write MIN:MAX, e.g. 1:4")
            elastic, nnodes = (lo, hi), hi
        else:
            nnodes = parse_int(raw, src, 1)
    hosts = tuple(h.strip() for h in values["hosts"].split(",") if h.strip()) if "hosts" in values else None
    origin = {k: provenance(k, src) for k, src in sources.items() if k != "platform"}
    overrides = Overrides(nnodes=nnodes, node_rank=values.get("node_rank"), nproc_per_node=values.get("nproc_per_node"),
                          master_addr=values.get("master_addr"), master_port=values.get("master_port"), hosts=hosts,
                          run_id=values.get("run_id"), sources=origin)
    return UserTopology(values.get("platform"), overrides, elastic)


__all__ = ["ENV_PREFIX", "INTERNAL_VARIABLES", "TOPOLOGY_OPTIONS", "TopologyOptions", "UserTopology", "option_fields",
           "parse_int", "user_topology"]
