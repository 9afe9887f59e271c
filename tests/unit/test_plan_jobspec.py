"""Plans and job specs: the batch invariant, --set, every shipped spec loads, broken ones fail clearly."""

import json
import textwrap

import pytest

from toolkit import jobspec, sites
from toolkit.errors import ConfigError, PlanError, UnknownNameError
from toolkit.plan import KNOBS, Plan, parse_sets, with_changes
from toolkit.resources import data_dir

A100 = sites.load_site("example-hpc").partition("a100-40gb")
V100 = sites.load_site("example-hpc").partition("v100-16gb")


def test_knob_names_are_the_documented_ones():
    documented = {"launcher", "nodes", "gpus_per_node", "global_batch", "micro_batch", "grad_accum", "seq_len",
                  "precision", "optimizer", "checkpointing", "attention", "zero_stage", "offload_optimizer",
                  "offload_params"}
    assert documented <= set(KNOBS)
    assert Plan().to_dict()["world_size"] == 1


def test_batch_invariant():
    Plan(nodes=2, gpus_per_node=4, global_batch=64, micro_batch=4, grad_accum=2)
    with pytest.raises(PlanError, match="not global_batch 64"):
        Plan(nodes=2, gpus_per_node=4, global_batch=64, micro_batch=4, grad_accum=1)


@pytest.mark.parametrize("kwargs, needle", [
    ({"precision": "fp8"}, "precision must be one of"),
    ({"zero_stage": 4}, "zero_stage"),
    ({"zero_stage": 2}, "launcher=deepspeed"),
    ({"launcher": "deepspeed", "offload_params": "cpu", "zero_stage": 2}, "offload_params needs zero_stage=3"),
    ({"launcher": "deepspeed", "offload_optimizer": "nvme", "zero_stage": 2}, "ZeRO-Infinity"),
    ({"launcher": "deepspeed", "offload_optimizer": "cpu"}, "zero_stage >= 1"),
    ({"micro_batch": 0}, "at least 1"),
])
def test_impossible_plans(kwargs, needle):
    with pytest.raises(PlanError, match=needle):
        Plan(**kwargs)


def test_plan_json_round_trip():
    plan = Plan(launcher="deepspeed", zero_stage=3, offload_params="nvme", offload_optimizer="cpu",
                gpus_per_node=4, global_batch=32, micro_batch=2, grad_accum=4, checkpointing=True)
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    with pytest.raises(PlanError, match="world_size"):
        Plan.from_dict({**plan.to_dict(), "world_size": 3})
    with pytest.raises(UnknownNameError, match="microbatch"):
        Plan.from_dict({"microbatch": 3})


def test_set_parsing_types_and_errors():
    assert parse_sets(["micro_batch=4", "checkpointing=true", "precision=fp16-mixed", "mem_mib=none"]) == {
        "micro_batch": 4, "checkpointing": True, "precision": "fp16-mixed", "mem_mib": None}
    with pytest.raises(UnknownNameError, match="valid: .*micro_batch"):
        parse_sets(["microbatch=4"])
    with pytest.raises(PlanError, match="expected an integer"):
        parse_sets(["micro_batch=four"])
    with pytest.raises(PlanError, match="knob=value"):
        parse_sets(["micro_batch"])


def test_changing_micro_batch_keeps_the_global_batch():
    plan = Plan(gpus_per_node=4, global_batch=64, micro_batch=16, grad_accum=1)
    smaller = with_changes(plan, {"micro_batch": 4})
    assert (smaller.micro_batch, smaller.grad_accum, smaller.global_batch) == (4, 4, 64)
    fewer = with_changes(plan, {"gpus_per_node": 2})
    assert fewer.grad_accum == 2 and fewer.global_batch == 64
    with pytest.raises(PlanError):
        with_changes(plan, {"micro_batch": 5})


