"""The optimizer table (toolkit/optimizers.py): names, HF mapping, state bytes, temporaries, and real builds on CPU."""

from __future__ import annotations

import pytest
import torch

from toolkit import optimizers
from toolkit.errors import ConfigError, HpcmemError
from toolkit.models import build_optimizer
from toolkit.optimizers import BNB_BLOCK, OPTIMIZERS, from_hf_optim, get, hf_optim, names


def test_todays_knob_values_stay_valid():
    for name in ("adamw", "adamw-8bit", "adafactor", "sgd"):
        assert name in names()
    assert get("adamw").temporaries == "foreach" and get("sgd").full_states == 1


def test_every_hf_optim_maps_to_one_row_and_the_writer_uses_the_first():
    assert from_hf_optim("adamw_torch").name == "adamw"
    assert from_hf_optim("adamw_torch_fused").name == "adamw-fused"
    assert from_hf_optim("adamw_hf").name == "adamw-perparam"
    assert from_hf_optim("adamw_bnb_8bit").name == "adamw-8bit"
    assert from_hf_optim("adamw_8bit").name == "adamw-8bit"
    assert from_hf_optim("paged_adamw_8bit").name == "adamw-8bit-paged"
    assert from_hf_optim("adafactor").name == "adafactor"
    assert from_hf_optim("SGD").name == "sgd"
    assert hf_optim("adamw") == "adamw_torch" and hf_optim("adamw-fused") == "adamw_torch_fused"
    seen = [hf for o in OPTIMIZERS.values() for hf in o.hf_optim]
    assert len(seen) == len(set(seen))


def test_unknown_names_are_errors_naming_them():
    with pytest.raises(ConfigError, match="'lion'"):
        get("lion")
    with pytest.raises(ConfigError, match="'lion_8bit'"):
        from_hf_optim("lion_8bit")
    with pytest.raises(ConfigError, match="sgd-plain"):
        hf_optim("sgd-plain")


def test_hf_names_known_to_transformers():
    from transformers.training_args import OptimizerNames

    valid = {o.value for o in OptimizerNames}
    for row in OPTIMIZERS.values():
        for hf in row.hf_optim:
            assert hf in valid or hf == "adamw_hf" or hf == "adamw_apex_fused", hf  # adamw_hf, apex: transformers 4


