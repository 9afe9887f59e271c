"""The ``hpcmem`` command line. Thin: parse, call the modules, format.

Every reporting command takes ``--json``. An ``HpcmemError`` becomes one line on
stderr and a non-zero exit; anything else keeps its traceback (it is a bug).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from . import __version__, controller, render, runs
from .detach import detach as detach_run
from .errors import ConfigError, HpcmemError, PlanError
from .jobspec import load_spec
from .plan import CHOICES as PLAN_CHOICES
from .plan import parse_sets
from .sites import all_sites, load_site


def _emit_json(data) -> None:
    from .templating import json_text

    click.echo(json_text(data))


def _refuse(message: str):
    raise click.BadParameter(message)


def _directories(paths, option: str):
    """``paths`` when each is a directory (click's ``file_okay=False`` lets a FIFO or a device through)."""
    import os

    for path in paths:
        if not os.path.isdir(path):
            raise click.BadParameter(f"{option} {path!r} is not a directory")
    return paths


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcmem")
@click.option("--sites-dir", "sites_dirs", multiple=True, type=click.Path(exists=True, file_okay=False),
              callback=lambda _ctx, _param, dirs: _directories(dirs, "--sites-dir"),
              help="Extra directory of site profiles (searched before HPCMEM_SITES and the shipped ones); it must exist.")
@click.pass_context
def main(ctx: click.Context, sites_dirs) -> None:
    """hpcmem: get GPU training jobs on Slurm past CUDA out-of-memory."""
    ctx.obj = {"sites_dirs": tuple(sites_dirs)}


def _target(ctx, job, site, partition, sets, launcher=None, gpus_per_node=None):
    """The spec, site, partition and first plan of a command on a JOB (``--launcher``/``--gpus-per-node``
    override the spec's, as ``--set`` would)."""
    spec = load_spec(job)
    site_obj = load_site(site, ctx.obj["sites_dirs"])
    part = site_obj.partition(partition)
    overrides = {**({"launcher": launcher} if launcher else {}),
                 **({"gpus_per_node": gpus_per_node} if gpus_per_node else {}), **parse_sets(sets)}
    plan = spec.first_plan(part, overrides)
    return spec, site_obj, part, plan


_site_opt = click.option("--site", default="local", show_default=True, help="Site profile name.")
_partition_opt = click.option("--partition", "-p", default=None, help="Partition of the site (optional if it has one).")
_set_opt = click.option("--set", "sets", multiple=True, metavar="KNOB=VALUE", help="Override a plan knob (repeatable).")
_json_opt = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
class _Count(click.ParamType):
    """A whole number >= ``low`` written in ASCII digits only (click's int takes ``1_6`` and Unicode digits)."""

    name = "integer"

    def __init__(self, low: int = 1):
        self.low = low

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            if not (text.isascii() and text.isdigit()):
                self.fail(f"{value!r} is not a whole number (digits 0-9 only)", param, ctx)
            number = int(text)
        if number < self.low:
            self.fail(f"{number} is below {self.low}", param, ctx)
        return number


_launcher_opt = click.option("--launcher", type=click.Choice(PLAN_CHOICES["launcher"]), default=None,
                             help="Training engine: torchrun (DDP), deepspeed, fsdp (default: the spec's).")
_gpus_opt = click.option("--gpus-per-node", type=_Count(), default=None,
                         help="Ranks per node (default: the spec's; 1 with --model).")


def _longest_opt(f):
    """--max-seq-len / --seq-len-hist: size the plan for the data's longest sequence (toolkit/peaks.py)."""
    f = click.option("--seq-len-hist", type=click.Path(dir_okay=False), default=None,
                     help="The data's length histogram: JSON {length: count} or CSV lines length,count; the plan "
                          "is sized for its longest length.")(f)
    return click.option("--max-seq-len", type=_Count(), default=None,
                        help="The data's longest sequence (tokens): the plan is sized for it.")(f)


def _sized_for_longest(plan, max_seq_len, hist_path):
    """(``plan`` with seq_len raised to the data's longest sequence, what that did as a dict); (plan, None) when
    neither option is given. A histogram file that cannot be read or parsed is a one-line ConfigError."""
    from . import peaks
    from .files import read_small_text

    hist, sources = None, [f"--max-seq-len {max_seq_len}"] if max_seq_len else []
    if hist_path:  # a regular UTF-8 file of at most 16 MiB (never a FIFO: opened without blocking)
        text = read_small_text(Path(hist_path), "--seq-len-hist", 16 * 2**20)
        hist = peaks.parse_length_hist(text, f"--seq-len-hist {hist_path}")
        sources.append(f"the histogram {hist_path}")
    longest = peaks.longest_sequence(max_seq_len, hist)
    sized = peaks.sized_for_longest(plan.seq_len, longest, " and ".join(sources))
    return (plan if sized is None else plan.replace(seq_len=sized["sized_seq_len"])), sized


def _interval(ctx, param, value: float) -> float:
    """--interval: a finite number of seconds above zero, checked before anything is submitted."""
    if not (value == value and 0 < value < float("inf")):  # value == value: not NaN
        raise click.BadParameter(f"{value!r} is not a positive number of seconds", ctx=ctx, param=param)
    return value


def _interval_opt(help_text: str):
    return click.option("--interval", default=2.0, show_default=True, type=float, callback=_interval, help=help_text)


@main.command()
@_json_opt
@click.pass_context
def sites(ctx, as_json) -> None:
    """List sites and partitions with their memory and capabilities."""
    found = all_sites(ctx.obj["sites_dirs"])
    if as_json:
        _emit_json([s.to_dict() for s in found])
        return
    for s in found:
        click.echo(f"{s.name} ({s.scheduler}) {s.path}")
        for p in s.partitions.values():
            gpu = f"{p.gpus_per_node}x {p.gpu_model} {p.gpu_mem_gib:g} GiB" if p.has_gpu else "CPU only"
            caps = ",".join(c for c, ok in (("fp16", p.fp16), ("bf16", p.bf16), ("tf32", p.tf32), ("flash", p.flash_attention)) if ok) or "-"
            click.echo(f"  {p.name:<12} {gpu:<40} cpus={p.cpus_per_node:<4} host={p.host_mem_gib:g}GiB "
                       f"nvme={p.nvme_gib:g}GiB caps={caps} max={p.max_time}")


@main.command("render")
@click.argument("job")
@_site_opt
@_partition_opt
@_set_opt
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              callback=lambda _ctx, _param, out: out if out else _refuse("-o: an empty path; name a directory"),
              help="Directory to write into.")
