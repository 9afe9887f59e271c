"""The one Jinja environment for everything hpcmem renders from ``templates/``: job scripts and reports.

StrictUndefined (a missing value is an error, never an empty string), ``*.html.j2`` autoescaped,
and a few formatting filters (``q``/``qjoin`` shell quoting, ``mib``, ``md`` for Markdown cells);
templates hold layout, the Python that fills them holds the logic.
"""

from __future__ import annotations

import functools
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
    return env


def render_template(name: str, *, trim: bool = False, **context: Any) -> str:
    """Render ``templates/<name>`` with ``context``; a template error is a RenderError naming the template."""
    try:
        return environment(trim).get_template(name).render(**context)
    except jinja2.TemplateError as exc:
        raise RenderError(f"template {name}: {exc}") from exc
