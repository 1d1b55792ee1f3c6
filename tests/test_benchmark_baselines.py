"""The benchmarks' PyTorch baselines (benchmarks/common.py) compute what the kernels they are timed
against compute: a baseline doing less work, or other work, would make every speedup wrong."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fp8_checks import assert_fp8_close, sqnr_db
from lightning_fuse.kernels import dact_dbias_quantize, dact_dbias_quantize_current_scaling, dbias_quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
common = pytest.importorskip("common")  # needs triton.testing, as the benchmarks do

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E5M2 = torch.float8_e5m2


def _inputs(m=67, n=48, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(m, n, generator=g).to(DEVICE, dtype),
            (2 * torch.randn(m, n, generator=g)).to(DEVICE, dtype))


@pytest.mark.parametrize("with_activation", [True, False])
def test_the_current_scaling_baseline_matches_the_two_passes(with_activation):
    grad, pre = _inputs()
    pre = pre if with_activation else None
    activation = "gelu_tanh" if with_activation else None
    q, q_t, dbias, amax, scale = dact_dbias_quantize_current_scaling(grad, pre, activation, fp8_dtype=E5M2,
                                                                     transpose=True)
    bq, bq_t, bdbias, bamax, bscale = common.unfused_current_scaling(grad, pre, "tanh" if with_activation else None,
                                                                     E5M2)
    assert torch.equal(bq_t.view(torch.uint8), bq.view(torch.uint8).t())
    if with_activation:  # eager's gelu_backward rounds dx to bf16 first: the same math, less precise
        _assert_same_math(q, scale, dbias, amax, bq, bscale, bdbias, bamax)
    else:
        assert amax.item() == bamax.item() and scale.item() == pytest.approx(bscale.item(), rel=1e-6)
        assert_fp8_close(q.cpu(), bq.cpu())
        torch.testing.assert_close(dbias, bdbias, rtol=1e-5, atol=1e-5)


def _assert_same_math(q, scale, dbias, amax, bq, bscale, bdbias, bamax):
    """The baseline's outputs within bf16's precision of ours: amax and scale within 1%, the values
    the FP8 codes stand for at an SQNR of 25 dB (an e5m2 cast's own is about 30), the bias gradient
    within 1% of its norm."""
    assert amax.reshape(()).item() == pytest.approx(bamax.reshape(()).item(), rel=1e-2)
    assert scale.item() == pytest.approx(bscale.item(), rel=1e-2)
    assert sqnr_db(bq.double() / bscale.double(), q.double() / scale.double()) >= 25
    assert ((bdbias.double() - dbias.double()).norm() / dbias.double().norm()).item() < 1e-2


def test_the_delayed_scaling_baselines_match_the_one_pass_kernels():
    grad, pre = _inputs()
    scale = torch.tensor(512.0, device=DEVICE)
    amax, bamax = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    q, q_t, dbias = dact_dbias_quantize(grad, pre, "gelu_tanh", scale=scale, fp8_dtype=E5M2, amax=amax,
                                        transpose=True)
    bq, bq_t, bdbias = common.unfused_dact_dbias_quantize(grad, pre, "tanh", scale, E5M2, bamax)
    _assert_same_math(q, scale, dbias, amax, bq, scale, bdbias, bamax)
    q, q_t, dbias = dbias_quantize(grad, scale=scale, fp8_dtype=E5M2, amax=amax, transpose=True)
    bq, bq_t, bdbias = common.unfused_dbias_quantize(grad, scale, E5M2, bamax)
    assert torch.equal(q.view(torch.uint8), bq.view(torch.uint8))
    assert torch.equal(bq_t.view(torch.uint8), bq.view(torch.uint8).t())
    torch.testing.assert_close(dbias, bdbias, rtol=1e-5, atol=1e-5)
