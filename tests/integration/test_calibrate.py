"""hpcmem calibrate: a real probe job on the Slurm test cluster (submitit) and locally; the site then uses it."""

import json
from pathlib import Path

import pytest
import yaml

from toolkit import sites

REPO = Path(__file__).resolve().parents[2]


from hpcmem_cli import run_cli as hpcmem  # noqa: E402


@pytest.mark.slurm
def test_calibrate_runs_a_probe_job_and_keeps_the_result(slurm_cluster, tmp_path, monkeypatch):
    result = hpcmem("calibrate", "--site", "testcluster", "--partition", "a100", "--json", home=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["measured"]["host_mem_gib"] > 0 and out["measured"]["nvme_free_gib"] > 0
    assert out["measured"]["gpus"] == 0  # the test cluster's GPUs are dummy devices: nothing to measure
    path = Path(out["file"])
    assert path == tmp_path / "calibration" / "testcluster.calibration.yaml"  # never inside the installation
    assert yaml.safe_load(path.read_text())["partitions"]["a100"]["host"]
    monkeypatch.setenv("HPCMEM_HOME", str(tmp_path))
    part = sites.load_site("testcluster").partition("a100")
    assert part.calibrated and part.gpu_mem_gib == 40  # no GPU seen: the profile's GPU values stay


def test_measured_gpu_values_replace_the_profile(tmp_path, monkeypatch):
    """A calibration file as a GPU node writes it (literal values; no GPU here) is applied over the profile."""
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "example-hpc.calibration.yaml").write_text(yaml.safe_dump({"partitions": {
        "a100-40gb": {"gpus": 4, "gpu_mem_gib": 39.4, "cuda_context_mib": 611.0, "bf16": True,
                      "flash_attention": True, "allocator_overhead_frac": 0.06}}}))
    monkeypatch.setenv("HPCMEM_HOME", str(tmp_path))
    site = sites.load_site("example-hpc")
    a100, v100 = site.partition("a100-40gb"), site.partition("v100-16gb")
    assert (a100.calibrated, a100.gpu_mem_gib, a100.cuda_context_mib, a100.allocator_overhead_frac) == (True, 39.4, 611.0, 0.06)
    assert not v100.calibrated and v100.cuda_context_mib == 420


def test_local_calibration_is_in_process(tmp_path, monkeypatch):
    import torch

    from toolkit.calibrate import cpu_precisions

    result = hpcmem("calibrate", "--site", "local", "--json", home=tmp_path)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout)["measured"]
    assert measured["host_mem_gib"] > 0
    if measured["gpus"] == 0:  # a CPU machine: its precision support is measured and then applied
        fp16 = cpu_precisions(torch)["fp16"]
        assert (measured["fp16"], measured["bf16"]) == (fp16, True)
        monkeypatch.setenv("HPCMEM_HOME", str(tmp_path))
        assert sites.load_site("local").partition(None).fp16 is fp16
        plan = hpcmem("plan", "quickstart", "--site", "local", "--set", "precision=fp16-mixed", home=tmp_path)
        if not fp16:
            assert plan.returncode != 0 and plan.stderr.strip().count("\n") == 0
            assert "has no fp16 support" in plan.stderr


def _record_attempts(home, site_name, partition, rank_metrics):
    """Runs in the ledger whose attempts carry metrics.json as a GPU job writes it. FAKE: the per-rank GPU
    figures are literal numbers (no GPU exists here), in the shape toolkit.runtime writes them."""
    from toolkit import runs
    from toolkit.jobspec import load_spec
    from toolkit.sites import load_site

    site = load_site(site_name)
    part = site.partition(partition)
    spec = load_spec("quickstart")
    with runs.open_ledger(home) as ledger:
        for ranks in rank_metrics:
            run = runs.create_run(ledger, spec, site, part, spec.first_plan(part), home=home)
            ledger.update_attempt(run.run_id, 1, state="COMPLETED", metrics={"ranks": ranks})


def test_calibrate_from_runs_fits_overheads_and_the_estimate_uses_them(tmp_path, monkeypatch):
    gpu_rank = lambda alloc, reserved, used: {"peak_allocated_mib": alloc, "peak_reserved_mib": reserved,
                                              "device_used_mib": used}
    _record_attempts(tmp_path, "example-hpc", "a100-40gb", [
        {"0": gpu_rank(10000, 11000, 11600), "1": gpu_rank(10000, 11000, 11620)},
        {"0": gpu_rank(20000, 21800, 22400)},
    ])
    out = hpcmem("calibrate", "--site", "example-hpc", "--partition", "a100-40gb", "--from-runs", "--json", home=tmp_path)
    assert out.returncode == 0, out.stderr
    fitted = json.loads(out.stdout)["measured"]
    assert fitted["allocator_overhead_frac"] == 0.1 and fitted["cuda_context_mib"] == 600.0
    monkeypatch.setenv("HPCMEM_HOME", str(tmp_path))
    part = sites.load_site("example-hpc").partition("a100-40gb")
    assert part.calibrated and part.allocator_overhead_frac == 0.1 and part.cuda_context_mib == 600.0
    est = json.loads(hpcmem("estimate", "gpt2-clm", "--site", "example-hpc", "--partition", "a100-40gb", "--json",
                            home=tmp_path).stdout)
    assert est["components"]["cuda_context"] == 600.0
    assert est["components"]["allocator_overhead"] == pytest.approx(0.1 * est["peak_allocated_mib"], rel=1e-6)


def test_calibrate_from_runs_without_gpu_measurements_says_so(tmp_path):
    _record_attempts(tmp_path, "testcluster", "cpu", [{"0": {"peak_rss_mib": 800.0}}])
    out = hpcmem("calibrate", "--site", "testcluster", "--partition", "cpu", "--from-runs", home=tmp_path)
    assert out.returncode != 0 and "nothing to fit yet" in out.stderr and len(out.stderr.strip().splitlines()) == 1
