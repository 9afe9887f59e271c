"""The one Jinja environment for everything hpcmem renders from ``templates/``: job scripts and reports.

StrictUndefined (a missing value is an error, never an empty string), ``*.html.j2`` autoescaped,
and a few formatting filters (``q``/``qjoin`` shell quoting, ``mib``, ``md`` for Markdown cells, ``safe_text``
for untrusted text); ``safe_data`` makes a whole report's strings terminal-safe at once (``triage/formats.py``);
templates hold layout, the Python that fills them holds the logic.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shlex
from typing import Any

import jinja2

from .errors import RenderError
from .resources import data_dir


def mib_text(mib: float | None) -> str:
    """MiB for a person: "512 MiB", "15.8 GiB"; "?" when unknown."""
    if mib is None:
        return "?"
    if abs(mib) >= 1024:
        return f"{mib / 1024:.1f} GiB"
    return f"{mib:.0f} MiB"


_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
"""What a terminal or a Markdown viewer must never get raw from a log or a file name: C0 controls but tab (ESC
starts CSI/OSC sequences, CR overwrites a line, BS erases, a newline in a file name fakes a report line), DEL, C1 controls (0x9b is a one-byte
CSI), Unicode line separators and the bidirectional overrides that make text read otherwise than it is."""
MAX_SHOWN = 4000
"""Longest single string a text or Markdown report shows (a path, a sentence); longer ones are cut."""


def safe_text(value: Any, width: int | None = MAX_SHOWN) -> str:
    """``value`` as text with every unsafe character (``_UNSAFE``) written as a visible escape (``\\x1b``,
    ``\\u202e``), cut to ``width`` characters (None: no cut)."""
    text = str(value)
    if width is not None and len(text) > width:
        text = text[:width] + f"...[{len(text) - width} more characters]"
    return _UNSAFE.sub(_escape, text)


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_data(data: Any, width: int | None = MAX_SHOWN) -> Any:
    """``data`` (JSON-ready dicts, lists, strings) with every string, keys too, made ``safe_text``: what a report
    template gets, so no template has to remember (JSON output is escaped by ``json.dumps`` instead)."""
    if isinstance(data, str):
        return safe_text(data, width)
    if isinstance(data, dict):
        return {safe_text(k, width) if isinstance(k, str) else k: safe_data(v, width) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [safe_data(v, width) for v in data]
    return data


def json_text(data: Any) -> str:
    """``data`` as strict JSON text for a ``--json`` output: a float that is not finite (a hand-edited ledger's
    NaN, an overflowed figure) becomes null, which every JSON parser reads, instead of Python's ``NaN``/``Infinity``."""
    return json.dumps(_finite(data), indent=2, default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


_HINTS = ("outofmemoryerror", "out of memory", "cuda error", "oom", "killed", "error", "memory")


def clip_around(text: str, width: int = 400) -> str:
    """A long log line cut to about ``width`` characters around what matters: the first failure word of
    ``_HINTS`` found (in that order), else the line's end (where a message ends up on a progress-bar line).
    What was cut is said: ``...[1234 characters]...``."""
    if len(text) <= width:
        return text
    low = text.lower()
    anchor = next((i for i in (low.rfind(h) for h in _HINTS) if i >= 0), len(text))
    start = max(0, min(anchor - width // 2, len(text) - width))
    end = min(len(text), start + width)
    head = f"...[{start} characters]..." if start else ""
    tail = f"...[{len(text) - end} characters]..." if end < len(text) else ""
    return head + text[start:end] + tail


def markdown_cell(value: Any) -> str:
    """Text safe in a Markdown table cell: no pipe, no newline, no raw HTML (error lines can hold any of them)."""
    return str(value).replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


@functools.lru_cache(maxsize=2)
def environment(trim: bool = False) -> jinja2.Environment:
    """The environment; ``trim``: block tags take their own line away (reports), else kept (job scripts)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=jinja2.select_autoescape(["html.j2"], default_for_string=False),
                             trim_blocks=trim, lstrip_blocks=trim)
    env.filters["q"] = lambda v: shlex.quote(str(v))
    env.filters["qjoin"] = lambda vs: " ".join(shlex.quote(str(v)) for v in vs)
    env.filters["mib"] = mib_text
    env.filters["md"] = markdown_cell
    env.filters["safe_text"] = safe_text
    return env


def render_template(name: str, *, trim: bool = False, **context: Any) -> str:
    """Render ``templates/<name>`` with ``context``; a template error is a RenderError naming the template."""
    try:
        return environment(trim).get_template(name).render(**context)
    except jinja2.TemplateError as exc:
        raise RenderError(f"template {name}: {exc}") from exc