@_json_opt
@click.pass_context
def render_cmd(ctx, job, site, partition, sets, out_dir, as_json) -> None:
    """Write job.sbatch, plan.json (and ds_config.json) for JOB without submitting."""
    spec, _, part, plan = _target(ctx, job, site, partition, sets)
    attempt = render.render_attempt(spec, part, plan, Path(out_dir))
    files = [str(p) for p in (attempt.script, attempt.plan_json, attempt.config) if p]
    if as_json:
        _emit_json({"dir": str(attempt.dir), "files": files, "plan": plan.to_dict()})
    else:
        click.echo("\n".join(files))


@main.command()
@click.argument("job")
@_site_opt
@_partition_opt
@_set_opt
@click.option("--wait", is_flag=True, help="Follow the run (retrying OOMs) to its end; exit 0 only on success.")
@click.option("--detach", is_flag=True, help="Hand the run's controller loop to a job that outlives this session.")
@_interval_opt("Seconds between polls with --wait.")
@click.option("--plan", "use_planner", is_flag=True, help="Start from the planner's fastest plan predicted to fit.")
@_json_opt
@click.pass_context
def submit(ctx, job, site, partition, sets, wait, detach, interval, use_planner, as_json) -> None:
    """Submit JOB (a spec file or a shipped spec name) as a new run.

    Without --wait or --detach the run advances whenever `hpcmem tick` (cron) or
    `hpcmem watch RUN` runs.
    """
    if wait and detach:
        raise click.UsageError("--wait and --detach exclude each other")
    spec, site_obj, part, plan = _target(ctx, job, site, partition, sets)
    if use_planner:
        plan = _planned(spec, part, plan)
    _check_attention(spec, plan)
    with runs.open_ledger() as ledger:
        run = controller.start(ledger, spec, site_obj, part, plan)
        if not as_json:
            click.echo(f"run {run.run_id}: {run.run_dir}")
        if detach:
            where = detach_run(run, site_obj, runs.home_dir())
            ledger.add_event(run.run_id, None, f"controller detached: {where}")
            if not as_json:
                click.echo(f"controller detached ({where}); follow with: hpcmem watch {run.run_id}")
        elif wait:
            run = _follow(ledger, run.run_id, interval, quiet=as_json)
        elif not as_json:
            click.echo(f"follow with: hpcmem watch {run.run_id}   (or run `hpcmem tick` from cron)")
        if as_json:
            _emit_json(runs.run_view(ledger, run.run_id))
    if wait and run.state != "succeeded":
        sys.exit(1)


