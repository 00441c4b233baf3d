"""One YAML configuration file, checked once at start; command-line flags override it.

Errors name the file, the line, the dotted key and what was expected, e.g.
``gpubalance.yaml:4: exporter.interval: expected a number, got 'fast'``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

Loc = tuple[str | int, ...]


# Top-level sections of the one configuration file, one per part.
# the log line of every long-running command (exporter, analyzer, controller)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# `haproxy` holds the pools `gpubalance deploy haproxy` renders (controller/pools.py)
SECTIONS = frozenset({"exporter", "lab", "analyzer", "controller", "haproxy"})


class ConfigError(Exception):
    """A configuration that cannot be used; the message says where and why."""


def _record_lines(node: yaml.Node, loc: Loc, lines: dict[Loc, int]) -> None:
    lines[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            lines[(*loc, key)] = key_node.start_mark.line + 1
            _record_lines(value_node, (*loc, key), lines)
            lines[(*loc, key)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record_lines(item, (*loc, i), lines)


def load_yaml(path: str | Path) -> tuple[Any, dict[Loc, int]]:
    """Parse a YAML file; return the data and the line of every key path in it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}, {}
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    finally:
        loader.dispose()
    lines: dict[Loc, int] = {}
    _record_lines(node, (), lines)
    return data, lines


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
}


def _describe(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    got = error.get("input")
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {got!r}"
    if kind == "value_error":
        # our validators raise ValueError with a message that already says what was given
        return str(error["ctx"]["error"])
    return f"{error['msg']} (got {got!r})"


def _line_for(loc: Loc, lines: Mapping[Loc, int]) -> int | None:
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def validate(
    model: type[M],
    data: Any,
    *,
    source: str,
    lines: Mapping[Loc, int] | None = None,
    prefix: Loc = (),
    flags: frozenset[str] = frozenset(),
) -> M:
    """Validate ``data`` against ``model``; raise ConfigError naming file, line and key.

    Top-level keys listed in ``flags`` came from the command line and are reported as flags.
    """
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as exc:
        messages = []
        for error in exc.errors():
            loc = tuple(error["loc"])
            if loc and loc[0] in flags:
                flag = "--" + str(loc[0]).replace("_", "-")
                messages.append(f"command line: {flag}: {_describe(error)}")
                continue
            full = (*prefix, *loc)
            line = _line_for(full, lines or {})
            where = f"{source}:{line}" if line is not None else source
            key = ".".join(str(part) for part in full) or "(top level)"
            messages.append(f"{where}: {key}: {_describe(error)}")
        raise ConfigError("\n".join(messages)) from None


def load_section(
    model: type[M],
    path: str | Path | None,
    section: str,
    overrides: Mapping[str, Any] | None = None,
) -> M:
    """Load one top-level section of the config file, apply flag overrides, validate.

    Overrides are command-line values (None means "not given"); they are validated with the
    same rules, so a bad flag gets the same message as a bad key.
    """
    data: dict[str, Any] = {}
    lines: dict[Loc, int] = {}
    source = str(path) if path is not None else "(defaults)"
    if path is not None:
        document, lines = load_yaml(path)
        if document is None:
            document = {}
        if not isinstance(document, dict):
            raise ConfigError(f"{source}:1: expected a mapping of sections, got {document!r}")
        for name in document:
            if name not in SECTIONS:
                raise ConfigError(
                    f"{source}:{lines.get((name,), 1)}: {name}: unknown section; "
                    f"expected one of {', '.join(sorted(SECTIONS))}"
                )
        section_data = document.get(section, {})
        if section_data is None:
            section_data = {}
        if not isinstance(section_data, dict):
            line = lines.get((section,), 1)
            raise ConfigError(f"{source}:{line}: {section}: expected a mapping")
        data = dict(section_data)
    flag_given = {k: v for k, v in (overrides or {}).items() if v is not None}
    for key, value in flag_given.items():
        # A flag that sets one entry of a mapping (--no-collector.host) keeps the others.
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return validate(
        model, data, source=source, lines=lines, prefix=(section,), flags=frozenset(flag_given)
    )


def read_token(path: str | Path, key: str) -> str:
    """The bearer token in ``path`` (the setting ``key`` names it): one token of printable ASCII."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"{key}: cannot read {path}: {reason}") from None
    if not token or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(f"{key}: {path} must hold one token of printable ASCII, without spaces")
    return token
