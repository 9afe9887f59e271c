"""The traced estimator: a fake-tensor training step against the same step on real tensors.

Accuracy, and why these tolerances:
- The fake trace and the same trace on real CPU tensors must agree: same operators, same
  output sizes, same lifetimes. This checks the fake tensors (and the transformers mask
  path, see traced._unpacked_batches). They agree to the byte except where a meta kernel
  differs from the CPU kernel: native_layer_norm's meta kernel returns 16-bit mean/rstd
  for a 16-bit input, the CPU kernel fp32 (2 x 4 bytes per token and layer norm):
  META_TOLERANCE.
- The reference is the plain step with nothing watching (traced.run_training_steps) and
  the CPU allocator's own count of live bytes (the profiler's memory events). The trace
  may only fall short, by buffers kernels allocate below the dispatcher that no tensor
  count can see: oneDNN's scratch in bf16 GEMMs (up to 0.23 MiB here), the RNG state
  checkpointing saves per layer (5 KiB). These are fixed sizes per call, not a share of
  the model, so the tolerance is SCRATCH_TOLERANCE bytes or 1 %, whichever is larger; on
  most cases here the trace is exact. On a GPU the matching cuBLAS workspace belongs to
  the partition's calibrated cuda_context.
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from toolkit import models  # noqa: E402
from toolkit.errors import ConfigError, PlanError  # noqa: E402
from toolkit.estimate import COMPONENTS, Estimate  # noqa: E402
from toolkit.estimate.measure import allocator_peak_bytes  # noqa: E402
from toolkit.estimate.traced import (  # noqa: E402
    CATEGORIES, HOST_BUFFER_FACTOR, MIB, PHASES, Trace, TracedModel, _device_behaviour, estimate_traced,
    run_training_steps, shard, trace_training,
)
from toolkit.plan import Plan  # noqa: E402
from toolkit.sites import Partition  # noqa: E402

SCRATCH_TOLERANCE = MIB // 2
META_TOLERANCE = 16 * 1024


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Real CPU steps on one thread: OpenMP spinning on a shared 2-core machine is 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def plan(**knobs) -> Plan:
    base = {"micro_batch": 2, "global_batch": 2, "seq_len": 64}
    base.update(knobs)
    if "global_batch" not in knobs:
        base["global_batch"] = base["micro_batch"] * base.get("grad_accum", 1) * base.get("gpus_per_node", 1)
    return Plan(**base)


def config(name: str, **changes) -> dict:
    return {**models.load_model_config(name), **changes}


@functools.lru_cache(maxsize=None)
def traced(name: str, task: str, target: str, **knobs) -> Trace:
    """A trace of a shipped model, shared between tests (a Trace is immutable)."""
    return trace_training(config(name), task, plan(**knobs), target=target)


def peak_bytes(trace: Trace) -> float:
    return sum(trace.peak()[1].values())


allocator_peak = allocator_peak_bytes


def gpu_partition(**changes) -> Partition:
    values = dict(site="t", name="gpu", slurm_partition="gpu", gpu_model="NVIDIA A100-SXM4-40GB", gpu_mem_gib=40.0,
                  gpus_per_node=4, cpus_per_node=32, host_mem_gib=256.0, nvme_path=None, nvme_gib=0.0,
                  max_time_min=600, cuda_context_mib=500.0, bf16=True, tf32=True, flash_attention=True)
    values.update(changes)
    return Partition(**values)


def cpu_partition(**changes) -> Partition:
    values = dict(site="t", name="cpu", slurm_partition="cpu", gpu_model=None, gpu_mem_gib=0.0, gpus_per_node=0,
                  cpus_per_node=4, host_mem_gib=16.0, nvme_path=None, nvme_gib=0.0, max_time_min=600,
                  cuda_context_mib=0.0, bf16=True, tf32=False, flash_attention=False, default_mem_mib=12288)
    values.update(changes)
    return Partition(**values)


# -- against real tensors -------------------------------------------------------------------

REAL_CASES = [
    ("tiny-gpt2", "causal-lm", {}),
    ("tiny-gpt2", "causal-lm", {"precision": "bf16-mixed", "checkpointing": True}),
    ("tiny-gpt2", "causal-lm", {"attention": "eager", "optimizer": "sgd", "launcher": "deepspeed"}),
    ("tiny-gpt2", "causal-lm", {"micro_batch": 1, "grad_accum": 2, "optimizer": "adafactor"}),
    ("tiny-bert", "seq-cls", {"precision": "bf16-true", "optimizer": "adamw-8bit"}),
    ("tiny-bert", "causal-lm", {"precision": "fp16-mixed", "attention": "eager"}),
    ("tiny-vit", "image-cls", {"checkpointing": True}),
    ("tiny-vit", "image-cls", {"precision": "bf16-mixed", "attention": "eager", "grad_accum": 2, "micro_batch": 2}),
]


def assert_close_to_real(fake: Trace, real: Trace, allocator_bytes: int) -> None:
    assert abs(peak_bytes(fake) - peak_bytes(real)) <= META_TOLERANCE  # fake tensors behave like real ones
    assert fake.step_ends == real.step_ends
    short = allocator_bytes - peak_bytes(real)
    assert 0 <= short <= max(SCRATCH_TOLERANCE, 0.01 * allocator_bytes)


@pytest.mark.parametrize("name,task,knobs", REAL_CASES, ids=lambda v: v if isinstance(v, str) else repr(v))
def test_trace_matches_the_same_step_on_real_tensors(name, task, knobs):
    p = plan(**{"micro_batch": 4, "seq_len": 128, **knobs})
    fake = trace_training(config(name), task, p, target="cpu")
    real = trace_training(config(name), task, p, target="cpu", fake=False)
    allocator_bytes, _ = allocator_peak(lambda: run_training_steps(config(name), task, p))
    assert_close_to_real(fake, real, allocator_bytes)


def test_model_factory_matches_real_tensors_and_arithmetic():
    def factory():
        module = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

        def make_batch(micro_batch, seq_len):
            return torch.randn(micro_batch, seq_len, 256)

        return module, make_batch, lambda out, batch: (out - batch).pow(2).mean()

    p = plan(micro_batch=4, seq_len=32)
    fake = trace_training(None, "any", p, target="cpu", model_factory=factory)
    real = trace_training(None, "any", p, target="cpu", model_factory=factory, fake=False)
    allocator_bytes, _ = allocator_peak(lambda: run_training_steps(None, "any", p, model_factory=factory))
    assert_close_to_real(fake, real, allocator_bytes)
    n = 256 * 1024 + 1024 + 1024 * 256 + 256
    assert fake.n_params == n
    # Steady state: fp32 weights, AdamW's two moments and one step counter per tensor.
    assert fake.step_ends[-1]["params"] == 4 * n
    assert fake.step_ends[-1]["optimizer"] == 8 * n + 4 * 4


def test_traces_repeat_exactly():
    p = plan(precision="bf16-mixed")
    first = trace_training(config("tiny-gpt2"), "causal-lm", p, target="cuda")
    again = trace_training(config("tiny-gpt2"), "causal-lm", p, target="cuda")
    assert first.samples == again.samples


# -- steps, phases, the plan's knobs ----------------------------------------------------------

def phase_max(trace: Trace, step: int, phase: str, category: str) -> int:
    index = CATEGORIES.index(category) + 2
    return max(s[index] for s in trace.samples if s[0] == step and s[1] == PHASES.index(phase))


def test_first_step_has_no_optimizer_state_second_step_does():
    trace = traced("tiny-gpt2", "causal-lm", "cpu")
    assert phase_max(trace, 0, "forward", "optimizer") == 0
    assert phase_max(trace, 0, "backward", "optimizer") == 0
    assert phase_max(trace, 1, "forward", "optimizer") == trace.step_ends[0]["optimizer"] > 0
    assert phase_max(trace, 1, "forward", "grads") == 0  # zero_grad(set_to_none=True)
    assert len(trace.step_ends) == 2


def n_tensors(name: str) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        module = models.build_model(models.transformers_config(config(name), "causal-lm"), "causal-lm")
    return len(list(module.parameters()))


@pytest.mark.parametrize("knobs,param_bytes,state_bytes", [
    ({}, 4, 8),                                                        # fp32 AdamW: 4 + 4 + 8
    ({"precision": "bf16-mixed"}, 4, 8),                               # torch autocast keeps fp32 weights
    ({"precision": "bf16-true"}, 2, 4),                                # bf16 weights, bf16 moments
    ({"launcher": "deepspeed", "precision": "bf16-mixed"}, 2, 12),     # DeepSpeed: 2 + 2 + 12 (16 psi)
    ({"launcher": "deepspeed", "precision": "bf16-true", "zero_stage": 1}, 2, 4),
    ({"optimizer": "sgd"}, 4, 4),                                      # momentum
])
def test_precision_and_optimizer_layouts(knobs, param_bytes, state_bytes):
    trace = traced("tiny-gpt2", "causal-lm", "cuda", **knobs)
    psi, tensors = trace.n_params, n_tensors("tiny-gpt2")
    steady = trace.step_ends[-1]
    assert steady["params"] == param_bytes * psi
    counters = 4 * tensors if knobs.get("optimizer", "adamw") == "adamw" else 0  # AdamW's fp32 step per tensor
    assert steady["optimizer"] == state_bytes * psi + counters


def test_adamw_8bit_state_is_sized_like_bitsandbytes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    trace = traced("tiny-gpt2", "causal-lm", "cuda", optimizer="adamw-8bit")
    with FakeTensorMode():
        module = models.build_model(models.transformers_config(config("tiny-gpt2"), "causal-lm"), "causal-lm")
        expected = sum(2 * p.numel() if p.numel() >= 4096 else 8 * p.numel() for p in module.parameters())
    assert trace.step_ends[-1]["optimizer"] == expected
    assert any("adamw-8bit" in note for note in trace.notes)


def test_grad_accumulation_meets_the_first_micro_batch_gradients():
    one = traced("tiny-gpt2", "causal-lm", "cpu")
    two = traced("tiny-gpt2", "causal-lm", "cpu", grad_accum=2)
    assert phase_max(one, 0, "forward", "grads") == 0
    assert phase_max(two, 0, "forward", "grads") == 4 * two.n_params
    assert peak_bytes(two) > peak_bytes(one)


def test_checkpointing_and_eager_attention_change_activations():
    p = dict(micro_batch=4, seq_len=256)
    act = {attention: phase_max(traced("tiny-gpt2", "causal-lm", "cuda", attention=attention, **p), 1, "forward",
                                "activations") for attention in ("sdpa", "eager")}
    act["ckpt"] = phase_max(traced("tiny-gpt2", "causal-lm", "cuda", checkpointing=True, **p), 1, "forward",
                            "activations")
    # eager keeps the fp32 (batch, heads, s, s) probabilities of each of the 2 layers; sdpa keeps a logsumexp.
    probabilities = 4 * 4 * 256 * 256 * 4
    assert 2 * probabilities * 0.95 <= act["eager"] - act["sdpa"] <= 2 * probabilities * 1.05
    assert act["ckpt"] < 0.6 * act["sdpa"]  # the logits and the loss's log-probabilities stay


def test_flash_is_traced_as_sdpa_with_a_note():
    trace = traced("tiny-gpt2", "causal-lm", "cuda", attention="flash")
    assert trace.samples == traced("tiny-gpt2", "causal-lm", "cuda").samples
    assert any("flash" in note for note in trace.notes)


def test_ddp_buckets_count_as_one_more_copy_of_the_gradients():
    single = traced("tiny-gpt2", "causal-lm", "cuda")
    ddp = traced("tiny-gpt2", "causal-lm", "cuda", gpus_per_node=2)
    assert ddp.step_ends[-1]["other"] == 4 * ddp.n_params
    assert peak_bytes(ddp) == peak_bytes(single) + 4 * ddp.n_params


# -- what CUDA does differently -----------------------------------------------------------------

def _factory(forward):
    """A one-linear model whose forward is ``forward(hidden)``; loss = mean of the output."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(128, 128)

        def forward(self, x):
            return forward(self.proj(x))

    return lambda: TracedModel(Model(), lambda b, s: torch.randn(b, s, 128), lambda out, batch: out.float().mean())


