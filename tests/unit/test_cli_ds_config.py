"""hpcmem estimate --ds-config: the job's own DeepSpeed config sets the plan and the ZeRO buckets."""

import json

import pytest

from hpcmem_cli import run_cli

WHERE = ("--site", "example-hpc", "--partition", "a100-40gb", "--gpus-per-node", "2")
MIB = 2 ** 20


def estimate(tmp_path, cfg, *args, check=True):
    path = tmp_path / "ds_config.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return run_cli("estimate", "--model", "gpt2", "--seq-len", "256", *WHERE, "--ds-config", path, *args,
                   home=tmp_path, check=check)


def test_the_ds_config_sets_the_plan_and_its_bucket_size_the_buffers(tmp_path):
    zero = {"stage": 3, "contiguous_gradients": True, "overlap_comm": True}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
           "zero_optimization": {**zero, "reduce_bucket_size": 2e8}}
    small = json.loads(estimate(tmp_path, cfg, "--json").stdout)
    assert {k: small["plan"][k] for k in ("launcher", "zero_stage", "precision", "micro_batch", "grad_accum")} == {
        "launcher": "deepspeed", "zero_stage": 3, "precision": "bf16-mixed", "micro_batch": 2, "grad_accum": 4}
    # DeepSpeed's own default bucket (5e8 elements, left out of the file): ZeRO-3 keeps one 16-bit bucket
    default = json.loads(estimate(tmp_path, {**cfg, "zero_optimization": zero}, "--json").stdout)
    assert default["peak_allocated_mib"] - small["peak_allocated_mib"] == pytest.approx(2 * 3e8 / MIB, abs=0.01)


@pytest.mark.parametrize("cfg, words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    pytest.param("[" * 200_000, "nested too deeply", id="deeply-nested"),
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage: expected 0, 1, 2 or 3, got 5"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}, "zero_optimization.offload_optimizer: expected an object"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}, "zero_optimization.reduce_bucket_size: expected a positive"),
])
def test_a_bad_ds_config_is_one_line_naming_the_field(tmp_path, cfg, words):
    r = estimate(tmp_path, cfg, check=False)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
