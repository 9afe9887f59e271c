"""Rendering: scripts parse with bash -n for every launcher x ZeRO x offload, hostile values stay quoted,
the DeepSpeed config is right field by field."""

import json
import re
import shlex
import subprocess
import textwrap
from pathlib import Path

import pytest

from toolkit import jobspec, render, sites
from toolkit.strategies.deepspeed import deepspeed_config
from toolkit.errors import RenderError
from toolkit.plan import Plan
from toolkit.runtime import checkpoint as ck

TC = sites.load_site("testcluster")
EX = sites.load_site("example-hpc")

COMBOS = [("torchrun", 0, "none", "none")] + [
    ("deepspeed", z, o, p) for z in (1, 2, 3) for o in ("none", "cpu") for p in ("none",)
] + [("deepspeed", 3, "cpu", "cpu"), ("deepspeed", 3, "nvme", "nvme"), ("deepspeed", 3, "cpu", "nvme")]


def plan_for(launcher, zero, opt, params, nodes=1, gpus=2):
    return Plan(launcher=launcher, zero_stage=zero, offload_optimizer=opt, offload_params=params, nodes=nodes,
                gpus_per_node=gpus, global_batch=8 * nodes * gpus, micro_batch=8, grad_accum=1)


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("launcher, zero, opt, params", COMBOS)
def test_every_combination_renders_valid_bash(tmp_path, launcher, zero, opt, params, nodes):
    spec = jobspec.load_spec("quickstart")
    part = EX.partition("a100-40gb")
    plan = plan_for(launcher, zero, opt, params, nodes=nodes)
    attempt = render.render_attempt(spec, part, plan, tmp_path / "a")
    text = attempt.script.read_text()
    subprocess.run(["bash", "-n", str(attempt.script)], check=True)
    assert json.loads(attempt.plan_json.read_text()) == plan.to_dict()
    assert "#SBATCH --gpus-per-node=a100:2" in text and f"#SBATCH --nodes={nodes}" in text
    assert (attempt.config is not None) == (launcher != "torchrun")
    if nodes > 1:
        assert "srun" in text and "--rdzv-backend=c10d" in text
    else:
        assert "torch.distributed.run --standalone --nnodes=1 --nproc-per-node=2" in text


