"""OOM-retry benchmark (issue 3, "Performance"): hpcmem's ladder against two batch-shrinking baselines.

    python benchmarks/retry.py [--quick] [--only PATTERN] [--jobs N] [--max-attempts N]
                               [--oom-after S] [--train-s S] [--no-save]

Runs a suite of out-of-memory scenarios on the Slurm test cluster (tests/cluster/slurm-up.sh) three ways
and prints, per scenario and method: attempts-to-fit, failed attempts, wasted job-seconds (sacct Elapsed of
the failed attempts), whether it fitted, whether the global batch was kept; a summary line per method; and
hpcmem's failure-to-resubmit latency. The same goes to benchmarks/results/retry-<date>.txt and .json with
the date, git commit and machine.

Methods
  hpcmem   ``python -m toolkit.cli submit SPEC --site testcluster --partition P --wait --json --interval 1``
           with its own HPCMEM_HOME: the real controller, classifier and ladder (default moves; global batch kept).
  halve    a loop here (no controller): render (toolkit.render.render_attempt), submit and poll
           (toolkit.backends slurm) and, on every failure, micro_batch //= 2.
  x0.9     the same with micro_batch = max(1, floor(0.9 x micro_batch)).
  The baselines keep grad_accum at 1, so they SHRINK THE GLOBAL BATCH (global = micro x world): they change
  what is learned; a baseline "fits" when a job succeeds. A baseline stops when the micro-batch cannot shrink
  any more (micro 1 failed) or after --max-attempts; hpcmem stops when its ladder gives up.

Scenarios (what is real and what is emulated)
  FAKE GPU   benchmarks/fake_gpu_job.py is the job's command: the job really runs through Slurm (torchrun,
             one process per rank) on the test cluster's v100/a100 partitions, whose GPUs are dummy devices;
             the GPU memory is EMULATED by a ground-truth model independent of hpcmem's ladder (see that file),
             which prints PyTorch's exact OOM message (or a cuBLAS allocation failure without numbers) after an
             emulated start-up of --oom-after seconds.
  REAL HOST  a job that really allocates host memory on the cpu partition and is really killed by the cgroup
             (no numbers in the message: Slurm's oom-kill event / OUT_OF_MEMORY).
  REAL CPU   the reference trainer (python -m toolkit.train, tiny GPT-2) really training on the cpu partition,
             really killed by the cgroup at a small --mem.

Lost steps and queue entries per OOM (``--resume``, issue 14): a second suite, the reference trainer rehearsing a real
OOM (``--oom-at-step N --oom-kind activations|fixed``) on the cpu partition, two ways, both through hpcmem's controller
and ladder (so only what happens to the training differs):
  hpcmem   in-job recovery on (the default) and resume from the run's checkpoints (``--checkpoint-every-steps 2``).
  scratch  ``retry: {inflight: false}`` and ``--no-resume``: every OOM is resubmitted and training restarts at step 0.
  Per run: queue entries (Slurm jobs submitted; requeues = entries - 1), lost steps (per failed attempt: the last
  step its log printed minus the step the next attempt resumed from), partial steps re-run in the job (in-job moves).
  The in-job scenario runs the job's python under ``ulimit -v`` (an address-space cap, like the local backend's), so
  the allocator's error is raised in the process as a GPU's CUDA OOM is; the cgroup scenarios are killed by the cgroup
  (SIGKILL: nothing to answer in the job), so the controller resubmits and the checkpoint bounds what is lost.
  Goal: 0 lost steps beyond the checkpoint interval, 0 requeues for the OOMs an in-job move answers.

    python benchmarks/retry.py --resume [--only PATTERN] [--jobs N] [--no-save]

Latency: next attempt's ``submitted`` (ledger, time.time() right after sbatch) minus the failed job's End
(sacct, epoch seconds via SLURM_TIME_FORMAT=%s; the same machine's clock). sacct's End has 1 s resolution
(truncated), so each value may read up to 1 s high.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import fnmatch
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from toolkit.backends.slurm import parse_duration_s
from toolkit import render, sites  # noqa: E402
from toolkit.backends import get_backend  # noqa: E402
from toolkit.classify import classify, classify_paths  # noqa: E402
from toolkit.jobspec import load_spec  # noqa: E402

FAKE = REPO / "benchmarks" / "fake_gpu_job.py"
MODELS = REPO / "jobs" / "models"
SITE = "testcluster"
METHODS = ("hpcmem", "halve", "x0.9")


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    kind: str
    """fake-gpu, real-host or real-cpu."""
    partition: str
    training: dict
    args: tuple = ()
    gpus: int = 1
    launcher: str = "torchrun"
    mem_mib: int | None = 1024
    numbers: bool = True
    """Whether the failure message states its numbers (PyTorch's OOM message)."""
    model: str | None = None
    module: str | None = None
    quick: bool = False


def fake(model: str, *extra: str) -> tuple:
    return (str(MODELS / f"{model}.json"), *extra)


SCENARIOS = (
    Scenario("bert-large-v100-fp32", "BERT-large cls, fp32, eager attention, seq 512, micro 32, 1x V100-16GB",
             "fake-gpu", "v100", dict(micro_batch=32, seq_len=512, precision="fp32", attention="eager"),
             fake("bert-large"), model="bert-large", quick=True),
    Scenario("gpt2-v100-seq1024", "GPT-2 124M causal LM, fp16-mixed, eager attention, seq 1024, micro 16, 1x V100-16GB",
             "fake-gpu", "v100", dict(micro_batch=16, seq_len=1024, precision="fp16-mixed", attention="eager"),
             fake("gpt2"), model="gpt2", quick=True),
    Scenario("gpt2-a100-fp32", "GPT-2 124M causal LM, fp32, eager attention, seq 1024, micro 32, 1x A100-40GB",
             "fake-gpu", "a100", dict(micro_batch=32, seq_len=1024, precision="fp32", attention="eager"),
             fake("gpt2"), model="gpt2"),
    Scenario("bert-large-v100-micro64", "BERT-large cls, fp16-mixed, sdpa, seq 512, micro 64 (only batch/"
             "checkpointing moves help), 1x V100-16GB",
             "fake-gpu", "v100", dict(micro_batch=64, seq_len=512, precision="fp16-mixed", attention="sdpa"),
             fake("bert-large"), model="bert-large"),
    Scenario("llama7b-a100-zero2", "LLaMA-7B causal LM, DeepSpeed ZeRO-2, bf16, flash, checkpointing, seq 2048, "
             "micro 4, 2x A100-40GB (model states need ZeRO-3/offload)",
             "fake-gpu", "a100", dict(micro_batch=4, seq_len=2048, precision="bf16-mixed", attention="flash",
                                      checkpointing=True, zero_stage=2),
             fake("llama-7b"), gpus=2, launcher="deepspeed", model="llama-7b"),
    Scenario("llama7b-a100-ddp", "LLaMA-7B causal LM as llama7b-a100-zero2 but started as plain DDP (torchrun, no "
             "DeepSpeed): bf16, flash, checkpointing, seq 2048, micro 4, 2x A100-40GB",
             "fake-gpu", "a100", dict(micro_batch=4, seq_len=2048, precision="bf16-mixed", attention="flash",
                                      checkpointing=True),
             fake("llama-7b"), gpus=2, model="llama-7b"),
    Scenario("fragmentation-v100", "BERT-large cls, fp16-mixed, sdpa, seq 512, micro 24, allocator holding 25 % "
             "reserved-unallocated (fragmentation), 1x V100-16GB",
             "fake-gpu", "v100", dict(micro_batch=24, seq_len=512, precision="fp16-mixed", attention="sdpa"),
             fake("bert-large", "--reserve", "0.25"), model="bert-large"),
    Scenario("cublas-no-numbers-v100", "GPT-2 as gpt2-v100-seq1024, but the failure is CUBLAS_STATUS_ALLOC_FAILED "
             "(no numbers)", "fake-gpu", "v100",
             dict(micro_batch=16, seq_len=1024, precision="fp16-mixed", attention="eager"),
             fake("gpt2", "--message", "cublas"), numbers=False, model="gpt2"),
    Scenario("host-cgroup-cpu", "REAL host memory on the cpu partition: 1500 MiB fixed (data held in RAM) + 25 MiB"
             " per sample, micro 16, --mem 1500M; cgroup OOM kill (no numbers)", "real-host", "cpu",
             dict(micro_batch=16, seq_len=128), ("--real-host-mib", "1500", "--real-host-mib-per-sample", "25"),
             mem_mib=1500, numbers=False, quick=True),
    Scenario("tiny-gpt2-real-cpu", "REAL training: python -m toolkit.train tiny GPT-2, fp32, eager, seq 512, micro 64,"
             " --mem 1200M on the cpu partition; cgroup OOM kill (no numbers)", "real-cpu", "cpu",
             dict(micro_batch=64, seq_len=512, precision="fp32", attention="eager"),
             ("--model", str(MODELS / "tiny-gpt2.json"), "--task", "causal-lm", "--steps", "2", "--warmup-steps", "0"),
             mem_mib=1200, numbers=False, module="toolkit.train"),
)


RESUME_METHODS = ("hpcmem", "scratch")
CHECKPOINT_EVERY = 2
"""The resume suite's checkpoint interval (steps): hpcmem's goal is to lose at most this many steps per OOM."""


@dataclass(frozen=True)
class ResumeScenario:
    name: str
    what: str
    oom_args: tuple
    mem_mib: int
    allow: tuple
    as_cap_mib: int | None = None
    """Run the job's python under ``ulimit -v`` this many MiB (the allocator's error is then raised in the process)."""
    steps: int = 6
    gpus: int = 2


RESUME_SCENARIOS = (
    ResumeScenario("activations-in-job", "tiny GPT-2, 2 ranks, micro 4 x 1 (global 8); --oom-at-step 3 activations "
                   "400 MiB a sample under a 2000 MiB address-space cap (micro 4 fails, 2 fits); --mem 6000",
                   ("--oom-at-step", "3", "--oom-mib", "400"), 6000, ("micro_batch",), as_cap_mib=2000),
    ResumeScenario("activations-cgroup", "tiny GPT-2, 2 ranks, micro 4 x 1; --oom-at-step 5 on rank 0, activations "
                   "450 MiB a sample, --mem 2600: the cgroup kills micro 4, micro 2 fits (the ladder's move)",
                   ("--oom-at-step", "5", "--oom-rank", "0", "--oom-kind", "activations", "--oom-mib", "450"), 2600,
                   ("micro_batch",)),
    ResumeScenario("fixed-cgroup", "tiny GPT-2, 2 ranks; --oom-at-step 5 on rank 0, fixed 1200 MiB, --mem 2000: no "
                   "micro-batch avoids it, the ladder's more --mem does",
                   ("--oom-at-step", "5", "--oom-rank", "0", "--oom-kind", "fixed", "--oom-mib", "1200"), 2000,
                   ("mem",)),
)


def write_resume_spec(sc: ResumeScenario, method: str, where: Path) -> Path:
    """The scenario as a spec for ``method`` (hpcmem: in-job recovery and resume; scratch: neither)."""
    args = ["--model", str(MODELS / "tiny-gpt2.json"), "--task", "causal-lm", "--steps", str(sc.steps),
            "--warmup-steps", "0", "--checkpoint-every-steps", str(CHECKPOINT_EVERY), *sc.oom_args]
    retry = {"max_attempts": 4, "allow": list(sc.allow)}
    if method == "scratch":
        args.append("--no-resume")
        retry["inflight"] = False
    command = {"module": "toolkit.train", "args": args}
    if sc.as_cap_mib:
        wrapper = where / f"python-as-{sc.as_cap_mib}"
        wrapper.write_text(f"#!/bin/bash\n# the address-space cap: the CPU allocator's error is raised in the process\n"
                           f"ulimit -v {sc.as_cap_mib * 1024}\nexec {sys.executable} \"$@\"\n")
        wrapper.chmod(0o755)
        command["python"] = str(wrapper)
    doc = {"name": f"bench-{sc.name}-{method}", "description": sc.what, "command": command, "gpus_per_node": sc.gpus,
           "mem_mib": sc.mem_mib, "time": "00:10:00",
           "training": {"global_batch": 8, "micro_batch": 4, "seq_len": 64}, "retry": retry,
           "env": {"MALLOC_ARENA_MAX": "2"}}
    path = where / f"{sc.name}-{method}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def last_step(adir: Path) -> int:
    """The last optimizer step an attempt completed: its log's last ``step N/M`` line (0 when none)."""
    import re

    last = 0
    for log in adir.glob("slurm-*.out"):
        for m in re.finditer(r"(?m)^step (\d+)/\d+ ", log.read_text(errors="replace")):
            last = max(last, int(m.group(1)))
    return last


def run_resume(sc: ResumeScenario, method: str, work: Path, opts) -> dict:
    """One resume-suite run through hpcmem's controller; its queue entries, lost steps and in-job moves."""
    home = work / f"home-{sc.name}-{method}"
    spec = write_resume_spec(sc, method, work)
    env = {**os.environ, "HPCMEM_HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "toolkit.cli", "submit", str(spec), "--site", SITE, "--partition",
                           "cpu", "--wait", "--json", "--interval", "1"], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=opts.run_timeout)
    try:
        run_id = json.loads(done.stdout)["run_id"]
    except (ValueError, KeyError):
        raise RuntimeError(f"hpcmem submit gave no run: rc={done.returncode} {done.stderr.strip()[-800:]}")
    view = json.loads(subprocess.run([sys.executable, "-m", "toolkit.cli", "runs", run_id, "--json"],
                                     capture_output=True, text=True, cwd=REPO, env=env, check=True).stdout)
    times = sacct_times([a["job_id"] for a in view["attempts"] if a["job_id"]])
    attempts = []
    for a in view["attempts"]:
        adir = Path(a["attempt_dir"])
        attempts.append({"n": a["n"], "job_id": a["job_id"], "state": a["state"],
                         "ok": a["state"] == "COMPLETED" and not a["exit_code"],
                         "elapsed_s": times.get(a["job_id"] or "", {}).get("elapsed_s"),
                         "plan": render.plan_summary(_plan(a["plan"])), "verdict": (a["verdict"] or {}).get("kind"),
                         "moves": (a["decision"] or {}).get("moves", []), "last_step": last_step(adir),
                         "resumed_from_step": a.get("resumed_from_step"),
                         "inflight_moves": [f"step {m['step']}: {m['from']['micro_batch']}x{m['from']['grad_accum']}"
                                            f"->{m['to']['micro_batch']}x{m['to']['grad_accum']}"
                                            for m in a.get("inflight_moves") or []]})
    return {"state": view["state"], "reason": view["reason"], "run_id": run_id, "attempts": attempts}


