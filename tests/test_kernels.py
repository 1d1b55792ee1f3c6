"""The kernel family against float64 references (CPU: Triton interpreter; GPU: the compiled kernels).

Every test draws fresh random inputs; FP8 outputs are compared with torch's own saturating cast
of the float64 reference (>= 99% bit-exact, every element within one FP8 step).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re

import pytest
import torch

from fp8_checks import assert_fp8_close
from lightning_fuse.kernels.activations import activation_id
from lightning_fuse.kernels import (
    ACTIVATIONS,
    FP8_FORMATS,
    activation_derivative_reference,
    activation_reference,
    bias_act,
    dact_dbias_quantize,
    dact_dbias_quantize_current_scaling,
    dbias_quantize,
    quantize,
    quantize_current_scaling,
    quantize_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
# (leading shape, N): one row, N not a multiple of 16, several row groups, 3-D. M % 4 != 0 (the
# byte-wise transposed store) and M % 4 == 0 (the packed one: 68 rows, a partial last tile).
SHAPES = [((1,), 48), ((37,), 70), ((67,), 33), ((2, 34), 70)]


def _inputs(leading, n, dtype, *, seed=None):
    g = torch.Generator(device="cpu").manual_seed(seed if seed is not None else torch.seed() % 2**31)
    grad = torch.randn(*leading, n, generator=g).to(DEVICE, dtype)
    pre = (2 * torch.randn(*leading, n, generator=g)).to(DEVICE, dtype)
    return grad, pre


def _reference(grad, pre, activation):
    g64, p64 = grad.double(), pre.double()
    dx = g64 if activation is None else g64 * activation_derivative_reference(p64, activation)
    return dx


def _check_dbias(dbias, dx64):
    expected = dx64.reshape(-1, dx64.shape[-1]).sum(0)
    assert dbias.dtype == torch.float32 and dbias.shape == expected.shape
    scale = expected.abs().max().clamp_min(1.0)
    torch.testing.assert_close(dbias.double(), expected, rtol=0, atol=1e-5 * scale.item() * max(1, dx64.shape[0]) ** 0.5)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("leading,n", SHAPES)
def test_dact_dbias_quantize_fp8_matches_float64(activation, dtype, leading, n):
    fp8_dtype = FP8_DTYPES[(len(leading) + n) % 2]
    grad, pre = _inputs(leading, n, dtype)
    dx64 = _reference(grad, pre, activation)
    scale = torch.tensor(float(FP8_FORMATS[fp8_dtype].max) / 8.0, device=DEVICE)
    amax = torch.zeros(1, device=DEVICE)
    dx, dx_t, dbias = dact_dbias_quantize(grad, pre, activation, scale=scale, fp8_dtype=fp8_dtype, amax=amax,
                                          transpose=True)
    assert dx.shape == grad.shape and dx.dtype == fp8_dtype
    assert_fp8_close(dx.cpu(), quantize_reference(dx64, scale.cpu().double(), fp8_dtype))
    m = grad.numel() // n
    assert dx_t.shape == (n, m) and dx_t.is_contiguous()
    assert torch.equal(dx_t.view(torch.uint8), dx.reshape(m, n).view(torch.uint8).t())
    _check_dbias(dbias.cpu(), dx64.cpu())
    torch.testing.assert_close(amax.double().cpu(), dx64.abs().max().reshape(1).cpu(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dact_dbias_high_precision_matches_float64(activation, dtype):
    grad, pre = _inputs((45,), 40, dtype)
    dx64 = _reference(grad, pre, activation)
    dx, dx_t, dbias = dact_dbias_quantize(grad, pre, activation)
    assert dx.dtype == dtype and dx_t is None
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(dx.double(), dx64, rtol=tol, atol=tol)
    _check_dbias(dbias.cpu(), dx64.cpu())


def test_non_contiguous_inputs():
    grad_full, pre_full = _inputs((40,), 64, torch.bfloat16)
    grad, pre = grad_full.t(), pre_full.t()  # (64, 40), column-major
    assert not grad.is_contiguous()
    scale = torch.tensor(100.0, device=DEVICE)
    dx, dx_t, dbias = dact_dbias_quantize(grad, pre, "gelu_tanh", scale=scale, fp8_dtype=torch.float8_e5m2,
                                          transpose=True)
    dx64 = _reference(grad, pre, "gelu_tanh")
    assert_fp8_close(dx.cpu(), quantize_reference(dx64, 100.0, torch.float8_e5m2).cpu())
    assert torch.equal(dx_t.view(torch.uint8), dx.view(torch.uint8).t())
    _check_dbias(dbias.cpu(), dx64.cpu())


def test_empty_batch():
    grad = torch.randn(0, 32, device=DEVICE)
    amax = torch.full((1,), 3.0, device=DEVICE)
    dx, dx_t, dbias = dact_dbias_quantize(grad, grad.clone(), "gelu", scale=torch.ones((), device=DEVICE),
                                          fp8_dtype=torch.float8_e4m3fn, amax=amax, transpose=True)
    assert dx.shape == (0, 32) and dx_t.shape == (32, 0)
    assert torch.equal(dbias.cpu(), torch.zeros(32))
    assert amax.item() == 3.0
    dx, dx_t, dbias, amax, scale = dact_dbias_quantize_current_scaling(grad, grad.clone(), "gelu",
                                                                       fp8_dtype=torch.float8_e5m2, transpose=True)
    assert dx.shape == (0, 32) and dx_t.shape == (32, 0)
    assert torch.equal(dbias.cpu(), torch.zeros(32)) and amax.item() == 0 and scale.item() == 1


@pytest.mark.parametrize("leading", [(4,), (2, 4)])
def test_zero_width(leading):
    # N = 0: empty outputs, amax untouched and scale 1, as for M = 0 (no launch, no division by zero)
    one, amax = torch.ones((), device=DEVICE), torch.zeros(1, device=DEVICE)
    x = torch.randn(*leading, 0, device=DEVICE)
    m = x.shape[:-1].numel()
    dx, dx_t, dbias = dact_dbias_quantize(x, x.clone(), "relu", scale=one, fp8_dtype=torch.float8_e4m3fn, amax=amax,
                                          transpose=True)
    assert dx.shape == x.shape and dx_t.shape == (0, m) and dbias.shape == (0,)
    q, q_t = quantize(x, scale=one, fp8_dtype=torch.float8_e4m3fn, amax=amax, transpose=True)
    assert q.shape == x.shape and q_t.shape == (0, m)
    y, _, _ = bias_act(x, torch.randn(0, device=DEVICE), "relu")
    assert y.shape == x.shape
    q, q_t, current_amax, scale = quantize_current_scaling(x, fp8_dtype=torch.float8_e5m2, transpose=True)
    assert q.shape == x.shape and current_amax.item() == 0 and scale.item() == 1
    assert amax.item() == 0


def test_element_offsets_past_2_31():
    # Rows 2**30 elements apart (a column slice of a wide buffer): offsets of row 2 pass 2**31, which
    # 32-bit index arithmetic wraps. Only the 48 elements read are ever touched: the buffer stays virtual.
    buffer = torch.empty(2**31 + 16, dtype=torch.bfloat16, device=DEVICE)
    grad = buffer.as_strided((3, 16), (2**30, 1))
    grad.copy_(torch.arange(1, 4, dtype=torch.bfloat16, device=DEVICE)[:, None].expand(3, 16))
    pre = torch.ones(3, 16, device=DEVICE)
    amax = torch.zeros(1, device=DEVICE)
    dx, dx_t, dbias = dact_dbias_quantize(grad, pre, "relu", scale=torch.ones((), device=DEVICE),
                                          fp8_dtype=torch.float8_e4m3fn, amax=amax, transpose=True)
    assert dx.float()[:, 0].tolist() == [1, 2, 3] and torch.equal(dx_t.view(torch.uint8), dx.view(torch.uint8).t())
    assert dbias.tolist() == [6.0] * 16 and amax.item() == 3
    y, _, _ = bias_act(grad, None, None)
    assert y.float()[:, 0].tolist() == [1, 2, 3]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_current_scaling_of_a_tiny_amax_keeps_zeros_zero(fp8_dtype):
    # fp8_max / 1e-37 overflows float32: the scale must stay finite, or 0 * inf turns zeros into NaN
    x = torch.tensor([[0.0, 1e-37, -1e-38, 0.0]], device=DEVICE)
    q, _, amax, scale = quantize_current_scaling(x, fp8_dtype=fp8_dtype)
    assert scale.item() == torch.finfo(torch.float32).max
    expected = (x * torch.finfo(torch.float32).max).to(fp8_dtype)  # about 34 and -3.4 in fp32, then rounded
    assert q.view(torch.uint8).tolist() == expected.view(torch.uint8).tolist()
    assert q.float()[0, 0] == 0 and q.float()[0, 3] == 0


# amax values: ordinary, a power of two, a tiny normal (the quotient overflows), a subnormal, huge,
# zero (scale 1), +inf and NaN (non-finite amax: scale 1)
SCALE_AMAXES = [3.7, 0.7500001, 2.0**-20, 1e-37, 3e-42, 3e38, 0.0, math.inf, math.nan]


def _numpy_scale(amax: float, fp8_max: float, margin: int) -> float:
    """fp8_max / amax / 2**margin in float32, each division correctly rounded (numpy's), at most
    float32's largest; 1 for a zero or non-finite amax: an independent twin of the pass's scale."""
    import numpy as np

    a = np.float32(amax)
    if not (np.isfinite(a) and a > 0):
        return 1.0
    with np.errstate(over="ignore"):
        scale = np.float32(fp8_max) / a / np.float32(2.0 ** margin)
    return float(min(scale, np.finfo(np.float32).max))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("margin", [0, 2, -1])
@pytest.mark.parametrize("activation", [None, "relu"])  # the cast's row groups; the fused pass's
def test_current_scaling_derives_its_scale_in_the_second_pass_bit_for_bit(fp8_dtype, margin, activation):
    # The second pass computes the scale from the first pass's amax and stores it: the scale returned
    # must be float32's own quotient, and the codes the cast of the input with that scale.
    fmax = FP8_FORMATS[fp8_dtype].max
    for amax_value in SCALE_AMAXES:
        grad = torch.zeros(5, 40, device=DEVICE)
        grad[3, 17] = amax_value
        grad[1, 2] = -amax_value / 4 if math.isfinite(amax_value) else 1.0
        pre = torch.ones_like(grad)  # relu'(1) = 1: dx is grad
        if activation is None:
            q, q_t, amax, scale = quantize_current_scaling(grad, fp8_dtype=fp8_dtype, transpose=True, margin=margin)
        else:
            q, q_t, _, amax, scale = dact_dbias_quantize_current_scaling(grad, pre, activation, fp8_dtype=fp8_dtype,
                                                                         transpose=True, margin=margin)
        expected_amax = grad[3, 17].item() if not math.isnan(amax_value) else math.inf  # a NaN makes it +inf
        assert amax.item() == expected_amax, (amax_value, amax.item())
        expected = _numpy_scale(amax.item(), fmax, margin)
        assert scale.dtype == torch.float32 and scale.shape == ()
        assert scale.item() == expected, (amax_value, margin, scale.item(), expected)
        if math.isfinite(amax_value):
            want = quantize_reference(grad.cpu(), scale.cpu(), fp8_dtype).view(torch.uint8)
            assert torch.equal(q.cpu().view(torch.uint8), want), amax_value
        assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())


def test_scale_from_amax_reference_is_the_passes_formula():
    # The torch twin (the path without Triton) against the same float32 arithmetic.
    from lightning_fuse.kernels.fp8 import scale_from_amax_reference

    for fmax in (448.0, 57344.0):
        for margin in (0, 3, -2):
            for amax_value in SCALE_AMAXES:
                got = scale_from_amax_reference(torch.tensor([amax_value]), fmax, margin)
                assert got.shape == () and got.item() == _numpy_scale(amax_value, fmax, margin), (amax_value, margin)


def test_bias_act_amax_leaves_out_the_rows_past_the_end():
    # h + b = 0 everywhere: the rows the last tile pads with h = 0 hold act(b), which is not output
    h = torch.tensor([[3.0, -2.0]], device=DEVICE)
    b = torch.tensor([-3.0, 2.0], device=DEVICE)
    for activation in (None, "silu", "gelu_tanh"):
        amax = torch.zeros(1, device=DEVICE)
        y, _, _ = bias_act(h, b, activation, scale=torch.ones((), device=DEVICE), fp8_dtype=torch.float8_e4m3fn,
                           amax=amax)
        assert y.abs().max().item() == 0 and amax.item() == 0, activation


@pytest.mark.parametrize("activation", ["relu", "squared_relu"])
def test_a_nan_pre_activation_stays_nan_through_relu(activation):
    # As in PyTorch: relu(NaN) is NaN, and so is autograd's gradient of relu(x)**2 there. (Triton's
    # default max drops NaN on the GPU; the interpreter keeps it, so this guards the GPU.)
    h = torch.tensor([[float("nan"), 1.0, -1.0, 2.0]], device=DEVICE)
    y, _, _ = bias_act(h, None, activation)
    assert y[0, 0].isnan() and torch.equal(y[0, 1:].cpu(), activation_reference(h[0, 1:].cpu(), activation))
    amax = torch.zeros(1, device=DEVICE)
    dx, _, _ = dact_dbias_quantize(torch.ones_like(h), h, activation, amax=amax)
    x = h.detach().cpu().double().requires_grad_()
    (torch.relu(x) if activation == "relu" else torch.relu(x) ** 2).sum().backward()  # PyTorch's own gradient
    assert torch.allclose(dx.cpu().double(), x.grad, rtol=0, atol=0, equal_nan=True)
    assert math.isfinite(amax.item()) == (not x.grad.isnan().any())


def test_bias_act_refuses_a_pre_act_out_it_cannot_write_in_place():
    h = torch.randn(2, 3, 8, device=DEVICE)
    pre_act_out = torch.zeros(2, 4, 8, device=DEVICE)[:, :3, :]  # rows not evenly spaced: no (6, 8) view
    with pytest.raises(ValueError, match=r"`pre_act_out` must be viewable as \(6, 8\) rows"):
        bias_act(h, torch.randn(8, device=DEVICE), "relu", pre_act_out=pre_act_out)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_saturates_instead_of_overflowing(fp8_dtype):
    grad, pre = _inputs((20,), 48, torch.float32)
    grad = grad * 1e4
    dx, dx_t, _ = dact_dbias_quantize(grad, pre, "relu", scale=torch.tensor(1e4, device=DEVICE),
                                      fp8_dtype=fp8_dtype, transpose=True)
    values = dx.float()
    fmax = FP8_FORMATS[fp8_dtype].max
    assert torch.isfinite(values).all()
    assert values.abs().max().item() == fmax
    assert torch.equal(dx_t.view(torch.uint8), dx.view(torch.uint8).t())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_gives_non_finite_amax(bad):
    grad, pre = _inputs((16,), 32, torch.bfloat16)
    grad[3, 5] = bad
    amax = torch.zeros(1, device=DEVICE)
    dact_dbias_quantize(grad, pre, "gelu", scale=torch.ones((), device=DEVICE), fp8_dtype=torch.float8_e5m2,
                        amax=amax)
    assert not torch.isfinite(amax).all()


def test_dbias_is_bitwise_deterministic():
    grad, pre = _inputs((300,), 96, torch.bfloat16)
    first = dact_dbias_quantize(grad, pre, "gelu_tanh")[2]
    for _ in range(3):
        assert torch.equal(dact_dbias_quantize(grad, pre, "gelu_tanh")[2], first)


@pytest.mark.parametrize("dbias_dtype", [torch.float32, torch.bfloat16])
def test_bias_gradient_summed_in_the_pass_equals_the_separate_sum(monkeypatch, dbias_dtype):
    # The pass's last program per column strip sums the partials (an arrival counter per strip); where
    # no counter buffer is at hand (torch.compile, a first capture) a second launch does. Same bits.
    module = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")

    grad, pre = _inputs((5, 67), 200, torch.bfloat16, seed=4)
    in_pass = dact_dbias_quantize(grad, pre, "silu", dbias_dtype=dbias_dtype)[2]
    counters = [c for key, c in module._COUNTERS.items() if key[0] == grad.device]
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)  # every launch leaves them at zero
    monkeypatch.setattr(module, "_arrival_counters", lambda device, strips: None)
    separate = dact_dbias_quantize(grad, pre, "silu", dbias_dtype=dbias_dtype)[2]
    assert torch.equal(in_pass, separate)
    if dbias_dtype == torch.float32:
        _check_dbias(in_pass.cpu(), _reference(grad, pre, "silu").cpu())


@pytest.mark.parametrize("groups", [8, 9, 17])
def test_bias_gradient_sum_over_many_row_groups(monkeypatch, groups):
    # The partials are summed eight rows at a time (rows past the last add -0.0): across chunks and
    # with a partial last chunk, in the pass and in the second launch alike, the same bits.
    from lightning_fuse.kernels._launch import LaunchConfig

    module = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")
    grad, pre = _inputs((200,), 40, torch.bfloat16, seed=9)
    config = LaunchConfig(block_m=4, block_n=16, num_warps=1, groups=groups)
    assert config.row_groups(200)[1] == groups

    def bias_gradient():
        dbias = torch.empty(40, dtype=torch.float32, device=DEVICE)
        out = torch.empty(200, 40, dtype=torch.bfloat16, device=DEVICE)
        module._launch(grad, pre, activation_id("gelu_tanh"), None, 0, None, False, True, True, config, out, None,
                       dbias, False)
        return dbias

    in_pass = bias_gradient()
    monkeypatch.setattr(module, "_arrival_counters", lambda device, strips: None)
    assert torch.equal(bias_gradient(), in_pass)
    _check_dbias(in_pass.cpu(), _reference(grad, pre, "gelu_tanh").cpu())


@pytest.mark.parametrize("dbias_dtype", [torch.bfloat16, torch.float16])
def test_dbias_in_the_bias_dtype_is_the_fp32_sum_rounded_once(dbias_dtype):
    grad, pre = _inputs((70,), 50, torch.bfloat16, seed=9)
    scale = torch.ones((), device=DEVICE)
    fp32 = dact_dbias_quantize(grad, pre, "gelu", scale=scale, fp8_dtype=torch.float8_e5m2)[2]
    rounded = dact_dbias_quantize(grad, pre, "gelu", scale=scale, fp8_dtype=torch.float8_e5m2, dbias_dtype=dbias_dtype)[2]
    assert rounded.dtype == dbias_dtype and torch.equal(rounded, fp32.to(dbias_dtype))
    plain = dbias_quantize(grad, dbias_dtype=dbias_dtype)[2]
    assert plain.dtype == dbias_dtype
    current = dact_dbias_quantize_current_scaling(grad, pre, "gelu", fp8_dtype=torch.float8_e5m2,
                                                  dbias_dtype=dbias_dtype)[2]
    assert torch.equal(current, fp32.to(dbias_dtype))
    with pytest.raises(ValueError, match=r"`dbias_dtype` must be one of .* got torch.int32"):
        dbias_quantize(grad, dbias_dtype=torch.int32)


def test_amax_is_max_reduced_in_place():
    grad, pre = _inputs((24,), 32, torch.float32)
    current = _reference(grad, pre, "silu").abs().max().item()
    kwargs = dict(scale=torch.ones((), device=DEVICE), fp8_dtype=torch.float8_e5m2)
    big = torch.full((1,), current * 10, device=DEVICE)
    big_ptr = big.data_ptr()
    dact_dbias_quantize(grad, pre, "silu", amax=big, **kwargs)
    assert big.data_ptr() == big_ptr and big.item() == pytest.approx(current * 10)
    small = torch.full((1,), current / 10, device=DEVICE)
    dact_dbias_quantize(grad, pre, "silu", amax=small, **kwargs)
    assert small.item() == pytest.approx(current, rel=1e-6)
    history = torch.zeros(4, 3, device=DEVICE)  # a one-element view into a bigger tensor, as the recipes use
    dact_dbias_quantize(grad, pre, "silu", amax=history[0, 1:2], **kwargs)
    assert history[0, 1].item() == pytest.approx(current, rel=1e-6)
    assert history.count_nonzero().item() == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_dbias_quantize(dtype, fp8_dtype):
    grad, _ = _inputs((3, 11), 80, dtype)
    scale = torch.tensor(7.0, device=DEVICE)
    amax = torch.zeros(1, device=DEVICE)
    dq, dq_t, dbias = dbias_quantize(grad, scale=scale, fp8_dtype=fp8_dtype, amax=amax, transpose=True)
    g64 = grad.double()
    assert_fp8_close(dq.cpu(), quantize_reference(g64, 7.0, fp8_dtype).cpu(), min_exact=1.0)
    assert torch.equal(dq_t.view(torch.uint8), dq.reshape(33, 80).view(torch.uint8).t())
    _check_dbias(dbias.cpu(), g64.cpu())
    assert amax.item() == g64.abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_exact(dtype, fp8_dtype):
    # Values spread over the whole FP8 range, subnormals and ties included.
    x = (torch.randn(50, 64) * torch.exp2(torch.randint(-20, 16, (50, 64)).float())).to(DEVICE, dtype)
    scale = torch.tensor(0.75, device=DEVICE)
    q, q_t = quantize(x, scale=scale, fp8_dtype=fp8_dtype, transpose=True)
    expected = quantize_reference(x.double(), 0.75, fp8_dtype)
    assert torch.equal(q.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu())
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())


@pytest.mark.parametrize("m", [512, 509])
def test_cast_and_activation_with_a_few_row_tiles_per_program(m):
    # Shapes big enough for the many-program grid of the two passes without a bias gradient
    # (LaunchRule.tiles_per_program, two row tiles for the cast and four for the activation; on the
    # interpreter 4 waves are 16 programs): every output of every program, with M a multiple of 4
    # (the transposed copy packed in words) and not.
    from lightning_fuse.kernels import _launch

    n = 128
    for name in ("quantize", "bias_act"):
        cfg = _launch.launch_config(name, m, n, torch.device(DEVICE))
        if DEVICE == "cpu":
            assert cfg.row_groups(m)[0] == _launch.LAUNCH_RULES[name].tiles_per_program * cfg.block_m
    x = (torch.randn(m, n) * torch.exp2(torch.randint(-12, 8, (m, n)).float())).to(DEVICE, torch.bfloat16)
    amax = torch.zeros(1, device=DEVICE)
    q, q_t = quantize(x, scale=torch.tensor(2.0, device=DEVICE), fp8_dtype=torch.float8_e4m3fn, amax=amax,
                      transpose=True)
    expected = quantize_reference(x.double(), 2.0, torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8).cpu(), expected.view(torch.uint8).cpu())
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())
    assert amax.item() == x.float().abs().max().item()
    amax.zero_()
    y, q, q_t = bias_act(x, None, "gelu_tanh", scale=torch.tensor(4.0, device=DEVICE),
                         fp8_dtype=torch.float8_e4m3fn, amax=amax, transpose=True)
    torch.testing.assert_close(y.double(), activation_reference(x.double(), "gelu_tanh"), rtol=1.6e-2, atol=1.6e-2)
    assert torch.equal(q.view(torch.uint8).cpu(),
                       quantize_reference(y.double(), 4.0, torch.float8_e4m3fn).view(torch.uint8).cpu())
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())
    assert amax.item() == y.float().abs().max().item()


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_current_scaling_uses_the_tensors_own_amax(fp8_dtype):
    grad, pre = _inputs((33,), 48, torch.bfloat16)
    dx, dx_t, dbias, amax, scale = dact_dbias_quantize_current_scaling(grad, pre, "gelu", fp8_dtype=fp8_dtype,
                                                                       transpose=True, margin=1)
    dx64 = _reference(grad, pre, "gelu")
    expected_amax = dx64.abs().max()
    assert amax.item() == pytest.approx(expected_amax.item(), rel=1e-6)
    assert scale.item() == pytest.approx(FP8_FORMATS[fp8_dtype].max / expected_amax.item() / 2, rel=1e-6)
    assert_fp8_close(dx.cpu(), quantize_reference(dx64.cpu(), scale.cpu().double(), fp8_dtype))
    assert torch.equal(dx_t.view(torch.uint8), dx.view(torch.uint8).t())
    _check_dbias(dbias.cpu(), dx64.cpu())
    x = torch.randn(21, 32, device=DEVICE)
    q, q_t, x_amax, x_scale = quantize_current_scaling(x, fp8_dtype=fp8_dtype, transpose=True)
    assert x_amax.item() == x.abs().max().item()
    assert torch.equal(q.view(torch.uint8).cpu(), quantize_reference(x, x_scale, fp8_dtype).view(torch.uint8).cpu())
    assert q.float().abs().max().item() == FP8_FORMATS[fp8_dtype].max


@pytest.mark.parametrize(("activation", "compute_dbias", "expected"), [
    ("gelu", True, ["dact_dbias_quantize", "dact_dbias_quantize"]),
    (None, True, ["dbias_quantize", "quantize"]),
    (None, False, ["quantize", "quantize"]),
])
def test_current_scaling_passes_take_the_launch_rules_of_what_they_compute(monkeypatch, activation, compute_dbias,
                                                                          expected):
    # Pass 2 sums no bias gradient: without an activation it is the cast, launched as `quantize` is.
    module = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")
    names, real = [], module.launch_config

    def recording(name, m, n, device, dtype):
        names.append(name)
        assert dtype == grad.dtype  # the rules may depend on the inputs' dtype (the fused pass's queued form)
        return real(name, m, n, device, dtype)

    monkeypatch.setattr(module, "launch_config", recording)
    grad, pre = _inputs((40,), 64, torch.bfloat16)
    dx, dx_t, dbias, amax, scale = dact_dbias_quantize_current_scaling(
        grad, pre if activation else None, activation, fp8_dtype=torch.float8_e5m2, transpose=True,
        compute_dbias=compute_dbias)
    assert names == expected
    dx64 = _reference(grad, pre, activation) if activation else grad.double()
    assert_fp8_close(dx.cpu(), quantize_reference(dx64.cpu(), scale.cpu().double(), torch.float8_e5m2))
    assert torch.equal(dx_t.view(torch.uint8), dx.view(torch.uint8).t())
    if compute_dbias:
        _check_dbias(dbias.cpu(), dx64.cpu())
    else:
        assert dbias is None


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_act(activation, dtype):
    h = torch.randn(2, 13, 48, device=DEVICE, dtype=dtype)
    bias = torch.randn(48, device=DEVICE, dtype=torch.float32)
    amax = torch.zeros(1, device=DEVICE)
    y, q, q_t = bias_act(h, bias, activation, scale=torch.tensor(4.0, device=DEVICE),
                         fp8_dtype=torch.float8_e4m3fn, amax=amax, transpose=True)
    expected = activation_reference(h.double() + bias.double(), activation)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 1e-3}[dtype]
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
    # The FP8 copy quantizes exactly the returned y.
    assert torch.equal(q.view(torch.uint8).cpu(),
                       quantize_reference(y.double(), 4.0, torch.float8_e4m3fn).view(torch.uint8).cpu())
    assert torch.equal(q_t.view(torch.uint8), q.reshape(26, 48).view(torch.uint8).t())
    assert amax.item() == y.float().abs().max().item()
    y2, q2, _ = bias_act(h, None, activation)
    torch.testing.assert_close(y2.double(), activation_reference(h.double(), activation), rtol=tol, atol=tol)
    assert q2 is None


# -- bad input -------------------------------------------------------------------------------


def _good():
    grad = torch.randn(8, 16, device=DEVICE)
    return grad, torch.randn(8, 16, device=DEVICE)


def test_rejects_integer_tensors():
    grad, pre = _good()
    with pytest.raises(TypeError, match=r"`grad` must have dtype .*got torch.int32"):
        dact_dbias_quantize(grad.to(torch.int32), pre, "gelu")
    with pytest.raises(TypeError, match="`pre_act` must be a torch.Tensor"):
        dact_dbias_quantize(grad, [1.0], "gelu")


def test_rejects_mismatched_shapes():
    grad, pre = _good()
    with pytest.raises(ValueError, match=r"`pre_act` must have the shape of `grad` \(8, 16\); got \(8, 15\)"):
        dact_dbias_quantize(grad, pre[:, :15], "gelu")


def test_rejects_missing_scale_and_bad_fp8_dtype():
    grad, pre = _good()
    with pytest.raises(TypeError, match="`scale` must be a float32 tensor.*got NoneType"):
        dact_dbias_quantize(grad, pre, "gelu", fp8_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"`fp8_dtype` must be one of .*float8_e4m3fn.*got torch.float16"):
        dact_dbias_quantize(grad, pre, "gelu", scale=torch.ones(()), fp8_dtype=torch.float16)
    with pytest.raises(ValueError, match="`scale` must be a float32 tensor with one element; got dtype torch.float64"):
        dact_dbias_quantize(grad, pre, "gelu", scale=torch.ones((), dtype=torch.float64, device=DEVICE),
                            fp8_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="`transpose=True` needs `fp8_dtype`"):
        dact_dbias_quantize(grad, pre, "gelu", transpose=True)
    for bad in ([torch.float8_e5m2], "float8_e5m2"):  # a list is unhashable: still the message, not a TypeError
        with pytest.raises(ValueError, match=r"`fp8_dtype` must be one of .*; got "):
            dact_dbias_quantize(grad, pre, "gelu", scale=torch.ones((), device=DEVICE), fp8_dtype=bad)
        with pytest.raises(ValueError, match=r"`fp8_dtype` must be one of .*; got "):
            quantize(grad, scale=torch.ones((), device=DEVICE), fp8_dtype=bad)


def test_rejects_unknown_activation_and_bad_amax():
    grad, pre = _good()
    with pytest.raises(ValueError, match=r"`activation` must be one of gelu, gelu_tanh.*got 'gelu_fast'"):
        dact_dbias_quantize(grad, pre, "gelu_fast")
    with pytest.raises(ValueError, match="`amax` must be a float32 tensor with one element"):
        dact_dbias_quantize(grad, pre, "gelu", amax=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match=r"`bias` must have shape \(16,\)"):
        bias_act(grad, torch.zeros(15, device=DEVICE), "gelu")
    with pytest.raises(ValueError, match="`fp8_dtype` is required"):
        quantize(grad, scale=torch.ones((), device=DEVICE), fp8_dtype=None)


def test_eager_calls_launch_the_kernels_directly(monkeypatch):
    """Eager launches must not go through ``wrap_triton``'s higher-order-op dispatch, which cost
    0.6-2.5 ms of CPU per launch on the H200 host (BENCHMARKS.md, host time per call)."""
    import lightning_fuse.kernels._launch as launch

    wrapped = []
    real = launch.wrap_triton
    monkeypatch.setattr(launch, "wrap_triton", lambda kernel: wrapped.append(kernel) or real(kernel))
    grad, pre = _inputs((33,), 40, torch.bfloat16, seed=3)
    scale, amax = torch.ones(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    dact_dbias_quantize(grad, pre, "gelu", scale=scale, fp8_dtype=torch.float8_e5m2, amax=amax, transpose=True)
    quantize(grad, scale=scale, fp8_dtype=torch.float8_e4m3fn, transpose=True)
    bias_act(pre, torch.zeros(40, device=DEVICE, dtype=torch.bfloat16), "gelu_tanh")
    dact_dbias_quantize_current_scaling(grad, pre, "silu", fp8_dtype=torch.float8_e5m2, transpose=True)
    assert wrapped == []
    assert launch.launcher(object, traced=False) is object


@pytest.mark.parametrize("config", [
    dict(block_m=16, block_n=32, num_warps=1, groups=1),
    dict(block_m=32, block_n=16, num_warps=2, groups=3, loop_stages=2),
    dict(block_m=16, block_n=64, num_warps=4, groups=5, loop_stages=3),
    dict(block_m=4, block_n=16, num_warps=1, groups=7),
    dict(block_m=16, block_n=32, num_warps=1, groups=2, max_registers=64),
    dict(block_m=16, block_n=32, num_warps=1, groups=3, cyclic_rows=True),
    dict(block_m=8, block_n=16, num_warps=1, groups=4, loop_stages=2, cyclic_rows=True),
    dict(block_m=16, block_n=32, num_warps=1, groups=1, prefetch=True),
    dict(block_m=16, block_n=32, num_warps=1, groups=3, prefetch=True),
    dict(block_m=4, block_n=16, num_warps=1, groups=7, prefetch=True),
    dict(block_m=32, block_n=16, num_warps=2, groups=3, loop_stages=2, prefetch=True),
    dict(block_m=8, block_n=16, num_warps=1, groups=4, cyclic_rows=True, prefetch=True),
])
@pytest.mark.parametrize("activation", ["gelu_tanh", None])
def test_every_launch_configuration_gives_the_same_bits(config, activation):
    # The benchmark sweeps these knobs; each must only change speed, never a single output bit. The
    # library's own launches prefetch in both backward passes; these cover both loop forms, with
    # row groups (83 rows: a partial last tile) that end inside and at the end of the rows.
    from lightning_fuse.kernels._launch import LaunchConfig
    from lightning_fuse.kernels.dact_dbias_quantize import _launch

    grad, pre = _inputs((83,), 72, torch.bfloat16)
    scale, fp8_dtype = torch.tensor(64.0, device=DEVICE), torch.float8_e5m2
    if activation is None:
        expected = dbias_quantize(grad, scale=scale, fp8_dtype=fp8_dtype, transpose=True)
        dx64 = grad.double()
    else:
        expected = dact_dbias_quantize(grad, pre, activation, scale=scale, fp8_dtype=fp8_dtype, transpose=True)
        dx64 = _reference(grad, pre, activation)
    out = torch.empty(83, 72, dtype=fp8_dtype, device=DEVICE)
    out_t = torch.empty(72, 83, dtype=fp8_dtype, device=DEVICE)
    dbias = torch.empty(72, dtype=torch.float32, device=DEVICE)
    amax = torch.zeros(1, device=DEVICE)
    _launch(grad, pre if activation else None, activation_id(activation) if activation else 0, scale, 2, amax, True,
            True, True, LaunchConfig(**config), out, out_t, dbias, False)
    assert torch.equal(out.view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(out_t.view(torch.uint8), expected[1].view(torch.uint8))
    _check_dbias(dbias.cpu(), dx64.cpu())
    assert amax.item() == pytest.approx(dx64.abs().max().item(), rel=1e-5)


@pytest.mark.parametrize("config", [
    dict(block_m=16, block_n=32, num_warps=1, groups=1),
    dict(block_m=16, block_n=32, num_warps=1, groups=3),
    dict(block_m=8, block_n=16, num_warps=2, groups=5, cyclic_rows=True),
    dict(block_m=16, block_n=32, num_warps=1, groups=2, loop_stages=2, cyclic_rows=True),
    dict(block_m=16, block_n=32, num_warps=1, groups=3, prefetch=True),
    dict(block_m=8, block_n=16, num_warps=2, groups=5, cyclic_rows=True, prefetch=True),
])
def test_every_bias_act_launch_configuration_gives_the_same_bits(config):
    from lightning_fuse.kernels._launch import LaunchConfig

    bias_act_module = importlib.import_module("lightning_fuse.kernels.bias_act")
    h = _inputs((83,), 72, torch.bfloat16, seed=5)[1]
    bias = torch.randn(72, device=DEVICE, dtype=torch.bfloat16)
    scale = torch.tensor(8.0, device=DEVICE)
    expected = bias_act(h, bias, "gelu_tanh", scale=scale, fp8_dtype=torch.float8_e4m3fn, transpose=True)
    y = torch.empty_like(h)
    q = torch.empty(83, 72, dtype=torch.float8_e4m3fn, device=DEVICE)
    q_t = torch.empty(72, 83, dtype=torch.float8_e4m3fn, device=DEVICE)
    amax = torch.zeros(1, device=DEVICE)
    bias_act_module._launch(h, bias, activation_id("gelu_tanh"), scale, 1, amax, True, None, y, q, q_t,
                            LaunchConfig(**config), False)
    assert torch.equal(y, expected[0])
    assert torch.equal(q.view(torch.uint8), expected[1].view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), expected[2].view(torch.uint8))
    assert amax.item() == expected[0].float().abs().max().item()


@pytest.mark.parametrize("card", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
@pytest.mark.parametrize("m,n", [(16384, 6400), (32768, 8192), (8192, 3072), (16384, 16384), (100, 64), (16384, 100000)])
def test_launch_grid_fills_the_gpu_and_whole_waves_never_overflow(monkeypatch, m, n, card):
    # The CUDA branch of the grid choice, with the device's answer faked: 132 multiprocessors.
    from lightning_fuse.kernels import _launch

    monkeypatch.setattr(_launch, "_device_info", lambda device: ((9, 0), 132, card))
    _launch._CONFIGS.clear()
    cuda = torch.device("cuda", 0)
    try:
        for name, rule in _launch.LAUNCH_RULES.items():
            cfg = _launch.launch_config(name, m, n, cuda)
            if rule.chunk_tiles:
                chunks = -(-n // cfg.block_n) * -(-m // (cfg.block_m * rule.chunk_tiles))
                if cfg.chunk_tiles:  # the queued form: one program per slot, enough chunks for each
                    assert cfg.groups == 132 * rule.programs_per_sm and cfg.chunk_tiles == rule.chunk_tiles
                    assert chunks >= rule.min_chunks_per_slot * cfg.groups
                    continue
                assert (chunks < rule.min_chunks_per_slot * 132 * rule.programs_per_sm
                        or torch.bfloat16 not in rule.queued_dtypes or "H100" not in card)
                rule = rule.alternative
            if rule.alternative is not None and cfg.loop_stages == rule.alternative.loop_stages:
                rule = rule.alternative
            rows, groups = cfg.row_groups(m)
            strips = -(-n // cfg.block_n)
            slots = 132 * rule.programs_per_sm
            assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.loop_stages) == (
                rule.block_m, rule.block_n, rule.num_warps, rule.loop_stages)
            assert cfg.block_m % 4 == 0  # four interleaved row sets per tile
            assert rows % cfg.block_m == 0 and (groups - 1) * rows < m <= groups * rows  # no empty group
            programs = groups * strips
            if rule.tiles_per_program and programs >= rule.min_waves * slots:
                # Enough tiles for many waves: tiles_per_program row tiles per program, no whole waves.
                assert rows == rule.tiles_per_program * cfg.block_m
            elif groups * cfg.block_m < m and groups > 1:  # rows left to spread over more programs
                if rule.tiles_per_program:  # too few tiles for its many-program grid
                    assert -(-m // (rule.tiles_per_program * cfg.block_m)) * strips < rule.min_waves * slots
                if rule.whole_waves:
                    # The fewest whole waves whose programs fill 85% of their slots (up to 4 waves)
                    # and walk at most max_rows_per_program rows.
                    waves = -(-groups * strips // slots)
                    assert groups * strips / (waves * slots) >= 0.8  # 0.85 before the groups are evened out
                    if rule.max_rows_per_program and waves < _launch._MAX_WAVES:
                        assert rows <= rule.max_rows_per_program
                    row_tiles = -(-m // cfg.block_m)
                    for fewer in range(1, waves):
                        fewer_groups = fewer * slots // strips
                        fewer_rows = -(-row_tiles // max(1, fewer_groups)) * cfg.block_m
                        assert (fewer_groups * strips < rule.min_wave_fill * fewer * slots
                                or fewer_rows > (rule.max_rows_per_program or m))
                else:
                    assert groups * strips >= slots
    finally:
        _launch._CONFIGS.clear()


@pytest.mark.parametrize("m,n,many", [(16384, 6400, True), (32768, 8192, True), (16384, 16384, True),
                                      (8192, 3072, True), (2048, 3072, False), (100, 64, False)])
def test_passes_without_a_bias_gradient_give_each_program_a_few_tiles_where_that_makes_four_waves(
        monkeypatch, m, n, many):
    # 132 multiprocessors: the cast (4 programs per SM) in programs of two 64-row tiles makes 64 x 48
    # programs at 8192x3072, 5.8 waves; at 2048x3072 16 x 48, under 2, and keeps whole waves. The
    # forward activation (5 per SM) in programs of four 32-row tiles: 4.7 and 1.2 waves.
    from lightning_fuse.kernels import _launch

    monkeypatch.setattr(_launch, "_device_info", lambda device: ((9, 0), 132, "NVIDIA H200"))
    _launch._CONFIGS.clear()
    try:
        for name, tiles, per_sm in (("quantize", 2, 4), ("bias_act", 4, 5)):
            cfg = _launch.launch_config(name, m, n, torch.device("cuda", 0))
            rows, groups = cfg.row_groups(m)
            assert (rows == tiles * cfg.block_m and groups == -(-m // rows)) == many, name
            assert cfg.prefetch
            if many:
                assert groups * -(-n // cfg.block_n) >= 4 * 132 * per_sm
        for name in ("dact_dbias_quantize", "dbias_quantize"):  # whole waves or one program per slot, always
            backward = _launch.launch_config(name, m, n, torch.device("cuda", 0))
            if backward.chunk_tiles:
                assert backward.groups == 132 * _launch.LAUNCH_RULES[name].programs_per_sm
            else:
                assert backward.row_groups(m)[1] * -(-n // backward.block_n) <= 4 * 132 * 4
    finally:
        _launch._CONFIGS.clear()


@pytest.mark.parametrize("name,m,n,groups", [
    ("dbias_quantize", 32768, 8192, 4), ("dbias_quantize", 16384, 16384, 2), ("dbias_quantize", 16384, 6400, 5),
    ("dbias_quantize", 8192, 3072, 5), ("dact_dbias_quantize", 32768, 8192, 6),
    ("dact_dbias_quantize", 16384, 16384, 3), ("dact_dbias_quantize", 8192, 3072, 8)])
def test_backward_passes_add_a_wave_where_one_wave_of_programs_would_walk_over_8192_rows(
        monkeypatch, name, m, n, groups):
    # 132 multiprocessors. The bias gradient (128 x 64 tiles, 2 per SM) at 32768x8192 fills one wave
    # with 2 row groups x 128 strips, each walking 16384 rows: it takes two waves of 4 x 128 instead;
    # at 16384x16384, 2 x 256 instead of 1 x 256. The fused pass (3 per SM) at 32768x8192: 6 x 128
    # programs of 5504 rows instead of 3 x 128 of 10944. Where one wave's programs walk fewer rows,
    # it stays one wave.
    from lightning_fuse.kernels import _launch

    monkeypatch.setattr(_launch, "_device_info", lambda device: ((9, 0), 132, "NVIDIA H200"))
    _launch._CONFIGS.clear()
    rule = _launch.row_groups_rule(_launch.LAUNCH_RULES[name])  # the fused pass's queued form aside
    try:
        cfg = _launch._pick_config(m, n, torch.device("cuda", 0), rule)
        rows, got = cfg.row_groups(m)
        assert got == groups, (name, m, n, cfg)
        assert rows <= rule.max_rows_per_program
    finally:
        _launch._CONFIGS.clear()


@pytest.mark.parametrize("m,n,cyclic", [(8192, 3072, True), (16384, 3072, True), (4096, 4096, True),
                                        (8192, 1024, False), (16384, 6400, False), (32768, 8192, False),
                                        (100, 64, False)])
def test_backward_passes_deal_row_tiles_in_turn_where_one_wave_holds_at_most_8_row_groups(monkeypatch, m, n, cyclic):
    # 132 multiprocessors, the bias gradient's tiles (128 x 64, 2 per SM: 264 slots). One wave of 5
    # row groups x 48 strips at 8192x3072 and 16384x3072, 4 x 64 at 4096x4096: tiles dealt in turn.
    # One wave of 16 x 16 at 8192x1024 (more than 8 groups), two waves of 5 x 100 at 16384x6400, two of
    # 4 x 128 at 32768x8192, one row group at 100x64: contiguous ranges. Interpreter launches never
    # deal in turn (their grids are the tests' own).
    from lightning_fuse.kernels import _launch

    monkeypatch.setattr(_launch, "_device_info", lambda device: ((9, 0), 132, "NVIDIA H200"))
    rule = _launch.LAUNCH_RULES["dbias_quantize"]
    assert rule.cyclic_max_groups == 8
    cfg = _launch._pick_config(m, n, torch.device("cuda", 0), rule)
    strips = -(-n // cfg.block_n)
    groups = cfg.row_groups(m)[1]
    assert cfg.cyclic_rows == cyclic, cfg
    assert cyclic == (1 < groups <= 8 and groups * strips <= 132 * rule.programs_per_sm)
    plain = _launch._pick_config(m, n, torch.device("cuda", 0), dataclasses.replace(rule, cyclic_max_groups=0))
    assert not plain.cyclic_rows and dataclasses.replace(plain, cyclic_rows=cfg.cyclic_rows) == cfg
    assert not _launch._pick_config(m, n, torch.device("cpu"), rule).cyclic_rows
    # The fused pass's row groups: 8 x 48 programs on 396 slots at 8192x3072.
    fused = _launch._pick_config(8192, 3072, torch.device("cuda", 0), _launch.LAUNCH_RULES["dact_dbias_quantize"])
    assert fused.cyclic_rows and fused.row_groups(8192)[1] == 8 and not fused.chunk_tiles


@pytest.mark.parametrize("m,n,groups", [(16384, 6400, 5), (32768, 8192, 4), (16384, 16384, 2), (8192, 3072, 5),
                                        (8192, 1024, 16), (100, 64, 1)])
def test_a_rule_naming_cyclic_devices_deals_row_tiles_in_turn_over_several_waves_on_those_gpus_alone(
        monkeypatch, m, n, groups):
    # The bias gradient's tiles on 132 multiprocessors (264 slots): two waves of 5 x 100 programs at
    # 16384x6400, 4 x 128 at 32768x8192, 2 x 256 at 16384x16384; one wave of 5 x 48 at 8192x3072 and of
    # 16 x 16 at 8192x1024. With cyclic_devices naming the card, every grid of 2 to 8 row groups deals
    # its tiles in turn, however many waves; on other cards (and with none named) only one-wave grids do.
    # The grid itself never changes.
    from lightning_fuse.kernels import _launch

    card = {}
    monkeypatch.setattr(_launch, "_device_info", lambda device: ((9, 0), 132, card["name"]))
    cuda = torch.device("cuda", 0)
    base = dataclasses.replace(_launch.LAUNCH_RULES["dbias_quantize"], cyclic_devices=())
    named = dataclasses.replace(base, cyclic_devices=("H200",))
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        card["name"] = name
        plain = _launch._pick_config(m, n, cuda, base)
        cfg = _launch._pick_config(m, n, cuda, named)
        assert cfg.row_groups(m)[1] == plain.row_groups(m)[1] == groups
        assert dataclasses.replace(cfg, cyclic_rows=plain.cyclic_rows) == plain
        one_wave = groups * -(-n // cfg.block_n) <= 132 * base.programs_per_sm
        assert plain.cyclic_rows == (1 < groups <= 8 and one_wave), (name, plain)
        assert cfg.cyclic_rows == (1 < groups <= 8 and (one_wave or name == "NVIDIA H200")), (name, cfg)
    assert not _launch._pick_config(m, n, torch.device("cpu"), named).cyclic_rows


@pytest.mark.parametrize("m,n,two_deep", [(16384, 6400, True), (8192, 6400, True), (8192, 3072, False),
                                          (32768, 8192, False), (16384, 16384, False), (100, 64, False)])
def test_fused_pass_takes_its_two_deep_form_where_the_prefetching_one_leaves_slots_idle(monkeypatch, m, n, two_deep):
    # 132 multiprocessors: the prefetching form (3 per multiprocessor) fills 88% of two waves at
    # N = 6400 (7 row groups x 100 strips on 792 slots), the 2-deep form (4 per multiprocessor) 95% of
    # one (5 x 100 on 528); at the other sizes the prefetching form fills 97% and is kept.
    from lightning_fuse.kernels import _launch

    monkeypatch.setattr(_launch, "_device_info", lambda device: ((9, 0), 132, "NVIDIA H200"))
    _launch._CONFIGS.clear()
    try:
        rule = _launch.row_groups_rule(_launch.LAUNCH_RULES["dact_dbias_quantize"])
        cfg = _launch._pick_config(m, n, torch.device("cuda", 0), rule)
        assert (cfg.loop_stages, cfg.prefetch) == ((2, False) if two_deep else (0, True))
        _, fill = _launch._config_and_fill(m, n, torch.device("cuda", 0), rule)
        _, other_fill = _launch._config_and_fill(m, n, torch.device("cuda", 0), rule.alternative)
        assert two_deep == (fill < rule.keep_fill and other_fill > fill)
    finally:
        _launch._CONFIGS.clear()


@pytest.mark.parametrize("m,n,queued", [(16384, 6400, True), (32768, 8192, True), (16384, 16384, True),
                                        (8192, 6400, True), (8192, 3072, False), (2048, 768, False)])
def test_the_fused_pass_takes_its_queued_form_on_h100s_where_each_slot_gets_eight_chunks(monkeypatch, m, n, queued):
    # 132 multiprocessors, 3 programs each: 396 slots. Chunks of four 64-row tiles of one 64-column
    # strip: 100 x 64 = 6400 at 16384x6400 (16 per slot), 100 x 32 = 3200 at 8192x6400 (8.1), 48 x 32 =
    # 1536 at 8192x3072 (3.9: the row groups instead). The shipped rule takes the form for bf16 and
    # fp16 inputs on H100s (faster there) and nowhere else: not on an H200 (slower there), not in the
    # interpreter, whose launches follow the H200's; a rule that names no device takes it everywhere.
    from lightning_fuse.kernels import _launch

    card = {}
    monkeypatch.setattr(_launch, "_device_info", lambda device: ((9, 0), 132, card["name"]))
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    shipped = _launch.LAUNCH_RULES["dact_dbias_quantize"]
    assert shipped.queued_devices == ("H100",)
    everywhere = dataclasses.replace(shipped, queued_devices=())
    for name, takes in (("NVIDIA H100 80GB HBM3", True), ("NVIDIA H100 PCIe", True), ("NVIDIA H200", False),
                        ("NVIDIA GH200 480GB", False), ("NVIDIA A100-SXM4-80GB", False)):
        card["name"] = name
        for dtype in (torch.bfloat16, torch.float16):
            cfg = _launch._pick_config(m, n, cuda, shipped, dtype)
            assert (cfg.chunk_tiles == 4 and cfg.groups == 396) == (queued and takes), (name, cfg)
            assert cfg.chunk_tiles == 0 or cfg.prefetch
            assert _launch._pick_config(m, n, cuda, everywhere, dtype).chunk_tiles == (4 if queued else 0)
        assert _launch._pick_config(m, n, cuda, shipped, torch.float32).chunk_tiles == 0
        assert _launch._pick_config(m, n, cuda, everywhere, torch.float32).chunk_tiles == 0
        assert _launch._pick_config(m, n, cuda, _launch.LAUNCH_RULES["dbias_quantize"], torch.bfloat16).chunk_tiles == 0
    for dtype in (torch.bfloat16, torch.float16):
        assert _launch._pick_config(m, n, cpu, shipped, dtype).chunk_tiles == 0
        assert _launch._pick_config(m, n, cpu, everywhere, dtype).chunk_tiles == 2  # any number there


@pytest.mark.parametrize("activation", ["gelu_tanh", None])
@pytest.mark.parametrize("m,n", [(130, 40), (64, 96), (1, 7)])
def test_the_queued_form_matches_the_row_groups_with_and_without_its_queue(monkeypatch, activation, m, n):
    # The queued form in chunks of two row tiles, with its queue and in a fixed stride (no queue: the
    # traced launch), at program counts from one to more than the chunks: the row groups' FP8 bytes
    # and amax, the float64 bias gradient within 1e-5, and the same bias-gradient bits with or without
    # the queue. Every queue and arrival counter is empty again afterwards.
    from lightning_fuse.kernels._launch import LaunchConfig

    module = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")  # not the function of that name
    block = (16, 32, 1) if DEVICE == "cpu" else (64, 64, 4)
    grad, pre = _inputs((m,), n, torch.bfloat16, seed=m + n)
    act = activation_id(activation) if activation else 0
    scale = torch.tensor(64.0, device=DEVICE)
    dx64 = grad.double() * (activation_derivative_reference(pre.double(), activation) if activation else 1)
    results = []
    for cfg, queue in [(LaunchConfig(*block, 3, prefetch=True), True)] + [
            (LaunchConfig(*block, programs, prefetch=True, chunk_tiles=2), queue)
            for programs in (1, 3, 100) for queue in (True, False)]:
        out = torch.full((m, n), 255, dtype=torch.uint8, device=DEVICE)
        out_t = torch.full((n, m), 255, dtype=torch.uint8, device=DEVICE)
        dbias = torch.full((n,), float("nan"), device=DEVICE)
        amax = torch.zeros(1, device=DEVICE)
        with monkeypatch.context() as patch:
            if not queue:
                patch.setattr(module, "_arrival_counters", lambda device, strips: None)
            module._launch(grad, pre if act else None, act, scale, 2, amax, True, True, True, cfg, out, out_t, dbias,
                           False)
        results.append((out, out_t, dbias, amax))
        assert torch.equal(out, results[0][0]) and torch.equal(out_t, out.t()), cfg
        assert amax.item() == results[0][3].item()
        assert (dbias.double() - dx64.sum(0)).abs().max().item() <= 1e-5 * max(1.0, dx64.abs().sum(0).max().item())
    assert all(torch.equal(dbias, results[1][2]) for _, _, dbias, _ in results[1:])
    assert all(int(c.abs().sum()) == 0 for c in module._COUNTERS.values())


@pytest.mark.parametrize("nan_bits", [0x7FFFFFFF, -1, 0x7FC00000], ids=["cuda-canonical", "all-ones", "quiet"])
def test_a_nan_bias_gradient_stays_nan_in_bfloat16(nan_bits):
    g = torch.ones(4, 8, device=DEVICE)
    g.view(torch.int32)[1, 2] = nan_bits
    for dbias in (dbias_quantize(g, dbias_dtype=torch.bfloat16)[2],
                  dact_dbias_quantize(g, torch.ones(4, 8, device=DEVICE), "relu", dbias_dtype=torch.bfloat16)[2]):
        assert dbias[2].isnan() and torch.equal(dbias[torch.arange(8, device=DEVICE) != 2].float(), torch.full((7,), 4.0, device=DEVICE))


def test_outputs_are_new_tensors_never_the_callers_inputs(monkeypatch):
    for interpret in ("1", "0"):  # the kernels and, on CPU, the torch references
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        g = torch.randn(5, 16, device=DEVICE)
        dx, _, _ = dbias_quantize(g)
        y, _, _ = bias_act(g, None, None)
        assert dx.data_ptr() != g.data_ptr() and y.data_ptr() != g.data_ptr()


def test_bias_act_returns_y_in_hs_dtype_and_checks_pre_act_outs_device(monkeypatch):
    h = torch.randn(6, 32, device=DEVICE, dtype=torch.bfloat16)
    for interpret in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        pre = torch.empty(6, 32, device=DEVICE, dtype=torch.float32)
        y, _, _ = bias_act(h, torch.randn(32, device=DEVICE), "gelu_tanh", pre_act_out=pre)
        assert y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"`pre_act_out` is on meta but `h` is on"):
        bias_act(h, None, "relu", pre_act_out=torch.empty(6, 32, device="meta"))


# -- review: argument names, references, devices ----------------------------------------------


def test_quantize_errors_name_x_and_only_what_quantize_accepts():
    # quantize and quantize_current_scaling take `x`, not `grad`, and refuse fp8_dtype=None
    one = torch.ones((), device=DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(TypeError, match=r"^`x` must have dtype .*; got torch.int32$"):
        quantize(x.to(torch.int32), scale=one, fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^`x` must have at least one dimension"):
        quantize(x[0, 0], scale=one, fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"^`x` must be a torch.Tensor; got list$"):
        quantize_current_scaling([1.0], fp8_dtype=torch.float8_e5m2)
    with pytest.raises(TypeError, match=r"^`x` must have dtype .*; got torch.float64$"):
        quantize_current_scaling(x.double(), fp8_dtype=torch.float8_e5m2)
    for call in (lambda: quantize(x, scale=one, fp8_dtype=torch.float16),
                 lambda: quantize_current_scaling(x, fp8_dtype=torch.float16)):
        with pytest.raises(ValueError, match=r"`fp8_dtype` must be one of .*got torch.float16") as info:
            call()
        assert "None" not in str(info.value)  # None is refused here: the message must not offer it
    with pytest.raises(TypeError, match=r"^`grad` must have dtype"):  # dbias_quantize's argument is `grad`
        dbias_quantize(x.to(torch.int32))


@pytest.mark.parametrize("interpret", ["1", "0"])  # on CPU: the kernels under the interpreter, the torch references
def test_a_one_element_scale_of_any_shape_gives_the_0d_scales_results(monkeypatch, interpret):
    # Validation accepts any float32 tensor with one element; the result must not depend on its shape
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    grad, pre = _inputs((2, 9), 24, torch.bfloat16, seed=11)
    zero_d = torch.tensor(8.0, device=DEVICE)
    for scale in (torch.full((1, 1, 1), 8.0, device=DEVICE), torch.full((1, 1), 8.0, device=DEVICE)):
        expected = dact_dbias_quantize(grad, pre, "silu", scale=zero_d, fp8_dtype=torch.float8_e4m3fn, transpose=True)
        got = dact_dbias_quantize(grad, pre, "silu", scale=scale, fp8_dtype=torch.float8_e4m3fn, transpose=True)
        assert got[0].shape == grad.shape and got[1].shape == (24, 18)
        assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
        assert torch.equal(got[1].view(torch.uint8), got[0].reshape(18, 24).view(torch.uint8).t())
        assert_fp8_close(got[0].cpu(), quantize_reference(_reference(grad, pre, "silu").cpu(), 8.0,
                                                          torch.float8_e4m3fn))
        q, q_t = quantize(grad, scale=scale, fp8_dtype=torch.float8_e5m2, transpose=True)
        assert q.shape == grad.shape and torch.equal(q_t.view(torch.uint8), q.reshape(18, 24).view(torch.uint8).t())
        assert torch.equal(q.view(torch.uint8).cpu(),
                           quantize_reference(grad.double().cpu(), 8.0, torch.float8_e5m2).view(torch.uint8))
        y, yq, yq_t = bias_act(grad, None, "relu", scale=scale, fp8_dtype=torch.float8_e4m3fn, transpose=True)
        assert yq.shape == grad.shape and torch.equal(yq_t.view(torch.uint8), yq.reshape(18, 24).view(torch.uint8).t())
        assert torch.equal(yq.view(torch.uint8).cpu(),
                           quantize_reference(y.double().cpu(), 8.0, torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_outputs_are_row_major_whatever_the_inputs_layout(monkeypatch, interpret):
    # The FP8 copies are GEMM operands (row-major dx, and dx_t its transpose) and `dx` is viewed as
    # [M, N] rows downstream: every path returns contiguous outputs, for column-major inputs too.
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    grad_t, pre_t = _inputs((24,), 40, torch.float32, seed=12)
    grad, pre = grad_t.t(), pre_t.t()  # (40, 24), column-major
    dx64 = _reference(grad, pre, "gelu")
    scale = torch.tensor(4.0, device=DEVICE)
    dx, _, dbias = dact_dbias_quantize(grad, pre, "gelu")
    assert dx.is_contiguous()
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-5)
    _check_dbias(dbias.cpu(), dx64.cpu())
    dq, dq_t, _ = dact_dbias_quantize(grad, pre, "gelu", scale=scale, fp8_dtype=torch.float8_e5m2, transpose=True)
    assert dq.is_contiguous() and dq_t.is_contiguous()
    assert_fp8_close(dq.cpu(), quantize_reference(dx64.cpu(), 4.0, torch.float8_e5m2))
    plain, _, _ = dbias_quantize(grad)
    assert plain.is_contiguous() and torch.equal(plain, grad)
    q, _ = quantize(grad, scale=scale, fp8_dtype=torch.float8_e4m3fn)
    assert q.is_contiguous()
    assert torch.equal(q.view(torch.uint8).cpu(), quantize_reference(grad.cpu(), 4.0, torch.float8_e4m3fn).view(torch.uint8))
    cq = dact_dbias_quantize_current_scaling(grad, pre, "gelu", fp8_dtype=torch.float8_e4m3fn)[0]
    assert cq.is_contiguous()
    y, yq, _ = bias_act(grad, None, "gelu", scale=scale, fp8_dtype=torch.float8_e4m3fn)
    assert y.is_contiguous() and yq.is_contiguous()
    torch.testing.assert_close(y.double(), activation_reference(grad.double(), "gelu"), rtol=1e-5, atol=1e-5)


def test_meta_tensors_are_not_sent_to_the_triton_interpreter(monkeypatch):
    # The interpreter runs CPU tensors; a meta tensor (shape inference, e.g. Lightning's measure_flops on a
    # model built on the meta device) has no data to copy: it takes the torch references, as without it.
    from lightning_fuse.kernels import update_scales, use_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    meta = torch.empty(3, 37, 40, device="meta", dtype=torch.bfloat16)
    assert not use_triton(meta)
    scale, amax = torch.ones((), device="meta"), torch.zeros(1, device="meta")
    dx, dx_t, dbias = dact_dbias_quantize(meta, meta, "gelu", scale=scale, fp8_dtype=torch.float8_e5m2, amax=amax,
                                          transpose=True)
    assert (dx.shape, dx.dtype, dx_t.shape, dbias.shape, dbias.dtype) == (
        meta.shape, torch.float8_e5m2, (40, 111), (40,), torch.float32)
    assert dx.is_meta and dx_t.is_meta and dbias.is_meta
    q, q_t, current_amax, current_scale = quantize_current_scaling(meta, fp8_dtype=torch.float8_e4m3fn, transpose=True)
    assert (q.shape, q.dtype, q_t.shape, current_amax.shape, current_scale.shape) == (
        meta.shape, torch.float8_e4m3fn, (40, 111), (1,), ())
    y, yq, _ = bias_act(meta, torch.empty(40, device="meta"), "gelu_tanh", scale=scale, fp8_dtype=torch.float8_e4m3fn)
    assert (y.shape, y.dtype, yq.dtype) == (meta.shape, torch.bfloat16, torch.float8_e4m3fn) and y.is_meta
    history = torch.zeros(4, 3, device="meta")
    _, new_scale, _ = update_scales(history, torch.ones(3, device="meta"), torch.zeros(3, dtype=torch.int64, device="meta"),
                                    fp8_max=448.0, margin=0, use_max=True)
    assert new_scale.shape == (3,) and new_scale.is_meta


@pytest.mark.parametrize("margin", [None, 1.5, "1", True])
def test_current_scaling_refuses_a_margin_that_is_not_an_int(margin):
    grad, pre = _good()
    with pytest.raises(ValueError, match=rf"`margin` must be an int .*; got {re.escape(repr(margin))}$"):
        quantize_current_scaling(grad, fp8_dtype=torch.float8_e4m3fn, margin=margin)
    with pytest.raises(ValueError, match=r"`margin` must be an int"):
        dact_dbias_quantize_current_scaling(grad, pre, "gelu", fp8_dtype=torch.float8_e5m2, margin=margin)


def test_dact_dbias_quantize_raises_what_its_docstring_says():
    # Each documented exception, with the phrase its docstring gives it under that exception's name
    doc = dact_dbias_quantize.__doc__.split("Raises:")[1]
    raises = dict(re.findall(r"^\s*(\w+Error): (.*)$", doc, flags=re.M))
    grad, pre = _good()
    one = torch.ones((), device=DEVICE)
    cases = [
        ("non-tensor", lambda: dact_dbias_quantize(grad, [1.0], "gelu")),
        ("non-float", lambda: dact_dbias_quantize(grad.to(torch.int32), pre, "gelu")),
        ("mismatched shapes", lambda: dact_dbias_quantize(grad, pre[:, :3], "gelu")),
        ("unknown activation", lambda: dact_dbias_quantize(grad, pre, "gelu_fast")),
        ("FP8 dtype", lambda: dact_dbias_quantize(grad, pre, "gelu", scale=one, fp8_dtype=torch.float16)),
        ("missing scale", lambda: dact_dbias_quantize(grad, pre, "gelu", fp8_dtype=torch.float8_e5m2)),
    ]
    for phrase, call in cases:
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        documented = raises.get(type(info.value).__name__, "")
        assert phrase in documented, (phrase, type(info.value).__name__, raises)


def _op_variants():
    """Every argument pattern the launchers give the registered ops: with and without the FP8 copy, its
    transpose, the bias gradient, the activation, the pre-activation output."""
    g, p = _inputs((40,), 48, torch.float32, seed=13)
    bias, scale = torch.randn(48, device=DEVICE), torch.tensor(4.0, device=DEVICE)
    amax = lambda: torch.zeros(1, device=DEVICE)  # noqa: E731
    cfg = (16, 32, 1, 2, 0, True, 0)  # block_m, block_n, num_warps, groups, loop_stages, prefetch, chunk_tiles
    queued = (16, 32, 1, 3, 0, True, 2)  # three programs taking chunks of two row tiles
    dq = torch.ops.lightning_fuse.dact_dbias_quantize.default
    cs = torch.ops.lightning_fuse.quantize_current_scaling.default
    ba = torch.ops.lightning_fuse.bias_act.default
    return [
        ("dq-fp8-t", dq, (g, p, 2, scale, 2, amax(), True, True, *cfg, True, torch.float32)),
        ("dq-fp8-t-queued", dq, (g, p, 2, scale, 2, amax(), True, True, *queued, True, torch.float32)),
        ("dq-high-precision", dq, (g, p, 1, None, 0, None, False, True, *cfg, True, torch.bfloat16)),
        ("dq-cast", dq, (g, None, 0, scale, 1, amax(), False, False, *cfg, True, torch.float32)),
        ("cs", cs, (g, p, 1, 2, amax(), True, 1, True, True, torch.float32)),
        ("cs-cast", cs, (g, None, 0, 1, amax(), False, 0, False, True, torch.float32)),
        ("ba-fp8-t", ba, (g, bias, 2, torch.float32, scale, 1, amax(), True, torch.empty_like(g), True)),
        ("ba-fp8", ba, (g, bias, 2, torch.float32, scale, 2, None, False, None, True)),
        ("ba-high-precision", ba, (g, bias, 3, torch.float32, None, 0, None, False, None, True)),
        ("ba-bias-only", ba, (g, bias, 0, torch.bfloat16, None, 0, None, False, torch.empty_like(g), True)),
    ]


@pytest.mark.parametrize("index", range(10))
def test_registered_ops_meet_the_custom_op_contract(index):
    # torch.compile and torch.export see these ops; PyTorch checks what each returns (no output may be
    # an input or alias another output) and that it declares what it mutates. (The fake-tensor check
    # needs wrap_triton to trace the kernels, which it does not under the interpreter.)
    name, op, args = _op_variants()[index]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration"))
    outputs = op(*args)
    first = outputs[0]
    if name.startswith("ba"):
        h, bias, act = args[0].double(), args[1].double(), args[2]
        expected = h + bias if act == 0 else activation_reference(h + bias, ACTIVATIONS[act - 1])
        tol = 1e-5 if args[3] == torch.float32 else 1.6e-2  # (the interpreter truncates bf16 stores)
        assert first.dtype == args[3]
        torch.testing.assert_close(first.double(), expected, rtol=tol, atol=tol)
    elif name != "dq-cast" and name != "cs-cast":
        tol = 1e-4 if args[-1] == torch.float32 else 8e-3  # the bias gradient in fp32, or rounded to bf16
        torch.testing.assert_close(_reference(args[0], args[1], ACTIVATIONS[args[2] - 1]).sum(0),
                                   outputs[2].double(), rtol=tol, atol=tol)
    pointers = [t.untyped_storage().data_ptr() for t in outputs if t.numel()]
    assert len(set(pointers)) == len(pointers)


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_outputs_and_amax_carry_no_autograd_history(monkeypatch, interpret):
    # The kernels are not differentiable: whatever the path, inputs that require grad (a weight, an
    # activation saved for backward) give plain outputs, and the caller's amax buffer (a view of the
    # recipe's history) never joins an autograd graph.
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    w = torch.nn.Parameter(torch.randn(16, 32, device=DEVICE))
    scale = torch.tensor(2.0, device=DEVICE)
    history = torch.zeros(4, 3, device=DEVICE)
    amax = history[0, 1:2]
    q, q_t = quantize(w, scale=scale, fp8_dtype=torch.float8_e4m3fn, amax=amax, transpose=True)
    dx, _, dbias = dact_dbias_quantize(w, w, "gelu", scale=scale, fp8_dtype=torch.float8_e5m2, amax=amax)
    y, yq, _ = bias_act(w, torch.randn(32, device=DEVICE, requires_grad=True), "silu", scale=scale,
                        fp8_dtype=torch.float8_e4m3fn, amax=amax)
    pre = torch.empty(16, 32, device=DEVICE)
    bias_act(w, torch.zeros(32, device=DEVICE), "relu", pre_act_out=pre)
    current = dact_dbias_quantize_current_scaling(w, w, "silu", fp8_dtype=torch.float8_e5m2)
    for t in (q, q_t, dx, dbias, y, yq, pre, history, *(t for t in current if t is not None)):
        assert not t.requires_grad and t.grad_fn is None
    expected = max(w.detach().abs().max().item(), _reference(w.detach(), w.detach(), "gelu").abs().max().item())
    assert history[0, 1].item() >= expected * (1 - 1e-6) and history.count_nonzero().item() == 1
    assert torch.equal(pre, w.detach())


def test_erf_gelu_is_float32_accurate_across_its_range():
    # The erf GELU's kernels take 0.5 erfc from a polynomial fit (kernels/activations.py) instead of
    # libdevice's erf: within a few float32 ulps of float64 everywhere, its tails and zero included.
    x = torch.cat([torch.linspace(-14.0, 14.0, 70_001)[:-1],  # step 4e-4
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 1e4, -1e4])]).to(DEVICE)
    x2 = x.reshape(-1, 8)
    x64 = x2.double()
    dx, _, _ = dact_dbias_quantize(torch.ones_like(x2), x2, "gelu")
    derivative = activation_derivative_reference(x64, "gelu")
    assert (dx.double() - derivative).abs().max().item() < 3e-7  # the derivative is at most 1.13
    y, _, _ = bias_act(x2, None, "gelu")
    forward = activation_reference(x64, "gelu")
    assert ((y.double() - forward).abs() / x64.abs().clamp_min(1.0)).max().item() < 3e-7
    # The tails are exact: 0 and 1 for the derivative, 0 and x for the activation, once exp(-x^2 / 2)
    # is 0 in float32 (|x| > 14.5).
    far = x2.abs() > 14.5
    assert torch.equal(dx[far], (x2[far] > 0).float()) and torch.equal(y[far], torch.where(x2[far] > 0, x2[far], 0.0))
    special = torch.tensor([[float("nan"), float("inf"), float("-inf"), 0.0]], device=DEVICE)
    dx, _, _ = dact_dbias_quantize(torch.ones_like(special), special, "gelu")
    y, _, _ = bias_act(special, None, "gelu")
    # as PyTorch's own formula gives: NaN stays NaN; x * pdf(x) at +-inf is inf * 0
    torch.testing.assert_close(dx, activation_derivative_reference(special, "gelu"), equal_nan=True)
    torch.testing.assert_close(y, activation_reference(special, "gelu"), equal_nan=True)