def _check_attention(spec, plan) -> None:
    """Refuse, before anything is submitted, an attention the spec's model cannot run (Gemma 2 on sdpa: the job
    would fail as it builds the model); a model the analytic shapes do not know is left to the job."""
    from .estimate import attention_refusal, spec_model

    try:
        model = spec_model(spec)
    except HpcmemError:
        return
    refusal = attention_refusal(model, plan)
    if refusal:
        raise ConfigError(refusal)


def _planned(spec, part, plan):
    """The planner's choice for ``spec`` starting from ``plan`` (an error when nothing is predicted to fit)."""
    from . import planner
    from .estimate import spec_model

    chosen = planner.choose(planner.plan_candidates(spec_model(spec), plan, part, spec.allow))
    if chosen is None:
        raise PlanError(f"no plan the spec allows is predicted to fit {part.site}:{part.name} "
                        "(see `hpcmem plan`); allow more moves in retry.allow or choose a bigger partition")
    return chosen.plan


def _follow(ledger, run_id, interval, quiet=False):
    run = controller.follow(ledger, run_id, interval_s=interval, on_change=None if quiet else _status_printer())
    if not quiet:
        if sys.stdout.isatty():
            click.echo()
        click.echo(f"run {run.run_id} {run.state}" + (f": {run.reason}" if run.reason else ""))
    return run


def _status_printer():
    """A live status line: rewritten in place on a terminal, one line per change otherwise."""
    tty = sys.stdout.isatty()
    last = [""]

    def show(run, attempts):
        line = runs.status_line(run, attempts)
        if tty:
            click.echo("\r\033[K" + line, nl=False)
        elif line != last[0]:
            click.echo(line)
        last[0] = line
    return show


@main.command()
@click.argument("run_id")
@_interval_opt("Seconds between polls.")
@click.option("--quiet", is_flag=True, help="No status line (for a detached controller).")
def watch(run_id, interval, quiet) -> None:
    """Follow a run to its end (taking its steps: resubmitting after an OOM); exit 0 only on success."""
    with runs.open_ledger() as ledger:
        run = _follow(ledger, run_id, interval, quiet=quiet)
    if run.state != "succeeded":
        sys.exit(1)


@main.command()
@_json_opt
def tick(as_json) -> None:
    """Advance every unfinished run by one step and exit (safe from cron, safe to run twice at once)."""
    with runs.open_ledger() as ledger:
        done = controller.tick_all(ledger)
        views = [runs.run_view(ledger, r.run_id) for r in done]
    if as_json:
        _emit_json(views)
    else:
        for v in views:
            click.echo(f"{v['run_id']} {v['state']}" + (f" attempt {v['attempts'][-1]['n']} {v['attempts'][-1]['state']}"
                                                        if v["attempts"] else ""))


@main.command("runs")
@click.argument("run_id", required=False)
@_json_opt
def runs_cmd(run_id, as_json) -> None:
    """Show runs and their attempts as recorded in the ledger."""
    with runs.open_ledger() as ledger:
        ids = [run_id] if run_id else [r.run_id for r in ledger.runs()]
        views = [runs.run_view(ledger, rid) for rid in ids]
    if as_json:
        _emit_json(views[0] if run_id else views)
        return
    click.echo(runs.views_text(views), nl=False)


@main.command()
@click.option("--repair", is_flag=True, help="Repair what the run directories can: rebuild a lost or damaged ledger, "
              "record orphaned runs, remove leftovers, settle local jobs that never started.")
@_json_opt
def doctor(repair, as_json) -> None:
    """Check HPCMEM_HOME: the ledger, run directories, locks, unfinished attempts, calibration files."""
    from .doctor import doctor as check_home
    from .resources import home_dir

    report = check_home(home_dir(), repair=repair)
    if as_json:
        _emit_json(report.to_dict())
    else:
        click.echo(report.text(), nl=False)
    if not report.healthy:
        sys.exit(1)