def forward_activations(forward, target: str, **knobs) -> int:
    trace = trace_training(None, "any", plan(micro_batch=4, seq_len=64, **knobs), target=target,
                           model_factory=_factory(forward))
    return phase_max(trace, 0, "forward", "activations")


def test_cuda_dropout_keeps_a_one_byte_mask():
    def forward(h):
        return nn.functional.dropout(h, 0.1, training=True)

    elements = 4 * 64 * 128
    # CPU: a float noise tensor; CUDA: a bool mask (both also keep the output).
    assert forward_activations(forward, "cpu") - forward_activations(forward, "cuda") == 3 * elements


def test_cuda_sdpa_with_dropout_stays_fused():
    def forward(h):
        q = h.view(4, 64, 4, 32).transpose(1, 2)
        return nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)

    attention_matrix = 4 * 4 * 64 * 64 * 4
    assert forward_activations(forward, "cpu") - forward_activations(forward, "cuda") >= 2 * attention_matrix


def test_cuda_autocast_policy_runs_pow_softmax_layer_norm_in_fp32():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), _device_behaviour("cuda", []), torch.autocast("cpu", dtype=torch.bfloat16):
        h = nn.functional.linear(torch.randn(4, 8), torch.randn(8, 8, requires_grad=True))
        assert h.dtype == torch.bfloat16  # matmuls in 16-bit on both
        assert torch.pow(h, 3.0).dtype == torch.float32
        assert torch.softmax(h, -1).dtype == torch.float32
        assert nn.functional.layer_norm(h, (8,)).dtype == torch.float32
        assert torch.einsum("ij,jk->ik", torch.randn(4, 8), torch.randn(8, 8)).dtype == torch.bfloat16
        assert h.sum().dtype == torch.float32

    def forward(h):
        return torch.pow(h, 3.0) + torch.softmax(h, -1)

    assert forward_activations(forward, "cuda", precision="bf16-mixed") > \
        forward_activations(forward, "cpu", precision="bf16-mixed")


