#!/usr/bin/env bash
# One lent GPU session's checks, prepared to run as a single command (the device tool's time is short):
#
#   bash benchmarks/gpu_session/run.sh [OUTDIR]        (default: $OUT, else /tmp/hpcmem-gpu)
#
# 1. env       nvidia-smi, torch, CUDA, the packages hpcmem's job side uses
# 2. context   probe.py context: device memory outside the allocator as kernels load (alone: NVML is device-wide)
#    replay    benchmarks/gpu_replay.py: real steps under a 16 GiB memory-fraction cap (one case at 40), the
#              allocator's own record replayed through the allocator model, the analytic estimate beside both;
#              the traces are kept (gpu-replay-traces/) for replays on machines without a GPU;
#              GPU_REPLAY_ONLY=regex picks its cases
# 3. at once   (each its own HPCMEM run on the local scheduler; nvidia-smi readings overlap, memory caps don't):
#              readme    the README's main job: hpcmem submit quickstart --site local --wait
#              inflight  a first-step CUDA OOM on an emulated 16 GiB card, answered inside the job
#              resume    a step-6 CUDA OOM with in-job recovery off: resubmitted, resumed from the checkpoint
#              fsdp      the quickstart under launcher=fsdp (FSDP2, NCCL, one GPU)
#              zero3     the quickstart under DeepSpeed ZeRO-3 (needs deepspeed: carried as a wheel in .whl/)
#              ckptjob   the quickstart with activation checkpointing, the runtime recording the allocator's history
#              ckpt-history  probe.py checkpointing: which history settings a checkpointed backward survives
# 4. triage    hpcmem triage RUN:1 --json of every run whose first attempt failed (a real CUDA OOM log)
# 5. calibrate hpcmem calibrate --site local --json (CUDA context and cuBLAS workspace as NVML sees them)
#
# Everything lands in OUTDIR/logs and OUTDIR/gpu-session.tar.gz (run directories without checkpoints).
# Wheels in .whl/ (packages the GPU image lacks: submitit, deepspeed and its pydantic) are installed first
# where deepspeed or submitit is missing.
# GPU_SESSION_ONLY=regex runs only the steps whose name matches (e.g. 'env|readme' for a smoke run);
# GPU_SESSION_BUDGET_S (default 480) is when every step must have ended: give the device call a minute more.
set -u
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-/tmp/hpcmem-gpu}}
logs=$out/logs
mkdir -p "$logs"
only=${GPU_SESSION_ONLY:-.}
export PYTHONUNBUFFERED=1 HPCMEM_HOME=${HPCMEM_HOME:-/tmp/hpcmem-gpu-home}
if ! python3 -c 'import deepspeed, submitit' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hpcmem-site \
    .whl/*.whl > "$logs/wheels.log" 2>&1 || echo "wheels: install failed (see logs/wheels.log)"
  export PYTHONPATH=/tmp/hpcmem-site:$PWD
else
  export PYTHONPATH=$PWD
fi
hp() { python3 -m toolkit.cli --sites-dir benchmarks/gpu_session/sites "$@"; }
wanted() { [[ $1 =~ $only ]]; }
t0=$(date +%s)
deadline=$(( t0 + ${GPU_SESSION_BUDGET_S:-480} ))  # every step ends by then, so the archive below is always made
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$out/summary.txt"; }

# step NAME LIMIT_S COMMAND...: its output to logs/NAME.log and .err, its exit status and time to the summary
step() {
  local name=$1 limit=$2 start rc
  shift 2
  wanted "$name" || return 0
  start=$(date +%s)
  (( limit > deadline - start )) && limit=$(( deadline - start ))
  (( limit >= 5 )) || { say "$name: skipped (the session's budget is spent)"; return 0; }
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" > "$logs/$name.log" 2> "$logs/$name.err"
  rc=$?
  say "$name: rc=$rc in $(( $(date +%s) - start ))s"
  tail -n 12 "$logs/$name.err"
  tail -n 25 "$logs/$name.log"
}

envinfo() {
  nvidia-smi
  python3 - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, p.total_memory, "bf16", torch.cuda.is_bf16_supported(), "nccl", torch.cuda.nccl.version())
for name in ("transformers", "accelerate", "deepspeed", "submitit", "pynvml", "jinja2", "click", "pandas", "yaml"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:  # noqa: BLE001 - report what is missing, whatever the reason
        print(name, "MISSING", type(exc).__name__, str(exc)[:200])
EOF
}

export -f hp envinfo
step env 60 envinfo
step context 90 python3 benchmarks/gpu_session/probe.py context "$logs/context.json"
step replay 200 python3 benchmarks/gpu_replay.py --cap-gib 16 --out "$logs/gpu-replay.json" \
  --traces "$logs/gpu-replay-traces" --only "${GPU_REPLAY_ONLY:-}"

spec=benchmarks/gpu_session
step readme 200 hp submit quickstart --site local --wait --json &
step inflight 200 hp submit $spec/gpt2-oom-inflight.yaml --site gpulab -p h100-16gb --wait --json &
step resume 200 hp submit $spec/gpt2-oom-resume.yaml --site gpulab -p h100-16gb --wait --json &
step fsdp 200 hp submit quickstart --site gpulab -p h100-16gb --set launcher=fsdp --wait --json &
step zero3 200 hp submit quickstart --site gpulab -p h100-16gb --set launcher=deepspeed --set zero_stage=3 \
  --wait --json &
step ckptjob 200 hp submit quickstart --site gpulab -p h100-16gb --set checkpointing=true --set precision=bf16-mixed \
  --wait --json &
step ckpt-history 200 python3 benchmarks/gpu_session/probe.py checkpointing "$logs/ckpt-history.json" &
wait

# run_of LOG: "RUN_ID FIRST_ATTEMPT_STATE | the run's state and each attempt's state and verdict"
run_of() {
  python3 - "$1" <<'EOF' 2>/dev/null
import json, sys
d = json.load(open(sys.argv[1]))
attempts = "; ".join("%s:%s:%s" % (a["n"], a["state"], (a.get("verdict") or {}).get("kind")) for a in d["attempts"])
print(d["run_id"], d["attempts"][0]["state"] if d["attempts"] else "-", "|", d["state"], attempts)
EOF
}
for name in readme inflight resume fsdp zero3 ckptjob; do
  [ -s "$logs/$name.log" ] || continue
  read -r run first rest <<< "$(run_of "$logs/$name.log")"
  [ -n "${run:-}" ] || { say "$name: no run in its output"; continue; }
  say "$name: run $run $rest"
  [ "$first" = COMPLETED ] && [[ ! $name =~ inflight|resume ]] || step "triage-$name" 45 hp triage "$run:1" --site gpulab --json
done
step calibrate 60 hp calibrate --site local --json
step runs 30 hp runs --json

# run directories without checkpoints (GPT-2's are about 1.5 GB each) and nothing over 8 MB
(cd "$HPCMEM_HOME" && find runs local -type f -size -8M -not -path '*/checkpoints/*' -print0 2>/dev/null \
  | tar --null -T - -czf "$logs/hpcmem-home.tar.gz") || say "hpcmem-home: tar failed"
tar -czf "$out/gpu-session.tar.gz" -C "$out" logs && say "written: $out/gpu-session.tar.gz ($(du -h "$out/gpu-session.tar.gz" | cut -f1))"
