"""Where to look when a failure is not out-of-memory: what it is, and the next thing to check (no memory advice)."""

from __future__ import annotations

import re

from ..classify import Verdict

TIME_LIMIT = ("The job reached its time limit: ask for more (--time; hpcmem: --set time_min=...) up to the "
              "partition's limit, or make it checkpoint and resume (#SBATCH --signal=B:USR1@90 --requeue).")
CANCELLED = ("The job was cancelled: `sacct -j JOBID -o JobID,State,End,User` shows when and by whom "
             "(\"CANCELLED by UID\"); if a rank failed first, its error is the cause.")
PREEMPTED = ("The job was preempted by a higher-priority job: resubmit with --requeue, or use a partition or QOS "
             "without preemption.")
NODE_FAIL = ("A node failed: resubmit (sacct -j JOBID -o JobID,NodeList shows which node; report it to the admins).")

# (pattern on the verdict's reason -- the classifier's named cause --, advice); the most specific first, so an NCCL
# watchdog "Timeout(ms)=600000" is a collective that hung, not the job's time limit.
_WHERE = (
    (r"nccl|watchdog", "A collective timed out: rerun with NCCL_DEBUG=INFO (and TORCH_DISTRIBUTED_DEBUG=DETAIL); "
     "look for the rank that stopped first, whose own error is usually the cause."),
    (r"illegal memory access|misaligned address|launch failure", "A CUDA kernel faulted: rerun with "
     "CUDA_LAUNCH_BLOCKING=1 (and TORCH_USE_CUDA_DSA=1) to see which operation; often a bug or a version mismatch."),
    (r"device-side assert", "A device-side assert: usually an index out of range (labels >= num_labels, token "
     "ids >= vocab_size); rerun with CUDA_LAUNCH_BLOCKING=1 to see which operation."),
    (r"\becc\b", "An uncorrectable ECC error is a hardware fault: report the node (nvidia-smi -q -d ECC) and resubmit."),
    (r"\btime limit\b", TIME_LIMIT),
    (r"\bcancel", CANCELLED),
    (r"\bpreempt", PREEMPTED),
    (r"node fail|boot fail", NODE_FAIL),
    (r"no space left|disk full|quota", "The disk is full or over quota: `df -h PATH`, `quota -s` or `lfs quota -u "
     "$USER PATH`; write checkpoints and caches (HF_HOME, TMPDIR) to scratch."),
    (r"import error|no module named|importerror|modulenotfounderror", "A package is missing on the compute node: "
     "check the job's module/venv lines (python -c 'import X' inside an srun)."),
    (r"command not found", "A command is missing on the compute node: check PATH and the module lines of the job "
     "script."),
    (r"sigkill", "Killed by SIGKILL with no out-of-memory record: `sacct -j JOBID -o JobID,State,ExitCode,MaxRSS,"
     "ReqMem` (MaxRSS near ReqMem: host memory) and the node's kernel log (dmesg) for the OOM killer."),
    (r"^the job completed", "The job completed: nothing failed."),
)
# By the classifier's cause (Verdict.cause), first: the causes its reason does not spell out.
_BY_CAUSE = {
    "teardown": ("Training completed, then the process crashed while shutting down (teardown): the results and "
                 "checkpoints written before it are good. Make the exit clean: jobs hpcmem renders start a script "
                 "through toolkit/runtime/run_script.py, which after a normal exit waits for every rank, destroys the "
                 "process group and, if backend threads are still alive, exits without interpreter shutdown "
                 "(docs/triage.md); elsewhere call torch.distributed.destroy_process_group() at the end of the "
                 "script and let DeepSpeed/NCCL threads stop before the interpreter exits (an exit through "
                 "os._exit(0) after the last write is a workaround); resubmitting only repeats the training."),
    "segfault": ("A segmentation fault (SIGSEGV) in native code: rerun with PYTHONFAULTHANDLER=1 (and "
                 "CUDA_LAUNCH_BLOCKING=1) to see where; often mismatched builds (torch, CUDA, NCCL, extensions) or a "
                 "DataLoader worker with too little /dev/shm."),
    "nan": ("The loss or a gradient became NaN/Inf: lower the learning rate or add warm-up, clip gradients, use bf16 "
            "instead of fp16 (or a loss scaler), and check the input data for NaN/Inf."),
    "cudnn_not_supported": ("cuDNN does not support this input or configuration (CUDNN_STATUS_NOT_SUPPORTED): make "
                            "the input contiguous, check its shape and dtype, or disable cuDNN for it "
                            "(torch.backends.cudnn.enabled = False) to confirm."),
    "nccl_shm_permission": ("NCCL could not create its shared-memory segment (permission denied): /dev/shm is not "
                            "writable for the job (container or node setting); fix its mode or set "
                            "NCCL_SHM_DISABLE=1."),
    "nccl_shm_attach": ("NCCL could not attach to a peer's shared-memory segment: the processes do not share "
                        "/dev/shm (separate containers or IPC namespaces) or one removed it; share it, or set "
                        "NCCL_SHM_DISABLE=1."),
    "nccl_shm_register": ("NCCL could not register its /dev/shm segment with CUDA (cudaHostRegister failed, not for "
                          "lack of memory): often a container or driver that refuses host registration; set "
                          "NCCL_SHM_DISABLE=1, or check the driver and the container's /dev/shm mount."),
    "child_failed_bare": ("The first rank to fail left no error in this log: read that rank's own output (torchrun "
                          "--tee 3, or @record on the entry point) and sacct MaxRSS for a memory kill."),
    "nccl_peer": ("NCCL lost a peer: find the first rank to fail (its own log; an OOM or a SIGKILL there is the "
                  "cause, sacct MaxRSS/State per node), and if every rank was alive, the network (NCCL_DEBUG=INFO, "
                  "NCCL_SOCKET_IFNAME / NCCL_IB_HCA)."),
    "sigabrt_no_context": ("A process aborted (SIGABRT) with nothing before it saying why: read the rank's own log and "
                           "any core dump; if it came after the final metrics, it is a teardown crash."),
}
_BY_STATE = {"TIMEOUT": TIME_LIMIT, "CANCELLED": CANCELLED, "PREEMPTED": PREEMPTED, "NODE_FAIL": NODE_FAIL,
             "BOOT_FAIL": NODE_FAIL}


def where_to_look(verdict: Verdict, state: str | None = None) -> list[str]:
    """For a failure that is not an OOM: what it is likely to be and where to look (sentences; [] for an OOM,
    which gets remedies instead). Read from the classifier's named cause (the verdict's reason), then the
    scheduler's ``state``; at most two sentences, the cause's first."""
    if verdict.is_oom:
        return []
    reason = verdict.reason.lower()
    cause = getattr(verdict, "cause", None)
    found = [_BY_CAUSE[cause]] if cause in _BY_CAUSE else []
    found += [advice for pattern, advice in _WHERE if re.search(pattern, reason) and advice not in found]
    if state in _BY_STATE and _BY_STATE[state] not in found:
        found.append(_BY_STATE[state])
    if found:
        return found[:2]
    if verdict.kind == "not_oom":
        return ["An error in the program: read the traceback that ends at the evidence line, on the rank that failed "
                "first."]
    return ["No failure signature was found: read the end of every rank's log and `sacct -j JOBID -o "
            "JobID,State,ExitCode,MaxRSS,ReqMem,Elapsed`."]
