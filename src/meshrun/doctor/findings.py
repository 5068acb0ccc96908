"""A finding: ok / warn / fail, one line of reason, one line of fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass

ORDER = {"ok": 0, "info": 0, "warn": 1, "fail": 2}


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok | warn | fail | info
    reason: str
    fix: str = ""
    node: int | None = None  # set when gathered from several nodes

    def to_dict(self) -> dict[str, str | int]:
        return {k: v for k, v in asdict(self).items() if v not in ("", None)}


def worst(findings: list[Finding]) -> str:
    return max((f.status for f in findings), key=lambda s: ORDER[s], default="ok")
