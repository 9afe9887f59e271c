"""The checkpoint directory (toolkit/runtime/checkpoint.py): atomic saves, the newest complete one, partial and
damaged saves skipped (never deleted), which layouts read which saves, the save policy; one real resume."""

import json
import os
from pathlib import Path

import pytest

from toolkit.render import checkpoint_dir
from toolkit.runtime import checkpoint as ck


def save(root: Path, step: int, payload: bytes = b"weights", full: bool = True, **meta) -> ck.Saved:
    """A save whose files are ``state.pt`` (``full``) and ``sub/shard-0``."""
    tmp = ck.begin(root, step)
    if full:
        (tmp / "state.pt").write_bytes(payload)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "shard-0").write_bytes(payload * 2)
    return ck.commit(tmp, step, {"format": ck.FORMAT_FULL, **meta})


def test_a_save_is_renamed_into_place_with_its_marker(tmp_path):
    saved = save(tmp_path, 12)
    assert saved.path == tmp_path / "step-00000012" and saved.step == 12
    marker = json.loads((saved.path / ck.MARKER).read_text())
    assert marker["files"] == {"state.pt": 7, "sub/shard-0": 14} and marker["step"] == 12
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(ck.PARTIAL)]


def test_newest_complete_save_wins(tmp_path):
    for step in (2, 10, 4):
        save(tmp_path, step)
    assert [s.step for s in ck.candidates(tmp_path)] == [10, 4, 2]
    assert ck.newest(tmp_path).step == 10


def test_a_partial_save_is_skipped_with_a_warning_and_kept(tmp_path, capsys):
    save(tmp_path, 2)
    tmp = ck.begin(tmp_path, 4)  # a job killed while writing step 4
    (tmp / "state.pt").write_bytes(b"half")
    unmarked = tmp_path / "step-00000006"  # a step directory without its marker
    unmarked.mkdir()
    assert ck.newest(tmp_path).step == 2
    err = capsys.readouterr().err
    assert "partial" in err and str(tmp) in err and "step-00000006" in err
    assert tmp.exists() and unmarked.exists()


@pytest.mark.parametrize("damage", ["truncate", "remove", "marker"])
def test_a_damaged_save_is_skipped_and_the_previous_one_used(tmp_path, capsys, damage):
    save(tmp_path, 2)
    bad = save(tmp_path, 4)
    if damage == "truncate":
        (bad.path / "sub" / "shard-0").write_bytes(b"x")
    elif damage == "remove":
        (bad.path / "state.pt").unlink()
    else:
        (bad.path / ck.MARKER).write_text("{not json")
    assert ck.newest(tmp_path).step == 2
    assert "step-00000004" in capsys.readouterr().err
    assert bad.path.exists()  # never deleted


def test_commit_never_replaces_an_existing_save(tmp_path):
    first = save(tmp_path, 3, b"one")
    tmp = ck.begin(tmp_path, 3)
    (tmp / "state.pt").write_bytes(b"two")
    with pytest.raises(FileExistsError):
        ck.commit(tmp, 3, {"format": ck.FORMAT_FULL})
    assert (first.path / "state.pt").read_bytes() == b"one" and tmp.exists()


def test_no_directory_means_no_saves(tmp_path):
    assert ck.newest(tmp_path / "missing") is None


def test_run_checkpoint_directory_is_shared_by_attempts(tmp_path):
    assert checkpoint_dir(tmp_path / "runs" / "r1" / "attempt-3") == tmp_path / "runs" / "r1" / "checkpoints"
    assert checkpoint_dir(tmp_path / "out") == tmp_path / "out" / "checkpoints"


LAYOUT = {"optimizer": "adamw", "precision": "fp32", "world_size": 2, "zero_stage": 0}


@pytest.mark.parametrize("saved_fmt,now_fmt,ok", [
    (ck.FORMAT_FULL, ck.FORMAT_DCP, True), (ck.FORMAT_DCP, ck.FORMAT_FULL, True),
    (ck.FORMAT_DCP, ck.FORMAT_DCP, True), (ck.FORMAT_FULL, ck.FORMAT_DEEPSPEED, False),
    (ck.FORMAT_DEEPSPEED, ck.FORMAT_DCP, False), (ck.FORMAT_DEEPSPEED, ck.FORMAT_DEEPSPEED, True)])