def resume_figures(result: dict) -> dict:
    """Queue entries, requeues, OOMs (failed attempts + in-job moves), lost steps (per failed attempt: its last step
    minus where the next attempt started), partial steps re-run in the job."""
    atts = result["attempts"]
    lost = []
    for a, nxt in zip(atts, atts[1:]):
        if not a["ok"]:
            lost.append(max(0, a["last_step"] - (nxt.get("resumed_from_step") or 0)))
    inflight = sum(len(a["inflight_moves"]) for a in atts)
    ooms = sum(1 for a in atts if not a["ok"] and (a["verdict"] or "").endswith("oom")) + inflight
    return {"queue_entries": len(atts), "requeues": len(atts) - 1, "ooms": ooms, "lost_steps": sum(lost),
            "lost_per_failed_attempt": lost, "max_lost": max(lost, default=0), "rerun_in_job": inflight,
            "succeeded": result["state"] == "succeeded"}


def resume_report(results: dict, scenarios: list, meta: dict) -> tuple[str, dict]:
    out = [f"hpcmem lost-steps benchmark (resume + in-job recovery vs resubmit-from-scratch) — {meta['date']}  "
           f"commit {meta['commit']}  {meta['machine']}", f"command: {meta['command']}",
           f"checkpoint interval {CHECKPOINT_EVERY} steps; wall time {meta['wall_s']:.0f} s", ""]
    header = ["scenario", "method", "succeeded", "OOMs", "queue entries", "requeues", "lost steps",
              "partial steps re-run in job"]
    rows = []
    for sc in scenarios:
        for m in RESUME_METHODS:
            r = results.get((sc.name, m))
            if r is None:
                continue
            if "error" in r:
                rows.append([sc.name, m, "ERROR", "-", "-", "-", "-", "-"])
                continue
            f = r["figures"]
            rows.append([sc.name, m, "yes" if f["succeeded"] else "NO", f["ooms"], f["queue_entries"], f["requeues"],
                         f["lost_steps"], f["rerun_in_job"]])
    out.append(fmt_table(rows, header))
    out.append("")
    hp = [(sc, results.get((sc.name, "hpcmem"), {}).get("figures")) for sc in scenarios]
    hp = [(sc, f) for sc, f in hp if f]
    beyond = [sc.name for sc, f in hp if f["max_lost"] > CHECKPOINT_EVERY]
    in_job = [(sc, f) for sc, f in hp if sc.as_cap_mib]
    out.append(f"goal '0 lost steps beyond the checkpoint interval ({CHECKPOINT_EVERY})': "
               + ("met" if not beyond else f"MISSED: {', '.join(beyond)}") + f" ({len(hp)} hpcmem runs)")
    requeued = [sc.name for sc, f in in_job if f["requeues"]]
    out.append("goal '0 requeues for OOMs an in-job move answers': "
               + ("met" if not requeued else f"MISSED: {', '.join(requeued)}") + f" ({len(in_job)} such scenarios)")
    out.append("")
    out.append("Attempts (plan; verdict; last step printed; resumed from; in-job moves; ladder moves):")
    out += attempt_lines(scenarios, RESUME_METHODS, results, lambda a: (
        f"; last step {a['last_step']}; resumed from {a['resumed_from_step']}"
        + (f"; in-job {', '.join(a['inflight_moves'])}" if a["inflight_moves"] else "")
        + (f"; moves {', '.join(a['moves'])}" if a["moves"] else "")))
    out.append("")
    out.append("Scenarios:")
    out += [f"  {sc.name}: {sc.what}" for sc in scenarios]
    data = {"meta": meta, "scenarios": [{**sc.__dict__, "oom_args": list(sc.oom_args), "allow": list(sc.allow)}
                                        for sc in scenarios],
            "results": [{"scenario": k[0], "method": k[1], **v} for k, v in results.items()]}
    return "\n".join(out) + "\n", data