def test_state_bytes_per_tensor():
    adamw, bnb, ada, sgd = get("adamw"), get("adamw-8bit"), get("adafactor"), get("sgd-plain")
    assert adamw.state_tensor_bytes((10, 20), 4) == [800, 800]
    assert get("adamw-fused").state_tensor_bytes((10, 20), 4) == [4, 800, 800]
    # 8-bit: a byte per element per state + an fp32 absmax per 256-block; small tensors 32-bit
    n = 1024 * 1024
    assert bnb.state_tensor_bytes((1024, 1024), 4) == [n, 4 * n // BNB_BLOCK] * 2
    assert bnb.state_tensor_bytes((100,), 2) == [400, 400]
    assert bnb.state_tensor_bytes((4097,), 4) == [4097, 4 * 17, 4097, 4 * 17]
    # Adafactor: fp32 row (shape[:-1]) and column (shape[:-2]+shape[-1:]) vectors; 1-D: a full vector
    assert ada.state_tensor_bytes((30, 20), 2) == [4 * 30, 4 * 20]
    assert ada.state_tensor_bytes((5, 30, 20), 4) == [4 * 150, 4 * 100]
    assert ada.state_tensor_bytes((7,), 2) == [28]
    assert get("adafactor-momentum").state_tensor_bytes((30, 20), 2) == [120, 80, 1200]
    assert sgd.state_tensor_bytes((30, 20), 4) == []
    assert adamw.state_bytes([((10, 20), 3), ((5,), 2)], 4) == 3 * 1600 + 2 * 40


def test_a_paged_optimizer_keeps_its_large_states_outside_the_allocator():
    """bitsandbytes' PagedAdamW8bit: ``get_state_buffer`` puts a parameter's two 8-bit states in unified memory
    (``F.get_paged``) once it has 1e5 elements; smaller ones, and every block scale, are device tensors."""
    from toolkit.optimizers import BNB_PAGED_MIN_NUMEL

    paged, plain = get("adamw-8bit-paged"), get("adamw-8bit")
    n = 1024 * 1024
    assert paged.state_tensor_bytes((1024, 1024), 4) == [4 * n // BNB_BLOCK] * 2
    assert paged.paged_state_bytes((1024, 1024)) == 2 * n
    small = BNB_PAGED_MIN_NUMEL - 1
    assert paged.state_tensor_bytes((small,), 4) == plain.state_tensor_bytes((small,), 4)
    assert paged.paged_state_bytes((small,)) == 0 and paged.paged_state_bytes((100,)) == 0
    assert plain.paged_state_bytes((1024, 1024)) == 0 and get("adamw").paged_bytes([((1024, 1024), 3)]) == 0
    shapes = [((1024, 1024), 3), ((small,), 2)]
    # the two add up to the plain optimizer's states
    assert paged.state_bytes(shapes, 4) + paged.paged_bytes(shapes) == plain.state_bytes(shapes, 4)


def test_step_temporaries_by_implementation():
    numel, largest = 1000.0, 100.0
    assert get("adamw").step_temp_bytes(numel, largest, 4, 4) == 4000
    assert get("adamw").step_temp_bytes(numel, largest, 4, 4, gpu=False) == 800
    assert get("adamw-fused").step_temp_bytes(numel, largest, 4, 4) == 0
    assert get("adamw-perparam").step_temp_bytes(numel, largest, 4, 4) == 800
    assert get("adafactor").step_temp_bytes(numel, largest, 4, 2) == 1600
    assert get("sgd").step_temp_bytes(numel, largest, 4, 4) == 0
    waves = get("adamw").step_temp_tensors([10, 20], 4, 4)
    assert waves == [[40, 80]]
    assert get("adamw-perparam").step_temp_tensors([10, 20], 4, 4) == [[40, 40], [80, 80]]
    assert get("adamw-fused").step_temp_tensors([10, 20], 4, 4) == []


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]


@pytest.mark.parametrize("name", [n for n in names() if get(n).needs is None])
def test_each_row_builds_for_real_on_cpu_and_its_states_match_the_table(name):
    params = _params()
    opt = build_optimizer(name, params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    row = get(name)
    for p in params:
        state = opt.state[p]
        tensors = [v for k, v in state.items() if torch.is_tensor(v) and v.numel() > 1 or k in ("exp_avg", "exp_avg_sq",
                                                                                          "momentum_buffer")]
        got = sorted(t.numel() * t.element_size() for t in tensors)
        want = sorted(b for b in row.state_tensor_bytes(tuple(p.shape), 4) if b > 4)
        assert got == want, (name, dict(state))


def test_fused_on_cpu_tensors_is_still_a_working_adamw():
    opt = build_optimizer("adamw-fused", _params(), lr=1e-3)
    assert isinstance(opt, torch.optim.AdamW)
    assert build_optimizer("adamw-perparam", _params(), lr=1e-3).defaults["foreach"] is False


def test_8bit_without_bitsandbytes_is_a_clear_error():
    pytest.importorskip("pytest")
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is installed here")
    except Exception:  # noqa: BLE001
        pass
    for name in ("adamw-8bit", "adamw-8bit-paged"):
        with pytest.raises(HpcmemError, match=f"optimizer={name} needs bitsandbytes"):
            build_optimizer(name, _params(), lr=1e-3)


def test_script_names_cover_the_old_tables():
    table = optimizers.script_names()
    for hf in ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit",
               "adafactor", "sgd", "adamw", "adamw-8bit"):
        assert hf in table