def test_which_layouts_read_which_saves(saved_fmt, now_fmt, ok):
    why = ck.readable({**LAYOUT, "format": saved_fmt}, {**LAYOUT, "format": now_fmt})
    assert (why is None) == ok


def test_deepspeed_converts_between_zero_1_2_layouts_only_and_torch_formats_anywhere():
    ds = {**LAYOUT, "format": ck.FORMAT_DEEPSPEED, "zero_stage": 2}
    assert "ZeRO-3" in ck.readable(ds, {**ds, "zero_stage": 3})
    assert ck.readable(ds, {**ds, "world_size": 4}) is None and ck.readable(ds, {**ds, "zero_stage": 1}) is None
    assert ck.readable({**ds, "zero_stage": 3}, {**ds, "zero_stage": 3}) is None
    assert "ZeRO-3" in ck.readable({**ds, "zero_stage": 3}, {**ds, "zero_stage": 3, "world_size": 4})
    full = {**LAYOUT, "format": ck.FORMAT_FULL}
    assert ck.readable(full, {**full, "world_size": 4, "format": ck.FORMAT_DCP}) is None
    assert "optimizer" in ck.readable(full, {**full, "optimizer": "sgd"})


def test_choose_passes_over_unreadable_saves_saying_why(tmp_path):
    save(tmp_path, 2, layout={**LAYOUT, "format": ck.FORMAT_FULL})
    save(tmp_path, 4, full=False, format=ck.FORMAT_DEEPSPEED, layout={**LAYOUT, "format": ck.FORMAT_DEEPSPEED})
    saved, passed = ck.choose(ck.candidates(tmp_path), {**LAYOUT, "format": ck.FORMAT_DCP}, report=None)
    assert saved.step == 2 and len(passed) == 1 and passed[0].startswith("step 4")
    assert "without a full copy" in passed[0]


def test_a_deepspeed_save_with_its_full_copy_is_read_by_every_layout(tmp_path):
    """The marker's file list says whether a DeepSpeed save carries ``state.pt`` (the layout-free copy)."""
    ds = {**LAYOUT, "format": ck.FORMAT_DEEPSPEED, "zero_stage": 2, "launcher": "deepspeed"}
    save(tmp_path, 2, full=False, format=ck.FORMAT_DEEPSPEED, layout=ds)
    save(tmp_path, 4, format=ck.FORMAT_DEEPSPEED, layout=ds)
    found = ck.candidates(tmp_path)
    assert [ck.has_full_copy(s) for s in found] == [True, False]
    for now in ({**ds, "zero_stage": 3}, {**ds, "zero_stage": 3, "world_size": 4}, {**ds, "zero_stage": 1},
                {**LAYOUT, "format": ck.FORMAT_FULL, "launcher": "torchrun"},
                {**LAYOUT, "format": ck.FORMAT_DCP, "launcher": "fsdp", "world_size": 3}):
        saved, passed = ck.choose(found, now, report=None)
        assert saved.step == 4 and passed == [], now
    # without the copy: ZeRO-3 and DDP pass over it (ZeRO-1/2 still convert through the universal checkpoint)
    saved, passed = ck.choose(found[1:], {**ds, "zero_stage": 3}, report=None)
    assert saved is None and "without a full copy" in passed[0] and "ZeRO-3" in passed[0]
    assert ck.choose(found[1:], {**ds, "world_size": 1}, report=None)[0].step == 2
    # still refused with a full copy: another optimizer, DeepSpeed's ZeRO-0
    assert "optimizer" in ck.readable(ds, {**ds, "zero_stage": 3, "optimizer": "sgd"}, full_copy=True)
    assert ck.readable(ds, {**ds, "zero_stage": 0}, full_copy=True) is not None


