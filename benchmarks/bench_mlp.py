"""MLP block benchmark (GPU): ``Linear(d, 4d) -> GELU(tanh) -> Linear(4d, d)``, 16384 tokens,
forward + backward, bf16, for d in {1600, 2048, 4096, 8192}.

Variants, timed in the same run (median of CUDA-event timings after warm-up):
  bf16 eager, bf16 torch.compile,
  ours eager (fused modules + fp8_autocast(DelayedScaling())), ours + torch.compile,
  ours with the fused backward kernels replaced by the unfused PyTorch sequence (what the fusion buys),
  torchao float8 (convert_to_float8_training) + torch.compile.
Gradient SQNR of ours against bf16 eager is reported too.

    python benchmarks/bench_mlp.py --out results/mlp
"""

from __future__ import annotations

import argparse
import copy
import time
from unittest import mock

import torch
from torch import nn

from common import environment, median_ms, print_table, unfused_dact_dbias_quantize, unfused_dbias_quantize
from common import write_results
import lightning_fuse
from lightning_fuse import DelayedScaling, FuseConfig, fp8_autocast, fuse_

TOKENS = 16384


def mlp(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d)).cuda().bfloat16()


def step_fn(model, x, dy, context=None):
    params = [p for p in model.parameters()]

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        if context is not None:
            with context():
                y = model(x)
        else:
            y = model(x)
        y.backward(dy)
    return step


def grads(model, x):
    return [x.grad.float()] + [p.grad.float() for p in model.parameters()]


def sqnr(a, b):
    return (20 * torch.log10(b.norm() / (a - b).norm())).item()


def _unfused_backward():
    """Patches the modules' fused backward kernels with the PyTorch sequence they replace."""
    def dact(grad, pre_act, activation, *, scale=None, fp8_dtype=None, amax=None, transpose=False,
             dbias_dtype=torch.float32):
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        q, q_t, db = unfused_dact_dbias_quantize(grad, pre_act, approximate, scale, fp8_dtype, amax, transpose)
        return q, q_t, db.to(dbias_dtype)

    def dbias(grad, *, scale=None, fp8_dtype=None, amax=None, transpose=False, dbias_dtype=torch.float32):
        q, q_t, db = unfused_dbias_quantize(grad, scale, fp8_dtype, amax, transpose)
        return q, q_t, db.to(dbias_dtype)
    return mock.patch.multiple("lightning_fuse.modules", dact_dbias_quantize=dact, dbias_quantize=dbias)


def bench_d(d: int, with_torchao: bool) -> dict:
    torch.manual_seed(0)
    base = mlp(d)
    x = torch.randn(TOKENS, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, d, device="cuda", dtype=torch.bfloat16)
    row = {"d": d}
    t0 = time.time()

    eager = step_fn(base, x, dy)
    eager()
    ref_grads = grads(base, x)
    row["bf16_eager_ms"] = median_ms(eager)

    # Every eager variant is timed before the first torch.compile of the run: compiling starts
    # Inductor's worker processes, which compete for the host CPU that an eager step is issued from.
    ours = copy.deepcopy(base)
    fuse_(ours, FuseConfig(convert="mlp"))
    recipe = DelayedScaling()
    ctx = lambda: fp8_autocast(recipe)  # noqa: E731
    ours_step = step_fn(ours, x, dy, ctx)
    for _ in range(3):
        ours_step()
    g = grads(ours, x)
    row["sqnr_dx"] = sqnr(g[0], ref_grads[0])
    row["sqnr_dw1"] = sqnr(g[1], ref_grads[1])
    row["sqnr_dw2"] = sqnr(g[3], ref_grads[3])
    row["ours_eager_ms"] = median_ms(ours_step)
    with _unfused_backward():
        row["ours_unfused_bwd_ms"] = median_ms(ours_step)
    row["bf16_compile_ms"] = median_ms(step_fn(torch.compile(base), x, dy))
    try:
        row["ours_compile_ms"] = median_ms(step_fn(torch.compile(ours), x, dy, ctx))
    except Exception as exc:  # report, keep going
        print(f"ours + compile failed at d={d}: {exc!r}"[:400])
        row["ours_compile_ms"] = float("nan")
    if with_torchao:
        from torchao.float8 import convert_to_float8_training

        ao = convert_to_float8_training(copy.deepcopy(base))
        row["torchao_compile_ms"] = median_ms(step_fn(torch.compile(ao), x, dy))
    else:
        row["torchao_compile_ms"] = float("nan")
    row["vs_bf16_eager"] = row["bf16_eager_ms"] / row["ours_eager_ms"]
    row["vs_torchao"] = row["torchao_compile_ms"] / row["ours_eager_ms"]
    row["fusion_gain"] = row["ours_unfused_bwd_ms"] / row["ours_eager_ms"]
    row["wall_s"] = time.time() - t0
    torch._dynamo.reset()
    return row


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["bf16_eager_ms", "bf16_compile_ms", "ours_eager_ms", "ours_compile_ms", "ours_unfused_bwd_ms",
            "torchao_compile_ms"]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.13
    for i, key in enumerate(keys):
        ax.bar([j + (i - 2.5) * width for j in range(len(rows))],
               [rows[j]["bf16_eager_ms"] / rows[j][key] for j in range(len(rows))], width, label=key[:-3])
    ax.set_xticks(range(len(rows)), [f"d={r['d']}" for r in rows])
    ax.set_ylabel("speedup over bf16 eager")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.legend(fontsize=7)
    ax.set_title(f"MLP block, {TOKENS} tokens, forward + backward")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/mlp")
    parser.add_argument("--dims", default="1600,2048,4096,8192")
    parser.add_argument("--no-torchao", action="store_true")
    args = parser.parse_args()
    print(environment(), "lightning_fuse", lightning_fuse.__file__)
    rows = []
    for d in [int(v) for v in args.dims.split(",")]:
        rows.append(bench_d(d, not args.no_torchao))
        print_table(rows[-1:], list(rows[-1]))
        out = write_results(args.out, "mlp", rows)
    plot(rows, out / "mlp.png")
    print_table(rows, ["d", "bf16_eager_ms", "bf16_compile_ms", "ours_eager_ms", "ours_compile_ms",
                       "ours_unfused_bwd_ms", "torchao_compile_ms", "vs_bf16_eager", "vs_torchao", "sqnr_dw1"])


if __name__ == "__main__":
    main()