@main.command()
@click.argument("run_id")
@_json_opt
def cancel(run_id, as_json) -> None:
    """Cancel a run: its job in flight is cancelled and it is not retried."""
    with runs.open_ledger() as ledger:
        run = controller.cancel(ledger, run_id)
        view = runs.run_view(ledger, run.run_id)
    if as_json:
        _emit_json(view)
    else:
        click.echo(f"run {run_id} {view['state']}")


@main.command()
@click.argument("targets", nargs=-1)
@click.option("--site", default=None, envvar="HPCMEM_SITE", show_envvar=True,
              help="Site profile (default: $HPCMEM_SITE, else the run's site for hpcmem runs; without one, no "
                   "remedies are checked against a partition).")
@click.option("--format", "fmt", type=click.Choice(["text", "markdown", "json"]), default="text", show_default=True)
@click.option("--since", default=None, metavar="SPAN", help="Every failed job of a window (24h, 7d or a date) from sacct.")
@click.option("--partition", "-p", default=None, help="With --since: only this Slurm partition. With TARGETs: the "
                                                      "partition they ran on, when the scheduler cannot say.")
@click.option("--user", "-u", default=None, help="With --since: only this user's jobs.")
@click.option("--max-remedies", default=5, show_default=True, type=click.IntRange(min=0), help="Remedies shown per job.")
@_json_opt
@click.pass_context
def triage(ctx, targets, site, fmt, since, partition, user, max_remedies, as_json) -> None:
    """Why a job died and what would make it fit: TARGET is a Slurm job id, an hpcmem run id (RUN or RUN:N),
    a log file (plain or gzip), a directory of a job's logs, or - (a log on standard input)."""
    from .triage import run_triage, run_since

    fmt = "json" if as_json else fmt
    if since is None and not targets:
        raise click.UsageError("give a TARGET (job id, run id, log file, directory or -) or --since SPAN")
    if since is not None and targets:
        raise click.UsageError("--since lists a window's jobs; give no TARGET with it")
    if since is None and user:
        raise click.UsageError("--user goes with --since")
    site_obj = load_site(site, ctx.obj["sites_dirs"]) if site else None
    if site_obj is not None and partition and since is None and partition not in site_obj.partitions \
            and not set(partition.split(",")) & {name for p in site_obj.partitions.values()
                                                 for name in (p.slurm_partition or "").split(",")}:
        raise ConfigError(f"--partition {partition!r}: site {site} has no such partition (hpcmem or Slurm name); "
                          f"valid: {', '.join(sorted(site_obj.partitions))}")
    colour = fmt == "text" and sys.stdout.isatty()
    if since is not None:
        click.echo(run_since(since, site_obj, fmt, partition=partition, user=user, colour=colour), nl=False)
    else:
        stdin = None
        if "-" in targets:
            if sys.stdin is None:  # started with standard input closed
                raise ConfigError("triage -: standard input is closed; give a log file or pipe the log in")
            stdin = sys.stdin.buffer
        click.echo(run_triage(targets, site_obj, fmt, stdin=stdin, colour=colour, max_remedies=max_remedies,
                              partition=partition, sites_dirs=ctx.obj["sites_dirs"]), nl=False)


@main.command()
@_site_opt
@_partition_opt
@click.option("--from-runs", is_flag=True, help="Fit allocator overhead and CUDA context from the metrics of past "
                                                 "attempts on the partition instead of running a probe.")
@click.option("--from-bench", is_flag=True, help="Fit them from the nightly benchmark results (with --from-runs: both).")
@click.option("--store", "store_path", default=None, type=click.Path(dir_okay=False),
              help="Benchmark results store for --from-bench (default: $HPCMEM_HOME/bench/results.sqlite).")
