"""Reading TrainConfig, every option of `meshrun train` (declared by section, and combined,
in sections.py), from a config file, MESHRUN_* variables and flags or keywords, with errors
that name where each value came from.

This module does not import torch: the CLI validates a config before launching anything. Nor
does the package, which holds what the `meshrun train` process (meshrun.job) and its ranks
(meshrun.training) must read alike: the options and their rules (sections.py), the run policy
(policy.py), the trackers' settings (trackers.py), OUT's run id and history (outdir.py) and its
lock (runlock.py), and a resume's batch on another data-parallel size (resize.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from ..defaults import seq_len_for
from ..errors import MeshrunError, bad_value
from ..options import check_all, flag, option_fields, read
from ..paths import check_path_text
from ..vocab import GPT_PRESETS
from .sections import BUILTIN_DATA, EXAMPLES, STRATEGY_CHOICES, Section, TrainConfig, section_names

__all__ = ["BUILTIN_DATA", "EXAMPLES", "STRATEGY_CHOICES", "TrainConfig", "build_config", "config_from",
           "load_file", "option_names", "resolve_seq_len", "validate"]


def validate(cfg: TrainConfig) -> TrainConfig:
    """Every option's own checks (its declaration's: a choice, a bound), then each section's
    rules, in SECTIONS' order; the config with paths made absolute and a GPT preset's context
    as the sequence length when none was given. Needs no torch and no process group (the
    batch arithmetic needs the world size and is checked by ``accumulation``)."""
    check_all(TrainConfig, {f.name: getattr(cfg, f.name) for f in option_fields(TrainConfig)}, cfg.sources)
    cfg = TrainConfig.check(cfg)  # each section's rules
    if cfg.seq_len is None and cfg.model is None and cfg.example == "gpt":  # a preset's own context
        cfg = cfg.replace(seq_len=seq_len_for(GPT_PRESETS[cfg.model_size].context),
                          sources={**cfg.sources, "seq_len": "the preset's context"})
    return cfg


def resolve_seq_len(cfg: TrainConfig, context: int | None) -> TrainConfig:
    """The config with its sequence length: the one given, else the model's ``context``
    (defaults.seq_len_for); checked again now that it is known."""
    if cfg.seq_len is not None:
        return cfg
    src = "the model's context" if context else "the default for a model that states no context"
    return validate(dataclasses.replace(cfg, seq_len=seq_len_for(context), sources={**cfg.sources, "seq_len": src}))


def option_names() -> list[str]:
    """Every option of `meshrun train`, as Python names (the config file's keys, the keywords
    of ``meshrun.train()``)."""
    return [f.name for f in option_fields(TrainConfig)]


def load_file(path: str, others: tuple[str, ...] = (), flags_only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a YAML or TOML config whose keys are the options (dashes or underscores), given
    flat or in their sections' tables (``[parallel]`` ``tp = 2``, or ``parallel: {tp: 2}``);
    ``others``: the names of options outside the sections it may hold too, flat (the job's
    and the topology's: ``max_restarts: 2``, ``nproc_per_node: 4``); ``flags_only``: options a
    file may not set (refused with a line that says so)."""
    check_path_text(path, "--config")
    if not os.path.isfile(path):
        raise bad_value("--config", path, "no such file")
    try:
        if path.endswith(".toml"):
            import tomllib

            with open(path, "rb") as f:
                raw = tomllib.load(f)
        else:
            import yaml

            with open(path) as text:
                raw = yaml.load(text, Loader=_unique_key_loader(yaml)) or {}
    except ImportError:
        raise bad_value("--config", path, "YAML needs PyYAML", "pip install pyyaml, or use a .toml file") from None
    except MeshrunError:
        raise
    except Exception as exc:  # a parse error of either format
        raise bad_value("--config", path, f"cannot parse ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise bad_value("--config", path, "must hold a mapping of option: value")
    sections = section_names()
    entries: list[tuple[object, object, type[Section] | None]] = []  # (key, value, the section it was given in)
    for key, value in raw.items():
        if isinstance(value, dict) and str(key) in sections:
            entries += [(k, v, sections[str(key)]) for k, v in value.items()]
        else:
            entries.append((key, value, None))
    known = {*option_names(), *others}
    out: dict[str, Any] = {}
    spelled: dict[str, object] = {}  # each option's key as the file spells it
    for key, value, section in entries:
        name = str(key).replace("-", "_")
        if section is not None and name not in section.__dataclass_fields__:
            table = next(n for n, s in sections.items() if s is section)
            raise bad_value(f"--config {path} [{table}]", key, "unknown key in this section",
                            f"its keys are {', '.join(f.name for f in option_fields(section))}")
        if name in flags_only:
            raise bad_value(f"--config {path}", key, "is an option for the command line alone",
                            f"give {flag(name)} when you mean it")
        if name not in known:
            raise bad_value(f"--config {path}", key, "unknown key",
                            f"keys are the flag names of meshrun train, or the sections {', '.join(sections)}")
        if name in out:  # the same option spelled with dashes and with underscores, or flat and in a table
            raise bad_value(f"--config {path}", key, f"duplicate key: the same option as {spelled[name]!r}",
                            "keep one of them")
        out[name], spelled[name] = value, key
    return out


def config_from(file_values: Mapping[str, Any], file: str | None, env: Mapping[str, str], given: Mapping[str, Any],
                given_source: str) -> TrainConfig:
    """The run's config from every source a user has, in one way for the CLI and
    ``meshrun.train(...)`` (options.read): defaults < the config file's ``file_values`` <
    MESHRUN_<NAME> < ``given`` (the flags, or the keywords; ``given_source`` says which)."""
    values, sources = read(TrainConfig, file_values, file, env, given, given_source)
    return validate(TrainConfig(sources=sources, **values))


_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")


def _unique_key_loader(yaml: Any) -> Any:
    """PyYAML's safe loader, except that a key given twice in one mapping is refused (the
    plain loader keeps the last value without a word, silently dropping a setting), and so
    is any anchor (&) or alias (*): a config of flag values needs none, and aliases nested
    in aliases ("billion laughs") expand a few lines into gigabytes. Digits between colons
    stay text: YAML 1.1 reads ``nnodes: 1:2`` as the base-60 number 62 (YAML 1.2 dropped it)."""

    class UniqueKeyLoader(yaml.SafeLoader):
        yaml_implicit_resolvers = {
            first: ([("tag:yaml.org,2002:str", _SEXAGESIMAL)] if first in "+-0123456789" else []) + list(resolvers)
            for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                line = event.start_mark.line + 1
                raise bad_value("--config", self.name, f"uses a YAML anchor or alias (line {line})",
                                "write each value out: meshrun config files take no & anchors or * aliases")
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    line = key_node.start_mark.line + 1
                    raise bad_value(f"--config {self.name}", key, f"duplicate key (line {line})", "keep one of them")
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def build_config(file_values: Mapping[str, Any], flag_values: Mapping[str, Any],
                 file_name: str | None = None) -> TrainConfig:
    """Defaults < config file < flags, as ``config_from`` reads them, with no variables."""
    return config_from(file_values, file_name, {}, flag_values, "flag")