def test_cuda_foreach_adamw_step_holds_a_parameter_sized_temporary():
    cpu, cuda = traced("tiny-gpt2", "causal-lm", "cpu"), traced("tiny-gpt2", "causal-lm", "cuda")
    states = cuda.step_ends[-1]["optimizer"]
    # foreach: sqrt(exp_avg_sq) for every parameter at once; per-tensor loop: two temporaries of one tensor.
    assert phase_max(cuda, 1, "optimizer", "optimizer") - states >= 4 * cuda.n_params
    assert phase_max(cpu, 1, "optimizer", "optimizer") - states <= 2 * cpu.largest_layer_bytes


def test_cuda_behaviour_is_removed_after_the_trace():
    trace_training(config("tiny-gpt2", resid_pdrop=0.1), "causal-lm", plan(precision="bf16-mixed"), target="cuda")
    x = torch.ones(8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.pow(x.bfloat16(), 3.0).dtype == torch.bfloat16
    assert type(nn.functional.dropout(x, 0.5, True).grad_fn).__name__ == "MulBackward0"


def test_cuda_target_traces_dropout_models_with_checkpointing():
    cfg = config("tiny-gpt2", resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1)
    trace = trace_training(cfg, "causal-lm", plan(precision="bf16-mixed", checkpointing=True), target="cuda")
    assert peak_bytes(trace) > 0


# -- ZeRO and offload: arithmetic on a literal trace ----------------------------------------------

def literal_trace() -> Trace:
    #          step phase  params buffers grads  act   temp  optim other
    samples = ((1, 0,      400,   0,      0,     300,  0,    1200, 0),   # forward
               (1, 1,      400,   0,      300,   100,  50,   1200, 0),   # backward
               (1, 2,      400,   0,      400,   0,    0,    1600, 0))   # optimizer step (+400 temporary)
    return Trace(samples=samples, step_ends=({"params": 400, "buffers": 0, "grads": 0, "activations": 0,
                                              "temporaries": 0, "optimizer": 1200, "other": 0},),
                 n_params=100, largest_layer_bytes=40, seconds=0.0)


def ds(**knobs) -> Plan:
    return Plan(launcher="deepspeed", nodes=1, gpus_per_node=4, micro_batch=1, global_batch=4, **knobs)


def test_zero_stages_shard_the_traced_categories():
    trace = literal_trace()
    none, _, _ = shard(trace, Plan(micro_batch=1, global_batch=1))
    assert sum(none.values()) == 2400
    one, _, _ = shard(trace, ds(zero_stage=1))
    assert one == {**dict.fromkeys(CATEGORIES, 0.0), "params": 400, "grads": 400, "optimizer": 400}
    two, _, _ = shard(trace, ds(zero_stage=2))
    # The sharded peak moves from the optimizer step (400+100+400) to the forward (400+300+300).
    assert two == {**dict.fromkeys(CATEGORIES, 0.0), "params": 400, "activations": 300, "optimizer": 300}
    three, _, notes = shard(trace, ds(zero_stage=3))
    assert three["params"] == 100 + 40  # a quarter, plus the largest layer gathered
    assert any("ZeRO-3" in note for note in notes)
    # with the model's shape, DeepSpeed's own device memory (strategies.deepspeed.model_states) replaces the
    # gathered layer, each part at its largest: gathered weights, gradient buckets, the offload hand-over
    from toolkit.strategies import ModelStates

    engine = ModelStates(params_bytes=0, grads_bytes=0, optimizer_bytes=0, persistent_grads=True, buffer_bytes=10,
                         gathered_bytes=70, step_temp_bytes=0, host_bytes_per_rank=0, reduce_temp_bytes=5,
                         grad_bucket_bytes=3)
    three, _, notes = shard(trace, ds(zero_stage=3), engine)
    assert three["params"] == 100 + 70 + 10 + 3 + 5
    assert any("gathered weights (its parameter coordinator)" in n for n in notes)


def test_fsdp_engine_memory_replaces_the_gathered_arithmetic_and_the_root_reduction_is_a_moment():
    """With the model's shape, FSDP's own device memory (strategies.fsdp.model_states) is added in the forward and
    backward, each part at its largest, in place of the traced weights scaled up (not at the optimizer step); the
    root's reduction in the backward's final callback is a moment of its own: the last backward sample's states,
    its gradient shard not made yet, with the root's unsharded gradients and reduce-scatter buffers."""
    from toolkit.strategies import ModelStates

    trace = literal_trace()
    fsdp = Plan(launcher="fsdp", nodes=1, gpus_per_node=4, micro_batch=1, global_batch=4)
    engine = ModelStates(params_bytes=0, grads_bytes=0, optimizer_bytes=0, persistent_grads=False, buffer_bytes=0,
                         gathered_bytes=60, step_temp_bytes=0, host_bytes_per_rank=0, grad_bucket_bytes=4,
                         reduce_extra_bytes=6, held_head_bytes=9, end_reduce_bytes=50, end_reduce_share=20)
    gpu, _, notes = shard(trace, fsdp, engine)
    # forward: 100 + 300 + 300 + (60 + 4 + max(6, 9)) = 773 > the root's reduction (100 + 75 - 20 + 300 + 50 = 505)
    assert gpu["params"] == 100 + 60 + 4 + 9 and gpu["activations"] == 300
    assert any("FSDP's own device memory" in n for n in notes)
    big_root = ModelStates(**{**engine.__dict__, "end_reduce_bytes": 600})
    end, _, _ = shard(trace, fsdp, big_root)
    assert end == {**dict.fromkeys(CATEGORIES, 0.0), "params": 100, "grads": 75 - 20, "temporaries": 600,
                   "optimizer": 300}


def test_fsdp_without_resharding_keeps_the_whole_model_gathered_through_forward_and_backward_only():
    trace = literal_trace()
    fsdp = functools.partial(Plan, launcher="fsdp", nodes=1, gpus_per_node=4, micro_batch=1, global_batch=4)
    # FULL_SHARD: a quarter of every state, plus the prefetched layers gathered (2 x 40)
    full, _, _ = shard(trace, fsdp(precision="fp32"))
    assert full == {**dict.fromkeys(CATEGORIES, 0.0), "params": 100 + 80, "activations": 300, "optimizer": 300}
    # SHARD_GRAD_OP: the shards, and on top of them the whole fp32 model from the forward to the backward
    # (forward: 100 + 400 + 300 + 300 = 1100 > the step's 100 + 100 + 400)
    kept, _, notes = shard(trace, fsdp(precision="fp32", reshard_after_forward=False))
    assert kept == {**dict.fromkeys(CATEGORIES, 0.0), "params": 100 + 400, "activations": 300, "optimizer": 300}
    assert any("gathered from each layer's forward to its backward" in n for n in notes)
    # under FSDP mixed precision the traced weights are already the 16-bit copy the gathered weights are kept in
    assert fsdp(precision="bf16-mixed").strategy.layout(fsdp(precision="bf16-mixed")).weights == "bfloat16"
    mixed, _, _ = shard(trace, fsdp(precision="bf16-mixed", reshard_after_forward=False))
    assert mixed["params"] == 100 + 400
    # when the step is the peak, no gathered copy is counted there
    step_heavy = Trace(samples=trace.samples[:2] + ((1, 2, 400, 0, 400, 0, 0, 8000, 0),), step_ends=trace.step_ends,
                       n_params=100, largest_layer_bytes=40, seconds=0.0)
    at_step, _, _ = shard(step_heavy, fsdp(precision="fp32", reshard_after_forward=False))
    assert at_step["params"] == 100 and at_step["optimizer"] == 2000


def test_offload_moves_states_to_the_host():
    trace = literal_trace()
    gpu, host, _ = shard(trace, ds(zero_stage=2, offload_optimizer="cpu"))
    # from ZeRO-2 on the gradients are reduced through the bucket into the host's partition: none stay on the GPU
    assert gpu["optimizer"] == 0 and gpu["grads"] == 0
    one, _, _ = shard(trace, ds(zero_stage=1, offload_optimizer="cpu"))
    assert one["grads"] > 0  # ZeRO-1 keeps the whole 16-bit gradients on the device
    # Each of the node's 4 ranks keeps a quarter of the fp32 state and of the fp32 gradients (4 bytes x 100).
    assert host == pytest.approx(4 * (1200 + 400) / 4 * HOST_BUFFER_FACTOR)
    gpu, host, _ = shard(trace, ds(zero_stage=3, offload_optimizer="cpu", offload_params="cpu"))
    assert gpu["params"] == 40 and gpu["optimizer"] == 0
    assert host == pytest.approx((1200 + 400 + 400) * HOST_BUFFER_FACTOR)
    gpu, host, notes = shard(trace, ds(zero_stage=3, offload_optimizer="nvme", offload_params="nvme"))
    assert host == 0 and gpu["optimizer"] == 0 and any("NVMe" in note for note in notes)


# -- the Estimate -------------------------------------------------------------------------------

def test_estimate_fields_add_up():
    p = plan()
    est = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition(), allocator_overhead_frac=0.1)
    assert isinstance(est, Estimate) and est.method == "traced"
    assert tuple(est.components) == COMPONENTS
    tensors = sum(est.components[k] for k in ("params", "grads", "optimizer", "activations", "temporaries"))
    assert tensors == pytest.approx(est.peak_allocated_mib, abs=0.01)
    assert est.components["cuda_context"] == 500.0
    # reserved: the recorded stream's replay, raised to a measured 10 % over allocated where that says more
    assert est.peak_reserved_mib >= 1.1 * est.peak_allocated_mib - 0.01
    assert est.components["allocator_overhead"] == pytest.approx(est.peak_reserved_mib - est.peak_allocated_mib,
                                                                 abs=0.01)
    assert est.device_used_mib == pytest.approx(500 + est.peak_reserved_mib, abs=0.01)
    assert any("caching allocator replayed" in note for note in est.notes) and est.segments > 0
    assert est.capacity_mib == 40 * 1024
    assert est.headroom_mib == pytest.approx(est.capacity_mib - est.device_used_mib, abs=0.01)
    assert est.fits and est.host_mib_per_node == 0
    assert any("CUDA would run it" in note for note in est.notes)
    assert est.to_dict()["components"] == dict(est.components)