def main_resume(opts, argv) -> int:
    scenarios = [sc for sc in RESUME_SCENARIOS
                 if not opts.only or fnmatch.fnmatch(sc.name, opts.only) or opts.only in sc.name]
    if not scenarios:
        raise SystemExit("retry.py: error: no resume scenario matches")
    if opts.list:
        for sc in scenarios:
            print(f"{sc.name:22} {sc.what}")
        return 0
    start = time.time()
    started = dt.datetime.now().astimezone()
    work = Path(tempfile.mkdtemp(prefix="hpcmem-resume-bench-", dir="/tmp"))
    results: dict = {}
    lock = threading.Lock()

    def one(sc, m):
        try:
            r = run_resume(sc, m, work, opts)
            r["figures"] = resume_figures(r)
        except Exception as exc:  # one broken run must not lose the others
            r = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        with lock:
            results[(sc.name, m)] = r
            f = r.get("figures")
            print(f"[{time.time() - start:6.0f}s] {sc.name} / {m}: " + (r["error"] if "error" in r else
                  f"{r['state']}, {f['queue_entries']} job(s), {f['lost_steps']} lost step(s)"),
                  file=sys.stderr, flush=True)

    with cf.ThreadPoolExecutor(max_workers=opts.jobs) as pool:
        for fut in [pool.submit(one, sc, m) for sc in scenarios for m in RESUME_METHODS]:
            fut.result()
    meta = {"date": started.isoformat(timespec="seconds"), "commit": git_commit(), "machine": machine(),
            "command": " ".join(["python", "benchmarks/retry.py", *(sys.argv[1:] if argv is None else argv)]),
            "wall_s": round(time.time() - start, 1), "work_dir": str(work)}
    text, data = resume_report(results, scenarios, meta)
    print(text)
    if not opts.no_save:
        save_report("resume", started, text, data)
    return 0


