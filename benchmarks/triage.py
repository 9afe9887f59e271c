"""Triage benchmarks (issue 5): a 1 GB log, and ``--since`` over 1,000 failed jobs.

    python benchmarks/triage.py [--log-gb 1] [--jobs 1000] [--skip-slurm] [--json]

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
import os
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
    args = ap.parse_args()
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
        print(json.dumps(results, indent=2))
        return
    for r in results:
        print(f"{r['what']:<55} {r['wall_s']:>6.2f} s {r['peak_rss_mib']:>7.1f} MiB  goal {r['goal']}  "
              + " ".join(f"{k}={v}" for k, v in r.items() if k not in ("what", "wall_s", "peak_rss_mib", "goal")))


if __name__ == "__main__":
    main()
