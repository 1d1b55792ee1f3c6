"""The fused modules on CPU: the high-precision path against PyTorch, the FP8 path emulated
(``emulate=True``: the kernels under the Triton interpreter, ``torch._scaled_mm`` on CPU) against
float64, and the delayed-scaling state machine (history roll, margin, non-finite amax)."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_fuse.modules
from helpers_models import Conv1D
from fp8_checks import sqnr_db
from lightning_fuse import (
    CurrentScaling,
    DelayedScaling,
    FP8Linear,
    FP8ScalingState,
    FuseConfig,
    FusedLinearBiasActivation,
    fp8_autocast,
    fp8_state_of,
    fuse_,
)
from lightning_fuse.kernels import ACTIVATIONS, activation_reference




def _bound(module, name="layer"):
    state = FP8ScalingState()
    module.bind_fp8_state(state, name)
    return module, state


def _clone_linear(linear):
    twin = Conv1D(linear.nf, linear.weight.shape[0]) if isinstance(linear, Conv1D) else \
        nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    twin.load_state_dict(linear.state_dict())
    return twin


def _run(module, x, dy):
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad


# -- high precision: exactly PyTorch ---------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("bias", [True, False])
def test_high_precision_matches_pytorch(activation, layout, bias):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias) if layout == "linear" else Conv1D(40, 24)
    reference = _clone_linear(linear)
    fused, _ = _bound(FusedLinearBiasActivation(linear, activation))
    x = torch.randn(3, 7, 24)
    dy = torch.randn(3, 7, 40)
    y, dx = _run(fused, x, dy)
    y_ref, dx_ref = _run(lambda t: activation_reference(reference(t), activation), x, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(linear.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(linear.bias.grad, reference.bias.grad, rtol=1e-5, atol=1e-5)


def test_holds_the_original_parameters():
    linear = nn.Linear(16, 32)
    fused = FusedLinearBiasActivation(linear, "gelu")
    assert fused.weight is linear.weight and fused.bias is linear.bias
    assert dict(fused.state_dict()).keys() == dict(linear.state_dict()).keys()
    conv = Conv1D(32, 16)
    plain = FP8Linear(conv)
    assert plain.weight is conv.weight and plain.weight_is_in_out and plain.out_features == 32
    assert fused.to_original() is linear


def test_wrong_input_width_is_reported_like_nn_linear():
    fused = FusedLinearBiasActivation(nn.Linear(16, 32), "relu")
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(6x15 and 16x32\)"):
        fused(torch.randn(2, 3, 15))
    with pytest.raises(RuntimeError, match=r"cannot be multiplied \(6x0 and 16x32\)"):
        fused(torch.randn(6, 0))
    with pytest.raises(RuntimeError, match="both arguments to linear need to be at least 1D"):
        fused(torch.tensor(1.0))
    with pytest.raises(ValueError, match="`activation` must be one of"):
        FusedLinearBiasActivation(nn.Linear(16, 32), "tanh")
    with pytest.raises(TypeError, match="expected nn.Linear or transformers' Conv1D; got Conv2d"):
        FP8Linear(nn.Conv2d(3, 3, 1))


def test_eval_no_grad_and_empty_batch():
    fused, _ = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "silu"))
    fused.eval()
    with torch.no_grad():
        assert fused(torch.randn(5, 16)).shape == (5, 32)
    assert fused(torch.randn(0, 16)).shape == (0, 32)


@pytest.mark.parametrize("recipe", [None, DelayedScaling(), CurrentScaling()], ids=["hp", "delayed", "current"])
@pytest.mark.parametrize("kind", ["fused", "plain"])
def test_empty_batch_backward_gives_zero_gradients(recipe, kind):
    linear = nn.Linear(16, 32)
    module = FusedLinearBiasActivation(linear, "gelu", emulate=True) if kind == "fused" else \
        FP8Linear(linear, emulate=True)
    module, _ = _bound(module)
    x = torch.randn(2, 0, 16, requires_grad=True)
    with fp8_autocast(recipe) if recipe is not None else contextlib.nullcontext():
        y = module(x)
    assert y.shape == (2, 0, 32)
    y.sum().backward()
    assert x.grad.shape == (2, 0, 16)
    assert torch.equal(linear.weight.grad, torch.zeros(32, 16)) and torch.equal(linear.bias.grad, torch.zeros(32))


def test_an_empty_first_batch_still_creates_the_scaling_state():
    # Under DDP every rank joins the delayed-scaling update's amax all-reduce, which a rank runs only
    # once its state exists: a rank whose first batch is empty must have it too.
    module, state = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "gelu", emulate=True))
    with fp8_autocast(DelayedScaling(amax_history_len=4), update_scales=False):
        module(torch.randn(0, 16))
    assert state.groups and state.groups["forward"].history.shape[0] == 4
    assert torch.equal(state.groups["forward"].history, torch.zeros_like(state.groups["forward"].history))


def test_an_ineligible_shape_warns_once_per_model():
    lightning_fuse.modules._WARNED.clear()
    first, _ = _bound(FusedLinearBiasActivation(nn.Linear(16, 40), "gelu", emulate=True), "mlp.0")
    again, _ = _bound(FusedLinearBiasActivation(nn.Linear(16, 40), "gelu", emulate=True), "mlp.0")
    with warnings.catch_warnings(record=True) as caught, fp8_autocast(update_scales=False):
        warnings.simplefilter("always")
        for module in (first, first, again):
            module(torch.randn(4, 16))
    messages = [str(w.message) for w in caught if "running in high precision" in str(w.message)]
    assert messages == ["mlp.0: running in high precision: out_features=40 not a multiple of 16, which "
                        "torch._scaled_mm requires"] * 2  # once for each model, not once per process


def test_frozen_weight_and_bias():
    linear = nn.Linear(16, 32)
    linear.weight.requires_grad_(False)
    fused, _ = _bound(FusedLinearBiasActivation(linear, "gelu_tanh", emulate=True))
    x = torch.randn(16, 16, requires_grad=True)
    with fp8_autocast():
        y = fused(x)
    y.sum().backward()
    assert linear.weight.grad is None and linear.bias.grad is not None and x.grad is not None


# -- FP8 path, emulated on CPU ------------------------------------------------------------------


def _reference64(linear, activation, x, dy):
    w = linear.weight.detach().double().requires_grad_()
    b = linear.bias.detach().double().requires_grad_()
    xr = x.detach().double().requires_grad_()
    h = xr @ (w if isinstance(linear, Conv1D) else w.t()) + b
    y = activation_reference(h, activation) if activation else h
    y.backward(dy.double())
    return y.detach(), xr.grad, w.grad, b.grad


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=8), CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
# ReLU is left out on purpose: its 0/1 derivative flips wherever FP8 rounding moves a pre-activation
# across zero, which no quantizer avoids; smooth activations measure the quantization itself.
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu", None])
def test_emulated_fp8_gradients(recipe, layout, activation):
    torch.manual_seed(1)
    linear = nn.Linear(32, 48) if layout == "linear" else Conv1D(48, 32)
    module = FusedLinearBiasActivation(linear, activation, emulate=True) if activation else \
        FP8Linear(linear, emulate=True)
    _bound(module)
    x = torch.randn(2, 24, 32)  # 48 tokens: the wgrad GEMM needs no padding
    dy = torch.randn(2, 24, 48)
    for _ in range(2):  # delayed scaling learns its scales in the first step
        linear.weight.grad = linear.bias.grad = None
        with fp8_autocast(recipe):
            y, dx = _run(module, x, dy)
    y_ref, dx_ref, dw_ref, db_ref = _reference64(linear, activation, x, dy)
    assert sqnr_db(y, y_ref) >= 25
    assert sqnr_db(dx, dx_ref) >= 20
    assert sqnr_db(linear.weight.grad, dw_ref) >= 20
    assert sqnr_db(linear.bias.grad, db_ref) >= 20


def test_emulated_fp8_pads_the_token_dimension_of_wgrad():
    torch.manual_seed(2)
    linear = nn.Linear(32, 48)
    module, _ = _bound(FusedLinearBiasActivation(linear, "gelu", emulate=True))
    x, dy = torch.randn(37, 32), torch.randn(37, 48)  # 37 tokens
    with fp8_autocast(CurrentScaling()):
        _run(module, x, dy)
    _, _, dw_ref, _ = _reference64(linear, "gelu", x, dy)
    assert sqnr_db(linear.weight.grad, dw_ref) >= 20


def test_emulated_fp8_under_bf16_autocast_with_checkpointing():
    torch.manual_seed(3)
    linear = nn.Linear(32, 64)
    module, _ = _bound(FusedLinearBiasActivation(linear, "gelu_tanh", emulate=True))
    x = torch.randn(32, 32, requires_grad=True)
    with fp8_autocast(CurrentScaling()), torch.autocast("cpu", dtype=torch.bfloat16):
        y = checkpoint(module, x, use_reentrant=False)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    _, dx_ref, dw_ref, _ = _reference64(linear, "gelu_tanh", x, torch.ones(32, 64))
    assert sqnr_db(x.grad, dx_ref) >= 20 and sqnr_db(linear.weight.grad, dw_ref) >= 20


def test_fp8_on_cpu_without_emulate_falls_back_with_one_warning():
    fused, _ = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "gelu"))
    from lightning_fuse import modules

    modules._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8_autocast():
            fused(torch.randn(4, 16))
            fused(torch.randn(4, 16))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "FP8 GEMMs need a CUDA GPU; the input is on cpu" in messages[0]


def test_shape_ineligible_for_scaled_mm_falls_back_naming_the_dims():
    fused, _ = _bound(FusedLinearBiasActivation(nn.Linear(20, 32), "gelu", emulate=True), "mlp.fc")
    assert fused.fp8_reason.startswith("in_features=20 not a multiple of 16")
    with pytest.warns(UserWarning, match=r"mlp.fc: running in high precision: in_features=20"):
        with fp8_autocast():
            fused(torch.randn(4, 20))


# -- delayed scaling state ----------------------------------------------------------------------


def _step(module, x, recipe, scale_grad=1.0):
    with fp8_autocast(recipe):
        y = module(x)
    (y * scale_grad).sum().backward()


def test_history_rolls_and_scales_follow_the_recipe():
    torch.manual_seed(4)
    module, state = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "relu", emulate=True))
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo="max", margin=1)
    x_big, x_small = torch.randn(16, 16) * 8, torch.randn(16, 16)
    _step(module, x_big, recipe)
    hist = state.groups["forward"].history
    assert hist.shape == (3, 2) and torch.all(hist[0] == 0)
    # The first update used amax(x_big): scale = 448 / amax / 2**margin.
    assert state.groups["forward"].scale[0].item() == pytest.approx(448 / x_big.abs().max().item() / 2, rel=1e-6)
    for _ in range(3):
        _step(module, x_small, recipe)
    # After 3 more steps the big input has left the 3-step history.
    assert state.groups["forward"].scale[0].item() == pytest.approx(448 / x_small.abs().max().item() / 2, rel=1e-6)
    assert state.groups["backward"].scale[0].item() != 1.0


def test_most_recent_amax():
    module, state = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "relu", emulate=True))
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    x1, x2 = torch.randn(16, 16) * 8, torch.randn(16, 16)
    _step(module, x1, recipe)
    _step(module, x2, recipe)
    assert state.groups["forward"].scale[0].item() == pytest.approx(448 / x2.abs().max().item(), rel=1e-6)


def test_non_finite_amax_keeps_the_previous_scale_and_is_counted():
    module, state = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "gelu", emulate=True))
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 16)
    _step(module, x, recipe)
    # Each context exit consumes the gradient amax of the backward before it: this step's exit
    # sets the gradient scale from step 1, then its backward records a NaN.
    _step(module, x, recipe, scale_grad=float("nan"))
    grad_scale = state.groups["backward"].scale.clone()
    assert grad_scale.item() != 1.0
    _step(module, x, recipe)  # consumes the NaN step's gradient amax
    assert torch.equal(state.groups["backward"].scale, grad_scale)
    assert state.stats()["nonfinite_amax"] == 1
    # The non-finite entry does not linger in the history.
    assert torch.isfinite(state.groups["backward"].history).all()


def test_state_dict_round_trip():
    module, state = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "gelu", emulate=True), "fc")
    recipe = DelayedScaling(amax_history_len=4)
    for _ in range(2):
        _step(module, torch.randn(16, 16), recipe)
    saved = state.state_dict()
    restored = FP8ScalingState()
    restored.register("fc")
    restored.load_state_dict(saved)
    restored.ensure(4, torch.device("cpu"))
    for group in ("forward", "backward"):
        for key, value in state.groups[group].tensors().items():
            assert torch.equal(restored.groups[group].tensors()[key], value)
    other = FP8ScalingState()
    other.register("proj")
    with pytest.raises(ValueError, match=r"saved for modules \['fc'\] but this model has \['proj'\]"):
        other.load_state_dict(saved)


@pytest.mark.parametrize("allocated", [True, False], ids=["allocated", "before-the-first-step"])
def test_a_state_saved_for_more_modules_loads_each_modules_own_columns(allocated):
    # A checkpoint of a model fused when more of its linears ran FP8 (before a linear FP8 cannot run
    # was left unconverted): each module this model has takes its own history, scales and counts.
    modules = [FP8Linear(nn.Linear(16, 16), emulate=True) for _ in range(3)]
    state = FP8ScalingState()
    for name, module in zip("abc", modules):
        module.bind_fp8_state(state, name)
    recipe = DelayedScaling(amax_history_len=4)
    for step in range(3):
        for i, module in enumerate(modules):
            _step(module, torch.randn(16, 16) * (i + 1) * (step + 1), recipe)
    saved = state.state_dict()
    restored = FP8ScalingState()
    for name in "ac":
        restored.register(name)
    if allocated:
        restored.ensure(4, torch.device("cpu"))
    with pytest.warns(UserWarning, match=r"the scales saved for \['b'\] are dropped"):
        restored.load_state_dict(saved)
    restored.ensure(4, torch.device("cpu"))
    for group, columns in (("forward", [0, 1, 4, 5]), ("backward", [0, 2])):
        for key, value in state.groups[group].tensors().items():
            expected = value[..., columns]
            assert torch.equal(restored.groups[group].tensors()[key], expected), (group, key)
    missing = FP8ScalingState()
    for name in "ad":
        missing.register(name)
    with pytest.raises(ValueError, match=r"saved for modules \['a', 'b', 'c'\] but this model has \['a', 'd'\]"):
        missing.load_state_dict(saved)


def test_loading_a_state_saved_before_any_fp8_step_resets_the_scales():
    # A checkpoint taken before the first FP8 step holds no histories: loading it (a rollback to that
    # checkpoint) must give the state a fresh model has, not keep the scales learnt since.
    module, state = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "gelu", emulate=True), "fc")
    fresh_module, fresh = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "gelu", emulate=True), "fc")
    fresh_module.load_state_dict(module.state_dict())
    saved = state.state_dict()
    assert "forward.history" not in saved
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 16) * 5
    for _ in range(2):
        _step(module, x, recipe)
    assert state.groups["forward"].scale[0].item() != 1.0
    state.load_state_dict(saved)
    module.weight.grad = fresh_module.weight.grad = None
    with fp8_autocast(recipe, update_scales=False):
        y, y_fresh = module(x), fresh_module(x)
    assert torch.equal(y, y_fresh)  # quantized with the initial scales, as the fresh model does
    for group in ("forward", "backward"):
        for key, value in fresh.groups[group].tensors().items():
            assert torch.equal(state.groups[group].tensors()[key], value), (group, key)


def test_scaling_state_misuse_names_what_was_given():
    module, state = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "gelu", emulate=True), "fc")
    _step(module, torch.randn(16, 16), DelayedScaling(amax_history_len=2))
    with pytest.raises(RuntimeError, match=r"cannot register 'proj': .*allocated for \['fc'\]"):
        FP8Linear(nn.Linear(32, 16), emulate=True).bind_fp8_state(state, "proj")
    with pytest.raises(TypeError, match=r"`recipe` must be a DelayedScaling .*; got CurrentScaling"):
        state.update(CurrentScaling())
    x = torch.randn(16, 16) * 1000
    with fp8_autocast(DelayedScaling(amax_history_len=2), update_scales=False):
        module(x)
    state.update("delayed")  # a recipe's name, as fp8_autocast takes it
    assert state.groups["forward"].scale[0].item() == pytest.approx(448 / x.abs().max().item(), rel=1e-6)


def test_recipes_validate_their_fields():
    with pytest.raises(ValueError, match="`fp8_format` must be one of hybrid, e4m3; got 'e5m2'"):
        DelayedScaling(fp8_format="e5m2")
    with pytest.raises(ValueError, match="`amax_compute_algo` must be one of max, most_recent"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="`margin` must be a non-negative int"):
        CurrentScaling(margin=-1)
    assert DelayedScaling(fp8_format="e4m3").backward_dtype == torch.float8_e4m3fn
    with pytest.raises(TypeError, match=r"^unknown DelayedScaling field\(s\) 'amax_histroy_len' \(did you mean "
                                        r"'amax_history_len'\?\); valid fields: fp8_format, amax_history_len, "):
        DelayedScaling(amax_histroy_len=16)
    with pytest.raises(TypeError, match=r"unknown CurrentScaling field\(s\) 'amax_history_len'; valid fields: "
                                        r"fp8_format, margin$"):
        CurrentScaling(amax_history_len=16)
    # still dataclasses: replace, equality, pickling
    recipe = dataclasses.replace(DelayedScaling(), margin=2)
    assert recipe == DelayedScaling(margin=2) == pickle.loads(pickle.dumps(recipe))


def test_every_scale_is_16_byte_aligned_for_cublas():
    # cuBLASLt refuses FP8 GEMMs whose scale pointer is not 16-byte aligned (see test_gpu.py).
    module, state = _bound(FusedLinearBiasActivation(nn.Linear(16, 32), "gelu", emulate=True))
    recipe = DelayedScaling(amax_history_len=2)
    for _ in range(2):
        _step(module, torch.randn(16, 16), recipe)
    for group in ("forward", "backward"):
        for index in range(state.groups[group].scale.shape[0]):
            scale, scale_inv, _ = state.slot(group, index)
            assert scale.data_ptr() % 16 == 0 and scale_inv.data_ptr() % 16 == 0


@pytest.mark.parametrize("autocast_bf16", [True, False], ids=["bf16-output", "fp32-output"])
@pytest.mark.parametrize("activation", ["gelu_tanh", None])
def test_bias_goes_into_the_gemm_epilogue_for_bf16_outputs(monkeypatch, autocast_bf16, activation):
    # bf16 output: the forward GEMM receives the bias, rounded to bf16, and nothing adds it again;
    # fp32 output (torch._scaled_mm takes no fp32 bias): the bias is added after the GEMM. Both match
    # float64 (a bias added twice or not at all would not).
    from lightning_fuse import modules

    seen = []
    real = modules._scaled_mm

    def recording(a, b, scale_a, scale_b, out_dtype, fast_accum=False, bias=None):
        seen.append((out_dtype, None if bias is None else bias.dtype))
        return real(a, b, scale_a, scale_b, out_dtype, fast_accum, bias)

    monkeypatch.setattr(modules, "_scaled_mm", recording)
    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    with torch.no_grad():
        linear.bias.mul_(20)  # large enough that a missing or doubled bias shows in the SQNR
    module, _ = _bound(FusedLinearBiasActivation(linear, activation, emulate=True) if activation
                       else FP8Linear(linear, emulate=True))
    x = torch.randn(64, 32)
    with torch.no_grad(), fp8_autocast(CurrentScaling()), torch.autocast("cpu", dtype=torch.bfloat16,
                                                                         enabled=autocast_bf16):
        y = module(x)
    expected = x.double() @ linear.weight.double().t() + linear.bias.double()
    if activation:
        expected = activation_reference(expected, activation)
    assert y.dtype == (torch.bfloat16 if autocast_bf16 else torch.float32)
    assert sqnr_db(y.double(), expected) >= 25
    assert seen[0] == ((torch.bfloat16, torch.bfloat16) if autocast_bf16 else (torch.float32, None))


def test_the_benchmark_times_a_conv1d_chain_in_its_own_weight_layout():
    from lightning_fuse.speed import _copy_of, measure, shape_key

    chain = FusedLinearBiasActivation(Conv1D(64, 32), "gelu_tanh", emulate=True)
    key = shape_key(chain, 8, torch.float32)
    copy = _copy_of(key, torch.device("cpu"), emulate=True)
    assert copy.weight_is_in_out and tuple(copy.weight.shape) == (32, 64)
    assert (copy.in_features, copy.out_features) == (32, 64)
    original_ms, fused_ms = measure(key, torch.device("cpu"), None, emulate=True, warmup=1, reps=1)
    assert original_ms > 0 and fused_ms > 0


@pytest.mark.parametrize("change", ["fused AdamW step", "write through .data"])
def test_current_scaling_quantizes_a_weight_changed_without_a_version_bump(change):
    # torch's fused optimizers and writes through .data leave weight._version as it was
    torch.manual_seed(0)
    module, _ = _bound(FP8Linear(nn.Linear(32, 48), emulate=True), "fc")
    x = torch.randn(16, 32)
    with fp8_autocast(CurrentScaling()):
        y = module(x)
    version = module.weight._version
    if change == "fused AdamW step":
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.05, fused=True)
        y.square().mean().backward()
        optimizer.step()
    else:
        module.weight.data.mul_(2.0)
    assert module.weight._version == version  # what the cache cannot see
    with fp8_autocast(CurrentScaling()):
        y = module(x)
    reference = F.linear(x.double(), module.weight.double(), module.bias.double())
    assert sqnr_db(y, reference) > 20


def test_a_high_precision_step_after_an_fp8_one_recomputes_in_high_precision_under_checkpointing():
    torch.manual_seed(0)
    module, _ = _bound(FusedLinearBiasActivation(nn.Linear(32, 48), "gelu", emulate=True), "fc")
    x = torch.randn(16, 32)
    with fp8_autocast("current"):
        module(x).sum().backward()
    module.weight.grad = None
    module(x.clone().requires_grad_()).sum().backward()
    plain = module.weight.grad.clone()
    for reentrant in (False, True):  # the non-reentrant form checks the recomputed tensors' metadata
        module.weight.grad = None
        checkpoint(module, x.clone().requires_grad_(), use_reentrant=reentrant).sum().backward()
        torch.testing.assert_close(module.weight.grad, plain)


def test_an_empty_batch_under_fp8_recomputes_the_same_path_under_checkpointing():
    module, _ = _bound(FusedLinearBiasActivation(nn.Linear(32, 48), "gelu", emulate=True), "fc")
    x = torch.randn(0, 32, requires_grad=True)
    with fp8_autocast("current"):
        y = checkpoint(module, x, use_reentrant=False)
    y.sum().backward()
    assert x.grad.shape == (0, 32) and torch.count_nonzero(module.weight.grad) == 0


@pytest.mark.parametrize("recipe", [None, "current"])
def test_double_backward_is_refused_not_silently_wrong(recipe):
    module, _ = _bound(FusedLinearBiasActivation(nn.Linear(32, 48), "gelu", emulate=True), "fc")
    x = torch.randn(16, 32, requires_grad=True)
    with fp8_autocast(recipe, enabled=recipe is not None):
        y = module(x)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=False)  # first order: fine
    assert gx.shape == x.shape
    with fp8_autocast(recipe, enabled=recipe is not None):
        y = module(x)
    with pytest.raises(RuntimeError, match="do not support double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_float64_runs_pytorchs_own_ops_with_one_warning():
    torch.manual_seed(0)
    linear = nn.Linear(32, 48).double()
    reference = nn.Sequential(_clone_linear(linear).double(), nn.GELU())
    module, _ = _bound(FusedLinearBiasActivation(linear, "gelu"), "fc")
    x = torch.randn(8, 32, dtype=torch.float64)
    lightning_fuse.modules._WARNED.clear()
    with pytest.warns(UserWarning, match="float64 runs PyTorch's unfused linear"):
        y, dx = _run(module, x, torch.ones(8, 48, dtype=torch.float64))
    y_ref, dx_ref = _run(reference, x, torch.ones(8, 48, dtype=torch.float64))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)
    assert torch.autograd.gradcheck(module, (torch.randn(3, 32, dtype=torch.float64, requires_grad=True),))


@pytest.mark.parametrize("recipe", [DelayedScaling(), CurrentScaling()], ids=["delayed", "current"])
def test_float64_under_a_recipe_warns_once_for_both_fallbacks(recipe):
    # No FP8 path and no fused kernel for float64: one warning saying both, not one for each.
    torch.manual_seed(0)
    linear = nn.Linear(32, 48).double()
    reference = nn.Sequential(_clone_linear(linear).double(), nn.GELU())
    module, _ = _bound(FusedLinearBiasActivation(linear, "gelu", emulate=True), "fc")
    x = torch.randn(8, 32, dtype=torch.float64)
    lightning_fuse.modules._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8_autocast(recipe):
            y, dx = _run(module, x, torch.ones(8, 48, dtype=torch.float64))
            _run(module, x, torch.ones(8, 48, dtype=torch.float64))
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert "input dtype torch.float64 has no FP8 path" in messages[0]
    assert "PyTorch's own linear and activation run instead" in messages[0]
    y_ref, dx_ref = _run(reference, x, torch.ones(8, 48, dtype=torch.float64))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)


def test_a_float64_mlp_under_a_recipe_warns_once():
    # The chain and the FP8Linear after it fall back alike: one warning for the model, not one per kind.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)).double()
    fuse_(model, FuseConfig(convert="mlp", emulate=True))
    assert [type(m) for m in model] == [FusedLinearBiasActivation, nn.Identity, FP8Linear]
    lightning_fuse.modules._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8_autocast(DelayedScaling()):
            model(torch.randn(8, 32, dtype=torch.float64)).sum().backward()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages


@pytest.mark.parametrize("kind", ["fused", "plain"])
def test_a_compiled_fp8_module_trains_like_the_eager_one(kind, monkeypatch):
    # Under torch.compile the FP8 weight copy is made in the graph, not looked up in the eager cache:
    # the cache key (the weight's version counter among others) must not be read while tracing.
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references: a triton_op cannot compile on CPU
    torch.manual_seed(0)
    linear = nn.Linear(32, 48)
    eager, _ = _bound(FusedLinearBiasActivation(linear, "gelu_tanh", emulate=True) if kind == "fused"
                      else FP8Linear(linear, emulate=True))
    twin = nn.Linear(32, 48)
    twin.load_state_dict(linear.state_dict())
    compiled_module, _ = _bound(FusedLinearBiasActivation(twin, "gelu_tanh", emulate=True) if kind == "fused"
                                else FP8Linear(twin, emulate=True))
    compiled = torch.compile(compiled_module, backend="aot_eager", fullgraph=True)
    x, dy = torch.randn(24, 32), torch.randn(24, 48)
    for _ in range(2):
        with fp8_autocast(CurrentScaling()):
            y, dx = _run(eager, x, dy)
            y_c, dx_c = _run(compiled, x, dy)
        torch.testing.assert_close(y_c, y, rtol=0, atol=0)
        torch.testing.assert_close(dx_c, dx, rtol=0, atol=0)
    torch.testing.assert_close(twin.weight.grad, linear.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(twin.bias.grad, linear.bias.grad, rtol=0, atol=0)
    _, dx_ref, dw_ref, db_ref = _reference64(linear, "gelu_tanh" if kind == "fused" else None, x, dy)
    assert sqnr_db(dx_c, dx_ref) >= 20 and sqnr_db(twin.weight.grad, 2 * dw_ref) >= 20
    assert sqnr_db(twin.bias.grad, 2 * db_ref) >= 20


@pytest.mark.parametrize("backward_in_context", [False, True], ids=["backward-after", "backward-inside"])
def test_a_compiled_fused_model_under_delayed_scaling_matches_the_eager_one(backward_in_context, monkeypatch):
    # The first compiled call allocates the scaling state and its backward max-reduces the gradient
    # amax into a history row: those must be tensors that exist outside the traced graph (a tensor
    # made in the forward graph and written by the backward one broke AOTAutograd's partitioner:
    # "Node select_scatter_... was invalid, but is output").
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references: a triton_op cannot compile on CPU

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        assert fuse_(model, FuseConfig(emulate=True)).num_fused == 1
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    (eager, eager_opt), (model, opt) = make(), make()
    assert isinstance(model[2], FP8Linear)
    compiled = torch.compile(model, backend="aot_eager")
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(1)
    for step in range(3):
        x, dy = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
        results = []
        for net, optimizer in ((eager, eager_opt), (compiled, opt)):
            optimizer.zero_grad()
            xi = x.clone().requires_grad_()
            with fp8_autocast(recipe):
                y = net(xi)
                if backward_in_context:
                    y.backward(dy)
            if not backward_in_context:
                y.backward(dy)
            results.append((y.detach(), xi.grad, [p.grad.clone() for p in net.parameters()]))
            optimizer.step()
        (y, dx, grads), (y_c, dx_c, grads_c) = results
        torch.testing.assert_close(y_c, y, rtol=0, atol=0, msg=f"step {step}: outputs")
        torch.testing.assert_close(dx_c, dx, rtol=0, atol=0, msg=f"step {step}: input gradients")
        for g_c, g in zip(grads_c, grads):
            torch.testing.assert_close(g_c, g, rtol=0, atol=0, msg=f"step {step}: parameter gradients")
        state, state_c = fp8_state_of(eager), fp8_state_of(model)
        for group in ("forward", "backward"):
            for key, value in state.groups[group].tensors().items():
                torch.testing.assert_close(state_c.groups[group].tensors()[key], value, rtol=0, atol=0,
                                           msg=f"step {step}: {group} {key}")
    # FP8 ran and the scales moved: every history holds amaxes, every scale left 1.
    for group in ("forward", "backward"):
        assert (state_c.groups[group].history[1] > 0).all()
        assert (state_c.groups[group].scale != 1).all()


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("activation", ["gelu", None])
@pytest.mark.parametrize("bias", [True, False])
def test_an_infinite_float16_gradient_reaches_the_weight_and_input_gradients(recipe, activation, bias):
    # A GradScaler (16-mixed) skips the step only if the overflow shows in the gradients. The FP8 cast
    # saturates, so an infinite incoming gradient used to leave the weight and input gradients finite.
    torch.manual_seed(5)
    linear = nn.Linear(32, 48, bias=bias).half()
    module = FusedLinearBiasActivation(linear, activation, emulate=True) if activation else \
        FP8Linear(linear, emulate=True)
    _, state = _bound(module)
    x = torch.randn(48, 32, dtype=torch.float16)
    finite = torch.randn(48, 48, dtype=torch.float16)
    with fp8_autocast(recipe):
        _run(module, x, finite)  # delayed scaling learns its scales
    assert torch.isfinite(linear.weight.grad).all()
    poisoned = finite.clone()
    poisoned[3, 5] = float("inf")
    linear.weight.grad = None
    if bias:
        linear.bias.grad = None
    with fp8_autocast(recipe, update_scales=False):
        _, dx = _run(module, x, poisoned)
    assert not torch.isfinite(dx).all()
    assert not torch.isfinite(linear.weight.grad).all()
    if bias:
        assert not torch.isfinite(linear.bias.grad).all()
    # The overflow poisons that step only: once the scales update (a GradScaler's skipped step still
    # runs the callback's update), the next finite gradient gives finite gradients again.
    if isinstance(recipe, DelayedScaling):
        state.update(recipe)
    linear.weight.grad = None
    with fp8_autocast(recipe, update_scales=False):
        _, dx = _run(module, x, finite)
    assert torch.isfinite(dx).all() and torch.isfinite(linear.weight.grad).all()


# -- the FP8 GEMM on CPU ------------------------------------------------------------------------------


def _fp8_operand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("formats", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cpu_fp8_gemm_is_the_dequantized_product(formats, out_dtype):
    # emulate=True runs the FP8 GEMMs on CPU as float32 matmuls of the exactly widened operands.
    fa, fb = (getattr(torch, f"float8_{f}fn" if f == "e4m3" else f"float8_{f}") for f in formats)
    m, k, n = 37, 64, 48  # rows need not be a multiple of 16
    a = _fp8_operand((m, k), fa, 0)
    b = _fp8_operand((n, k), fb, 1).t()  # column-major
    scale_a, scale_b = torch.tensor(0.37), torch.tensor(1.9)
    bias = torch.randn(n).to(out_dtype) if out_dtype == torch.bfloat16 else None
    out = lightning_fuse.modules._scaled_mm(a, b, scale_a, scale_b, out_dtype, bias=bias)
    expected = (a.double() @ b.double()) * (0.37 * 1.9)
    if bias is not None:
        expected = expected + bias.double()
    assert out.dtype == out_dtype and out.shape == (m, n)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[out_dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.parametrize("case,match", [
    ("k", r"contraction width 24 and output width 48 must be multiples of 16"),
    ("n", r"contraction width 32 and output width 24 must be multiples of 16"),
    ("row-major-b", r"`b` must be column-major; got strides \(48, 1\)"),
    ("column-major-a", r"`a` must be row-major; got strides \(1, 16\)"),
    ("e5m2-pair", r"e5m2 x e5m2 has no cuBLASLt kernel"),
    ("fp32-bias", r"a torch.float32 bias with torch.bfloat16 output"),
    ("unaligned-scale", r"`scale_a` not 16-byte aligned"),
])
def test_the_cpu_fp8_gemm_refuses_what_cublaslt_refuses(case, match):
    # torch._scaled_mm's own CPU kernel takes all of these: on CPU the operands are checked as the GPU
    # takes them (tests/test_gpu.py::test_scaled_mm_requirements checks the GPU itself).
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    a, b = _fp8_operand((16, 32), e4m3, 0), _fp8_operand((48, 32), e4m3, 1).t()
    one, bias, out_dtype = torch.ones(()), None, torch.bfloat16
    scale_a = one
    if case == "k":
        a, b = _fp8_operand((16, 24), e4m3, 0), _fp8_operand((48, 24), e4m3, 1).t()
    elif case == "n":
        b = _fp8_operand((24, 32), e4m3, 1).t()
    elif case == "row-major-b":
        b = _fp8_operand((32, 48), e4m3, 1)
    elif case == "column-major-a":
        a = _fp8_operand((32, 16), e4m3, 0).t()
    elif case == "e5m2-pair":
        a, b = a.to(torch.float32).to(e5m2), b.to(torch.float32).to(e5m2)
    elif case == "fp32-bias":
        bias = torch.zeros(48)
    else:
        scale_a = torch.ones(2)[1]
    with pytest.raises(RuntimeError, match=match):
        lightning_fuse.modules._scaled_mm(a, b, scale_a, one, out_dtype, bias=bias)


def _fused_mlp_steps(wrap, step):
    """Three delayed-scaling steps of one fused MLP, the same weights and inputs on every call: each
    step's input and parameter gradients, then the scaling state's tensors. ``wrap(model)`` is what
    runs the model; ``step(run, x, model, recipe)`` runs one forward and backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32))
    fuse_(model, FuseConfig(convert="mlp", emulate=True))
    run = wrap(model)
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(1)
    results = []
    for i in range(3):
        x = (torch.randn(16, 32) * (1.0 + i)).requires_grad_()  # growing amaxes: the scales move
        step(run, x, model, recipe)
        results += [x.grad, *(p.grad.clone() for p in model.parameters())]
        model.zero_grad()
    state = fp8_state_of(model)
    return results + [t.clone() for g in state.groups.values() for t in g.tensors().values()]


