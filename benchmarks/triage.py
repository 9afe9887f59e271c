"""Triage benchmarks (issues 5 and 12): the corpus's accuracy, a 1 GB log, and ``--since`` over 1,000 failed jobs.

    python benchmarks/triage.py [--log-gb 1] [--jobs 1000] [--skip-slurm] [--corpus-only] [--json]

Accuracy over ``tests/fixtures/corpus/`` (real logs from public issue trackers, each with its label): exact kind,
non-OOM logs called OOM (must be 0), stated numbers read exactly, phase on the logs that show a traceback (a line
``Traceback (most recent call last)`` anywhere in a line), per kind, per group (gpu/host/other), per
launcher, and on the held-out fifth (every 5th stem in sorted order, ``HELD_OUT``) kept aside while the rules were
developed; also the step where labelled and the cause where labelled (among the logs whose kind is right).
``tests/unit/test_corpus.py`` asserts the issue's figures with the same scoring (``score_corpus``).

Each figure is the whole command as support staff run it (``hpcmem triage ... --format json`` in a
fresh process: interpreter start, imports, reading, classifying, remedies), wall time and the
process's peak resident memory (from wait4). Goals: 1 GB log < 3 s and < 200 MB; ``--since`` over
1,000 jobs < 10 s. The 1,000 jobs are a real job array on the test cluster (tests/cluster/slurm-up.sh),
each task failing the way real jobs do (a CUDA OOM message, a Python error, a cgroup-style kill line).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

OOM = ("[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
       "15.77 GiB of which 1.10 GiB is free. Including non-PyTorch memory, this process has 14.66 GiB memory in use. "
       "Of the allocated memory 13.90 GiB is allocated by PyTorch, and 412.00 MiB is reserved by PyTorch but "
       "unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
FILLER = "[rank{r}]: {{'loss': 2.{n:04d}, 'grad_norm': 1.2{n:03d}, 'learning_rate': 4.9e-05, 'epoch': 0.{n:04d}}}  step {n}/900000 | 14.2 samples/s\n"

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "corpus"
NUMBER_KEYS = ("tried_to_allocate_mib", "total_capacity_mib", "free_mib", "process_in_use_mib",
               "allocated_by_pytorch_mib", "reserved_unallocated_mib", "already_allocated_mib", "reserved_total_mib",
               "other_process_mib", "nccl_bytes", "host_used_mib")
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
"""A log "shows a traceback" when any line holds Python's ``Traceback (most recent call last)`` header."""


def HELD_OUT(index: int) -> bool:
    """The held-out fifth: every 5th stem of the corpus in sorted order (index 4, 9, 14, ...)."""
    return index % 5 == 4


def load_corpus(corpus: Path = CORPUS) -> list[dict]:
    """Every case: {stem, group, log, label, held_out}."""
    import yaml

    cases = []
    for k, label_path in enumerate(sorted(corpus.glob("*.yaml"))):
        stem = label_path.stem
        cases.append({"stem": stem, "group": stem.split("-")[0], "held_out": HELD_OUT(k),
                      "log": (corpus / f"{stem}.log").read_text(encoding="utf-8", errors="replace"),
                      "label": yaml.safe_load(label_path.read_text())})
    return cases


def same_number(a, b) -> bool:
    """Exact up to the printing of the message (two decimals of a GiB/MiB figure, converted)."""
    return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-4, abs_tol=0.011)


def score_case(case: dict) -> dict:
    """Classify one corpus log (no scheduler record: a pasted log) and compare with its label."""
    from toolkit.classify import OOM_KINDS, classify

    label = case["label"]
    v = classify(None, case["log"])
    stated = {k: x for k, x in (label.get("numbers") or {}).items() if x is not None}
    numbers_ok = {k: same_number(v.numbers.get(k), x) for k, x in stated.items()}
    traceback = bool(TRACEBACK.search(case["log"]))
    phase = getattr(v, "phase", None)
    return {
        "stem": case["stem"], "group": case["group"], "held_out": case["held_out"],
        "launcher": label.get("launcher") or "unknown", "want": label["kind"], "got": v.kind,
        "kind_ok": v.kind == label["kind"],
        "false_oom": label["kind"] not in OOM_KINDS and v.kind in OOM_KINDS,
        "numbers_ok": numbers_ok, "traceback": traceback,
        "phase_want": label.get("phase"), "phase_got": phase, "phase_ok": phase == label.get("phase"),
        "step_want": label.get("step"), "step_got": getattr(v, "step", None),
        "confidence": getattr(v, "confidence", None),
        "cause_want": label.get("cause"), "cause_ok": getattr(v, "cause", None) == label.get("cause"),
    }


