"""The optimizers hpcmem knows, as they really run: ONE table (``OPTIMIZERS``), name -> ``Optimizer``.

In the style of litgpt's ``name_to_config``: every fact about an optimizer implementation lives in
its row, and every consumer reads the row instead of keeping its own map:

- the plan knob ``optimizer`` takes ``names()``;
- the HF Trainer's ``--optim`` (``transformers.training_args.OptimizerNames``) maps onto a row with
  ``from_hf_optim(name)``, and a row writes its own ``hf_optim`` (``row.hf_optim[0]``);
- DeepSpeed's config ``optimizer.type`` is ``row.deepspeed`` (None: the training code brings it);
- the estimator asks a row for its state bytes per tensor (``state_tensor_bytes``) and its step
  temporaries (``step_temp_bytes``, ``step_temp_tensors``);
- the ladder reads ``state_bytes_per_param`` (nominal, for quick arithmetic) and ``cost``;
- ``toolkit.models.build_optimizer`` builds ``row.build`` for real.

Facts (read from the sources, torch 2.x, transformers 5.x, bitsandbytes 0.4x):

- torch ``AdamW`` with ``foreach`` (the default for CUDA tensors, ``torch/optim/adam.py``
  ``_multi_tensor_adam``): two states (exp_avg, exp_avg_sq) in the parameter's dtype, created
  lazily at the first step, parameter by parameter; ``step()`` builds ``exp_avg_sq_sqrt =
  torch._foreach_sqrt(exp_avg_sqs)``, one parameter-sized tensor per parameter of a (device,
  dtype) group, alive until the update: a full state-sized temporary at once.
- torch ``AdamW(fused=True)`` (``torch._fused_adamw_``): one kernel, no temporaries; its step
  counters live on the device (a 4-byte tensor per parameter).
- a per-parameter loop (torch ``foreach=False``, the default on CPU tensors; HF's old
  ``transformers.AdamW`` = ``adamw_hf``, gone in transformers 5; DeepSpeed's ``DeepSpeedCPUAdam``
  runs on the host): ``denom = (exp_avg_sq.sqrt() / bc2).add_(eps)``: two temporaries of one
  parameter (torch), one (HF's old AdamW: ``exp_avg_sq.sqrt().add_(eps)``).
- bitsandbytes ``AdamW8bit`` (``adamw_bnb_8bit``, ``adamw_8bit``): block-wise 8-bit states, one byte
  per element per state plus an fp32 absmax per block of 256, for tensors of at least 4096
  elements (``min_8bit_size``); smaller tensors keep 32-bit states. A fused CUDA kernel: no
  temporaries. ``paged_adamw_8bit`` puts the states in CUDA unified memory (``cudaMallocManaged``),
  outside PyTorch's caching allocator: they show in nvidia-smi, not in ``memory_reserved``.
- transformers' ``Adafactor`` (``adafactor``; ``scale_parameter=False, relative_step=False``, no
  momentum: beta1=None): fp32 second moments factored into a row vector (shape[:-1]) and a column
  vector (shape[:-2] + shape[-1:]) per tensor of >= 2 dims, a full fp32 vector per 1-D tensor; its
  step works one parameter at a time on fp32 copies (``grad**2 + eps``, the row/col outer product,
  ``-update``): two fp32 copies of the parameter, four when the grads are 16-bit (their fp32 casts).
  With ``beta1`` set it also keeps a full momentum (``exp_avg``) in the grad's dtype.
- torch ``SGD`` with momentum: one momentum buffer (``clone(grad)`` at the first step), updated in
  place (foreach), no temporaries; without momentum: no state at all.

Costs are relative step-time factors for the ladder (AdamW foreach = 1.0); they are coarse
judgements, not fits: the fused kernel saves a little of the optimizer step, 8-bit adds its
(de)quantisation, paging adds host traffic under pressure, Adafactor's per-tensor loop is slower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Iterable, Sequence

from .errors import UnknownNameError

BNB_BLOCK = 256
"""bitsandbytes block-wise quantisation block (``optimizer.py``: blocksize 256 for the 8-bit states)."""
BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes ``min_8bit_size``: tensors with fewer elements keep 32-bit states."""
BNB_PAGED_MIN_NUMEL = 100_000
"""bitsandbytes pages a state buffer only for a parameter of at least this many elements
(``Optimizer8bit.get_state_buffer``: ``if not self.is_paged or p.numel() < 1e5`` makes a plain device tensor,
else ``F.get_paged``, CUDA unified memory); the block scales (``absmax``) are always plain device tensors."""
SGD_MOMENTUM = 0.9
ADAFACTOR_BETA1 = 0.9
"""beta1 of the momentum variant (transformers' Adafactor default is None: no momentum)."""


