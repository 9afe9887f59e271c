"""The reference trainer's pure parts (flags -> plan, ds_config filling, CPU decisions) and the model configs."""

import json

import pytest

from toolkit import models
from toolkit.runtime import train
from toolkit.strategies.deepspeed import deepspeed_config
from toolkit.errors import ConfigError, HpcmemError, UnknownNameError
from toolkit.plan import Plan
from toolkit.runtime.jobenv import Ranks

BASE = ["--model", "tiny-gpt2", "--task", "causal-lm"]


def _plan(argv, plan=None, ds=None):
    return train.plan_for_args(plan or Plan(), train.parse_args(BASE + argv), ds)


def test_default_plan_follows_the_ranks():
    assert train.default_plan(Ranks()) == Plan()
    plan = train.default_plan(Ranks(rank=0, local_rank=0, world_size=4, local_world_size=2))
    assert (plan.nodes, plan.gpus_per_node, plan.micro_batch, plan.global_batch) == (2, 2, 8, 32)


def test_hf_flags_override_the_plan_literally():
    plan = _plan(["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "3", "--bf16",
                  "--gradient_checkpointing", "--optim", "adamw_bnb_8bit"], plan=Plan(gpus_per_node=2, global_batch=16))
    assert (plan.micro_batch, plan.grad_accum, plan.global_batch) == (2, 3, 12)
    assert (plan.precision, plan.checkpointing, plan.optimizer) == ("bf16-mixed", True, "adamw-8bit")


def test_hf_bool_flags_take_values():
    assert _plan(["--fp16", "True"]).precision == "fp16-mixed"
    assert _plan(["--gradient_checkpointing", "false"], plan=Plan(checkpointing=True)).checkpointing is False
    with pytest.raises(ConfigError, match="--bf16 and --fp16"):
        _plan(["--bf16", "--fp16"])
    with pytest.raises(SystemExit):
        train.parse_args(BASE + ["--bf16", "maybe"])


@pytest.mark.parametrize("knobs", [
    {},
    {"precision": "bf16-true", "checkpointing": True, "optimizer": "adafactor"},
    {"precision": "fp16-mixed", "optimizer": "adamw-8bit", "micro_batch": 2, "grad_accum": 4},
    {"launcher": "deepspeed", "zero_stage": 3, "precision": "bf16-true", "offload_params": "cpu",
     "offload_optimizer": "cpu", "gpus_per_node": 2, "micro_batch": 2, "grad_accum": 2, "global_batch": 8},
    {"launcher": "deepspeed", "zero_stage": 2, "precision": "fp16-mixed", "optimizer": "sgd"},
])
def test_hf_trainer_flags_rendered_by_hpcmem_give_back_the_plan(knobs):
    # A job spec with plan_args: hf-trainer gets these flags on top of HPCMEM_PLAN: they must agree.
    from toolkit.jobspec import hf_trainer_args

    knobs.setdefault("global_batch", knobs.get("micro_batch", 8) * knobs.get("grad_accum", 1))
    plan = Plan(**knobs)
    ds = deepspeed_config(plan, gpu=False) if plan.launcher == "deepspeed" else None
    args = train.parse_args(BASE + hf_trainer_args(plan, "ds_config.json" if ds else None))
    assert train.plan_for_args(plan, args, ds) == plan


def test_set_keeps_the_global_batch():
    plan = _plan(["--set", "micro_batch=2", "--set", "attention=eager"], plan=Plan(global_batch=8))
    assert (plan.micro_batch, plan.grad_accum, plan.global_batch, plan.attention) == (2, 4, 8, "eager")


def test_deepspeed_config_flag_sets_launcher_and_zero():
    user = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto", "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme"}}}
    plan = _plan(["--deepspeed", "ds.json"], ds=user)
    assert (plan.launcher, plan.zero_stage, plan.offload_params, plan.offload_optimizer) == ("deepspeed", 3, "cpu", "nvme")
    assert (plan.micro_batch, plan.precision) == (4, "bf16-mixed")


def test_fill_ds_config_takes_batches_from_the_plan_and_resolves_auto():
    plan = Plan(launcher="deepspeed", zero_stage=2, gpus_per_node=2, micro_batch=2, grad_accum=2, global_batch=8,
                precision="bf16-mixed")
    user = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 9,
            "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    cfg = train.fill_ds_config(user, plan, lr=3e-4)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (8, 2, 2)
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["fp16"]["enabled"] is False and cfg["bf16"]["enabled"] is True
    assert cfg["optimizer"]["params"] == {"lr": 3e-4, "weight_decay": 0.0}
    assert user["train_batch_size"] == "auto"  # the caller's dict is not changed