def summarise(rows: list[dict]) -> dict:
    """The issue's figures over ``rows``: kind accuracy, false OOMs, numbers exact, phase on traceback logs."""
    nums = [ok for r in rows for ok in r["numbers_ok"].values()]
    tb = [r for r in rows if r["traceback"]]
    steps = [r for r in rows if r["step_want"] is not None]
    causes = [r for r in rows if r["cause_want"] is not None and r["kind_ok"]]
    return {
        "cases": len(rows),
        "kind_exact": sum(r["kind_ok"] for r in rows) / len(rows) if rows else None,
        "false_oom": sum(r["false_oom"] for r in rows),
        "numbers": len(nums), "numbers_exact": sum(nums) / len(nums) if nums else None,
        "traceback_logs": len(tb), "phase_exact": sum(r["phase_ok"] for r in tb) / len(tb) if tb else None,
        "steps": len(steps),
        "step_exact": sum(r["step_got"] == r["step_want"] for r in steps) / len(steps) if steps else None,
        "causes": len(causes), "cause_exact": sum(r["cause_ok"] for r in causes) / len(causes) if causes else None,
    }


def score_corpus(corpus: Path = CORPUS) -> dict:
    """Figures over the whole corpus, the development part, the held-out fifth, per kind/group/launcher."""
    rows = [score_case(c) for c in load_corpus(corpus)]
    out = {"all": summarise(rows), "development": summarise([r for r in rows if not r["held_out"]]),
           "held_out": summarise([r for r in rows if r["held_out"]]), "rows": rows}
    for key, field_name in (("per_kind", "want"), ("per_group", "group"), ("per_launcher", "launcher")):
        values = sorted({r[field_name] for r in rows})
        out[key] = {v: summarise([r for r in rows if r[field_name] == v]) for v in values}
    return out


def print_corpus(result: dict, misses: bool = False) -> None:
    def pct(x):
        return "   -  " if x is None else f"{100 * x:5.1f}%"

    def line(name, s):
        print(f"  {name:<24} {s['cases']:>4} logs  kind {pct(s['kind_exact'])}  false OOM {s['false_oom']}  "
              f"numbers {pct(s['numbers_exact'])} of {s['numbers']:>3}  phase {pct(s['phase_exact'])} of "
              f"{s['traceback_logs']:>2} traceback logs  step {pct(s['step_exact'])} of {s['steps']}  "
              f"cause {pct(s['cause_exact'])} of {s['causes']}")

    print("triage corpus (tests/fixtures/corpus): goals kind >= 95 %, false OOM 0, numbers >= 98 %, phase >= 90 %")
    for name in ("all", "development", "held_out"):
        line(name, result[name])
    for key in ("per_group", "per_kind", "per_launcher"):
        print(f" {key.replace('_', ' ')}:")
        for name, s in result[key].items():
            line(name, s)
    if misses:
        print(" misses:")
        for r in result["rows"]:
            bad = [k for k, ok in r["numbers_ok"].items() if not ok]
            if not r["kind_ok"] or bad or (r["traceback"] and not r["phase_ok"]):
                print(f"  {'H' if r['held_out'] else ' '} {r['stem']:<52} want {r['want']:<22} got {r['got']:<22}"
                      + (f" numbers {bad}" if bad else "")
                      + (f" phase {r['phase_want']}/{r['phase_got']}" if r["traceback"] and not r["phase_ok"] else ""))



def make_log(path: Path, size_bytes: int, compress: bool) -> Path:
    """A training log of about ``size_bytes`` (uncompressed) ending in a rank's CUDA OOM and the launcher's summary."""
    block = "".join(FILLER.format(r=n % 4, n=n) for n in range(2000)).encode()
    opener = gzip.open if compress else open
    with opener(path, "wb") as f:
        written = 0
        while written < size_bytes:
            f.write(block)
            written += len(block)
        f.write(("Traceback (most recent call last):\n  File \"train.py\", line 88, in <module>\n" + OOM + "\n"
                 "E1121 09:12:03 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 1) "
                 "local_rank: 1 (pid: 4242) of binary: /usr/bin/python\n").encode())
    return path


