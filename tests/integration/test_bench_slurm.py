"""The nightly benchmark end to end on the real test cluster: the shipped ci-small matrix (tiny GPT-2 x
techniques, ZeRO-3 with CPU offload included, real torch and DeepSpeed on the CPU) plus one cell starved of
memory (a real cgroup OOM), through `hpcmem bench run`, `bench collect --wait` and `bench report`."""

import json
from pathlib import Path

import pytest
import yaml

from toolkit.bench import store
from toolkit.bench.columns import COLUMNS, KEY

from hpcmem_cli import run_cli as hpcmem

REPO = Path(__file__).resolve().parents[2]
NIGHT = "2026-01-15"


def _matrix_with_a_starved_cell(tmp_path: Path) -> Path:
    """The shipped ci-small matrix plus a model whose one cell gets 300 MiB of --mem: the cgroup kills it."""
    doc = yaml.safe_load((REPO / "jobs" / "nightly" / "ci-small.yaml").read_text())
    starved = dict(doc["models"][0], name="tiny-gpt2-starved", techniques=["vanilla"], set={"mem_mib": 300})
    doc["models"].append(starved)
    path = tmp_path / "ci-small.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.slurm
def test_ci_small_matrix_runs_collects_once_and_reports(slurm_cluster, hpcmem_home, tmp_path):
    matrix = _matrix_with_a_starved_cell(tmp_path)
    ran = hpcmem("bench", "run", matrix, "--site", "testcluster", "--night", NIGHT, "--json", home=hpcmem_home,
                 check=True)
    manifest = json.loads(ran.stdout)
    cells = {(c["model"], c["technique"]): c for c in manifest["cells"]}
    assert cells[("tiny-gpt2", "fp16-mixed")]["status"] == "skipped"
    assert "no GPU" in cells[("tiny-gpt2", "fp16-mixed")]["reason"]
    submitted = [c for c in manifest["cells"] if c["status"] == "submitted"]
    assert {c["technique"] for c in submitted} >= {"vanilla", "zero3-offload-cpu", "fsdp"} and len(submitted) == 7
    assert all(c["run_id"] and c["job_id"] for c in submitted)
    assert Path(manifest["path"]) == hpcmem_home / "bench" / f"{NIGHT}-ci-small-testcluster.json"

    again = json.loads(hpcmem("bench", "run", matrix, "--site", "testcluster", "--night", NIGHT, "--json",
                              home=hpcmem_home, check=True).stdout)  # resumes: nothing is submitted twice
    assert [c["run_id"] for c in again["cells"]] == [c["run_id"] for c in manifest["cells"]]

    collected = hpcmem("bench", "collect", "--wait", "--interval", "2", "--timeout", "600", "--json",
                       home=hpcmem_home, check=True)
    result = json.loads(collected.stdout)
    assert result["added"] == len(submitted) + 1 and result["pending"] == [] and result["skipped"] == 1

    frame = store.load(hpcmem_home / "bench" / "results.sqlite")
    assert list(frame.columns) == list(COLUMNS)
    assert len(frame) == len(submitted) + 1 and not frame.duplicated(list(KEY)).any()
    skipped = frame[frame.status == "skipped"].iloc[0]  # stored so the report shows it, with its reason
    assert skipped.technique == "fp16-mixed" and "no GPU" in skipped.error
    assert set(frame.night) == {NIGHT} and set(frame.matrix) == {"ci-small"} and set(frame.partition) == {"cpu"}

    ok = frame[frame.status == "ok"]
    assert set(ok.technique) == {c["technique"] for c in submitted if c["model"] == "tiny-gpt2"}
    assert (ok.samples_per_s > 0).all() and (ok.peak_rss_mib > 100).all() and (ok.steps == 6).all()
    assert (ok.predicted_peak_mib > 0).all() and ok.torch.str.startswith("2.").all() and ok.deepspeed.notna().all()
    offload = ok[ok.technique == "zero3-offload-cpu"].iloc[0]
    assert (offload.launcher, offload.zero_stage, offload.offload_params) == ("deepspeed", 3, "cpu")
    assert offload.predicted_host_mib > 0  # offloaded states live in host memory
    ckpt = ok[ok.technique == "accum+ckpt"].iloc[0]
    assert ckpt.checkpointing == True and ckpt.micro_batch * ckpt.grad_accum == 8  # noqa: E712

    failed = frame[frame.model == "tiny-gpt2-starved"].iloc[0]
    assert failed.status == "failed" and failed.verdict == "host_oom", failed.to_dict()
    assert failed.error and failed.job_id and failed.run_id

    second = json.loads(hpcmem("bench", "collect", "--json", home=hpcmem_home, check=True).stdout)
    assert second["added"] == 0 and second["rows"] == []
    assert len(store.load(hpcmem_home / "bench" / "results.sqlite")) == len(submitted) + 1

    # The first report: one night, no references, nothing to compare with: clean, even with the starved
    # cell failed (it never worked, so it is not newly failing).
    out = tmp_path / "report"
    report = hpcmem("bench", "report", "-o", out, "--format", "html", "--json", home=hpcmem_home)
    assert report.returncode == 0, (report.stdout, report.stderr)
    outcome = json.loads(report.stdout)
    assert outcome["exit_code"] == 0 and outcome["new_failures"] == [] and outcome["pending"] == []
    html = Path(outcome["path"]).read_text()
    assert Path(outcome["path"]).parent == out and "zero3-offload-cpu" in html and "data:image/png;base64," in html
    assert "skipped: " in html and "fp16-mixed" in html

    # A regression injected into a copy of this history: the same cells on three earlier nights, where
    # vanilla needed 30 % less memory. The report flags it and exits 1; the real store is untouched.
    frame = store.load(hpcmem_home / "bench" / "results.sqlite")
    earlier = []
    for night in ("2026-01-12", "2026-01-13", "2026-01-14"):
        rows = frame.copy()
        rows["night"] = night
        vanilla = rows.technique == "vanilla"
        rows.loc[vanilla, "peak_rss_mib"] = rows.loc[vanilla, "peak_rss_mib"] * 0.7
        earlier.append(rows)
    copy = tmp_path / "history-copy.sqlite"
    records = [{k: (None if v != v else v) for k, v in row.items()}  # NaN -> None (not measured)
               for part in [frame, *earlier] for row in part.to_dict("records")]
    assert store.append(copy, records) == 4 * len(frame)
    flagged = hpcmem("bench", "report", "--store", copy, "-o", tmp_path / "flagged", "--json", home=hpcmem_home)
    assert flagged.returncode == 1, flagged.stderr
    found = json.loads(flagged.stdout)["regressions"]
    assert any(r["technique"] == "vanilla" and r["metric"] == "peak_rss_mib" for r in found), found
    assert len(store.load(hpcmem_home / "bench" / "results.sqlite")) == len(submitted) + 1
