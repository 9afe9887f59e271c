"""hpcmem triage on logs, without Slurm (support staff on another machine): real logs of real tools, bad input.

The command runs for real (tests/hpcmem_cli.py); PATH holds no Slurm command, so a job id can only be
answered with what could not be found.
"""

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest

from hpcmem_cli import run_cli
from toolkit.schema import load_schema, validate
from toolkit.triage.formats import render_report

REPO = Path(__file__).resolve().parents[2]
LOGS = REPO / "tests" / "fixtures" / "logs"
SCHEMA = load_schema(REPO / "docs" / "triage.schema.json")


@pytest.fixture
def no_slurm(tmp_path):
    """An environment whose PATH has python but no sbatch/sacct/scontrol."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("python3", "python"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return {"PATH": str(bin_dir)}


def triage(*args, home, env=None, fmt="json", stdin=None):
    result = run_cli("triage", *map(str, args), "--format", fmt, home=home, env=env, input=stdin)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    if fmt == "json":
        data = json.loads(result.stdout)
        validate(data, SCHEMA, "triage --format json")
        return data["findings"]
    return result.stdout


@pytest.mark.parametrize("log, kind", [
    ("hf_trainer_gpu_oom_torch22.log", "gpu_oom"),
    ("lightning_gpu_oom_torch113_fragmentation.log", "gpu_oom_fragmentation"),
    ("deepspeed_launcher_sigkill.log", "host_oom"),
    ("deepspeed_cgroup_oom_slurm2205.log", "host_oom"),
    ("torchrun_rank_oom_childfailed.log", "gpu_oom_fragmentation"),
    ("illegal_memory_access.log", "not_oom"),
])
def test_logs_of_other_tools_without_slurm(log, kind, tmp_path, no_slurm):
    f, = triage(LOGS / log, "--site", "example-hpc", "--partition", "a100-40gb", home=tmp_path, env=no_slurm)
    assert f["verdict"]["kind"] == kind and f["source"] == "file" and f["partition"] == "a100-40gb"
    assert f["oom"] == (kind not in ("not_oom", "unknown"))
    if f["oom"]:
        assert f["memory"] is not None and f["remedies"], f
    else:
        assert f["remedies"] == [] and f["where_to_look"]


def test_v100_oom_remedies_keep_to_what_a_v100_can_do(tmp_path, no_slurm):
    f, = triage(LOGS / "lightning_gpu_oom_torch113_fragmentation.log", "--site", "example-hpc", home=tmp_path,
                env=no_slurm)
    assert f["partition"].startswith("v100")
    assert "expandable_segments" in " ".join(f["remedies"][0]["set_args"])
    for r in f["remedies"]:
        assert "bf16" not in " ".join(r["set_args"]) and "attention=flash" not in r["set_args"]


def test_stdin_and_directory_and_gzip(tmp_path, no_slurm):
    text = (LOGS / "hf_trainer_gpu_oom_torch22.log").read_text()
    from_stdin, = triage("-", "--site", "example-hpc", home=tmp_path, env=no_slurm, stdin=text)
    assert from_stdin["source"] == "stdin" and from_stdin["verdict"]["kind"] == "gpu_oom"
    logs = tmp_path / "job-logs"
    logs.mkdir()
    with gzip.open(logs / "slurm-77.out.gz", "wt") as f:
        f.write(text)
    from_dir, = triage(logs, "--site", "example-hpc", home=tmp_path, env=no_slurm)
    assert from_dir["source"] == "dir" and from_dir["verdict"]["kind"] == "gpu_oom"
    assert from_dir["verdict"]["evidence"] == from_stdin["verdict"]["evidence"]


def test_bad_input_is_a_verdict_not_a_traceback(tmp_path, no_slurm):
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(os.urandom(200_000))
    empty = tmp_path / "empty.log"
    empty.write_text("")
    # The OOM, then the job kept logging; the copy of the log attached to the ticket was cut mid-stream.
    after = "".join(f"step {i} loss {i * 0.37 % 3:.4f} tokens {i * 7919 % 100003}\n" for i in range(20000))
    whole = gzip.compress(((LOGS / "hf_trainer_gpu_oom_torch22.log").read_text() + after).encode())
    truncated = tmp_path / "cut.log.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    g, e, t = triage(garbage, empty, truncated, "--site", "example-hpc", home=tmp_path, env=no_slurm)
    assert g["verdict"]["kind"] == "unknown" and any("binary" in n for n in g["notes"])
    assert e["verdict"]["kind"] == "unknown" and any("empty" in n for n in e["notes"])
    assert t["verdict"]["kind"] == "gpu_oom" and "damaged gzip" in t["verdict"]["reason"]


def test_job_id_without_slurm_says_what_could_not_be_found(tmp_path, no_slurm):
    f, = triage("4412", home=tmp_path, env=no_slurm)
    assert f["source"] == "job" and f["verdict"]["kind"] == "unknown"
    assert f["job"]["job_id"] == "4412" and any("sacct" in m or "Slurm" in m for m in f["job"]["missing"])


def test_a_path_that_does_not_exist_is_one_line(tmp_path, no_slurm):
    result = run_cli("triage", tmp_path / "nope.log", home=tmp_path, env=no_slurm)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "nope.log" in result.stderr


def test_usage_errors(tmp_path):
    assert run_cli("triage", home=tmp_path).returncode == 2
    assert run_cli("triage", "1", "--since", "24h", home=tmp_path).returncode == 2
    assert run_cli("triage", "--since", "yesterday-ish", home=tmp_path).returncode == 2


def test_text_has_colour_only_when_asked(tmp_path, no_slurm):
    data = json.loads(run_cli("triage", LOGS / "hf_trainer_gpu_oom_torch22.log", "--site", "example-hpc",
                              "--json", home=tmp_path, env=no_slurm).stdout)
    assert "\033[" in render_report(data, "text", colour=True)
    plain = render_report(data, "text", colour=False)
    assert "\033[" not in plain and "gpu_oom" in plain and "hpcmem submit" in plain


def test_the_site_can_come_from_the_environment(tmp_path, no_slurm):
    f, = triage(LOGS / "hf_trainer_gpu_oom_torch22.log", home=tmp_path, env={**no_slurm, "HPCMEM_SITE": "example-hpc"})
    assert f["site"] == "example-hpc" and f["partition"] == "a100-40gb" and f["remedies"]


def test_text_and_markdown_say_where_when_and_how_sure(tmp_path, no_slurm):
    log = tmp_path / "slurm-77.out"
    log.write_text(" 40%|####      | 400/1000 [10:00<15:00,  1.50s/it]\nKilled\n")
    f, = triage(log, "--site", "example-hpc", "--partition", "a100-40gb", home=tmp_path, env=no_slurm)
    v = f["verdict"]
    assert v["kind"] == "host_oom" and v["confidence"] == "medium" and v["step"] == 400 and v["total_steps"] == 1000
    text = triage(log, "--site", "example-hpc", "--partition", "a100-40gb", home=tmp_path, env=no_slurm, fmt="text")
    assert "at step 400 of 1000" in text and "confidence: medium" in text and "sacct" in text
    md = triage(log, "--site", "example-hpc", "--partition", "a100-40gb", home=tmp_path, env=no_slurm,
                fmt="markdown")
    assert "**Confidence:** medium" in md and "at step 400 of 1000" in md


def test_a_crash_in_teardown_after_training_says_so(tmp_path, no_slurm):
    log = tmp_path / "slurm-78.out"
    log.write_text("{'train_runtime': 812.3, 'train_samples_per_second': 9.8, 'train_loss': 1.92, 'epoch': 3.0}\n"
                   "terminate called without an active exception\n"
                   "[ERROR] [launch.py:325:sigkill_handler] ['python', 'run_clm.py'] exits with return code = -6\n")
    f, = triage(log, "--site", "example-hpc", home=tmp_path, env=no_slurm)
    assert f["verdict"]["kind"] == "not_oom" and f["verdict"]["cause"] == "teardown"
    assert f["verdict"]["phase"] == "teardown" and f["remedies"] == []
    assert "Training completed" in f["verdict"]["reason"] and "destroy_process_group" in f["where_to_look"][0]


def test_in_job_moves_the_attempt_recorded_are_shown(tmp_path, no_slurm):
    """An attempt directory whose log has an OOM the runtime answered inside the job: the rank record's
    inflight_moves come out in the JSON (schema-checked), the text and the markdown."""
    attempt = tmp_path / "attempt-1"
    attempt.mkdir()
    (attempt / "slurm-41.out").write_text(
        "step 2/4 loss 8.3\n"
        "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 419430400 bytes. Error code 12 (Cannot allocate memory)\n"
        "hpcmem: out of memory in step 3; in-job move: micro_batch 4 -> 2\nstep 3/4 loss 8.2\nstep 4/4 loss 8.1\n")
    move = {"step": 3, "verdict": {"kind": "cpu_alloc_oom", "reason": "can't allocate memory"},
            "from": {"micro_batch": 4, "grad_accum": 2, "checkpointing": False},
            "to": {"micro_batch": 2, "grad_accum": 4, "checkpointing": False}, "global_batch": 8}
    (attempt / "metrics.json").write_text(json.dumps({"ranks": {"0": {"rank": 0, "inflight_moves": [move]}}}))
    (finding,) = triage(attempt / "slurm-41.out", home=tmp_path, env=no_slurm)
    assert finding["inflight_moves"] == [move]
    text = triage(attempt / "slurm-41.out", home=tmp_path, env=no_slurm, fmt="text")
    assert "In-job moves" in text and "in-job move at step 3 [cpu_alloc_oom]: micro_batch 4 -> 2, grad_accum 2 -> 4" in text
    md = triage(attempt / "slurm-41.out", home=tmp_path, env=no_slurm, fmt="markdown")
    assert "**In-job moves**" in md and "- in-job move at step 3" in md
    (attempt / "metrics.json").unlink()
    assert triage(attempt / "slurm-41.out", home=tmp_path, env=no_slurm)[0]["inflight_moves"] == []
