"""Data-driven peaks for real (issue 14): a slow leak and one long batch, each a genuine out-of-memory failure at a
later step under the local backend's address-space cap (the CPU allocator's own error), each named by triage with
its own remedies, and neither answered by the controller with a smaller micro-batch.

In-job recovery is off in these jobs (``--inflight-recovery false``): this is about the controller and triage;
except in the local leak test, which also shows that in-job recovery (on by default) does not answer a leak.
Twice each: on the local backend (the CPU allocator's own error under its address-space cap; the job records its
failing step as it ends) and on the test cluster's cpu partition (the cgroup's OOM killer: SIGKILL, so the step
series is what the rank files held when the job was killed: the periodic flush, and the long batch written down
as its step began).
"""

import json
import textwrap
from pathlib import Path

import pytest

from hpcmem_cli import run_cli as hpcmem

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "jobs" / "models" / "tiny-gpt2.json"


def submit(tmp_path, name, args, training, retry="{}", site=("--site", "local"), mem_mib=1800, inflight=False):
    spec = tmp_path / f"{name}.yaml"
    switch = "" if inflight else '--inflight-recovery, "false", '
    spec.write_text(textwrap.dedent(f"""\
        name: {name}
        command:
          module: toolkit.train
          args: [--model, "{MODEL}", --task, causal-lm, --warmup-steps, "0", {switch}{args}]
        gpus_per_node: 1
        mem_mib: {mem_mib}
        time: "00:10:00"
        training: {training}
        retry: {retry}
        """))
    result = hpcmem("submit", str(spec), *site, "--wait", "--json", "--interval", "0.5", home=tmp_path, timeout=900,
                    env={"MALLOC_ARENA_MAX": "2"})
    return result, json.loads(result.stdout)


def triage(tmp_path, attempt, site="local"):
    log = next(Path(attempt["attempt_dir"]).glob("slurm-*.out"))
    result = hpcmem("triage", str(log), "--site", site, "--format", "json", home=tmp_path, check=True)
    (finding,) = json.loads(result.stdout)["findings"]
    text = hpcmem("triage", str(log), "--site", site, home=tmp_path, check=True).stdout
    return finding, text, log.read_text()


def test_a_slow_leak_is_named_and_not_retried(tmp_path):
    """50 MiB of real tensors kept every step under an 1800 MiB cap: the allocator fails many steps in. The
    controller gives up naming the leak (a smaller batch would only fail later); triage gives the code remedy."""
    result, view = submit(tmp_path, "leak", '--steps, "60", --leak-mib-per-step, "50"',
                          "{global_batch: 8, micro_batch: 8, seq_len: 64}", "{allow: [mem, micro_batch, checkpointing]}",
                          inflight=True)
    (attempt,) = view["attempts"]  # no second attempt: a leak is not retried
    finding, text, log = triage(tmp_path, attempt)
    assert "the step series shows a leak; no in-job move answers it" in log  # in-job recovery is on: not moved
    assert "; in-job move:" not in log  # no smaller micro-batch inside the job either
    assert "DefaultCPUAllocator: can't allocate memory" in log, log[-3000:]
    assert "step 8/60" in log  # it died hours-in style: well after its first steps
    assert attempt["verdict"]["kind"] == "cpu_alloc_oom"
    assert view["state"] == "gave_up", view
    assert "leak" in view["reason"] and "loss.item()" in view["reason"] and "Not retried" in view["reason"]
    assert finding["peaks"]["case"] == "leak" and finding["remedies"] == []
    numbers = finding["peaks"]["numbers"]
    assert 40 < numbers["slope_mib_per_step"] < 65 and numbers["tau"] >= 0.9  # 50 MiB a step, kept
    assert "Data-driven peak: leak" in text and "loss.item()" in text and "micro_batch" not in text.split("Remedies")[1]


