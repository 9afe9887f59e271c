"""``hpcmem bench run | collect | report``: thin commands over runner, collect, store and report.

Every command takes ``--json``. ``report`` exits with the report's status (non-zero when a
regression or a newly failing cell is found), so cron mail and CI catch it.
"""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import click

from .. import runs
from ..resources import home_dir
from ..sites import load_site

# The bench modules (pandas, matplotlib) are imported inside the commands: every other hpcmem
# command loads this group, and should not pay for them.

_json_opt = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
_store_opt = click.option("--store", "store_path", type=click.Path(dir_okay=False), default=None,
                          help="Results store (default: $HPCMEM_HOME/bench/results.sqlite).")


def _emit_json(data) -> None:
    from ..templating import json_text

    click.echo(json_text(data))


def _store(path: str | None) -> Path:
    from . import store

    return Path(path) if path else store.default_path(home_dir())


@click.group("bench")
def bench() -> None:
    """Nightly benchmarks: every technique's memory and speed per partition, kept night after night."""


@bench.command("run")
@click.argument("matrix")
@click.option("--site", required=True, help="Site profile whose partitions the matrix names.")
@click.option("--partition", "-p", default=None, help="Only this partition of the matrix.")
@click.option("--only", default=None, metavar="PATTERN",
              help="Only cells whose technique, model, model/technique or partition/model/technique matches "
                   "(shell pattern, e.g. 'zero*').")
@click.option("--night", default=None, metavar="YYYY-MM-DD", help="The night the cells belong to (default: today).")
@_json_opt
@click.pass_context
def run_cmd(ctx, matrix, site, partition, only, night, as_json) -> None:
    """Submit one fixed-plan run (no retry) per cell of MATRIX (a file or a name in jobs/nightly/)."""
    from .matrix import load_matrix
    from .runner import run_matrix

    mat = load_matrix(matrix)
    site_obj = load_site(site, (ctx.obj or {}).get("sites_dirs", ()))
    with runs.open_ledger() as ledger:
        manifest = run_matrix(ledger, mat, site_obj, partition=partition, only=only, night=night)
    if as_json:
        _emit_json(manifest)
        return
    click.echo(f"{mat.name} {manifest['night']} on {site_obj.name}: manifest {manifest['path']}")
    for c in manifest["cells"]:
        where = f"{c['partition']}/{c['model']}/{c['technique']}"
        if c["status"] == "skipped":
            click.echo(f"  {where:<48} skipped: {c['reason']}")
        else:
            extra = f" ({c['reason']})" if c.get("reason") else ""
            click.echo(f"  {where:<48} {c['status']} run {c['run_id'] or '-'} job {c.get('job_id') or '-'}{extra}")
    click.echo("collect with: hpcmem bench collect --wait")


@bench.command("collect")
@click.option("--wait", is_flag=True, help="Keep collecting until no submitted cell is still running.")
@click.option("--interval", default=5.0, show_default=True, help="Seconds between passes with --wait.")
@click.option("--timeout", "timeout_s", type=float, default=None, help="Give up waiting after this many seconds.")
@_store_opt
@_json_opt
def collect_cmd(wait, interval, timeout_s, store_path, as_json) -> None:
    """Store a row per finished cell of every manifest (metrics, verdict, prediction); running cells wait."""
    from .collect import collect as collect_once, collect_wait

    path = _store(store_path)
    with runs.open_ledger() as ledger:
        if wait:
            result = collect_wait(ledger, path, interval_s=interval, timeout_s=timeout_s)
        else:
            result = collect_once(ledger, path)
    if as_json:
        _emit_json(result)
    else:
        for row in result["rows"]:
            where = f"{row['night']} {row['partition']}/{row['model']}/{row['technique']:<20}"
            if row["status"] == "skipped":
                click.echo(f"  {where} skipped: {row['error']}")
                continue
            measured = f"{row['samples_per_s']:.2f} samples/s" if row["samples_per_s"] else "-"
            peak = row["peak_allocated_mib"] or row["peak_rss_mib"]
            click.echo(f"  {where} {row['status']:<10} "
                       f"{measured:>18} peak {peak or 0:,.0f} MiB"
                       + (f"  [{row['verdict']}] {row['error']}" if row["status"] != "ok" else ""))
        click.echo(f"{result['added']} row(s) added to {path}; {len(result['pending'])} cell(s) still running"
                   + (f"; {len(result['not_submitted'])} never submitted (run `hpcmem bench run` again)"
                      if result["not_submitted"] else ""))
        for problem in result["problems"]:
            click.echo(f"  problem: {problem}", err=True)
    if wait and result["pending"]:
        sys.exit(1)  # timed out with cells still running


@bench.command("report")
@click.option("--since", default=None, metavar="DATE", help="Only nights from this date (YYYY-MM-DD).")
@click.option("--format", "fmt", type=click.Choice(["markdown", "html"]), default="markdown", show_default=True)
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the report and its plots (default: $HPCMEM_HOME/bench/report).")
@click.option("--references", type=click.Path(dir_okay=False, exists=True), default=None,
              help="Declared references per site:partition (value, lower and upper tolerance).")
@click.option("--window", default=7, show_default=True, help="Nights in the rolling median a night is compared with.")
@click.option("--tolerance", default=0.10, show_default=True,
              help="Relative change against the rolling median that counts as a regression.")
@_store_opt
@_json_opt
def report_cmd(since, fmt, out_dir, references, window, tolerance, store_path, as_json) -> None:
    """Per-technique tables, savings against vanilla, trends, estimator error and regressions; exit non-zero
    on a regression or a newly failing cell."""
    from . import store
    from .collect import submitted_cells
    from .regress import load_references
    from .report import run_report
    from .runner import parse_night

    since_date = dt.date.fromisoformat(parse_night(since, option="--since")) if since else None
    refs = load_references(references) if references else None
    frame = store.load(_store(store_path))
    out = Path(out_dir) if out_dir else home_dir() / "bench" / "report"
    outcome = run_report(frame, since=since_date, fmt=fmt, out_dir=out, references=refs, window=window,
                         tolerance=tolerance, submitted=submitted_cells(home_dir()))
    if as_json:
        _emit_json(outcome.to_dict())
    else:
        click.echo(f"report: {outcome.path}")
    sys.exit(outcome.exit_code)