def test_estimate_with_zero_offload_and_overrides():
    p = Plan(launcher="deepspeed", gpus_per_node=4, micro_batch=2, global_batch=8, seq_len=64, precision="bf16-mixed",
             zero_stage=2, offload_optimizer="cpu")
    est = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition(gpu_mem_gib=0.5), cuda_context_mib=100)
    assert est.components["optimizer"] == 0
    assert est.components["cuda_context"] == 100
    assert est.host_mib_per_node > 0
    assert est.fits is (est.headroom_mib >= 0)
    tiny = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition(gpu_mem_gib=0.05), cuda_context_mib=100)
    assert not tiny.fits and tiny.headroom_mib < 0


def test_estimate_on_a_cpu_partition_uses_each_ranks_share_of_host_memory():
    p = plan(gpus_per_node=2)
    est = estimate_traced(config("tiny-bert"), "seq-cls", p, cpu_partition())
    assert est.capacity_mib == 12288 / 2
    assert not any("CUDA would run it" in note for note in est.notes)
    assert est.fits


def test_estimate_notes_a_plan_the_partition_cannot_run():
    est = estimate_traced(config("tiny-gpt2"), "causal-lm", plan(precision="bf16-mixed"),
                          gpu_partition(gpu_model="Tesla V100-SXM2-16GB", bf16=False))
    assert any("cannot run this plan" in note for note in est.notes)


