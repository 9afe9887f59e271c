"""Reference models built from a transformers config, never downloaded.

A model is named by a path to a config.json, a directory holding one, or the name
of a shipped config in ``jobs/models/<name>.json`` (tiny-gpt2, tiny-bert, gpt2,
bert-large, llama-7b, tiny-vit, vit-base). As a last resort a Hugging Face id already
in the local cache is read offline. ``build_model`` turns the config into an untrained
model: ``AutoModelForCausalLM`` (causal-lm), ``AutoModelForSequenceClassification``
(seq-cls) or ``AutoModelForImageClassification`` (image-cls, e.g. a ViT).

Tasks and their inputs: the text tasks take ``input_ids`` of the plan's ``seq_len``
tokens; image-cls takes ``pixel_values`` of ``image_input_shape`` and ignores the
plan's ``seq_len`` (the encoder's sequence is fixed by the config: a ViT's patches
plus its CLS token, ``toolkit.modelshape.image_sequence``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import ConfigError, HpcmemError, UnknownNameError
from .files import read_small_json
from .resources import data_dir

TASKS = ("causal-lm", "seq-cls", "image-cls")
IMAGE_TASKS = ("image-cls",)
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
"""Plan attention -> transformers ``attn_implementation`` (the job builds the model so; the estimator traces it so)."""

# task -> the transformers auto class (toolkit.models.build_model) and its mapping of model types
_AUTO = {"causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
         "seq-cls": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
         "image-cls": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES")}


def models_dir() -> Path:
    """The directory of shipped model configs (``jobs/models``)."""
    return data_dir("jobs") / "models"


def shipped_models() -> list[str]:
    """Names of the shipped model configs."""
    return sorted(p.stem for p in models_dir().glob("*.json"))


def load_model_config(name_or_path: str) -> dict[str, Any]:
    """The config dict (with ``model_type``) for a path, a directory or a shipped name."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _read_config(path)
    if name_or_path.endswith(".json") or name_or_path.startswith(("/", ".", "~")):
        raise ConfigError(f"model config {path} does not exist")
    shipped = models_dir() / f"{name_or_path}.json"
    if shipped.is_file():
        return _read_config(shipped)
    cached = _cached_hub_config(name_or_path)
    if cached is not None:
        return _read_config(cached)
    if "/" in name_or_path:
        raise ConfigError(f"model {name_or_path!r} is not in the local Hugging Face cache ({hub_cache_dir()}); "
                          f"nothing is downloaded: on a machine with network run `huggingface-cli download {name_or_path} "
                          "config.json` (with the same HF_HOME), or copy its config.json here and give its path")
    raise UnknownNameError("model", name_or_path, shipped_models())


MAX_CONFIG_BYTES = 16 * 2**20
"""Largest model config.json read: real ones are a few KiB, up to about 1 MiB with a 21,843-class id2label
(ImageNet-21k ViTs); a larger file is not a model config."""


def _read_config(path: Path) -> dict[str, Any]:
    data = read_small_json(path, "model config", MAX_CONFIG_BYTES)
    if not isinstance(data, dict) or not data.get("model_type"):
        raise ConfigError(f"model config {path} needs a 'model_type' key (a transformers config.json)")
    return data


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser() / "hub"


