"""GPU-only checks: the compiled kernels at training sizes, every ``torch._scaled_mm`` layout the
modules use, and the real FP8 path of the modules (eager and ``torch.compile``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers_models import Conv1D
from fp8_checks import assert_fp8_close, sqnr_db
from lightning_fuse import CurrentScaling, DelayedScaling, FP8Linear, FP8ScalingState, FusedLinearBiasActivation
from lightning_fuse import fp8_autocast
from lightning_fuse.kernels.activations import activation_id
from lightning_fuse.kernels import (
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

pytestmark = pytest.mark.gpu
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _poison(nbytes: int) -> None:
    # Freed blocks refilled with 0xFF (NaN in both FP8 formats): an unwritten output element shows.
    block = torch.full((nbytes,), 255, dtype=torch.uint8, device="cuda")
    del block


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_dtype", [E5M2, E4M3])
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "relu", "silu", "quick_gelu", "squared_relu"])
@pytest.mark.parametrize("m,n", [(8192, 3072), (4099, 1000)])
def test_fused_kernel_at_training_sizes(dtype, fp8_dtype, activation, m, n):
    grad = torch.randn(m, n, device="cuda", dtype=dtype)
    pre = torch.randn(m, n, device="cuda", dtype=dtype) * 2
    _check_fused_pass(grad, pre, activation, fp8_dtype)


def _check_fused_pass(grad, pre, activation, fp8_dtype):
    """Every output of the fused pass against float64: FP8 codes, every transposed element, bias
    gradient, amax, SQNR."""
    m, n = grad.shape
    dx64 = grad.double() * activation_derivative_reference(pre.double(), activation)
    # Half the format's range above the largest value: no saturation, so SQNR measures rounding.
    fmax = 57344.0 if fp8_dtype == E5M2 else 448.0
    scale = (fmax / 2 / dx64.abs().max()).float()
    amax = torch.zeros(1, device="cuda")
    _poison(2 * m * n)
    dx, dx_t, dbias = dact_dbias_quantize(grad, pre, activation, scale=scale, fp8_dtype=fp8_dtype, amax=amax,
                                          transpose=True)
    assert_fp8_close(dx, quantize_reference(dx64, scale.double(), fp8_dtype))
    # Every element of the transposed copy.
    assert torch.equal(dx_t.view(torch.uint8), dx.view(torch.uint8).t())
    expected_db = dx64.sum(0)
    assert ((dbias.double() - expected_db).norm() / expected_db.norm()).item() < 1e-5
    assert amax.item() == pytest.approx(dx64.abs().max().item(), rel=1e-5)
    assert sqnr_db(dx.double() / scale.double(), dx64) >= (25 if fp8_dtype == E5M2 else 30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["gelu_tanh", None])
@pytest.mark.parametrize("m,n", [(16384, 6400), (4099, 1000)])
def test_current_scaling_at_training_sizes(dtype, activation, m, n):
    # Two passes: the amax (and bias gradient), then the FP8 copies with the scale the second pass
    # derives from that amax and stores, both sizes in row groups; without an activation pass 2 is
    # the cast.
    grad = torch.randn(m, n, device="cuda", dtype=dtype)
    pre = torch.randn(m, n, device="cuda", dtype=dtype) * 2
    dx64 = grad.double() if activation is None else grad.double() * activation_derivative_reference(pre.double(),
                                                                                                    activation)
    _poison(2 * m * n)
    if activation is None:
        dx, dx_t, dbias, amax, scale = dact_dbias_quantize_current_scaling(grad, None, None, fp8_dtype=E5M2,
                                                                           transpose=True, margin=1)
    else:
        dx, dx_t, dbias, amax, scale = dact_dbias_quantize_current_scaling(grad, pre, activation, fp8_dtype=E5M2,
                                                                           transpose=True, margin=1)
    expected_amax = dx64.abs().max()
    assert amax.item() == pytest.approx(expected_amax.item(), rel=1e-6)
    # The scale: float32's own quotients of the amax the first pass found (fp8_max / amax / 2**margin).
    fmax = torch.tensor(57344.0, device="cuda")
    assert scale.item() == (fmax / amax.reshape(()) / torch.tensor(2.0, device="cuda")).item()
    assert_fp8_close(dx, quantize_reference(dx64, scale.double(), E5M2))
    assert torch.equal(dx_t.view(torch.uint8), dx.view(torch.uint8).t())  # every transposed element
    expected_db = dx64.sum(0)
    assert ((dbias.double() - expected_db).norm() / expected_db.norm()).item() < 1e-5
    assert sqnr_db(dx.double() / scale.double(), dx64) >= 25
    q, q_t, x_amax, x_scale = quantize_current_scaling(pre, fp8_dtype=E4M3, transpose=True)
    assert x_amax.item() == pre.float().abs().max().item()
    assert torch.equal(q.view(torch.uint8), quantize_reference(pre, x_scale, E4M3).view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "quick_gelu"])
def test_fused_kernel_in_its_queued_form(monkeypatch, activation, dtype):
    # The queued form (one program per slot taking chunks of four row tiles), which the shipped rule
    # takes on H100s only: a rule that takes it on every card does at 16384 x 6400 on 132
    # multiprocessors, and every output is checked as above.
    import dataclasses

    from lightning_fuse.kernels import _launch

    m, n = 16384, 6400
    rule = dataclasses.replace(_launch.LAUNCH_RULES["dact_dbias_quantize"], queued_devices=())
    monkeypatch.setitem(_launch.LAUNCH_RULES, "dact_dbias_quantize", rule)
    _launch._CONFIGS.clear()
    try:
        cfg = _launch.launch_config("dact_dbias_quantize", m, n, torch.device("cuda"), dtype)
        if torch.cuda.get_device_properties(0).multi_processor_count == 132:
            assert cfg.chunk_tiles == 4
        grad = torch.randn(m, n, device="cuda", dtype=dtype)
        pre = torch.randn(m, n, device="cuda", dtype=dtype) * 2
        _check_fused_pass(grad, pre, activation, E5M2)
    finally:
        _launch._CONFIGS.clear()


@pytest.mark.parametrize("activation", ["gelu_tanh", None])
@pytest.mark.parametrize("m,n", [(16384, 6400), (4099, 1000)])
def test_the_queued_form_writes_the_bytes_of_the_row_groups_and_sums_the_same_bias_gradient(monkeypatch, activation,
                                                                                           m, n):
    # The queued form (chunks taken from a queue as programs free up), the same chunks in a fixed stride
    # (the graph-captured or traced launch), and the row groups: the same FP8 bytes; the bias gradient
    # the same bits with and without the queue, and within 1e-5 of the row groups' sum.
    from lightning_fuse.kernels._launch import LaunchConfig
    import importlib

    module = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")  # not the function of that name

    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    pre = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2
    act = activation_id(activation) if activation else 0
    scale = torch.tensor(512.0, device="cuda")
    results = []
    for cfg, traced in ((LaunchConfig(64, 64, 4, 5, prefetch=True), False),
                        (LaunchConfig(64, 64, 4, 396, prefetch=True, chunk_tiles=4), False),
                        (LaunchConfig(64, 64, 4, 396, prefetch=True, chunk_tiles=4), True),
                        (LaunchConfig(64, 64, 4, 50, prefetch=True, chunk_tiles=4), False)):
        out = torch.full((m, n), 255, dtype=torch.uint8, device="cuda")
        out_t = torch.full((n, m), 255, dtype=torch.uint8, device="cuda")
        dbias = torch.full((n,), float("nan"), device="cuda")
        amax = torch.zeros(1, device="cuda")
        with monkeypatch.context() as patch:
            if traced:  # no queue, no arrival counters: chunks in a fixed stride, the bias gradient's second launch
                patch.setattr(module, "_arrival_counters", lambda device, strips: None)
            module._launch(grad, pre if act else None, act, scale, 2, amax, True, True, True, cfg, out, out_t, dbias,
                           False)
        results.append((out, out_t, dbias, amax))
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for c in module._COUNTERS.values())  # every queue and counter emptied
    for out, out_t, dbias, amax in results:
        assert torch.equal(out, results[0][0]) and torch.equal(out_t, out.t())
        assert amax.item() == results[0][3].item()
        assert ((dbias.double() - results[0][2].double()).norm() / results[0][2].double().norm()).item() < 1e-5
    assert torch.equal(results[1][2], results[2][2]) and torch.equal(results[1][2], results[3][2])


@pytest.mark.parametrize("activation", ["gelu_tanh", None])
@pytest.mark.parametrize("m,n", [(8192, 3072), (4099, 1000)])
def test_both_loop_forms_of_the_backward_passes_write_the_same_bytes(activation, m, n):
    # Both backward passes prefetch each tile's inputs one iteration ahead where the launch rules say
    # so; the loop without it (the fused pass's two-deep form, the sweep's variants) must write the
    # same bytes, at the shipped tiles and grid.
    import dataclasses

    from lightning_fuse.kernels._launch import launch_config
    from lightning_fuse.kernels.dact_dbias_quantize import _launch

    name = "dact_dbias_quantize" if activation else "dbias_quantize"
    shipped = launch_config(name, m, n, torch.device("cuda"))
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    pre = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2
    act = activation_id(activation) if activation else 0
    scale = torch.tensor(512.0, device="cuda")
    results = []
    for prefetch in (True, False):
        out = torch.full((m, n), 255, dtype=torch.uint8, device="cuda")
        out_t = torch.full((n, m), 255, dtype=torch.uint8, device="cuda")
        dbias = torch.full((n,), float("nan"), device="cuda")
        amax = torch.zeros(1, device="cuda")
        _launch(grad, pre if act else None, act, scale, 2, amax, True, True, True,
                dataclasses.replace(shipped, prefetch=prefetch), out, out_t, dbias, False)
        results.append((out, out_t, dbias, amax))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    out, out_t, dbias, amax = results[0]
    dx64 = grad.double() * (activation_derivative_reference(pre.double(), activation) if activation else 1)
    assert_fp8_close(out.view(E5M2), quantize_reference(dx64, 512.0, E5M2))
    assert torch.equal(out_t, out.t())
    assert ((dbias.double() - dx64.sum(0)).norm() / dx64.sum(0).norm()).item() < 1e-5
    assert amax.item() == pytest.approx(dx64.abs().max().item(), rel=1e-5)


@pytest.mark.parametrize("m,n", [(16384, 6400), (1, 4096), (333, 96)])
def test_quantize_and_dbias_quantize_at_training_sizes(m, n):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    _poison(2 * m * n)
    q, q_t = quantize(x, scale=torch.tensor(50.0, device="cuda"), fp8_dtype=E4M3, transpose=True)
    assert torch.equal(q.view(torch.uint8), quantize_reference(x, 50.0, E4M3).view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())
    _poison(2 * m * n)
    dq, dq_t, db = dbias_quantize(x, scale=torch.tensor(9.0, device="cuda"), fp8_dtype=E5M2, transpose=True)
    assert torch.equal(dq.view(torch.uint8), quantize_reference(x, 9.0, E5M2).view(torch.uint8))
    assert torch.equal(dq_t.view(torch.uint8), dq.view(torch.uint8).t())


@pytest.mark.parametrize("m,n", [(8192, 3072), (16384, 6400)])
def test_bias_gradient_summed_in_the_pass_across_repeats_graphs_and_streams(monkeypatch, m, n):
    # The last-arriving program of each column strip sums the partials (an arrival counter per strip,
    # reset by that program). Its result must equal the separate sum launch bit for bit on every
    # launch: many in a row, replayed from a CUDA graph, and on two streams at once. At 16384 x 6400 an
    # H100 runs the queued form, whose queue shares the counters' buffer and is emptied the same way.
    import importlib

    module = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")
    grads = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    pre = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2
    scale = torch.tensor(256.0, device="cuda")

    def run(g):
        return dact_dbias_quantize(g, pre, "gelu_tanh", scale=scale, fp8_dtype=E5M2, transpose=True)[2]

    with monkeypatch.context() as patch:
        patch.setattr(module, "_arrival_counters", lambda device, strips: None)
        expected = [run(g) for g in grads]
    for a, b in [(run(grads[0]), expected[0]), (run(grads[1]), expected[1])]:
        assert torch.equal(a, b)
    for _ in range(50):
        assert torch.equal(run(grads[0]), expected[0])
    # Replayed from a graph: the counters must be zero at every replay.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = [run(grads[i % 2]) for i in range(4)]
    for _ in range(10):
        for c in captured:
            c.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for i, c in enumerate(captured):
            assert torch.equal(c, expected[i % 2])
    # Two streams at once, each with its own counters.
    streams = [torch.cuda.Stream() for _ in grads]
    results = [[] for _ in grads]
    torch.cuda.synchronize()
    for _ in range(20):
        for s, g, r in zip(streams, grads, results):
            with torch.cuda.stream(s):
                r.append(run(g))
    torch.cuda.synchronize()
    for r, e in zip(results, expected):
        assert all(torch.equal(x, e) for x in r)
    assert all(int(c.abs().sum()) == 0 for c in module._COUNTERS.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", "relu", "silu", "quick_gelu", "squared_relu"])
@pytest.mark.parametrize("m,n", [(16384, 6400), (4099, 1000)])
def test_bias_act_at_training_sizes(dtype, with_bias, activation, m, n):
    # The forward pass the modules run after the GEMM: output, its FP8 copies (every transposed
    # element) and their amax, against float64.
    h = torch.randn(m, n, device="cuda", dtype=dtype) * 2
    bias = torch.randn(n, device="cuda", dtype=dtype) if with_bias else None
    # Added in fp32 and rounded: the pre-activation the backward reads, so the forward uses it too.
    pre = (h.float() + bias.float()).to(dtype).double() if with_bias else h.double()
    y64 = activation_reference(pre, activation)
    scale = (224.0 / y64.abs().max()).float()
    amax = torch.zeros(1, device="cuda")
    pre_out = torch.empty_like(h) if with_bias else None
    _poison(4 * m * n)
    y, q, q_t = bias_act(h, bias, activation, scale=scale, fp8_dtype=E4M3, amax=amax, transpose=True,
                         pre_act_out=pre_out)
    assert y.dtype == dtype
    assert sqnr_db(y.double(), y64) >= 40
    assert_fp8_close(q, quantize_reference(y.double(), scale.double(), E4M3))
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())
    assert amax.item() == pytest.approx(y.double().abs().max().item(), rel=1e-6)
    if with_bias:
        assert torch.equal(pre_out, pre.to(dtype))


# -- torch._scaled_mm: exactly what the modules rely on --------------------------------------------


def _fp8(shape, dtype):
    return (torch.randn(*shape, device="cuda") * 4).to(dtype)


def _one():
    return torch.ones((), device="cuda")


def test_scaled_mm_layouts_the_modules_use():
    m, k, n = 64, 96, 48
    x, w_nk, w_kn = _fp8((m, k), E4M3), _fp8((n, k), E4M3), None
    w_kn = w_nk.t().contiguous()
    dy, dy_t = _fp8((m, n), E5M2), None
    dy_t = dy.t().contiguous()
    x_t = x.t().contiguous()
    f = lambda t: t.float()  # noqa: E731
    # forward: x (M, K) row-major @ W^T (K, N) column-major, bf16 out (fast accumulation, as used)
    out = torch._scaled_mm(x, w_nk.t(), scale_a=_one(), scale_b=_one(), out_dtype=torch.bfloat16,
                           use_fast_accum=True)
    expected = f(x) @ f(w_nk).t()
    assert ((out.float() - expected).norm() / expected.norm()).item() < 4e-3
    # A scale pointer that is not 16-byte aligned is refused: the FP8 state keeps its scales 16 bytes apart.
    unaligned = torch.ones(2, device="cuda")[1]
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_NOT_SUPPORTED"):
        torch._scaled_mm(x, w_nk.t(), scale_a=unaligned, scale_b=_one(), out_dtype=torch.bfloat16)
    # dgrad: dy (M, N) e5m2 row-major @ W (N, K) column-major (from the (K, N) copy)
    # (Hopper's FP8 tensor cores accumulate with fewer bits than fp32: compare norms, not elements.)
    def close(out, expected):
        return ((out.float() - expected).norm() / expected.norm()).item() < 4e-3

    dx = torch._scaled_mm(dy, w_kn.t(), scale_a=_one(), scale_b=_one(), out_dtype=torch.float32)
    assert close(dx, f(dy) @ f(w_nk))
    # wgrad: dy^T (N, M) e5m2 row-major @ x (M, K) column-major, fp32 out (master weights)
    dw = torch._scaled_mm(dy_t, x_t.t(), scale_a=_one(), scale_b=_one(), out_dtype=torch.float32)
    assert close(dw, f(dy).t() @ f(x))
    # wgrad of a (K, N) Conv1D weight: x^T (K, M) e4m3 row-major @ dy (M, N) column-major
    dw_kn = torch._scaled_mm(x_t, dy_t.t(), scale_a=_one(), scale_b=_one(), out_dtype=torch.float32)
    assert close(dw_kn, f(x).t() @ f(dy))


def test_scaled_mm_requirements():
    """What the modules' eligibility rules and padding are based on."""
    k, n = 32, 48
    w = _fp8((n, k), E4M3)
    # Rows of the first operand need not be a multiple of 16.
    torch._scaled_mm(_fp8((17, k), E4M3), w.t(), scale_a=_one(), scale_b=_one(), out_dtype=torch.bfloat16)
    # The contraction dimension must be (wgrad contracts over tokens: the modules pad it).
    with pytest.raises(RuntimeError):
        torch._scaled_mm(_fp8((16, 24), E4M3), _fp8((n, 24), E4M3).t(), scale_a=_one(), scale_b=_one(),
                         out_dtype=torch.bfloat16)
    # So must the output columns.
    with pytest.raises(RuntimeError):
        torch._scaled_mm(_fp8((16, k), E4M3), _fp8((24, k), E4M3).t(), scale_a=_one(), scale_b=_one(),
                         out_dtype=torch.bfloat16)
    # e5m2 x e5m2 is rejected (the modules never pair two gradients).
    with pytest.raises((RuntimeError, ValueError)):
        torch._scaled_mm(_fp8((16, k), E5M2), _fp8((n, k), E5M2).t(), scale_a=_one(), scale_b=_one(),
                         out_dtype=torch.bfloat16)
    # The second operand must be column-major.
    with pytest.raises(RuntimeError):
        torch._scaled_mm(_fp8((16, k), E4M3), _fp8((k, n), E4M3), scale_a=_one(), scale_b=_one(),
                         out_dtype=torch.bfloat16)