# -- bad input -----------------------------------------------------------------------------------

def test_bad_input_is_refused_clearly():
    with pytest.raises(ConfigError, match="steps"):
        estimate_traced(config("tiny-gpt2"), "causal-lm", plan(), gpu_partition(), steps=0)
    with pytest.raises(PlanError, match="seq_len 1024 is longer than the model's 512 positions"):
        trace_training(config("tiny-gpt2"), "causal-lm", plan(seq_len=1024))
    with pytest.raises(ConfigError, match="model config or a model_factory"):
        trace_training(None, "causal-lm", plan())
    with pytest.raises(ConfigError, match="must return a TracedModel"):
        trace_training(None, "any", plan(), model_factory=lambda: nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="fake=False needs target='cpu'"):
        trace_training(config("tiny-gpt2"), "causal-lm", plan(), target="cuda", fake=False)
    with pytest.raises(ConfigError, match="task must be one of"):
        trace_training(config("tiny-gpt2"), "translation", plan())
    with pytest.raises(ConfigError, match="task image-cls does not fit model_type 'gpt2'"):
        trace_training(config("tiny-gpt2"), "image-cls", plan())
    with pytest.raises(ConfigError, match="task causal-lm does not fit model_type 'vit'"):
        trace_training(config("tiny-vit"), "causal-lm", plan())


def test_factory_output_without_a_loss_asks_for_loss_fn():
    factory = _factory(lambda h: h)  # output is not a scalar and there is no loss_fn
    broken = lambda: TracedModel(factory().module, factory().make_batch)  # noqa: E731
    with pytest.raises(ConfigError, match="loss_fn"):
        trace_training(None, "any", plan(), model_factory=broken)


def test_one_step_says_it_has_no_steady_state():
    trace = trace_training(config("tiny-gpt2"), "causal-lm", plan(), steps=1)
    assert len(trace.step_ends) == 1 and any("no steady state" in note for note in trace.notes)
    assert math.isfinite(peak_bytes(trace))


# -- image classification (ViT) ------------------------------------------------------------------

def test_image_cls_trace_equals_the_trainers_real_step():
    """The fake trace against measure.py's real step (train.py's loop: the batch dropped after the forward)."""
    from toolkit.estimate.measure import measured_peak_bytes

    for knobs in ({"micro_batch": 16}, {"micro_batch": 16, "precision": "bf16-mixed", "checkpointing": True}):
        p = plan(**knobs)
        assert peak_bytes(trace_training(config("tiny-vit"), "image-cls", p, target="cpu")) == \
            measured_peak_bytes(config("tiny-vit"), "image-cls", p)


def test_image_cls_takes_pixels_of_the_config_and_ignores_seq_len():
    short = trace_training(config("tiny-vit"), "image-cls", plan(seq_len=8), target="cpu")
    long = trace_training(config("tiny-vit"), "image-cls", plan(seq_len=4096), target="cpu")  # past any position table
    assert short.samples == long.samples
    assert any("3x32x32 pixels" in note and "does not apply" in note for note in long.notes)
    bigger = trace_training(config("tiny-vit", image_size=64), "image-cls", plan(), target="cpu")
    assert peak_bytes(bigger) > peak_bytes(short)  # 65 patches + CLS instead of 17


def test_vit_base_traced_and_analytic_agree_on_a_gpu_partition():
    """Two independent derivations of a ViT-B/16 step (CUDA behaviour traced, arithmetic): within 2 %."""
    from toolkit.estimate import estimate, model_ref

    p = plan(micro_batch=32, precision="bf16-mixed")
    part = gpu_partition()
    traced_est = estimate(model_ref("vit-base", "image-cls"), p, part, method="traced")
    analytic_est = estimate(model_ref("vit-base", "image-cls"), p, part, method="analytic")
    assert traced_est.peak_allocated_mib == pytest.approx(analytic_est.peak_allocated_mib, rel=0.02)
    assert traced_est.fits and traced_est.components["params"] == pytest.approx(4 * 86_567_656 / MIB, abs=0.01)