def _cached_hub_config(model_id: str) -> Path | None:
    """The config.json of a model already in the local hub cache (read as files: no download, no transformers)."""
    repo = hub_cache_dir() / ("models--" + model_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = repo / "snapshots" / ref.read_text().strip() / "config.json"
        if candidate.is_file():
            return candidate
    found = sorted((repo / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def transformers_config(cfg: dict[str, Any], task: str):
    """A ``transformers.PretrainedConfig`` from a config dict, fitted for ``task``."""
    from transformers import AutoConfig

    check_task(task)
    check_model_task(cfg["model_type"], task)
    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    for key in ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:  # and huggingface_hub's field validation
        raise _refused(model_type, "config", exc) from None
    except Exception as exc:
        if type(exc).__module__.split(".")[0] not in ("transformers", "huggingface_hub"):
            raise
        raise _refused(model_type, "config", exc) from None
    if task == "causal-lm":
        config.use_cache = False  # no KV cache in training; it only costs memory
    if task == "seq-cls" and getattr(config, "pad_token_id", None) is None:
        # Decoder classifiers find the last token through the pad id.
        config.pad_token_id = getattr(config, "eos_token_id", None) or 0
    return config


def _refused(model_type: Any, what: str, exc: BaseException) -> ConfigError:
    """transformers' own refusal of a model config, as one line naming the model type."""
    detail = " ".join(str(exc).split())[:300] or type(exc).__name__
    return ConfigError(f"model config ({model_type}): transformers cannot build its {what}: {detail}")


def check_task(task: str) -> None:
    if task not in TASKS:
        raise ConfigError(f"task must be one of {', '.join(TASKS)}; got {task!r}")


def check_model_task(model_type: str, task: str) -> None:
    """A one-line ConfigError when transformers has no model of ``model_type`` for ``task``
    (a ViT asked for causal-lm, a GPT-2 for image-cls); types transformers does not know pass."""
    from transformers.models.auto import modeling_auto

    known = {t: getattr(modeling_auto, names) for t, (_, names) in _AUTO.items()}
    if model_type in known[task] or not any(model_type in m for m in known.values()):
        return
    fits = [t for t in TASKS if model_type in known[t]]
    raise ConfigError(f"task {task} does not fit model_type {model_type!r}: transformers has no "
                      f"{_AUTO[task][0]} for it (it fits {', '.join(fits)})")


def image_input_shape(config) -> tuple[int, int, int]:
    """(channels, height, width) of the ``pixel_values`` an image model takes, from its config."""
    size = config.image_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return int(getattr(config, "num_channels", 3)), int(height), int(width)


def random_image_batch(config, micro_batch: int, generator=None) -> dict[str, Any]:
    """A synthetic image-cls batch: fp32 ``pixel_values`` (micro_batch, C, H, W) drawn from N(0, 1)
    and integer ``labels`` in [0, num_labels), on the CPU."""
    import torch

    pixels = torch.randn(micro_batch, *image_input_shape(config), generator=generator)
    labels = torch.randint(0, int(getattr(config, "num_labels", 2) or 2), (micro_batch,), generator=generator)
    return {"pixel_values": pixels, "labels": labels}


def max_positions(config) -> int | None:
    """The longest sequence the model's position embeddings allow (None: unbounded, e.g. RoPE without a limit)."""
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def build_model(config, task: str, attn_implementation: str = "sdpa", dtype=None):
    """An untrained ``AutoModelForCausalLM`` / ``AutoModelForSequenceClassification`` /
    ``AutoModelForImageClassification`` (by ``task``) from ``config``.

    ``dtype`` (a torch dtype) builds the weights in that type directly (bf16-true).
    """
    import transformers

    check_task(task)
    auto = getattr(transformers, _AUTO[task][0])
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        return auto.from_config(config, **kwargs)
    except (KeyError, ValueError, TypeError) as exc:  # an activation or attention the model class refuses
        raise _refused(getattr(config, "model_type", "?"), "model", exc) from None


def count_parameters(model) -> int:
    """Parameters of ``model`` (ZeRO-3 partitioned ones counted at full size)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def build_optimizer(name: str, params, lr: float, foreach: bool | None = None):
    """The plan's optimizer built as its row in ``toolkit.optimizers`` says (a plan name or alias).

    ``foreach`` picks torch's multi-tensor implementation for the rows that leave it to torch
    (adamw, sgd: None is torch's default for the tensors' device); the rows that name an
    implementation (adamw-fused, adamw-perparam) keep theirs. ``adamw-fused`` is fused on CUDA
    tensors and, where torch has no fused kernel for the tensors' device, foreach.
    """
    import torch

    from .optimizers import ADAFACTOR_BETA1, SGD_MOMENTUM, get

    row = get(name)
    if row.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    if row.name == "adamw-fused":
        params = list(params)
        on_cuda = any(getattr(p, "is_cuda", False) for p in _flat_params(params))
        return torch.optim.AdamW(params, lr=lr, fused=True if on_cuda else None)
    if row.name == "adamw-perparam":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if row.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM, foreach=foreach)
    if row.name == "sgd-plain":
        return torch.optim.SGD(params, lr=lr, momentum=0.0, foreach=foreach)
    if row.name in ("adafactor", "adafactor-momentum"):
        from transformers.optimization import Adafactor

        beta1 = ADAFACTOR_BETA1 if row.name == "adafactor-momentum" else None
        return Adafactor(params, lr=lr, beta1=beta1, scale_parameter=False, relative_step=False, warmup_init=False)
    if row.name == "adamw-8bit":
        return import_bitsandbytes(row.name).optim.AdamW8bit(params, lr=lr)
    if row.name == "adamw-8bit-paged":
        return import_bitsandbytes(row.name).optim.PagedAdamW8bit(params, lr=lr)
    raise ConfigError(f"optimizer {row.name!r} has no builder in toolkit.models.build_optimizer")


def _flat_params(params):
    """Tensors of a parameter list or of param-group dicts."""
    for p in params:
        if isinstance(p, dict):
            yield from p.get("params", ())
        else:
            yield p


def import_bitsandbytes(optimizer: str = "adamw-8bit"):
    """bitsandbytes for the 8-bit optimizers, or an error saying it is missing (never a substitute)."""
    try:
        import bitsandbytes
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken CUDA set-up inside bitsandbytes
        first = str(exc).strip().splitlines()
        raise HpcmemError(f"optimizer={optimizer} needs bitsandbytes, which cannot be imported here "
                          f"({type(exc).__name__}: {first[0] if first else ''}); hpcmem does not substitute "
                          "another optimizer (pip install bitsandbytes, or set optimizer=adamw or adafactor)") from exc
    return bitsandbytes
