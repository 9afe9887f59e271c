"""Regressions in a results store: against declared references, against the rolling median of
previous nights, newly failing cells; and the references file's checks. Frames are built here,
row by row, with the columns of toolkit/bench/columns.py."""

import datetime
import json
from pathlib import Path

import pandas as pd
import pytest

from toolkit.bench import regress
from toolkit.bench.columns import COLUMNS
from toolkit.bench.regress import load_references
from toolkit.bench.report import run_report
from toolkit.bench.matrix import load_matrix, shipped_matrices
from toolkit.errors import ConfigError
from toolkit.resources import data_dir
from toolkit.sites import load_site

START = datetime.date(2026, 11, 1)


def row(night: int, technique="vanilla", *, partition="cpu", model="tiny-gpt2", status="ok", **values) -> dict:
    """One store row on night START + ``night`` (days); CPU-like unless values say otherwise."""
    out = dict.fromkeys(COLUMNS)
    out.update(night=(START + datetime.timedelta(days=night)).isoformat(), site="testcluster", partition=partition,
               model=model, technique=technique, matrix="ci-small", status=status, verdict="" if status == "ok" else "host_oom",
               error="" if status == "ok" else "Killed", torch="2.13.0", hpcmem="0.1.0")
    out.update(values)
    return out


def history(nights=10, techniques=("vanilla", "accum")) -> pd.DataFrame:
    """A clean history: every cell ok every night, memory and speed within +-2 % of a constant."""
    wobble = [1.0, 1.02, 0.98, 1.01, 0.99]
    rows = [row(n, t, peak_rss_mib=1000.0 * (i + 1) * wobble[n % 5], samples_per_s=50.0 / (i + 1) * wobble[(n + 2) % 5],
                step_time_s=0.1)
            for n in range(nights) for i, t in enumerate(techniques)]
    return pd.DataFrame(rows)


def last(frame: pd.DataFrame) -> pd.Series:
    return frame["night"] == frame["night"].max()


def run(frame, tmp_path, **kw):
    return run_report(frame, out_dir=tmp_path / "out", **kw)


# ---------------------------------------------------------------- rolling median


def test_clean_history_exits_zero(tmp_path):
    outcome = run(history(), tmp_path)
    assert outcome.regressions == [] and outcome.new_failures == [] and outcome.exit_code == 0


def test_memory_regression_injected_into_a_copy_is_flagged(tmp_path):
    clean = history()
    bad = clean.copy()
    bad.loc[last(bad) & (bad["technique"] == "accum"), "peak_rss_mib"] *= 1.25
    outcome = run(bad, tmp_path)
    assert outcome.exit_code == 1
    [reg] = outcome.regressions
    assert (reg.technique, reg.metric, reg.against, reg.night) == ("accum", "peak_rss_mib", "median", "2026-11-10")
    previous = clean[(clean["technique"] == "accum") & ~last(clean)].tail(7)["peak_rss_mib"].median()
    assert reg.baseline == pytest.approx(previous)
    assert reg.change == pytest.approx(reg.value / previous - 1)
    assert run(clean, tmp_path).exit_code == 0  # the copy, not the history, was changed


def test_samples_per_s_down_is_flagged_up_is_not_and_memory_down_is_not(tmp_path):
    frame = history()
    frame.loc[last(frame) & (frame["technique"] == "vanilla"), "samples_per_s"] *= 0.7
    frame.loc[last(frame) & (frame["technique"] == "accum"), "samples_per_s"] *= 1.5
    frame.loc[last(frame) & (frame["technique"] == "accum"), "peak_rss_mib"] *= 0.5
    [reg] = run(frame, tmp_path).regressions
    assert (reg.technique, reg.metric) == ("vanilla", "samples_per_s") and reg.change < -0.10


def test_tolerance_decides(tmp_path):
    frame = history()
    frame.loc[last(frame) & (frame["technique"] == "vanilla"), "peak_rss_mib"] *= 1.15
    assert run(frame, tmp_path, tolerance=0.10).exit_code == 1
    assert run(frame, tmp_path, tolerance=0.20).exit_code == 0


def test_median_uses_only_the_last_window_ok_nights():
    # 20 nights at 500 MiB, then 7 at 1000 MiB; the latest at 1050 MiB is +5 % on a 7-night window
    rows = [row(n, peak_rss_mib=500.0 if n < 20 else 1000.0) for n in range(27)] + [row(27, peak_rss_mib=1050.0)]
    frame = pd.DataFrame(rows)
    nights = regress.cell_nights(frame)
    latest = regress.latest_rows(frame, nights)
    near = regress.against_median(latest, regress.median_baseline(frame, nights, 7), 0.10)
    far = regress.against_median(latest, regress.median_baseline(frame, nights, 30), 0.10)
    assert near == [] and [r.baseline for r in far] == [500.0]


