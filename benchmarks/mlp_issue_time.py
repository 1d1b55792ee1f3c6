"""Is the FP8 MLP step bound by the host? For the MLP block of bench_mlp.py (16384 tokens, bf16,
``FuseConfig(convert="mlp")`` under delayed scaling), the step's time (CUDA events, median) against
the host time it takes to issue one step (``perf_counter`` over 8 steps started from an idle GPU,
best of 3, no synchronization inside). Where the issue time reaches the step time, the GPU waits
on Python and the step's time follows the host, not the kernels.

Each d runs twice, and each time with the bias gradient finished inside the backward pass (the
library's eager path) and by the separate sum launch (as under ``torch.compile``).

    cd benchmarks && python mlp_issue_time.py
"""

from __future__ import annotations

import contextlib
import copy

import torch

from bench_mlp import TOKENS, mlp, step_fn
from common import environment, host_ms, median_ms, separate_sum_launch
from lightning_fuse import DelayedScaling, FuseConfig, fp8_autocast, fuse_


def main():
    print(environment())
    for d in (1600, 2048):
        torch.manual_seed(0)
        base = mlp(d)
        x = torch.randn(TOKENS, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(TOKENS, d, device="cuda", dtype=torch.bfloat16)
        eager = step_fn(base, x, dy)
        ours = copy.deepcopy(base)
        fuse_(ours, FuseConfig(convert="mlp"))
        recipe = DelayedScaling()
        ours_step = step_fn(ours, x, dy, lambda: fp8_autocast(recipe))
        for _ in range(5):
            ours_step()
            eager()
        for rep in range(2):
            for name, mode in (("in-pass dbias", contextlib.nullcontext), ("separate sum launch", separate_sum_launch)):
                with mode():
                    ms = median_ms(ours_step)
                    host = min(host_ms(ours_step, calls=8, warmup=0) for _ in range(3))
                print(f"d={d} rep {rep} ours {name:20s} step {ms:.3f} ms  cpu issue {host:.3f} ms", flush=True)
            host = min(host_ms(eager, calls=8, warmup=0) for _ in range(3))
            print(f"d={d} rep {rep} bf16 eager step {median_ms(eager):.3f} ms  cpu issue {host:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
