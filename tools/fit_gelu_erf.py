"""The erf-GELU kernels' polynomial: ``0.5 erfcx(|x| / sqrt 2)`` as a degree-8 polynomial in
``t = 1 / (1 + 0.2275 |x|)``, fitted for least maximum relative error on ``|x| <= 13.3`` (beyond it
``exp(-x^2 / 2)`` is 0 in float32, so the polynomial's value no longer matters).

``kernels/activations.py`` evaluates ``0.5 erfc(|x| / sqrt 2) = exp(-x^2 / 2) * H(t)`` with it, which
shares the exponential the derivative's ``x phi(x)`` term needs anyway: one reciprocal, eight
multiply-adds and a select in place of libdevice's ``erf``.

    python tools/fit_gelu_erf.py        # prints the coefficients (lowest power first) and the fit's error

The fit is Lawson's iteratively reweighted least squares (it converges to the minimax fit) in
float64 against ``torch.special.erfcx``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch


def fit(q: float = 0.2275, degree: int = 8, x_max: float = 13.3, iterations: int = 60) -> tuple[np.ndarray, float]:
    """Coefficients of ``H`` (lowest power first) and the fit's largest relative error."""
    x = np.concatenate([np.linspace(0.0, 4.0, 20000), np.linspace(4.0, x_max, 20000)])
    t = 1.0 / (1.0 + q * x)
    target = 0.5 * torch.special.erfcx(torch.from_numpy(x / np.sqrt(2.0))).numpy()
    basis = np.vander(t, degree + 1, increasing=True)
    weights = np.ones_like(t)
    for _ in range(iterations):
        row = np.sqrt(weights) / target
        coefficients, *_ = np.linalg.lstsq(basis * row[:, None], target * row, rcond=None)
        error = (basis @ coefficients - target) / target
        weights = weights * np.abs(error)
        weights /= weights.sum()
    return coefficients, float(np.abs(error).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--q", type=float, default=0.2275)
    parser.add_argument("--degree", type=int, default=8)
    args = parser.parse_args()
    coefficients, error = fit(args.q, args.degree)
    print(f"q = {args.q}, degree {args.degree}: largest relative error {error:.3e}")
    for k, c in enumerate(coefficients):
        print(f"  t^{k}: {float(c)!r}")


if __name__ == "__main__":
    main()