def test_the_recorded_stream_replays_to_a_reserved_peak_at_least_the_allocated_one():
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.traced import record_training

    p = plan()
    events = record_training(config("tiny-gpt2"), "causal-lm", p, steps=2)
    assert [e[1] for e in events if e[0] == "mark"] == ["step 1", "step 2"]
    r = replay(events)
    trace = trace_training(config("tiny-gpt2"), "causal-lm", p)
    traced_peak, _ = trace.peak()
    # the same step, counted two ways: storages alive (MemTracker) and blocks (the allocator model, 512 B rounded)
    assert r.peak_allocated >= 0.95 * sum(trace.samples[traced_peak][2:])
    assert r.peak_reserved >= r.peak_allocated
    est = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition())
    assert est.peak_reserved_mib >= est.peak_allocated_mib and est.fits_allocated


def test_the_recorded_ddp_stream_builds_one_bucket_and_rebuilds_it_at_the_second_step():
    """Over several ranks the recorded stream holds DDP's construction (the broadcast's flat copy, the Reducer's one
    bucket of every gradient) and its rebuild at the second step, the analytic stream's recipe
    (stream.ddp_construction); on Lightning's own stream with Runtime.ddp_side_stream."""
    from toolkit.estimate.stream import DDP_BUILD_STREAM
    from toolkit.estimate.traced import record_training

    p = plan(gpus_per_node=2)
    for side in (False, True):
        events = record_training(config("tiny-gpt2"), "causal-lm", p, steps=2, ddp_side_stream=side)
        step1, step2 = events.index(("mark", "step 1")), events.index(("mark", "step 2"))
        copy, bucket = [e for e in events[:step1] if e[0] == "alloc"][-2:]  # a tiny model: one broadcast copy
        assert copy[2] == bucket[2] and ("free", copy[1]) in events[:step1]  # fp32 weights and grads: one size
        assert all((len(e) == 4 and e[3] == DDP_BUILD_STREAM) == side for e in (copy, bucket))
        assert events[step2 + 1] == ("free", bucket[1])  # the rebuild frees it before the second forward
        rebuilt = [e for e in events[step2 + 2:] if e[0] == "alloc"]
        sums = list(itertools.accumulate(e[2] for e in rebuilt))
        assert bucket[2] in sums[:64]  # the rebuilt buckets, first after the free, hold every gradient again
    one = record_training(config("tiny-gpt2"), "causal-lm", plan(), steps=2)
    assert not any(len(e) == 4 for e in one)


def test_the_recorded_stream_takes_the_cublas_workspaces_where_the_analytic_one_does():
    """``workspaces`` (stream.gemm_workspaces): the forward thread's before the first step, the autograd thread's
    before the first backward (after the forward's allocations), each once and kept; the traced estimate replays
    them for a GPU partition."""
    from toolkit.estimate.traced import record_training

    fwd, bwd = 1111 * 1024, 2222 * 1024  # sizes no tensor of the tiny model has
    events = record_training(config("tiny-gpt2"), "causal-lm", plan(), steps=2, workspaces=((fwd,), (bwd,)))
    step1, step2 = events.index(("mark", "step 1")), events.index(("mark", "step 2"))
    f = [i for i, e in enumerate(events) if e[0] == "alloc" and e[2] == fwd]
    b = [i for i, e in enumerate(events) if e[0] == "alloc" and e[2] == bwd]
    assert len(f) == len(b) == 1 and f[0] < step1 < b[0] < step2
    assert any(e[0] == "alloc" for e in events[step1 + 1:b[0]])  # the forward ran first
    kept = {events[f[0]][1], events[b[0]][1]}
    assert not any(e[0] == "free" and e[1] in kept for e in events)
    plain = record_training(config("tiny-gpt2"), "causal-lm", plan(), steps=2)
    assert len(events) == len(plain) + 2


def test_an_older_runtime_keeps_the_gradients_in_the_trace():
    from toolkit.estimate.gpu import Runtime

    p = plan()
    today = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition())
    old = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition(), runtime=Runtime(torch_version="1.10"))
    assert old.peak_allocated_mib > today.peak_allocated_mib
    assert any("zero_grad keeps the gradients" in n for n in old.notes)
    assert "cublas_workspace" in old.gpu_extras_mib


def test_zero_grad_before_backward_keeps_the_last_steps_gradients_through_the_forward():
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.traced import record_training

    p = plan()
    late = Runtime(zero_grad="before_backward")
    today = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition())
    est = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition(), runtime=late)
    assert est.peak_allocated_mib > today.peak_allocated_mib
    assert any("between the loss and the backward" in n for n in est.notes)
    # the recorded stream: nothing is freed between step 1's optimizer step and step 2's forward
    events = record_training(config("tiny-gpt2"), "causal-lm", p, zero_before_backward=True)
    usual = record_training(config("tiny-gpt2"), "causal-lm", p)

    def live_at_step2(ev):
        live = {}
        for e in ev:
            if e[0] == "mark" and e[1] == "step 2":
                return sum(live.values())
            if e[0] == "alloc":
                live[e[1]] = e[2]
            elif e[0] == "free":
                live.pop(e[1], None)
        raise AssertionError("no step 2 mark")

    assert live_at_step2(events) > live_at_step2(usual)


def test_a_loss_on_16bit_logits_keeps_no_fp32_copy_in_the_trace():
    from toolkit.estimate.gpu import Runtime

    p = plan(precision="bf16-true", micro_batch=4, seq_len=64)
    today = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition())
    lean = estimate_traced(config("tiny-gpt2"), "causal-lm", p, gpu_partition(), runtime=Runtime(logits_fp32=False))
    assert lean.peak_allocated_mib < today.peak_allocated_mib
    assert any("no fp32 upcast" in n for n in lean.notes)