@_json_opt
@click.pass_context
def calibrate(ctx, site, partition, from_runs, from_bench, store_path, as_json) -> None:
    """Measure a partition (GPU, CUDA context, fp16/bf16/flash, host memory, NVMe) and keep it beside the site profile."""
    from .calibrate import calibration_path, fit_recorded, load_measured, run_probe, write_calibration
    from .resources import home_dir

    site_obj = load_site(site, ctx.obj["sites_dirs"])
    part = site_obj.partition(partition)
    if from_runs or from_bench:
        ledger = runs.open_ledger() if from_runs else None
        try:
            frame = None
            if from_bench:
                from .bench import store

                frame = store.load(Path(store_path) if store_path else store.default_path())
            fitted = fit_recorded(site_obj.name, part.name, ledger=ledger, bench=frame)
        finally:
            if ledger is not None:
                ledger.close()
        path = calibration_path(site_obj, home_dir())
        measured = {**load_measured(path, part.name), **fitted}
    else:
        measured = run_probe(site_obj, part, home_dir() / "calibration" / "jobs")
    path = write_calibration(calibration_path(site_obj, home_dir()), part.name, measured)
    if as_json:
        _emit_json({"site": site_obj.name, "partition": part.name, "file": str(path), "measured": measured})
        return
    click.echo(f"calibrated {site_obj.name}:{part.name} -> {path}")
    for key, value in measured.items():
        click.echo(f"  {key:<18} {value}")


_METHOD_OPT = click.option("--method", type=click.Choice(["analytic", "traced"]), default="analytic", show_default=True,
                           help="analytic: arithmetic, instant; traced: one real step under fake tensors (seconds).")


_MODEL_ONLY = ("model", "task", "seq_len", "micro_batch", "grad_accum", "precision", "optimizer", "checkpointing",
               "attention", "zero_stage", "offload_optimizer", "offload_params", "nodes")
"""estimate's options that describe a plan from scratch (with --model); a JOB spec holds its own."""


@main.command("estimate")
@click.argument("job", required=False)
@_site_opt
@_partition_opt
@_set_opt
@_METHOD_OPT
@click.option("--model", help="Instead of JOB: a model name in jobs/models, a config.json (or its directory), or a HF id in the local cache.")
@click.option("--task", type=click.Choice(["causal-lm", "seq-cls", "image-cls"]), default="causal-lm", show_default=True)
@click.option("--seq-len", type=_Count(), default=512, show_default=True)
@click.option("--micro-batch", type=_Count(), default=1, show_default=True)
@click.option("--grad-accum", type=_Count(), default=1, show_default=True)
@click.option("--precision", type=click.Choice(PLAN_CHOICES["precision"]), default="fp32", show_default=True)
@click.option("--optimizer", type=click.Choice(PLAN_CHOICES["optimizer"]), default="adamw", show_default=True)
@click.option("--checkpointing", is_flag=True)
@click.option("--attention", type=click.Choice(PLAN_CHOICES["attention"]), default="sdpa", show_default=True)
@click.option("--zero-stage", type=click.IntRange(0, 3), default=0, show_default=True)
@click.option("--offload-optimizer", type=click.Choice(PLAN_CHOICES["offload_optimizer"]), default="none", show_default=True)
@click.option("--offload-params", type=click.Choice(PLAN_CHOICES["offload_params"]), default="none", show_default=True)
@click.option("--nodes", type=_Count(), default=1, show_default=True)
@click.option("--ds-config", "ds_config", metavar="FILE",
              help="The DeepSpeed config the job brings (ds_config.json): its ZeRO stage, offload, precision, "
                   "micro-batch and accumulation set the plan (as hpcmem-train --deepspeed takes them), and its "
                   "zero_optimization bucket sizes the estimate's gradient buffers.")
