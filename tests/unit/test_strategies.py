"""toolkit/strategies: the registry and each engine's answers, on literal plans (no torch needed)."""

from dataclasses import fields

import pytest

from toolkit import strategies
from toolkit.errors import PlanError, UnknownNameError
from toolkit.modelshape import ModelShape
from toolkit.models import load_model_config
from toolkit.plan import Plan
from toolkit.strategies.base import _OWN_DEFAULTS

LLAMA = ModelShape.from_config(load_model_config("llama-7b"))


def test_registry_names_the_engines_and_refuses_what_it_does_not_know():
    assert strategies.names() == ("torchrun", "deepspeed", "fsdp")
    assert Plan(launcher="fsdp", gpus_per_node=2, global_batch=16).strategy is strategies.get("fsdp")
    with pytest.raises(UnknownNameError, match="valid: deepspeed, fsdp, torchrun"):
        strategies.get("megatron")
    with pytest.raises(ValueError, match="registered twice"):
        strategies.register(type(strategies.get("fsdp")))


def test_own_knob_defaults_are_the_plans():
    defaults = {f.name: f.default for f in fields(Plan)}
    owned = {k for s in strategies.all_strategies() for k in s.own_knobs}
    assert owned == set(_OWN_DEFAULTS) and all(_OWN_DEFAULTS[k] == defaults[k] for k in owned)


@pytest.mark.parametrize("knobs, message", [
    ({"zero_stage": 2}, "zero_stage=2 needs launcher=deepspeed"),
    ({"reshard_after_forward": False}, "needs launcher=fsdp"),
    ({"launcher": "fsdp", "zero_stage": 3}, "zero_stage=3 needs launcher=deepspeed"),
    ({"launcher": "fsdp", "offload_params": "nvme"}, "FSDP offloads to the CPU only"),
    ({"launcher": "fsdp", "offload_optimizer": "cpu"}, "offload_optimizer=cpu needs launcher=deepspeed"),
    ({"launcher": "torchrun", "offload_params": "cpu"}, "DDP replicates the model"),
    ({"launcher": "deepspeed", "zero_stage": 2, "offload_params": "cpu"}, "offload_params needs zero_stage=3"),
])
def test_each_engine_refuses_what_it_cannot_run(knobs, message):
    with pytest.raises(PlanError, match=message):
        Plan(gpus_per_node=2, global_batch=16, **knobs)


def test_switching_engines_resets_the_others_knobs():
    plan = Plan(launcher="fsdp", gpus_per_node=2, global_batch=16, reshard_after_forward=False)
    moved = plan.replace(**strategies.switch_to("deepspeed"), zero_stage=3)
    assert (moved.launcher, moved.zero_stage, moved.reshard_after_forward) == ("deepspeed", 3, True)
    assert strategies.infer_launcher({"zero_stage": 2}) == "deepspeed"
    assert strategies.infer_launcher({"reshard_after_forward": False}) == "fsdp"
    assert strategies.infer_launcher({"launcher": "fsdp", "offload_params": "cpu"}) == "fsdp"
    assert strategies.infer_launcher({"offload_params": "cpu"}) == "deepspeed"
    assert strategies.infer_launcher({}) == "torchrun"


def test_fsdp_shards_every_model_state_and_keeps_blocks_gathered_only_without_resharding():
    def states(**knobs):
        plan = Plan(launcher="fsdp", gpus_per_node=8, global_batch=8, micro_batch=1, precision="bf16-mixed", **knobs)
        s = plan.strategy
        return s.model_states(LLAMA, plan, s.dtypes(plan, gpu=True))

    psi, n = LLAMA.n_params, 8
    full = states()
    # fp32 sharded weights and grads, AdamW's two fp32 states: 16 bytes per parameter over 8 ranks
    assert full.params_bytes == pytest.approx(4 * psi / n) and full.grads_bytes == pytest.approx(4 * psi / n)
    assert full.optimizer_bytes == pytest.approx(8 * psi / n, rel=1e-3)
    kept = states(reshard_after_forward=False)
    assert kept.gathered_bytes > 10 * full.gathered_bytes  # every block gathered vs two in flight (+ the root)
    assert full.gathered_bytes < 2 * 2 * psi / LLAMA.layers + 2 * (psi - LLAMA.layers * LLAMA.layer_params) + 1
    offload = states(offload_params="cpu")
    assert offload.params_bytes == offload.optimizer_bytes == 0 and offload.host_bytes_per_rank == pytest.approx(
        full.params_bytes + full.grads_bytes + full.optimizer_bytes)


def test_zero_stages_follow_the_paper_and_fsdp_matches_zero3():
    def per_gpu(launcher, **knobs):
        plan = Plan(launcher=launcher, gpus_per_node=8, global_batch=8, micro_batch=1, precision="bf16-mixed", **knobs)
        st = plan.strategy.model_states(LLAMA, plan, plan.strategy.dtypes(plan, gpu=True))
        return (st.params_bytes + st.grads_bytes + st.optimizer_bytes) / LLAMA.n_params

    assert per_gpu("deepspeed", zero_stage=1) == pytest.approx(4 + 12 / 8, rel=1e-3)
    assert per_gpu("deepspeed", zero_stage=2) == pytest.approx(2 + 14 / 8, rel=1e-3)
    assert per_gpu("deepspeed", zero_stage=3) == pytest.approx(16 / 8, rel=1e-3)
    assert per_gpu("fsdp") == pytest.approx(16 / 8, rel=1e-3)
    assert per_gpu("torchrun") > per_gpu("deepspeed", zero_stage=1)


def test_costs_order_the_families_and_configs_carry_the_knobs():
    base = dict(gpus_per_node=2, global_batch=16)
    cost = {name: Plan(**base, **k).strategy.cost(Plan(**base, **k)) for name, k in {
        "ddp": {}, "zero1": {"launcher": "deepspeed", "zero_stage": 1},
        "fsdp-kept": {"launcher": "fsdp", "reshard_after_forward": False}, "fsdp": {"launcher": "fsdp"},
        "zero3-offload": {"launcher": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu"}}.items()}
    assert cost["ddp"] == 1.0 < cost["zero1"] < cost["fsdp-kept"] < cost["fsdp"] < cost["zero3-offload"]
    plan = Plan(launcher="fsdp", precision="fp16-mixed", reduce_dtype="param", checkpointing=True, **base)
    cfg = plan.strategy.config(plan)
    assert cfg["version"] == 2 and cfg["activation_checkpointing"] is True
    assert cfg["mixed_precision_policy"] == {"param_dtype": "float16", "reduce_dtype": "float16"}
    assert Plan(**base).strategy.config(Plan(**base)) is None
