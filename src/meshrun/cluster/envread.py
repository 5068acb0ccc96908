"""Typed reads from an environment mapping that remember where each value came from."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import bad_value


class EnvReader:
    """Reads variables from ``env`` and records ``field -> 'env NAME'`` for ``meshrun env``.

    Detectors use it so that a bad value is reported with the variable that carried it,
    and so that the provenance table is built as a side product of reading.
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.sources: dict[str, str] = {}

    def has(self, *names: str) -> bool:
        return all(self.env.get(n, "").strip() != "" for n in names)

    def any(self, *names: str) -> bool:
        return any(self.env.get(n, "").strip() != "" for n in names)

    def note(self, field: str, source: str) -> None:
        self.sources[field] = source

    def opt_str(self, name: str, field: str | None = None) -> str | None:
        value = self.env.get(name, "").strip()
        if value == "":
            return None
        if field:
            self.note(field, f"env {name}")
        return value

    def str_or(self, name: str, field: str, default: str, default_source: str = "default") -> str:
        value = self.opt_str(name, field)
        if value is None:
            self.note(field, default_source)
            return default
        return value

    def opt_int(self, name: str, field: str | None = None, minimum: int = 0) -> int | None:
        raw = self.env.get(name, "").strip()
        if raw == "":
            return None
        try:
            value = int(raw)
        except ValueError:
            raise bad_value(f"env {name}", raw, "not an integer",
                            f"{name} must be a whole number; fix or unset it") from None
        if value < minimum:
            raise bad_value(f"env {name}", raw, f"must be >= {minimum}")
        if field:
            self.note(field, f"env {name}")
        return value

    def int_or(self, name: str, field: str, default: int, minimum: int = 0,
               default_source: str = "default") -> int:
        value = self.opt_int(name, field, minimum)
        if value is None:
            self.note(field, default_source)
            return default
        return value

    def need_int(self, name: str, field: str | None = None, minimum: int = 0) -> int:
        value = self.opt_int(name, field, minimum)
        if value is None:
            raise bad_value(f"env {name}", "", "is required here but unset or empty")
        return value