def test_fill_ds_config_keeps_hpcmem_configs():
    plan = Plan(launcher="deepspeed", zero_stage=3, offload_optimizer="cpu", offload_params="cpu", precision="fp16-mixed")
    cfg = deepspeed_config(plan, gpu=False)
    filled = train.fill_ds_config(cfg, plan)
    assert filled == cfg


def test_fill_ds_config_switches_precision_to_the_plans():
    user = {"fp16": {"enabled": True, "loss_scale": 0}, "bfloat16": {"enabled": False}}
    cfg = train.fill_ds_config(user, Plan(launcher="deepspeed", precision="bf16-mixed"))
    assert cfg["fp16"] == {"enabled": False, "loss_scale": 0}
    assert cfg["bf16"] == {"enabled": True} and "bfloat16" not in cfg
    assert train.fill_ds_config(user, Plan(launcher="deepspeed"))["fp16"]["enabled"] is False


def test_choose_attention():
    assert train.choose_attention("sdpa", "cpu", False) == ("sdpa", None)
    assert train.choose_attention("eager", "cuda", False) == ("eager", None)
    impl, why = train.choose_attention("flash", "cpu", True)
    assert impl == "sdpa" and "CUDA" in why
    assert train.choose_attention("flash", "cuda", True) == ("flash_attention_2", None)
    with pytest.raises(HpcmemError, match="flash-attn"):
        train.choose_attention("flash", "cuda", False)


def test_choose_precision_takes_the_nearest_the_engine_runs():
    engine = "DeepSpeed's cpu accelerator"
    assert train.choose_precision("fp16-mixed", True, True, engine) == ("fp16-mixed", None)
    assert train.choose_precision("fp32", False, False, engine) == ("fp32", None)
    precision, why = train.choose_precision("fp16-mixed", False, True, engine)
    assert precision == "bf16-mixed" and why == f"{engine} has no fp16 on this device; ran bf16-mixed instead of fp16-mixed"
    assert train.choose_precision("fp16-mixed", False, False, engine)[0] == "fp32"
    assert train.choose_precision("bf16-true", True, False, engine)[0] == "fp16-mixed"
    assert train.choose_precision("bf16-mixed", False, False, engine)[0] == "fp32"


def test_local_rank_argument_of_the_deepspeed_launcher_is_accepted():
    assert train.parse_args(["--local_rank=1"] + BASE).local_rank == 1


# -- models ------------------------------------------------------------------------

def test_model_config_by_name_path_and_directory(tmp_path):
    by_name = models.load_model_config("tiny-gpt2")
    assert by_name["model_type"] == "gpt2"
    path = models.models_dir() / "tiny-bert.json"
    assert models.load_model_config(str(path))["model_type"] == "bert"
    (tmp_path / "config.json").write_text(json.dumps(by_name))
    assert models.load_model_config(str(tmp_path)) == by_name


def test_unknown_model_lists_the_shipped_ones(tmp_path):
    with pytest.raises(UnknownNameError, match="tiny-gpt2"):
        models.load_model_config("no-such-model-anywhere")
    with pytest.raises(ConfigError, match="does not exist"):
        models.load_model_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ConfigError, match="model_type"):
        models.load_model_config(str(tmp_path / "bad.json"))


# name -> (task, parameters in millions, tolerance)
SHIPPED = {
    "tiny-gpt2": ("causal-lm", 1.0, 0.5),
    "tiny-bert": ("seq-cls", 1.0, 0.5),
    "gpt2": ("causal-lm", 124.4, 0.5),
    "bert-large": ("seq-cls", 335.1, 1.0),
    "llama-7b": ("causal-lm", 6738.4, 5.0),
    "tiny-vit": ("image-cls", 0.11, 0.01),
    "vit-base": ("image-cls", 86.6, 0.1),
}


