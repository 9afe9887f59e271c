"""What ``hpcmem runs`` prints under an attempt about resume and in-job moves (runs.resume_lines), on literal
attempt views as ``runs.run_view`` gives them."""

from toolkit import runs


def test_resume_and_in_job_moves_are_shown():
    attempt = {"resumed_from_step": 4, "checkpoint": {"path": "/h/runs/r/checkpoints/step-00000006", "step": 6},
               "inflight_moves": [{"step": 3, "verdict": {"kind": "gpu_oom", "reason": "CUDA out of memory"},
                                   "from": {"micro_batch": 8, "grad_accum": 1, "checkpointing": False},
                                   "to": {"micro_batch": 4, "grad_accum": 2, "checkpointing": False}}]}
    assert runs.resume_lines(attempt) == [
        "resumed from step 4",
        "last checkpoint: step 6 /h/runs/r/checkpoints/step-00000006",
        "in-job move at step 3 [gpu_oom]: micro_batch 8 -> 4, grad_accum 1 -> 2",
    ]


def test_a_fresh_attempt_without_saves_prints_nothing_and_odd_records_are_skipped():
    assert runs.resume_lines({"resumed_from_step": None, "checkpoint": None, "inflight_moves": None}) == []
    assert runs.resume_lines({"checkpoint": "step-1", "inflight_moves": ["garbage", 3]}) == []
