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
from .files import MAX_SMALL_BYTES, read_small_json, read_small_text  # noqa: F401 (their home is files.py)

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


MAX_YAML_BYTES = MAX_SMALL_BYTES
"""Largest spec, site or calibration file read: these are a few KiB; anything larger is not one."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists taken from a YAML file (the schemas need 4)."""


def load_yaml(path: Path) -> Any:
    """Read a YAML file; a missing, unreadable, non-UTF-8, oversized or too deeply nested file, or one that is
    not a regular file, is a one-line ConfigError."""
    return parse_yaml(read_small_text(Path(path)), str(path))


def parse_yaml(text: str, where: str) -> Any:
    """YAML text -> data with the bounds of ``load_yaml`` (depth, alias expansion, 64-bit integers, finite
    numbers, safe tags only); any problem is one ConfigError starting with ``where``."""
    path = where
    try:
        doc = yaml.load(text, Loader=_DepthLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}") from exc
    except (RecursionError, MemoryError):
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    except (ValueError, OverflowError) as exc:  # a value PyYAML's constructors refuse (a huge integer...)
        raise ConfigError(f"{path}: not valid YAML: {str(exc).splitlines()[0][:200]}") from None
    return doc


MAX_NODES = 100_000
"""Most values a YAML file may stand for once its aliases are expanded (a "billion laughs" stands for 10**9)."""


def _check_expanded(root) -> None:
    """Refuse a node graph that refers to itself (``&x [*x]``) or expands to more than ``MAX_NODES`` values."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    open_ids: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if done:
            open_ids.discard(key)
            sizes[key] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[key] > MAX_NODES:
                raise yaml.constructor.ConstructorError(None, None, f"stands for more than {MAX_NODES} values "
                                                        "once its aliases are expanded", node.start_mark)
            continue
        if key in sizes:
            continue
        if key in open_ids:
            raise yaml.constructor.ConstructorError(None, None, "an alias refers to its own anchor", node.start_mark)
        open_ids.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in open_ids:
                raise yaml.constructor.ConstructorError(None, None, "an alias refers to its own anchor",
                                                        child.start_mark)
            if id(child) not in sizes:
                stack.append((child, False))


class _DepthLoader(yaml.SafeLoader):
    """SafeLoader that refuses nesting deeper than ``MAX_DEPTH`` while composing (before any recursion can
    overflow), and keys that cannot be dict keys (a mapping or list as a key)."""

    def compose_node(self, parent, index):
        depth = getattr(self, "_depth", 0)
        if depth > MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise yaml.constructor.ConstructorError(None, None, f"nested more than {MAX_DEPTH} levels deep", mark)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            _check_expanded(node)
        return node

    def construct_yaml_int(self, node):
        value = super().construct_yaml_int(node)
        if abs(value) >= 2**63:
            raise yaml.constructor.ConstructorError(None, None, "an integer beyond 64 bits", node.start_mark)
        return value

    def construct_yaml_float(self, node):
        value = super().construct_yaml_float(node)
        if value != value or value in (float("inf"), float("-inf")):
            raise yaml.constructor.ConstructorError(None, None, "a number that is not finite (.nan, .inf, 1e999)",
                                                    node.start_mark)
        return value

    def construct_mapping(self, node, deep=False):
        for key_node, _value in node.value if isinstance(node, yaml.MappingNode) else ():
            if isinstance(key_node, (yaml.MappingNode, yaml.SequenceNode)):  # unhashable once built
                raise yaml.constructor.ConstructorError(None, None, "a mapping key must be a plain value",
                                                        key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


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
        raise ConfigError(f"{here}: must be one of {', '.join(map(str, schema['enum']))}; got {_clip(value)}")
    if "minimum" in schema and _TYPES["number"](value) and value < schema["minimum"]:
        raise ConfigError(f"{here}: must be >= {schema['minimum']}, got {value}")
    if "pattern" in schema and isinstance(value, str) and not re.fullmatch(schema["pattern"], value, re.ASCII):
        raise ConfigError(f"{here}: {_clip(value)} does not match the expected form {schema['pattern']}")
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
            path = ".".join(map(str, key + (name,)))[:200]
            valid = ", ".join(sorted(props))
            raise ConfigError(f"{where}: {path}: unknown key (valid: {valid})")
        elif isinstance(extra, dict):
            _check(item, extra, where, key + (name,))


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    return f"{type(value).__name__} {_clip(value)}"


def _clip(value: Any, width: int = 80) -> str:
    """``repr`` cut to ``width`` characters: an error is one line, whatever the file held."""
    text = repr(value)
    return text if len(text) <= width else text[:width] + "..."


_DepthLoader.add_constructor("tag:yaml.org,2002:int", _DepthLoader.construct_yaml_int)
_DepthLoader.add_constructor("tag:yaml.org,2002:float", _DepthLoader.construct_yaml_float)
