"""Fuzzing the rendered job script: any knob, site field or spec value, however hostile, is refused (one
HpcmemError) or rendered into a script that passes ``bash -n``, whose every shell line splits with balanced
quotes, which holds no control character, and which, run, executes nothing it was given (no marker file)."""

from __future__ import annotations

import dataclasses

from hostile import outcome, render_outcome
from hypothesis import given, settings
from hypothesis import strategies as st
from fuzz_strategies import examples, PIECES, hostile_text

from toolkit import jobspec, sites
from toolkit.plan import KNOBS, Plan, parse_knob, with_changes

TC = sites.load_site("testcluster")
SPEC = jobspec.load_spec("quickstart")
PARTITION_FIELDS = ("name", "site", "slurm_partition", "gres_type", "account", "qos", "constraint", "nvme_path",
                    "gpu_model", "description")


def injection(marker):
    """Hostile text that, run by a shell anywhere, would create ``marker``."""
    m = str(marker)
    return st.one_of(hostile_text, st.tuples(st.sampled_from(PIECES), st.sampled_from(
        [f"touch {m}", f"$(touch {m})", f"`touch {m}`", f";touch {m};", f"\ntouch {m}\n", f"'\ntouch {m}\n'"]),
        hostile_text).map("".join))


@settings(max_examples=examples(120))
@given(data=st.data(), partition=st.sampled_from(["cpu", "v100"]))
def test_fuzz_knobs_in_the_script(tmp_path_factory, data, partition):
    tmp = tmp_path_factory.mktemp("knobs")
    marker = tmp / "INJECTED"
    part = TC.partition(partition)
    changes = {}
    for name in data.draw(st.lists(st.sampled_from(KNOBS), min_size=1, max_size=3, unique=True), label="knobs"):
        text = data.draw(injection(marker), label=name)
        kind, value = outcome(lambda: parse_knob(name, text), 5)
        changes[name] = value if kind == "ok" else text  # unparsed text straight into the Plan as well
    kind, plan = outcome(lambda: with_changes(SPEC.first_plan(part), changes), 10)
    if kind == "ok":
        kind, _ = outcome(lambda: part.check_plan(plan), 5)
    if kind == "ok":
        render_outcome(SPEC, part, plan, tmp, marker)


@settings(max_examples=examples(120))
@given(data=st.data())
def test_fuzz_partition_fields_in_the_script(tmp_path_factory, data):
    """Values a Partition may get from code (detect, calibration), not only from a checked site file."""
    tmp = tmp_path_factory.mktemp("part")
    marker = tmp / "INJECTED"
    part = TC.partition("cpu")
    fields = {}
    for name in data.draw(st.lists(st.sampled_from(PARTITION_FIELDS + ("env", "setup")), min_size=1, max_size=3,
                                   unique=True), label="fields"):
        text = data.draw(injection(marker), label=name)
        if name == "env":
            fields["env"] = ((data.draw(st.sampled_from(["X", "OMP_NUM_THREADS", text]), label="env name"), text),)
        elif name == "setup":
            fields["setup"] = (data.draw(st.sampled_from(["true", ":"]), label="setup") + " " + text.replace(
                "\n", " "),) if "\n" not in text and "\r" not in text else (text,)
        else:
            fields[name] = text
    plan = SPEC.first_plan(part, {"launcher": "deepspeed", "zero_stage": 3, "offload_params": "nvme",
                                  "offload_optimizer": "nvme"})
    hostile = dataclasses.replace(part, **fields)
    if "setup" in fields and "\n" not in fields["setup"][0] and "\r" not in fields["setup"][0]:
        # setup lines are shell by design: the check is only that they stay one line and bash -n holds
        kind, attempt = outcome(lambda: __import__("toolkit.render").render.render_attempt(
            SPEC, hostile, plan, tmp / "a", workdir=tmp, python="/bin/true"), 20)
        return
    render_outcome(SPEC, hostile, plan, tmp, marker)


@settings(max_examples=examples(100))
@given(data=st.data())
def test_fuzz_spec_values_in_the_script(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("spec")
    marker = tmp / "INJECTED"
    values = {k: data.draw(injection(marker), label=k) for k in ("name", "arg", "env", "python")}
    spec = dataclasses.replace(SPEC, name=values["name"], args=(values["arg"], "{plan_json}" + values["arg"]),
                               env=(("X", values["env"]),))
    kind, plan = outcome(lambda: spec.first_plan(TC.partition("cpu")), 5)
    if kind == "ok":
        render_outcome(spec, TC.partition("cpu"), plan, tmp, marker)