@dataclass(frozen=True)
class Optimizer:
    """One optimizer implementation as it runs: its states, its step's temporaries, its names."""

    name: str
    """the plan knob value"""
    summary: str
    family: str
    """what the ladder treats alike: adamw, adamw-8bit, adafactor, sgd"""
    build: str
    """what ``toolkit.models.build_optimizer`` builds (for people: the class and its arguments)"""
    full_states: int = 0
    """parameter-sized states in the state dtype (AdamW 2, SGD with momentum 1)"""
    quantized: bool = False
    """bitsandbytes block-wise 8-bit states (instead of ``full_states`` in the state dtype)"""
    factored: bool = False
    """Adafactor's fp32 row/column second moments (a full fp32 vector for 1-D tensors)"""
    temporaries: str = "none"
    """the step's transient memory: foreach (a state-sized copy of every parameter at once),
    per-param (``temp_copies`` state-sized copies of one parameter at a time), adafactor (fp32
    copies of one parameter), none (fused kernels, in-place updates)"""
    temp_copies: float = 0.0
    paged: bool = False
    """states in CUDA unified memory, outside the caching allocator"""
    device_steps: bool = False
    """a 4-byte step counter per parameter on the device (fused AdamW)"""
    hf_optim: tuple[str, ...] = ()
    """HF TrainingArguments ``optim`` values that build this (the first is the one hpcmem writes)"""
    deepspeed: str | None = None
    """DeepSpeed config ``optimizer.type`` (None: the training code brings its own optimizer)"""
    aliases: tuple[str, ...] = ()
    cost: float = 1.0
    """relative step time (AdamW foreach = 1.0)"""
    needs: str | None = None
    """a Python package the job needs beyond torch/transformers"""
    nominal_state_bytes: float = 0.0
    """state bytes per parameter for fp32 parameters, for quick arithmetic (the ladder)"""
    notes: tuple[str, ...] = field(default_factory=tuple)

    # -- memory ------------------------------------------------------------------------------

    def state_bytes_per_param(self, precision: str = "fp32") -> float:
        """Nominal optimizer-state bytes per parameter (states in the parameter's dtype: halved
        under bf16-true for torch's optimizers; 8-bit and Adafactor states do not follow it)."""
        if precision == "bf16-true" and not (self.quantized or self.factored):
            return self.nominal_state_bytes / 2.0
        return self.nominal_state_bytes

    def state_tensor_bytes(self, dims: Sequence[int], state_bytes: int, device: bool = True) -> list[int]:
        """The state tensors the caching allocator serves (bytes each, in creation order) for one parameter of
        shape ``dims`` whose states are ``state_bytes`` per element (the param's dtype for torch; fp32 for a
        DeepSpeed master copy). Step counters on the CPU are not counted, nor a paged optimizer's states in
        unified memory (``paged_state_bytes``). ``device``: the optimizer steps CUDA tensors (False: host tensors,
        a CPU partition or offload, where nothing is paged)."""
        numel = prod(dims) if dims else 1
        out: list[int] = []
        if self.device_steps:
            out.append(4)
        if self.quantized:
            paged = self.pages(numel, device)
            if numel >= BNB_MIN_8BIT_SIZE:
                absmax = 4 * -(-numel // BNB_BLOCK)
                out += [absmax, absmax] if paged else [numel, absmax, numel, absmax]
            elif not paged:
                out += [4 * numel, 4 * numel]
            return out
        if self.factored:
            if len(dims) >= 2:
                out += [4 * numel // dims[-1], 4 * numel // dims[-2]]
            else:
                out.append(4 * numel)
        out += [state_bytes * numel] * self.full_states
        return out

    def state_bytes(self, shapes: Iterable[tuple[Sequence[int], int]], state_bytes: int,
                    device: bool = True) -> float:
        """Bytes of optimizer state for ``shapes`` ((dims, count) pairs, e.g. ModelShape.shape_counts)."""
        return float(sum(count * sum(self.state_tensor_bytes(dims, state_bytes, device)) for dims, count in shapes))

    def pages(self, numel: int, device: bool = True) -> bool:
        """Whether a parameter of ``numel`` elements gets its states in unified memory (``BNB_PAGED_MIN_NUMEL``):
        only next to CUDA parameters (bitsandbytes makes plain tensors for host ones)."""
        return self.paged and device and numel >= BNB_PAGED_MIN_NUMEL

    def paged_state_bytes(self, dims: Sequence[int], device: bool = True) -> int:
        """Bytes of one parameter's states in CUDA unified memory (``F.get_paged``: the paged rows' two 8-bit
        states), outside the caching allocator; 0 where it keeps them with the others."""
        numel = prod(dims) if dims else 1
        return 2 * numel if self.pages(numel, device) else 0

    def paged_bytes(self, shapes: Iterable[tuple[Sequence[int], int]], device: bool = True) -> float:
        """``paged_state_bytes`` for ``shapes`` ((dims, count) pairs)."""
        return float(sum(count * self.paged_state_bytes(dims, device) for dims, count in shapes))

    def step_temp_bytes(self, numel: float, largest_numel: float, state_bytes: int, grad_bytes: int,
                        gpu: bool = True) -> float:
        """Peak transient bytes of one step over ``numel`` parameters whose largest has ``largest_numel``.

        ``gpu``: torch's default ``foreach`` holds on CUDA tensors; on CPU tensors torch loops per
        parameter (two copies of one parameter)."""
        if self.temporaries == "foreach":
            return state_bytes * numel if gpu else 2.0 * state_bytes * largest_numel
        if self.temporaries == "per-param":
            return self.temp_copies * state_bytes * largest_numel
        if self.temporaries == "adafactor":
            return (2 if grad_bytes == 4 else 4) * 4.0 * largest_numel
        return 0.0

    def step_temp_tensors(self, param_numels: Sequence[int], state_bytes: int, grad_bytes: int,
                          gpu: bool = True) -> list[list[int]]:
        """The step's temporaries as the allocator sees them: a list of waves, each a list of tensor
        sizes (bytes) allocated together and freed together before the next wave (foreach: one wave
        of every parameter; a per-parameter loop: one wave per parameter)."""
        if self.temporaries == "foreach" and gpu:
            return [[state_bytes * n for n in param_numels]]
        if self.temporaries == "foreach" or self.temporaries == "per-param":
            copies = 2 if self.temporaries == "foreach" else int(self.temp_copies)
            return [[state_bytes * n] * copies for n in param_numels]
        if self.temporaries == "adafactor":
            copies = 2 if grad_bytes == 4 else 4
            return [[4 * n] * copies for n in param_numels]
        return []


def _row(*args, **kwargs) -> Optimizer:
    return Optimizer(*args, **kwargs)


OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    _row("adamw", "torch AdamW, foreach (torch's default on CUDA)", "adamw",
         "torch.optim.AdamW(foreach=None)", full_states=2, temporaries="foreach",
         hf_optim=("adamw_torch", "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_apex_fused",
                   "adamw_anyprecision"),
         deepspeed="AdamW", aliases=("adamw-foreach", "adam"), cost=1.0, nominal_state_bytes=8.0),
    _row("adamw-fused", "torch AdamW, fused CUDA kernel (transformers 5's default optim)", "adamw",
         "torch.optim.AdamW(fused=True on CUDA)", full_states=2, temporaries="none", device_steps=True,
         hf_optim=("adamw_torch_fused",), deepspeed="AdamW", cost=0.99, nominal_state_bytes=8.0),
    _row("adamw-perparam", "AdamW one parameter at a time (torch foreach=False, HF's old AdamW, "
         "DeepSpeed's CPU Adam)", "adamw", "torch.optim.AdamW(foreach=False)", full_states=2,
         temporaries="per-param", temp_copies=2.0, hf_optim=("adamw_hf",), deepspeed="AdamW",
         aliases=("adamw-loop",), cost=1.02, nominal_state_bytes=8.0),
    _row("adamw-8bit", "bitsandbytes AdamW8bit, block-wise 8-bit states", "adamw-8bit",
         "bitsandbytes.optim.AdamW8bit", quantized=True, hf_optim=("adamw_bnb_8bit", "adamw_8bit"),
         aliases=("adamw8bit", "adamw_8bit"), cost=1.05, needs="bitsandbytes", nominal_state_bytes=2.0),
    _row("adamw-8bit-paged", "bitsandbytes PagedAdamW8bit, 8-bit states in CUDA unified memory", "adamw-8bit",
         "bitsandbytes.optim.PagedAdamW8bit", quantized=True, paged=True, hf_optim=("paged_adamw_8bit",),
         aliases=("paged-adamw-8bit",), cost=1.08, needs="bitsandbytes", nominal_state_bytes=2.0),
    _row("adafactor", "transformers Adafactor, factored fp32 second moments, no momentum", "adafactor",
         "transformers.optimization.Adafactor(scale_parameter=False, relative_step=False)", factored=True,
         temporaries="adafactor", hf_optim=("adafactor",), cost=1.10, nominal_state_bytes=0.5),
    _row("adafactor-momentum", "transformers Adafactor with beta1=0.9: factored second moments + full momentum",
         "adafactor", "transformers.optimization.Adafactor(beta1=0.9, scale_parameter=False, relative_step=False)",
         factored=True, full_states=1, temporaries="adafactor", cost=1.12, nominal_state_bytes=4.5),
    _row("sgd", "torch SGD with momentum 0.9 (foreach)", "sgd", "torch.optim.SGD(momentum=0.9)",
         full_states=1, hf_optim=("sgd",), deepspeed=None, aliases=("sgd-momentum",), cost=1.0,
         nominal_state_bytes=4.0),
    _row("sgd-plain", "torch SGD without momentum: no state", "sgd", "torch.optim.SGD(momentum=0)",
         cost=1.0, nominal_state_bytes=0.0),
)}
"""name -> Optimizer, in the order the CLI lists them."""