def run_measured(argv: list[str], out: Path) -> dict:
    """Run ``argv`` with stdout to ``out``; wall seconds, peak RSS (MiB) and exit status of that process."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    start = time.perf_counter()
    pid = os.posix_spawnp(argv[0], argv, dict(os.environ), file_actions=[(os.POSIX_SPAWN_DUP2, fd, 1)])
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    os.close(fd)
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "exit": os.waitstatus_to_exitcode(status)}


def bench_log(size_gb: float, compress: bool, tmp: Path) -> dict:
    path = make_log(tmp / ("big.log.gz" if compress else "big.log"), int(size_gb * 2**30), compress)
    os.sync()
    result = run_measured([sys.executable, "-m", "toolkit.cli", "triage", str(path), "--site", "example-hpc",
                           "--format", "json"], tmp / "out.json")
    data = json.loads((tmp / "out.json").read_text())
    f = data["findings"][0]
    return {"what": f"triage a {size_gb:g} GB {'gzip' if compress else 'plain'} log", **result,
            "file_mib": round(path.stat().st_size / 2**20), "kind": f["verdict"]["kind"],
            "evidence_line": f["verdict"]["evidence"][0]["line"] if f["verdict"]["evidence"] else None,
            "remedies": len(f["remedies"]), "goal": "< 3 s, < 200 MiB"}


def bench_since(n_jobs: int, tmp: Path) -> dict:
    """Submit an array of ``n_jobs`` failing tasks, wait for sacct to hold them, time `triage --since`."""
    from toolkit import proc

    logs = tmp / "array"
    logs.mkdir()
    script = logs / "fail.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH -p cpu\n#SBATCH --mem=50M\n#SBATCH -t 2\n#SBATCH -J triage-bench\n"
        f"#SBATCH --array=0-{n_jobs - 1}\n#SBATCH --output={logs}/slurm-%A_%a.out\n"
        "case $((SLURM_ARRAY_TASK_ID % 3)) in\n"
        f"  0) echo {json.dumps(OOM)} ;;\n"
        "  1) echo 'ValueError: could not convert string to float: nan' ;;\n"
        "  2) echo 'slurmstepd: error: Detected 1 oom-kill event(s) in StepId=1.batch. Some of your processes may "
        "have been killed by the cgroup out-of-memory handler.' ;;\n"
        "esac\nexit 1\n")
    started = time.time() - 5
    array = proc.run(["sbatch", "--parsable", str(script)], timeout=60).stdout.strip().split(";")[0]
    deadline = time.time() + 900
    while time.time() < deadline:
        out = proc.run(["sacct", "-X", "-n", "-P", "-j", array, "-o", "State"], timeout=60, check=False).stdout
        states = out.split()
        if len(states) >= n_jobs and not any(s in ("PENDING", "RUNNING", "COMPLETING") for s in states):
            break
        time.sleep(5)
    submitted_for = time.time() - started
    window = f"{int(time.time() - started + 60)}s"
    result = run_measured([sys.executable, "-m", "toolkit.cli", "triage", "--since", window, "--site", "testcluster",
                           "--format", "json"], tmp / "since.json")
    data = json.loads((tmp / "since.json").read_text())
    return {"what": f"triage --since over a window with {data['jobs']} failed jobs", **result,
            "groups": {g["kind"]: g["count"] for g in data["groups"]}, "array_done_s": round(submitted_for),
            "goal": "< 10 s"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--log-gb", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--skip-slurm", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--corpus-only", action="store_true", help="only the corpus accuracy (no timing)")
    ap.add_argument("--misses", action="store_true", help="list the corpus cases it gets wrong")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    corpus = score_corpus()
    if not args.json:
        print_corpus(corpus, args.misses)
    if args.corpus_only:
        if args.json:
            print(json.dumps({k: v for k, v in corpus.items() if k != "rows"}, indent=2))
        return
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="hpcmem-triage-bench-", dir="/tmp"))
    try:
        results.append(bench_log(args.log_gb, False, tmp))
        results.append(bench_log(args.log_gb, True, tmp))
        if not args.skip_slurm:
            results.append(bench_since(args.jobs, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"corpus": {k: v for k, v in corpus.items() if k != "rows"}, "timing": results}, indent=2))
        return
    for r in results:
        print(f"{r['what']:<55} {r['wall_s']:>6.2f} s {r['peak_rss_mib']:>7.1f} MiB  goal {r['goal']}  "
              + " ".join(f"{k}={v}" for k, v in r.items() if k not in ("what", "wall_s", "peak_rss_mib", "goal")))


if __name__ == "__main__":
    main()
