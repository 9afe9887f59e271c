"""What a job script and a DeepSpeed config say about a job, as Plan knobs (pure).

Triage often has only the files a user attached: the batch script and maybe a
``ds_config.json``. ``read_script`` reads the ``#SBATCH`` directives and the launcher
and trainer flags of the command lines; ``read_ds_config`` reads a DeepSpeed config.
Both answer in the knob names of ``toolkit/plan.py`` so the estimator and the ladder can
use them; what cannot be read exactly (a ``$VARIABLE``, DeepSpeed's ``"auto"``) is left out
rather than guessed.

Understood on command lines (``\\``-continued lines joined, quotes as the shell reads them):

- torchrun / ``python -m torch.distributed.run|launch``: ``--nproc_per_node`` (ranks per
  node), ``--nnodes``; ``deepspeed``: ``--num_gpus``, ``--num_nodes``; ``accelerate launch``:
  ``--num_processes`` (over all machines), ``--num_machines``;
- Hugging Face Trainer flags on any line: ``--per_device_train_batch_size``,
  ``--gradient_accumulation_steps``, ``--bf16``, ``--fp16``, ``--gradient_checkpointing``,
  ``--optim``, ``--deepspeed CFG``, ``--fsdp "full_shard|shard_grad_op [auto_wrap] [offload]"``,
  ``--accelerator_config`` (as written, and whether it asks for ``sync_each_batch``), ``--max_seq_length`` /
  ``--block_size`` / ``--model_max_length`` / ``--max_length``, ``--attn_implementation``,
  ``--model_name_or_path``;
- ``PYTORCH_CUDA_ALLOC_CONF=...`` set in the script (the allocator knob).

Numbers are ASCII digits only (``isascii() and isdigit()``): ``²`` or ``٣`` in a script is not a
number Slurm or argparse would take, so it is skipped, never raised. Every knob comes out with the
Plan field's Python type (int, bool, str).
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any, Mapping

from .. import optimizers
from ..backends.slurm import gpus_requested, parse_mem_mib, parse_time_limit_s, read_directives
from ..plan import ATTENTIONS, OFFLOADS

JOB_SCRIPT = "job script"
TRAINER_ARGS = "trainer args"

OPTIMIZERS = optimizers.script_names()
"""HF ``--optim`` values (and the plan's own names and aliases) -> plan optimizer (the optimizer table's)."""

ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash",
             "flash": "flash"}
"""HF ``--attn_implementation`` values -> plan attention."""

_SEQ_FLAGS = ("max_seq_length", "block_size", "model_max_length", "max_length", "seq_len", "max_seq_len")
_MODEL_FLAGS = ("model_name_or_path", "model", "model_name", "model_path")
_DS_FLAGS = ("deepspeed", "deepspeed_config")
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_TORCHRUN = re.compile(r"(^|/)torchrun$")
_ALLOC_CONF = re.compile(r"^(?:export\s+)?PYTORCH_CUDA_ALLOC_CONF=(.*)$")


def read_script(text: str) -> dict[str, Any]:
    """A batch script -> what it says about the job.

    Returns a dict:
    ``directives`` (``#SBATCH`` options, long names -> value), ``knobs`` (Plan knob -> value),
    ``knob_origin`` (knob -> ``"job script"`` for directives and launcher flags, ``"trainer args"``
    for Trainer flags), ``model`` (``--model_name_or_path`` and friends, or None), ``ds_config``
    (the path given to ``--deepspeed``/``--deepspeed_config`` as written, or None), ``cd`` (the
    directory of the last literal ``cd DIR`` before the launch, where relative paths start, or None),
    ``output``/``error`` (the ``--output``/``--error`` patterns, or None), ``partition``
    (``#SBATCH -p/--partition`` as written, or None when absent or a ``$VARIABLE``), ``launcher_line``
    (the first command line that starts ranks, or None), ``runtime`` (``estimate.gpu.Runtime`` fields the
    flags state: ``fsdp_no_sync`` for the HF Trainer under ``--fsdp``, whose accumulation runs every micro-batch
    but the last under ``no_sync`` unless ``--accelerator_config`` asks for ``sync_each_batch``),
    ``accelerator_config`` (the Trainer's ``--accelerator_config`` as written, or None). Memory knobs in MiB,
    time in minutes.

    Under the HF Trainer's ``--fsdp`` with ``--bf16``/``--fp16``, Accelerate builds FSDP's mixed-precision
    policy with the gradients reduced in that 16-bit dtype (``FullyShardedDataParallelPlugin.set_mixed_precision``:
    ``reduce_dtype=dtype``), and the Trainer hands it no other (``TrainingArguments`` does not pass an
    ``fsdp_config``'s ``mixed_precision_policy`` on to the plugin: read in transformers 5.24): the ``reduce_dtype``
    knob is ``param``.
    """
    text = bounded_script(text)
    directives = read_directives(text)
    knobs: dict[str, Any] = {}
    origin: dict[str, str] = {}

    def put(knob: str, value: Any, source: str) -> None:
        knobs[knob], origin[knob] = value, source

    _directive_knobs(directives, put)
    found: dict[str, Any] = {"model": None, "ds_config": None, "launcher_line": None, "cd": None,
                             "hf_fsdp": False, "accelerator_config": None}
    for line in logical_lines(text):
        alloc = _ALLOC_CONF.match(line)
        if alloc:
            value = _words(alloc.group(1))
            if value and "$" not in value[0]:
                put("alloc_conf", value[0], JOB_SCRIPT)
            continue
        words = _words(line)
        if not words:
            continue
        if words[0] == "cd" and len(words) == 2 and "$" not in words[1] and found["launcher_line"] is None:
            found["cd"] = words[1]
        if _launcher_flags(words, put) and found["launcher_line"] is None:
            found["launcher_line"] = line
        _trainer_flags(words, put, found)
    partition = directives.get("partition") or None
    runtime: dict[str, Any] = {}
    if found.pop("hf_fsdp"):
        sync = sync_each_batch(found["accelerator_config"])
        if sync is not None:
            runtime["fsdp_no_sync"] = not sync
        if origin.get("precision") == TRAINER_ARGS and knobs["precision"] in ("bf16-mixed", "fp16-mixed"):
            put("reduce_dtype", "param", TRAINER_ARGS)
    return {"directives": directives, "knobs": knobs, "knob_origin": origin, **found, "runtime": runtime,
            "output": directives.get("output") or None, "error": directives.get("error") or None,
            "partition": partition if partition and "$" not in partition else None}


def read_ds_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A DeepSpeed config dict -> Plan knobs it fixes.

    ``launcher`` is ``deepspeed``; micro-batch, accumulation and global batch when numbers
    (``"auto"`` is skipped); precision from ``fp16``/``bf16`` (``bf16_master_weights_and_grads``
    means bf16-true); ZeRO stage and the offload devices of ``zero_optimization``; AdamW when the
    config builds Adam/AdamW itself. Anything malformed is skipped, never raised.
    """
    out: dict[str, Any] = {"launcher": "deepspeed"}
    for key, knob in (("train_micro_batch_size_per_gpu", "micro_batch"), ("gradient_accumulation_steps", "grad_accum"),
                      ("train_batch_size", "global_batch")):
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            out[knob] = value
    fp16, bf16 = _section(cfg, "fp16"), _section(cfg, "bf16") or _section(cfg, "bfloat16")
    if fp16.get("enabled") is True:
        out["precision"] = "fp16-mixed"
    elif bf16.get("enabled") is True:
        out["precision"] = "bf16-true" if bf16.get("bf16_master_weights_and_grads") is True else "bf16-mixed"
    elif fp16.get("enabled") is False and bf16.get("enabled") in (False, None) and (fp16 or bf16):
        out["precision"] = "fp32"
    zero = _section(cfg, "zero_optimization")
    stage = zero.get("stage")
    if isinstance(stage, int) and not isinstance(stage, bool) and stage in (0, 1, 2, 3):
        out["zero_stage"] = stage
    for key, knob in (("offload_optimizer", "offload_optimizer"), ("offload_param", "offload_params")):
        section = zero.get(key)
        if isinstance(section, Mapping):
            device = str(section.get("device", "none")).lower()
            if device in OFFLOADS:
                out[knob] = device
        elif "zero_stage" in out:
            out[knob] = "none"
    optimizer = _section(cfg, "optimizer")
    if str(optimizer.get("type", "")).lower() in ("adam", "adamw", "cpuadam", "fusedadam"):
        out["optimizer"] = "adamw"
    return out


MAX_SCRIPT_BYTES = 4 * 2**20
"""Most characters of a job script read (a script from ``sacct -B`` is not bounded by a file size)."""
MAX_LINE = 65536
"""Longest (logical) line read as a command: no real command is longer, and quote parsing is per character."""


def bounded_script(text: str) -> str:
    """The first ``MAX_SCRIPT_BYTES`` characters of a script, each line longer than ``MAX_LINE`` replaced by a
    stand-in of its kind (``#`` for a comment, ``:`` for a command) so that ``#SBATCH`` reading still stops where
    sbatch would, in linear time whatever the input."""
    text = text[:MAX_SCRIPT_BYTES]
    if all(len(line) <= MAX_LINE for line in text.splitlines()):
        return text
    return "\n".join(line if len(line) <= MAX_LINE else ("#" if line.lstrip().startswith("#") else ":")
                     for line in text.splitlines())


def logical_lines(text: str) -> list[str]:
    """The script's lines with ``\\``-continuations joined, without blank and comment-only lines (joined lines
    longer than ``MAX_LINE`` are left out: built in linear time, never parsed)."""
    out: list[str] = []
    pending: list[str] = []
    size = 0
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending.append(line[:-1] + " ")
            size += len(line)
            continue
        joined = ("".join(pending) + line).strip() if size + len(line) <= MAX_LINE else ""
        pending, size = [], 0
        if joined and not joined.startswith("#"):
            out.append(joined)
    rest = "".join(pending).strip() if size <= MAX_LINE else ""
    if rest and not rest.startswith("#"):
        out.append(rest)
    return out


# ---------------------------------------------------------------- directives


def _directive_knobs(directives: Mapping[str, str], put) -> None:
    nodes = _int(directives.get("nodes"))
    if nodes:
        put("nodes", nodes, JOB_SCRIPT)
    try:
        gpus = gpus_requested(directives)
    except ValueError:  # a count in digits int() refuses (``gpu:²``): not a request Slurm would take
        gpus = 0
    tasks = _int(directives.get("ntasks-per-node"))
    if gpus:
        put("gpus_per_node", gpus, JOB_SCRIPT)
    elif tasks and tasks > 1:
        put("gpus_per_node", tasks, JOB_SCRIPT)  # one rank per task (srun, Lightning)
    if "mem" in directives:
        mem = parse_mem_mib(directives["mem"], default_unit="M")
        if mem and int(mem) >= 1:
            put("mem_mib", int(mem), JOB_SCRIPT)
    if "time" in directives:
        try:
            seconds = parse_time_limit_s(directives["time"])
        except ValueError:
            seconds = None
        if seconds:
            put("time_min", max(1, round(seconds / 60)), JOB_SCRIPT)


# ---------------------------------------------------------------- command lines


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: read what can be read
        return line.split()


def _flags(words: list[str]) -> list[tuple[str, str | None]]:
    """``--name value`` / ``--name=value`` / ``--flag`` -> (name with ``-`` as ``_``, value or None)."""
    out = []
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--") and len(word) > 2:
            name, sep, value = word[2:].partition("=")
            name = name.replace("-", "_")
            if sep:
                out.append((name, value))
            elif i + 1 < len(words) and not words[i + 1].startswith("-"):
                out.append((name, words[i + 1]))
                i += 1
            else:
                out.append((name, None))
        i += 1
    return out


def _program(words: list[str]) -> str | None:
    """Which launcher a command line runs: torchrun, deepspeed, accelerate or None."""
    for i, word in enumerate(words):
        base = word.rsplit("/", 1)[-1]
        if _TORCHRUN.search(word):
            return "torchrun"
        if base == "deepspeed":
            return "deepspeed"
        if base == "accelerate" and i + 1 < len(words) and words[i + 1] == "launch":
            return "accelerate"
        if word == "-m" and i + 1 < len(words) and words[i + 1] in ("torch.distributed.run", "torch.distributed.launch"):
            return "torchrun"
    return None


def _launcher_flags(words: list[str], put) -> bool:
    """Ranks and nodes from a launcher line; True when the line starts ranks."""
    program = _program(words)
    if program is None:
        return False
    flags = {k: v for k, v in _flags(words) if v is not None}
    names = {"torchrun": ("nproc_per_node", "nnodes"), "deepspeed": ("num_gpus", "num_nodes"),
             "accelerate": ("num_processes", "num_machines")}[program]
    ranks, nodes = _int(flags.get(names[0])), _int(flags.get(names[1]))
    if nodes:
        put("nodes", nodes, JOB_SCRIPT)
    if ranks:
        per_node = ranks // (nodes or 1) if program == "accelerate" else ranks
        if per_node >= 1:
            put("gpus_per_node", per_node, JOB_SCRIPT)
    if program == "deepspeed":
        put("launcher", "deepspeed", JOB_SCRIPT)
    return True


def _trainer_flags(words: list[str], put, found: dict[str, Any]) -> None:
    flags = _flags(words)
    for name, value in flags:
        number = _int(value)
        if name == "per_device_train_batch_size" and number:
            put("micro_batch", number, TRAINER_ARGS)
        elif name == "gradient_accumulation_steps" and number:
            put("grad_accum", number, TRAINER_ARGS)
        elif name in ("bf16", "fp16") and _bool(value):
            put("precision", "bf16-mixed" if name == "bf16" else "fp16-mixed", TRAINER_ARGS)
        elif name == "gradient_checkpointing" and _bool(value) is not None:
            put("checkpointing", _bool(value), TRAINER_ARGS)
        elif name == "optim" and value and value.lower() in OPTIMIZERS:
            put("optimizer", OPTIMIZERS[value.lower()], TRAINER_ARGS)
        elif name in _SEQ_FLAGS and number:
            put("seq_len", number, TRAINER_ARGS)
        elif name == "attn_implementation" and value and ATTENTION.get(value.lower()) in ATTENTIONS:
            put("attention", ATTENTION[value.lower()], TRAINER_ARGS)
        elif name in _DS_FLAGS and value and found["ds_config"] is None:
            found["ds_config"] = value
            put("launcher", "deepspeed", TRAINER_ARGS)
        elif name == "fsdp" and value and "$" not in value:
            found["hf_fsdp"] = _fsdp_words(value, put) or found["hf_fsdp"]
        elif name == "accelerator_config" and value:
            found["accelerator_config"] = value
        elif name in _MODEL_FLAGS and value and found["model"] is None and "$" not in value:
            found["model"] = value


def _fsdp_words(value: str, put) -> bool:
    """HF Trainer ``--fsdp "full_shard auto_wrap offload"``: FSDP, resharded after the forward (full_shard) or
    not (shard_grad_op), CPU offload; True when it shards. ``no_shard`` is plain data parallelism; other words say
    nothing more."""
    words = set(value.lower().replace(",", " ").split())
    if not words & {"full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2"}:
        return False
    put("launcher", "fsdp", TRAINER_ARGS)
    put("reshard_after_forward", not words & {"shard_grad_op", "hybrid_shard_zero2"}, TRAINER_ARGS)
    if "offload" in words:
        put("offload_params", "cpu", TRAINER_ARGS)
    return True


def sync_each_batch(value: str | None) -> bool | None:
    """Whether HF Trainer's ``--accelerator_config`` asks for a gradient sync on every micro-batch
    (``{"gradient_accumulation_kwargs": {"sync_each_batch": true}}``): False when the flag is absent or says
    nothing of it (the Trainer's default), None when it cannot be read here (a file path, a ``$VARIABLE``, JSON
    that does not parse)."""
    if value is None:
        return False
    config = json_object(value)
    if config is None:
        return None
    kwargs = config.get("gradient_accumulation_kwargs")
    sync = kwargs.get("sync_each_batch", False) if isinstance(kwargs, dict) else False
    return sync if isinstance(sync, bool) else None


def json_object(value: str) -> dict | None:
    """An inline JSON object as a flag's value, else None (a file path, a ``$VARIABLE``, JSON that does not parse,
    or nests deeper than the parser's stack)."""
    if not value.lstrip().startswith("{"):
        return None
    try:
        config = json.loads(value)
    except (ValueError, RecursionError):
        return None
    return config if isinstance(config, dict) else None


def _int(value: str | None) -> int | None:
    """A positive whole number written in ASCII digits, else None (``²``, ``٣``, ``$N``, ``0``)."""
    if value is None or not (value.isascii() and value.isdigit()):
        return None
    number = int(value)
    return number if number >= 1 else None


def _bool(value: str | None) -> bool | None:
    """A flag's truth: bare flag -> True, ``true``/``false`` words, anything else (``$X``) -> None."""
    if value is None:
        return True
    return _BOOL_WORDS.get(value.strip().lower())


def _section(cfg: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = cfg.get(key)
    return value if isinstance(value, Mapping) else {}
