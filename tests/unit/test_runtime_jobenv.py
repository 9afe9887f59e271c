"""toolkit.runtime.jobenv: what a job reads from its environment."""

import json

import pytest

from toolkit.errors import ConfigError, HpcmemError, PlanError
from toolkit.plan import Plan
from toolkit.runtime import jobenv


def test_load_plan_reads_the_file_named_by_hpcmem_plan(tmp_path):
    plan = Plan(gpus_per_node=2, micro_batch=4, grad_accum=2, global_batch=16, precision="bf16-mixed")
    (tmp_path / "plan.json").write_text(plan.to_json())
    assert jobenv.load_plan({"HPCMEM_PLAN": str(tmp_path / "plan.json")}) == plan


def test_load_plan_without_the_variable_says_which_one():
    with pytest.raises(HpcmemError, match="HPCMEM_PLAN is not set"):
        jobenv.load_plan({})


def test_load_plan_with_a_missing_file_names_it(tmp_path):
    with pytest.raises(HpcmemError, match="does not exist"):
        jobenv.load_plan({"HPCMEM_PLAN": str(tmp_path / "nope.json")})


def test_load_plan_refuses_broken_json_and_bad_knobs(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        jobenv.load_plan({"HPCMEM_PLAN": str(path)})
    path.write_text(json.dumps({"micro_batch": 3, "global_batch": 8}))
    with pytest.raises(PlanError, match="global_batch"):
        jobenv.load_plan({"HPCMEM_PLAN": str(path)})


def test_attempt_dir_and_ds_config(tmp_path):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    (tmp_path / "ds_config.json").write_text(json.dumps(cfg))
    env = {"HPCMEM_ATTEMPT_DIR": str(tmp_path), "HPCMEM_DS_CONFIG": str(tmp_path / "ds_config.json")}
    assert jobenv.attempt_dir(env) == tmp_path
    assert jobenv.ds_config(env) == cfg
    assert jobenv.attempt_dir({}, required=False) is None
    with pytest.raises(HpcmemError, match="HPCMEM_ATTEMPT_DIR"):
        jobenv.attempt_dir({})
    with pytest.raises(HpcmemError, match="HPCMEM_DS_CONFIG"):
        jobenv.ds_config({})


def test_ranks_from_launcher_variables():
    assert jobenv.ranks({}) == jobenv.Ranks(0, 0, 1, 1)
    r = jobenv.ranks({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (r.rank, r.local_rank, r.world_size, r.nodes, r.is_main) == (5, 1, 8, 2, False)
    with pytest.raises(HpcmemError, match="RANK"):
        jobenv.ranks({"RANK": "x"})


@pytest.mark.parametrize("cap, total_gib, expected", [
    (None, 80, None),        # no cap
    (16, 80, 0.2),           # an 80 GB card plays a 16 GB one
    (40, 80, 0.5),
    (80, 80, None),          # the card is not larger: nothing to do
    (32, 16, None),
])
def test_memory_fraction(cap, total_gib, expected):
    got = jobenv.memory_fraction(cap, total_gib * 2**30)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_gpu_mem_cap_parsing():
    assert jobenv.gpu_mem_cap_gib({}) is None
    assert jobenv.gpu_mem_cap_gib({"HPCMEM_GPU_MEM_GIB": "32"}) == 32.0
    for bad in ("lots", "-4", "0"):
        with pytest.raises(HpcmemError, match="HPCMEM_GPU_MEM_GIB"):
            jobenv.gpu_mem_cap_gib({"HPCMEM_GPU_MEM_GIB": bad})


def test_gpu_memory_cap_is_a_no_op_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without a GPU")
    assert jobenv.apply_gpu_memory_cap(env={"HPCMEM_GPU_MEM_GIB": "16"}) is None