# --------------------------------------------------------------------------- specs


def write_spec(sc: Scenario, where: Path, opts) -> Path:
    """The scenario as an hpcmem job spec (the same file serves the baselines' rendering)."""
    training = {**sc.training, "global_batch": sc.training["micro_batch"] * sc.gpus}
    command = {"module": sc.module} if sc.module else {"script": str(FAKE)}
    command["args"] = list(sc.args)
    doc = {"name": f"bench-{sc.name}", "description": sc.what, "command": command, "launcher": sc.launcher,
           "nodes": 1, "gpus_per_node": sc.gpus, "time": "00:10:00", "training": training,
           "retry": {"max_attempts": opts.max_attempts},
           "env": {"FAKE_GPU_OOM_AFTER_S": str(opts.oom_after), "FAKE_GPU_TRAIN_S": str(opts.train_s)}}
    if sc.mem_mib:
        doc["mem_mib"] = sc.mem_mib
    if sc.model:
        doc["model"] = {"config": str(MODELS / f"{sc.model}.json"),
                        "task": "seq-cls" if sc.model.startswith("bert") else "causal-lm"}
    path = where / f"{sc.name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# --------------------------------------------------------------------------- slurm facts


def sacct_times(job_ids: list[str]) -> dict[str, dict]:
    """Elapsed (s), Start and End (epoch s) per job, from sacct (-X: the allocation line)."""
    if not job_ids:
        return {}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_")) or k == "SLURM_CONF"}
    env["SLURM_TIME_FORMAT"] = "%s"
    for _ in range(20):
        out = subprocess.run(["sacct", "-X", "-P", "-n", "-j", ",".join(job_ids), "-o", "JobID,State,Elapsed,Start,End"],
                             capture_output=True, text=True, env=env, timeout=60).stdout
        rows = {}
        for line in out.splitlines():
            f = line.split("|")
            if len(f) >= 5:
                rows[f[0]] = {"state": f[1], "elapsed_s": parse_duration_s(f[2]), "start": _epoch(f[3]), "end": _epoch(f[4])}
        if all(j in rows and rows[j]["end"] is not None for j in job_ids):
            return rows
        time.sleep(1)
    return rows