@pytest.mark.parametrize("update", ["at-exit", "inside"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_recomputation_quantizes_with_its_forwards_scales(reentrant, update):
    # Outside Lightning the backward runs after the fp8_autocast block, whose exit updates the delayed
    # scales: the recomputation of a checkpointed forward must still quantize with the scales its
    # forward used (and record no amax a second time), so the step is bit-equal to an uncheckpointed one.
    def step(run, x, model, recipe):
        if update == "at-exit":
            with fp8_autocast(recipe):
                y = run(x)
            (y.float() ** 2).sum().backward()  # after the exit: the scales were updated since the forward
        else:  # an optimizer step between a forward and its backward (manual optimization, a GAN's two)
            with fp8_autocast(recipe, update_scales=False):
                y = run(x)
                fp8_state_of(model).update(recipe, groups=("forward",))
                (y.float() ** 2).sum().backward()

    checkpointed = _fused_mlp_steps(lambda model: lambda x: checkpoint(model, x, use_reentrant=reentrant), step)
    plain = _fused_mlp_steps(lambda model: model, step)
    assert len(checkpointed) == len(plain) > 12
    assert all(torch.equal(a, b) for a, b in zip(checkpointed, plain))


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def test_a_compiled_checkpointed_block_matches_eager_with_the_backward_after_the_context(monkeypatch):
    # torch.compile over a checkpointed block (torchtitan's order) recomputes inside its own backward graph:
    # with the backward after each fp8_autocast block, whose exit updated the scales, the steps are
    # bit-equal to eager ones without checkpointing. (The other order, checkpoint over a compiled block,
    # recompiles the block outside the context and PyTorch's checkpoint rejects the recomputation: README.)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references: a triton_op cannot compile on CPU

    def step(run, x, model, recipe):
        with fp8_autocast(recipe):
            y = run(x)
        (y.float() ** 2).sum().backward()

    compiled = _fused_mlp_steps(lambda model: torch.compile(_Checkpointed(model), backend="aot_eager"), step)
    eager = _fused_mlp_steps(lambda model: model, step)
    assert len(compiled) == len(eager) > 12
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16])
def test_the_cpu_fp8_gemm_is_float32_under_autocast(autocast_dtype):
    # The GPU accumulates in float32 whatever autocast says: so must the CPU emulation (a float16 matmul
    # of 448-sized FP8 values overflows).
    a = torch.full((16, 32), 448.0).to(torch.float8_e4m3fn)
    b = _fp8_operand((48, 32), torch.float8_e4m3fn, 1).t()
    one = torch.ones(())
    expected = lightning_fuse.modules._scaled_mm(a, b, one, one, torch.float32)
    with torch.autocast("cpu", dtype=autocast_dtype):
        out = lightning_fuse.modules._scaled_mm(a, b, one, one, torch.float32)
    assert torch.isfinite(out).all() and torch.equal(out, expected)
