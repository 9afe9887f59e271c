"""From a triage TARGET to cases and job facts (toolkit/triage/sources.py, facts.py), without Slurm.

Pure parts on literal values; the rest on real files in tmp_path, a real sqlite ledger, and a real
SlurmBackend on a PATH without Slurm's commands (a support machine with no Slurm installed).
"""

import gzip
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit.backends.slurm import SlurmBackend
from toolkit.strategies.deepspeed import deepspeed_config
from toolkit.errors import HpcmemError
from toolkit.ledger import Ledger, Run
from toolkit.plan import Plan
from hpcmem_cli import REPO, run_cli
from toolkit.triage.facts import Case, FactsBuilder, JobFacts, add_ds_config, add_script
from toolkit.triage.logmatch import expand_nodelist, log_clues, same_job
from toolkit.triage.sources import (
    cases, job_id_in_text, job_id_of_logs, log_candidates, log_files, resolve_ids, target_kind,
)

LOGS = Path(__file__).resolve().parents[1] / "fixtures" / "logs"

# ---------------------------------------------------------------- pure


@pytest.mark.parametrize("target, kind", [
    ("-", "stdin"), ("4412", "job"), ("4412_7", "job"), ("20261121-083000-ab12", "run"),
    ("20261121-083000-ab12:3", "run"), ("/logs/slurm-1.out", "file"), ("/logs", "dir"),
])
def test_target_kind(target, kind):
    exists = {"/logs/slurm-1.out", "/logs"}.__contains__
    assert target_kind(target, exists=exists, isdir=lambda p: p == "/logs") == kind


def test_a_job_id_wins_over_a_file_of_that_name():
    assert target_kind("4412", exists=lambda p: True, isdir=lambda p: False) == "job"
    assert target_kind("./4412", exists=lambda p: True, isdir=lambda p: False) == "file"


