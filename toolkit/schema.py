"""Check a loaded YAML/JSON document against a small JSON-Schema subset.

Supported keywords: ``type`` (a name or a list of names), ``properties``,
``required``, ``additionalProperties`` (false or a schema), ``items``, ``enum``,
``minimum``, ``pattern``, ``description`` (ignored). That is all the site and
job schemas use; a schema keyword outside this set is a bug and raises.
Errors name the file and the dotted key path, in one line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
_KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "enum",
             "minimum", "pattern", "description", "$schema", "title", "default"}


def validate(doc: Any, schema: dict, where: str) -> None:
    """Raise ConfigError("<where>: <key.path>: <problem>") on the first problem found."""
    _check(doc, schema, where, ())


def load_yaml(path: Path) -> Any:
    """Read a YAML file; a missing or unreadable file is a one-line ConfigError."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}") from exc


def load_schema(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _check(value: Any, schema: dict, where: str, key: tuple) -> None:
    unknown = set(schema) - _KEYWORDS
    if unknown:
        raise ValueError(f"schema keyword(s) not supported: {sorted(unknown)}")
    here = f"{where}: {'.'.join(map(str, key))}" if key else where
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_TYPES[n](value) for n in names):
            raise ConfigError(f"{here}: expected {' or '.join(names)}, got {_describe(value)}")
    if "enum" in schema and value not in schema["enum"]:
        raise ConfigError(f"{here}: must be one of {', '.join(map(str, schema['enum']))}; got {value!r}")
    if "minimum" in schema and _TYPES["number"](value) and value < schema["minimum"]:
        raise ConfigError(f"{here}: must be >= {schema['minimum']}, got {value}")
    if "pattern" in schema and isinstance(value, str) and not re.fullmatch(schema["pattern"], value):
        raise ConfigError(f"{here}: {value!r} does not match the expected form {schema['pattern']}")
    if isinstance(value, dict):
        _check_object(value, schema, where, key)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], where, key + (i,))


def _check_object(value: dict, schema: dict, where: str, key: tuple) -> None:
    props = schema.get("properties", {})
    for name in schema.get("required", ()):
        if name not in value:
            path = ".".join(map(str, key + (name,)))
            raise ConfigError(f"{where}: {path}: missing required key")
    extra = schema.get("additionalProperties", True)
    for name, item in value.items():
        if name in props:
            _check(item, props[name], where, key + (name,))
        elif extra is False:
            path = ".".join(map(str, key + (name,)))
            valid = ", ".join(sorted(props))
            raise ConfigError(f"{where}: {path}: unknown key (valid: {valid})")
        elif isinstance(extra, dict):
            _check(item, extra, where, key + (name,))


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"