def test_torch_before_1_11_softmax_keeps_its_input_in_the_trace():
    from toolkit.estimate.gpu import Runtime

    cfg = config("tiny-bert")
    p = plan(attention="eager", micro_batch=4, seq_len=64)
    new = estimate_traced(cfg, "seq-cls", p, gpu_partition(), runtime=Runtime(torch_version="1.11"),
                          allocator_model=False)
    old = estimate_traced(cfg, "seq-cls", p, gpu_partition(), runtime=Runtime(torch_version="1.10"),
                          allocator_model=False)
    assert any("softmax keeps its input" in n for n in old.notes)
    # one fp32 a x s x s matrix more per layer, alive from its forward to its backward
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    matrices = layers * 4 * heads * 64 * 64 * 4 / 2**20
    assert old.components["activations"] - new.components["activations"] == pytest.approx(matrices, rel=0.05)


def added_by_variant(variant: dict, base: dict, sizes: dict, p: Plan) -> dict[str, float]:
    """What a LLaMA-layout variant adds to the model it extends (peak allocated MiB on a GPU partition, both at
    ``sizes``), by method: the traced CUDA step and the arithmetic. A difference isolates the variant's own
    tensors from what the two methods already differ by in the shared parts."""
    from toolkit.estimate import ModelRef, estimate

    added = {}
    for method in ("traced", "analytic"):
        peaks = [estimate(ModelRef({**cfg, **sizes}, "causal-lm", None, cfg["model_type"]), p, gpu_partition(),
                          method=method).peak_allocated_mib for cfg in (variant, base)]
        added[method] = peaks[0] - peaks[1]
    return added


@pytest.mark.parametrize("kept", ["model_output", "logits"])
def test_a_kept_output_costs_the_same_traced_and_analytic(kept):
    """Runtime.output_kept: the traced loop keeps each micro-batch's output (a transformers model given labels
    computes its loss inside the forward, so both rules let the previous one go once the next forward returns);
    the arithmetic keeps the model's logits. Both add the logits of one micro-batch (bf16: 2 bytes each) to a
    peak after the forward; the replayed stream reserves no less (its segments may have room)."""
    from model_configs import TINY_LLAMA

    from toolkit.estimate import ModelRef, estimate
    from toolkit.estimate.gpu import Runtime

    p = plan(micro_batch=4, seq_len=256, precision="bf16-mixed", optimizer="adamw", grad_accum=2)
    ref = ModelRef(TINY_LLAMA, "causal-lm", None, "llama")
    logits = 2 * 4 * 256 * TINY_LLAMA["vocab_size"] / 2 ** 20
    for method in ("traced", "analytic"):
        runs = [estimate(ref, p, gpu_partition(), method=method, runtime=runtime)
                for runtime in (Runtime(output_kept=kept), Runtime())]
        assert runs[0].peak_allocated_mib - runs[1].peak_allocated_mib == pytest.approx(logits, abs=0.5), method
        assert runs[0].peak_reserved_mib >= runs[1].peak_reserved_mib, method


def test_a_paged_optimizer_traced_as_the_arithmetic_counts_it():
    """PagedAdamW8bit on CUDA: the stand-in makes no device states for a parameter of 1e5 elements or more, and the
    estimate puts them beside the allocator, resident as room allows (as the analytic method does); offloaded
    states are host tensors in both."""
    from model_configs import TINY_LLAMA

    from toolkit import optimizers
    from toolkit.estimate import ModelRef, estimate
    from toolkit.modelshape import ModelShape

    ref = ModelRef(TINY_LLAMA, "causal-lm", None, "llama")
    shape = ModelShape.from_config(TINY_LLAMA)
    states = optimizers.get("adamw-8bit-paged").paged_bytes(shape.shape_counts) / 2 ** 20
    assert states > 1
    for method in ("traced", "analytic"):
        paged, plain = (estimate(ref, plan(optimizer=o), gpu_partition(), method=method)
                        for o in ("adamw-8bit-paged", "adamw-8bit"))
        assert plain.peak_allocated_mib - paged.peak_allocated_mib == pytest.approx(states, abs=0.5), method
        assert any(n.startswith(f"paged optimizer states: {states:.0f} MiB") for n in paged.notes), method
        # offloaded, the states are host tensors: nothing paged
        off = [estimate(ref, plan(optimizer=o, launcher="deepspeed", zero_stage=2, offload_optimizer="cpu"),
                        gpu_partition(), method=method) for o in ("adamw-8bit-paged", "adamw-8bit")]
        assert off[0].host_mib_per_node == pytest.approx(off[1].host_mib_per_node), method
    cpu = [estimate(ref, plan(optimizer=o), cpu_partition(), method="traced").peak_allocated_mib
           for o in ("adamw-8bit-paged", "adamw-8bit")]
    assert cpu[0] == cpu[1]


def test_one_process_wrapped_in_ddp_costs_the_same_traced_and_analytic():
    """Runtime.ddp_single_process: DDP's construction and gradient buckets on one GPU, in both methods the same
    as over two ranks."""
    from model_configs import TINY_LLAMA

    from toolkit.estimate import ModelRef, estimate
    from toolkit.estimate.gpu import Runtime

    one, two = plan(precision="bf16-mixed"), plan(precision="bf16-mixed", gpus_per_node=2)
    ref = ModelRef(TINY_LLAMA, "causal-lm", None, "llama")
    for method in ("traced", "analytic"):
        wrapped, bare, pair = (estimate(ref, q, gpu_partition(), method=method, runtime=r).peak_allocated_mib
                               for q, r in ((one, Runtime(ddp_single_process=True)), (one, None), (two, None)))
        assert wrapped - bare == pytest.approx(pair - bare, abs=0.5) and wrapped - bare > 1, method


@pytest.mark.parametrize("window, precision", [(None, "bf16-mixed"), (None, "bf16-true"), (None, "fp32"),
                                               (256, "bf16-true")])