_BY_ALIAS = {alias: o.name for o in OPTIMIZERS.values() for alias in o.aliases}
_BY_HF = {hf: o.name for o in OPTIMIZERS.values() for hf in o.hf_optim}


def names() -> tuple[str, ...]:
    """The plan knob's values (CLI choices)."""
    return tuple(OPTIMIZERS)


def get(name: str) -> Optimizer:
    """The row for a plan name or an alias; an unknown name is an error listing the valid ones."""
    key = _BY_ALIAS.get(name, name)
    if key not in OPTIMIZERS:
        raise UnknownNameError("optimizer", name, list(OPTIMIZERS))
    return OPTIMIZERS[key]


def from_hf_optim(name: str) -> Optimizer:
    """The row an HF TrainingArguments ``optim`` value builds (a plan name or alias is accepted too)."""
    key = name.strip().lower()
    if key in _BY_HF:
        return OPTIMIZERS[_BY_HF[key]]
    if key in OPTIMIZERS or key in _BY_ALIAS:
        return get(key)
    raise UnknownNameError("HF optim", name, sorted(_BY_HF))


def hf_optim(name: str) -> str:
    """The HF ``optim`` value hpcmem writes for a plan optimizer (an error when HF has none)."""
    row = get(name)
    if not row.hf_optim:
        from .errors import ConfigError

        raise ConfigError(f"optimizer={row.name} has no HF Trainer optim value; use one of "
                          f"{', '.join(o.name for o in OPTIMIZERS.values() if o.hf_optim)}")
    return row.hf_optim[0]


def script_names() -> dict[str, str]:
    """Every name a training script or command line may use (HF optim values, plan names, aliases)
    -> the plan name: what triage's script reader and train.py's --optim accept."""
    out = {hf: o for hf, o in _BY_HF.items()}
    out.update(_BY_ALIAS)
    out.update({n: n for n in OPTIMIZERS})
    return out