def test_one_long_batch_is_named_and_sized_for(tmp_path):
    """Lengths vary in [32, 64] tokens; step 5's batch is padded to 512 and its activations (micro-batch 64, eager
    attention) pass the 1800 MiB cap. Triage names the long batch with its own remedies; the controller sizes the
    plan for 512 tokens (here: the --mem the step series says it needs, the same micro-batch) and the one retry
    gets past step 5."""
    result, view = submit(tmp_path, "long", '--steps, "6", --long-batch-at-step, "5", --seq-len-max, "512"',
                          "{global_batch: 64, micro_batch: 64, seq_len: 64, attention: eager}",
                          "{allow: [mem, micro_batch, checkpointing]}")
    first = view["attempts"][0]
    finding, text, log = triage(tmp_path, first)
    assert "DefaultCPUAllocator: can't allocate memory" in log, log[-3000:]
    assert "step 4/6" in log and "step 5/6" not in log
    assert finding["peaks"]["case"] == "long_batch" and finding["remedies"] == []
    assert finding["peaks"]["numbers"]["step"] == 5 and finding["peaks"]["numbers"]["seq_len"] == 512
    assert finding["peaks"]["numbers"]["longest_done"] <= 64
    assert any("--max-seq-len 512" in r for r in finding["peaks"]["remedies"])
    assert "Data-driven peak: long_batch" in text
    second = view["attempts"][1]
    decision = second["decision"]
    assert decision["moves"][0] == "sized-for-seq-len:512" and "step 5's batch was 512 tokens" in decision["reason"]
    assert second["plan"]["micro_batch"] == 64 and second["plan"]["seq_len"] == 64  # the data keeps its lengths
    # sized from the step series (usual peak x 512 / longest completed length, +10 %), not a blind doubling:
    # one retry gets past the long batch
    assert second["plan"]["mem_mib"] > 3 * first["plan"]["mem_mib"] and "x 512/" in decision["reason"]
    assert len(view["attempts"]) == 2 and view["state"] == "succeeded", view


CLUSTER = ("--site", "testcluster", "--partition", "cpu")


@pytest.mark.slurm
def test_a_slow_leak_killed_by_the_cgroup_is_named_and_not_retried(slurm_cluster, tmp_path):
    """30 MiB a step kept, steps padded to 1 s, --mem 1500: the cgroup's OOM killer ends the job tens of steps
    in (OUT_OF_MEMORY, SIGKILL). The rank file's last flush holds the rising series: the run gives up on the leak."""
    result, view = submit(tmp_path, "leak-cg", '--steps, "200", --leak-mib-per-step, "30", --min-step-s, "1"',
                          "{global_batch: 8, micro_batch: 8, seq_len: 64}", "{allow: [mem, micro_batch]}",
                          site=CLUSTER, mem_mib=1500)
    (attempt,) = view["attempts"]
    finding, text, log = triage(tmp_path, attempt, "testcluster")
    assert attempt["state"] == "OUT_OF_MEMORY", log[-3000:]
    assert "step 10/200" in log
    assert view["state"] == "gave_up" and "leak" in view["reason"], view
    assert finding["peaks"]["case"] == "leak" and finding["remedies"] == []
    assert 20 < finding["peaks"]["numbers"]["slope_mib_per_step"] < 45


@pytest.mark.slurm
def test_a_long_batch_killed_by_the_cgroup_is_named_and_sized_for(slurm_cluster, tmp_path):
    """Lengths in [32, 64], step 5 padded to 512 (micro-batch 64, eager attention) under --mem 1500: the cgroup
    kills the job in step 5; the rank file names the step's length (written as the step began); the retry is
    sized for it and gets past step 5."""
    result, view = submit(tmp_path, "long-cg", '--steps, "6", --long-batch-at-step, "5", --seq-len-max, "512"',
                          "{global_batch: 64, micro_batch: 64, seq_len: 64, attention: eager}",
                          "{allow: [mem, micro_batch, checkpointing]}", site=CLUSTER, mem_mib=1500)
    first = view["attempts"][0]
    finding, text, log = triage(tmp_path, first, "testcluster")
    assert first["state"] == "OUT_OF_MEMORY", log[-3000:]
    assert "step 4/6" in log and "step 5/6" not in log
    assert finding["peaks"]["case"] == "long_batch" and finding["peaks"]["numbers"]["seq_len"] == 512
    second = view["attempts"][1]
    assert second["decision"]["moves"][0] == "sized-for-seq-len:512"
    assert second["plan"]["micro_batch"] == 64 and second["plan"]["seq_len"] == 64
    assert len(view["attempts"]) == 2 and view["state"] == "succeeded", view