@pytest.mark.parametrize("path", sorted(data_dir("jobs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_spec_loads_and_plans(path):
    spec = jobspec.load_spec(path)
    part = V100 if spec.training.get("precision", "fp32") in ("fp32", "fp16-mixed") else A100
    plan = spec.first_plan(part)
    assert plan.micro_batch * plan.grad_accum * plan.world_size == plan.global_batch
    argv = spec.argv(plan, {"plan_json": "/p.json", "ds_config": "/d.json", "attempt_dir": "/a"})
    assert "{" not in " ".join(argv)


def test_the_four_required_specs_exist():
    names = {p.stem for p in data_dir("jobs").glob("*.yaml")}
    assert {"quickstart", "bert-large-cls", "gpt2-clm", "llama-7b-zero3-nvme"} <= names
    big = jobspec.load_spec("llama-7b-zero3-nvme")
    plan = big.first_plan(A100)
    assert (plan.launcher, plan.zero_stage, plan.offload_params) == ("deepspeed", 3, "nvme")


def test_bf16_on_v100_is_refused():
    with pytest.raises(PlanError, match="no bf16"):
        jobspec.load_spec("gpt2-clm").first_plan(V100)
    assert jobspec.load_spec("gpt2-clm").first_plan(V100, {"precision": "fp16-mixed"}).precision == "fp16-mixed"


def test_hf_trainer_args_follow_the_plan():
    spec = jobspec.load_spec("bert-large-cls")
    plan = spec.first_plan(V100, {"micro_batch": 4, "checkpointing": True})
    paths = {"plan_json": "/p", "config": "/d.json", "attempt_dir": "/a"}
    argv = spec.argv(plan, {**paths, "config": ""})
    joined = " ".join(argv)
    assert "--per_device_train_batch_size 4 --gradient_accumulation_steps 4" in joined
    assert "--gradient_checkpointing" in argv and "--fp16" in argv and "--deepspeed" not in argv
    assert argv[argv.index("--optim") + 1] == "adamw_torch"
    ds = spec.first_plan(V100, {"launcher": "deepspeed", "zero_stage": 2})
    assert spec.argv(ds, paths)[-2:] == ["--deepspeed", "/d.json"]
    # FSDP: the engine's own flags, and checkpointing through its config instead of the Trainer's flag
    fsdp = spec.argv(spec.first_plan(V100, {"launcher": "fsdp", "checkpointing": True, "offload_params": "cpu",
                                            "reshard_after_forward": False}), paths)
    assert fsdp[-4:] == ["--fsdp", "shard_grad_op auto_wrap offload", "--fsdp_config", "/d.json"]
    assert "--gradient_checkpointing" not in fsdp


SPEC = textwrap.dedent("""\
    name: t
    command:
      module: toolkit.train
      args: ["--mb", "{micro_batch}"]
    gpus_per_node: 2
    training:
      global_batch: 16
      micro_batch: 4
    """)


@pytest.mark.parametrize("text, needle", [
    (SPEC.replace("global_batch: 16", "global_batch: 15"), "not a multiple"),
    (SPEC.replace("{micro_batch}", "{microbatch}"), "unknown placeholder {microbatch}"),
    (SPEC.replace("  micro_batch: 4", "  micro_batch: 4\n  precison: fp32"), "training.precison: unknown key"),
    (SPEC.replace("  module: toolkit.train\n", ""), "exactly one of module or script"),
    (SPEC.replace("global_batch: 16", "global_batch: many"), "training.global_batch: expected integer"),
])
def test_broken_specs_name_the_culprit(tmp_path, text, needle):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        jobspec.load_spec(path).first_plan(A100)
    assert needle in str(err.value) and str(path) in str(err.value)


def test_spec_by_name_and_missing(tmp_path):
    assert jobspec.find_spec("quickstart").name == "quickstart.yaml"
    with pytest.raises(UnknownNameError, match="quickstart"):
        jobspec.find_spec("nosuch")
    with pytest.raises(ConfigError, match="no such job spec file"):
        jobspec.find_spec(str(tmp_path / "missing.yaml"))


def test_the_spec_schema_lists_what_the_code_accepts():
    """jobs/schema.json's choices are the code's tables (plan.CHOICES, ladder.ALLOW_NAMES): one home, kept in sync."""
    import json

    from toolkit.ladder import ALLOW_NAMES
    from toolkit.plan import CHOICES
    from toolkit.resources import data_dir

    schema = json.loads((data_dir("jobs") / "schema.json").read_text())
    props, training = schema["properties"], schema["properties"]["training"]["properties"]
    assert props["launcher"]["enum"] == list(CHOICES["launcher"])
    for knob in ("precision", "optimizer", "attention", "offload_optimizer", "offload_params", "reduce_dtype"):
        assert training[knob]["enum"] == list(CHOICES[knob]), knob
    assert props["retry"]["properties"]["allow"]["items"]["enum"] == list(ALLOW_NAMES)
    assert set(jobspec.DEFAULT_ALLOW) <= set(ALLOW_NAMES)