def test_ddp_and_fsdp_saves_load_into_zero_1_2_3():
    for saved in ({**LAYOUT, "format": ck.FORMAT_FULL, "launcher": "torchrun"},
                  {**LAYOUT, "format": ck.FORMAT_DCP, "launcher": "fsdp"}):
        for stage in (1, 2, 3):
            now = {**LAYOUT, "format": ck.FORMAT_DEEPSPEED, "zero_stage": stage, "world_size": 1}
            assert ck.readable(saved, now) is None
        assert "ZeRO-1/2/3 only" in ck.readable(saved, {**LAYOUT, "format": ck.FORMAT_DEEPSPEED, "zero_stage": 0})


def test_the_runtime_takes_the_save_request_once(tmp_path, monkeypatch):
    """Rank 0 takes the request file the trap writes (and removes it): the next step saves with reason signal."""
    class Ranks:
        rank, world_size, is_main = 0, 1, True

    monkeypatch.setenv("HPCMEM_ATTEMPT_DIR", str(tmp_path))
    saver = ck.Checkpointer(tmp_path / "checkpoints", ck.Policy(), Ranks(), {})
    assert not saver.take_request()
    (tmp_path / ck.SAVE_REQUEST).write_text("")
    assert saver.take_request() and not (tmp_path / ck.SAVE_REQUEST).exists()
    assert not saver.take_request()
    assert saver.policy.due(3, 0.0, 0.0, requested=True, deadline_saved=False) == "signal"


def test_policy():
    p = ck.Policy(every_steps=5)
    assert [s for s in range(1, 12) if p.due(s, 0, 0, False, False)] == [5, 10]
    timed = ck.Policy(every_s=60)
    assert timed.due(1, 100.0, 50.0, False, False) is None and timed.due(1, 111.0, 50.0, False, False) == "interval"
    limit = ck.Policy(deadline=1000.0, margin_s=30)
    assert limit.due(1, 960.0, 0, False, False) is None
    assert limit.due(1, 975.0, 0, False, False) == "time-limit"
    assert limit.due(1, 975.0, 0, False, True) is None  # saved once for the limit already
    assert limit.due(1, 950.0, 0, False, False, save_cost_s=30) == "time-limit"  # a slow save starts earlier
    assert ck.Policy().due(3, 0, 0, True, False) == "signal"


def test_deadline_and_margin():
    assert ck.job_deadline({"time_min": 2}, env={}, started=100.0) == 220.0
    assert ck.job_deadline({"time_min": 2}, env={"SLURM_JOB_START_TIME": "50"}, started=100.0) == 170.0
    assert ck.job_deadline({"time_min": 2}, env={"SLURM_JOB_END_TIME": "999"}) == 999.0
    assert ck.job_deadline({}, env={}) is None
    assert ck.margin_s(60) == 20 and ck.margin_s(3600) == 300 and ck.margin_s(1200) == 120
    assert ck.margin_s(60, 5) == 5


def test_digest_is_bitwise():
    torch = pytest.importorskip("torch")
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    opt = {"state": {"w": {"exp_avg": torch.ones(3), "step": torch.tensor(1.0)}}}
    same = ck.state_digest(dict(a), opt)
    assert same == ck.state_digest({"b": torch.zeros(2), "w": torch.ones(3)}, opt)
    b = {"w": torch.ones(3), "b": torch.tensor([0.0, 1e-30])}
    assert ck.state_digest(b, opt)["model"] != same["model"]


