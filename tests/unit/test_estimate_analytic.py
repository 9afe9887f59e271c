"""toolkit.estimate.analytic: the arithmetic on round numbers, its monotonicity, capacity and
fit on the shipped partitions, and the estimate against real training steps on the CPU.

The real check: one steady-state training step of tiny GPT-2, BERT, LLaMA-like and ViT models,
run the way toolkit/runtime/train.py runs it (autocast, GradScaler, accumulation, grads set to
None), under a TorchDispatchMode that sums the bytes of live tensor storages (a CPU
stand-in for torch.cuda.max_memory_allocated: every tensor an op makes is counted until
its storage is freed). The CPU has no caching allocator, so this is the tensors' own
peak, which is what ``peak_allocated_mib`` predicts. Model states and saved activations
are counted tensor by tensor and come out to the byte; what is left is the short-lived
gradients inside one layer's backward, fitted as per-family constants. Over ~100 such
configurations (tiny and mid-sized, with and without dropout) the error stayed within
2.1 %; the test allows 3 %, inside the issue's 5 % target. The ViT (image-cls) cases cover
fp32 / bf16-mixed x checkpointing x sdpa / eager x two micro-batches; they stayed within 1.1 %
(and within 0.7 % on a wider 3-layer variant), except CPU sdpa with attention dropout under
16-bit autocast, which BERT shares (the math fallback upcasts; not in these cases).
"""

import contextlib
import dataclasses
import math

import pytest

from toolkit import optimizers, sites
from toolkit.errors import ConfigError
from toolkit.estimate import COMPONENTS
from toolkit.estimate import activations as inv
from toolkit.estimate import analytic as an
from toolkit.estimate.analytic import estimate_analytic
from toolkit.models import load_model_config, random_image_batch, transformers_config
from toolkit.modelshape import ModelShape
from toolkit.plan import Plan

EX = sites.load_site("example-hpc")
V100 = EX.partition("v100-16gb")
A100 = EX.partition("a100-40gb")
CPU = sites.load_site("testcluster").partition("cpu")
MIB = 2**20

PSI = 10**9
SHAPE_1B = ModelShape.from_param_count(PSI, hidden=2048, layers=16, heads=16, vocab=32000, seq=2048)
GPT2 = ModelShape.from_config(load_model_config("gpt2"))
LLAMA7B = ModelShape.from_config(load_model_config("llama-7b"))


def recipe_peak(order) -> float:
    from toolkit.strategies.base import recipe_sizes

    return recipe_sizes(order)[1]


def plan(**knobs) -> Plan:
    """A plan whose global batch follows from the knobs given."""
    knobs.setdefault("micro_batch", 1)
    world = knobs.get("nodes", 1) * knobs.get("gpus_per_node", 1)
    if "launcher" not in knobs and (knobs.get("zero_stage") or knobs.get("offload_optimizer", "none") != "none"):
        knobs["launcher"] = "deepspeed"
    return Plan(global_batch=knobs["micro_batch"] * knobs.get("grad_accum", 1) * world, **knobs)


def states_in_psi(p: Plan, shape=SHAPE_1B, gpu=True):
    st = an.model_states(shape, p, an.dtypes_for(p, gpu))
    return st.params_bytes / PSI, st.grads_bytes / PSI, st.optimizer_bytes / PSI


# -- model states on round numbers (REFERENCE.md "Memory arithmetic") -------------------------------------


def test_16_psi_for_mixed_precision_adam_however_it_is_split():
    assert SHAPE_1B.n_params == PSI
    assert states_in_psi(plan(precision="fp32")) == (4, 4, 8)
    assert states_in_psi(plan(precision="bf16-mixed")) == (4, 4, 8)  # torch autocast: fp32 weights are the master
    assert states_in_psi(plan(launcher="deepspeed", precision="bf16-mixed")) == (2, 2, 12)  # 16-bit + master + 2 states
    assert states_in_psi(plan(precision="bf16-true")) == (2, 2, 4)  # no master copy; AdamW states in bf16


