"""A chain hands its consumer linear the FP8 copies of its output (written in the activation pass)
under delayed scaling: the consumer then skips its own quantization pass. The hand-off must never
change a result, and must be refused whenever the consumer's input is not that exact tensor."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn

import lightning_fuse.modules as modules
from lightning_fuse import CurrentScaling, DelayedScaling, FP8Linear, FP8ScalingState, FuseConfig
from lightning_fuse import FusedLinearBiasActivation, fp8_autocast, fp8_state_of, fuse_


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _on_device():
    # The real kernels and GEMMs on a GPU; on CPU the Triton interpreter runs the same code path.
    with torch.device(DEVICE):
        yield


def _mlp(seed=0, d=32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))


def _counting_quantize():
    calls = []
    real = modules.quantize

    def counted(x, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, **kwargs)
    return calls, mock.patch.object(modules, "quantize", counted)


def _train(model, xs, recipe):
    outs, grads = [], []
    for x in xs:
        x = x.clone().requires_grad_(True)
        with fp8_autocast(recipe):
            y = model(x)
        (y.float() ** 2).mean().backward()
        outs.append(y.detach())
        grads.append(x.grad)
    return outs, grads


def test_fuse_links_the_mlp_consumer_and_it_skips_its_quantization():
    model = _mlp()
    fuse_(model, FuseConfig(convert="mlp", emulate=True))
    assert model[0]._consumer == (model[2],)
    calls, patch = _counting_quantize()
    with patch:
        _train(model, [torch.randn(24, 32)], DelayedScaling())
    # The chain's input, the chain's weight and the consumer's weight; not the consumer's input.
    assert calls == [(24, 32), (128, 32), (32, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hand_off_changes_no_result(dtype):
    linked = _mlp(seed=1).to(dtype)
    fuse_(linked, FuseConfig(convert="mlp", emulate=True))
    unlinked = copy.deepcopy(linked)
    unlinked[0]._consumer = ()
    torch.manual_seed(2)
    xs = [torch.randn(2, 9, 32, dtype=dtype) * scale for scale in (1.0, 4.0, 0.5)]  # 3-D input, 18 rows
    recipe = DelayedScaling(amax_history_len=4)
    out_a, grad_a = _train(linked, xs, recipe)
    out_b, grad_b = _train(unlinked, xs, recipe)
    for a, b in zip(out_a + grad_a, out_b + grad_b):
        assert torch.equal(a, b)
    for (name, p), q in zip(linked.named_parameters(), unlinked.parameters()):
        assert torch.equal(p.grad, q.grad), name
    state_a, state_b = fp8_state_of(linked).state_dict(), fp8_state_of(unlinked).state_dict()
    for key, value in state_a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, state_b[key]), key


def _pair(linked, activation="gelu", seed=11):
    """A chain and the FP8Linear after it, on one scaling state; ``linked``: the chain hands off to it."""
    torch.manual_seed(seed)
    fc = FusedLinearBiasActivation(nn.Linear(16, 32), activation, emulate=True)
    proj = FP8Linear(nn.Linear(32, 16), emulate=True)
    state = FP8ScalingState()
    fc.bind_fp8_state(state, "fc")
    proj.bind_fp8_state(state, "proj")
    if linked:
        fc.link_consumer(proj)
    return fc, proj, state


def test_a_modified_or_different_input_is_quantized_by_the_consumer():
    fc, proj, _ = _pair(True, "relu", seed=3)
    x = torch.randn(8, 16)
    calls, patch = _counting_quantize()
    with patch, fp8_autocast(DelayedScaling()):
        h = fc(x)
        h.mul_(2.0)  # changed in place after the hand-off was written
        y_changed = proj(h)
        h2 = fc(x)
        y_other = proj(h2 + 0.0)  # a different tensor object
    assert calls.count((8, 32)) == 2
    with fp8_autocast(DelayedScaling(), update_scales=False):
        expected = proj(h2 + 0.0)
    assert torch.isfinite(y_changed).all() and y_other.shape == expected.shape
    assert "_fp8_input" not in proj.__dict__  # nothing left holding the chain's output


def test_no_hand_off_under_current_scaling():
    model = _mlp()
    fuse_(model, FuseConfig(convert="mlp", emulate=True))
    calls, patch = _counting_quantize()
    with patch:
        _train(model, [torch.randn(16, 32)], CurrentScaling())
    assert calls == []  # current scaling quantizes through its own two-pass functions


def test_link_consumer_checks_the_consumer():
    fc = FusedLinearBiasActivation(nn.Linear(16, 32), "relu")
    with pytest.raises(ValueError, match=r"out_features=32 .* FP8Linear with in_features=32"):
        fc.link_consumer(FP8Linear(nn.Linear(16, 16)))
    with pytest.raises(ValueError, match="FP8Linear"):
        fc.link_consumer(nn.Linear(32, 16))


@pytest.mark.parametrize("leading", [(12,), (3, 4)], ids=["2d", "3d"])
def test_outputs_of_the_fp8_modules_can_be_changed_in_place(leading):
    base = _mlp(seed=5)
    model = copy.deepcopy(base)
    fuse_(model, FuseConfig(convert="mlp", emulate=True))
    reference = copy.deepcopy(model)
    torch.manual_seed(6)
    x = torch.randn(*leading, 32)

    def run(m, in_place):
        xi = x.clone().requires_grad_(True)
        with fp8_autocast(DelayedScaling()):
            h = m[0](xi)
            h = h.mul_(0.5) if in_place else h * 0.5
            y = m[2](h)
            y = y.add_(1.0) if in_place else y + 1.0
        y.square().sum().backward()
        return y.detach(), xi.grad

    y_a, g_a = run(model, True)
    y_b, g_b = run(reference, False)
    assert torch.equal(y_a, y_b) and torch.equal(g_a, g_b)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_inference_mode_forward_runs_without_hand_off():
    model = _mlp(seed=7)
    fuse_(model, FuseConfig(convert="mlp", emulate=True))
    x = torch.randn(10, 32)
    with torch.no_grad(), fp8_autocast(DelayedScaling(), update_scales=False):
        expected = model(x)
    with torch.inference_mode(), fp8_autocast(DelayedScaling(), update_scales=False):
        got = model(x)
    assert torch.equal(got, expected)


def test_the_row_wise_copy_handed_over_is_freed_after_the_consumer_forward():
    import gc
    import weakref

    model = _mlp(seed=8)
    fuse_(model, FuseConfig(convert="mlp", emulate=True))
    x = torch.randn(20, 32, requires_grad=True)
    with fp8_autocast(DelayedScaling()):
        h = model[0](x)
        handed = model[2].__dict__["_fp8_input"]
        row_wise, transposed = weakref.ref(handed[2]), weakref.ref(handed[3])
        del handed
        y = model[2](h)
    gc.collect()
    assert row_wise() is None  # only the forward GEMM reads it
    assert transposed() is not None  # saved for the weight gradient
    y.sum().backward()
    del y
    gc.collect()
    assert transposed() is None


_SEQUENCES = {
    # what runs between the chain and its consumer; the consumer's input amax must be what it quantized
    "changed-in-place": lambda fc, proj, x: proj(fc(x).mul_(0.25)),
    "other-tensor": lambda fc, proj, x: proj(fc(x) * 0.25),
    "consumer-not-called": lambda fc, proj, x: fc(x),
    "two-chain-calls-first-consumed": lambda fc, proj, x: (lambda a, b: proj(a))(fc(x), fc(x * 4.0)),
    "two-chain-calls-both-consumed": lambda fc, proj, x: (lambda a, b: (proj(a), proj(b)))(fc(x * 4.0), fc(x)),
    "consumer-unfused": lambda fc, proj, x: (setattr(proj, "fused", False), proj(fc(x)), setattr(proj, "fused", True)),
    "used": lambda fc, proj, x: proj(fc(x)),
}


@pytest.mark.parametrize("sequence", list(_SEQUENCES))
def test_an_unused_hand_off_leaves_no_amax_behind(sequence):
    # The chain's pass max-reduces its output's amax into the consumer's input slot when it writes the
    # FP8 copy. A consumer that then quantizes another tensor (or none) must record only that tensor's
    # amax, as an unlinked consumer does: a larger stale amax would shrink its scale for as many steps
    # as the history holds.
    x = torch.randn(8, 16) * 3.0
    histories = []
    for linked in (True, False):
        fc, proj, state = _pair(linked)
        with fp8_autocast(DelayedScaling(amax_history_len=4), update_scales=False):
            _SEQUENCES[sequence](fc, proj, x)
        newest = state.groups["forward"].history[0].clone()
        with fp8_autocast(DelayedScaling(amax_history_len=4)):  # a step that updates: pending hand-offs settle first
            _SEQUENCES[sequence](fc, proj, x)
        histories.append((newest, state.groups["forward"].history.clone(), state.groups["forward"].scale.clone()))
    (newest_a, history_a, scale_a), (newest_b, history_b, scale_b) = histories
    if sequence != "consumer-not-called":  # (that hand-off stays pending until the update: proj may still run)
        assert torch.equal(newest_a[2], newest_b[2]), (newest_a, newest_b)  # slot 2: proj's input
    assert torch.equal(history_a, history_b) and torch.equal(scale_a, scale_b)


def test_a_compiled_consumer_records_its_own_input_amax(monkeypatch):
    # A compiled consumer never takes a hand-off (the graph quantizes its input itself), so the eager
    # chain's copy goes unused and its amax must not count, nor erase what the graph recorded.
    x = torch.randn(8, 16) * 3.0
    results = []
    for linked in (True, False):
        fc, proj, state = _pair(linked)
        compiled = torch.compile(proj, backend="aot_eager")
        with fp8_autocast(DelayedScaling(amax_history_len=4)):
            monkeypatch.setenv("TRITON_INTERPRET", "1")  # the chain's kernels (a hand-off needs them)
            h = fc(x) * 0.25 if not linked else fc(x)
            if linked:
                h.mul_(0.25)
            monkeypatch.setenv("TRITON_INTERPRET", "0")  # a triton_op cannot compile on CPU: its references
            compiled(h)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        results.append((state.groups["forward"].history[:, 2].clone(), state.groups["forward"].scale[2].clone()))
    (history_a, scale_a), (history_b, scale_b) = results
    assert history_b.max() > 0
    assert torch.equal(history_a, history_b) and torch.equal(scale_a, scale_b)
