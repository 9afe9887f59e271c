"""The results store's columns: one row per benchmark cell per night.

This is the contract between ``bench collect`` (which writes rows) and ``bench report``
(which reads them). Memory in MiB, time in seconds, rates in samples per second.
A value that was not measured is None (NaN in a DataFrame), never 0.
"""

from __future__ import annotations

KEY = ("night", "site", "partition", "model", "technique", "matrix")
"""A row's identity: one cell of one matrix on one night. A second collect of the same cell adds nothing;
two matrices running the same model and technique on one partition and night are two rows."""

COLUMNS = (
    # identity
    "night",                 # str YYYY-MM-DD: the night the cell was submitted (local date of `bench run`)
    "site", "partition", "model", "technique",
    "matrix",                # str: matrix name (jobs/nightly/<name>.yaml)
    # the plan the cell ran (fixed, no retry)
    "plan_json",             # str: Plan.to_dict() as JSON
    "launcher", "precision", "optimizer", "attention", "offload_optimizer", "offload_params",  # str
    "micro_batch", "grad_accum", "world_size", "seq_len", "zero_stage",                      # int
    "checkpointing",         # bool
    # software and hardware
    "torch", "deepspeed", "transformers", "cuda", "driver", "hpcmem",  # str versions or None
    "gpu_name",              # str or None (None on CPU)
    # measured (metrics.json)
    "peak_allocated_mib", "peak_reserved_mib", "device_used_mib", "peak_rss_mib",  # float or None
    "samples_per_s", "step_time_s",                                                # float or None
    "steps",                 # int or None: steps finished
    "status",                # str: "ok" | "failed" | "missing" (no metrics.json) | "incomplete" | "skipped"
    "verdict",               # str: classifier kind for failed cells ("" when ok)
    "error",                 # str: first error line, or why the cell was skipped ("" when ok)
    # predicted (estimator, analytic, for the same plan and partition)
    "predicted_peak_mib", "predicted_device_mib", "predicted_host_mib",  # float or None
    # bookkeeping
    "job_id", "run_id",      # str
    "collected_at",          # float: unix time of the collect that wrote the row
)

NUMERIC = ("micro_batch", "grad_accum", "world_size", "seq_len", "zero_stage", "peak_allocated_mib",
           "peak_reserved_mib", "device_used_mib", "peak_rss_mib", "samples_per_s", "step_time_s", "steps",
           "predicted_peak_mib", "predicted_device_mib", "predicted_host_mib", "collected_at")

STATUSES = ("ok", "failed", "missing", "incomplete", "skipped")
"""``skipped``: the technique cannot run on the partition (the manifest's reason is the row's ``error``);
never a failure, never a regression, never a baseline."""

FAILED_STATUSES = ("failed", "missing", "incomplete")
"""What counts as a cell that did not work (``skipped`` does not)."""
