"""`hpcmem bench report`: the technique table's numbers, the versions, the written Markdown and HTML
(with their plots), and bad input. Frames are built here, row by row."""

import base64
import datetime
import re

import pandas as pd
import pytest

from toolkit.bench import regress
from toolkit.bench.columns import COLUMNS
from toolkit.bench.report import prepare, run_report, technique_table, version_table
from toolkit.errors import HpcmemError, UnknownNameError

PNG = b"\x89PNG\r\n\x1a\n"


def row(night: str, technique: str, *, partition="a100", model="gpt2", status="ok", **values) -> dict:
    out = dict.fromkeys(COLUMNS)
    out.update(night=night, site="testcluster", partition=partition, model=model, technique=technique, status=status,
               verdict="", error="", torch="2.13.0", deepspeed="0.16.4", hpcmem="0.1.0")
    out.update(values)
    return out


def gpu(night, technique, alloc, predicted, speed=10.0, **kw):
    return row(night, technique, peak_allocated_mib=alloc, peak_rss_mib=3000.0, predicted_peak_mib=predicted,
               samples_per_s=speed, step_time_s=1.6, gpu_name="NVIDIA A100-SXM4-40GB", **kw)


def cpu(night, technique, rss, predicted=None, **kw):
    return row(night, technique, partition="cpu", model="tiny-gpt2", peak_rss_mib=rss, predicted_peak_mib=predicted,
               samples_per_s=50.0, step_time_s=0.1, **kw)


def small_store() -> pd.DataFrame:
    """Two nights, a GPU partition (gpt2) and a CPU one (tiny-gpt2); zero3 fails on the latest night."""
    rows = []
    for night in ("2026-11-20", "2026-11-21"):
        rows += [gpu(night, "vanilla", 8000.0, 8800.0), gpu(night, "accum+ckpt", 3000.0, 2700.0),
                 gpu(night, "bf16-mixed", 5000.0, 5000.0),
                 cpu(night, "vanilla", 900.0, 500.0), cpu(night, "accum", 720.0)]
    rows.append(gpu("2026-11-20", "zero3", 2000.0, 2100.0))
    rows.append(row("2026-11-21", "zero3", status="failed", verdict="gpu_oom", peak_rss_mib=3100.0,
                    error="CUDA out of memory | <b>Tried</b> to allocate 2.00 GiB", gpu_name="NVIDIA A100-SXM4-40GB"))
    return pd.DataFrame(rows)


def latest_table(frame):
    frame = prepare(frame, None)
    nights = regress.cell_nights(frame)
    return technique_table(regress.latest_rows(frame, nights)).set_index(["partition", "technique"])


# ---------------------------------------------------------------- the table


def test_saving_vs_vanilla_and_estimator_error():
    table = latest_table(small_store())
    assert table.loc[("a100", "vanilla"), "saving_pct"] == 0.0
    assert table.loc[("a100", "accum+ckpt"), "saving_pct"] == pytest.approx(100 * (8000 - 3000) / 8000)
    assert table.loc[("a100", "bf16-mixed"), "saving_pct"] == pytest.approx(37.5)
    assert table.loc[("a100", "accum+ckpt"), "error_pct"] == pytest.approx(100 * (2700 - 3000) / 3000)
    assert table.loc[("a100", "vanilla"), "error_pct"] == pytest.approx(10.0)
    # CPU partition: memory is peak RSS, the saving is on it, no estimator error (nothing allocated on a GPU)
    assert table.loc[("cpu", "accum"), "memory_kind"] == "peak RSS"
    assert table.loc[("cpu", "accum"), "saving_pct"] == pytest.approx(20.0)
    assert pd.isna(table.loc[("cpu", "vanilla"), "error_pct"]) and table.loc[("cpu", "vanilla"), "on_cpu"]


