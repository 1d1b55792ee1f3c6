"""The one-launch delayed-scaling update against its PyTorch reference (and against the recipe's
formula): bit-identical scales, histories and non-finite counters, for every history length the
kernel handles, NaN/inf/zero amaxes, both amax algorithms and a margin."""

from __future__ import annotations

import pytest
import torch

from lightning_fuse.kernels import update_scales, update_scales_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _group(length, slots, seed):
    g = torch.Generator().manual_seed(seed)
    history = torch.rand(length, slots, generator=g) * torch.logspace(-3, 3, slots)
    history[1:, 0] = 0.0  # a tensor that never ran before
    if slots > 2:
        history[0, 1] = float("nan")
        history[0, 2] = float("inf")
    if slots > 3:
        history[:, 3] = 0.0  # all-zero: keeps its scale
    scale_storage = torch.rand(slots, 4, generator=g) + 0.5
    nonfinite = torch.randint(0, 3, (slots,), generator=g)
    return history.to(DEVICE), scale_storage.to(DEVICE)[:, 0], nonfinite.to(DEVICE)


@pytest.mark.parametrize("length,slots", [(1, 1), (3, 7), (5, 2), (16, 300), (1024, 6)])
@pytest.mark.parametrize("use_max", [True, False], ids=["max", "most_recent"])
@pytest.mark.parametrize("fp8_max,margin", [(448.0, 0), (57344.0, 2)])
def test_kernel_matches_the_recipe_and_the_reference(length, slots, use_max, fp8_max, margin):
    history, scale, nonfinite = _group(length, slots, seed=length * 1000 + slots)
    h_ref, n_ref = history.clone(), nonfinite.clone()
    h_ref, s_ref, si_ref = update_scales_reference(h_ref, scale, n_ref, fp8_max=fp8_max, margin=margin, use_max=use_max)
    original = history.clone()
    newest = history[0].clone()
    amax = history.nan_to_num(0.0, 0.0).amax(0) if use_max else newest.nan_to_num(0.0, 0.0)
    out_h, out_s, out_si = update_scales(history, scale, nonfinite, fp8_max=fp8_max, margin=margin, use_max=use_max)
    # The recipe's formula, correctly rounded from float64: the kernel's divisions are IEEE ones.
    finite = torch.isfinite(newest)
    exact = (fp8_max / amax.double().clamp_min(1e-38) / 2.0 ** margin).float()
    expected = torch.where(finite & (amax > 0), exact, scale)
    assert torch.equal(out_s, expected)
    assert torch.equal(out_si, (1.0 / expected.double()).float())
    # PyTorch's scalar division may be one ulp off the correctly rounded value.
    torch.testing.assert_close(s_ref, expected, rtol=2.5e-7, atol=0)
    torch.testing.assert_close(si_ref, out_si, rtol=5e-7, atol=0)
    assert torch.equal(out_h, h_ref) and torch.equal(nonfinite, n_ref)
    assert torch.equal(out_h[0], torch.zeros_like(out_h[0]))
    if length > 1:
        assert torch.equal(out_h[1], torch.where(finite, newest, torch.zeros_like(newest)))
        assert torch.equal(out_h[2:], original[1:-1])  # older rows move down by one


def test_new_scales_are_new_tensors_spaced_16_bytes():
    history, scale, nonfinite = _group(4, 5, seed=1)
    before = scale.clone()
    _, new, new_inv = update_scales(history, scale, nonfinite, fp8_max=448.0, margin=0, use_max=True)
    assert torch.equal(scale, before)  # the old scale is never written: a pending backward may hold it
    assert new.stride(0) == 4 and new_inv.stride(0) == 4
    assert all(new[i].data_ptr() % 16 == 0 for i in range(5))


@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_an_amax_too_small_for_a_finite_scale_gets_the_largest_finite_one(fp8_max):
    # fp8_max / 1e-37 overflows float32; an infinite scale would turn every zero it multiplies into NaN
    history = torch.tensor([[1e-37, 1.0]], device=DEVICE)
    scale = torch.ones(2, device=DEVICE)
    for update in (update_scales, update_scales_reference):
        _, new, new_inv = update(history.clone(), scale, torch.zeros(2, dtype=torch.int64, device=DEVICE),
                                 fp8_max=fp8_max, margin=0, use_max=True)
        assert new.tolist() == [torch.finfo(torch.float32).max, fp8_max], update.__name__
        assert new_inv[0].item() == (1.0 / torch.tensor(torch.finfo(torch.float32).max)).item() > 0


def test_the_reference_rolls_the_history_in_place():
    history = torch.tensor([[4.0, 2.0], [1.0, 8.0]])
    scale, nonfinite = torch.ones(2), torch.zeros(2, dtype=torch.int64)
    returned, _, _ = update_scales_reference(history, scale, nonfinite, fp8_max=448.0, margin=0, use_max=True)
    assert returned is history
    assert torch.equal(history, torch.tensor([[0.0, 0.0], [4.0, 2.0]]))


@pytest.mark.parametrize("history, scale, nonfinite, match", [
    (torch.zeros(0, 3), torch.ones(3), torch.zeros(3, dtype=torch.int64), "`history` must be a float32 \\(length >= 1"),
    (torch.zeros(4, 3, dtype=torch.float16), torch.ones(3), torch.zeros(3, dtype=torch.int64), "`history` must be"),
    (torch.zeros(4, 5), torch.ones(3), torch.zeros(5, dtype=torch.int64), r"`scale` must be a float32 \(5,\) tensor"),
    (torch.zeros(4, 3), torch.ones(3), torch.zeros(3, dtype=torch.int32), r"`nonfinite` must be a contiguous int64"),
    (torch.zeros(4, 3), torch.ones(3), "strided", "`nonfinite` must be a contiguous"),
])
def test_bad_arguments_are_refused_naming_what_was_given(history, scale, nonfinite, match):
    if isinstance(nonfinite, str):  # strided on the device itself: moving a view there would copy it contiguous
        nonfinite = torch.zeros(6, dtype=torch.int64, device=DEVICE)[::2]
        assert not nonfinite.is_contiguous()
    for update in (update_scales, update_scales_reference):
        with pytest.raises(ValueError, match=match):
            update(history.to(DEVICE), scale.to(DEVICE), nonfinite.to(DEVICE), fp8_max=448.0, margin=0, use_max=True)


@pytest.mark.parametrize("fp8_max, margin, match", [
    (448.0, None, r"`margin` must be an int .*; got None$"),
    (448.0, 1.5, r"`margin` must be an int .*; got 1.5$"),
    (None, 0, r"`fp8_max` must be a positive finite number .*; got None$"),
    (-448.0, 0, r"`fp8_max` must be a positive finite number .*; got -448.0$"),
    (float("inf"), 0, r"`fp8_max` must be a positive finite number .*; got inf$"),
])
def test_bad_fp8_max_or_margin_is_refused_before_anything_changes(fp8_max, margin, match):
    history, scale, nonfinite = _group(3, 4, seed=2)
    before = history.clone(), nonfinite.clone()
    for update in (update_scales, update_scales_reference):
        with pytest.raises(ValueError, match=match):
            update(history, scale, nonfinite, fp8_max=fp8_max, margin=margin, use_max=True)
        # refused, not half-applied (bit for bit: the history holds a NaN)
        assert torch.equal(history.view(torch.int32), before[0].view(torch.int32)) and torch.equal(nonfinite, before[1])
