"""FSDP2 on one CPU rank: what the analytic estimate says against what the CPU allocator hands out.

One rank (gloo, world size 1) runs hpcmem's own FSDP2 sharding (``strategies.fsdp.FSDP.shard``: each decoder layer,
then the root) of a small LLaMA whose root unit (embedding, final norm, untied head) is much larger than a layer,
so the root's reduction at the backward's end (``ModelStates.end_reduce_bytes``) and the head's gradient held
until then (``held_head_bytes``) decide the peak. On one rank FSDP2's reduce-scatter is its own copy of the input
into the output (``foreach_reduce``, world size 1: no collective), so what is measured is FSDP2's buffers and not
gloo's (on two gloo ranks a reduce-scatter runs as an all-reduce of the whole gradient: docs/estimator.md,
session 19). Measured: the bytes of the tensors alive before a steady-state step (parameter shards, optimizer
states) plus the highest sum of the CPU allocator's live allocations during it (the profiler's memory events,
``estimate.measure.allocator_peak_bytes``). Estimated: ``estimate_analytic`` on the test cluster's cpu partition.

    python3 benchmarks/fsdp_cpu_check.py            # every case, one line each
    python3 benchmarks/fsdp_cpu_check.py --json

Needs torch and transformers (the ``job`` extra). A check of the mechanism on CPU tensors, not of a GPU: CPU
FSDP2 has no separate streams and autocast on CPU differs from CUDA's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = {  # a LLaMA whose root (two 16000 x 256 matrices) is about ten layers' worth
    "model_type": "llama", "vocab_size": 16000, "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_act": "silu",
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
CASES = (  # (precision, reshard_after_forward, checkpointing, micro_batch, seq_len, optimizer)
    ("fp32", True, False, 2, 128, "adamw"),
    ("fp32", False, False, 2, 128, "adamw"),
    ("fp32", True, True, 2, 128, "adamw"),
    ("fp32", True, False, 8, 256, "adamw"),
    # little activation and a step without temporaries: the root's reduction at the backward's end is the peak
    ("fp32", True, False, 1, 16, "sgd-plain"),
    ("fp32", False, True, 1, 16, "sgd-plain"),
    # FSDP2's mixed precision: bf16 gathered weights and gradients, reduced in fp32 into the fp32 shards
    ("bf16-mixed", True, False, 2, 128, "adamw"),
    ("bf16-mixed", True, False, 1, 16, "sgd-plain"),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(precision: str, reshard: bool, ckpt: bool, micro_batch: int, seq_len: int, optimizer: str) -> dict:
    import torch

    from toolkit.estimate.analytic import estimate_analytic
    from toolkit.estimate.measure import allocator_peak_bytes
    from toolkit.models import build_model, build_optimizer, transformers_config
    from toolkit.modelshape import ModelShape
    from toolkit.plan import Plan
    from toolkit.sites import load_site
    from toolkit.strategies.fsdp import FSDP

    plan = Plan(launcher="fsdp", gpus_per_node=1, precision=precision, micro_batch=micro_batch, seq_len=seq_len,
                global_batch=micro_batch, checkpointing=ckpt, reshard_after_forward=reshard, attention="sdpa",
                optimizer=optimizer)
    torch.manual_seed(0)
    model = build_model(transformers_config(CONFIG, "causal-lm"), "causal-lm", "sdpa")
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    FSDP().shard(model, plan, torch.device("cpu"))
    opt = build_optimizer(optimizer, model.parameters(), lr=1e-4)  # torch's default: a loop on CPU tensors
    gen = torch.Generator().manual_seed(1)

    def step():
        ids = torch.randint(0, CONFIG["vocab_size"], (micro_batch, seq_len), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # the optimizer's states come with the first step
        step()
    before = {}
    for t in [*model.parameters(), *model.buffers()]:
        local = t.to_local() if hasattr(t, "to_local") else t
        before[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                before[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    during, _ = allocator_peak_bytes(step)
    measured = sum(before.values()) + during
    partition = load_site("testcluster").partition("cpu")
    est = estimate_analytic(ModelShape.from_config(CONFIG, "causal-lm"), plan, partition)
    mib = 2 ** 20
    return {"precision": precision, "reshard_after_forward": reshard, "checkpointing": ckpt, "optimizer": optimizer,
            "micro_batch": micro_batch, "seq_len": seq_len, "measured_mib": measured / mib,
            "before_step_mib": sum(before.values()) / mib, "estimated_mib": est.peak_allocated_mib,
            "error_pct": 100.0 * (est.peak_allocated_mib * mib - measured) / measured,
            "estimate_notes": [n for n in est.notes if n.startswith("peak")]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="machine output: one JSON object")
    ap.add_argument("--cases", default=None, metavar="I,J",
                    help=f"run only these cases (indices into CASES, 0-{len(CASES) - 1}; default all)")
    args = ap.parse_args(argv)
    try:
        picked = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else list(CASES)
    except (ValueError, IndexError):
        ap.error(f"--cases: expected comma-separated indices 0-{len(CASES) - 1}, got {args.cases!r}")
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rows = [measure(*case) for case in picked]
    finally:
        dist.destroy_process_group()
    if args.json:
        print(json.dumps({"config": CONFIG, "rows": rows}, indent=1))
        return 0
    print(f"{'precision':10} {'optimizer':10} {'reshard':7} {'ckpt':5} {'mb':>3} {'seq':>4} {'measured MiB':>13} "
          f"{'estimated':>10} {'err %':>6}  estimate's peak")
    for r in rows:
        print(f"{r['precision']:10} {r['optimizer']:10} {str(r['reshard_after_forward']):7} {str(r['checkpointing']):5} "
              f"{r['micro_batch']:>3} {r['seq_len']:>4} {r['measured_mib']:>13.1f} {r['estimated_mib']:>10.1f} "
              f"{r['error_pct']:>+6.1f}  {'; '.join(r['estimate_notes'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