def test_failed_cell_has_no_saving_and_keeps_its_group_on_peak_allocated():
    table = latest_table(small_store())
    failed = table.loc[("a100", "zero3")]
    assert failed["status"] == "failed" and pd.isna(failed["saving_pct"]) and failed["memory_kind"] == "peak allocated"
    assert pd.isna(failed["memory_mib"])  # its peak RSS is not a peak allocated


def test_no_ok_vanilla_means_no_saving():
    frame = small_store()
    frame.loc[(frame["technique"] == "vanilla") & (frame["partition"] == "a100"), "status"] = "failed"
    assert pd.isna(latest_table(frame).loc[("a100", "accum+ckpt"), "saving_pct"])


def test_techniques_in_table_order():
    table = latest_table(small_store()).reset_index()
    assert list(table[table["partition"] == "a100"]["technique"]) == ["vanilla", "accum+ckpt", "bf16-mixed", "zero3"]


def test_versions_changed_since_previous_night():
    frame = small_store()
    frame.loc[(frame["night"] == "2026-11-21") & (frame["partition"] == "a100"), "torch"] = "2.14.0"
    versions = version_table(frame, regress.partition_nights(frame)).set_index(["partition", "name"])
    assert tuple(versions.loc[("a100", "torch"), ["latest", "previous", "changed"]]) == ("2.14.0", "2.13.0", True)
    assert not versions.loc[("cpu", "torch"), "changed"] and not versions.loc[("a100", "deepspeed"), "changed"]
    assert versions.loc[("a100", "cuda"), "latest"] == ""


def test_version_change_shown_next_to_the_regression(tmp_path):
    frame = small_store()
    latest = (frame["night"] == "2026-11-21") & (frame["partition"] == "a100")
    frame.loc[latest, "torch"] = "2.14.0"
    frame.loc[latest & (frame["technique"] == "bf16-mixed"), "peak_allocated_mib"] = 6500.0
    outcome = run_report(frame, out_dir=tmp_path)
    [reg] = outcome.regressions
    assert reg.versions_changed == ("torch 2.13.0 -> 2.14.0",)
    text = outcome.path.read_text()
    assert re.search(r"\| testcluster:a100 gpt2 bf16-mixed \|.*\| torch 2\.13\.0 -> 2\.14\.0 \|", text)


# ---------------------------------------------------------------- the files


def test_markdown_report_writes_pngs_beside_it(tmp_path):
    outcome = run_report(small_store(), out_dir=tmp_path / "r")
    assert outcome.path == tmp_path / "r" / "report.md"
    text = outcome.path.read_text()
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    assert sorted(images) == ["trend-testcluster-a100-gpt2.png", "trend-testcluster-cpu-tiny-gpt2.png"]
    for name in images:
        assert (tmp_path / "r" / name).read_bytes().startswith(PNG)
    assert "| accum+ckpt | 1.600 | 10.0 | 3,000 | +62.5 % | 2,700 | -10.0 % | ok |" in text
    assert "| vanilla | 0.100 | 50.0 | 900 | baseline | 500 | n/a on CPU | ok |" in text
    assert "| zero3 | - | - | - | - | - | n/a | failed (gpu_oom) |" in text
    assert r"CUDA out of memory \| &lt;b>Tried&lt;/b>" in text  # a pipe would break the table; no raw HTML
    assert "memory: peak allocated (MiB)" in text and "memory: peak RSS (MiB)" in text