@pytest.mark.parametrize("target", ["4412_", "20261121-083000-AB12", "12a", ""])
def test_target_of_no_kind_is_a_one_line_error(target):
    with pytest.raises(HpcmemError, match="is not a job id .* or - \\(stdin\\)") as info:
        target_kind(target, exists=lambda p: False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("target", ["slurm-4412.out", "logs/x", "run.log.gz"])
def test_a_missing_log_file_is_named_as_such(target):
    with pytest.raises(HpcmemError, match=f"triage target '{target}': no such file or directory"):
        target_kind(target, exists=lambda p: False)


RECORDS = {
    "782_1": {"state": "COMPLETED", "raw_id": "783"},
    "782_2": {"state": "FAILED", "raw_id": "782"},
    "782_10": {"state": "OUT_OF_MEMORY", "raw_id": "792"},
    "790_1": {"state": "COMPLETED", "raw_id": "790"},
    "800": {"state": "TIMEOUT", "raw_id": "800"},
}


@pytest.mark.parametrize("asked, found", [
    ("782", ["782_2", "782_10"]),   # an array job: its failed tasks, in task order
    ("790", ["790_1"]),             # none failed: all tasks
    ("782_1", ["782_1"]),
    ("783", ["782_1"]),             # a task's own job id
    ("800", ["800"]),
    ("9", []),
])
def test_resolve_ids(asked, found):
    assert resolve_ids(asked, RECORDS) == found


def test_log_candidates_best_first():
    record = {"workdir": "/w", "raw_id": "783", "name": "trx", "user": "ann", "nodes": "n[1-2]"}
    remembered = {"stdout": "/w/o-783.out", "stderr": "/w/e-783.err"}
    script = {"output": "logs/%x-%A_%a.out", "error": "/abs/%u-%j.err"}
    got = log_candidates("782_1", record, remembered, script)
    assert got == [
        ("scontrol StdOut/StdErr", (Path("/w/o-783.out"), Path("/w/e-783.err"))),
        ("#SBATCH --output/--error", (Path("/w/logs/trx-782_1.out"), Path("/abs/ann-783.err"))),
    ]
    assert log_candidates("5", {"workdir": "/w"}, {}, {}) == [("default slurm-%j.out in WorkDir", (Path("/w/slurm-5.out"),))]
    assert log_candidates("5_2", {}, {}, {"error": "e.err"})[0] == (
        "#SBATCH --output/--error", (Path("slurm-5_2.out"), Path("e.err")))


@pytest.mark.parametrize("text, job_id", [
    ("hpcmem: job 789 attempt 1 on vm at 2026-11-21T08:37:30+00:00\nstep 1/8", "789"),
    ("...\nslurmstepd: error: Detected 1 oom-kill event(s) in StepId=4412.batch. Some of your processes", "4412"),
    ("slurmstepd: error: *** JOB 77_3 ON gpu01 CANCELLED AT 2026-11-21T08:00:00 DUE TO TIME LIMIT ***", "77_3"),
    ("Traceback (most recent call last):\nRuntimeError: CUDA out of memory.", None),
])
def test_job_id_in_text(text, job_id):
    assert job_id_in_text(text) == job_id


# ---------------------------------------------------------------- files


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


SCRIPT = """#!/bin/bash
#SBATCH --job-name=sft
#SBATCH --gres=gpu:4
#SBATCH --mem=64G
deepspeed --num_gpus 4 train.py --model_name_or_path gpt2-large --per_device_train_batch_size 8 \\
   --gradient_accumulation_steps 2 --bf16 --deepspeed cfg/ds.json
"""


def test_a_log_with_its_script_and_ds_config_next_to_it(tmp_path):
    log = write(tmp_path / "job" / "slurm-4412.out", "step 1\nRuntimeError: CUDA out of memory.\n")
    write(tmp_path / "job" / "train.sbatch", SCRIPT)
    write(tmp_path / "job" / "cfg" / "ds.json", json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    [case] = cases(str(log))
    assert isinstance(case, Case) and case.kind == "file" and case.log_paths == (log,) and case.log_text is None
    facts = case.facts
    assert facts.job_id == "4412" and facts.model == "gpt2-large"
    assert facts.script_path == str(tmp_path / "job" / "train.sbatch")
    assert facts.ds_config_path == str(tmp_path / "job" / "cfg" / "ds.json")
    assert facts.plan_knobs == {
        "launcher": "deepspeed", "micro_batch": 4, "zero_stage": 2, "offload_optimizer": "cpu", "offload_params": "none",
        "grad_accum": 2, "precision": "bf16-mixed", "gpus_per_node": 4, "mem_mib": 65536}
    # the config the engine really used outranks the Trainer flag it overrides
    assert facts.knob_sources["micro_batch"] == "ds_config.json"
    assert facts.knob_sources["grad_accum"] == "trainer args"  # "auto" in the config
    assert facts.knob_sources["gpus_per_node"] == "job script"
    assert set(facts.sources) == {"ds_config.json", "trainer args", "job script"}
    assert any("Slurm" in m for m in facts.missing)  # no backend: said, not raised
    json.dumps(facts.to_dict())


def test_a_gzip_log_alone(tmp_path):
    log = write(tmp_path / "train-88.log.gz", gzip.compress(b"hpcmem: job 88 attempt 2 on n1 at x\nboom\n"))
    [case] = cases(str(log))
    assert case.facts.job_id == "88" and case.log_paths == (log,)
    assert any(m.startswith("job script not found") for m in case.facts.missing)


def test_a_log_naming_no_job(tmp_path):
    log = write(tmp_path / "pasted.txt", "Traceback\nKilled\n")
    [case] = cases(str(log))
    assert case.facts.job_id is None
    assert any("names no Slurm job id" in m for m in case.facts.missing)


def test_a_directory_of_rank_logs_in_rank_order(tmp_path):
    for rank in (10, 2, 1, 0):
        write(tmp_path / f"rank-{rank}.log", f"rank {rank}\n")
    write(tmp_path / "rank-3.err.gz", gzip.compress(b"rank 3\n"))
    write(tmp_path / "plan.json", Plan().to_json())
    write(tmp_path / "notes.json", "{}")
    assert [p.name for p in log_files(tmp_path)] == ["rank-0.log", "rank-1.log", "rank-2.log", "rank-3.err.gz",
                                                     "rank-10.log"]
    [case] = cases(str(tmp_path))
    assert case.kind == "dir" and len(case.log_paths) == 5
    assert case.facts.plan_knobs == {k: v for k, v in Plan().to_dict().items() if k != "world_size" and v is not None}
    assert set(case.facts.knob_sources.values()) == {"plan.json"}


def test_an_empty_directory_says_so(tmp_path):
    [case] = cases(str(tmp_path))
    assert case.log_paths == ()
    assert any("no log files in" in m for m in case.facts.missing)


def test_job_id_of_logs(tmp_path):
    assert job_id_of_logs([Path("slurm-5.out"), Path("slurm-5.err")]) == "5"
    assert job_id_of_logs([Path("slurm-5.out"), Path("slurm-6.out")]) is None  # two jobs: not guessed
    assert job_id_of_logs([]) is None


def test_stdin_plain_and_truncated_gzip():
    [case] = cases("-", stdin=io.BytesIO(b"slurmstepd: error: Detected 1 oom-kill event(s) in StepId=31.batch.\n"))
    assert (case.kind, case.log_paths, case.facts.job_id) == ("stdin", (), "31")
    assert case.log_text.startswith("slurmstepd: error:")
    packed = gzip.compress(b"x" * 5000 + b"\nend\n")
    [case] = cases("-", stdin=io.BytesIO(packed[:-12]))
    assert case.log_text.startswith("xxx")
    assert any("truncated or corrupt" in m for m in case.facts.missing)
    [case] = cases("-", stdin=io.BytesIO(b""))
    assert case.log_text == ""


def test_bad_files_next_to_a_log_are_reported_not_raised(tmp_path):
    log = write(tmp_path / "slurm-9.out", "x\n")
    write(tmp_path / "plan.json", "{not json")
    write(tmp_path / "job.sbatch", "#!/bin/bash\npython t.py --deepspeed $CFG\n")
    [case] = cases(str(log))
    assert any("plan" in m and "not valid JSON" in m for m in case.facts.missing)
    assert any("shell variable" in m for m in case.facts.missing)
    assert case.facts.plan_knobs == {"launcher": "deepspeed"}


def test_ds_config_relative_to_the_directory_the_script_changes_to(tmp_path):
    write(tmp_path / "proj" / "ds.json", json.dumps({"zero_optimization": {"stage": 3}}))
    write(tmp_path / "logs" / "run.sbatch", f"#!/bin/bash\n#SBATCH -N 1\ncd {tmp_path / 'proj'}\n"
                                             "deepspeed train.py --deepspeed ds.json\n")
    log = write(tmp_path / "logs" / "slurm-3.out", "x\n")
    facts = cases(str(log))[0].facts
    assert facts.ds_config_path == str(tmp_path / "proj" / "ds.json") and facts.plan_knobs["zero_stage"] == 3


def test_ds_config_named_but_missing(tmp_path):
    builder = FactsBuilder()
    add_ds_config(builder, [tmp_path], "conf/zero3.json")
    facts = builder.build()
    assert facts.ds_config_path is None and facts.plan_knobs == {}
    tried = tmp_path / "conf" / "zero3.json"
    assert facts.missing == (f"DeepSpeed config conf/zero3.json named by the job script was not found (tried {tried})",)


def test_hpcmem_ds_config_next_to_a_log(tmp_path):
    plan = Plan(launcher="deepspeed", gpus_per_node=2, global_batch=8, micro_batch=1, grad_accum=4, zero_stage=3)
    write(tmp_path / "ds_config.json", json.dumps(deepspeed_config(plan)))
    log = write(tmp_path / "slurm-12.out", "x\n")
    facts = cases(str(log))[0].facts
    assert (facts.plan_knobs["zero_stage"], facts.plan_knobs["micro_batch"], facts.plan_knobs["grad_accum"]) == (3, 1, 4)
    assert facts.ds_config_path == str(tmp_path / "ds_config.json")


# ---------------------------------------------------------------- no Slurm here


@pytest.fixture
def no_slurm(tmp_path, monkeypatch):
    """A real SlurmBackend on a machine whose PATH has no Slurm commands."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return SlurmBackend(tries=1)


def test_a_job_id_without_sacct_is_a_case_that_says_so(no_slurm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    [case] = cases("4412", backend=no_slurm)
    assert (case.kind, case.facts.job_id, case.log_paths) == ("job", "4412", ())
    missing = " | ".join(case.facts.missing)
    assert "sacct unavailable: command not found: sacct" in missing
    assert "scontrol unavailable too" in missing
    assert "no log found for job 4412: tried slurm-4412.out" in missing


def test_a_job_id_without_slurm_finds_its_log_here(no_slurm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "slurm-4412_3.out", "x\n")
    [case] = cases("4412_3", backend=None)
    assert case.log_paths == (Path("slurm-4412_3.out"),)
    assert any("no Slurm scheduler on this machine" in m for m in case.facts.missing)


# ---------------------------------------------------------------- the ledger


def make_run(home: Path, ledger: Ledger, run_id: str = "20261121-083000-ab12") -> Run:
    run_dir = home / "runs" / run_id
    write(run_dir / "spec.yaml", "name: demo\nmodel:\n  config: gpt2\n  task: causal-lm\n")
    now = time.time()
    run = Run(run_id=run_id, spec_path="/s.yaml", spec_name="demo", site="local", site_path="/l.yaml",
              partition="cpu", run_dir=str(run_dir), workdir=str(home), state="failed", reason="", created=now,
              updated=now)
    first = Plan(global_batch=8, micro_batch=8)
    ledger.add_run(run, first.to_dict(), str(run_dir / "attempt-1"))
    ledger.update_attempt(run_id, 1, job_id="local-1", state="FAILED", verdict={"kind": "gpu_oom"}, exit_code=1)
    second = Plan(global_batch=8, micro_batch=4, grad_accum=2)
    ledger.add_attempt(run_id, 2, second.to_dict(), str(run_dir / "attempt-2"), "cpu", decision={"moves": ["micro_batch"]})
    ledger.update_attempt(run_id, 2, job_id="local-2", state="OUT_OF_MEMORY", exit_code=0)
    for n, plan in ((1, first), (2, second)):
        write(run_dir / f"attempt-{n}" / "plan.json", plan.to_json())
        write(run_dir / f"attempt-{n}" / "job.sbatch", "#!/bin/bash\n#SBATCH --mem=3G\npython -m toolkit.train\n")
        write(run_dir / f"attempt-{n}" / f"slurm-local-{n}.out", f"hpcmem: job local-{n} attempt {n}\n")
    return run


def test_a_run_gives_its_last_attempt_with_the_earlier_ones(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        run = make_run(tmp_path, ledger)
        [case] = cases(run.run_id, ledger=ledger)
    facts = case.facts
    assert case.kind == "run" and case.log_paths == (Path(run.run_dir) / "attempt-2" / "slurm-local-2.out",)
    assert (facts.run_id, facts.attempt, facts.job_id, facts.site) == (run.run_id, 2, "local-2", "local")
    assert (facts.state, facts.exit_code, facts.partition) == ("OUT_OF_MEMORY", 0, "cpu")
    assert (facts.plan_knobs["micro_batch"], facts.plan_knobs["grad_accum"]) == (4, 2)
    assert facts.knob_sources["micro_batch"] == "plan.json" and facts.knob_sources["mem_mib"] == "job script"
    assert (facts.model, facts.task) == ("gpt2", "causal-lm")
    assert [a["n"] for a in facts.attempts] == [1]
    assert facts.attempts[0]["verdict"] == {"kind": "gpu_oom"} and facts.attempts[0]["plan"]["micro_batch"] == 8
    assert any("local backend" in m for m in facts.missing)


def test_run_colon_n_picks_an_attempt_and_a_missing_one_is_said(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        run = make_run(tmp_path, ledger)
        [first] = cases(f"{run.run_id}:1", ledger=ledger)
        [none] = cases(f"{run.run_id}:7", ledger=ledger)
        [unknown] = cases("20991231-000000-ffff", ledger=ledger)
    assert (first.facts.attempt, first.facts.attempts, first.facts.plan_knobs["micro_batch"]) == (1, (), 8)
    assert none.log_paths == () and none.facts.missing == (f"run {run.run_id} has no attempt 7 (attempts: 1, 2)",)
    assert unknown.facts.missing[0].startswith("hpcmem ledger: no run '20991231-000000-ffff'")
    assert cases(run.run_id)[0].facts.missing == ("no hpcmem ledger here: the run's attempts cannot be looked up",)


def test_a_log_inside_a_run_directory_is_that_attempt(tmp_path):
    with Ledger(tmp_path / "ledger.sqlite") as ledger:
        run = make_run(tmp_path, ledger)
        log = Path(run.run_dir) / "attempt-1" / "slurm-local-1.out"
        [case] = cases(str(log), ledger=ledger)
    assert (case.facts.run_id, case.facts.attempt, case.facts.job_id) == (run.run_id, 1, "local-1")
    assert case.facts.knob_sources["micro_batch"] == "plan.json"


def test_job_facts_to_dict_is_json_with_stable_names():
    facts = JobFacts(job_id="1", attempts=({"n": 1},), sources=("sacct",), missing=("x",))
    data = facts.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["attempts"] == [{"n": 1}] and data["sources"] == ["sacct"] and data["missing"] == ["x"]
    assert {"job_id", "state", "exit_code", "max_rss_mib", "req_tres", "alloc_tres", "plan_knobs", "knob_sources",
            "run_id", "attempt", "attempts", "model", "script_path", "ds_config_path", "sources", "missing"} <= set(data)


def test_builder_keeps_the_first_value_and_ignores_unknown_knobs():
    builder = FactsBuilder()
    builder.set("sacct", state="FAILED", exit_code=None)
    builder.set("ledger", state="OUT_OF_MEMORY", exit_code=1)
    builder.knobs({"micro_batch": 4, "not_a_knob": 1}, "plan.json")
    builder.knobs({"micro_batch": 8, "zero_stage": 2}, {"micro_batch": "trainer args", "zero_stage": "ds_config.json"})
    facts = builder.build()
    assert (facts.state, facts.exit_code) == ("FAILED", 1)
    assert facts.plan_knobs == {"micro_batch": 4, "zero_stage": 2}
    assert facts.knob_sources == {"micro_batch": "plan.json", "zero_stage": "ds_config.json"}
    assert facts.sources == ("sacct", "ledger", "plan.json", "ds_config.json")
    with pytest.raises(ValueError):
        builder.set("x", no_such_field=1)


# ---------------------------------------------------------------- knobs of the wrong type never reach the plan


@pytest.mark.parametrize("plan, bad", [
    ({"time_min": "abc", "micro_batch": 4}, ["time_min is 'abc', not an integer"]),
    ({"micro_batch": "8", "global_batch": 0, "grad_accum": 2},
     ["micro_batch is '8', not an integer", "global_batch is 0, not at least 1"]),
    ({"zero_stage": 7, "precision": "fp8", "checkpointing": "yes", "micro_batch": True, "grad_accum": 2},
     ["zero_stage is 7, not 0 to 3", "precision is 'fp8', not one of", "checkpointing is 'yes', not true or false",
      "micro_batch is True, not an integer"]),
])
def test_a_malformed_plan_json_is_named_and_kept_out_of_the_plan(tmp_path, plan, bad):
    from toolkit.sites import load_site
    from toolkit.triage.diagnose import diagnose

    log = write(tmp_path / "slurm-9.out", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                                          "GPU 0 has a total capacity of 15.77 GiB of which 1.10 GiB is free.\n")
    write(tmp_path / "plan.json", json.dumps(plan))
    [case] = cases(str(log))
    good = {k: v for k, v in plan.items() if not any(m.startswith(k) for m in bad)}
    assert case.facts.plan_knobs == good
    for sentence in bad:
        assert any(f"plan {tmp_path / 'plan.json'}: {sentence}" in m and m.endswith("not used")
                   for m in case.facts.missing), (sentence, case.facts.missing)
    finding = diagnose(case, load_site("example-hpc"))  # picture.fill_plan gets only well-typed knobs
    assert finding.verdict.kind == "gpu_oom" and finding.remedies


def test_bad_ds_config_values_are_skipped(tmp_path):
    write(tmp_path / "ds_config.json", json.dumps({"train_micro_batch_size_per_gpu": "8",
                                                   "gradient_accumulation_steps": 2.5,
                                                   "zero_optimization": {"stage": "3"}}))
    [case] = cases(str(write(tmp_path / "slurm-9.out", "x\n")))
    assert case.facts.plan_knobs == {"launcher": "deepspeed"}


def test_the_partition_comes_from_the_script_below_the_scheduler(tmp_path):
    write(tmp_path / "run.sbatch", "#!/bin/bash\n#SBATCH -p gpu_v100\npython t.py\n")
    [case] = cases(str(write(tmp_path / "train.log", "x\n")))
    assert case.facts.partition == "gpu_v100" and "job script" in case.facts.sources
    builder = FactsBuilder()
    builder.set("sacct", partition="gpu_a100")
    add_script(builder, "#!/bin/bash\n#SBATCH --partition=gpu_v100\n", "job.sbatch", [])
    assert builder.build().partition == "gpu_a100"


# ---------------------------------------------------------------- a directory of several jobs' logs


def test_a_directory_of_two_jobs_gives_one_case_each(tmp_path):
    write(tmp_path / "slurm-101.out",
          "step 1\nslurmstepd: error: *** JOB 101 ON n2 CANCELLED AT x DUE TO TIME LIMIT ***\n")
    write(tmp_path / "slurm-100.out", "RuntimeError: CUDA out of memory.\n")
    write(tmp_path / "slurm-100.err", "Traceback\n")
    write(tmp_path / "train-101-rank1.log", "rank 1 of job 101\n")      # its name holds the job id
    write(tmp_path / "rank-0.log", "hpcmem: job 100 attempt 1 on n1 at 2026-11-21T08:00:00+00:00\n")
    write(tmp_path / "notes.txt", "what the user wrote\n")              # names no job
    found = cases(str(tmp_path))
    assert [(c.facts.job_id, [p.name for p in c.log_paths]) for c in found] == [
        ("100", ["rank-0.log", "slurm-100.err", "slurm-100.out"]),
        ("101", ["slurm-101.out", "train-101-rank1.log"]),
        (None, ["notes.txt"]),
    ]
    assert all(c.kind == "dir" and c.target == str(tmp_path) for c in found)
    assert any("notes.txt in" in m and "holds logs of jobs 100, 101" in m for m in found[2].facts.missing)


def test_rank_logs_of_one_job_stay_one_case(tmp_path):
    write(tmp_path / "slurm-7.out", "launcher\n")
    for rank in (0, 1):
        write(tmp_path / f"rank-{rank}.log", f"rank {rank}\n")
    [case] = cases(str(tmp_path))
    assert case.facts.job_id == "7" and [p.name for p in case.log_paths] == ["rank-0.log", "rank-1.log", "slurm-7.out"]


# ---------------------------------------------------------------- does the log match the record?


def test_expand_nodelist():
    assert expand_nodelist("gpu-node-[08-10,12],vm.cluster.local,r[1-2]-n[1-2]") == {
        "gpu-node-08", "gpu-node-09", "gpu-node-10", "gpu-node-12", "vm", "r1-n1", "r1-n2", "r2-n1", "r2-n2"}
    assert expand_nodelist("None assigned") == frozenset() and expand_nodelist("") == frozenset()


RECORD = {"nodes": "vm", "workdir": "/w", "start": "2026-11-21T08:00:00", "end": "2026-11-21T08:05:00", "name": "x"}
TICKET = (LOGS / "time_limit_after_oom.log").read_text()  # a real log: JOB 4720 ON gpu-node-09, dated 2024-05-02


def test_a_log_at_the_job_own_output_path_is_that_job_whatever_it_says():
    clues = log_clues(TICKET, Path("/w/slurm-1858.out.gz"))
    assert same_job(clues, "1858", RECORD, [Path("/w/slurm-1858.out")]) == (True, None)


def test_a_log_from_other_nodes_and_dates_is_not_the_job():
    same, why = same_job(log_clues(TICKET, Path("/tickets/slurm-1858.out")), "1858", RECORD,
                         [Path("/w/slurm-1858.out")])
    assert not same
    assert why == ("job 1858 here ran on node vm from /w on 2026-11-21; this log (/tickets/slurm-1858.out) is from "
                   "node gpu-node-09 and is dated 2024-05-02: not the same job, so this cluster's record of job 1858 "
                   "is not used")


@pytest.mark.parametrize("text, same, says", [
    ("srun: error: vm: task 0: Out Of Memory\n", True, None),                       # its node: agrees
    ("[2026-11-21 08:03:10,120] step 5\n", True, None),                             # dated within the run
    ("RuntimeError: CUDA out of memory.\n", True, "on its id alone"),               # nothing to compare
    ("gpu-node-04:201933:202011 [3] NCCL INFO x\n", False, "is from node gpu-node-04"),
    ("[2025-01-02 10:00:00] start\n", False, "is dated 2025-01-02"),
])
def test_what_a_copied_log_shows_decides(text, same, says):
    got, why = same_job(log_clues(text, Path("/tickets/a.log")), "1858", RECORD, [Path("/w/slurm-1858.out")])
    assert got is same and (why is None if says is None else says in why)


# ---------------------------------------------------------------- standard input through the real command line


@pytest.fixture
def no_slurm_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    os.symlink(sys.executable, bin_dir / "python3")
    return {"PATH": str(bin_dir)}


OOM_END = ("Traceback (most recent call last):\n  File \"train.py\", line 88, in <module>\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
           "15.77 GiB of which 1.10 GiB is free. Including non-PyTorch memory, this process has 14.66 GiB memory "
           "in use. Of the allocated memory 13.90 GiB is allocated by PyTorch, and 412.00 MiB is reserved by "
           "PyTorch but unallocated.\n")


def test_a_large_log_on_stdin_is_read_from_its_end(tmp_path, no_slurm_env):
    lines = 300_000
    text = "".join(f"{{'loss': 2.{n:04d}, 'epoch': 0.{n:05d}}} step {n}/900000 | 14.2 samples/s\n"
                   for n in range(lines)) + OOM_END
    assert len(text) > 2 * 8 * 2**20  # far more than the 8 MiB tail
    result = run_cli("triage", "-", "--format", "json", home=tmp_path / "home", env=no_slurm_env, input=text)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    [finding] = json.loads(result.stdout)["findings"]
    assert finding["source"] == "stdin" and finding["verdict"]["kind"] == "gpu_oom"
    said = [m for m in finding["job"]["missing"] if m.startswith("standard input holds")]
    assert said and f"holds {len(text)} bytes: only its last {8 * 2**20} were read" in said[0]
    first = int(said[0].split("from line ")[1].split()[0])
    kept = text.splitlines(keepends=True)
    # the whole lines that fit in the last 8 MiB: from line `first` on, and not one more
    assert len("".join(kept[first - 1:])) <= 8 * 2**20 < len("".join(kept[first - 2:]))
    # evidence line numbers are the input's own, not the kept tail's
    oom_line = next(n for n, line in enumerate(text.splitlines(), 1) if "CUDA out of memory" in line)
    assert oom_line in [e["line"] for e in finding["verdict"]["evidence"]]


def test_a_damaged_gzip_on_stdin_is_damaged_not_empty(tmp_path, no_slurm_env):
    packed = gzip.compress(("step\n" * 20000 + OOM_END).encode())
    for data, says in ((packed[: len(packed) // 3], "what could be decompressed is used"),
                       (b"\x1f\x8b\x08\x00" + b"\xff garbage" * 50, "nothing could be decompressed")):
        result = subprocess.run([sys.executable, "-m", "toolkit.cli", "triage", "-", "--format", "json"], input=data,
                                capture_output=True, cwd=REPO, timeout=300,
                                env={**os.environ, **no_slurm_env, "HPCMEM_HOME": str(tmp_path / "home")})
        assert result.returncode == 0 and b"Traceback" not in result.stderr, result.stderr
        [finding] = json.loads(result.stdout)["findings"]
        missing = " | ".join(finding["job"]["missing"])
        assert "the gzip data on standard input is damaged" in missing and says in missing
        assert not any("empty" in n for n in finding["notes"]), finding["notes"]
