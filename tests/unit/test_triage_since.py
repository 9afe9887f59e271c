"""toolkit.triage.since, the pure parts: the window's start, and grouping jobs by verdict kind."""

from datetime import datetime, timezone

import pytest

from toolkit.classify import Verdict
from toolkit.errors import ConfigError
from toolkit.sites import load_site
from toolkit.triage.facts import JobFacts
from toolkit.triage.since import GENERIC_REMEDY, _first_remedy, group, parse_since

NOW = 1_800_000_000.0


@pytest.mark.parametrize("text, back_s", [("24h", 86400), ("90m", 5400), ("7d", 604800), ("2w", 1209600),
                                          (" 30s ", 30), ("1.5h", 5400)])
def test_spans_count_back_from_now(text, back_s):
    assert parse_since(text, NOW) == NOW - back_s


def test_dates_and_bad_spans():
    assert parse_since("2026-11-20T00:00:00+00:00", NOW) == datetime(2026, 11, 20, tzinfo=timezone.utc).timestamp()
    with pytest.raises(ConfigError, match="--since 'yesterday'"):
        parse_since("yesterday", NOW)


def test_groups_are_largest_first_with_users_partitions_and_top_remedies():
    def row(job, kind, user="ann", part="v100", remedy=None):
        return JobFacts(job_id=job, user=user, partition=part), Verdict(kind, reason=f"{kind} {job}"), remedy
    groups = group([row("1", "not_oom"), row("2", "gpu_oom", remedy="micro_batch:8->4"),
                    row("3", "gpu_oom", user="bob", remedy="micro_batch:8->4"),
                    row("4", "gpu_oom", part="a100", remedy="precision:bf16-mixed"), row("5", "host_oom")])
    assert [g.kind for g in groups] == ["gpu_oom", "host_oom", "not_oom"]  # ties: OOM kinds first
    top = groups[0].to_dict()
    assert top["count"] == 3 and top["users"] == {"ann": 2, "bob": 1} and top["partitions"] == {"v100": 2, "a100": 1}
    assert top["top_remedies"][0] == {"remedy": "micro_batch:8->4", "count": 2}
    assert [j["job_id"] for j in top["jobs"]] == ["2", "3", "4"]


def test_first_remedy_is_the_ladders_move_when_the_plan_is_known():
    site = load_site("example-hpc")
    verdict = Verdict("gpu_oom", {"tried_to_allocate_mib": 2048.0, "total_capacity_mib": 16148.0, "free_mib": 400.0,
                                  "process_in_use_mib": 15700.0, "allocated_by_pytorch_mib": 14500.0,
                                  "reserved_unallocated_mib": 300.0})
    facts = JobFacts(job_id="7", partition="v100-16gb")
    known = _first_remedy(verdict, {"micro_batch": 16, "global_batch": 64, "gpus_per_node": 4}, site, facts)
    assert known and known != GENERIC_REMEDY["gpu_oom"] and "bf16" not in known
    assert _first_remedy(verdict, None, site, facts) == GENERIC_REMEDY["gpu_oom"]


def test_groups_keep_where_and_when_each_job_died_and_how_sure():
    from toolkit.triage.report import JobRow
    rows = [(JobFacts(job_id="1", user="ann", partition="v100"),
             Verdict("host_oom", reason="killed", cause="sigkill", confidence="medium", phase="load"), None),
            (JobFacts(job_id="2", user="ann", partition="v100"),
             Verdict("host_oom", reason="killed", cause="sigkill", confidence="medium", step=400, total_steps=900),
             None),
            (JobFacts(job_id="3", user="bob", partition="v100"),
             Verdict("gpu_oom", reason="oom", phase="eval", step=12, total_steps=50), "micro_batch:8->4")]
    groups = group(rows)
    host = groups[0].to_dict()
    assert host["kind"] == "host_oom" and host["phases"] == {"load": 1, "?": 1}
    assert "sacct" in host["hint"]  # the table's hint, since no remedy was counted
    assert host["jobs"][1] == {"job_id": "2", "user": "ann", "partition": "v100", "reason": "killed",
                               "cause": "sigkill", "confidence": "medium", "phase": None, "step": 400,
                               "total_steps": 900}
    job_id, user, partition, reason = groups[1].jobs[0]  # still unpacks as before
    assert (job_id, user) == ("3", "bob") and isinstance(groups[1].jobs[0], JobRow)


def test_since_json_matches_its_schema():
    import json
    from pathlib import Path

    from toolkit.schema import validate
    from toolkit.triage.report import SinceReport

    rows = [(JobFacts(job_id="1", user="ann", partition="v100"),
             Verdict("not_oom", reason="segfault", cause="segfault", phase="teardown"), None)]
    report = SinceReport(NOW - 3600, NOW, None, None, group(rows))
    schema = json.loads((Path(__file__).resolve().parents[2] / "docs" / "triage-since.schema.json").read_text())
    validate(report.to_dict(), schema, "triage --since")