def test_html_report_embeds_its_pngs_and_escapes(tmp_path):
    outcome = run_report(small_store(), fmt="html", out_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    text = outcome.path.read_text()
    sources = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(sources) == 2 and all(base64.b64decode(s).startswith(PNG) for s in sources)
    assert "<b>Tried</b>" not in text and "&lt;b&gt;Tried&lt;/b&gt;" in text


def test_newly_failing_cell_in_the_report(tmp_path):
    outcome = run_report(small_store(), out_dir=tmp_path)
    assert [f["technique"] for f in outcome.new_failures] == ["zero3"] and outcome.exit_code == 1
    assert "| testcluster:a100 gpt2 zero3 | 2026-11-21 | failed | gpu_oom |" in outcome.path.read_text()


def test_since_limits_the_nights(tmp_path):
    frame = small_store()
    outcome = run_report(frame, since=datetime.date(2026, 11, 21), out_dir=tmp_path)
    assert outcome.new_failures == [] and outcome.exit_code == 0  # no earlier night to be ok on
    assert "1 nights (2026-11-21 to 2026-11-21) · since 2026-11-21" in outcome.path.read_text()


def test_a_single_night_renders(tmp_path):
    frame = small_store()
    outcome = run_report(frame[frame["night"] == "2026-11-21"], fmt="html", out_dir=tmp_path)
    assert outcome.exit_code == 0 and "night 2026-11-21</h2>" in outcome.path.read_text()


# ---------------------------------------------------------------- bad input


def test_empty_store_is_an_error(tmp_path):
    with pytest.raises(HpcmemError, match="^results store is empty: nothing to report"):
        run_report(pd.DataFrame(columns=list(COLUMNS)), out_dir=tmp_path)


def test_nothing_since_is_an_error(tmp_path):
    with pytest.raises(HpcmemError, match="no night on or after 2027-01-01 \\(latest: 2026-11-21\\)"):
        run_report(small_store(), since=datetime.date(2027, 1, 1), out_dir=tmp_path)


def test_store_without_identity_columns(tmp_path):
    with pytest.raises(HpcmemError, match="lacks column\\(s\\) technique, status"):
        run_report(small_store().drop(columns=["technique", "status"]), out_dir=tmp_path)


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_unwritable_out_dir_is_one_line(tmp_path, where):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    out_dir = blocker if where == "file" else blocker / "report"
    with pytest.raises(HpcmemError) as err:
        run_report(small_store(), out_dir=out_dir)
    assert str(err.value).startswith(f"{out_dir}: cannot create the report directory") and "\n" not in str(err.value)


def test_unknown_format(tmp_path):
    with pytest.raises(UnknownNameError, match="unknown report format 'pdf'; valid: html, markdown"):
        run_report(small_store(), fmt="pdf", out_dir=tmp_path)


def test_references_that_match_no_cell_are_named(tmp_path):
    refs = {"testcluster:a100": {"gpt2": {"vanila": {"samples_per_s": [10, -0.5, None]},       # a typo
                                          "vanilla": {"samples_per_s": [10, -0.5, None]}}},
            "example-hpc:a100-40gb": {"gpt2": {"vanilla": {"samples_per_s": [10, -0.5, None]}}}}  # not in the store
    text = run_report(small_store(), references=refs, out_dir=tmp_path).path.read_text()
    assert "References with no row on the latest night (check the names): testcluster:a100 gpt2 vanila\n" in text


@pytest.mark.parametrize("window, tolerance", [(0, 0.1), (7, -0.1)])
def test_bad_window_or_tolerance(tmp_path, window, tolerance):
    with pytest.raises(HpcmemError, match="window must be >= 1 night and tolerance >= 0"):
        run_report(small_store(), out_dir=tmp_path, window=window, tolerance=tolerance)


def test_a_store_of_failed_and_missing_rows_is_reported_not_a_crash(tmp_path):
    rows = [row(night, t, status=status, verdict="host_oom" if status == "failed" else "", error="Killed")
            for night in ("2026-11-20", "2026-11-21") for t, status in (("vanilla", "failed"), ("zero3", "missing"))]
    for fmt in ("markdown", "html"):
        outcome = run_report(pd.DataFrame(rows), fmt=fmt, out_dir=tmp_path / fmt)
        assert outcome.exit_code == 0 and outcome.regressions == [] and outcome.new_failures == []
        assert "failed (host_oom)" in outcome.path.read_text()