@pytest.mark.parametrize("stage, expected", [(1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_zero_stages_shard_as_rajbhandari(stage, expected):
    p = plan(launcher="deepspeed", gpus_per_node=8, zero_stage=stage, precision="fp16-mixed")
    assert sum(states_in_psi(p)) == pytest.approx(expected)
    fp32 = plan(launcher="deepspeed", gpus_per_node=8, zero_stage=1, precision="fp32")
    assert states_in_psi(fp32) == pytest.approx((4, 4, 8 / 8))


def test_zero3_gathered_weights_follow_deepspeeds_parameter_coordinator():
    """Hand-worked on a 2-layer Llama (hidden 1000, MLP 2000, vocab 10000, untied): linears of 1M (attention) and
    2M (MLP) elements, 10M-element embedding and head, norms of 1000 (persistent: always gathered, 5000 in all).
    ZeRO-3 gathers a module's own weights; prefetches up to prefetch_bucket_size more at each module, while fewer
    than max_live_parameters are live; keeps a weight the trace uses again within max_reuse_distance elements; keeps
    the embeddings through their backward."""
    from toolkit.strategies.deepspeed import ZeroSettings, zero3_gathered

    shape = ModelShape.from_config({"model_type": "llama", "hidden_size": 1000, "intermediate_size": 2000,
                                    "num_hidden_layers": 2, "num_attention_heads": 10, "num_key_value_heads": 10,
                                    "vocab_size": 10_000, "tie_word_embeddings": False})
    norms = 5 * 1000

    def run(**knobs):
        return zero3_gathered(shape, ZeroSettings(**knobs), checkpointing=False, causal=True)

    one = run(prefetch_bucket_size=0, max_live_parameters=0, max_reuse_distance=0)  # one module at a time
    assert one == {"forward_end": norms + 10_000_000, "head_backward": norms + 10_000_000,
                   "last_layer": norms + 2_000_000, "first_layer": norms + 2_000_000,
                   "backward_end": norms + 10_000_000}
    # DeepSpeed's default reuse distance (1e9 elements) is longer than this whole step: every weight is kept
    # from its forward to its backward, so the forward ends with the whole model gathered
    whole = norms + 2 * 10_000_000 + 2 * (4 * 1_000_000 + 3 * 2_000_000)
    kept = run(prefetch_bucket_size=0, max_live_parameters=0)
    assert kept["forward_end"] == whole and kept["backward_end"] == norms + 10_000_000
    # prefetching fills the window up to max_live_parameters (one module past it at most)
    window = run(prefetch_bucket_size=10 ** 9, max_live_parameters=5_000_000, max_reuse_distance=0)
    assert norms + 5_000_000 <= window["last_layer"] <= norms + 5_000_000 + 10_000_000
    assert one["last_layer"] < window["last_layer"]
    # the plan's model states carry it, moment by moment, in the 16-bit dtype
    p = plan(gpus_per_node=8, zero_stage=3, precision="bf16-mixed")
    st = an.model_states(shape, p, an.dtypes_for(p, True))
    assert st.gathered_moments.forward_end == 2 * whole  # hpcmem's ds_config: DeepSpeed's reuse distance
    assert st.gathered_bytes == max(vars(st.gathered_moments).values())


def test_zero3_without_its_linear_wrapper_keeps_each_gathered_linear_weight_until_its_backward():
    """A model passed to an older DeepSpeed already built (not inside zero.Init: DeepSpeed PR #8189) runs torch's
    F.linear, whose autograd saves a view of the gathered weight: releasing the parameter leaves that storage
    alive until the module's backward. Hand-worked on the 2-layer Llama above, one module gathered at a time:
    each layer's linears are 4 x 1M + 3 x 2M = 10M elements, the head 10M, the norms 5000 (persistent)."""
    from toolkit.errors import ConfigError
    from toolkit.estimate.gpu import Runtime
    from toolkit.strategies.deepspeed import ZeroSettings, zero3_gathered

    shape = ModelShape.from_config({"model_type": "llama", "hidden_size": 1000, "intermediate_size": 2000,
                                    "num_hidden_layers": 2, "num_attention_heads": 10, "num_key_value_heads": 10,
                                    "vocab_size": 10_000, "tie_word_embeddings": False})
    norms, layer, M = 5 * 1000, 10_000_000, 1_000_000
    zs = ZeroSettings(prefetch_bucket_size=0, max_live_parameters=0, max_reuse_distance=0)

    def run(ckpt: bool, wrapped: bool, s=shape):
        return zero3_gathered(s, zs, checkpointing=ckpt, causal=True, linear_wrapped=wrapped)

    # no checkpointing: the forward ends with both layers' linears kept beside the head. Released by the
    # coordinator and gathered again for its backward, a kept weight is there twice: the head at its backward,
    # each layer's MLP weight (2M) at its own; each layer's backward drops its linears (layer 1's first)
    assert run(False, False) == {"forward_end": norms + 10 * M + 2 * layer,
                                 "head_backward": norms + 2 * 10 * M + 2 * layer,
                                 "last_layer": norms + 2 * M + 2 * layer, "first_layer": norms + 2 * M + layer,
                                 "backward_end": norms + 10 * M}
    assert run(False, True)["forward_end"] == norms + 10 * M
    # checkpointing: the layers' forward saves nothing; the head's does, and each recompute keeps its layer's
    # linears until that backward
    assert run(True, False) == {**run(True, True), "head_backward": norms + 2 * 10 * M,
                                "last_layer": norms + 2 * M + layer, "first_layer": norms + 2 * M + layer}
    # HF GPT-2's Conv1D multiplies by the parameter itself: only its tied head's nn.Linear keeps a view of the
    # token embedding (here released after the head's forward and gathered again for its backward)
    gpt2 = ModelShape.from_config(load_model_config("gpt2"))
    embedding = gpt2.vocab * gpt2.hidden
    assert run(False, False, gpt2) == {**run(False, True, gpt2),
                                       "head_backward": run(False, True, gpt2)["head_backward"] + embedding}
    # the plan's states: the Runtime fact, or the ds_config's memory_efficient_linear; one rank gathers nothing
    p8 = plan(gpus_per_node=8, zero_stage=3, precision="bf16-mixed")
    dt = an.dtypes_for(p8, True)
    ds = {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}
    wrapped = an.model_states(shape, p8, dt, Runtime(engine_config=ds)).gathered_moments
    unwrapped = an.model_states(shape, p8, dt, Runtime(engine_config=ds, zero3_linear_wrapped=False)).gathered_moments
    off = an.model_states(shape, p8, dt, Runtime(engine_config={**ds, "memory_efficient_linear": False}))
    assert unwrapped == off.gathered_moments and unwrapped.head_backward == 2 * (norms + 2 * 10 * M + 2 * layer)
    assert wrapped.head_backward == 2 * (norms + 10 * M)
    p1 = plan(gpus_per_node=1, zero_stage=3, precision="bf16-mixed")
    assert an.model_states(shape, p1, dt, Runtime(zero3_linear_wrapped=False)).gathered_bytes == 0
    with pytest.raises(ConfigError, match="memory_efficient_linear"):
        an.model_states(shape, p8, dt, Runtime(engine_config={"memory_efficient_linear": "yes"}))


def test_leaner_optimizers():
    for launcher in ("torchrun", "deepspeed"):
        base = states_in_psi(plan(launcher=launcher, precision="fp32"))[2]
        assert states_in_psi(plan(launcher=launcher, precision="fp32", optimizer="sgd"))[2] == base - 4
        assert states_in_psi(plan(launcher=launcher, precision="fp32", optimizer="adamw-8bit"))[2] == \
            pytest.approx(base - 8 + 2, abs=0.1)  # 1 byte per state + block absmax
        adafactor = states_in_psi(plan(launcher=launcher, precision="fp32", optimizer="adafactor"))[2]
        assert base - 8 < adafactor < base - 8 + 0.05  # factored: a row and a column per matrix


def test_offload_moves_states_to_the_host_with_deepspeeds_buffer_factor():
    p = plan(gpus_per_node=8, zero_stage=2, offload_optimizer="cpu", precision="bf16-mixed")
    st = an.model_states(SHAPE_1B, p, an.dtypes_for(p, True))
    assert (st.params_bytes, st.grads_bytes, st.optimizer_bytes) == (2 * PSI, 0, 0)
    assert st.host_bytes_per_rank * 8 == pytest.approx(1.5 * 16 * PSI)  # master, 2 states, fp32 grads
    p3 = plan(gpus_per_node=8, zero_stage=3, offload_optimizer="cpu", offload_params="cpu", precision="bf16-mixed")
    st3 = an.model_states(SHAPE_1B, p3, an.dtypes_for(p3, True))
    assert st3.params_bytes == st3.grads_bytes == st3.optimizer_bytes == 0
    assert st3.host_bytes_per_rank * 8 == pytest.approx(1.5 * 18 * PSI)  # DeepSpeed's 18 x 1.5 per node
    # NVMe: 4 pinned fp32 buffers of one sub-group (10^9 elements at most) per rank, whatever the model.
    for shape, world in ((SHAPE_1B, 8), (LLAMA7B, 2)):
        nvme = plan(gpus_per_node=world, zero_stage=3, offload_optimizer="nvme", offload_params="nvme", precision="bf16-mixed")
        st_nvme = an.model_states(shape, nvme, an.dtypes_for(nvme, True))
        shard = shape.n_params / world
        assert st_nvme.host_bytes_per_rank == pytest.approx(16 * min(shard, 10**9) + 10 * -(-shape.largest_param_numel // 10**6) * 10**6)
    assert st_nvme.host_bytes_per_rank < 1.5 * 18 * shard / 2  # a 7B shard on NVMe needs far less host memory


def test_ddp_keeps_a_second_copy_of_the_grads():
    one = an.model_states(SHAPE_1B, plan(), an.dtypes_for(plan(), True))
    two = an.model_states(SHAPE_1B, plan(gpus_per_node=2), an.dtypes_for(plan(), True))
    assert (one.buffer_bytes, two.buffer_bytes) == (0, 4 * PSI)


def test_ddp_buckets_close_once_they_reach_their_cap_as_torch_assigns_them():
    """c10d's compute_bucket_assignment_by_size adds a tensor, then closes the bucket once it has reached its limit,
    so a bucket overshoots by up to its last tensor; the limits are taken in turn (hand-worked, MiB)."""
    from toolkit.estimate.gpu import MIB, buckets_by_size, ddp_broadcast_sizes, ddp_bucket_sizes

    assert buckets_by_size([10, 10, 10, 10, 10], (15,)) == [20, 20, 10]
    assert buckets_by_size([1, 30, 2, 2], (1, 25)) == [1, 30, 4]  # the first limit, then the second for the rest
    assert buckets_by_size([40], (25,)) == [40] and buckets_by_size([], (25,)) == []
    # the rebuilt buckets run over the gradients as the backward makes them (reverse registration): 1 MiB, then 25
    assert ddp_bucket_sizes([MIB * x for x in (20, 20, 20, 0.5, 0.75)]) == [MIB * x for x in (1.25, 40, 20)]
    # the construction's broadcast goes over the parameters in order, 250 MiB buckets, each bucket of more than one
    # tensor through a flat copy (a lone tensor is broadcast in place: flatten_dense_tensors returns its view)
    assert ddp_broadcast_sizes([MIB * x for x in (200, 100, 30, 20)]) == [MIB * 300, MIB * 50]
    assert ddp_broadcast_sizes([MIB * x for x in (300, 100, 30)]) == [MIB * 130]


def test_ddp_is_built_with_one_bucket_rebuilt_at_the_second_forward_and_lightning_builds_it_on_a_stream_of_its_own():
    """DDP's construction broadcasts the parameters through flat copies and makes one bucket of every gradient,
    rebuilt into the capped buckets at the second forward (estimate.gpu's DDP notes). On the default stream the
    allocator reuses those blocks; Lightning builds DDP on a stream of its own (Runtime.ddp_side_stream), whose
    blocks training never reuses: the reserved peak then holds the broadcast's copies and the first bucket on top,
    the allocated peak is unchanged (ViT-B on 4 ranks, fp32 weights: a 327 MiB bucket, copies of 253 + 74 MiB)."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime, ddp_broadcast_sizes
    from toolkit.estimate.stream import DDP_BUILD_STREAM, step_events, param_order

    p = plan(gpus_per_node=4, precision="bf16-mixed", micro_batch=16, seq_len=197)
    dt = an.dtypes_for(p, True)
    states, acts = an.model_states(VIT_BASE, p, dt), inv.activations(VIT_BASE, p, dt)
    runs = {}
    for side in (False, True):
        events = step_events(VIT_BASE, p, dt, states, acts, runtime=Runtime(ddp_side_stream=side), steps=2)
        runs[side] = (events, replay(events))
    (plain, r0), (lightning, r1) = runs[False], runs[True]
    grads = 4 * VIT_BASE.n_params
    built = [e for e in lightning if e[0] == "alloc" and len(e) == 4 and e[3] == DDP_BUILD_STREAM]
    copies = ddp_broadcast_sizes([4 * math.prod(e[1]) for e in param_order(VIT_BASE)])
    assert [e[2] for e in built] == [*copies, grads] and len(copies) == 2
    assert not any(len(e) == 4 and e[3] == DDP_BUILD_STREAM for e in plain)
    # the first bucket is freed at the second step, before its first forward allocation
    first = built[-1][1]
    at = next(i for i, e in enumerate(lightning) if e[0] == "free" and e[1] == first)
    step2 = next(i for i, e in enumerate(lightning) if e[0] == "mark" and e[1] == "step 2")
    assert at == step2 + 1
    assert r1.peak_requested == r0.peak_requested  # the same tensors (allocated differs by where blocks split)
    extra = r1.peak_reserved - r0.peak_reserved
    assert 0.9 * (grads + sum(copies)) <= extra <= 1.1 * (grads + sum(copies)) + 64 * 2**20, extra / 2**20


# -- activations --------------------------------------------------------------------------------------------


def test_the_layer_inventory_reduces_to_korthikanti():
    """A Megatron GPT layer (fused GELU, dropout everywhere, 16-bit, eager) saves s·b·h·(34 + 5as/h) bytes."""
    cfg = {**load_model_config("gpt2"), "activation_function": "gelu", "attn_pdrop": 0.1, "resid_pdrop": 0.1}
    shape = ModelShape.from_config(cfg)
    s, b, h, a = 1024, 4, 768, 12
    p = plan(launcher="deepspeed", precision="fp16-mixed", attention="eager", seq_len=s, micro_batch=b)
    dt = an.dtypes_for(p, gpu=True)
    ln_stats = 2 * inv.LN_STATS_BYTES * s * b  # LayerNorm's mean and rstd, which the paper leaves out
    assert s * b * inv.layer_bytes_per_token(shape, p, dt) - ln_stats == inv.korthikanti_layer_bytes(s, b, h, a)
    flash = p.replace(attention="sdpa")
    lse = 4 * a * s * b
    assert s * b * inv.layer_bytes_per_token(shape, flash, dt) - ln_stats - lse == \
        inv.korthikanti_layer_bytes(s, b, h, a, stores_scores=False)


def test_more_micro_batch_more_activations_and_checkpointing_fewer():
    peaks = [estimate_analytic(LLAMA7B, plan(precision="bf16-mixed", micro_batch=m, seq_len=2048,
                                             gpus_per_node=8, zero_stage=3), A100).peak_allocated_mib for m in (1, 2, 4)]
    assert peaks[0] < peaks[1] < peaks[2]
    for shape in (GPT2, LLAMA7B):
        base = plan(precision="bf16-mixed", micro_batch=8, seq_len=1024)
        full = inv.activations(shape, base, an.dtypes_for(base, True))
        ckpt = inv.activations(shape, base.replace(checkpointing=True), an.dtypes_for(base, True))
        assert ckpt.kept_layer_bytes < full.kept_layer_bytes / 10
        assert estimate_analytic(shape, base.replace(checkpointing=True), A100).peak_allocated_mib < \
            estimate_analytic(shape, base, A100).peak_allocated_mib


def test_eager_attention_stores_the_score_matrix():
    sdpa = plan(precision="bf16-mixed", micro_batch=4, seq_len=1024)
    dt = an.dtypes_for(sdpa, True)
    for shape in (GPT2, LLAMA7B):
        extra = inv.layer_bytes_per_token(shape, sdpa.replace(attention="eager"), dt) - inv.layer_bytes_per_token(shape, sdpa, dt)
        assert extra > shape.heads * 1024 * 4  # at least an fp32 a x s row per token


def test_zero_stages_and_offload_lower_the_device_and_raise_the_host():
    p = plan(launcher="deepspeed", precision="bf16-mixed", gpus_per_node=4, micro_batch=1, seq_len=2048,
             checkpointing=True)
    used = [estimate_analytic(LLAMA7B, p.replace(zero_stage=z), A100).device_used_mib for z in (0, 1, 2, 3)]
    assert used[0] > used[1] > used[2] > used[3]
    on_gpu = estimate_analytic(LLAMA7B, p.replace(zero_stage=3), A100)
    offload = estimate_analytic(LLAMA7B, p.replace(zero_stage=3, offload_optimizer="cpu", offload_params="cpu"), A100)
    assert offload.device_used_mib < on_gpu.device_used_mib
    assert offload.host_mib_per_node > on_gpu.host_mib_per_node == 0


# -- the Estimate: phases, capacity, fit, notes ---------------------------------------------------------------


def test_components_add_up_and_device_used_follows():
    e = estimate_analytic(GPT2, plan(precision="bf16-mixed", micro_batch=8, seq_len=1024), A100)
    assert tuple(e.components) == COMPONENTS
    tensors = sum(e.components[k] for k in ("params", "grads", "optimizer", "activations", "temporaries"))
    assert tensors == pytest.approx(e.peak_allocated_mib)
    assert e.components["cuda_context"] == A100.cuda_context_mib
    # device used = context + the replayed reserved peak (allocator_overhead = reserved - allocated)
    assert e.peak_reserved_mib >= e.peak_allocated_mib
    assert e.components["allocator_overhead"] == pytest.approx(e.peak_reserved_mib - e.peak_allocated_mib)
    assert e.device_used_mib == pytest.approx(A100.cuda_context_mib + e.peak_reserved_mib)
    assert e.headroom_mib == pytest.approx(e.capacity_mib - e.device_used_mib)
    assert e.method == "analytic" and e.to_dict()["fits"] is e.fits
    assert e.to_dict()["peak_reserved_mib"] == e.peak_reserved_mib and 0 <= e.fragmentation < 1 and e.segments > 0
    assert any("not calibrated" in n for n in e.notes) and any("allocator replayed" in n for n in e.notes)
    custom = estimate_analytic(GPT2, plan(precision="bf16-mixed", micro_batch=8, seq_len=1024), A100,
                               allocator_overhead_frac=0.25, cuda_context_mib=1000)
    # a partition's measured overhead raises reserved where it says more than the replay
    assert custom.peak_reserved_mib == pytest.approx(max(e.peak_reserved_mib, 1.25 * e.peak_allocated_mib))
    assert custom.device_used_mib == pytest.approx(1000 + custom.peak_reserved_mib)
    assert not any("not calibrated" in n for n in custom.notes)
    quick = estimate_analytic(GPT2, plan(precision="bf16-mixed", micro_batch=8, seq_len=1024), A100,
                              allocator_model=False)
    assert quick.peak_reserved_mib == quick.peak_allocated_mib and quick.device_used_mib < e.device_used_mib


def test_the_peak_is_the_largest_phase_not_the_sum():
    p = plan(precision="fp32", micro_batch=1, seq_len=128)
    dt = an.dtypes_for(p, True)
    ws = 2 * (2 * 4096 + 8 * 16) * 1024  # the forward thread's and the backward thread's cuBLAS workspaces
    all_phases = an.phases(GPT2, p, dt, an.model_states(GPT2, p, dt), inv.activations(GPT2, p, dt), workspaces=ws)
    e = estimate_analytic(GPT2, p, A100)
    assert e.peak_allocated_mib == pytest.approx(max(ph.total for ph in all_phases) / MIB)
    assert e.peak_allocated_mib < 16 * GPT2.n_params / MIB + sum(ph.activations for ph in all_phases) / MIB
    assert {"forward end", "backward start", "backward end", "optimizer step"} <= {ph.name for ph in all_phases}


def test_a_v100_holds_less_than_an_a100():
    p = plan(precision="fp16-mixed", micro_batch=16, seq_len=1024, attention="sdpa")
    v100, a100 = estimate_analytic(GPT2, p, V100), estimate_analytic(GPT2, p, A100)
    assert (v100.capacity_mib, a100.capacity_mib) == (16 * 1024, 40 * 1024)
    assert v100.device_used_mib == pytest.approx(a100.device_used_mib - A100.cuda_context_mib + V100.cuda_context_mib)
    assert a100.fits and not v100.fits
    margin = an.safety_margin_mib(a100.capacity_mib)
    assert margin == pytest.approx(0.03 * 40 * 1024)


def test_a_cpu_partition_has_no_cuda_context_and_shares_host_memory():
    p = plan(precision="fp32", micro_batch=2, seq_len=128, gpus_per_node=2)
    e = estimate_analytic(GPT2, p, CPU)
    assert e.components["cuda_context"] == 0
    assert e.capacity_mib == CPU.default_mem_mib / 2
    assert estimate_analytic(GPT2, p.replace(mem_mib=16000), CPU).capacity_mib == 8000
    assert any("CPU partition" in n for n in e.notes)


def test_host_memory_decides_fit_too():
    p = plan(launcher="deepspeed", gpus_per_node=4, zero_stage=3, offload_optimizer="cpu", offload_params="cpu",
             precision="bf16-mixed", checkpointing=True, seq_len=2048)
    e = estimate_analytic(LLAMA7B, p, A100)
    assert e.fits
    small = estimate_analytic(LLAMA7B, p.replace(mem_mib=32 * 1024), A100)
    assert not small.fits and any("host memory" in n for n in small.notes)


# -- against a real training step on the CPU -----------------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from toolkit.estimate.measure import LiveTensorBytes, measured_peak_bytes, train_setup  # noqa: E402

from model_configs import (TINY_GEMMA, TINY_GEMMA2, TINY_GEMMA3, TINY_LLAMA, TINY_OPT, TINY_PHI3,  # noqa: E402
                           TINY_QWEN3, TINY_ROBERTA)

MODELS = {"tiny-gpt2": load_model_config("tiny-gpt2"), "tiny-bert": load_model_config("tiny-bert"),
          "tiny-llama": TINY_LLAMA, "tiny-vit": load_model_config("tiny-vit"), "tiny-qwen3": TINY_QWEN3,
          "tiny-gemma": TINY_GEMMA, "tiny-roberta": TINY_ROBERTA, "tiny-opt": TINY_OPT, "tiny-phi3": TINY_PHI3,
          # a window shorter than the tests' sequences: SDPA gets a mask, and K and V are repeated for it
          "tiny-phi3-window": {**TINY_PHI3, "sliding_window": 64},
          "tiny-phi3-mha-window": {**TINY_PHI3, "num_key_value_heads": 4, "sliding_window": 64},
          "tiny-mistral-window": {**TINY_LLAMA, "model_type": "mistral", "sliding_window": 64},
          "tiny-gemma2": TINY_GEMMA2, "tiny-gemma3": TINY_GEMMA3,
          "tiny-gemma3-no-window": {**TINY_GEMMA3, "sliding_window": 4096},
          # one full-attention layer under SDPA's mask-free path beside a windowed one: the estimate takes both as
          # windowed (a bound)
          "tiny-gemma3-mixed": {**TINY_GEMMA3, "layer_types": ["full_attention", "sliding_attention"]},
          # soft-capping set: Gemma 3's attention does not apply it, its logits do
          "tiny-gemma3-capped": {**TINY_GEMMA3, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
          # soft-capping left out of config.json: Gemma2Config's defaults (50, 30) apply
          "tiny-gemma2-defaults": {k: v for k, v in TINY_GEMMA2.items() if not k.endswith("softcapping")}}


def forward_saved_bytes(cfg, task, p: Plan) -> int:
    """Live tensor bytes at the end of a forward (the output dropped), beyond params and inputs."""
    model, _, _, _ = train_setup(cfg, task, p)
    dtype = {"fp16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(p.precision)
    if task == "image-cls":
        batch = random_image_batch(transformers_config(cfg, task), p.micro_batch)
    else:
        ids = torch.randint(0, cfg["vocab_size"], (p.micro_batch, p.seq_len))
        batch = {"input_ids": ids, "labels": ids if task == "causal-lm" else torch.randint(0, 2, (p.micro_batch,))}
    mode = LiveTensorBytes()
    with mode:
        for t in [*model.parameters(), *model.buffers(), *batch.values()]:
            mode.track(t)
        before = mode.current
        with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
            loss = model(**batch).loss
        saved = mode.current - before
    del loss
    return saved


@pytest.mark.parametrize("family, precision, attention", [
    (family, precision, attention)
    for family in ("tiny-gpt2", "tiny-bert", "tiny-llama", "tiny-vit", "tiny-qwen3", "tiny-gemma", "tiny-roberta",
                   "tiny-opt", "tiny-phi3", "tiny-phi3-window", "tiny-phi3-mha-window", "tiny-mistral-window",
                   "tiny-gemma3", "tiny-gemma3-no-window", "tiny-gemma3-capped")
    for precision, attention in (("fp32", "sdpa"), ("bf16-mixed", "sdpa"), ("bf16-true", "eager"))
] + [(family, precision, "eager") for family in ("tiny-gemma2", "tiny-gemma2-defaults", "tiny-gemma3-capped")
     for precision in ("fp32", "bf16-mixed", "bf16-true")])
def test_one_layer_saves_what_the_inventory_says(family, precision, attention):
    """The per-layer inventory against the real forward: a 3-layer minus a 2-layer model."""
    cfg, layers_key = MODELS[family], "n_layer" if family == "tiny-gpt2" else "num_hidden_layers"
    p = plan(precision=precision, attention=attention, micro_batch=3, seq_len=96)
    task = "image-cls" if family == "tiny-vit" else "causal-lm"
    real = forward_saved_bytes({**cfg, layers_key: 3}, task, p) - forward_saved_bytes({**cfg, layers_key: 2}, task, p)
    shape = ModelShape.from_config(cfg, task)
    dt = an.dtypes_for(p, gpu=False)
    tokens = 3 * inv.sequence_length(shape, p)  # a ViT's patches + CLS, else seq_len 96
    predicted = tokens * inv.layer_bytes_per_token(shape, p, dt) + (2 * shape.layer_linear_params if dt.autocast else 0)
    assert predicted == pytest.approx(real, rel=0.005)


CASES = [
    ("tiny-gpt2", "causal-lm", dict(precision="fp32", micro_batch=4, seq_len=128)),
    ("tiny-gpt2", "causal-lm", dict(precision="bf16-mixed", attention="eager", micro_batch=4, seq_len=128)),
    ("tiny-gpt2", "causal-lm", dict(precision="fp16-mixed", micro_batch=2, seq_len=128, grad_accum=2, optimizer="sgd")),
    ("tiny-gpt2", "seq-cls", dict(precision="fp32", micro_batch=8, seq_len=128)),
    ("tiny-gpt2", "seq-cls", dict(precision="bf16-true", micro_batch=8, seq_len=128, checkpointing=True)),
    ("tiny-bert", "seq-cls", dict(precision="fp32", micro_batch=8, seq_len=128)),
    ("tiny-bert", "seq-cls", dict(precision="bf16-mixed", attention="eager", micro_batch=8, seq_len=128)),
    ("tiny-bert", "seq-cls", dict(precision="fp32", micro_batch=4, seq_len=64, grad_accum=2, optimizer="adafactor")),
    ("tiny-bert", "causal-lm", dict(precision="bf16-mixed", micro_batch=4, seq_len=128, checkpointing=True)),
    ("tiny-bert", "causal-lm", dict(precision="bf16-true", micro_batch=1, seq_len=16, optimizer="sgd")),
    ("tiny-llama", "causal-lm", dict(precision="bf16-mixed", micro_batch=4, seq_len=128)),
    ("tiny-llama", "seq-cls", dict(precision="fp32", attention="eager", micro_batch=8, seq_len=128)),
    ("tiny-llama", "seq-cls", dict(precision="fp32", micro_batch=4, seq_len=128, checkpointing=True)),
    ("tiny-qwen3", "causal-lm", dict(precision="bf16-mixed", micro_batch=4, seq_len=128)),
    ("tiny-qwen3", "seq-cls", dict(precision="fp32", micro_batch=8, seq_len=128)),
    ("tiny-qwen3", "causal-lm", dict(precision="bf16-true", micro_batch=4, seq_len=128, checkpointing=True)),
    ("tiny-gemma", "causal-lm", dict(precision="bf16-true", attention="eager", micro_batch=4, seq_len=128)),
    ("tiny-gemma", "seq-cls", dict(precision="fp32", micro_batch=8, seq_len=128)),
    ("tiny-phi3", "causal-lm", dict(precision="fp32", micro_batch=4, seq_len=128)),
    ("tiny-phi3", "causal-lm", dict(precision="bf16-mixed", micro_batch=4, seq_len=128)),
    ("tiny-phi3", "causal-lm", dict(precision="bf16-true", attention="eager", micro_batch=4, seq_len=128)),
    ("tiny-phi3", "causal-lm", dict(precision="bf16-true", micro_batch=4, seq_len=128, checkpointing=True)),
    ("tiny-phi3", "seq-cls", dict(precision="fp32", micro_batch=8, seq_len=128)),
    ("tiny-phi3-window", "causal-lm", dict(precision="bf16-mixed", micro_batch=4, seq_len=128)),
    ("tiny-gemma2", "causal-lm", dict(precision="fp32", attention="eager", micro_batch=4, seq_len=128)),
    ("tiny-gemma2", "causal-lm", dict(precision="bf16-mixed", attention="eager", micro_batch=4, seq_len=128)),
    ("tiny-gemma2", "causal-lm", dict(precision="bf16-true", attention="eager", micro_batch=4, seq_len=128,
                                      checkpointing=True)),
    ("tiny-gemma2", "seq-cls", dict(precision="fp32", attention="eager", micro_batch=8, seq_len=128)),
    ("tiny-gemma3", "causal-lm", dict(precision="bf16-mixed", micro_batch=4, seq_len=128)),
    ("tiny-gemma3", "causal-lm", dict(precision="fp32", micro_batch=4, seq_len=128)),
    ("tiny-gemma3-no-window", "causal-lm", dict(precision="bf16-true", micro_batch=4, seq_len=128,
                                                checkpointing=True)),
    ("tiny-gemma3-mixed", "causal-lm", dict(precision="bf16-mixed", micro_batch=4, seq_len=128)),
    ("tiny-mistral-window", "causal-lm", dict(precision="fp32", micro_batch=4, seq_len=128)),
    ("tiny-roberta", "seq-cls", dict(precision="bf16-mixed", micro_batch=8, seq_len=128)),
    ("tiny-roberta", "causal-lm", dict(precision="fp32", micro_batch=4, seq_len=128, checkpointing=True)),
    ("tiny-opt", "causal-lm", dict(precision="fp32", micro_batch=4, seq_len=128)),
    ("tiny-opt", "causal-lm", dict(precision="bf16-mixed", micro_batch=4, seq_len=128)),
    ("tiny-opt", "causal-lm", dict(precision="bf16-true", attention="eager", micro_batch=4, seq_len=128)),
    ("tiny-opt", "causal-lm", dict(precision="fp32", micro_batch=4, seq_len=128, checkpointing=True)),
    ("tiny-opt", "seq-cls", dict(precision="fp32", micro_batch=8, seq_len=128)),
    ("tiny-opt", "seq-cls", dict(precision="bf16-mixed", micro_batch=8, seq_len=128, checkpointing=True)),
] + [  # a ViT: every combination of precision, checkpointing and attention, at two micro-batches
    ("tiny-vit", "image-cls", dict(precision=precision, checkpointing=ckpt, attention=attention, micro_batch=micro))
    for precision in ("fp32", "bf16-mixed") for ckpt in (False, True) for attention in ("sdpa", "eager")
    for micro in (8, 64)
] + [
    ("tiny-vit", "image-cls", dict(precision="bf16-true", micro_batch=32)),
    ("tiny-vit", "image-cls", dict(precision="fp16-mixed", micro_batch=16, grad_accum=2, optimizer="adafactor")),
    ("tiny-vit", "image-cls", dict(precision="fp32", micro_batch=16, grad_accum=2, optimizer="sgd",
                                   checkpointing=True)),
]


def test_gemma3_takes_its_full_attention_layers_as_windowed_ones():
    """Gemma 3 mixes windowed and full-attention layers; under SDPA only the windowed ones get a mask (and K and V
    repeated). The estimate keeps one layer size for all, the windowed one's: a bound, above a real step."""
    p = plan(precision="bf16-mixed", micro_batch=4, seq_len=128)
    real_mib = measured_peak_bytes(MODELS["tiny-gemma3-mixed"], "causal-lm", p) / MIB
    mixed = estimate_analytic(ModelShape.from_config(MODELS["tiny-gemma3-mixed"], "causal-lm"), p, CPU)
    windowed = estimate_analytic(ModelShape.from_config(MODELS["tiny-gemma3"], "causal-lm"), p, CPU)
    assert mixed.peak_allocated_mib == windowed.peak_allocated_mib
    assert real_mib < mixed.peak_allocated_mib < real_mib * 1.02


@pytest.mark.parametrize("family, task, knobs", CASES, ids=[f"{f}-{t}-{i}" for i, (f, t, _) in enumerate(CASES)])
def test_peak_allocated_matches_a_real_cpu_training_step(family, task, knobs):
    p = plan(**knobs)
    real_mib = measured_peak_bytes(MODELS[family], task, p) / MIB
    estimate = estimate_analytic(ModelShape.from_config(MODELS[family], task), p, CPU)
    assert estimate.peak_allocated_mib == pytest.approx(real_mib, rel=0.03), estimate.notes
    assert not math.isnan(estimate.device_used_mib) and estimate.components["cuda_context"] == 0


# -- image classification: the sequence comes from the model ----------------------------------------------

VIT_BASE = ModelShape.from_config(load_model_config("vit-base"), "image-cls")


def test_image_cls_ignores_the_plans_seq_len_and_says_so():
    p = plan(precision="bf16-mixed", micro_batch=64)
    short = estimate_analytic(VIT_BASE, p.replace(seq_len=16), A100)
    long = estimate_analytic(VIT_BASE, p.replace(seq_len=4096), A100)
    assert short.components == long.components
    assert any("197 tokens per sample" in n and "does not apply" in n for n in long.notes)
    assert not any("longer than the model" in n for n in long.notes)
    dt = an.dtypes_for(p, True)
    assert inv.activations(VIT_BASE, p, dt).layer_bytes == 64 * 197 * inv.layer_bytes_per_token(VIT_BASE, p, dt)


def test_image_cls_scales_with_micro_batch_and_checkpointing_saves():
    base = plan(precision="bf16-mixed", micro_batch=32)
    peaks = [estimate_analytic(VIT_BASE, base.replace(micro_batch=m, global_batch=m), A100).peak_allocated_mib
             for m in (32, 64, 128)]
    assert peaks[0] < peaks[1] < peaks[2]
    ckpt = estimate_analytic(VIT_BASE, base.replace(micro_batch=128, global_batch=128, checkpointing=True), A100)
    assert ckpt.peak_allocated_mib < peaks[2]
    zero3 = plan(launcher="deepspeed", zero_stage=3, gpus_per_node=4, precision="bf16-mixed", micro_batch=64)
    # ZeRO-3 shards the optimizer states; the weights of a model smaller than stage3_max_live_parameters (1e9)
    # are all gathered at the peak anyway (the coordinator's prefetch window), so they do not shrink there
    z3, z0 = (estimate_analytic(VIT_BASE, p, A100).components for p in (zero3, zero3.replace(zero_stage=0)))
    assert z3["optimizer"] < z0["optimizer"] / 3 and z3["params"] >= z0["params"]


def test_image_cls_through_the_library_entry_point():
    from toolkit.estimate import estimate, model_ref

    local = sites.load_site("local").partitions
    partition = next(iter(local.values()))
    e = estimate(model_ref("tiny-vit", "image-cls"), plan(micro_batch=8), partition)
    assert e.method == "analytic" and e.peak_allocated_mib > 0 and tuple(e.components) == COMPONENTS
    with pytest.raises(ConfigError, match="image model"):
        estimate(model_ref("tiny-vit", "causal-lm"), plan(), partition)


# -- the allocator model: stream, replay, fit -----------------------------------------------------------------


@pytest.mark.parametrize("shape, knobs", [
    (GPT2, dict(precision="bf16-mixed", micro_batch=8, seq_len=1024)),
    (GPT2, dict(precision="fp32", micro_batch=2, grad_accum=4, seq_len=512, attention="eager")),
    (LLAMA7B, dict(precision="bf16-true", seq_len=2048, checkpointing=True)),
    (SHAPE_1B, dict(precision="fp16-mixed", micro_batch=4, seq_len=1024, optimizer="adamw-perparam")),
])
def test_the_stream_reaches_the_phase_models_peak(shape, knobs):
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.stream import step_events

    p = plan(**knobs)
    dt = an.dtypes_for(p, True)
    states, acts = an.model_states(shape, p, dt), inv.activations(shape, p, dt)
    peak = max(ph.total for ph in an.phases(shape, p, dt, states, acts))
    r = replay(step_events(shape, p, dt, states, acts, steps=2))
    # the same tensors, one as a sum per phase, one event by event (512 B rounding, small-pool bundles)
    assert r.peak_allocated == pytest.approx(peak, rel=0.03)
    assert r.peak_reserved >= r.peak_allocated
    assert [m[0] for m in r.marks][:2] == ["step 1", "step 1 optimizer"]


def test_deferred_bucket_frees_return_four_flushes_later_and_all_at_the_epilogue():
    """ZeRO-3's host waits at each bucket flush for the reduction three flushes back (max_param_reduce_events 2),
    whose stream waited for the compute stream when each gradient entered that bucket: a block freed after c
    flushes is back by flush c + 4; the backward's epilogue synchronizes the reduce stream and returns the rest."""
    from toolkit.estimate.stream import _Deferred

    out, plain = [], []
    late = _Deferred(3, 10, out.append, plain.append)
    late.free("w0")  # after 0 flushes: back at flush 4
    for k in range(1, 5):
        late.add(10)  # each gradient fills the bucket: the next one flushes it
        if k == 2:
            late.free("w1")  # after 1 flush: back at flush 5
    assert out == [("defer", "w0"), ("defer", "w1")]  # 3 flushes so far
    late.add(10)
    assert out[-1] == ("return", "w0") and late.count == 4
    late.drain()
    assert out[-1] == ("return", "w1") and not plain
    off = _Deferred(0, 10, out.append, plain.append)
    off.free("x")
    assert plain == ["x"]


def test_zero3_record_stream_frees_raise_reserved_not_allocated():
    """ZeRO-3 on several GPUs (ModelStates.deferred_flushes): the backward's gathered weights and bucketed
    gradients are deferred and every one returns by the step's end; max_memory_allocated is what it was with
    plain frees; active (allocated + deferred) is above it and, on this Llama-7B step, reserved is not below the
    plain frees'; ZeRO-2 and ZeRO-3 without overlap_comm defer nothing."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import step_events

    p = plan(launcher="deepspeed", zero_stage=3, gpus_per_node=8, precision="fp16-mixed", seq_len=1024,
             optimizer="adamw-fused")
    dt = an.dtypes_for(p, True)
    states, acts = an.model_states(LLAMA7B, p, dt), inv.activations(LLAMA7B, p, dt)
    assert states.deferred_flushes == 3 and states.deferred_bucket_elements == 50_000_000
    events = step_events(LLAMA7B, p, dt, states, acts, steps=2, sharded=True)
    deferred = [e[1] for e in events if e[0] == "defer"]
    assert deferred and sorted(deferred) == sorted(e[1] for e in events if e[0] == "return")
    plain = [("free", e[1]) if e[0] == "defer" else e for e in events if e[0] != "return"]
    with_late, without = replay(events), replay(plain)
    assert with_late.peak_allocated == without.peak_allocated
    assert with_late.peak_active > with_late.peak_allocated and with_late.peak_reserved >= without.peak_reserved
    assert an.model_states(LLAMA7B, p.replace(zero_stage=2), dt).deferred_flushes == 0
    off = an.model_states(LLAMA7B, p, dt, Runtime(engine_config={"stage": 3, "overlap_comm": False}))
    assert off.deferred_flushes == 0
    # the estimate says how much waits at the active peak (A100 80GB, where the step fits)
    a100 = EX.partition("a100-80gb")
    note = [n for n in estimate_analytic(LLAMA7B, p, a100).notes if "record_stream" in n]
    waiting = (with_late.peak_active - with_late.peak_allocated) / 2**20
    assert len(note) == 1 and f"up to {waiting:.0f} MiB" in note[0]


def test_optimizer_implementations_differ_in_their_step_temporaries():
    e = {o: estimate_analytic(GPT2, plan(precision="fp32", micro_batch=1, seq_len=128, optimizer=o), A100)
         for o in ("adamw", "adamw-fused", "adamw-perparam", "sgd", "sgd-plain")}
    # foreach: a copy of every parameter at the step (the peak here); per-parameter and fused stay below it
    assert e["adamw"].peak_allocated_mib > max(e["adamw-perparam"].peak_allocated_mib, e["adamw-fused"].peak_allocated_mib)
    temps = {o: an.model_states(GPT2, plan(precision="fp32", optimizer=o), an.dtypes_for(plan(), True)).step_temp_bytes
             for o in ("adamw", "adamw-perparam", "adamw-fused")}
    assert temps["adamw"] > temps["adamw-perparam"] > temps["adamw-fused"] == 0
    assert e["sgd"].peak_allocated_mib > e["sgd-plain"].peak_allocated_mib


def test_an_older_runtime_keeps_gradients_and_a_16bit_loss_keeps_no_fp32_logits():
    from toolkit.estimate.gpu import Runtime

    p = plan(precision="bf16-mixed", micro_batch=4, seq_len=1024)
    today = estimate_analytic(GPT2, p, A100)
    old = estimate_analytic(GPT2, p, A100, runtime=Runtime(torch_version="1.10"))
    assert old.peak_allocated_mib > today.peak_allocated_mib  # grads live in the next forward
    assert "cublas_workspace" in old.gpu_extras_mib and not today.gpu_extras_mib
    lean = estimate_analytic(GPT2, p, A100, runtime=Runtime(logits_fp32=False))
    assert lean.peak_allocated_mib < today.peak_allocated_mib


def test_a_training_step_keeps_a_cublas_workspace_for_each_thread_that_runs_gemms():
    """cuBLAS keeps a workspace per (handle, stream), handles are per thread, and the autograd engine runs a CUDA
    backward on its device thread: the forward's first GEMM makes one, the first backward's a second, both kept.
    torch 2.0-2.4 add the forward's separate 1 MiB cuBLASLt workspace; before 1.11 none is the allocator's."""
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import gemm_workspaces, step_events

    ws = 2 * 4096 * 1024 + 8 * 16 * 1024
    assert gemm_workspaces("NVIDIA A100-SXM4-40GB", Runtime(torch_version="2.6")) == ((ws,), (ws,))
    assert gemm_workspaces("NVIDIA H100 80GB HBM3", Runtime(torch_version="2.6")) == ((32 * MIB,), (32 * MIB,))
    assert gemm_workspaces("NVIDIA A100-SXM4-40GB", Runtime(torch_version="2.1")) == ((ws, MIB), (ws,))
    assert gemm_workspaces("NVIDIA A100-SXM4-40GB", Runtime(torch_version="1.10")) == ((), ())

    p = plan(precision="bf16-mixed", micro_batch=2, seq_len=128)
    dt = an.dtypes_for(p, True)
    states, acts = an.model_states(GPT2, p, dt), inv.activations(GPT2, p, dt)
    odd = 1234 * 1024  # a workspace size no tensor of the step has
    events = step_events(GPT2, p, dt, states, acts, gpu_model="NVIDIA A100-SXM4-40GB", steps=2,
                         runtime=Runtime(cublas_workspace_config=":1234:1"))
    made = [i for i, e in enumerate(events) if e[0] == "alloc" and e[2] == odd]
    step1, step2 = events.index(("mark", "step 1")), events.index(("mark", "step 2"))
    assert len(made) == 2 and made[0] < step1 < made[1] < step2
    assert not any(e[0] == "free" and e[1] in {events[i][1] for i in made} for e in events)
    # the backward's comes once the forward has freed its transients (the autocast casts among them)
    assert any(e[0] == "free" for e in events[step1:made[1]])


def test_the_phases_hold_the_gemm_workspaces_the_stream_makes():
    """The GPU session of 2026-11-27 (H100, torch 2.11): the real allocator's live blocks at the allocated peak of
    gpt2 fp32 mb4 s512 include two 32 MiB blocks alive from the first forward and backward GEMMs to the end (the
    cuBLAS workspaces of the two threads, which the stream already made); the phases lacked them, so the allocated
    peak came out 64 MiB (1.4 %) under max_memory_allocated. Every phase of the steady state holds both."""
    from toolkit.estimate.gpu import Runtime

    p = plan(precision="fp32", micro_batch=4, seq_len=512)
    dt = an.dtypes_for(p, True)
    states, acts = an.model_states(GPT2, p, dt), inv.activations(GPT2, p, dt)
    bare = {ph.name: ph.total for ph in an.phases(GPT2, p, dt, states, acts)}
    held = {ph.name: ph.total for ph in an.phases(GPT2, p, dt, states, acts, workspaces=64 * MIB)}
    assert all(held[n] - bare[n] == 64 * MIB for n in bare)
    h100 = dataclasses.replace(A100, gpu_model="NVIDIA H100 80GB HBM3", gpu_mem_gib=80)
    peak = max(bare.values()) / MIB
    assert estimate_analytic(GPT2, p, h100).peak_allocated_mib == pytest.approx(peak + 2 * 32)
    assert estimate_analytic(GPT2, p, A100).peak_allocated_mib == pytest.approx(peak + 2 * 8.125)
    # torch < 1.11: cuBLAS's own memory, outside the allocator (an extra of device_used, not an allocation)
    rt = Runtime(torch_version="1.10")
    old = estimate_analytic(GPT2, p, A100, runtime=rt)
    old_states = dataclasses.replace(an.model_states(GPT2, p, dt, rt), persistent_grads=True)  # 1.x kept grads
    assert old.peak_allocated_mib == pytest.approx(
        max(ph.total for ph in an.phases(GPT2, p, dt, old_states, inv.activations(GPT2, p, dt, rt), rt)) / MIB)
    assert old.gpu_extras_mib["cublas_workspace"] == 8.125


def test_a_checkpointed_layer_makes_its_kept_input_once_its_internals_are_gone():
    """Non-reentrant checkpointing keeps a layer's input and drops every internal tensor as the forward goes on
    (the H100 trace of gpt2 bf16-mixed mb8 s1024 ckpt: each layer's 24 MiB fp32 output, the next layer's kept
    input, is made after its FFN temporaries are freed, into their space). The stream had made the kept tensor
    while all the layer's internals were alive, so each landed in new space; in step 2 those holes took the
    layers' inputs into a free logits-sized segment, and the fp32 logits then needed a fifth one: 8,728 MiB
    reserved against the real 6,980 (segments 76 vs 44). Made after the internals, step 2 reserves nothing new
    (the real allocator made no segment of the large pool after step 1, over three steps)."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.stream import step_events

    p = plan(precision="bf16-mixed", micro_batch=8, seq_len=1024, checkpointing=True)
    dt = an.dtypes_for(p, True)
    states, acts = an.model_states(GPT2, p, dt), inv.activations(GPT2, p, dt)
    events = step_events(GPT2, p, dt, states, acts, gpu_model="NVIDIA H100 80GB HBM3", steps=2)
    start = events.index(("mark", "step 1"))
    logits = next(i for i, e in enumerate(events) if i > start and e[0] == "alloc" and e[2] >= 4 * 8 * 1024 * GPT2.vocab)
    forward = events[start + 1:logits]
    freed = {e[1] for e in forward if e[0] == "free"}
    transient: set = set()
    kept = 0
    for e in forward:
        if e[0] == "free":
            transient.discard(e[1])
        elif e[1] in freed:
            transient.add(e[1])
        elif e[2] == int(acts.kept_layer_bytes):
            kept += 1
            assert not transient  # no internal of the layer is alive when its kept tensor is made
    assert kept >= GPT2.layers  # (and the embeddings' output, made before any layer)
    marks = {m[0]: m[2] for m in replay(events).marks}
    assert marks["step 2 optimizer"] - marks["step 1 optimizer"] <= 2 * MIB  # a small-pool segment at most


def test_zero_grad_before_backward_keeps_the_previous_steps_grads_through_the_forward():
    from toolkit.estimate.gpu import Runtime

    # logits = model(x); loss = ...; optimizer.zero_grad(); loss.backward(): set_to_none frees the grads only
    # there, so the forward's end holds params + grads + states + activations
    p = plan(precision="bf16-mixed", micro_batch=8, seq_len=1024)
    late = Runtime(zero_grad="before_backward")
    dt = an.dtypes_for(p, True)
    states = an.model_states(GPT2, p, dt)
    acts = inv.activations(GPT2, p, dt)
    fwd = {ph.name: ph for ph in an.phases(GPT2, p, dt, states, acts, late)}["forward end"]
    usual = {ph.name: ph for ph in an.phases(GPT2, p, dt, states, acts)}["forward end"]
    assert fwd.grads == states.grads_bytes and usual.grads == 0
    today = estimate_analytic(GPT2, p, A100)
    est = estimate_analytic(GPT2, p, A100, runtime=late)
    assert est.peak_allocated_mib >= today.peak_allocated_mib  # GPT-2's peak is the loss's backward here
    assert est.peak_reserved_mib >= today.peak_reserved_mib
    # the stream agrees: when step 2's loss saves its log-probs, the previous step's gradients are still alive
    from toolkit.estimate.stream import step_events

    logprobs = 4 * 8 * 1024 * GPT2.vocab  # as large as the fp32 logits made just before them

    def live_at_step2_logprobs(runtime) -> int:
        live, sizes, step2, seen = 0, {}, False, 0
        for e in step_events(GPT2, p, dt, states, inv.activations(GPT2, p, dt, runtime), runtime=runtime, steps=2):
            if e[0] == "mark":
                step2 = step2 or e[1] == "step 2"
            elif e[0] == "alloc":
                sizes[e[1]] = e[2]
                live += e[2]
                seen += step2 and e[2] == logprobs
                if seen == 2:
                    return live
            elif e[0] == "free":
                live -= sizes.pop(e[1])
        raise AssertionError("no log-probs in step 2")

    assert live_at_step2_logprobs(late) - live_at_step2_logprobs(Runtime()) == pytest.approx(states.grads_bytes,
                                                                                               rel=0.01)
    # torch 1.x keeps them anyway (zeroed, not freed): the placement changes nothing there
    old = Runtime(torch_version="1.10")
    old_late = Runtime(torch_version="1.10", zero_grad="before_backward")
    assert estimate_analytic(GPT2, p, A100, runtime=old).peak_reserved_mib == \
        estimate_analytic(GPT2, p, A100, runtime=old_late).peak_reserved_mib
    with pytest.raises(ValueError, match="zero_grad"):
        Runtime(zero_grad="sometimes")


def test_torchvision_vit_saves_out_projs_copy_and_casts_the_packed_projections_input_once():
    from toolkit.estimate.gpu import Runtime

    tv = Runtime(model_code="torchvision")
    h = VIT_BASE.hidden
    fp32 = plan(precision="fp32", micro_batch=8, attention="sdpa")
    dt = an.dtypes_for(fp32, True)
    # fp32: out_proj's contiguous (seq, batch) copy of the attention output, h elements per token more
    assert inv.layer_bytes_per_token(VIT_BASE, fp32, dt, tv) - inv.layer_bytes_per_token(VIT_BASE, fp32, dt) == 4 * h
    mixed = plan(precision="bf16-mixed", micro_batch=8, attention="sdpa")
    dt = an.dtypes_for(mixed, True)
    # autocast: one 16-bit copy of the norm's output for the packed in_proj instead of three, plus the copy
    assert inv.layer_bytes_per_token(VIT_BASE, mixed, dt, tv) - inv.layer_bytes_per_token(VIT_BASE, mixed, dt) == -2 * h
    # a text model is untouched; an unknown code is refused
    assert inv.layer_bytes_per_token(GPT2, fp32, dt, tv) == inv.layer_bytes_per_token(GPT2, fp32, dt)
    with pytest.raises(ValueError, match="model_code"):
        Runtime(model_code="timm")


def test_torch_before_1_11_softmax_keeps_its_input_too():
    from toolkit.estimate.gpu import Runtime

    old, new = Runtime(torch_version="1.10"), Runtime(torch_version="1.11")
    assert old.softmax_saves_input and not new.softmax_saves_input and not Runtime().softmax_saves_input
    bert = ModelShape.from_config(load_model_config("bert-large"), "seq-cls")
    s, a = 512, bert.heads
    for precision, soft in (("fp32", 4), ("fp16-mixed", 4)):  # CUDA autocast: the fp32 mask makes the scores fp32
        eager = plan(precision=precision, micro_batch=4, seq_len=s, attention="eager")
        dt = an.dtypes_for(eager, True)
        extra = inv.layer_bytes_per_token(bert, eager, dt, old) - inv.layer_bytes_per_token(bert, eager, dt, new)
        assert extra == a * s * soft
        sdpa = eager.replace(attention="sdpa")  # no score matrix, nothing more
        assert inv.layer_bytes_per_token(bert, sdpa, dt, old) == inv.layer_bytes_per_token(bert, sdpa, dt, new)
    # the estimate grows by about one a x s x s fp32 matrix per layer (4 samples x 24 layers x 16 MiB)
    eager = plan(precision="fp32", micro_batch=4, seq_len=s, attention="eager")
    assert estimate_analytic(bert, eager, V100, runtime=old).components["activations"] - \
        estimate_analytic(bert, eager, V100, runtime=Runtime(torch_version="1.11", grads_set_to_none=False)) \
        .components["activations"] == pytest.approx(4 * bert.layers * a * s * s * 4 / MIB)


def test_an_eager_attention_that_clamps_its_scores_keeps_them():
    """transformers' OPT attention of 2023 (Runtime.eager_clamps_scores): torch.max keeps the masked scores, softmax
    upcasts only fp16 scores. Per a x s per token, against today's softmax(dtype=float32) without a clamp."""
    from toolkit.estimate.gpu import Runtime

    opt = ModelShape.from_config(TINY_OPT)
    s, a = 256, opt.heads
    old = Runtime(eager_clamps_scores=True)
    cases = (  # (plan, engine), then bytes per a x s: with the clamp, without it
        (dict(precision="fp16-mixed", launcher="deepspeed", zero_stage=2), 2 + 4 + 2, 4 + 2),  # fp16 weights
        (dict(precision="bf16-true"), 2 + 2, 4 + 2),  # bf16 scores: a bf16 softmax, no copy
        (dict(precision="fp32"), 4 + 4, 4),
        (dict(precision="fp16-mixed"), 4 + 4 + 2, 4 + 2))  # autocast: the fp32 mask promotes the scores
    for knobs, clamped, today in cases:
        p = plan(attention="eager", seq_len=s, **knobs)
        dt = an.dtypes_for(p, True)
        qkvo = 4 * opt.hidden * dt.compute
        assert inv._attention_bytes(opt, p, dt, old) == qkvo + a * s * clamped, knobs
        assert inv._attention_bytes(opt, p, dt) == qkvo + a * s * today, knobs
        sdpa = p.replace(attention="sdpa")  # no score matrix: nothing to clamp
        assert inv._attention_bytes(opt, sdpa, dt, old) == inv._attention_bytes(opt, sdpa, dt)
    with pytest.raises(ValueError, match="eager_clamps_scores"):
        Runtime(eager_clamps_scores="yes")


def test_torchvision_vit_stream_allocates_the_packed_in_projection_as_one_tensor():
    from math import prod

    from toolkit.estimate import stream

    hf = stream.param_order(VIT_BASE)
    tv = stream.param_order(VIT_BASE, packed=True)
    h = VIT_BASE.hidden
    assert sum(prod(e[1]) for e in hf) == sum(prod(e[1]) for e in tv)  # the same parameters
    names = [e[0] for e in tv if e[3] == 0]
    assert "attention.in_proj_weight" in names and not any("q_proj" in n for n in names)
    assert [e[1] for e in tv if e[0] == "attention.in_proj_weight"][0] == (3 * h, h)
    assert len(tv) == len(hf) - 2 * VIT_BASE.layers  # three weights became one per layer (biases are bundled)


def test_foreach_adamw_before_torch_2_1_holds_two_parameter_sized_intermediates():
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import foreach_step_copies

    assert Runtime(torch_version="2.0").foreach_adam_intermediates == 2
    assert Runtime(torch_version="2.1.0.dev20230623+cu118").foreach_adam_intermediates == 2  # before PR #104780
    assert Runtime(torch_version="2.1.0.dev20230801").foreach_adam_intermediates == 1
    assert Runtime(torch_version="2.1.0+cu121").foreach_adam_intermediates == 1
    assert Runtime().foreach_adam_intermediates == 1
    old = Runtime(torch_version="2.0")
    p = plan(precision="bf16-true", micro_batch=1, seq_len=128)
    dt = an.dtypes_for(p, True)
    states = an.model_states(GPT2, p, dt)
    acts = inv.activations(GPT2, p, dt, old)
    step = {ph.name: ph for ph in an.phases(GPT2, p, dt, states, acts, old)}["optimizer step"]
    assert step.temporaries == 2 * states.step_temp_bytes and states.step_temp_bytes > 0
    assert foreach_step_copies(p.replace(optimizer="adamw-fused"), dt, old) == 1  # fused: no foreach lists
    assert foreach_step_copies(p, an.dtypes_for(p, False), old) == 1  # CPU tensors: torch loops per parameter
    # the optimizer step is the peak here: allocated grows by the second list; the replayed stream holds
    # it too (part of it fits in blocks the activations left)
    before = estimate_analytic(GPT2, p, A100, runtime=old)
    after = estimate_analytic(GPT2, p, A100, runtime=Runtime(torch_version="2.1"))
    assert before.peak_allocated_mib - after.peak_allocated_mib == pytest.approx(states.step_temp_bytes / MIB)
    assert before.peak_reserved_mib > after.peak_reserved_mib + 0.5 * states.step_temp_bytes / MIB


def test_more_ranks_add_nccl_buffers_outside_the_allocator():
    one = estimate_analytic(GPT2, plan(precision="bf16-mixed", micro_batch=4, seq_len=512), A100)
    four = estimate_analytic(GPT2, plan(precision="bf16-mixed", micro_batch=4, seq_len=512, gpus_per_node=4), A100)
    assert four.gpu_extras_mib["nccl_buffers"] > 0 and not one.gpu_extras_mib
    assert four.device_used_mib == pytest.approx(four.components["cuda_context"] + four.peak_reserved_mib
                                                 + four.gpu_extras_mib["nccl_buffers"])


def test_a_fragmentation_only_failure_names_the_setting_that_fits(monkeypatch):
    from toolkit.estimate import device

    # the tensors of this plan fit a V100; force the replay to find the reserved memory over the limit
    p = plan(precision="fp16-mixed", micro_batch=4, seq_len=512)
    real = device.device_memory

    def tight(events, *, capacity_mib, **kw):
        got = real(events, capacity_mib=None, **kw)
        return real(events, capacity_mib=(got.peak_allocated_mib + got.peak_reserved_mib) / 2, **kw)

    monkeypatch.setattr(device, "device_memory", tight)
    e = estimate_analytic(GPT2, p, V100)
    assert e.fits_allocated is True
    if e.fragmentation_only:  # the replay's own reserved peak exceeded the midpoint
        assert not e.fits and e.oom is not None
        assert e.alloc_conf_fix is None or e.fix_device_used_mib is not None
        assert any("fragmentation" in n for n in e.notes)


def test_fsdp1_without_the_rate_limiter_reserves_every_units_gather_and_gradient_for_the_step():
    from toolkit.estimate.gpu import Runtime

    # limit_all_gathers defaulted to False until PR #104900 (nightlies from 2023-07-12, the 2.1 release);
    # torch >= 2.4's fsdp is FSDP2, which hpcmem runs (no rate limiter question)
    assert Runtime(torch_version="2.1.0.dev20230623").fsdp_unlimited_all_gathers
    assert Runtime(torch_version="2.0.1").fsdp_unlimited_all_gathers
    assert not Runtime(torch_version="2.1.0.dev20230712").fsdp_unlimited_all_gathers
    assert not Runtime(torch_version="2.1.0+cu121").fsdp_unlimited_all_gathers
    assert not Runtime(torch_version="2.3").fsdp_unlimited_all_gathers
    assert not Runtime().fsdp_unlimited_all_gathers
    # a job that passes limit_all_gathers says so, whatever its torch's default (llama-recipes on 2.0)
    assert not Runtime(torch_version="2.0.1", fsdp_limit_all_gathers=True).fsdp_unlimited_all_gathers
    assert Runtime(torch_version="2.1.0+cu121", fsdp_limit_all_gathers=False).fsdp_unlimited_all_gathers
    assert not Runtime(torch_version="2.4", fsdp_limit_all_gathers=False).fsdp_unlimited_all_gathers  # FSDP2
    # two nightlies that differ only in the limiter's default (both after the foreach Adam change)
    old, new = Runtime(torch_version="2.1.0.dev20230710"), Runtime(torch_version="2.1.0.dev20230712")
    assert old.fsdp_unlimited_all_gathers and not new.fsdp_unlimited_all_gathers
    assert old.foreach_adam_intermediates == new.foreach_adam_intermediates
    # the pytorch-memory-optim FSDP row's setup on a ViT-B: fp32, checkpointed blocks, 4 ranks
    p = plan(launcher="fsdp", gpus_per_node=4, precision="fp32", micro_batch=64, seq_len=197, checkpointing=True)
    unlimited, limited = (estimate_analytic(VIT_BASE, p, A100, runtime=r) for r in (old, new))
    unit = 4 * VIT_BASE.layer_params / MIB
    # the frees happened (memory_allocated does not see the pending blocks); the reserved memory holds at
    # least one pass's gathered units more than the two in flight under the limiter
    assert unlimited.peak_allocated_mib == pytest.approx(limited.peak_allocated_mib)
    assert unlimited.peak_reserved_mib - limited.peak_reserved_mib >= (VIT_BASE.layers - 2) * unit
    # only FSDP FULL_SHARD: DeepSpeed ZeRO-3 under the same two nightlies is unchanged
    ds = p.replace(launcher="deepspeed", zero_stage=3)
    assert estimate_analytic(VIT_BASE, ds, A100, runtime=old).peak_reserved_mib == \
        estimate_analytic(VIT_BASE, ds, A100, runtime=new).peak_reserved_mib


def test_fsdp1_cpu_offload_copies_each_units_shard_to_the_device_and_keeps_its_gradient_shard():
    """FSDP1 with CPUOffload(offload_params=True) (torch's FlatParamHandle.pre_unshard, _accumulate_sharded_grad and
    prepare_gradient_for_optim): every unshard copies the unit's shard to the device first, the all-gather's input,
    which NCCL records on its stream: without the rate limiter a block of its own until the backward's end, as the
    gathered units are; with it, a transient. Each unit's gradient shard stays on the device, in the flat
    parameter's dtype, until the backward's final callback, limiter or not. FSDP2 offload keeps neither."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import step_events

    old, new = Runtime(torch_version="2.1.0.dev20230623"), Runtime(torch_version="2.3")
    assert old.fsdp_unlimited_all_gathers and not new.fsdp_unlimited_all_gathers and new.fsdp_flat_params
    base = plan(launcher="fsdp", gpus_per_node=4, precision="bf16-mixed", micro_batch=64, seq_len=197,
                checkpointing=True, offload_params="cpu")
    dt = an.dtypes_for(base, True)
    copy = -(-2 * VIT_BASE.layer_params // 4)  # the unit's shard in the gathered bf16
    root = -(-2 * (VIT_BASE.n_params - VIT_BASE.layers * VIT_BASE.layer_params) // 4)

    def stream(runtime, p=base):
        states = an.model_states(VIT_BASE, p, dt, runtime)
        return states, step_events(VIT_BASE, p, dt, states, inv.activations(VIT_BASE, p, dt, runtime),
                                   runtime=runtime, steps=2, sharded=True)

    def most_copies_at_once(events):
        live: dict = {}
        most = 0
        for e in events:
            if e[0] == "alloc":
                live[e[1]] = e[2]
            elif e[0] == "free":
                live.pop(e[1])
            most = max(most, list(live.values()).count(copy))
        return most

    for runtime in (old, new):
        states, events = stream(runtime)
        # the gradient shards: fp32 (the flat parameter's dtype), the whole rank's share, freed before the step
        assert states.grads_bytes == pytest.approx(4 * VIT_BASE.n_params / 4) and states.grads_end_with_backward
        assert states.params_bytes == 0 and states.optimizer_bytes == 0
        allocs = [e[2] for e in events if e[0] == "alloc"]
        # two copies per layer (the forward's gather and the backward's) and one of the root per step
        assert allocs.count(copy) >= 2 * 2 * VIT_BASE.layers and allocs.count(root) >= 2
        phases = {ph.name: ph for ph in an.phases(VIT_BASE, base, dt, states, inv.activations(VIT_BASE, base, dt,
                                                                                              runtime), runtime)}
        # (with the head's unsharded gradient, held until the root is reduced)
        assert phases["backward end"].grads >= states.grads_bytes and phases["optimizer step"].grads == 0
    # without the limiter every copy of the step is held until the backward's end; with it, one at a time
    assert most_copies_at_once(stream(old)[1]) == 2 * VIT_BASE.layers
    assert most_copies_at_once(stream(new)[1]) == 1
    # the reserved peak of the unlimited run holds them all: without them it is lower
    events = stream(old)[1]
    ids = {e[1] for e in events if e[0] == "alloc" and e[2] == copy}
    rest = [e for e in events if e[0] == "mark" or e[1] not in ids]
    full, less = replay(events), replay(rest)
    # (to a block's rounding: allocated counts whole blocks, and the gradient shards' own pool moves the peak's
    # blocks a little)
    assert full.peak_allocated - less.peak_allocated >= 0.98 * 2 * VIT_BASE.layers * copy
    assert full.peak_reserved > less.peak_reserved
    # FSDP2 (torch >= 2.4) offloads the gradients too, and makes no such copies
    states2, events2 = stream(Runtime())
    assert states2.grads_bytes == 0 and not states2.grads_end_with_backward
    assert [e[2] for e in events2 if e[0] == "alloc"].count(copy) == 0


def test_fsdp_no_sync_keeps_the_whole_unsharded_gradient_between_micro_batches():
    """Accumulation under FSDP's no_sync (Runtime.fsdp_no_sync: HF Trainer, Accelerate, Lightning) keeps every
    unit's unsharded gradient from the first micro-batch until the last one's reduce-scatter: FSDP1 in the compute
    dtype (its flat parameter's .grad), FSDP2 in the mixed-precision policy's reduce dtype
    (to_accumulated_grad_if_needed). Hand-worked on ViT-B over 4 ranks; a synced accumulation keeps shards only."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import step_events

    psi = VIT_BASE.n_params
    for precision, reduce_dtype, torch_version, per_elem in (
            ("bf16-mixed", "fp32", "2.2", 2), ("bf16-mixed", "fp32", None, 4), ("bf16-mixed", "param", None, 2),
            ("bf16-true", "fp32", None, 2), ("fp32", "fp32", "2.2", 4)):
        p = plan(launcher="fsdp", gpus_per_node=4, precision=precision, reduce_dtype=reduce_dtype, micro_batch=8,
                 seq_len=197, grad_accum=4, checkpointing=True)
        dt = an.dtypes_for(p, True)
        runs = {}
        for no_sync in (False, True):
            rt = Runtime(torch_version=torch_version, fsdp_no_sync=no_sync)
            states = an.model_states(VIT_BASE, p, dt, rt)
            acts = inv.activations(VIT_BASE, p, dt, rt)
            runs[no_sync] = (states, {ph.name: ph for ph in an.phases(VIT_BASE, p, dt, states, acts, rt)},
                             step_events(VIT_BASE, p, dt, states, acts, runtime=rt, steps=2, sharded=True))
        (synced, sph, sev), (kept, kph, kev) = runs[False], runs[True]
        case = (precision, reduce_dtype, torch_version)
        assert synced.accumulated_grads_bytes == 0 and kept.accumulated_grads_bytes == per_elem * psi, case
        assert kept.grads_bytes == synced.grads_bytes  # the shards the optimizer steps over are the same
        # the whole unsharded gradient is alive through the micro-batches, the shards after the last one
        for name in ("forward end", "backward start", "head backward", "backward, last layer",
                     "backward, first layer"):
            assert kph[name].grads == per_elem * psi, (case, name)
        assert kph["backward end"].grads == max(per_elem * psi, synced.grads_bytes)
        assert kph["optimizer step"].grads == sph["optimizer step"].grads == synced.grads_bytes
        # the stream holds it too (the new gradient of the last micro-batch is a transient, the unsharded one freed
        # after its shard is made): the allocated peak rises by what is held beyond the shards (to 1 %: the
        # transients differ in size, and so does where a block splits), by no more than the whole unsharded
        # gradient, and the same tensors are alive after the step
        gain = replay(kev).peak_allocated - replay(sev).peak_allocated
        assert 0.99 * (per_elem * psi - synced.grads_bytes) <= gain <= per_elem * psi, case

        def alive(events):
            live: dict = {}
            for e in events:
                if e[0] == "alloc":
                    live[e[1]] = e[2]
                elif e[0] == "free":
                    live.pop(e[1])
            return sorted(live.values())

        assert alive(kev) == alive(sev)
    # a zero_grad that keeps the shards allocated (set_to_none=False): the phases hold them beside the unsharded
    # gradient, as the stream does
    p = plan(launcher="fsdp", gpus_per_node=4, precision="bf16-mixed", micro_batch=8, seq_len=197, grad_accum=4,
             checkpointing=True)
    dt = an.dtypes_for(p, True)
    for keep_shards in (False, True):
        rt = Runtime(fsdp_no_sync=True, grads_set_to_none=not keep_shards)
        states = an.model_states(VIT_BASE, p, dt, rt)
        states = dataclasses.replace(states, persistent_grads=True) if keep_shards else states  # as estimate_analytic
        ph = {x.name: x for x in an.phases(VIT_BASE, p, dt, states, inv.activations(VIT_BASE, p, dt, rt), rt)}
        held = states.accumulated_grads_bytes + (states.grads_bytes if keep_shards else 0.0)
        assert ph["forward end"].grads == ph["backward, first layer"].grads == held, keep_shards
    # nothing to keep without accumulation or on one rank
    for p in (plan(launcher="fsdp", gpus_per_node=4, precision="bf16-mixed", micro_batch=8, seq_len=197),
              plan(launcher="fsdp", gpus_per_node=1, precision="bf16-mixed", micro_batch=8, seq_len=197, grad_accum=4)):
        assert an.model_states(VIT_BASE, p, an.dtypes_for(p, True),
                               Runtime(fsdp_no_sync=True)).accumulated_grads_bytes == 0
    with pytest.raises(ValueError, match="fsdp_no_sync"):
        Runtime(fsdp_no_sync="yes")


def test_fsdp2_reduce_scatters_from_a_new_flat_input_whatever_the_dtypes():
    """A unit's reduction, read in torch 2.13: FSDP2's foreach_reduce (_fsdp_collectives.py) copies the unit's
    unsharded gradients into a new flat reduce-scatter input in the reduce dtype, frees them, then makes the output
    shard; FSDP1's flat gradient is the cat that the backward of its views' split makes while the views' gradients
    are alive (_flat_param.py), then cast to the reduce dtype where that differs. The unsharded gradients go with
    the unit's backward (grad_bucket_bytes); the rest comes once its computation is done (reduce_extra_bytes)."""
    from toolkit.estimate.gpu import Runtime

    unit, n = VIT_BASE.layer_params, 4
    for precision, reduce_dtype, grad, reduce in (("bf16-mixed", "param", 2, 2), ("bf16-mixed", "fp32", 2, 4),
                                                  ("fp32", "param", 4, 4), ("bf16-true", "param", 2, 2)):
        p = plan(launcher="fsdp", gpus_per_node=n, precision=precision, reduce_dtype=reduce_dtype, micro_batch=8,
                 seq_len=197)
        dt = an.dtypes_for(p, True)
        fsdp2 = an.model_states(VIT_BASE, p, dt, Runtime())
        fsdp1 = an.model_states(VIT_BASE, p, dt, Runtime(torch_version="2.3"))
        for states in (fsdp2, fsdp1):
            assert states.buffer_bytes == 0, "nothing of the reduction lives through the forward"
            assert states.grad_bucket_bytes == pytest.approx(unit * grad)
        after_copy_in = unit * reduce * (1 + 1 / n)  # the input and the output shard, the gradients freed
        assert fsdp2.reduce_extra_bytes + unit * grad == pytest.approx(max(unit * (grad + reduce), after_copy_in))
        assert fsdp1.reduce_extra_bytes + unit * grad == pytest.approx(
            max(unit * (grad + max(grad, reduce)), after_copy_in)), (precision, reduce_dtype)


def test_fsdp_root_unit_is_reduced_at_the_backward_end_holding_the_head_gradient():
    """The root unit (embeddings, final norm, head) has no input that needs a gradient, so FSDP reduces it in the
    backward's final callback (FSDP2's _root_post_backward_final_callback, read in torch 2.13): the head's unsharded
    gradient is held from its backward to there, where the whole root is reduced at once. A job that wraps the
    embedding as a unit of its own (Runtime.fsdp_embedding_unit, an untied head) reduces the root (norm + head)
    in the head's backward instead, and only the embedding at the end."""
    from math import prod

    from toolkit.estimate.gpu import Runtime

    LLAMA_8B = ModelShape.from_config({  # Meta-Llama-3-8B's config.json: an untied head over a 128256-token vocabulary
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False})
    p = plan(launcher="fsdp", gpus_per_node=8, precision="bf16-mixed", reduce_dtype="fp32", micro_batch=1,
             seq_len=512, checkpointing=True)
    dt = an.dtypes_for(p, True)
    root = LLAMA_8B.n_params - LLAMA_8B.layers * LLAMA_8B.layer_params
    states = an.model_states(LLAMA_8B, p, dt, Runtime())
    assert states.held_head_bytes == pytest.approx(2 * LLAMA_8B.head_linear_params)
    assert states.end_reduce_bytes == pytest.approx(root * (2 + 4))  # unsharded bf16 grads + the fp32 input
    assert states.head_reduce_bytes == 0
    ph = {x.name: x for x in an.phases(LLAMA_8B, p, dt, states, inv.activations(LLAMA_8B, p, dt, Runtime()),
                                       Runtime())}
    assert ph["backward, last layer"].grads == pytest.approx(states.held_head_bytes)
    # the root is resharded before it reduces: no gathered weights, and its own gradient shard not made yet
    root_red = ph["root reduction"]
    assert root_red.params == states.params_bytes and root_red.temporaries >= states.end_reduce_bytes
    assert root_red.grads == pytest.approx(states.grads_bytes * (1 - root / LLAMA_8B.n_params))
    # the root of Llama-3-8B (two 128256 x 4096 matrices) is five layers' worth: its reduction is the backward's peak
    assert root_red.total > max(ph[name].total for name in ("backward, first layer", "backward end"))

    # the allocator stream: each backward holds the head's gradient from the head to the root's reduction, made
    # after the embedding's gradient (the rest of the root's unsharded gradients and its reduce-scatter buffers)
    from toolkit.estimate.stream import step_events

    events = step_events(LLAMA_8B, p, dt, states, inv.activations(LLAMA_8B, p, dt, Runtime()), runtime=Runtime(),
                         steps=2, sharded=True)
    live: dict[int, tuple[int, int]] = {}  # id -> (size, event index)
    found = 0
    for k, e in enumerate(events):
        if e[0] == "alloc":
            if e[2] == int(states.end_reduce_bytes - states.held_head_bytes):
                # the head's gradient is alive, made before the layers' backward (the embedding's transients, of
                # the same vocab x hidden size, are gone by now)
                held = [at for size, at in live.values() if size == int(states.held_head_bytes)]
                assert len(held) == 1 and k - held[0] > LLAMA_8B.layers, (k, held)
                found += 1
            live[e[1]] = (e[2], k)
        elif e[0] == "free":
            live.pop(e[1], None)
    assert found == 2  # one per step

    own = an.model_states(LLAMA_8B, p, dt, Runtime(fsdp_embedding_unit=True))
    emb = max(prod(d) for _n, d, k in LLAMA_8B.other_tensors if k == "embedding")
    assert own.held_head_bytes == 0
    assert own.head_reduce_bytes == pytest.approx((root - emb) * (2 + 4))
    assert own.end_reduce_bytes == pytest.approx(emb * (2 + 4))
    with pytest.raises(ValueError, match="fsdp_embedding_unit"):
        Runtime(fsdp_embedding_unit="yes")


def test_fsdp_gathered_weights_follow_the_step_moment_by_moment():
    """FSDP2's gathered weights at the phases' moments: the root throughout; with resharding, by the loss none of the
    layers' units, in the backward the unit computing and the one prefetched (the first layer has none after it);
    without resharding every unit until its backward, then only the first layer's; at the embeddings' backward no
    layer's unit (each is resharded after its backward). Measured on one CPU rank with hpcmem's own FSDP2 sharding
    by benchmarks/fsdp_cpu_check.py (docs/estimator.md, session 20). Also: FSDP2 reshards the root after its
    forward from torch 2.8 when the job passes reshard_after_forward=True, not before."""
    from toolkit.estimate.gpu import Runtime

    root = 2 * (LLAMA7B.n_params - LLAMA7B.layers * LLAMA7B.layer_params)
    unit = 2 * LLAMA7B.layer_params
    for reshard in (True, False):
        p = plan(launcher="fsdp", gpus_per_node=4, precision="bf16-mixed", micro_batch=1, seq_len=512,
                 reshard_after_forward=reshard)
        at = an.model_states(LLAMA7B, p, an.dtypes_for(p, True), Runtime()).gathered_moments
        middle = 2 if reshard else LLAMA7B.layers
        assert at.forward_end == pytest.approx(root + (0 if reshard else middle * unit))
        assert at.last_layer == pytest.approx(root + middle * unit)
        assert at.first_layer == pytest.approx(root + unit) and at.backward_end == pytest.approx(root)
    # FSDP1: the root and two units at every moment, as before (no trace of an FSDP1 step says otherwise)
    p = plan(launcher="fsdp", gpus_per_node=4, precision="bf16-mixed", micro_batch=1, seq_len=512)
    assert an.model_states(LLAMA7B, p, an.dtypes_for(p, True), Runtime(fsdp_api="fsdp1")).gathered_moments is None
    assert Runtime(torch_version="2.8").fsdp_root_reshards_after_forward
    assert not Runtime(torch_version="2.7").fsdp_root_reshards_after_forward
    assert not Runtime(fsdp_api="fsdp1").fsdp_root_reshards_after_forward


def test_fsdp_optimizer_steps_over_the_shards_as_torch_sees_them():
    """strategies.fsdp.optimizer_tensors: FSDP2 steps over each parameter's shard (dim 0 chunked); FSDP1 over one
    flat shard per wrapped unit (the root first), or with use_orig_params over each original parameter's piece of
    the rank's contiguous chunk of the unit."""
    from math import prod

    from toolkit.strategies.fsdp import optimizer_tensors

    root = VIT_BASE.n_params - VIT_BASE.layers * VIT_BASE.layer_params
    unit = VIT_BASE.layer_params
    flat = optimizer_tensors(VIT_BASE, 4, flat=True)
    assert flat == [(-(-root // 4),)] + [(-(-unit // 4),)] * VIT_BASE.layers
    pieces = optimizer_tensors(VIT_BASE, 4, flat=True, orig_params=True)
    assert sum(prod(d) for d in pieces) == sum(prod(d) for d in flat)
    assert all(len(d) == 1 for d in pieces) and len(pieces) > len(flat)
    layer = [prod(dims) for _n, dims, _k in VIT_BASE.layer_tensors]
    # rank 0's chunk of a layer: its parameters in order, whole, until the chunk ends inside one
    chunk, got, taken = -(-unit // 4), [], 0
    for n in layer:
        if taken >= chunk:
            break
        got.append(min(n, chunk - taken))
        taken += got[-1]
    assert [prod(d) for d in pieces[-len(got):]] == got
    fsdp2 = optimizer_tensors(VIT_BASE, 4)
    assert len(fsdp2) == len([t for t in VIT_BASE.other_tensors if t[1]]) + VIT_BASE.layers * len(layer)
    assert (768, 768) in fsdp2  # a 3072 x 768 MLP weight, 768 rows per rank
    # a factored optimizer keeps a full second moment of a 1-D tensor: FSDP1's states are the flat shards'
    p = plan(launcher="fsdp", gpus_per_node=4, precision="fp32", optimizer="adafactor", micro_batch=8, seq_len=197)
    dt = an.dtypes_for(p, True)
    from toolkit.estimate.gpu import Runtime

    fsdp1_states = an.model_states(VIT_BASE, p, dt, Runtime(torch_version="2.3")).optimizer_bytes
    fsdp2_states = an.model_states(VIT_BASE, p, dt, Runtime()).optimizer_bytes
    assert fsdp1_states == pytest.approx(4 * sum(prod(d) for d in flat)) and fsdp2_states < fsdp1_states / 4
    # a job that states its FSDP (Accelerate's plugin: FSDP1 on any torch) is taken at its word
    stated = an.model_states(VIT_BASE, p, dt, Runtime(torch_version="2.7", fsdp_api="fsdp1")).optimizer_bytes
    assert stated == fsdp1_states
    assert an.model_states(VIT_BASE, p, dt, Runtime(torch_version="2.3", fsdp_api="fsdp2")).optimizer_bytes == fsdp2_states
    with pytest.raises(ValueError, match="fsdp_api"):
        Runtime(fsdp_api="FSDP1")


def test_fsdp_optimizer_states_are_made_by_the_first_step_tensor_by_tensor():
    """torch's optimizers make their states at the first step, one per tensor they step over
    (strategies.fsdp.optimizer_tensors), not as one flat buffer at start-up (DeepSpeed's); a foreach step's
    temporaries are as many tensors; the second step makes no states."""
    from math import prod

    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import foreach_step_copies, step_events
    from toolkit.strategies.fsdp import optimizer_tensors

    def at_steps(p, runtime):
        dt = an.dtypes_for(p, True)
        states = an.model_states(VIT_BASE, p, dt, runtime)
        events = step_events(VIT_BASE, p, dt, states, inv.activations(VIT_BASE, p, dt, runtime), runtime=runtime,
                             steps=2, sharded=True)
        one = events.index(("mark", "step 1 optimizer"))
        two = events.index(("mark", "step 2"))
        two_step = events.index(("mark", "step 2 optimizer"))
        sizes = [[e[2] for e in part if e[0] == "alloc"] for part in (events[:one], events[one:two], events[two_step:])]
        return states, dt, sizes

    # FSDP1 through Lightning (use_orig_params): foreach AdamW over the pieces, torch 2.0's two temporaries each
    p = plan(launcher="fsdp", gpus_per_node=4, precision="fp32", micro_batch=8, seq_len=197)
    orig = Runtime(torch_version="2.0.1", fsdp_use_orig_params=True)
    states, dt, (before, step1, step2) = at_steps(p, orig)
    pieces = [4 * prod(d) for d in optimizer_tensors(VIT_BASE, 4, flat=True, orig_params=True)]
    assert foreach_step_copies(p, dt, orig) == 2
    assert sorted(step1) == sorted(pieces * (2 + 2))  # exp_avg and exp_avg_sq, then two temporaries per piece
    assert sorted(step2) == sorted(pieces * 2)  # the states exist: the temporaries only
    assert max(before) <= states.params_bytes < states.optimizer_bytes  # no flat buffer of states at start-up
    # FSDP1's own FlatParameter is no nn.Parameter to torch's foreach check: the per-parameter AdamW, one unit
    # at a time
    per = p.replace(optimizer="adamw-perparam")
    _, _, (_, step1, _) = at_steps(per, Runtime(torch_version="2.0.1"))
    unit = 4 * -(-VIT_BASE.layer_params // 4)
    assert step1.count(unit) >= 2 * VIT_BASE.layers
    # FSDP2: every parameter's shard, one foreach temporary each
    _, dt2, (_, step1, step2) = at_steps(p, Runtime())
    shards = [4 * prod(d) for d in optimizer_tensors(VIT_BASE, 4)]
    assert foreach_step_copies(p, dt2, Runtime()) == 1
    assert sorted(step1) == sorted(shards * 3) and sorted(step2) == sorted(shards)


def test_zero3_offload_hands_the_largest_gradient_partition_to_the_host_through_device_copies():
    """DeepSpeed ZeRO-3 with optimizer offload (stage3.py partition_grads): each gradient partition is copied
    back to the device, its norm taken in fp64 chunks of at most 250M elements, and it is cast to fp32 on the
    device before the copy to the host. The largest partition's copies are a transient of the backward."""
    from toolkit.estimate.analytic import dtypes_for, model_states

    def states(shape, **knobs):
        p = plan(launcher="deepspeed", gpus_per_node=4, precision="bf16-mixed", zero_stage=3, **knobs)
        return p, model_states(shape, p, dtypes_for(p, True))

    p, offload = states(LLAMA7B, offload_optimizer="cpu", offload_params="cpu")
    part = LLAMA7B.largest_param_numel / 4  # the 32000 x 4096 embedding (and untied head), a quarter per rank
    assert offload.reduce_temp_bytes == pytest.approx(2 * part + 8 * part)  # bf16 copy + fp64 norm (> fp32 cast)
    assert states(LLAMA7B)[1].reduce_temp_bytes == 0  # without offload the partition stays on the device
    two = Plan(launcher="deepspeed", nodes=1, gpus_per_node=4, global_batch=4, micro_batch=1, seq_len=512,
               precision="bf16-mixed", zero_stage=2, offload_optimizer="cpu")
    # ZeRO-1/2 (stage_1_and_2.py copy_grads_in_partition): the rank's slice of a gradient, a range of the flat
    # model, normed in fp64 on the device, then cast to fp32: the rank owning the largest parameter whole. The
    # embedding (131M elements) is larger than hpcmem's 50M bucket, so at ZeRO-2 its bf16 gradient is a tensor
    # of its own through the hand-over
    emb = LLAMA7B.largest_param_numel
    assert model_states(LLAMA7B, two, dtypes_for(two, True)).reduce_temp_bytes == 2 * emb + 8 * emb
    tiny_share = two.replace(gpus_per_node=8, nodes=64, global_batch=512)  # the flat model's 512th is smaller than the embedding
    assert model_states(LLAMA7B, tiny_share, dtypes_for(tiny_share, True)).reduce_temp_bytes == \
        2 * emb + 8 * math.ceil(LLAMA7B.n_params / 512)
    assert model_states(LLAMA7B, two.replace(zero_stage=1), dtypes_for(two, True)).reduce_temp_bytes == 8 * emb
    assert model_states(LLAMA7B, two.replace(offload_optimizer="none"),
                        dtypes_for(two, True)).reduce_temp_bytes == 0
    assert model_states(LLAMA7B, p, dtypes_for(p, False)).reduce_temp_bytes == 0  # no CUDA norm on the CPU
    # ZeRO-1/2 with CPU offload also keep a 16-bit staging buffer of the largest parameter's size on the device
    # (temp_grad_buffer_for_gpu_offload), beside the gradient bucket
    kept = {o: model_states(LLAMA7B, two.replace(offload_optimizer=o), dtypes_for(two, True)).buffer_bytes
            for o in ("cpu", "none")}
    assert kept["cpu"] - kept["none"] == 2 * LLAMA7B.largest_param_numel
    # a partition above the chunk: the fp64 norm is one chunk, the fp32 cast the whole partition
    big = ModelShape.from_param_count(20_000_000_000, hidden=8192, layers=20, heads=64, vocab=256_000)
    _, s = states(big, offload_optimizer="cpu")
    part = big.largest_param_numel / 4
    assert part > 250_000_000 and s.reduce_temp_bytes == pytest.approx(2 * part + max(8 * 250_000_000, 4 * part))
    # the phases: the untied head's hand-over in the head's backward, the embedding's at the backward's end;
    # a tied head (GPT-2) hands its gradient over with the embedding's, at the end only
    dt = dtypes_for(p, True)
    acts = an.activations(LLAMA7B, p, dt)
    with_, without = ({ph.name: ph for ph in an.phases(LLAMA7B, p, dt, st, acts)}
                      for st in (offload, dataclasses.replace(offload, reduce_temp_bytes=0.0)))
    for name in ("head backward", "backward end"):
        assert with_[name].temporaries - without[name].temporaries == pytest.approx(offload.reduce_temp_bytes)
    assert with_["backward start"].total == without["backward start"].total
    g, tied = states(GPT2, offload_optimizer="cpu")
    gdt, gacts = dtypes_for(g, True), an.activations(GPT2, g, dtypes_for(g, True))
    gp = {ph.name: ph for ph in an.phases(GPT2, g, gdt, tied, gacts)}
    gq = {ph.name: ph for ph in an.phases(GPT2, g, gdt, dataclasses.replace(tied, reduce_temp_bytes=0.0), gacts)}
    assert gp["head backward"].total == gq["head backward"].total
    assert gp["backward end"].total - gq["backward end"].total == pytest.approx(tied.reduce_temp_bytes)


def test_zero_gradient_buckets_come_from_the_ds_config_with_deepspeeds_lifetimes():
    """DeepSpeed's contiguous-gradient buckets (stage_1_and_2.py setup_buckets / _release_ipg_buffers, stage3.py
    "IPG"): reduce_bucket_size elements of 16-bit each; ZeRO-1/2 make one (two with overlap_comm) at the first
    gradient and free them in the backward's epilogue, ZeRO-3 keeps one from start-up. A ds_config that leaves
    a field out gets DeepSpeed's default (5e8 elements; overlap_comm on at stage 3 only); "auto" is transformers'
    hidden x hidden."""
    from toolkit.estimate.analytic import dtypes_for, model_states
    from toolkit.estimate.gpu import Runtime
    from toolkit.strategies.deepspeed import ZeroSettings

    def states(stage, zero=None, gpu=True):
        p = plan(launcher="deepspeed", gpus_per_node=4, precision="bf16-mixed", zero_stage=stage)
        return p, model_states(LLAMA7B, p, dtypes_for(p, gpu), Runtime(engine_config=zero))

    _, own = states(2)  # hpcmem's ds_config: 5e7 elements, overlap_comm on a GPU: two buckets
    assert (own.buffer_bytes, own.grad_bucket_bytes) == (0.0, 2 * 2 * 50_000_000)
    _, cpu = states(2, gpu=False)  # overlap off on CPU ranks; only what gradients write becomes resident
    assert cpu.grad_bucket_bytes == 2 * min(50_000_000, LLAMA7B.n_params)
    _, default = states(2, {"stage": 2})  # DeepSpeed's defaults: 5e8, overlap_comm off below stage 3
    assert default.grad_bucket_bytes == 2 * 500_000_000
    _, z3 = states(3, {"stage": 3, "reduce_bucket_size": 2e8})  # one bucket, kept from start-up
    assert (z3.buffer_bytes, z3.grad_bucket_bytes) == (2 * 200_000_000, 0.0)
    _, off = states(3, {"contiguous_gradients": False})
    assert off.buffer_bytes == off.grad_bucket_bytes == 0.0
    assert ZeroSettings.from_config({"reduce_bucket_size": "auto"}, stage=2, hidden=4096).reduce_bucket_size == 4096 ** 2
    # the phases: ZeRO-2's buckets from the head's backward to the backward's end, not in the forward or the step
    p, z2 = states(2, {"stage": 2, "overlap_comm": True})
    dt = dtypes_for(p, True)
    acts = an.activations(LLAMA7B, p, dt)
    with_, without = ({ph.name: ph for ph in an.phases(LLAMA7B, p, dt, st, acts)}
                      for st in (z2, dataclasses.replace(z2, grad_bucket_bytes=0.0)))
    for name, ph in with_.items():
        expect = 2 * 2 * 500_000_000 if name.startswith(("head", "backward,", "backward end")) else 0.0
        assert ph.total - without[name].total == pytest.approx(expect), name


def test_zero3_reduces_each_bucket_through_a_copy_and_gathers_only_across_ranks():
    """DeepSpeed ZeRO-3 with reduce_scatter (its default): reduce_scatter_coalesced copies the bucket's gradients
    into one new tensor (torch.cat) whenever the next gradient would overflow the bucket, and in the backward's
    epilogue; with overlap_comm on the reduce stream. On one rank without parameter offload it gathers nothing
    (_no_gather_coalesced: a parameter's data is its own partition)."""
    from toolkit.estimate.stream import REDUCE_STREAM, GATHER_STREAM, step_events, zero3_reductions
    from toolkit.strategies.deepspeed import ZeroSettings, zero3_gathers

    # hand-worked on the 2-layer Llama of the coordinator's test: backward order head 10M, layer 1 (MLP 3 x 2M,
    # attention 4 x 1M, norms), layer 0 (same), embedding 10M; a 12M bucket
    shape = ModelShape.from_config({"model_type": "llama", "hidden_size": 1000, "intermediate_size": 2000,
                                    "num_hidden_layers": 2, "num_attention_heads": 10, "num_key_value_heads": 10,
                                    "vocab_size": 10_000, "tie_word_embeddings": False})
    layer = 3 * 2_000_000 + 4 * 1_000_000 + 2 * 1000
    final_norm = 1000
    # head + final norm (10.001M) + layer 1's q (11.001M): its k would overflow, so 11.001M is reduced; layer 1's
    # other weights and layer 0's q, k (11.002M): its v overflows, reduced; layer 0's rest (8.002M): the embedding
    # overflows, reduced; the epilogue reduces the embedding's 10M
    assert zero3_reductions(shape, 12_000_000) == (11_002_000, 10_000_000)
    total = 2 * 10_000_000 + 2 * layer + final_norm
    assert zero3_reductions(shape, 10 ** 9) == (0, total)  # one bucket holds everything: the epilogue's copy only
    assert ZeroSettings.from_config({"reduce_scatter": False}, stage=3).flush_elements(3) == 0
    assert ZeroSettings.from_config({}, stage=2).flush_elements(2) == 0
    one = plan(gpus_per_node=1, zero_stage=3, precision="bf16-mixed")
    eight = plan(gpus_per_node=8, zero_stage=3, precision="bf16-mixed")
    assert not zero3_gathers(one) and zero3_gathers(eight)
    assert zero3_gathers(plan(gpus_per_node=1, zero_stage=3, precision="bf16-mixed", offload_params="cpu"))
    dt = an.dtypes_for(one, True)
    st = an.model_states(shape, one, dt)
    assert st.gathered_bytes == 0.0 and st.gathered_moments is None and st.side_streams
    assert st.flush_bucket_elements == 50_000_000  # hpcmem's own ds_config
    # the stream: the copy on the reduce stream, once per backward here, each alloc freed at once
    events = step_events(shape, one, dt, st, an.activations(shape, one, dt), steps=1, sharded=True)
    copies = [e for e in events if len(e) == 4 and e[0] == "alloc"]
    assert [(e[2], e[3]) for e in copies] == [(2 * total, REDUCE_STREAM)]
    # with the optimizer offloaded the gradients go to the host, through the same bucket and its copy
    off = plan(gpus_per_node=1, zero_stage=3, precision="bf16-mixed", offload_optimizer="cpu")
    st_off = an.model_states(shape, off, dt)
    events = step_events(shape, off, dt, st_off, an.activations(shape, off, dt), steps=1, sharded=True)
    assert st_off.grads_bytes == 0 and (2 * total, REDUCE_STREAM) in [(e[2], e[3]) for e in events if len(e) == 4]
    st8 = an.model_states(shape, eight, dt)
    events = step_events(shape, eight, dt, st8, an.activations(shape, eight, dt), steps=1, sharded=True)
    assert any(len(e) == 4 and e[3] == GATHER_STREAM for e in events)
    # the phases: the epilogue's copy at the backward's end
    acts = an.activations(shape, one, dt)
    with_, without = ({ph.name: ph for ph in an.phases(shape, one, dt, s, acts)}
                      for s in (st, dataclasses.replace(st, flush_bucket_elements=0.0)))
    others = without["backward end"].temporaries - st.buffer_bytes  # the embedding's transients, freed before it
    assert with_["backward end"].temporaries == pytest.approx(st.buffer_bytes + max(others, 2 * total))
    assert with_["backward end"].total > without["backward end"].total
    assert with_["forward end"].total == without["forward end"].total


def test_zero12_offload_hand_over_and_step_as_older_deepspeed_allocate(monkeypatch):
    """ZeRO-1/2 with CPU optimizer offload, hand-worked. Each gradient handed to the host (copy_grads_in_partition):
    the rank's slice normed in fp64, then the overflow check over the whole gradient, then the slice cast to fp32.
    Before DeepSpeed PR #8325 the check is elementwise: an fp32 copy, three bool masks and an fp32 copy of the last,
    11 bytes per element of a 16-bit gradient, 7 of an fp32 one. From v0.14.1 (PR #5301) to v0.17.0 (PR #7309)
    the step copies the whole updated fp32 partition to the device before casting it into the 16-bit weights."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.analytic import dtypes_for, model_states
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import REDUCE_STREAM, step_events
    from toolkit.strategies.base import AUTOGRAD_GRADIENT, recipe_sizes
    from toolkit.strategies.deepspeed import zero12_offload_handover

    # a 100-element parameter, 30 of them this rank's, 16-bit gradients
    order = zero12_offload_handover(100, 30, 2, own=True, check="elementwise")
    assert [size for _, size in order if size is not None] == [200, 240, 400, 100, 100, 100, 400, 120]
    assert order[0][0] == order[-1][0] == AUTOGRAD_GRADIENT  # made by autograd, freed last
    alive, peak = recipe_sizes(order)
    assert alive == {} and peak == 200 + 400 + 300 + 400  # the gradient + the check's five tensors
    assert recipe_sizes(zero12_offload_handover(100, 30, 4, own=False, check="elementwise"))[1] == 300 + 400  # fp32
    assert recipe_sizes(zero12_offload_handover(100, 30, 2, own=False, check=None))[1] == 240  # the fp64 slice
    assert recipe_sizes(zero12_offload_handover(100, 100, 2, own=False, check="elementwise"))[1] == 1100 > 800
    # before v0.13.3 the check was float(x.float().sum()): one fp32 copy of a 16-bit gradient, none of an fp32 one
    assert recipe_sizes(zero12_offload_handover(100, 10, 2, own=False, check="sum"))[1] == 400
    assert recipe_sizes(zero12_offload_handover(100, 10, 4, own=False, check="sum"))[1] == 80

    assert [Runtime(deepspeed_version=v).zero_overflow_check for v in
            ("0.7.0", "0.13.2", "0.13.3", "0.14.2", "0.19.5", "0.19.7", "0.19.8", "0.20")] == \
        ["sum", "sum"] + ["elementwise"] * 4 + [None] * 2
    assert [Runtime(deepspeed_version=v).zero_offload_step_fp32_copy
            for v in ("0.14.0", "0.14.1", "0.16.9", "0.17.0")] == [False, True, True, False]
    # a Runtime that names no version is the DeepSpeed installed beside hpcmem (its jobs run it), else the newest read
    from toolkit.estimate import gpu

    monkeypatch.setattr(gpu, "installed_deepspeed", lambda: "0.14.2")
    assert Runtime().zero_overflow_check == "elementwise" and Runtime().zero_offload_step_fp32_copy
    assert Runtime(deepspeed_version="0.19.8").zero_overflow_check is None
    monkeypatch.setattr(gpu, "installed_deepspeed", lambda: None)
    assert gpu.CURRENT_DEEPSPEED == "0.19.8"
    assert Runtime().zero_overflow_check is None and not Runtime().zero_offload_step_fp32_copy
    # a version is a few digits, never thousands (a hostile log must not reach int()'s limit)
    with pytest.raises(ValueError, match="deepspeed_version"):
        Runtime(deepspeed_version="9" * 5000 + ".1")

    two = Plan(launcher="deepspeed", nodes=1, gpus_per_node=8, global_batch=8, micro_batch=1, seq_len=512,
               precision="fp16-mixed", zero_stage=2, offload_optimizer="cpu")
    dt = dtypes_for(two, True)
    emb, shard = LLAMA7B.largest_param_numel, LLAMA7B.n_params / 8
    old, new = (model_states(LLAMA7B, two, dt, Runtime(deepspeed_version=v)) for v in ("0.14.2", "0.19.8"))
    assert old.reduce_temp_bytes == 2 * emb + 11 * emb and new.reduce_temp_bytes == 2 * emb + 8 * emb
    assert old.step_temp_bytes == pytest.approx(4 * shard) and new.step_temp_bytes == 0
    assert model_states(LLAMA7B, two, dt, Runtime(deepspeed_version="0.17.1")).step_temp_bytes == 0
    # the phases: the step's copy beside the weights; the stream replays the hand-over tensor by tensor, in order
    phases = {ph.name: ph for ph in an.phases(LLAMA7B, two, dt, old, an.activations(LLAMA7B, two, dt))}
    assert phases["optimizer step"].temporaries == pytest.approx(old.buffer_bytes + 4 * shard)
    events = step_events(LLAMA7B, two, dt, old, an.activations(LLAMA7B, two, dt), steps=1, sharded=True)
    sizes = [e[2] for e in events if e[0] == "alloc"]
    made = [int(size) for _, size in old.reduce_order if size is not None]
    at = next(i for i in range(len(sizes)) if sizes[i:i + len(made)] == made)
    assert made == [2 * emb, 8 * emb, 4 * emb, emb, emb, emb, 4 * emb, 4 * emb] and at > 0
    assert replay(events).peak_allocated >= LLAMA7B.n_params * 2 + old.reduce_temp_bytes
    # the backward's epilogue hands the embedding's gradient over before it releases the bucket
    # (independent_gradient_partition_epilogue: reduce_ipg_grads, then _release_ipg_buffers); the gradient autograd
    # made is on the compute stream
    last = max(i for i in range(len(sizes)) if sizes[i:i + len(made)] == made)
    allocs = [e for e in events if e[0] == "alloc"]
    bucket = [e[1] for e in allocs if e[2] == int(old.grad_bucket_bytes)][-1]
    freed_at = next(i for i, e in enumerate(events) if e[0] == "free" and e[1] == bucket)
    assert events.index(allocs[last + len(made) - 1]) < freed_at
    # with overlap_comm the hand-over runs on the reduction stream, the gradient autograd made on the compute stream
    overlap = Runtime(deepspeed_version="0.14.2",
                      engine_config={"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True,
                                     "reduce_bucket_size": 50_000_000})
    ov = model_states(LLAMA7B, two, dt, overlap)
    ev = step_events(LLAMA7B, two, dt, ov, an.activations(LLAMA7B, two, dt), steps=1, sharded=True)
    allocs = [e for e in ev if e[0] == "alloc"]
    at = max(i for i in range(len(allocs)) if [e[2] for e in allocs[i:i + len(made)]] == made)
    assert [len(e) == 3 for e in allocs[at:at + len(made)]] == [True] + [False] * (len(made) - 1)
    assert {e[3] for e in allocs[at + 1:at + len(made)]} == {REDUCE_STREAM}


def test_zero3_fp16_checks_the_gradient_partition_for_overflow_with_two_masks_on_the_reduce_stream():
    """stage3.py has_overflow (v0.14.2 and 0.19.8), fp16 only: isinf(grad_partitions_flat_buffer).any(), then isnan,
    under the reduce-and-partition stream, at the step's start: two bool masks of the rank's gradient partition,
    one after the other. With the optimizer offloaded that buffer is on the host."""
    from toolkit.estimate.stream import REDUCE_STREAM, step_events

    def check(**knobs):
        p = plan(gpus_per_node=8, zero_stage=3, **knobs)
        dt = an.dtypes_for(p, True)
        st = an.model_states(LLAMA7B, p, dt)
        events = step_events(LLAMA7B, p, dt, st, an.activations(LLAMA7B, p, dt), steps=1, sharded=True)
        at = next(i for i, e in enumerate(events) if e[0] == "mark" and e[1] == "step 1 optimizer")
        return st.step_check_bytes, events[at + 1:at + 5]

    size, after = check(precision="fp16-mixed")
    assert size == pytest.approx(LLAMA7B.n_params / 8)
    assert [(e[0], e[2] if e[0] == "alloc" else None, e[3] if e[0] == "alloc" else None) for e in after] == \
        [("alloc", int(size), REDUCE_STREAM), ("free", None, None)] * 2
    assert after[1][1] == after[0][1] and after[3][1] == after[2][1]  # each mask freed before the next is made
    assert check(precision="bf16-mixed")[0] == 0 and check(precision="fp16-mixed", offload_optimizer="cpu")[0] == 0
    # the step phase counts the larger of the masks and the step's own transients: with small sub-groups, the mask
    from toolkit.estimate.gpu import Runtime

    p = plan(gpus_per_node=8, zero_stage=3, precision="fp16-mixed")
    dt = an.dtypes_for(p, True)
    small = Runtime(engine_config={"stage": 3, "sub_group_size": 10_000_000})
    st = an.model_states(LLAMA7B, p, dt, small)
    step = {ph.name: ph for ph in an.phases(LLAMA7B, p, dt, st, an.activations(LLAMA7B, p, dt), small)}
    assert st.step_temp_bytes + st.step_flatten_bytes < st.step_check_bytes
    assert step["optimizer step"].temporaries == pytest.approx(st.buffer_bytes + st.step_check_bytes)


def test_zero_without_offload_scans_and_norms_each_gradient_slice_at_the_step_start():
    """The start of ZeRO's step without offload (stage_1_and_2.py and stage3.py, v0.7.0 to 0.19.8), slice after
    slice of the rank's partition: ZeRO-1/2 fp16 checks each for overflow (_has_inf_or_nan, in the version's form),
    then every stage takes ``g.double().norm(2)`` of each. ZeRO-3's slices are the parameters' partitions; ZeRO-1/2's
    the parameters in the rank's range. The largest slice sets the sizes."""
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import REDUCE_STREAM, step_events

    def start(runtime=Runtime(), **knobs):
        p = plan(gpus_per_node=8, **knobs)
        dt = an.dtypes_for(p, True)
        st = an.model_states(LLAMA7B, p, dt, runtime)
        events = step_events(LLAMA7B, p, dt, st, an.activations(LLAMA7B, p, dt, runtime), runtime=runtime, steps=1,
                             sharded=True)
        at = next(i for i, e in enumerate(events) if e[0] == "mark" and e[1] == "step 1 optimizer")
        masks = {e[1] for e in events[at + 1:] if e[0] == "alloc" and len(e) > 3 and e[3] == REDUCE_STREAM}
        after = [e for e in events[at + 1:] if e[1] not in masks]
        return st, after

    largest = LLAMA7B.largest_param_numel
    in_range = min(largest, -(-LLAMA7B.n_params // 8))
    st, after = start(zero_stage=3, precision="fp16-mixed")
    # ZeRO-3: the norm's copy only (its overflow check is the reduce stream's masks), made and freed at once, first
    assert st.step_order == (("fp64 norm", 8.0 * -(-largest // 8)), ("fp64 norm", None))
    assert after[0][0] == "alloc" and after[0][2] == 8 * -(-largest // 8) and after[1] == ("free", after[0][1])
    # ZeRO-1/2 fp16 in DeepSpeed 0.14: the 11-byte check (fp32 copy, three masks, the last as fp32), then the norm
    st, after = start(Runtime(deepspeed_version="0.14.2"), zero_stage=2, precision="fp16-mixed")
    made = [e[2] for e in after[:5]]
    assert made == [int(x * in_range) for x in (4, 1, 1, 1, 4)] and all(e[0] == "alloc" for e in after[:5])
    assert [e[0] for e in after[5:10]] == ["free"] * 5 and after[10][2] == 8 * in_range
    assert recipe_peak(st.step_order) == 11.0 * in_range
    # before v0.13.3: one fp32 copy; from 0.19.8: no copy of the slice's size; bf16 is not checked at all
    assert start(Runtime(deepspeed_version="0.13.2"), zero_stage=1, precision="fp16-mixed")[0].step_order[0] == \
        ("fp32 copy", 4.0 * in_range)
    assert start(Runtime(deepspeed_version="0.19.8"), zero_stage=2, precision="fp16-mixed")[0].step_order == \
        (("fp64 norm", 8.0 * in_range), ("fp64 norm", None))
    assert start(Runtime(deepspeed_version="0.14.2"), zero_stage=2, precision="bf16-mixed")[0].step_order == \
        (("fp64 norm", 8.0 * in_range), ("fp64 norm", None))
    # bf16 at ZeRO-1 too: DeepSpeed takes its BF16_Optimizer only when the config asks for fp32 gradient
    # accumulation (engine.py get_data_types: under ZeRO the default accumulates in the model's dtype)
    assert start(zero_stage=1, precision="bf16-mixed")[0].step_order == (("fp64 norm", 8.0 * in_range),
                                                                         ("fp64 norm", None))
    # offloaded, the scans happen on the way to the host
    assert start(zero_stage=3, precision="fp16-mixed", offload_optimizer="cpu")[0].step_order == ()
    # the step phase counts the recipe's peak against the check's masks and the step's own transients: with fp32
    # gradients (no fp32 copy to make) and a fused AdamW (no temporaries) the norm's copy is the step's transient
    p = plan(gpus_per_node=8, zero_stage=2, precision="fp32", optimizer="adamw-fused")
    dt = an.dtypes_for(p, True)
    st = an.model_states(LLAMA7B, p, dt)
    assert st.step_temp_bytes == 0 and st.step_flatten_bytes == 0 and st.step_check_bytes == 0
    assert recipe_peak(st.step_order) == 8.0 * in_range
    step = {ph.name: ph for ph in an.phases(LLAMA7B, p, dt, st, an.activations(LLAMA7B, p, dt))}
    assert step["optimizer step"].temporaries == pytest.approx(st.buffer_bytes + 8.0 * in_range)


def test_zero3_start_up_allocates_as_deepspeed_does_and_states_come_with_the_first_step():
    """DeepSpeed ZeRO-3 with the partitions on the device (stage3.py): the flat 16-bit buffer; per sub-group the
    fp32 master, made since v0.18.3 from a converted fp32 copy (alive until the next replaces it), before it
    (v0.14.2) from a 16-bit clone; a zeroed fp32 gradient buffer of the largest sub-group (freed); the IPG bucket;
    the flat gradient buffer. The optimizer's states are made by its first step, beside that step's fp32
    gradient copy, for each sub-group as one flat vector, and kept."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import step_events
    from toolkit.strategies.deepspeed import zero3_startup

    dt = an.dtypes_for(plan(zero_stage=3, precision="fp16-mixed"), True)
    adam = optimizers.get("adamw-fused")
    steps, lazy = zero3_startup(25.0, dt, adam, 10, 6.0)  # 25 elements in sub-groups of 10: 10, 10, 5
    assert steps == (("lp_param_buffer", 50.0),
                     ("converted 0", 40.0), ("fp32 partition 0", 40.0),
                     ("converted 1", 40.0), ("converted 0", None), ("fp32 partition 1", 40.0),
                     ("converted 2", 20.0), ("converted 1", None), ("fp32 partition 2", 20.0), ("converted 2", None),
                     ("gradient_buffer", 40.0), ("gradient_buffer", None),
                     ("ipg bucket", 6.0), ("grad_partitions_flat_buffer", 50.0))
    # FusedAdam: a device step counter, exp_avg and exp_avg_sq per flat fp32 partition
    assert lazy == (4.0, 40.0, 40.0, 4.0, 40.0, 40.0, 4.0, 20.0, 20.0)
    old, _ = zero3_startup(25.0, dt, adam, 10, 6.0, master_from_clone=True)
    assert old[1:7] == (("clone 0", 20.0), ("fp32 partition 0", 40.0), ("clone 0", None),
                        ("clone 1", 20.0), ("fp32 partition 1", 40.0), ("clone 1", None))
    fp32 = an.dtypes_for(plan(zero_stage=3, precision="fp32"), True)
    assert [name for name, _ in zero3_startup(25.0, fp32, adam, 10, 0.0)[0]] == [
        "lp_param_buffer", "gradient_buffer", "gradient_buffer", "grad_partitions_flat_buffer"]  # no master copy
    assert [name for name, _ in zero3_startup(25.0, fp32, adam, 10, 0.0, master_from_clone=True)[0]][1:4] == [
        "fp32 partition 0", "fp32 partition 1", "fp32 partition 2"]  # the fp32 clone is a master of its own

    one = plan(gpus_per_node=1, zero_stage=3, precision="fp16-mixed", optimizer="adamw-fused")
    for name in ("adamw-fused", "adamw", "adafactor", "adamw-8bit", "sgd"):
        for runtime in (Runtime(), Runtime(deepspeed_version="0.14.2")):
            p = one.replace(optimizer=name)
            st = an.model_states(SHAPE_1B, p, dt, runtime)
            alive: dict = {}
            for tensor, size in st.startup:
                alive.pop(tensor) if size is None else alive.__setitem__(tensor, size)
            # what start-up leaves alive and what the first step makes are the ModelStates' bytes the phases use
            kept = st.params_bytes + st.grads_bytes + st.buffer_bytes + st.optimizer_bytes
            assert sum(alive.values()) + sum(st.lazy_states) == pytest.approx(kept, rel=1e-9), (name, runtime)
    # the optimizer sees flat vectors: a factored optimizer keeps a full second moment under ZeRO-3
    fact = an.model_states(SHAPE_1B, one.replace(optimizer="adafactor"), dt)
    assert fact.optimizer_bytes == pytest.approx(4 * SHAPE_1B.n_params * 2, rel=1e-6)  # master + second moment
    # the stream: start-up's high-water mark is the recipe's; allocated after start-up = its survivors, after
    # step 1's optimizer + the states
    st = an.model_states(SHAPE_1B, one, dt)
    events = step_events(SHAPE_1B, one, dt, st, an.activations(SHAPE_1B, one, dt), steps=2, sharded=True)
    first = next(k for k, e in enumerate(events) if e[0] == "mark")
    running, peak, sizes = 0.0, 0.0, {}
    for tensor, size in st.startup:
        running += -sizes.pop(tensor) if size is None else sizes.setdefault(tensor, size)
        peak = max(peak, running)
    assert replay(events[:first]).peak_allocated == pytest.approx(peak, rel=0.001)
    marks = {m[0]: m for m in replay(events).marks}
    assert marks["step 1"][1] == pytest.approx(sum(sizes.values()), rel=0.01)
    assert marks["step 2"][1] == pytest.approx(sum(sizes.values()) + sum(st.lazy_states), rel=0.01)
    assert an.model_states(SHAPE_1B, plan(gpus_per_node=1, zero_stage=3, precision="fp16-mixed",
                                          offload_optimizer="cpu"), dt).startup == ()  # offload: not this path


def test_the_causal_loss_makes_its_tensors_in_order_and_older_transformers_copy_the_shifted_logits():
    """transformers' causal-LM loss: the head's 16-bit logits, their fp32 upcast, until PR #35646 a contiguous copy
    of the shifted fp32 logits, then the log-probs log_softmax saves. Where the model's forward itself upcasts
    (``logits = logits.float()``, before 4.46) the 16-bit logits are gone by then; where the loss function does
    (hpcmem's transformers 5) the model's output still holds them. Bytes per logit beside the log-probs (bf16):
    5.x 6, 4.40 (in-model upcast and the copy) 8, 4.46-4.48 (the copy, upcast in the loss) 10."""
    from toolkit.estimate.activations import causal_loss_forward, loss_forward_temp
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import step_events

    after, before = "after_upcast", "before_upcast"
    assert causal_loss_forward(1000, 2, True, None, False) == (("logits", 2000), ("fp32 logits", 4000.0))
    assert causal_loss_forward(1000, 2, True, None, True) == (("logits", 2000), ("fp32 logits", 4000.0),
                                                              ("logits", None))
    assert causal_loss_forward(1000, 2, True, after, True)[-1] == ("shifted logits", 4000)
    assert causal_loss_forward(1000, 4, True, after, True) == (("logits", 4000), ("shifted logits", 4000))  # fp32
    assert causal_loss_forward(1000, 2, False, after, False) == (("logits", 2000), ("shifted logits", 2000))
    # a hand-written loss copies the 16-bit logits, and autocast's cross-entropy casts the copy
    assert causal_loss_forward(1000, 2, True, before, False) == (("logits", 2000), ("shifted logits", 2000),
                                                                 ("fp32 logits", 4000.0))
    # beside the log-probs (4 per logit), or before them where more was alive
    assert [loss_forward_temp(causal_loss_forward(1, 2, True, copy, in_model), 4)
            for copy, in_model in ((None, False), (after, True), (after, False), (None, True), (before, False))] \
        == [6, 8, 10, 4, 8]
    p = plan(precision="bf16-mixed", micro_batch=1, seq_len=128)
    dt = an.dtypes_for(p, True)
    old = Runtime(shifted_logits_copy="after_upcast", logits_upcast_in_model=True)  # transformers 4.40
    n = 128 * GPT2.vocab
    assert inv.activations(GPT2, p, dt).loss_forward_temp_bytes == 6 * n
    acts = inv.activations(GPT2, p, dt, old)
    assert acts.loss_forward_temp_bytes == 8 * n
    assert acts.loss_backward_temp_bytes == inv.activations(GPT2, p, dt).loss_backward_temp_bytes
    # the stream: logits, upcast, the 16-bit logits freed, the copy, then the log-probs; the copy and the fp32
    # logits freed once the loss is computed
    events = step_events(GPT2, p, dt, an.model_states(GPT2, p, dt), acts, runtime=old, steps=1)
    size = {e[1]: e[2] for e in events if e[0] == "alloc"}
    start = next(k for k, e in enumerate(events) if e[0] == "alloc" and e[2] == 2 * n)
    loss = [(e[0], size[e[1]]) for e in events[start:start + 7]]
    assert loss == [("alloc", 2 * n), ("alloc", 4 * n), ("free", 2 * n), ("alloc", 4 * n), ("alloc", 4 * n),
                    ("free", 4 * n), ("free", 4 * n)]
    with pytest.raises(ValueError, match="shifted_logits_copy"):
        Runtime(shifted_logits_copy="yes")
    with pytest.raises(ValueError, match="logits_upcast_in_model"):
        Runtime(logits_upcast_in_model="false")
    with pytest.raises(ValueError, match="deepspeed_version"):
        Runtime(deepspeed_version="latest")


def test_a_loop_that_keeps_the_models_output_keeps_its_logits_into_the_next_forward():
    """Runtime.output_kept: ``out = model(ids, labels=ids); out.loss.backward()`` ("model_output") or ``logits =
    model(x); loss = f(logits, y)`` ("logits") keep the logits the model returns through the backward and the
    step, until the next micro-batch's forward rebinds the variable: the previous ones are freed once the new loss
    is computed, or as soon as the model has returned the new logits. The kept tensor is the model's output:
    16-bit under transformers 5 (the loss upcasts a copy), fp32 where the model upcasts them itself."""
    from toolkit.estimate.activations import PREVIOUS_OUTPUT, causal_loss_forward, loss_forward_temp
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import step_events

    assert causal_loss_forward(1000, 2, True, None, False, "logits") == (
        ("logits", 2000), (PREVIOUS_OUTPUT, None), ("fp32 logits", 4000.0))
    assert causal_loss_forward(1000, 2, True, None, True, "logits") == (
        ("logits", 2000), ("fp32 logits", 4000.0), ("logits", None), (PREVIOUS_OUTPUT, None))
    assert causal_loss_forward(1000, 2, True, None, False, "model_output") == (
        ("logits", 2000), ("fp32 logits", 4000.0))  # freed with the loss's own, once it is computed
    # the previous output beside the new loss: all of it (model_output), or until the new logits exist (logits)
    base = loss_forward_temp(causal_loss_forward(1, 2, True, None, False), 4)
    assert loss_forward_temp(causal_loss_forward(1, 2, True, None, False, "model_output"), 4, 2) == base + 2
    assert loss_forward_temp(causal_loss_forward(1, 2, True, None, False, "logits"), 4, 2) == base
    p = plan(precision="bf16-mixed", micro_batch=2, seq_len=128, grad_accum=2)
    dt = an.dtypes_for(p, True)
    n = 2 * 128 * GPT2.vocab
    # (runtime, the kept tensor's bytes, what the forward's end adds: model_output holds the previous one beside
    # the whole loss; logits lets it go as the model returns, before transformers 5's upcast in the loss (nothing
    # added), or after the model's own upcast, whose 2 + 4 bytes per logit then meet the previous fp32 ones: 10
    # at once, against the 8 that fp32 logits and log-probs hold without it)
    for runtime, size, at_end in ((Runtime(output_kept="model_output"), 2 * n, 2 * n),
                                  (Runtime(output_kept="logits"), 2 * n, 0),
                                  (Runtime(output_kept="logits", logits_upcast_in_model=True), 4 * n, 2 * n)):
        acts = inv.activations(GPT2, p, dt, runtime)
        assert (acts.kept_output, acts.kept_output_bytes) == ("fp32 logits" if size == 4 * n else "logits", size)
        # the phases: every moment after the forward holds it; the forward's end holds the previous one too
        # where the model computes the loss
        dropped = dataclasses.replace(runtime, output_kept=None)
        ph = {x.name: x for x in an.phases(GPT2, p, dt, an.model_states(GPT2, p, dt), acts, runtime)}
        plain = {x.name: x for x in an.phases(GPT2, p, dt, an.model_states(GPT2, p, dt),
                                              inv.activations(GPT2, p, dt, dropped), dropped)}
        for name in plain:
            extra = ph[name].total - plain[name].total
            if name == "forward end":
                assert extra == at_end, runtime
            else:
                assert extra == pytest.approx(size), name
        # the stream: one tensor of that size outlives its micro-batch; two micro-batches and two steps keep one
        # alive at every mark after the first forward
        events = step_events(GPT2, p, dt, an.model_states(GPT2, p, dt), acts, runtime=runtime, steps=2)
        plain_events = step_events(GPT2, p, dt, an.model_states(GPT2, p, dt), inv.activations(GPT2, p, dt, dropped),
                                   runtime=dropped, steps=2)
        alive, spans = {}, []
        mark = None
        for e in events:
            if e[0] == "mark":
                mark = e[1]
            elif e[0] == "alloc" and e[2] == size:
                alive[e[1]] = mark
            elif e[0] == "free" and e[1] in alive:
                spans.append((alive.pop(e[1]), mark))
        # each micro-batch's: the first (step 1) to the second's forward, the second across the step into step 2
        kept = [span for span in spans if span[0] != span[1]] + [(m, "end") for m in alive.values()]
        assert kept == [("step 1", "step 2"), ("step 2", "end")], kept
        # "model_output" holds one at every moment after step 1's first loss; "logits" lets it go inside the next
        # loss forward, where GPT-2's step peaks with the model's fp32 logits
        kept_run, plain_run = replay(events), replay(plain_events)
        added = kept_run.peak_requested - plain_run.peak_requested  # tensor by tensor, before the blocks' rounding
        assert added == size if runtime.output_kept == "model_output" else 0 <= added <= size
        assert kept_run.peak_allocated - plain_run.peak_allocated == \
            pytest.approx(added, abs=size * 0.3)  # the allocator's blocks: unsplit rests differ
    # an image model's or a classifier's output is a few numbers per sample: nothing kept is modelled
    vit_acts = inv.activations(ModelShape.from_config(load_model_config("vit-base"), task="image-cls"),
                               plan(micro_batch=8), an.dtypes_for(plan(micro_batch=8), True),
                               Runtime(output_kept="logits"))
    assert (vit_acts.kept_output, vit_acts.kept_output_bytes) == (None, 0.0)
    with pytest.raises(ValueError, match="output_kept"):
        Runtime(output_kept="yes")


def test_a_script_that_wraps_one_process_in_ddp_has_its_buckets():
    """Runtime.ddp_single_process: torch builds DDP's Reducer and buckets for a world of one as for more, so a
    script that wraps whenever torchrun started it has one more fp32 copy of the gradients on a single GPU."""
    from toolkit.estimate.gpu import Runtime
    from toolkit.strategies.ddp import builds_ddp

    one = plan(precision="bf16-mixed", micro_batch=2, seq_len=128)
    wraps = Runtime(ddp_single_process=True)
    assert not builds_ddp(one) and builds_ddp(one, True)
    dt = an.dtypes_for(one, True)
    assert an.model_states(GPT2, one, dt, wraps).buffer_bytes == 4 * GPT2.n_params
    assert an.model_states(GPT2, one, dt).buffer_bytes == 0.0
    part = A100
    added = (estimate_analytic(GPT2, one, part, runtime=wraps).peak_allocated_mib
             - estimate_analytic(GPT2, one, part).peak_allocated_mib)
    two = plan(precision="bf16-mixed", micro_batch=2, seq_len=128, gpus_per_node=2)
    assert added == pytest.approx(estimate_analytic(GPT2, two, part).peak_allocated_mib
                                  - estimate_analytic(GPT2, one, part).peak_allocated_mib, abs=1)
    with pytest.raises(ValueError, match="ddp_single_process"):
        Runtime(ddp_single_process="yes")


def test_sdpa_saves_repeated_kv_where_the_model_code_repeats_them():
    """Runtime.sdpa_repeats_kv: transformers < 4.48 (and later with a padding mask on CUDA) and torchtitan-style
    code repeat a grouped-query model's K and V to every query head before SDPA, which saves them: per token and
    layer 2 x (q_dim - kv_dim) more 16-bit elements. A model without grouped queries and eager attention (which
    repeats them anyway) are unchanged."""
    from toolkit.estimate.activations import layer_bytes_per_token
    from toolkit.estimate.gpu import Runtime

    gqa = ModelShape.from_config({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                  "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "vocab_size": 128256})
    repeats = Runtime(sdpa_repeats_kv=True)
    p = plan(precision="bf16-mixed")
    dt = an.dtypes_for(p, True)
    extra = layer_bytes_per_token(gqa, p, dt, repeats) - layer_bytes_per_token(gqa, p, dt)
    assert extra == 2 * (4096 - 1024) * 2
    mha = dataclasses.replace(gqa, kv_heads=gqa.heads)
    assert layer_bytes_per_token(mha, p, dt, repeats) == layer_bytes_per_token(mha, p, dt)
    eager = plan(precision="bf16-mixed", attention="eager")
    assert layer_bytes_per_token(gqa, eager, dt, repeats) == layer_bytes_per_token(gqa, eager, dt)


def test_zero_steps_each_group_through_an_fp32_copy_of_its_gradients():
    """The step's fp32 gradient copy: ZeRO-1/2 cast the pre-flattened 16-bit partition (nothing with fp32 grads);
    ZeRO-3 flattens one sub-group's gradient partitions into a new tensor and casts it (stage3.py
    _prepare_fp32_grad_for_sub_group), one sub-group of sub_group_size elements at a time."""
    from toolkit.estimate.analytic import dtypes_for, model_states
    from toolkit.estimate.gpu import Runtime

    def states(stage, zero=None, precision="bf16-mixed", optimizer="adamw-fused"):
        p = plan(launcher="deepspeed", gpus_per_node=4, precision=precision, zero_stage=stage, optimizer=optimizer)
        return model_states(LLAMA7B, p, dtypes_for(p, True), Runtime(engine_config=zero))

    shard = LLAMA7B.n_params / 4
    z2 = states(2)
    assert (z2.step_temp_bytes, z2.step_flatten_bytes) == (pytest.approx(4 * shard), 0.0)
    assert states(2, precision="fp32").step_temp_bytes == 0.0
    z3 = states(3, {"stage": 3})  # a shard of 1.7e9 elements, DeepSpeed's sub_group_size 1e9
    assert shard > 1e9 and z3.step_temp_bytes == 4 * 1e9 and z3.step_flatten_bytes == 2 * 1e9
    small = states(3, {"stage": 3, "sub_group_size": 1e8})
    assert (small.step_temp_bytes, small.step_flatten_bytes) == (4 * 1e8, 2 * 1e8)
    assert states(3, {"stage": 3}, precision="fp32").step_flatten_bytes == 0.0  # the flattened copy is the fp32 one
    assert states(3, {"stage": 3}, precision="fp32").step_temp_bytes == 4 * 1e9
    # the step phase holds both while the cast is made
    p = plan(launcher="deepspeed", gpus_per_node=4, precision="bf16-mixed", zero_stage=3, optimizer="adamw-fused")
    dt = dtypes_for(p, True)
    acts = an.activations(LLAMA7B, p, dt)
    with_, without = ({ph.name: ph for ph in an.phases(LLAMA7B, p, dt, st, acts)}
                      for st in (z3, dataclasses.replace(z3, step_flatten_bytes=0.0)))
    assert with_["optimizer step"].total - without["optimizer step"].total == 2 * 1e9


@pytest.mark.parametrize("zero, words", [
    ({"reduce_bucket_size": -1}, "reduce_bucket_size: expected a positive whole number"),
    ({"reduce_bucket_size": "5e8"}, "reduce_bucket_size: expected a positive whole number"),
    ({"reduce_bucket_size": 1.5}, "reduce_bucket_size: expected a positive whole number"),
    ({"reduce_bucket_size": True}, "reduce_bucket_size: expected a positive whole number"),
    ({"reduce_bucket_size": "auto"}, "'auto' needs the model's hidden size"),
    ({"overlap_comm": "yes"}, "overlap_comm: expected true or false"),
    ({"reduce_scatter": 1}, "reduce_scatter: expected true or false"),
    ({"sub_group_size": 0}, "sub_group_size: expected a positive whole number"),
    ([1, 2], "zero_optimization: expected an object"),
])
def test_a_bad_zero_section_is_named_in_one_line(zero, words):
    from toolkit.strategies.deepspeed import ZeroSettings

    with pytest.raises(ConfigError, match=words):
        ZeroSettings.from_config(zero, stage=2)


def test_the_traced_method_without_torch_is_one_line(monkeypatch):
    # A login node's core install (no hpcmem[job]): `estimate --method traced` names what is missing and the way out.
    import sys

    from toolkit.estimate import ModelRef, estimate

    monkeypatch.delitem(sys.modules, "toolkit.estimate.traced", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ModuleNotFoundError, as when it is absent
    ref = ModelRef(load_model_config("gpt2"), "causal-lm", None, "gpt2")
    with pytest.raises(ConfigError, match=r"^the traced method needs torch, which is not installed here: use "
                                          r"--method analytic, or pip install 'hpcmem\[job\]'$"):
        estimate(ref, Plan(), sites.load_site("local").partition("default"), "traced")


def test_fsdp1_cpu_offload_keeps_no_device_grads_between_steps_whatever_zero_grad_does():
    """FSDP1 with CPU offload hands the optimizer the host copy of each gradient shard (.grad = _cpu_grad) and drops
    the device shard at the backward's end (prepare_gradient_for_optim, torch 2.4-2.13), so zero_grad(set_to_none=
    False) keeps host memory, not device memory (the Lambda Llama-3.1-405B file: +26 % allocated before)."""
    from toolkit.estimate.gpu import Runtime

    def est(offload, set_to_none):
        p = plan(launcher="fsdp", gpus_per_node=4, precision="bf16-true", micro_batch=2, seq_len=512,
                 checkpointing=True, offload_params=offload)
        return estimate_analytic(LLAMA7B, p, A100, runtime=Runtime(fsdp_api="fsdp1", grads_set_to_none=set_to_none))

    # offloaded: the same device peak and stream whichever zero_grad runs
    kept, dropped = est("cpu", False), est("cpu", True)
    assert kept.peak_allocated_mib == dropped.peak_allocated_mib and kept.peak_reserved_mib == dropped.peak_reserved_mib
    assert kept.components["grads"] == dropped.components["grads"]


def test_paged_optimizer_states_are_outside_the_allocator_and_resident_as_room_allows():
    """A paged optimizer's states live in CUDA unified memory: not in the allocated or reserved peaks, nor in the
    device memory a fit needs (the driver pages them out when the device needs the room: the planner and the
    Predictor compare device_used); resident as far as there is room, the rest on the host. Next to host tensors
    (a CPU partition, offload) nothing is paged: they are plain states there."""
    opt = optimizers.get("adamw-8bit-paged")
    p = plan(precision="bf16-mixed", micro_batch=2, seq_len=256, optimizer="adamw-8bit-paged")
    plain = estimate_analytic(GPT2, p.replace(optimizer="adamw-8bit"), A100)
    paged = estimate_analytic(GPT2, p, A100)
    states = opt.paged_bytes(GPT2.shape_counts) / MIB
    assert states > 100
    assert paged.peak_allocated_mib == pytest.approx(plain.peak_allocated_mib - states, abs=1)
    assert paged.peak_reserved_mib <= plain.peak_reserved_mib
    assert paged.device_used_mib == pytest.approx(paged.peak_reserved_mib + paged.components["cuda_context"]
                                                  + sum(paged.gpu_extras_mib.values()))
    assert paged.device_used_mib < plain.device_used_mib and paged.host_mib_per_node == 0
    assert any(n.startswith(f"paged optimizer states: {states:.0f} MiB") and "paged out" not in n for n in paged.notes)
    # a card with room for the step but not for all the states: they stay on the host, the step still fits
    room = states / 2
    tight = dataclasses.replace(A100, gpu_mem_gib=(paged.device_used_mib + room) / 1024 / 0.97)
    squeezed = estimate_analytic(GPT2, p, tight)
    assert squeezed.fits and 0 < squeezed.host_mib_per_node < states
    assert any("paged out to host memory" in n for n in squeezed.notes)
    # next to host tensors the states are plain: a CPU partition, DeepSpeed's optimizer offload, FSDP's CPU offload
    for q, part in ((p, CPU), (p.replace(launcher="deepspeed", zero_stage=2, offload_optimizer="cpu", gpus_per_node=2,
                                         global_batch=4), A100),
                    (p.replace(launcher="fsdp", offload_params="cpu", gpus_per_node=2, global_batch=4),
                     A100)):
        both = [estimate_analytic(GPT2, q.replace(optimizer=o), part) for o in ("adamw-8bit-paged", "adamw-8bit")]
        assert both[0].peak_allocated_mib == pytest.approx(both[1].peak_allocated_mib), (q.launcher, part.name)
        assert both[0].host_mib_per_node == pytest.approx(both[1].host_mib_per_node), (q.launcher, part.name)
        assert not any(n.startswith("paged optimizer states") for n in both[0].notes)
    # sharded without offload: each rank pages its share
    z2 = p.replace(launcher="deepspeed", zero_stage=2, gpus_per_node=2, global_batch=4)
    st = an.model_states(GPT2, z2, an.dtypes_for(z2, True))
    assert st.paged_optimizer_bytes == pytest.approx(opt.paged_bytes(GPT2.shape_counts) / 2)


def test_fsdp_makes_its_gradient_shards_on_its_reduction_stream():
    """FSDP1's post-backward hook and FSDP2's reduce-scatter make the gradient shards under a stream of their own,
    and FSDP1 its casts and new shards there too (FSDP2 makes its reduce-scatter input on the compute stream). Freed
    by zero_grad, those blocks stay cached for that stream: the next forward cannot reuse them, so the replay reserves
    about the shards' bytes more than one pool would. DDP's and a single GPU's gradients stay on the compute stream."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import DEFAULT_STREAM, REDUCE_STREAM, step_events

    def streams_of(p, rt, what):
        dt = an.dtypes_for(p, True)
        states, acts = an.model_states(GPT2, p, dt, rt), inv.activations(GPT2, p, dt, rt)
        events = step_events(GPT2, p, dt, states, acts, runtime=rt, steps=2, sharded=p.launcher == "fsdp")
        marks = [k for k, e in enumerate(events) if e[0] == "mark"]
        step = events[marks[0]:marks[1]]  # step 1's forward and backward
        return events, {e[3] if len(e) == 4 else DEFAULT_STREAM for e in step if e[0] == "alloc" and what(e[2], states)}

    shard = lambda size, st: size == pytest.approx(st.grads_bytes / GPT2.n_params * 50257 * 768, rel=0.01)  # noqa: E731
    p = plan(launcher="fsdp", gpus_per_node=4, precision="bf16-mixed", micro_batch=4, seq_len=256)
    for api, extras in (("fsdp1", REDUCE_STREAM), ("fsdp2", DEFAULT_STREAM)):
        rt = Runtime(fsdp_api=api)
        events, streams = streams_of(p, rt, shard)  # the embedding's gradient shard, the largest tensor
        assert streams == {REDUCE_STREAM}, api
        _, streams = streams_of(p, rt, lambda size, st: size == int(st.reduce_extra_bytes))
        assert streams == {extras}, api
        # one pool for all: the shards' blocks would serve the next forward
        merged = [e[:3] if len(e) == 4 and e[3] == REDUCE_STREAM else e for e in events]
        extra = replay(events).peak_reserved - replay(merged).peak_reserved
        st = an.model_states(GPT2, p, an.dtypes_for(p, True), rt)
        assert 0.5 * st.grads_bytes < extra < st.grads_bytes + st.reduce_extra_bytes + st.end_reduce_bytes, api
    for q in (plan(gpus_per_node=4, precision="bf16-mixed", micro_batch=4, seq_len=256),
              plan(precision="bf16-mixed", micro_batch=4, seq_len=256)):
        _, streams = streams_of(q, Runtime(), lambda size, st: size == 4 * 50257 * 768)
        assert streams == {DEFAULT_STREAM}


def test_fsdp_gathers_unit_by_unit_on_the_stream_each_version_allocates_them():
    """FSDP in the allocator stream (FULL_SHARD and SHARD_GRAD_OP, FSDP1 with its rate limiter and FSDP2): the root
    unit (embeddings, final norm, head) stays gathered from the forward's start to its backward's end; each layer's
    unit is its own block, at most two at once when resharding after the forward (the phases' ModelStates count),
    all of them at the backward's start without resharding. FSDP1 makes the units under its unshard stream; FSDP2
    gathers into a flat block on its all-gather stream and copies out into units on the compute stream. Until
    session 19 the stream made one block of the root and two units per layer, two of them alive: the replay of
    Lightning Thunder's Open-LLaMA-3B SHARD_GRAD_OP run then held a second copy of every gathered weight."""
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import DEFAULT_STREAM, GATHER_STREAM, step_events

    shape = ModelShape.from_config(load_model_config("llama-7b"))
    unit = 2 * shape.layer_params
    root = 2 * (shape.n_params - shape.layers * shape.layer_params)
    for reshard in (True, False):
        for api in ("fsdp1", "fsdp2"):
            p = plan(launcher="fsdp", gpus_per_node=4, precision="bf16-mixed", micro_batch=1, seq_len=512,
                     checkpointing=True, reshard_after_forward=reshard)
            rt = Runtime(fsdp_api=api)
            dt = an.dtypes_for(p, True)
            states, acts = an.model_states(shape, p, dt, rt), inv.activations(shape, p, dt, rt)
            assert states.gathered_bytes == 2 * (shape.n_params - shape.layers * shape.layer_params) + \
                dt.param * shape.layer_params * (2 if reshard else shape.layers)
            events = step_events(shape, p, dt, states, acts, runtime=rt, steps=2, sharded=True)
            unit_stream = GATHER_STREAM if api == "fsdp1" else DEFAULT_STREAM
            live: dict[int, int] = {}
            units_most = flat_most = 0
            roots, flat = [], set()
            copy_out = False  # FSDP2: the block made next is the unit its flat output is copied out into
            for e in events:
                if e[0] == "alloc":
                    stream = e[3] if len(e) == 4 else DEFAULT_STREAM
                    # (a unit's unsharded bf16 gradient is unit-sized too, but no gather makes it)
                    if e[2] in (unit, root) and stream == unit_stream and (api == "fsdp1" or copy_out):
                        live[e[1]] = e[2]
                        copy_out = False
                        if e[2] == root:
                            roots.append(e[1])
                    elif stream == GATHER_STREAM:  # FSDP2's flat output, freed once copied out
                        assert api == "fsdp2" and e[2] in (unit, root), e
                        flat.add(e[1])
                        flat_most = max(flat_most, len(flat))
                        copy_out = True
                elif e[0] == "free":
                    live.pop(e[1], None)
                    flat.discard(e[1])
                units_most = max(units_most, sum(1 for v in live.values() if v == unit))
            assert units_most == (2 if reshard else shape.layers), (api, reshard)
            # one root per step, all freed by the step's end; FSDP2 (torch >= 2.8) reshards the root after the forward
            # when told to reshard and gathers it again for the backward
            assert len(roots) == (4 if api == "fsdp2" and reshard else 2) and not live and not flat
            assert flat_most == (1 if api == "fsdp2" else 0)


def test_fsdp_gathers_an_embedding_unit_twice_and_a_kept_last_block_once():
    """Two wraps of torchtitan's, read in its code (session 24). Since its PR #1094 (2025-07-28) the embeddings are a
    unit of their own (Runtime.fsdp_embedding_unit), resharded after their forward: the stream gathers them before
    the layers and frees them before the first layer's unit, then gathers them again when the first block's backward
    prefetches them, so the root no longer holds them through the loss. From its PR #165 to #1094 the last block was
    not resharded after its forward (Runtime.fsdp_keep_last_block): gathered once per step, there by the loss (the
    phases' forward_end), not prefetched again by the root's pre-backward."""
    from math import prod

    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import DEFAULT_STREAM, GATHER_STREAM, step_events

    shape = LLAMA7B
    unit = 2 * shape.layer_params
    root = 2 * (shape.n_params - shape.layers * shape.layer_params)
    emb = 2 * sum(prod(d) for _n, d, k in shape.other_tensors if k == "embedding")
    p = plan(launcher="fsdp", gpus_per_node=4, precision="bf16-mixed", micro_batch=1, seq_len=512, checkpointing=True)
    dt = an.dtypes_for(p, True)

    def gathers(rt):
        """(size, event index, live unit-sized gathers) of each FSDP2 copy-out (the block after a flat output)"""
        states, acts = an.model_states(shape, p, dt, rt), inv.activations(shape, p, dt, rt)
        events = step_events(shape, p, dt, states, acts, runtime=rt, steps=2, sharded=True)
        out, live, flat = [], {}, False
        for k, e in enumerate(events):
            if e[0] == "alloc":
                stream = e[3] if len(e) == 4 else DEFAULT_STREAM
                if stream == GATHER_STREAM:
                    flat = True
                elif flat:
                    out.append((e[2], k, sum(1 for v in live.values() if v == unit)))
                    live[e[1]] = e[2]
                    flat = False
            elif e[0] == "free":
                live.pop(e[1], None)
        return states, events, out

    base = Runtime(fsdp_api="fsdp2", torch_version="2.7")
    states, _events, plain = gathers(base)
    assert states.embedding_unit_bytes == 0
    assert [g[0] for g in plain].count(root) == 2 and [g[0] for g in plain].count(unit) == 4 * shape.layers

    own_states, own_events, own = gathers(dataclasses.replace(base, fsdp_embedding_unit=True))
    assert own_states.embedding_unit_bytes == emb
    sizes = [g[0] for g in own]
    assert sizes.count(root - emb) == 2 and sizes.count(emb) == 4 and sizes.count(unit) == 4 * shape.layers
    step1 = own[:len(own) // 2]
    first, again = [k for k, g in enumerate(step1) if g[0] == emb]
    assert first == 1 and step1[first + 1][0] == unit  # right after the root, before the first layer's unit
    # freed before that unit is made: its id is not live when the first unit comes
    emb_id = own_events[step1[first][1]][1]
    freed_at = next(k for k, e in enumerate(own_events) if e[0] == "free" and e[1] == emb_id)
    assert freed_at < step1[first + 1][1]
    assert step1[again][2] == 1 and again == len(step1) - 1  # prefetched in the first block's backward, last of all

    kept_states, _e, kept = gathers(dataclasses.replace(base, fsdp_keep_last_block=True))
    assert [g[0] for g in kept].count(unit) == 4 * shape.layers - 2  # one gather fewer per step
    assert kept_states.gathered_moments.forward_end == pytest.approx(root + unit)
    assert states.gathered_moments.forward_end == pytest.approx(root)
    with pytest.raises(ValueError, match="fsdp_keep_last_block"):
        Runtime(fsdp_keep_last_block="yes")


# -- litgpt's model code and its loss ---------------------------------------------------------------------------


class _LitGPTStyleBlock(torch.nn.Module):
    """A transformer block with the tensor flow of litgpt's ``Block`` (RMSNorm, CausalSelfAttention, LLaMAMLP), for
    the inventory test: one fused Q/K/V linear; Q, K and V reshaped from a permuted view (``views`` False: litgpt
    before its PR #1013) or split off as views and K/V repeated (after), the query and key rotated and joined
    with a ``cat``, SDPA, the output
    transposed back and reshaped for the output projection. ``norm``: the RMSNorm styles of
    ``activations.rms_norm_bytes`` as litgpt wrote them in turn."""

    def __init__(self, hidden: int, heads: int, groups: int, ffn: int, norm: str, views: bool):
        super().__init__()
        self.heads, self.groups, self.hs, self.norm, self.views = heads, groups, hidden // heads, norm, views
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * groups) * self.hs, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.fc_1 = torch.nn.Linear(hidden, ffn, bias=False)
        self.fc_2 = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)
        self.w1, self.w2 = torch.nn.Parameter(torch.ones(hidden)), torch.nn.Parameter(torch.ones(hidden))

    def _rms(self, x, weight):
        if self.norm == "input_dtype":  # lit-gpt before its PR #606: no upcast
            return weight * (x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-5))
        dtype, x = x.dtype, x.float()
        normed = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-5)
        if self.norm == "fp32_normed":
            return (normed * weight.float()).to(dtype)
        return normed.to(dtype) * weight

    @staticmethod
    def _rope(x, cos, sin):
        half = x.size(-1) // 2
        return ((x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)).to(x.dtype)

    def _attention(self, x, cos, sin):
        B, T, _ = x.shape
        h, g, hs = self.heads, self.groups, self.hs
        qkv = self.qkv(x)
        if self.views:
            q, k, v = qkv.split((h * hs, g * hs, g * hs), dim=-1)
            q, k, v = (t.view(B, T, -1, hs).transpose(1, 2) for t in (q, k, v))
        else:
            qkv = qkv.view(B, T, g, h // g + 2, hs).permute(0, 2, 3, 1, 4)
            q, k, v = qkv.split((h // g, 1, 1), dim=2)
            k, v = k.expand(B, g, h // g, T, hs), v.expand(B, g, h // g, T, hs)
            q, k, v = (t.reshape(B, -1, T, hs) for t in (q, k, v))
        q = torch.cat((self._rope(q, cos, sin), q[..., hs:]), dim=-1)
        k = torch.cat((self._rope(k, cos, sin), k[..., hs:]), dim=-1)
        if self.views and g != h:
            k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.proj(y.reshape(B, T, h * hs))

    def forward(self, x, cos, sin):
        x = self._attention(self._rms(x, self.w1), cos, sin) + x
        n = self._rms(x, self.w2)
        return self.down(torch.nn.functional.silu(self.fc_1(n)) * self.fc_2(n)) + x


@pytest.mark.parametrize("date, norm, views", [("2023-09-13", "input_dtype", False),
                                               ("2023-12-01", "fp32_normed", False),
                                               ("2024-03-20", "transformers", False),
                                               ("2024-09-01", "fp32_normed", False),
                                               ("2025-06-01", "fp32_normed", True)])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16-true", "bf16-mixed"])
def test_litgpt_code_saves_what_the_inventory_says(date, norm, views, kv_heads, precision):
    """litgpt's layer (Runtime.model_code litgpt:DATE) against a real forward of a block with its tensor flow: its
    attention output is copied for the output projection, and its RMSNorm keeps what the code of that date kept."""
    from toolkit.estimate.gpu import Runtime

    cfg = {**TINY_LLAMA, "num_key_value_heads": kv_heads}
    shape = ModelShape.from_config(cfg, "causal-lm")
    p = plan(precision=precision, attention="sdpa", micro_batch=3, seq_len=96)
    dt = an.dtypes_for(p, gpu=False)
    runtime = Runtime(model_code=f"litgpt:{date}")  # litgpt repeats K and V itself in training
    assert inv.litgpt_rms_norm(inv.litgpt_code(shape, runtime)) == norm
    torch.manual_seed(0)
    param_dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    blocks = [_LitGPTStyleBlock(shape.hidden, shape.heads, kv_heads, shape.ffn, norm, views).to(param_dtype)
              for _ in range(3)]
    hs = shape.head_dim
    cos, sin = torch.randn(96, hs, dtype=param_dtype), torch.randn(96, hs, dtype=param_dtype)

    def saved(n: int) -> int:
        x = torch.randn(3, 96, shape.hidden, dtype=param_dtype, requires_grad=True)
        mode = LiveTensorBytes()
        with mode:
            for t in [x, cos, sin, *(q for b in blocks[:n] for q in b.parameters())]:
                mode.track(t)
            before = mode.current
            with torch.autocast("cpu", dtype=torch.bfloat16) if dt.autocast else contextlib.nullcontext():
                out = x
                for b in blocks[:n]:
                    out = b(out, cos, sin)
            grown = mode.current - before
        del out
        return grown

    real = saved(3) - saved(2)
    predicted = 3 * 96 * inv.layer_bytes_per_token(shape, p, dt, runtime) + (
        2 * shape.layer_linear_params if dt.autocast else 0)
    assert predicted == pytest.approx(real, rel=0.005)
    if norm == "transformers" and not dt.autocast and kv_heads < shape.heads:
        # where the rest is alike (transformers' norm, no casts, K/V repeated by both), the output's copy
        old = Runtime(sdpa_repeats_kv=True)
        assert inv.layer_bytes_per_token(shape, p, dt, runtime) - inv.layer_bytes_per_token(shape, p, dt, old) == \
            shape.heads * shape.head_dim * dt.compute


@pytest.mark.parametrize("chunk_rows", [0, 16, 100])
@pytest.mark.parametrize("logits_fp32", [False, True])
def test_a_chunked_loss_peaks_at_two_logits_sized_gradients_in_its_backward(chunk_rows, logits_fp32):
    """litgpt's chunked cross-entropy (Runtime.loss_chunk_rows) against a real backward: the chunks' log-probs go as
    their gradients come and split's backward concatenates those, so the backward holds one logits-sized tensor
    more than the forward left (the log-probs), or a chunk's two gradients where a chunk is over half the rows;
    one cross-entropy holds two more. fp32: logits the model (or Fabric) returned in fp32."""
    from toolkit.estimate.gpu import Runtime

    shape = ModelShape.from_config(TINY_LLAMA, "causal-lm")
    p = plan(precision="bf16-true", micro_batch=2, seq_len=64)
    dt = an.dtypes_for(p, gpu=False)
    runtime = Runtime(loss_chunk_rows=chunk_rows, logits_fp32=logits_fp32, logits_upcast_in_model=logits_fp32)
    acts = inv.activations(shape, p, dt, runtime)
    rows = 2 * 64
    logits = torch.randn(rows, shape.vocab, dtype=torch.float32 if logits_fp32 else torch.bfloat16,
                         requires_grad=True)
    targets = torch.randint(0, shape.vocab, (rows,))
    mode = LiveTensorBytes()
    with mode:
        mode.track(logits)
        mode.track(targets)
        if chunk_rows:
            losses = [torch.nn.functional.cross_entropy(lc, tc, reduction="none")
                      for lc, tc in zip(logits.split(chunk_rows), targets.split(chunk_rows))]
            loss = torch.cat(losses).sum() / rows
        else:
            loss = torch.nn.functional.cross_entropy(logits, targets)
        mode.peak = before = mode.current
        loss.backward()
    assert mode.peak - before == pytest.approx(acts.loss_backward_temp_bytes, rel=0.02)
    assert acts.loss_chunk_bytes == (chunk_rows * shape.vocab * (4 if logits_fp32 else 2) if chunk_rows else 0)


def test_a_chunked_loss_follows_into_the_stream():
    """The allocator stream frees the log-probs, makes the chunks' gradients and then their concatenation, and so
    reaches the phases' peak; a chunk of all the rows (or more) is one cross-entropy."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import step_events

    p = plan(precision="bf16-true", micro_batch=4, seq_len=2048)
    dt = an.dtypes_for(p, True)
    peaks, replayed = {}, {}
    for rows in (0, 128, 4 * 2048):
        runtime = Runtime(loss_chunk_rows=rows, logits_fp32=True, logits_upcast_in_model=True)
        states, acts = an.model_states(LLAMA7B, p, dt, runtime), inv.activations(LLAMA7B, p, dt, runtime)
        peaks[rows] = max(ph.total for ph in an.phases(LLAMA7B, p, dt, states, acts, runtime))
        replayed[rows] = replay(step_events(LLAMA7B, p, dt, states, acts, runtime=runtime, steps=2)).peak_allocated
        assert replayed[rows] == pytest.approx(peaks[rows], rel=0.03)
    logits = 4 * 4 * 2048 * LLAMA7B.vocab  # fp32
    assert peaks[0] == peaks[4 * 2048] and peaks[0] - peaks[128] == pytest.approx(logits)
    # the stream drops the same logits-sized tensor (the peak is at the backward's start here), and makes the first
    # chunk's two gradients as blocks of one chunk in every step (the rest as at most MAX_PIECES blocks)
    assert replayed[0] == replayed[4 * 2048] and replayed[0] - replayed[128] == pytest.approx(logits, rel=0.02)
    runtime = Runtime(loss_chunk_rows=128, logits_fp32=True, logits_upcast_in_model=True)
    states, acts = an.model_states(LLAMA7B, p, dt, runtime), inv.activations(LLAMA7B, p, dt, runtime)
    chunk = 4 * 128 * LLAMA7B.vocab
    sizes = [e[2] for e in step_events(LLAMA7B, p, dt, states, acts, runtime=runtime, steps=2) if e[0] == "alloc"]
    assert sizes.count(chunk) >= 2 * 2
    for bad in (dict(loss_chunk_rows=-1), dict(loss_chunk_rows=True),
                dict(loss_chunk_rows=128),  # transformers' loss upcasts (each chunk): not modelled
                dict(loss_chunk_rows=128, logits_fp32=False, shifted_logits_copy="before_upcast")):
        with pytest.raises(ValueError, match="loss_chunk_rows"):
            Runtime(**bad)


def test_litgpt_code_is_dated_and_known_for_the_llama_family_only():
    from toolkit.errors import ConfigError
    from toolkit.estimate.gpu import Runtime

    assert Runtime(model_code="litgpt:2024-03-15").model_code == "litgpt:2024-03-15"
    for bad in ("litgpt:2024-13-01", "litgpt:yesterday", "litgpt2", "megatron"):
        with pytest.raises(ValueError, match="model_code"):
            Runtime(model_code=bad)
    assert inv.litgpt_rms_norm(None) == "transformers"
    assert [inv.litgpt_rms_norm(d) for d in ("2023-10-23", "2023-10-24", "2024-03-15", "2024-07-22",
                                             inv.LITGPT_TODAY)] == \
        ["input_dtype", "fp32_normed", "transformers", "fp32_normed", "fp32_normed"]
    p = plan(precision="bf16-true", micro_batch=2, seq_len=128)
    with pytest.raises(ConfigError, match="LLaMA family only, not the gpt2 family"):
        an.estimate_analytic(GPT2, p, A100, runtime=Runtime(model_code="litgpt"))
    with pytest.raises(ConfigError, match="torchvision builds ViT models only"):
        an.estimate_analytic(GPT2, p, A100, runtime=Runtime(model_code="torchvision"))


def test_cuda_flash_pads_a_head_dimension_off_the_multiple_of_8_and_slices_the_output_back():
    """torch >= 2.1's SDPA pads a head dimension that is not a multiple of 8 before CUDA's flash kernel (PR
    #105602): autograd saves the padded Q, K, V and output, the sliced output is copied for o_proj, and a value
    view of a fused projection keeps nothing of it alive."""
    from toolkit.estimate.gpu import Runtime

    cfg = {**TINY_LLAMA, "hidden_size": 400, "num_attention_heads": 4, "num_key_value_heads": 4}  # head_dim 100
    shape = ModelShape.from_config(cfg, "causal-lm")
    p = plan(precision="bf16-true", micro_batch=2, seq_len=128)
    gpu = an.dtypes_for(p, True)
    assert inv.flash_padded_head_dim(shape, p, gpu, False) == 104
    for other in (an.dtypes_for(p, False), an.dtypes_for(plan(precision="fp32"), True)):  # CPU; fp32 (no flash)
        assert inv.flash_padded_head_dim(shape, p, other, False) == 100
    assert inv.flash_padded_head_dim(shape, p, dataclasses.replace(gpu, flash_sdpa=False), False) == 100  # V100
    assert inv.flash_padded_head_dim(shape, p, gpu, True) == 100  # a mask: not the flash kernel
    assert inv.flash_padded_head_dim(shape, p, gpu, False, Runtime(torch_version="2.0")) == 100
    q = shape.heads * shape.head_dim * 2
    hf = inv.layer_bytes_per_token(shape, p, gpu, Runtime(torch_version="2.0"))
    assert inv.layer_bytes_per_token(shape, p, gpu) - hf == 4 * q * 4 / 100 + q  # four padded tensors, the copy
    lit = Runtime(model_code="litgpt:2024-03-15")
    # litgpt's multi-head value is a view of the fused projection (its q and k parts kept) unless padded
    assert inv.layer_bytes_per_token(shape, p, gpu, dataclasses.replace(lit, torch_version="2.0")) - hf == 2 * q + q
    assert inv.layer_bytes_per_token(shape, p, gpu, lit) - hf == 4 * q * 4 / 100 + q


def test_an_older_transformers_keeps_rotary_tables_on_the_device_for_every_layer():
    """Runtime.rotary_tables: each layer's cos and sin tables of max_position_embeddings x head_dim in the model's
    dtype, resident like the parameters: every phase holds them and the stream makes them as 2 x layers blocks."""
    from toolkit.errors import ConfigError
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import step_events

    cfg = {**TINY_LLAMA, "max_position_embeddings": 4096}
    shape = ModelShape.from_config(cfg, "causal-lm")
    p = plan(precision="fp16-mixed", launcher="deepspeed", zero_stage=3, micro_batch=2, seq_len=256)
    dt = an.dtypes_for(p, True)
    old, new = Runtime(rotary_tables=True), Runtime()
    table = 4096 * shape.head_dim * dt.param
    assert inv.rotary_table_bytes(shape, dt, old) == (table,) * (2 * shape.layers)
    assert inv.rotary_table_bytes(shape, dt, new) == ()
    totals = {}
    for name, rt in (("old", old), ("new", new)):
        states, acts = an.model_states(shape, p, dt, rt), inv.activations(shape, p, dt, rt)
        phases = an.phases(shape, p, dt, states, acts, rt)
        events = step_events(shape, p, dt, states, acts, runtime=rt, steps=2, sharded=True)
        totals[name] = ([ph.total for ph in phases], replay(events).peak_allocated,
                        sum(1 for e in events if e[0] == "alloc" and e[2] == table))
    assert [a - b for a, b in zip(totals["old"][0], totals["new"][0])] == [2 * shape.layers * table] * len(
        totals["new"][0])
    assert totals["old"][1] - totals["new"][1] == pytest.approx(2 * shape.layers * table, rel=0.05)
    assert totals["old"][2] - totals["new"][2] == 2 * shape.layers
    with pytest.raises(ConfigError, match="rotary_tables: the gpt2 family"):
        an.estimate_analytic(GPT2, plan(precision="bf16-true"), A100, runtime=old)
    with pytest.raises(ValueError, match="rotary_tables"):
        Runtime(rotary_tables="yes")


def test_the_stream_frees_the_heads_saved_tensors_with_the_heads_backward_and_the_embeddings_last():
    """Autograd releases the final norm's and the head's saved tensors as their backward runs, right after the
    loss's, and the embeddings' (ids, position ids) only at the end: the stream frees them so, and the layers'
    backward, where the stream was 512 MiB high for a Llama-2-7B micro-batch of 8 x 2048, holds neither."""
    from toolkit.estimate.stream import _outside, step_events

    p = plan(precision="bf16-mixed", micro_batch=8, seq_len=2048)
    dt = an.dtypes_for(p, True)
    states, acts = an.model_states(LLAMA7B, p, dt), inv.activations(LLAMA7B, p, dt)
    embedded, outside, _ = _outside(LLAMA7B, p, dt, acts)
    assert sum(embedded) == acts.input_bytes == 8 * 2048 * inv.ID_BYTES * (1 + 1 / 8)  # ids and position ids
    events = step_events(LLAMA7B, p, dt, states, acts, steps=2)
    start = events.index(("mark", "step 2"))
    allocs = [e for e in events[start:] if e[0] == "alloc"][:len(embedded) + len(outside)]
    assert [e[2] for e in allocs] == embedded + outside
    where = {e[1]: i for i, e in enumerate(events) if e[0] == "free"}
    layer_frees = [i for i, e in enumerate(events) if i > start and e[0] == "free"]
    head_end = max(where[e[1]] for e in allocs[len(embedded):])
    assert head_end < where[allocs[0][1]] < events.index(("mark", "step 2 optimizer"))
    # the layers' saved tensors are freed between the two (before, the head's went with the embeddings' at the end)
    assert sum(1 for i in layer_frees if head_end < i < where[allocs[0][1]]) >= LLAMA7B.layers


def test_the_zero3_stream_holds_what_its_schedule_gathers_beyond_the_layers():
    """ZeRO-3's coordinator (gathered_moments) holds at the forward's end the head's weights and its prefetch
    beside every layer's weights that torch's linear keeps (a model built outside zero.Init), and the embeddings'
    in their backward: the stream holds them as blocks of their own, so its peak is the phases' (it was the
    head's weights short: 1 GB for a Llama-7B-sized vocabulary)."""
    from toolkit.estimate.allocator import replay
    from toolkit.estimate.gpu import Runtime
    from toolkit.estimate.stream import step_events

    p = plan(precision="fp16-mixed", launcher="deepspeed", zero_stage=3, gpus_per_node=8, micro_batch=1, seq_len=2048)
    dt = an.dtypes_for(p, True)
    rt = Runtime(zero3_linear_wrapped=False, deepspeed_version="0.14.2")
    states, acts = an.model_states(LLAMA7B, p, dt, rt), inv.activations(LLAMA7B, p, dt, rt)
    layer = 2 * LLAMA7B.layer_params  # one layer's fp16 weights, the window's block
    assert states.gathered_moments.forward_end > LLAMA7B.layers * layer  # every layer's, and the head's
    peak = max(ph.total for ph in an.phases(LLAMA7B, p, dt, states, acts, rt))
    r = replay(step_events(LLAMA7B, p, dt, states, acts, runtime=rt, steps=2, sharded=True))
    assert r.peak_allocated == pytest.approx(peak, rel=0.005)


def test_deepspeed_before_0_15_4_prefetches_further_from_its_stale_count_of_available_parameters():
    """DeepSpeed < 0.15.4 reset the coordinator's count at the backward's end while the embeddings and persistent
    parameters were still gathered; the step's release then took them off, so each later step's prefetch window
    is wider by their elements (a checkpointed run, whose window the layers' recompute fills, shows it)."""
    from toolkit.estimate.gpu import Runtime
    from toolkit.strategies.deepspeed import ZeroSettings, zero3_gathered

    zs = ZeroSettings.from_config({"stage": 3}, stage=3, hidden=LLAMA7B.hidden, offload=False)
    new = zero3_gathered(LLAMA7B, zs, checkpointing=True, causal=True)
    old = zero3_gathered(LLAMA7B, zs, checkpointing=True, causal=True, stale_counter=True)
    embedding = LLAMA7B.vocab * LLAMA7B.hidden
    assert old["forward_end"] > new["forward_end"]
    assert old["forward_end"] - new["forward_end"] <= embedding + zs.prefetch_bucket_size  # at most the offset
    p = plan(precision="fp16-mixed", launcher="deepspeed", zero_stage=3, gpus_per_node=8, micro_batch=1, seq_len=2048,
             checkpointing=True)
    dt = an.dtypes_for(p, True)
    moments = {v: an.model_states(LLAMA7B, p, dt, Runtime(deepspeed_version=v)).gathered_moments.forward_end
               for v in ("0.14.2", "0.15.4")}
    assert moments["0.14.2"] == 2 * old["forward_end"] and moments["0.15.4"] == 2 * new["forward_end"]