def _epoch(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- the methods


def run_hpcmem(sc: Scenario, spec: Path, work: Path, opts) -> dict:
    home = work / f"home-{sc.name}"
    env = {**os.environ, "HPCMEM_HOME": str(home)}
    cmd = [sys.executable, "-m", "toolkit.cli", "submit", str(spec), "--site", SITE, "--partition", sc.partition,
           "--wait", "--json", "--interval", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=opts.run_timeout)
    try:
        run_id = json.loads(done.stdout)["run_id"]
    except (ValueError, KeyError):
        raise RuntimeError(f"hpcmem submit gave no run: rc={done.returncode} {done.stderr.strip()[-800:]}")
    view = json.loads(subprocess.run([sys.executable, "-m", "toolkit.cli", "runs", run_id, "--json"],
                                     capture_output=True, text=True, cwd=REPO, env=env, check=True).stdout)
    ids = [a["job_id"] for a in view["attempts"] if a["job_id"]]
    times = sacct_times(ids)
    attempts = []
    for a in view["attempts"]:
        t = times.get(a["job_id"] or "", {})
        adir = Path(a["attempt_dir"])
        attempts.append({
            "n": a["n"], "job_id": a["job_id"], "state": a["state"], "ok": a["state"] == "COMPLETED" and not a["exit_code"],
            "elapsed_s": t.get("elapsed_s"), "start": t.get("start"), "end": t.get("end"), "submitted": a["submitted"],
            "micro_batch": a["plan"]["micro_batch"], "global_batch": a["plan"]["global_batch"],
            "plan": render.plan_summary(_plan(a["plan"])), "partition": a["partition"],
            "verdict": (a["verdict"] or {}).get("kind"), "numbers": (a["verdict"] or {}).get("numbers") or {},
            "moves": (a["decision"] or {}).get("moves", []),
            "predicted_peak_mib": (a["decision"] or {}).get("predicted_peak_mib"),
            "truth": _truth(adir)})
    return {"state": view["state"], "reason": view["reason"], "run_id": run_id, "attempts": attempts}


def _plan(d: dict):
    from toolkit.plan import Plan
    return Plan.from_dict(d)


def _truth(adir: Path) -> dict | None:
    t = read_json(adir / "fake_gpu_truth.json")
    if not t:
        return None
    return {"fits": t["fits"], "peak_device_mib": round(t["peak_device_mib"]), "capacity_mib": round(t["capacity_mib"]),
            "failed_at": (t["failure"] or {}).get("what")}


def shrink(rule: str, micro: int) -> int:
    return max(1, micro // 2) if rule == "halve" else max(1, math.floor(0.9 * micro))


def run_baseline(rule: str, sc: Scenario, spec_path: Path, work: Path, opts) -> dict:
    spec = load_spec(spec_path)
    part = sites.load_site(SITE).partition(sc.partition)
    plan = spec.first_plan(part)
    backend = get_backend("slurm")
    run_id = f"{rule}-{int(time.time())}"
    attempts, state, reason = [], "gave_up", ""
    for n in range(1, opts.max_attempts + 1):
        adir = work / f"{rule}-{sc.name}" / f"attempt-{n}"
        att = render.render_attempt(spec, part, plan, adir, run_id=run_id, attempt=n, workdir=REPO)
        job = backend.submit(att.script, adir)
        submitted = time.time()
        deadline = time.monotonic() + opts.run_timeout
        while True:
            status = backend.poll([job])[job]
            if status.finished:
                break
            if time.monotonic() > deadline:
                backend.cancel([job])
                raise RuntimeError(f"job {job} did not finish in {opts.run_timeout} s")
            time.sleep(1.0)
        logs = sorted(adir.glob("slurm-*.out"))
        verdict = classify_paths(logs, record=status) if logs else classify(status, "")
        attempts.append({"n": n, "job_id": job, "state": status.state, "ok": status.succeeded, "submitted": submitted,
                         "micro_batch": plan.micro_batch, "global_batch": plan.global_batch,
                         "plan": render.plan_summary(plan), "partition": part.name, "verdict": verdict.kind,
                         "numbers": verdict.numbers, "moves": [], "truth": _truth(adir)})
        if status.succeeded:
            state = "succeeded"
            break
        new = shrink(rule, plan.micro_batch)
        if new == plan.micro_batch:
            reason = f"micro_batch {plan.micro_batch} cannot shrink further"
            break
        plan = plan.replace(micro_batch=new, global_batch=new * plan.world_size, grad_accum=1)
    else:
        reason = f"{opts.max_attempts} attempts used"
    times = sacct_times([a["job_id"] for a in attempts])
    for a in attempts:
        t = times.get(a["job_id"], {})
        a.update(elapsed_s=t.get("elapsed_s"), start=t.get("start"), end=t.get("end"))
    return {"state": state, "reason": reason, "run_id": run_id, "attempts": attempts}


def figures(result: dict) -> dict:
    """attempts-to-fit, failed attempts, wasted job-seconds, fits, global batch kept, latencies."""
    atts = result["attempts"]
    fit_at = next((a["n"] for a in atts if a["ok"]), None)
    failed = [a for a in atts if not a["ok"] and (fit_at is None or a["n"] < fit_at)]
    wasted = sum(a["elapsed_s"] or 0.0 for a in failed)
    kept = len({a["global_batch"] for a in atts}) == 1
    lat = []
    for prev, nxt in zip(atts, atts[1:]):
        if not prev["ok"] and prev.get("end") is not None and nxt.get("submitted") is not None:
            lat.append(round(nxt["submitted"] - prev["end"], 2))
    return {"attempts_to_fit": fit_at, "attempts_made": len(atts), "failed_attempts": len(failed),
            "wasted_job_s": round(wasted, 1), "fits": fit_at is not None, "global_batch_kept": kept,
            "first_global_batch": atts[0]["global_batch"] if atts else None,
            "final_global_batch": atts[-1]["global_batch"] if atts else None, "latencies_s": lat}


# --------------------------------------------------------------------------- the report


def attempt_lines(scenarios, methods, results: dict, tail) -> list[str]:
    """The report's per-attempt lines, scenario by scenario and method by method: each run's end, then each
    attempt as 'n. job ID STATE ELAPSED [verdict] plan' followed by what ``tail(attempt)`` adds."""
    out = []
    for sc in scenarios:
        for m in methods:
            r = results.get((sc.name, m))
            if not r:
                continue
            if "error" in r:
                out.append(f"  {sc.name} / {m}: ERROR {r['error']}")
                continue
            out.append(f"  {sc.name} / {m}: {r['state']}" + (f" — {r['reason']}" if r.get("reason") else ""))
            for a in r["attempts"]:
                el = f"{a['elapsed_s']:.0f}s" if a.get("elapsed_s") is not None else "?"
                out.append(f"    {a['n']}. job {a['job_id']} {a['state']} {el} [{a['verdict']}] {a['plan']}{tail(a)}")
    return out


def _ladder_attempt_tail(a: dict) -> str:
    t = a.get("truth")
    truth = f"; truth {t['peak_device_mib']}/{t['capacity_mib']}" if t else ""
    if t and t.get("failed_at"):
        truth += f" (failed at {t['failed_at']})"
    moves = f"; moves {', '.join(a['moves'])}" if a.get("moves") else ""
    pred = f"; predicted {a['predicted_peak_mib']:.0f}" if a.get("predicted_peak_mib") else ""
    return f"{moves}{pred}{truth}"


def fmt_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: " | ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *map(line, rows)])


def report(results: dict, scenarios: list[Scenario], meta: dict) -> tuple[str, dict]:
    out = []
    out.append(f"hpcmem OOM-retry benchmark — {meta['date']}  commit {meta['commit']}  {meta['machine']}")
    out.append(f"command: {meta['command']}")
    out.append(f"settings: max attempts {meta['max_attempts']}, emulated time-to-OOM {meta['oom_after']} s, emulated "
               f"training {meta['train_s']} s x slowdown, {meta['jobs']} method runs at once; wall time "
               f"{meta['wall_s']:.0f} s")
    out.append("FAKE GPU = benchmarks/fake_gpu_job.py emulates GPU memory (no GPU here); REAL = real memory under the "
               "cpu partition's cgroup.")
    out.append("Baselines (halve, x0.9) shrink the micro-batch with grad_accum 1: they CHANGE THE GLOBAL BATCH "
               "(what is learned); hpcmem keeps it.")
    out.append("")
    header = ["scenario", "kind", "method", "attempts-to-fit", "failed attempts", "wasted job-s", "fits?",
              "global batch kept?"]
    rows, summary = [], {}
    for sc in scenarios:
        for m in METHODS:
            r = results.get((sc.name, m))
            if r is None:
                continue
            if "error" in r:
                rows.append([sc.name, sc.kind, m, "ERROR", "-", "-", "-", "-"])
                continue
            f = r["figures"]
            fit = str(f["attempts_to_fit"]) if f["fits"] else f"gave up ({f['attempts_made']})"
            kept = "yes" if f["global_batch_kept"] else f"no ({f['first_global_batch']}->{f['final_global_batch']})"
            rows.append([sc.name, sc.kind + ("" if sc.numbers else ", no numbers"), m, fit, f["failed_attempts"],
                         f"{f['wasted_job_s']:.0f}", "yes" if f["fits"] else "NO", kept])
    out.append(fmt_table(rows, header))
    out.append("")
    goal_misses, worse = [], []
    for m in METHODS:
        fs = [(sc, results[(sc.name, m)]["figures"]) for sc in scenarios
              if (sc.name, m) in results and "figures" in results[(sc.name, m)]]
        if not fs:
            continue
        fitted = [f for _, f in fs if f["fits"]]
        att = [f["attempts_to_fit"] for f in fitted]
        s = {"scenarios": len(fs), "fitted": len(fitted), "failed_attempts": sum(f["failed_attempts"] for _, f in fs),
             "wasted_job_s": round(sum(f["wasted_job_s"] for _, f in fs), 1),
             "median_attempts_to_fit": statistics.median(att) if att else None,
             "global_batch_kept": sum(f["global_batch_kept"] for _, f in fs)}
        summary[m] = s
        out.append(f"{m:>7}: fitted {s['fitted']}/{s['scenarios']}, {s['failed_attempts']} failed attempts, "
                   f"{s['wasted_job_s']:.0f} wasted job-s, median attempts-to-fit {s['median_attempts_to_fit']}, "
                   f"global batch kept in {s['global_batch_kept']}/{s['scenarios']}")
    for sc in scenarios:
        h = results.get((sc.name, "hpcmem"), {}).get("figures")
        if not h:
            continue
        if sc.numbers and not (h["fits"] and h["failed_attempts"] <= 1):
            goal_misses.append(f"{sc.name} ({h['failed_attempts']} failed attempts"
                               + ("" if h["fits"] else ", did not fit") + ")")
        for m in METHODS[1:]:
            b = results.get((sc.name, m), {}).get("figures")
            if b and b["fits"] and (not h["fits"] or h["attempts_to_fit"] > b["attempts_to_fit"]):
                worse.append(f"{sc.name} vs {m} ({h['attempts_to_fit'] or 'gave up'} > {b['attempts_to_fit']})")
    with_numbers = [sc for sc in scenarios if sc.numbers and (sc.name, "hpcmem") in results]
    out.append(f"goal 'at most one failed attempt where the message states its numbers': "
               f"{len(with_numbers) - len(goal_misses)}/{len(with_numbers)} met"
               + (f"; missed: {'; '.join(goal_misses)}" if goal_misses else ""))
    out.append("goal 'never more attempts than the baselines': "
               + ("met" if not worse else f"MISSED: {'; '.join(worse)}"))
    lats = [x for sc in scenarios for x in results.get((sc.name, "hpcmem"), {}).get("figures", {}).get("latencies_s", [])]
    base_lats = [x for sc in scenarios for m in METHODS[1:]
                 for x in results.get((sc.name, m), {}).get("figures", {}).get("latencies_s", [])]
    lat = {"n": len(lats), "median_s": statistics.median(lats) if lats else None, "max_s": max(lats) if lats else None,
           "goal_s": 10, "baseline_loop_median_s": statistics.median(base_lats) if base_lats else None}
    if lats:
        out.append(f"failure-to-resubmit latency (hpcmem, --interval 1): median {lat['median_s']:.1f} s, max "
                   f"{lat['max_s']:.1f} s over {len(lats)} resubmissions (goal < 10 s; sacct End is truncated to the "
                   f"second, so values read up to 1 s high)"
                   + (f"; the baselines' bare loop: median {lat['baseline_loop_median_s']:.1f} s" if base_lats else ""))
    else:
        out.append("failure-to-resubmit latency (hpcmem): no resubmissions measured")
    misses = explain_misses(results, scenarios)
    if misses:
        out.append("Why hpcmem needed more than one failed attempt despite numbers (message = in use + tried to "
                   "allocate, what the ladder takes as the failed step's demand; truth = the fake GPU's peak, MiB):")
        out += [f"  {line}" for line in misses]
    out.append("")
    out.append("Scenarios:")
    for sc in scenarios:
        out.append(f"  {sc.name}: {sc.what} [{sc.kind}]")
    out.append("")
    out.append("Attempts (plan; verdict; truth = the fake GPU's ground-truth peak / capacity, MiB):")
    out += attempt_lines(scenarios, METHODS, results, _ladder_attempt_tail)
    data = {"meta": meta, "summary": summary, "latency": lat, "goal_misses": goal_misses, "worse_than_baseline": worse,
            "scenarios": [{**sc.__dict__, "args": list(sc.args)} for sc in scenarios],
            "results": [{"scenario": k[0], "method": k[1], **v} for k, v in results.items()]}
    return "\n".join(out) + "\n", data


def explain_misses(results: dict, scenarios: list[Scenario]) -> list[str]:
    """For hpcmem runs with more than one failed attempt where the message stated numbers: per failed attempt,
    what the message said against the truth, and what the ladder predicted for the next plan against the truth."""
    lines = []
    for sc in scenarios:
        r = results.get((sc.name, "hpcmem"))
        if not r or "figures" not in r or not sc.numbers or r["figures"]["failed_attempts"] <= 1:
            continue
        atts = r["attempts"]
        for a, nxt in zip(atts, atts[1:] + [None]):
            if a["ok"]:
                break
            n, t = a["numbers"], a.get("truth") or {}
            said = (n.get("process_in_use_mib") or 0) + (n.get("tried_to_allocate_mib") or 0)
            text = f"{sc.name} attempt {a['n']} ({a['plan']}): failed at {t.get('failed_at', '?')}; message {said:.0f}"
            if t.get("peak_device_mib"):
                text += f" vs truth {t['peak_device_mib']} ({100 * said / t['peak_device_mib']:.0f} % of it)"
            if nxt is not None and nxt.get("predicted_peak_mib"):
                nt = (nxt.get("truth") or {}).get("peak_device_mib")
                text += (f"; next plan ({', '.join(nxt['moves'])}) predicted {nxt['predicted_peak_mib']:.0f}"
                         + (f", truth {nt}" if nt else ""))
            lines.append(text)
    return lines


def save_report(kind: str, started: dt.datetime, text: str, data: dict) -> Path:
    """benchmarks/results/KIND-<start time>.txt and .json; returns the stem."""
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{kind}-{started.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".txt").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"saved {stem}.txt and .json", file=sys.stderr)
    return stem


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=REPO).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def machine() -> str:
    try:
        slurm = subprocess.run(["sinfo", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        slurm = "no slurm"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{socket.gethostname()} ({platform.system()} {platform.release()}, {os.cpu_count()} CPUs, {mem:.0f} GiB, "
            f"Python {platform.python_version()}, {slurm})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="three scenarios only")
    p.add_argument("--only", metavar="PATTERN", help="scenarios whose name matches (glob, or a substring)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated: hpcmem,halve,x0.9")
    p.add_argument("--jobs", type=int, default=3, help="method runs at once (Slurm queues what does not fit)")
    p.add_argument("--max-attempts", type=int, default=8)
    p.add_argument("--oom-after", type=float, default=6.0, help="FAKE GPU: emulated start-up seconds before the OOM")
    p.add_argument("--train-s", type=float, default=3.0, help="FAKE GPU: emulated training seconds of a fitting plan")
    p.add_argument("--run-timeout", type=int, default=1800, help="seconds allowed per method run")
    p.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/retry-*")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--resume", action="store_true",
                   help="the lost-steps suite: hpcmem (resume + in-job recovery) vs resubmit-from-scratch")
    opts = p.parse_args(argv)
    if opts.resume:
        return main_resume(opts, argv)
    scenarios = [sc for sc in SCENARIOS if not opts.quick or sc.quick]
    if opts.only:
        scenarios = [sc for sc in scenarios if fnmatch.fnmatch(sc.name, opts.only) or opts.only in sc.name]
    methods = [m for m in opts.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown or not scenarios:
        p.error(f"unknown method {sorted(unknown)}" if unknown else "no scenario matches")
    if opts.list:
        for sc in scenarios:
            print(f"{sc.name:28} {sc.kind:9} {sc.what}")
        return 0
    start = time.time()
    started = dt.datetime.now().astimezone()
    work = Path(tempfile.mkdtemp(prefix="hpcmem-retry-bench-", dir="/tmp"))
    specs = {sc.name: write_spec(sc, work, opts) for sc in scenarios}
    tasks = [(sc, m) for m in ("x0.9", "halve", "hpcmem") if m in methods for sc in scenarios]
    results: dict = {}
    lock = threading.Lock()

    def one(sc: Scenario, m: str):
        t0 = time.time()
        try:
            r = run_hpcmem(sc, specs[sc.name], work, opts) if m == "hpcmem" else \
                run_baseline("halve" if m == "halve" else "x0.9", sc, specs[sc.name], work, opts)
            r["figures"] = figures(r)
        except Exception as exc:  # one broken run must not lose the others
            r = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        r["wall_s"] = round(time.time() - t0, 1)
        with lock:
            results[(sc.name, m)] = r
            f = r.get("figures")
            print(f"[{time.time() - start:6.0f}s] {sc.name} / {m}: "
                  + (r["error"] if "error" in r else
                     f"{r['state']}, {f['attempts_made']} attempt(s), {f['wasted_job_s']:.0f} wasted job-s"),
                  file=sys.stderr, flush=True)

    print(f"work dir {work}; {len(tasks)} method runs, {opts.jobs} at once", file=sys.stderr, flush=True)
    with cf.ThreadPoolExecutor(max_workers=opts.jobs) as pool:
        for fut in [pool.submit(one, sc, m) for sc, m in tasks]:
            fut.result()
    meta = {"date": started.isoformat(timespec="seconds"), "commit": git_commit(), "machine": machine(),
            "command": " ".join(["python", "benchmarks/retry.py", *(sys.argv[1:] if argv is None else argv)]),
            "max_attempts": opts.max_attempts, "oom_after": opts.oom_after, "train_s": opts.train_s, "jobs": opts.jobs,
            "wall_s": round(time.time() - start, 1), "work_dir": str(work)}
    text, data = report(results, scenarios, meta)
    print(text)
    if not opts.no_save:
        save_report("retry", started, text, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
