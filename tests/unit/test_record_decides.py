"""The record decides (issue 10): a run records the site profile as resolved at submission (runs/<id>/site.json)
beside its spec copy, and its later attempts are planned from that record: editing or deleting the user's site
file after `submit` changes nothing for the run."""

import json
from pathlib import Path

import pytest

from toolkit import controller, runs
from toolkit.classify import classify
from toolkit.errors import LedgerError
from toolkit.jobspec import load_spec
from toolkit.resources import data_dir
from toolkit.sites import load_site, load_site_file, site_from_record, site_record

from oom_messages import new_oom

OOM_LOG = new_oom(2.0, 15.77, 0.5, 15.2, 13.9, 0.6) + "\n"


class Record:
    state, exit_code, signal = "FAILED", 1, None


def submit(tmp_path, site_file):
    """A run of quickstart on the site file's v100 partition whose first attempt ended in a CUDA OOM."""
    site = load_site_file(site_file)
    part = site.partition("v100")
    spec = load_spec("quickstart")
    ledger = runs.open_ledger(tmp_path / "home")
    run = runs.create_run(ledger, spec, site, part, spec.first_plan(part, {"gpus_per_node": 2}), home=tmp_path / "home")
    verdict = classify(Record(), OOM_LOG)
    assert verdict.is_oom
    ledger.update_attempt(run.run_id, 1, job_id="101", state="FAILED", exit_code=1, verdict=verdict.to_dict(),
                          finished=1.0)
    return ledger, run


@pytest.fixture
def site_file(tmp_path):
    """The user's own site profile (a copy of the test cluster's, under its own name)."""
    path = tmp_path / "sites" / "mysite.yaml"
    path.parent.mkdir()
    path.write_text((data_dir("site_configs") / "testcluster.yaml").read_text().replace("site: testcluster",
                                                                                          "site: mysite"))
    return path


def next_attempt(ledger, run):
    controller.tick(ledger, run.run_id)
    attempts = ledger.attempts(run.run_id)
    assert ledger.run(run.run_id).state == "running" and len(attempts) == 2, ledger.run(run.run_id).reason
    return attempts[-1]


def test_the_resolved_site_is_recorded_at_submit(tmp_path, site_file):
    ledger, run = submit(tmp_path, site_file)
    recorded = json.loads((Path(run.run_dir) / "site.json").read_text())
    assert site_from_record(recorded, "site.json") == load_site_file(site_file)
    assert recorded["partitions"]["v100"]["gpu_mem_gib"] == 16 and recorded["path"] == str(site_file)
    ledger.close()


def test_a_deleted_site_file_does_not_stop_the_next_attempt(tmp_path, site_file):
    ledger, run = submit(tmp_path, site_file)
    site_file.unlink()
    attempt = next_attempt(ledger, run)
    assert attempt.partition == "v100" and attempt.decision["moves"]
    assert runs.load_site_for(run).partition("v100").slurm_partition == "v100"
    ledger.close()


def test_an_edited_site_file_changes_nothing_for_a_submitted_run(tmp_path, site_file):
    ledger, as_submitted = submit(tmp_path, site_file)
    expected = next_attempt(ledger, as_submitted)  # decided from the file as it was
    _, run = submit(tmp_path, site_file)
    text = site_file.read_text()
    edited = text.replace("gpu_mem_gib: 16", "gpu_mem_gib: 80", 1).replace("slurm_partition: v100",
                                                                          "slurm_partition: elsewhere", 1)
    assert edited != text
    site_file.write_text(edited)
    assert load_site_file(site_file).partition("v100").gpu_mem_gib == 80  # the file now says otherwise
    attempt = next_attempt(ledger, run)
    assert (attempt.plan, attempt.partition, attempt.decision["moves"]) == \
        (expected.plan, expected.partition, expected.decision["moves"])
    part = runs.load_site_for(run).partition("v100")
    assert (part.gpu_mem_gib, part.slurm_partition) == (16, "v100")
    ledger.close()


def test_a_run_without_a_site_record_reads_its_site_file_and_a_damaged_record_is_one_error(tmp_path, site_file):
    ledger, run = submit(tmp_path, site_file)
    record = Path(run.run_dir) / "site.json"
    record.unlink()  # as a run made before hpcmem recorded the site
    assert runs.load_site_for(run) == load_site_file(site_file)
    record.write_text("{not json")
    with pytest.raises(LedgerError, match="site.json is unreadable"):
        runs.load_site_for(run)
    record.write_text(json.dumps({"site": "mysite", "scheduler": "slurm", "path": "x",
                                  "partitions": {"v100": {"name": "v100", "colour": "red"}}}))
    with pytest.raises(LedgerError, match="not a recorded site profile.*colour"):
        runs.load_site_for(run)
    ledger.close()


@pytest.mark.parametrize("name", ["testcluster", "example-hpc", "local"])
def test_every_shipped_site_round_trips_through_its_record(name):
    site = load_site(name)
    assert site_from_record(json.loads(json.dumps(site_record(site))), name) == site


def test_triage_reads_a_run_s_site_as_recorded(tmp_path, site_file):
    from types import SimpleNamespace

    from toolkit.triage import _case_site

    ledger, run = submit(tmp_path, site_file)
    site_file.write_text(site_file.read_text().replace("gpu_mem_gib: 16", "gpu_mem_gib: 80", 1))
    case = SimpleNamespace(facts=SimpleNamespace(run_id=run.run_id, site="mysite"))
    assert _case_site(case, [site_file.parent], ledger).partition("v100").gpu_mem_gib == 16
    site_file.unlink()
    assert _case_site(case, [site_file.parent], ledger).partition("v100").gpu_mem_gib == 16
    outside = SimpleNamespace(facts=SimpleNamespace(run_id=None, site="testcluster"))  # not an hpcmem run: by name
    assert _case_site(outside, [], ledger).name == "testcluster"
    ledger.close()
