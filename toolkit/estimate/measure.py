"""Real memory of a training step on CPU tensors: what the estimators are checked against.

``measured_peak_bytes`` runs a steady-state step of a transformers model the way
``toolkit/runtime/train.py``'s torch loop does and returns the peak of live tensor storage
bytes (every op's outputs counted until their storage is freed). Used by the tests
and by benchmarks/estimator.py; needs torch and transformers (the ``job`` extra).
An image-cls model gets random ``pixel_values`` of its config's image size (the plan's
seq_len does not apply) and integer labels.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ..models import build_model, build_optimizer, random_image_batch, transformers_config
from ..plan import Plan


class LiveTensorBytes(TorchDispatchMode):
    """Bytes held by live tensor storages, and their peak. Every op's outputs are counted
    until their storage is freed; tensors made before (parameters, optimizer state) are
    added with ``track``."""

    def __init__(self):
        super().__init__()
        self.sizes = WeakIdKeyDictionary()
        self.refs = {}
        self.current = self.peak = 0

    def track(self, tensor):
        storage = tensor.untyped_storage()
        if storage in self.sizes:
            return
        nbytes = storage.nbytes()
        self.sizes[storage] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        key = id(storage)

        def freed(_ref, nbytes=nbytes, key=key):
            self.current -= nbytes
            self.refs.pop(key, None)

        self.refs[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out


def train_setup(cfg, task, p: Plan, device: str = "cpu"):
    """Model, optimizer and one-step function, as toolkit/runtime/train.py's torch loop builds them, on
    ``device`` ("cpu", or "cuda" for benchmarks/gpu_replay.py); the batches are drawn on the CPU either way."""
    torch.manual_seed(0)
    kind = torch.device(device).type
    config = transformers_config(cfg, task)
    model = build_model(config, task, "eager" if p.attention == "eager" else "sdpa",
                        dtype=torch.bfloat16 if p.precision == "bf16-true" else None).to(device)
    if p.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = build_optimizer(p.optimizer, model.parameters(), lr=1e-4)
    dtype = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(p.precision)
    scaler = torch.amp.GradScaler(kind) if p.precision == "fp16-mixed" else None
    gen = torch.Generator().manual_seed(1)

    def batch():
        if task == "image-cls":
            drawn = random_image_batch(config, p.micro_batch, gen)
        else:
            ids = torch.randint(0, config.vocab_size, (p.micro_batch, p.seq_len), generator=gen)
            labels = ids if task == "causal-lm" else torch.randint(0, 2, (p.micro_batch,), generator=gen)
            drawn = {"input_ids": ids, "labels": labels}
        return {k: v.to(device) for k, v in drawn.items()}

    def step():
        for _ in range(p.grad_accum):
            with torch.autocast(kind, dtype=dtype) if dtype else contextlib.nullcontext():
                loss = model(**batch()).loss / p.grad_accum
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, scaler, step


def measured_peak_bytes(cfg, task, p: Plan) -> int:
    """Peak live tensor bytes of a steady-state step (after one that created the optimizer state)."""
    model, opt, scaler, step = train_setup(cfg, task, p)
    for _ in range(5):  # GradScaler skips steps whose grads overflow; the states come with the first real one
        step()
        if opt.state:
            break
    mode = LiveTensorBytes()
    with mode:
        for t in [*model.parameters(), *model.buffers()]:
            mode.track(t)
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    mode.track(value)
        if scaler:
            mode.track(scaler._scale)
            mode.track(scaler._growth_tracker)
        step()
    return mode.peak




def allocator_peak_bytes(run):
    """(highest sum of live CPU allocations while ``run()`` runs, its result), from the profiler's memory events.

    Sees what the CPU allocator hands out, also buffers no tensor-level counter sees (oneDNN scratch).
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        result = run()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak, result