def test_failed_nights_do_not_enter_the_baseline():
    rows = [row(n, peak_rss_mib=1000.0) for n in range(5)]
    rows += [row(n, status="failed", peak_rss_mib=5000.0) for n in range(5, 9)]  # what an OOM-killed job saw
    rows += [row(9, peak_rss_mib=1500.0)]
    frame = pd.DataFrame(rows)
    nights = regress.cell_nights(frame)
    [reg] = regress.against_median(regress.latest_rows(frame, nights), regress.median_baseline(frame, nights, 7), 0.1)
    assert reg.baseline == 1000.0


def test_a_cell_with_no_earlier_night_has_no_median_check(tmp_path):
    frame = pd.concat([history(), pd.DataFrame([row(9, "zero3", peak_rss_mib=99999.0, samples_per_s=0.1)])])
    assert run(frame, tmp_path).exit_code == 0


# ---------------------------------------------------------------- references


REFS = {"testcluster:cpu": {"tiny-gpt2": {
    "vanilla": {"peak_rss_mib": [1000, None, 0.10], "samples_per_s": [50, -0.2, None],
                "peak_allocated_mib": [100, -0.1, 0.1]},  # not measured on CPU: not checked
    "accum": {"peak_rss_mib": [2000, -0.05, 0.05]}}}}


def test_history_within_references_is_clean(tmp_path):
    assert run(history(), tmp_path, references=REFS).exit_code == 0


def test_reference_crossed_is_flagged_in_either_direction_but_not_past_null(tmp_path):
    frame = history()
    frame.loc[last(frame) & (frame["technique"] == "vanilla"), "peak_rss_mib"] = 1150.0   # upper +10 %: crossed
    frame.loc[last(frame) & (frame["technique"] == "vanilla"), "samples_per_s"] = 500.0  # upper null: fine
    frame.loc[last(frame) & (frame["technique"] == "accum"), "peak_rss_mib"] = 1850.0    # lower -5 %: crossed
    outcome = run(frame, tmp_path, references=REFS, tolerance=10.0)  # the median check cannot fire
    found = {(r.technique, r.metric): r for r in outcome.regressions}
    assert set(found) == {("vanilla", "peak_rss_mib"), ("accum", "peak_rss_mib")} and outcome.exit_code == 1
    up, down = found[("vanilla", "peak_rss_mib")], found[("accum", "peak_rss_mib")]
    assert (up.against, up.baseline, up.limit) == ("reference", 1000.0, 0.10) and up.change == pytest.approx(0.15)
    assert (down.baseline, down.limit) == (2000.0, -0.05) and down.change == pytest.approx(-0.075)


def test_references_only_look_at_the_latest_night(tmp_path):
    frame = history()
    frame.loc[frame["night"] == frame["night"].min(), "peak_rss_mib"] = 9999.0
    assert [r.against for r in run(frame, tmp_path, references=REFS).regressions] == []


# ---------------------------------------------------------------- newly failing cells


def test_newly_failing_cell_is_flagged(tmp_path):
    frame = history()
    frame.loc[last(frame) & (frame["technique"] == "accum"), ["status", "verdict", "error", "samples_per_s"]] = [
        "failed", "host_oom", "oom-kill event", None]
    outcome = run(frame, tmp_path)
    assert outcome.exit_code == 1 and outcome.regressions == []
    assert outcome.new_failures == [{"site": "testcluster", "partition": "cpu", "model": "tiny-gpt2",
                                     "technique": "accum", "matrix": "ci-small", "night": "2026-11-10",
                                     "status": "failed",
                                     "verdict": "host_oom", "error": "oom-kill event", "previous_night": "2026-11-09"}]


def test_a_cell_not_run_on_the_latest_night_is_not_newly_failing_and_keeps_its_row(tmp_path):
    # `bench run --only vanilla` on the last night: accum did not run, it did not fail
    frame = history()
    frame = frame[~(last(frame) & (frame["technique"] == "accum"))]
    outcome = run(frame, tmp_path)
    assert outcome.new_failures == [] and outcome.pending == [] and outcome.exit_code == 0
    text = outcome.path.read_text()
    assert "| accum | 0.100 |" in text and "ok (night 2026-11-09)" in text  # its latest night, said so