@_launcher_opt
@_gpus_opt
@_longest_opt
@_json_opt
@click.pass_context
def estimate_cmd(ctx, job, site, partition, sets, method, model, task, seq_len, micro_batch, grad_accum, precision,
                 optimizer, checkpointing, attention, zero_stage, offload_optimizer, offload_params, nodes, ds_config,
                 launcher, gpus_per_node, max_seq_len, seq_len_hist, as_json) -> None:
    """Predict a training step's peak memory per GPU (and host memory under offload) before submitting.

    Give a JOB spec (change its knobs with --set) or --model with the plan options (--seq-len, --micro-batch, ...;
    --set applies there too, except global_batch, which follows micro-batch x accumulation x GPUs)."""
    from .estimate import estimate, model_ref, spec_model
    from .plan import Plan
    from .strategies import infer_launcher

    given = [p.opts[-1] for p in ctx.command.params if p.name in _MODEL_ONLY
             and ctx.get_parameter_source(p.name) not in (None, click.core.ParameterSource.DEFAULT)]
    if job:
        if given:  # the spec holds them: say so rather than estimate without them
            raise click.UsageError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --model; with a "
                                   f"JOB spec, set plan knobs with --set KNOB=VALUE")
        spec, _, part, plan = _target(ctx, job, site, partition, sets, launcher, gpus_per_node)
        ref = spec_model(spec)
    else:
        if not model:
            raise click.UsageError("give a JOB spec or --model")
        part = load_site(site, ctx.obj["sites_dirs"]).partition(partition)
        knobs = {"zero_stage": zero_stage, "offload_optimizer": offload_optimizer, "offload_params": offload_params,
                 "launcher": launcher}
        engine = infer_launcher(knobs)
        if launcher and engine != launcher:  # --launcher torchrun --zero-stage 3: which one was meant?
            raise click.UsageError(f"--launcher {launcher} does not take the {engine} knobs given "
                                   f"(--zero-stage, --offload-optimizer)")
        gpus_per_node = gpus_per_node or 1
        plan = Plan(launcher=engine, nodes=nodes, gpus_per_node=gpus_per_node, seq_len=seq_len,
                    micro_batch=micro_batch, grad_accum=grad_accum,
                    global_batch=micro_batch * grad_accum * nodes * gpus_per_node, precision=precision,
                    optimizer=optimizer, checkpointing=checkpointing, attention=attention, zero_stage=zero_stage,
                    offload_optimizer=offload_optimizer, offload_params=offload_params)
        if sets:  # the flags' semantics: the global batch follows micro_batch x grad_accum x GPUs
            from .plan import apply_overrides

            changes = parse_sets(sets)
            if "global_batch" in changes:
                raise click.UsageError("with --model the global batch is micro-batch x accumulation x GPUs: set "
                                       "those, not global_batch")
            plan = apply_overrides(plan, changes)
        part.check_plan(plan)
        ref = model_ref(model, task)
    runtime = None
    if ds_config:
        plan, runtime = _with_ds_config(plan, ds_config)
        part.check_plan(plan)
    plan, sized = _sized_for_longest(plan, max_seq_len, seq_len_hist)
    est = estimate(ref, plan, part, method, runtime=runtime)
    from .predict import fit_fields, fit_text

    if as_json:
        _emit_json({**est.to_dict(), **fit_fields(est, plan), "plan": plan.to_dict(),
                    **({"sized_for_longest": sized} if sized else {})})
        return
    if sized:
        click.echo(f"note: {sized['note']}")
    click.echo(f"{ref.name} {ref.task} on {part.site}:{part.name} ({method}): {render.plan_summary(plan)}")
    for name, mib in sorted(est.components.items(), key=lambda kv: -kv[1]):
        click.echo(f"  {name:<20} {mib:>12,.0f} MiB")
    click.echo(f"  {'peak allocated':<20} {est.peak_allocated_mib:>12,.0f} MiB   (torch.cuda.max_memory_allocated)")
    if est.peak_reserved_mib is not None:
        click.echo(f"  {'peak reserved':<20} {est.peak_reserved_mib:>12,.0f} MiB   (torch.cuda.max_memory_reserved; "
                   f"{est.fragmentation:.0%} of it unallocated at its peak)")
    click.echo(f"  {'device used':<20} {est.device_used_mib:>12,.0f} MiB   (nvidia-smi)")
    if est.host_mib_per_node:
        click.echo(f"  {'host per node':<20} {est.host_mib_per_node:>12,.0f} MiB")
    click.echo(f"  {fit_text(est, plan)}")
    for note in est.notes:
        click.echo(f"  note: {note}")


def _with_ds_config(plan, path: str):
    """``plan`` with what a user's ds_config sets, and the estimate's Runtime carrying its zero_optimization."""
    from .errors import ConfigError
    from .estimate.gpu import Runtime
    from .plan import apply_overrides
    from .files import read_small_json
    from .strategies.deepspeed import plan_from_ds_config

    cfg = read_small_json(Path(path), "DeepSpeed config")
    if not isinstance(cfg, dict):
        raise ConfigError(f"DeepSpeed config {path}: must hold a JSON object")
    try:
        return (apply_overrides(plan, plan_from_ds_config(cfg)),
                Runtime(engine_config=cfg.get("zero_optimization") or {}))
    except ConfigError as exc:
        raise ConfigError(f"DeepSpeed config {path}: {exc}") from None