def test_every_shipped_model_is_tested():
    assert set(models.shipped_models()) == set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_model_builds_with_the_expected_size(name):
    torch = pytest.importorskip("torch")
    task, millions, tol = SHIPPED[name]
    config = models.transformers_config(models.load_model_config(name), task)
    with torch.device("meta"):  # shapes only: a 7B model costs no memory here
        model = models.build_model(config, task, "sdpa")
    assert models.count_parameters(model) / 1e6 == pytest.approx(millions, abs=tol)
    assert model.config._attn_implementation == "sdpa"
    if task == "image-cls":
        assert type(model).__name__ == "ViTForImageClassification"


def test_llama_7b_has_the_llama2_shape():
    cfg = models.load_model_config("llama-7b")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["intermediate_size"],
            cfg["vocab_size"]) == (4096, 32, 32, 11008, 32000)


def test_seq_cls_config_gets_a_pad_token():
    cfg = dict(models.load_model_config("tiny-gpt2"))
    cfg.pop("pad_token_id")
    config = models.transformers_config(cfg, "seq-cls")
    assert config.pad_token_id is not None and config.num_labels == 2
    with pytest.raises(ConfigError, match="task"):
        models.transformers_config(cfg, "translation")


# -- image classification (a ViT) -------------------------------------------------------

def test_image_cls_is_a_task_and_fits_only_image_models():
    assert train.parse_args(["--model", "tiny-vit", "--task", "image-cls"]).task == "image-cls"
    config = models.transformers_config(models.load_model_config("vit-base"), "image-cls")
    assert models.image_input_shape(config) == (3, 224, 224) and config.num_labels == 1000
    for name, task in (("tiny-vit", "causal-lm"), ("tiny-vit", "seq-cls"), ("tiny-gpt2", "image-cls")):
        with pytest.raises(ConfigError, match=f"task {task} does not fit") as err:
            models.transformers_config(models.load_model_config(name), task)
        assert "\n" not in str(err.value)


def test_synthetic_image_batches_follow_the_config():
    torch = pytest.importorskip("torch")
    config = models.transformers_config({**models.load_model_config("tiny-vit"), "image_size": [32, 48],
                                         "num_channels": 1}, "image-cls")
    batches = train.SyntheticBatches(config, "image-cls", micro_batch=5, seq_len=4096, device=torch.device("cpu"),
                                     seed=0)
    batch = batches.next()
    assert set(batch) == {"pixel_values", "labels"}
    assert batch["pixel_values"].shape == (5, 1, 32, 48) and batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].dtype == torch.int64 and 0 <= int(batch["labels"].min()) <= int(batch["labels"].max()) < 10
    assert not torch.equal(batch["pixel_values"], batches.next()["pixel_values"])


def _run_trainer(tmp_path, *args, env_extra=None):
    """python -m toolkit.train outside hpcmem (no HPCMEM_PLAN), one process on the CPU; its metrics.json."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPCMEM_", "SLURM_"))}
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", **(env_extra or {}),
                "PYTHONPATH": os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)})
    result = subprocess.run([sys.executable, "-m", "toolkit.train", "--model", "tiny-vit", "--task", "image-cls",
                             "--metrics-dir", str(tmp_path), *args], cwd=repo, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((tmp_path / "metrics.json").read_text()), result.stdout


@pytest.mark.parametrize("sets", [
    ["precision=bf16-mixed", "checkpointing=true", "attention=eager", "micro_batch=4", "optimizer=adafactor"],
    ["launcher=deepspeed", "zero_stage=3", "precision=bf16-mixed", "micro_batch=4"],
], ids=["torch-bf16-ckpt-eager-accum", "deepspeed-zero3"])
def test_the_trainer_trains_a_vit_on_synthetic_images(tmp_path, sets):
    import math

    metrics, stdout = _run_trainer(tmp_path, "--steps", "3", *[a for s in sets for a in ("--set", s)])
    assert metrics["status"] == "ok" and metrics["steps"] == 3 and metrics["device"] == "cpu"
    assert math.isfinite(metrics["loss"]) and metrics["samples_per_s"] > 0
    plan = metrics["plan"]
    for knob, value in (s.split("=") for s in sets):
        assert str(plan[knob]).lower() == value
    assert plan["micro_batch"] * plan["grad_accum"] == plan["global_batch"] == 8  # the default plan's global batch
    assert metrics["applied"]["seq_len"] == 17 and "patches" in metrics["applied"]["reasons"]["seq_len"]
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and "image 3x32x32 (17 tokens: patches + CLS)" in stdout