def test_a_partial_night_judges_each_cell_on_its_own_latest_night(tmp_path):
    # night 10 ran only partition gpu (`bench run -p gpu`): cpu cells keep night 9, and a cpu cell
    # that regressed on night 9 is still flagged against the nights before it
    frame = history()
    frame.loc[frame["night"] == "2026-11-10", "partition"] = "gpu"
    frame.loc[(frame["night"] == "2026-11-09") & (frame["technique"] == "accum"), "peak_rss_mib"] *= 1.5
    outcome = run(frame, tmp_path)
    assert outcome.new_failures == []
    assert [(r.partition, r.technique, r.night) for r in outcome.regressions] == [("cpu", "accum", "2026-11-09")]
    text = outcome.path.read_text()
    assert "## testcluster:cpu, night 2026-11-09" in text and "## testcluster:gpu, night 2026-11-10" in text


def test_a_second_matrix_on_the_site_hides_nothing_and_accuses_nothing(tmp_path):
    # the nightly matrix ran up to night 9; a smaller matrix ran one cell on night 10
    frame = history()
    frame = frame[~last(frame)]
    other = pd.DataFrame([row(9, "zero3", model="gpt2", matrix="smoke", peak_rss_mib=500.0)])
    outcome = run(pd.concat([frame, other]), tmp_path)
    assert outcome.new_failures == [] and outcome.exit_code == 0
    text = outcome.path.read_text()
    assert "### tiny-gpt2 · matrix ci-small" in text and "### gpt2 · matrix smoke" in text


def test_two_matrices_with_the_same_cell_are_two_cells(tmp_path):
    frame = history()
    twin = frame[frame["technique"] == "vanilla"].assign(matrix="smoke")
    twin.loc[twin["night"] == twin["night"].max(), "status"] = "failed"
    outcome = run(pd.concat([frame, twin]), tmp_path)
    assert [(f["technique"], f["matrix"]) for f in outcome.new_failures] == [("vanilla", "smoke")]


def test_a_submitted_cell_without_a_row_is_pending_not_failing(tmp_path):
    frame = history()
    frame = frame[~(last(frame) & (frame["technique"] == "accum"))]
    submitted = [{"night": "2026-11-10", "site": "testcluster", "matrix": "ci-small", "partition": "cpu",
                  "model": "tiny-gpt2", "technique": t, "run_id": "r", "state": "submitted"}
                 for t in ("vanilla", "accum")]
    outcome = run(frame, tmp_path, submitted=submitted)
    assert outcome.exit_code == 0 and outcome.new_failures == []
    assert outcome.pending == [{"site": "testcluster", "partition": "cpu", "model": "tiny-gpt2", "technique": "accum",
                                "matrix": "ci-small", "night": "2026-11-10", "state": "submitted",
                                "last_night": "2026-11-09"}]
    text = outcome.path.read_text()
    assert "| testcluster:cpu tiny-gpt2 accum [ci-small] | 2026-11-10 | submitted, no row yet" in text
    assert "ok (night 2026-11-09); 2026-11-10 pending" in text
    html = run(frame, tmp_path, submitted=submitted, fmt="html").path.read_text()
    assert "<td>testcluster:cpu tiny-gpt2 accum [ci-small]</td><td>2026-11-10</td><td>submitted, no row yet" in html
    assert run(frame, tmp_path, submitted=submitted, since=datetime.date(2026, 11, 11) - datetime.timedelta(days=1)
               ).pending[0]["night"] == "2026-11-10"


def test_a_failure_after_a_night_not_run_is_still_newly_failing(tmp_path):
    frame = history()
    frame = frame[~((frame["night"] == "2026-11-09") & (frame["technique"] == "accum"))]
    frame.loc[last(frame) & (frame["technique"] == "accum"), "status"] = "failed"
    [failure] = run(frame, tmp_path).new_failures
    assert (failure["technique"], failure["previous_night"]) == ("accum", "2026-11-08")


def test_skipped_cells_are_shown_and_never_fail_or_regress(tmp_path):
    frame = history()
    skipped = [row(n, "fp16-mixed", status="skipped", verdict="", error="no GPU") for n in range(10)]
    # ok, then skipped (bitsandbytes uninstalled), then failed: the skip is not a failure, the failure is new
    frame.loc[(frame["night"] == "2026-11-09") & (frame["technique"] == "accum"), ["status", "verdict", "error"]] = [
        "skipped", "", "bitsandbytes not installed"]
    outcome = run(pd.concat([frame, pd.DataFrame(skipped)]), tmp_path)
    assert outcome.regressions == [] and outcome.new_failures == [] and outcome.exit_code == 0
    assert "| fp16-mixed | - | - | - | - | - | - | skipped: no GPU |" in outcome.path.read_text()
    html = run(pd.concat([frame, pd.DataFrame(skipped)]), tmp_path, fmt="html").path.read_text()
    assert "<td>skipped: no GPU</td>" in html and 'class="bad"' not in html
    frame.loc[last(frame) & (frame["technique"] == "accum"), "status"] = "failed"
    [failure] = run(frame, tmp_path).new_failures
    assert (failure["technique"], failure["previous_night"]) == ("accum", "2026-11-08")