@main.command("plan")
@click.argument("job")
@_site_opt
@_partition_opt
@_set_opt
@_METHOD_OPT
@click.option("--top", default=12, show_default=True, type=click.IntRange(min=1),
              help="How many candidates to list (fastest first).")
@_launcher_opt
@_gpus_opt
@_longest_opt
@_json_opt
@click.pass_context
def plan_cmd(ctx, job, site, partition, sets, method, top, launcher, gpus_per_node, max_seq_len, seq_len_hist,
             as_json) -> None:
    """List candidate plans with predicted memory and throughput; mark the fastest that fits."""
    from . import planner
    from .estimate import spec_model

    spec, _, part, plan = _target(ctx, job, site, partition, sets, launcher, gpus_per_node)
    plan, sized = _sized_for_longest(plan, max_seq_len, seq_len_hist)
    cands = planner.plan_candidates(spec_model(spec), plan, part, spec.allow, method)
    chosen = planner.choose(cands)
    if as_json:
        _emit_json({"site": part.site, "partition": part.name, "chosen": chosen.to_dict() if chosen else None,
                    "candidates": [c.to_dict() for c in cands], **({"sized_for_longest": sized} if sized else {})})
        return
    if sized:
        click.echo(f"note: {sized['note']}")
    click.echo(f"{len(cands)} candidate plans for {spec.name} on {part.site}:{part.name}; "
               f"capacity {cands[0].estimate.capacity_mib:,.0f} MiB")
    click.echo(f"  {'':2}{'speed':>6} {'device MiB':>11} {'reserved':>9} {'frag':>5} {'fits':>5}  plan")
    shown = [c for c in cands if c.fits_with_margin()][:top] or cands[:top]
    given = next((c for c in cands if not c.moves), cands[0])  # the plan as given, always shown
    if given not in shown:
        shown = [given] + shown
    for c in shown:
        mark = "->" if c is chosen else "  "
        e = c.estimate
        reserved = "-" if e.peak_reserved_mib is None or c.screened else f"{e.peak_reserved_mib:,.0f}"
        fits = "yes" if c.fits_with_margin() else ("alloc" if e.fragmentation_only else "no")
        click.echo(f"  {mark}{c.throughput:>6.2f} {e.device_used_mib:>11,.0f} {reserved:>9} {e.fragmentation:>5.0%} "
                   f"{fits:>5}  {render.plan_summary(c.plan)}")
    from .predict import fit_text

    for c in shown:  # fragmentation-aware fit: the tensors fit, the reserved peak does not
        if c.estimate.fragmentation_only:
            click.echo(f"  alloc: {render.plan_summary(c.plan)}: {fit_text(c.estimate, c.plan)}")
    if chosen is None:
        click.echo("no candidate is predicted to fit with a margin; allow more moves in the spec's retry.allow")
    else:
        import shlex

        from .templating import safe_text

        argv = ["hpcmem", *(a for d in ctx.obj["sites_dirs"] for a in ("--sites-dir", d)), "submit", job,
                "--site", part.site, "--partition", part.name, "--plan"]
        click.echo("submit it with: " + safe_text(shlex.join(argv)))  # quoted: a line to paste into a shell


from .bench.cli import bench  # noqa: E402  (the bench group lives with the bench package)

main.add_command(bench)


def entry() -> None:
    """Console-script entry: HpcmemError -> one line and a non-zero exit."""
    try:
        main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:  # one line too, with where to read the usage
        from .templating import safe_text

        where = exc.ctx.command_path if exc.ctx is not None else "hpcmem"
        click.echo(f"hpcmem: error: {safe_text(exc.format_message(), 2000)} (see '{where} --help')", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except HpcmemError as exc:
        from .templating import safe_text

        # one line, whatever the input put into the message (a newline or an escape from a file or an option)
        click.echo(f"hpcmem: error: {safe_text(exc, 2000)}", err=True)
        sys.exit(exc.exit_code)
    except OSError as exc:
        if exc.filename is None:  # not about a path the user gave: a bug to see in full
            raise
        from .templating import safe_text

        # a path the system refused (a name too long, a loop of links, no permission), wherever it was opened
        click.echo(f"hpcmem: error: {safe_text(exc.filename, 300)}: {exc.strerror or exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    entry()