def test_the_reference_trainer_resumes_where_an_uninterrupted_run_is(tmp_path, monkeypatch):
    """One process: 2 steps then resume to 4 equals 4 steps straight (model, optimizer, RNG, data position)."""
    pytest.importorskip("transformers")
    from toolkit import train

    for name in ("HPCMEM_PLAN", "HPCMEM_ATTEMPT_DIR", "HPCMEM_CHECKPOINT_DIR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    model = str(Path(train.__file__).resolve().parents[1] / "jobs" / "models" / "tiny-gpt2.json")

    def run(ckdir, steps, metrics):
        argv = ["--model", model, "--task", "causal-lm", "--steps", str(steps), "--checkpoint-dir", str(ckdir),
                "--checkpoint-every-steps", "2", "--checkpoint-digest", "--metrics-dir", str(metrics),
                "--set", "seq_len=32", "--set", "micro_batch=2"]
        assert train.main(argv) == 0
        return json.loads((metrics / "metrics.json").read_text())

    first = run(tmp_path / "a", 2, tmp_path / "m1")
    assert first["resumed_from_step"] is None and first["checkpoint"]["step"] == 2
    resumed = run(tmp_path / "a", 4, tmp_path / "m2")
    straight = run(tmp_path / "b", 4, tmp_path / "m3")
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 2
    digest = lambda d, step: json.loads((d / f"step-{step:08d}" / "complete").read_text())["digest"]  # noqa: E731
    assert resumed["resume"]["digest"] == digest(tmp_path / "b", 2)
    assert digest(tmp_path / "a", 4) == digest(tmp_path / "b", 4)


# -- the OOM rehearsal's limits and amounts (toolkit/runtime/oom.py) ----------------------------------------------

def test_cgroup_limit_v2_takes_the_tightest_ancestor(tmp_path):
    from toolkit.runtime.oom import cgroup_limit_bytes

    root = tmp_path / "cg"
    (root / "slurm" / "job_7" / "step_batch").mkdir(parents=True)
    (root / "slurm" / "memory.max").write_text("max\n")
    (root / "slurm" / "job_7" / "memory.max").write_text(f"{2000 * 2**20}\n")
    (root / "slurm" / "job_7" / "step_batch" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/slurm/job_7/step_batch\n")
    assert cgroup_limit_bytes(str(proc), str(root)) == 2000 * 2**20
    proc.write_text("0::/elsewhere\n")
    assert cgroup_limit_bytes(str(proc), str(root)) is None


def test_cgroup_limit_v1(tmp_path):
    from toolkit.runtime.oom import cgroup_limit_bytes

    root = tmp_path / "cg"
    (root / "memory" / "slurm" / "uid_0" / "job_9").mkdir(parents=True)
    (root / "memory" / "slurm" / "uid_0" / "job_9" / "memory.limit_in_bytes").write_text(str(3 * 2**30))
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpuacct,cpu:/slurm/uid_0/job_9\n4:memory:/slurm/uid_0/job_9\n")
    assert cgroup_limit_bytes(str(proc), str(root)) == 3 * 2**30


def test_rehearsal_amounts():
    from toolkit.runtime.oom import MIB, OomRehearsal

    act = OomRehearsal(3, kind="activations", mib=100)
    assert not act.active(2) and act.active(3) and act.active(9)
    assert act.amount(4) == 400 * MIB and act.amount(2) == 200 * MIB  # scales with the micro-batch
    fixed = OomRehearsal(3, kind="fixed", mib=100)
    assert fixed.amount(4) == fixed.amount(1) == 100 * MIB
    only = OomRehearsal(3, rank=1, my_rank=0)
    assert not only.active(5)


def test_hf_resume_checkpoint_skips_a_half_written_one(tmp_path, capsys):
    from toolkit.runtime import hf_resume_checkpoint

    assert hf_resume_checkpoint(tmp_path / "none") is None
    for step, done in ((500, True), (1000, True), (1500, False)):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"w")
        if done:
            (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    assert hf_resume_checkpoint(tmp_path) == str(tmp_path / "checkpoint-1000")
    assert "checkpoint-1500" in capsys.readouterr().err and (tmp_path / "checkpoint-1500").exists()


def test_prune_keeps_the_newest_and_never_partial_or_damaged(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step)
    bad = save(tmp_path, 0)
    (bad.path / "state.pt").unlink()
    partial = ck.begin(tmp_path, 5)
    assert ck.prune(tmp_path, 0) == []
    removed = ck.prune(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step-00000001", "step-00000002"]
    assert [s.step for s in ck.candidates(tmp_path, report=None)] == [4, 3]
    assert bad.path.exists() and partial.exists()