def test_a_cell_skipped_on_its_latest_night_is_not_judged():
    frame = history()
    frame.loc[frame["night"] == "2026-11-09", "status"] = "failed"
    frame.loc[last(frame), ["status", "error"]] = ["skipped", "no GPU"]
    frame = frame[frame["night"] >= "2026-11-08"]
    assert regress.new_failures(frame, regress.cell_nights(frame)) == []


def test_a_cell_failing_two_nights_running_is_not_new():
    frame = history()
    frame.loc[frame["night"] >= "2026-11-09", "status"] = "failed"
    assert regress.new_failures(frame, regress.cell_nights(frame)) == []


def test_latest_night_is_per_cell():
    other = [dict(row(n, site="example-hpc", partition="a100-40gb", peak_allocated_mib=10.0)) for n in (0, 1)]
    frame = pd.concat([history(), pd.DataFrame(other)])
    nights = regress.cell_nights(frame).set_index(["site", "technique"])
    assert nights.loc[("example-hpc", "vanilla"), "latest"] == "2026-11-02"
    assert nights.loc[("testcluster", "vanilla"), "latest"] == "2026-11-10"
    assert regress.new_failures(frame, regress.cell_nights(frame)) == []


# ---------------------------------------------------------------- the references file


def write(tmp_path, text) -> Path:
    path = tmp_path / "refs.yaml"
    path.write_text(text)
    return path


def test_shipped_references_name_cells_a_shipped_matrix_runs():
    refs = load_references(data_dir("jobs") / "nightly" / "references.yaml")
    runs = set()
    for name in shipped_matrices():
        matrix = load_matrix(name)
        for site, partitions in matrix.sites.items():
            for partition in partitions:
                load_site(site).partition(partition)
                for model in matrix.models:
                    if model.partitions is None or partition in model.partitions:
                        runs |= {(site, partition, model.name, t) for t in model.techniques or matrix.techniques}
    cells = set(regress.references_frame(refs)[list(regress.REF_CELL)].itertuples(index=False, name=None))
    assert cells and cells <= runs, cells - runs


@pytest.mark.parametrize("text, message", [
    ("testcluster:cpu: {tiny-gpt2: {vanilla: {peak_rss: [900, -0.1, 0.1]}}}",
     "testcluster:cpu.tiny-gpt2.vanilla.peak_rss: unknown key"),
    ("testcluster:cpu: {tiny-gpt2: {vanilla: {peak_rss_mib: [900, -0.1]}}}",
     "testcluster:cpu.tiny-gpt2.vanilla.peak_rss_mib: expected [value, lower, upper], got 2 item(s)"),
    ("testcluster:cpu: {tiny-gpt2: {vanilla: {peak_rss_mib: [900, 0.1, 0.2]}}}",
     "peak_rss_mib: the lower tolerance must be <= 0"),
    ("testcluster:cpu: {tiny-gpt2: {vanilla: {peak_rss_mib: [900, -0.1, -0.2]}}}",
     "peak_rss_mib: the upper tolerance must be >= 0"),
    ("testcluster:cpu: {tiny-gpt2: {vanilla: {samples_per_s: [null, -0.1, null]}}}",
     "samples_per_s: the reference value must be a number > 0"),
    ("testcluster:cpu: {tiny-gpt2: {vanilla: {samples_per_s: [50, '10%', null]}}}",
     "samples_per_s.1: expected number or null, got str '10%'"),
    ("testcluster-cpu: {tiny-gpt2: {vanilla: {samples_per_s: [50, -0.1, null]}}}",
     "testcluster-cpu: expected a 'site:partition' key"),
    ("testcluster:cpu: {tiny-gpt2: [vanilla]}", "testcluster:cpu.tiny-gpt2: expected object, got list"),
    ("testcluster:cpu: {tiny-gpt2: {vanilla: {samples_per_s: [50, -0.1, null}}", "not valid YAML"),
])
def test_bad_references_name_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_references(path)
    assert str(err.value).startswith(str(path)) and message in str(err.value) and "\n" not in str(err.value)


def test_missing_references_file(tmp_path):
    with pytest.raises(ConfigError, match="refs.yaml: cannot read"):
        load_references(tmp_path / "refs.yaml")


def test_regressions_serialize_to_json(tmp_path):
    frame = history()
    frame.loc[last(frame), "peak_rss_mib"] *= 2
    data = run(frame, tmp_path, references=REFS).to_dict()
    assert json.loads(json.dumps(data)) == data and data["exit_code"] == 1
    assert {r["against"] for r in data["regressions"]} == {"median", "reference"}
