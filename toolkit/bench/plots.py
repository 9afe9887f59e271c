"""Trend plots for the nightly report: one PNG per site, partition and model.

Each figure has two panels over nights: memory (MiB; peak allocated on a GPU, peak RSS on a CPU
partition) and samples/s, one line per technique. Only ok rows are drawn; a night on which a
technique did not run ok is a gap in its line. Matplotlib's Agg canvas is used directly (no
pyplot state), so this works on a login node without a display and is cheap enough to draw a
year of nights for every partition and model in a few seconds.
"""

from __future__ import annotations

import io

import pandas as pd

from ..errors import HpcmemError

_MARKERS_UP_TO = 60
"""Draw a marker on every point up to this many nights (beyond, the lines alone read better)."""


def trend_series(rows: pd.DataFrame, memory: str, order: list[str]) -> dict[str, pd.DataFrame]:
    """Night x technique tables of ``memory`` (MiB) and ``samples_per_s`` from one group's rows.

    Nights on which no technique ran ok stay in the index (as gaps); columns follow ``order``.
    """
    nights = pd.to_datetime(sorted(rows["night"].unique()))
    ok = rows[rows["status"] == "ok"].drop_duplicates(["night", "technique"], keep="last")
    out = {}
    for name, column in (("memory", memory), ("samples_per_s", "samples_per_s")):
        wide = ok.pivot(index="night", columns="technique", values=column)
        wide.index = pd.to_datetime(wide.index)
        out[name] = wide.reindex(index=nights, columns=[t for t in order if t in wide.columns])
    return out


def trend_png(series: dict[str, pd.DataFrame], *, title: str, memory_label: str) -> bytes:
    """One figure (two panels: memory, samples/s) as PNG bytes."""
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
        from matplotlib.figure import Figure
    except ImportError as exc:  # matplotlib is needed by `bench report` only
        raise HpcmemError("bench report draws its plots with matplotlib: pip install matplotlib") from exc

    # fixed margins: constrained layout would cost a third of the drawing time
    fig = Figure(figsize=(10, 6), dpi=80)
    fig.subplots_adjust(left=0.08, right=0.80, top=0.93, bottom=0.07, hspace=0.08)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    tab20 = colormaps["tab20"].colors
    colours = tab20[0::2] + tab20[1::2]  # ten distinct colours first, their light twins after
    memory, speed = series["memory"], series["samples_per_s"]
    marker = "o" if len(memory.index) <= _MARKERS_UP_TO else None
    for i, technique in enumerate(memory.columns):
        style = {"color": colours[i % len(colours)], "marker": marker, "markersize": 3, "linewidth": 1.2}
        top.plot(memory.index, memory[technique].to_numpy(), label=technique, **style)
        if technique in speed.columns:
            bottom.plot(speed.index, speed[technique].to_numpy(), **style)
    top.set_ylabel(f"{memory_label} (MiB)")
    bottom.set_ylabel("samples/s")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    locator = AutoDateLocator()
    bottom.xaxis.set_major_locator(locator)
    bottom.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    fig.suptitle(title)
    if len(memory.columns):
        fig.legend(loc="center right", fontsize="small", frameon=False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