# -- the modules' FP8 path --------------------------------------------------------------------------




def _reference_grads(linear, activation, x, dy):
    """float64 forward/backward of the original layer."""
    w = linear.weight.detach().double().requires_grad_()
    b = linear.bias.detach().double().requires_grad_() if linear.bias is not None else None
    xr = x.detach().double().requires_grad_()
    wt = w if isinstance(linear, Conv1D) else w.t()
    h = xr @ wt + (b if b is not None else 0)
    y = h if activation is None else {
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
        "relu": torch.relu, "gelu": torch.nn.functional.gelu}[activation](h)
    y.backward(dy.double())
    return y.detach(), xr.grad, w.grad, (b.grad if b is not None else None)


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu", None])
@pytest.mark.parametrize("tokens", [2048, 1000])
def test_fp8_module_gradients(recipe, layout, activation, tokens):
    torch.manual_seed(0)
    k, n = 256, 512
    linear = (nn.Linear(k, n) if layout == "linear" else Conv1D(n, k)).cuda()
    module = (FusedLinearBiasActivation(linear, activation) if activation else FP8Linear(linear)).cuda()
    state = FP8ScalingState()
    module.bind_fp8_state(state, "layer")
    x = torch.randn(2, tokens // 2, k, device="cuda", requires_grad=True)
    dy = torch.randn(2, tokens // 2, n, device="cuda")
    for _ in range(3):  # delayed scaling needs a step to learn its scales
        x.grad = None
        linear.weight.grad = linear.bias.grad = None
        with fp8_autocast(recipe), torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x)
        y.backward(dy.bfloat16())
    y_ref, dx_ref, dw_ref, db_ref = _reference_grads(linear, activation, x, dy.bfloat16().float())
    assert y.dtype == torch.bfloat16
    assert sqnr_db(y.float(), y_ref) >= 20
    assert sqnr_db(x.grad, dx_ref) >= 20
    assert sqnr_db(linear.weight.grad, dw_ref) >= 20
    assert sqnr_db(linear.bias.grad, db_ref) >= 20
    assert linear.weight.grad.dtype == torch.float32


def test_fp8_module_bf16_weights_frozen_bias_and_empty_batch():
    linear = nn.Linear(128, 256).cuda().bfloat16()
    linear.bias.requires_grad_(False)
    module = FusedLinearBiasActivation(linear, "gelu_tanh")
    module.bind_fp8_state(FP8ScalingState(), "fc")
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast():
        y = module(x)
        empty = module(torch.randn(0, 128, device="cuda", dtype=torch.bfloat16))
    y.sum().backward()
    assert empty.shape == (0, 256)
    assert linear.weight.grad.dtype == torch.bfloat16 and linear.bias.grad is None
    assert torch.isfinite(x.grad).all()


def test_weight_fp8_copy_is_reused_until_the_weight_changes():
    linear = nn.Linear(128, 256).cuda()
    module = FusedLinearBiasActivation(linear, "gelu_tanh")
    state = FP8ScalingState()
    module.bind_fp8_state(state, "fc")
    x = torch.randn(64, 128, device="cuda")
    with fp8_autocast(update_scales=False):
        module(x)
        first = module._weight_cache[1][0]
        module(x)  # another micro-batch: same copy
        assert module._weight_cache[1][0] is first
        with torch.no_grad():
            linear.weight.add_(1.0)  # an optimizer step
        module(x)
        assert module._weight_cache[1][0] is not first


def test_torch_compile_has_no_graph_break_inside_the_module():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(approximate="tanh"), nn.Linear(1024, 256)).cuda()
    state = FP8ScalingState()
    fc = FusedLinearBiasActivation(mlp[0], "gelu_tanh")
    proj = FP8Linear(mlp[2])
    fc.bind_fp8_state(state, "0")
    proj.bind_fp8_state(state, "2")
    fused = nn.Sequential(fc, proj).cuda()
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    compiled = torch.compile(fused, fullgraph=True)
    for _ in range(3):
        with fp8_autocast(), torch.autocast("cuda", dtype=torch.bfloat16):
            y_eager = fused(x)
            y_compiled = compiled(x)
        y_compiled.float().sum().backward()
    assert sqnr_db(y_compiled.float(), y_eager.float()) >= 30
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_callback_trains_in_fp8_under_fsdp_and_ddp_on_one_gpu(tmp_path, strategy):
    """Lightning allows FSDP only on GPUs: the swap must happen before wrapping (layers built in
    ``configure_model``), the FP8 path must run on the wrapped parameters, and the scales must move."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from boring_models import ConfigureModelMLP
    from lightning_fuse import FusedBackwardCallback

    torch.manual_seed(0)
    model = ConfigureModelMLP(d=64, batch_size=8)
    callback = FusedBackwardCallback(recipe=DelayedScaling(amax_history_len=4), benchmark="off")
    trainer = Trainer(accelerator="cuda", devices=1, strategy=FSDPStrategy() if strategy == "fsdp" else DDPStrategy(),
                      precision="bf16-mixed", max_steps=3, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0, default_root_dir=tmp_path, callbacks=[callback])
    trainer.fit(model)
    kinds = {name: type(module).__name__ for name, module in model.named_modules()}
    assert "FusedLinearBiasActivation" in kinds.values() and "FP8Linear" in kinds.values()
    assert callback.state.generation == 3
    forward_scales = callback.state.groups["forward"].scale
    assert torch.isfinite(forward_scales).all() and (forward_scales != 1.0).all()
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


@pytest.mark.parametrize("fp8_dtype", [E5M2, E4M3])
@pytest.mark.parametrize("encoder", ["ptx", "ptx4", "tile"])
@pytest.mark.parametrize("m", [4099, 4096])
def test_hardware_encoders_match_the_integer_encoder_bit_for_bit(monkeypatch, fp8_dtype, encoder, m):
    """Every FP8 code, row-wise and transposed, from each hardware encoder equals the integer
    encoder's (nearest-even, saturating), specials and subnormals included. With M a multiple of 4
    the transposed copy is written as words, and ``tile`` converts both layouts at once (fp8.py's
    ``fp8_tile_codes``); otherwise byte by byte, as ``ptx``."""
    torch.manual_seed(11)
    n = 1000
    grad = torch.randn(m, n, device="cuda") * torch.logspace(-12, 6, n, device="cuda")
    grad[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, 6e4, -1e9])
    pre = torch.randn(m, n, device="cuda") * 3
    scale = torch.tensor(1.0, device="cuda")
    outputs = {}
    for name in ("int", encoder):
        monkeypatch.setenv("LIGHTNING_FUSE_FP8_ENCODER", name)
        outputs[name] = dact_dbias_quantize(grad, pre, "gelu_tanh", scale=scale, fp8_dtype=fp8_dtype, transpose=True)
    for a, b in zip(outputs["int"][:2], outputs[encoder][:2]):
        nan = torch.isnan(a.float())
        assert torch.equal(nan, torch.isnan(b.float()))  # a NaN's sign bit may differ between encoders
        assert torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan])
    assert torch.equal(outputs[encoder][1].view(torch.uint8), outputs[encoder][0].view(torch.uint8).t())