def test_deepspeed_config_field_by_field():
    plan = Plan(launcher="deepspeed", zero_stage=3, offload_optimizer="nvme", offload_params="nvme", gpus_per_node=4,
                global_batch=64, micro_batch=2, grad_accum=8, precision="bf16-mixed", checkpointing=True)
    cfg = deepspeed_config(plan, "/local/nvme", gpu=True, largest_param=32000 * 4096)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (64, 2, 8)
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "nvme" and zero["offload_optimizer"]["nvme_path"] == "/local/nvme"
    assert zero["offload_param"]["device"] == "nvme" and zero["offload_param"]["buffer_size"] == 132_000_000
    assert zero["offload_param"]["pin_memory"] is True
    assert cfg["aio"]["block_size"] == 1048576
    assert cfg["optimizer"]["type"] == "AdamW"
    assert cfg["activation_checkpointing"]["partition_activations"] is True

    fp16 = deepspeed_config(Plan(launcher="deepspeed", zero_stage=1, precision="fp16-mixed"), None, gpu=False)
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0 and "bf16" not in fp16
    assert fp16["zero_optimization"] == {"stage": 1, "contiguous_gradients": True, "overlap_comm": False,
                                         "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000}
    assert "optimizer" not in fp16 and "aio" not in fp16

    cpu = deepspeed_config(Plan(launcher="deepspeed", zero_stage=2, offload_optimizer="cpu", optimizer="adafactor"), None, gpu=False)
    assert cpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert cpu["zero_force_ds_cpu_optimizer"] is False and "optimizer" not in cpu
    assert cpu["zero_allow_untested_optimizer"] is True

    true16 = deepspeed_config(Plan(launcher="deepspeed", zero_stage=2, precision="bf16-true"), None, gpu=False)
    assert true16["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


HOSTILE = 'evil"; touch /tmp/pwned-$USER; echo "$(id)`id` \'x'


def test_hostile_name_path_and_argument_are_quoted(tmp_path):
    (tmp_path / "my job's dir").mkdir()
    spec_path = tmp_path / "my job's dir" / "spec.yaml"
    spec_path.write_text(textwrap.dedent(f"""\
        name: {json.dumps(HOSTILE)}
        command:
          script: "train $(whoami).py"
          args: [{json.dumps(HOSTILE)}, "--out", "{{attempt_dir}}"]
        gpus_per_node: 1
        training: {{global_batch: 4, micro_batch: 4}}
        env: {{MY_VAR: {json.dumps(HOSTILE)}}}
        """))
    (spec_path.parent / "train $(whoami).py").write_text("print('hi')\n")
    spec = jobspec.load_spec(spec_path)
    part = TC.partition("cpu")
    plan = spec.first_plan(part)
    attempt_dir = tmp_path / "runs dir; rm -rf ~" / "attempt-1"
    attempt = render.render_attempt(spec, part, plan, attempt_dir, workdir=tmp_path / "work $(id)")
    text = attempt.script.read_text()
    subprocess.run(["bash", "-n", str(attempt.script)], check=True)
    sbatch_lines = [l for l in text.splitlines() if l.startswith("#SBATCH")]
    name_line = [l for l in sbatch_lines if l.startswith("#SBATCH --job-name=")][0]
    assert re.fullmatch(r"#SBATCH --job-name=evil[A-Za-z0-9._+-]+", name_line)
    # Every line that carries a hostile value carries it as one shell word.
    launch = [l for l in text.splitlines() if "torch.distributed.run" in l][0]
    words = shlex.split(launch)
    assert HOSTILE in words and str(spec_path.parent / "train $(whoami).py") in words
    assert str(attempt_dir.resolve()) in words
    exports = [l for l in text.splitlines() if l.startswith("export MY_VAR=")]
    assert shlex.split(exports[0].split("=", 1)[1]) == [HOSTILE]
    assert not Path("/tmp/pwned-root").exists()


def test_sbatch_values_refuse_newlines_and_quotes():
    with pytest.raises(RenderError):
        render.sbatch_value("a\nb")
    with pytest.raises(RenderError):
        render.sbatch_value('a"b')
    assert render.sbatch_value("gpu_a100") == "gpu_a100"


def test_a_hostile_script_runs_with_its_values_intact(tmp_path):
    """Run the rendered launcher line for real (with a stub python) and check the arguments arrive verbatim."""
    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(textwrap.dedent(f"""\
        name: x
        command:
          module: toolkit.train
          args: [{json.dumps(HOSTILE)}]
        gpus_per_node: 1
        training: {{global_batch: 1}}
        """))
    spec = jobspec.load_spec(spec_path)
    part = sites.load_site("local").partition(None)
    plan = spec.first_plan(part)
    stub = tmp_path / "argv-printer"
    stub.write_text("#!/bin/bash\nprintf '%s\\n' \"$@\" > \"$HPCMEM_ATTEMPT_DIR/argv.txt\"\n")
    stub.chmod(0o755)
    attempt = render.render_attempt(spec, part, plan, tmp_path / "a", python=str(stub), workdir=tmp_path)
    subprocess.run(["bash", str(attempt.script)], check=True, env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "local-08"})
    lines = (tmp_path / "a" / "argv.txt").read_text().splitlines()
    assert lines[-1] == HOSTILE and lines[-2] == "toolkit.train"


@pytest.mark.parametrize("time_min,margin", [(1, 20), (10, 60), (30, 180), (60, 300)])
def test_slurm_warns_the_batch_shell_at_the_runtime_s_margin(time_min, margin):
    spec = jobspec.load_spec("quickstart")
    plan = spec.first_plan(TC.partition("cpu"), {"time_min": time_min})
    lines = render.directives(spec, TC.partition("cpu"), plan, Path("/r/a"))
    assert f"--signal=B:USR1@{margin}" in lines
    assert margin == ck.margin_s(60.0 * time_min)  # the runtime saves on its own at the same margin


def test_the_launch_line_turns_usr1_into_a_save_request_and_keeps_the_exit_status(tmp_path):
    """Run the rendered script for real with a stub launcher in place of torchrun: USR1 sent to the batch shell
    (what Slurm's --signal=B:USR1 does) runs the trap while the launcher runs in the background; the trap writes
    the save request the runtime looks for; the script then waits again and exits with the launcher's status."""
    import signal
    import time

    spec = jobspec.load_spec("quickstart")
    part = sites.load_site("local").partition(None)
    plan = spec.first_plan(part)
    stub = tmp_path / "launcher"
    stub.write_text(textwrap.dedent("""\
        #!/bin/bash
        : > "$HPCMEM_ATTEMPT_DIR/started"
        for _ in $(seq 600); do
          [ -e "$HPCMEM_ATTEMPT_DIR/save-request" ] && exit 7
          sleep 0.05
        done
        exit 1
        """))
    stub.chmod(0o755)
    attempt = render.render_attempt(spec, part, plan, tmp_path / "a", python=str(stub), workdir=tmp_path)
    proc = subprocess.Popen(["bash", str(attempt.script)], env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "9"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(300):
            if (tmp_path / "a" / "started").exists():
                break
            time.sleep(0.05)
        assert proc.poll() is None
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 7, err
    assert "save requested" in out
    assert (tmp_path / "a" / ck.SAVE_REQUEST).exists()


def test_cpu_partition_gets_no_gres_and_the_memory_asked():
    spec = jobspec.load_spec("quickstart")
    part = TC.partition("cpu")
    plan = spec.first_plan(part, {"mem_mib": 900, "gpus_per_node": 2})
    lines = render.directives(spec, part, plan, Path("/r/a"))
    assert "--mem=900M" in lines and not any(l.startswith("--gpus") for l in lines)
    assert "--cpus-per-task=2" in lines