def test_phi3_fused_projections_cost_the_same_traced_and_analytic(window, precision):
    """What Phi-3's fused projections add to LLaMA's layer (the value's view keeping the whole fused output, one
    autocast copy per projection, o_proj's input copied back from the query's layout), derived twice. The traced
    step runs the CPU's SDPA kernel, whose output keeps the query's layout also where CUDA's memory-efficient
    kernel (fp32, or the mask of an attention window no longer than the sequence) lays it out itself: there its
    difference is above by that copy (micro-batch x tokens x hidden, per layer). Grouped-query attention (two
    key/value heads for eight): the traced step keeps the shared heads unrepeated, as CUDA's kernels do, so the
    value's view of the fused output stays what is saved."""
    from model_configs import TINY_LLAMA, TINY_PHI3

    sizes = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1376,
             "num_hidden_layers": 4, "sliding_window": window}
    added = added_by_variant(TINY_PHI3, TINY_LLAMA, sizes,
                             plan(micro_batch=4, seq_len=512, precision=precision, optimizer="sgd"))
    memory_efficient = precision == "fp32" or window is not None
    copy = 4 * 512 * 512 * (4 if precision == "fp32" else 2) * 4 / MIB if memory_efficient else 0.0
    assert abs(added["analytic"]) > 1  # MiB; bf16-mixed: fewer autocast copies outweigh the view (-6 MiB here)
    assert added["traced"] - copy == pytest.approx(added["analytic"], abs=0.5)


GEMMA_SIZES = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
               "intermediate_size": 2048, "vocab_size": 32000}


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_gemma2_sandwich_norms_and_softcaps_cost_the_same_traced_and_analytic(precision):
    """What Gemma 2 adds to Gemma's layer and head (two more norms per layer, each keeping its fp32 input; the
    soft-capped scores' and logits' tanh outputs), traced and analytic, to the MiB (eager attention:
    transformers gives Gemma 2 no SDPA path)."""
    from model_configs import TINY_GEMMA, TINY_GEMMA2

    added = added_by_variant(TINY_GEMMA2, TINY_GEMMA, {**GEMMA_SIZES, "num_hidden_layers": 4},
                             plan(micro_batch=4, seq_len=512, precision=precision, optimizer="sgd",
                                  attention="eager"))
    assert added["analytic"] > 200  # MiB: the norms alone are 2 x 4 layers x 2048 tokens x 512 x 4 bytes
    assert added["traced"] == pytest.approx(added["analytic"], abs=0.5)


@pytest.mark.parametrize("window, precision", [(4096, "bf16-mixed"), (256, "bf16-mixed"), (256, "fp32")])
def test_gemma3_norms_and_window_cost_the_same_traced_and_analytic(window, precision):
    """What Gemma 3's text model adds to Gemma's (four norms per layer, Gemma-style norms on each head's queries
    and keys; with a window no longer than the sequence, SDPA's mask on the windowed layers), traced and analytic
    under SDPA, to the MiB. Five layers: all windowed (transformers' default pattern makes every sixth layer a
    full one)."""
    from model_configs import TINY_GEMMA, TINY_GEMMA3

    added = added_by_variant(TINY_GEMMA3, TINY_GEMMA,
                             {**GEMMA_SIZES, "num_hidden_layers": 5, "sliding_window": window},
                             plan(micro_batch=4, seq_len=512, precision=precision, optimizer="sgd"))
    assert added["analytic"] > 100
    assert added["traced"] == pytest.approx(added["analytic"], abs=0.5)


def test_cuda_sdpa_keeps_shared_key_value_heads_at_their_own_width():
    """Grouped-query attention traced as CUDA runs it: the same output and gradients as torch's own GQA SDPA, and
    the keys and values saved for backward unrepeated (a repeat made for the CPU's kernel is freed inside the
    forward)."""
    from toolkit.estimate.traced import _GroupedSdpa

    torch.manual_seed(0)
    for mask in (None, torch.randn(2, 1, 16, 16)):
        q, k, v = (torch.randn(2, heads, 16, 32, requires_grad=True) for heads in (8, 2, 2))
        out = _GroupedSdpa.apply(q, k, v, mask, 0.0, mask is None, None)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                               enable_gqa=True)
        grad = torch.randn_like(out)
        ours, theirs = torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)
        assert torch.allclose(out, ref, atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(ours, theirs))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        _GroupedSdpa.apply(q, k, v, None, 0.0, True, None)
    assert torch.Size([2, 2, 16, 32]) in saved and torch.Size([2, 8, 16, 32]) in saved  # k, v at 2 heads; q, out at 8
    assert saved.count(torch.Size([2, 8, 16, 32])) == 2



def test_a_runtime_that_repeats_kv_before_sdpa_is_traced_so():
    """``Runtime.sdpa_repeats_kv`` (transformers before PR #39412, torchtune, litgpt): the traced step hands SDPA
    the repeats, which it then saves: 2 x (query - key/value width) per token and layer more than the grouped
    kernel keeps."""
    from model_configs import TINY_LLAMA
    from toolkit.estimate import ModelRef, estimate
    from toolkit.estimate.gpu import Runtime

    cfg = {**TINY_LLAMA, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
           "intermediate_size": 1376, "num_hidden_layers": 4}
    p = plan(micro_batch=4, seq_len=512, precision="bf16-true", optimizer="sgd")
    ref = ModelRef(cfg, "causal-lm", None, "gqa")
    grouped = estimate(ref, p, gpu_partition(), method="traced", allocator_model=False)
    repeated = estimate(ref, p, gpu_partition(), method="traced", runtime=Runtime(sdpa_repeats_kv=True),
                        allocator_model=False)
    repeats = 4 * 2048 * 2 * (512 - 128) * 2 / MIB  # layers x tokens x (k, v) x (q - kv width) x bf16
    assert repeated.peak_allocated_mib - grouped.peak_allocated_mib == pytest.approx(repeats, abs=0.5)
