"""The backward passes with their FP8 stores (and loads) through TMA tensor descriptors, against
the pointer loads and stores the library ships: every output byte checked against the shipped
pass, then both timed in the same run (CUDA-graph medians, bf16 inputs).

A variant is ``(tma_load, tma_row, tma_t)``:

- ``tma_load``: ``grad``/``pre_act`` row sets loaded through a 3-D descriptor ``[M/4, 4, N]``;
- ``tma_row``: the row-wise FP8 copy stored through a 3-D descriptor, one row set at a time (1), or
  as the whole ``block_m x block_n`` tile reassembled from the four row sets (2);
- ``tma_t``: the transposed copy's packed 32-bit words stored through a 2-D descriptor.

Each variant runs at the library's grid and at the fewest whole waves for its own residency. The
variants' row loop does not prefetch (``LaunchConfig.prefetch``) and pipelines only as deep as the
shipped launch asks (``loop_stages``; 0 for the prefetching passes): against the prefetching passes
they also measure the prefetch. The table in BENCHMARKS.md was taken before it.
Needs ``M % 16 == 0`` and ``N % 16 == 0`` (descriptor strides are 16-byte multiples).

    python benchmarks/tma_variants.py --out results/tma
"""

from __future__ import annotations

import argparse
import importlib

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench_kernels import SIZES, _resident_per_sm
from common import copy_bandwidth_gbps, environment, graph_ms, parse_sizes, print_table, write_results
from lightning_fuse.kernels._launch import (LAUNCH_RULES, LaunchRule, _pick_config, fp8_encoder, row_groups_rule,
                                            row_loop)
from lightning_fuse.kernels.activations import act_derivative, activation_id
from lightning_fuse.kernels.fp8 import amax_finish, amax_update, fp8_codes

ddq = importlib.import_module("lightning_fuse.kernels.dact_dbias_quantize")

# pass -> (activation id, FP8 code, bias gradient)
PASSES = {"dact_dbias_quantize": (activation_id("gelu_tanh"), 2, True), "dbias_quantize": (0, 2, True),
          "quantize": (0, 1, False)}
VARIANTS = [(0, 0, 0), (0, 0, 1), (0, 1, 1), (0, 2, 1), (1, 0, 0), (1, 0, 1), (1, 1, 1), (1, 2, 1)]


@triton.jit
def _row_set(grad_ptr, pre_ptr, g_desc, p_desc, rows, j, m0, n0, offs_n, mask, stride_g, stride_p,
             ACTIVATION: tl.constexpr, TMA_LOAD: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr):
    """``dx`` of row set ``j``: through the descriptors, or the shipped pass's pointer loads."""
    if TMA_LOAD:
        dx = g_desc.load([m0 // 4, j, n0]).reshape(BQ, BN).to(tl.float32)
        if ACTIVATION != 0:
            dx = dx * act_derivative(p_desc.load([m0 // 4, j, n0]).reshape(BQ, BN).to(tl.float32), ACTIVATION)
    else:
        dx = ddq._dx_rows(grad_ptr, pre_ptr, rows, offs_n, mask, stride_g, 1, stride_p, 1, ACTIVATION)
    return dx


@triton.jit
def _store_row_set(out_ptr, o_desc, rows, j, m0, n0, offs_n, mask, stride_o, dx, scale, FP8_FORMAT: tl.constexpr,
                   ENCODER: tl.constexpr, TMA_ROW: tl.constexpr, BQ: tl.constexpr, BN: tl.constexpr):
    """The FP8 codes of row set ``j`` (int32), stored row-wise through the descriptor (``TMA_ROW`` 1),
    by the shipped pass's pointer store (0), or not yet (2: the caller stores the whole tile)."""
    if TMA_ROW == 0:
        codes = ddq.store_codes(out_ptr, out_ptr, rows, offs_n, mask, stride_o, 0, dx, scale, FP8_FORMAT, ENCODER,
                                False, True)
    else:
        codes = fp8_codes(dx * scale, FP8_FORMAT, ENCODER)
        if TMA_ROW == 1:
            o_desc.store([m0 // 4, j, n0], codes.to(tl.uint8).reshape(BQ, 1, BN))
    return codes


@triton.jit
def _tma_variant_kernel(grad_ptr, pre_ptr, out_ptr, out_t_ptr, g_desc, p_desc, o_desc, tile_desc, t_desc,
                        partial_ptr, dbias_ptr, counter_ptr, scale_ptr, amax_ptr,
                        stride_g, stride_p, stride_o, stride_t, M, N, rows_per_group,
                        ACTIVATION: tl.constexpr, FP8_FORMAT: tl.constexpr, COMPUTE_DBIAS: tl.constexpr,
                        ENCODER: tl.constexpr, TMA_LOAD: tl.constexpr, TMA_ROW: tl.constexpr, TMA_T: tl.constexpr,
                        LOOP_STAGES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The shipped pass (kernels/dact_dbias_quantize.py, transposed copy packed, amax on), built from
    # its helpers, with the loads and stores each taken through a descriptor or not.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    BQ: tl.constexpr = BLOCK_M // 4
    quarter = tl.arange(0, BQ)
    row_start, row_end, row_step = row_loop(pid_m, rows_per_group, M, BLOCK_M, False)
    dbias_acc = tl.zeros((BQ, BLOCK_N), dtype=tl.float32)
    amax_acc = tl.zeros((BQ, BLOCK_N), dtype=tl.float32)
    scale = tl.load(scale_ptr)
    for m0 in tl.range(row_start, row_end, row_step, num_stages=LOOP_STAGES):
        r0 = m0 + 4 * quarter
        k0 = (r0 < M)[:, None] & mask_n[None, :]
        k1 = (r0 + 1 < M)[:, None] & mask_n[None, :]
        k2 = (r0 + 2 < M)[:, None] & mask_n[None, :]
        k3 = (r0 + 3 < M)[:, None] & mask_n[None, :]
        d0 = _row_set(grad_ptr, pre_ptr, g_desc, p_desc, r0, 0, m0, n0, offs_n, k0, stride_g, stride_p,
                      ACTIVATION, TMA_LOAD, BQ, BLOCK_N)
        d1 = _row_set(grad_ptr, pre_ptr, g_desc, p_desc, r0 + 1, 1, m0, n0, offs_n, k1, stride_g, stride_p,
                      ACTIVATION, TMA_LOAD, BQ, BLOCK_N)
        d2 = _row_set(grad_ptr, pre_ptr, g_desc, p_desc, r0 + 2, 2, m0, n0, offs_n, k2, stride_g, stride_p,
                      ACTIVATION, TMA_LOAD, BQ, BLOCK_N)
        d3 = _row_set(grad_ptr, pre_ptr, g_desc, p_desc, r0 + 3, 3, m0, n0, offs_n, k3, stride_g, stride_p,
                      ACTIVATION, TMA_LOAD, BQ, BLOCK_N)
        if COMPUTE_DBIAS:
            dbias_acc += (d0 + d1) + (d2 + d3)
        amax_acc = amax_update(amax_update(amax_update(amax_update(amax_acc, d0), d1), d2), d3)
        c0 = _store_row_set(out_ptr, o_desc, r0, 0, m0, n0, offs_n, k0, stride_o, d0, scale, FP8_FORMAT, ENCODER,
                            TMA_ROW, BQ, BLOCK_N)
        c1 = _store_row_set(out_ptr, o_desc, r0 + 1, 1, m0, n0, offs_n, k1, stride_o, d1, scale, FP8_FORMAT, ENCODER,
                            TMA_ROW, BQ, BLOCK_N)
        c2 = _store_row_set(out_ptr, o_desc, r0 + 2, 2, m0, n0, offs_n, k2, stride_o, d2, scale, FP8_FORMAT, ENCODER,
                            TMA_ROW, BQ, BLOCK_N)
        c3 = _store_row_set(out_ptr, o_desc, r0 + 3, 3, m0, n0, offs_n, k3, stride_o, d3, scale, FP8_FORMAT, ENCODER,
                            TMA_ROW, BQ, BLOCK_N)
        if TMA_ROW == 2:
            # [BQ, BN, 2, 2] holding c(2a + b) at [i, n, a, b] -> rows m0 + 4 i + 2 a + b
            tile = tl.join(tl.join(c0, c2), tl.join(c1, c3))
            tile_desc.store([m0, n0], tl.permute(tile, (0, 2, 3, 1)).reshape(BLOCK_M, BLOCK_N).to(tl.uint8))
        if TMA_T:
            t_desc.store([n0, m0 // 4], tl.trans(c0 | (c1 << 8) | (c2 << 16) | (c3 << 24)))
        else:
            ddq.store_packed_transpose(out_t_ptr, m0, quarter, offs_n, mask_n, M, stride_t, c0, c1, c2, c3)
    if COMPUTE_DBIAS:
        ddq.store_bias_gradient_partial(partial_ptr, dbias_ptr, counter_ptr, dbias_acc, pid_m, pid_n, offs_n, mask_n,
                                        N, tl.num_programs(1), True, False)
    tl.atomic_max(amax_ptr, amax_finish(amax_acc))


def launch_variant(grad, pre, activation, scale, fp8_code, amax, with_dbias, cfg, out, out_t, dbias, variant):
    """One launch of ``variant`` into uint8 ``out``/``out_t``; returns the compiled kernel."""
    m, n = grad.shape
    bm, bn = cfg.block_m, cfg.block_n
    rows_per_group, groups = cfg.row_groups(m)
    partials = torch.empty((groups, n), dtype=torch.float32, device=grad.device)
    counters = ddq._arrival_counters(grad.device, -(-n // bn))
    pre = pre if pre is not None else grad
    row_sets = ([m // 4, 4, n], [4 * n, n, 1], [bm // 4, 1, bn])
    g_desc, p_desc, o_desc = (TensorDescriptor(t, *row_sets) for t in (grad, pre, out))
    tile_desc = TensorDescriptor(out, [m, n], [n, 1], [bm, bn])
    t_desc = TensorDescriptor(out_t.view(torch.int32), [n, m // 4], [m // 4, 1], [bn, bm // 4])
    return _tma_variant_kernel[(-(-n // bn), groups)](
        grad, pre, out, out_t, g_desc, p_desc, o_desc, tile_desc, t_desc, partials, dbias, counters, scale, amax,
        grad.stride(0), pre.stride(0), out.stride(0), out_t.stride(0), m, n, rows_per_group,
        ACTIVATION=activation, FP8_FORMAT=fp8_code, COMPUTE_DBIAS=with_dbias, ENCODER=fp8_encoder(grad),
        TMA_LOAD=variant[0], TMA_ROW=variant[1], TMA_T=variant[2], LOOP_STAGES=cfg.loop_stages or None,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=cfg.num_warps)


def run(sizes, copy_gbps, out_dir):
    rows = []
    for (name, (activation, fp8_code, with_dbias)), (m, n) in [(p, s) for p in PASSES.items() for s in sizes]:
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        pre = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 if activation else None
        scale = torch.tensor(2048.0 if fp8_code == 2 else 32.0, device="cuda")
        amax = torch.zeros(1, device="cuda")
        out = torch.empty(m, n, dtype=torch.uint8, device="cuda")
        out_t = torch.empty(n, m, dtype=torch.uint8, device="cuda")
        dbias = torch.empty(n, device="cuda")
        # The row groups' launch: the variants are forms of the row-group kernel (the fused pass's queued
        # form, where the rule takes it, is another kernel).
        cfg = _pick_config(m, n, grad.device, row_groups_rule(LAUNCH_RULES[name]))

        def shipped():
            ddq._launch(grad, pre, activation, scale, fp8_code, amax, True, with_dbias, True, cfg, out, out_t, dbias,
                        False)

        shipped()
        expected = (out.clone(), out_t.clone(), dbias.clone())
        nbytes = m * n * ((4 if activation else 2) + 2)
        t_shipped = graph_ms(shipped, rep_ms=80)
        rows.append(dict(kernel=name, M=m, N=n, variant="shipped", groups=cfg.groups, regs="", resident="",
                         ms=t_shipped, frac_copy=nbytes / t_shipped / 1e6 / copy_gbps, vs_shipped=1.0, ok=True))
        print_table(rows[-1:], list(rows[-1]))
        for variant in VARIANTS:
            def launch(c, variant=variant):
                return launch_variant(grad, pre, activation, scale, fp8_code, amax, with_dbias, c, out, out_t, dbias,
                                      variant)
            try:
                compiled = launch(cfg)
                resident = _resident_per_sm(compiled, cfg.num_warps)
                own = _pick_config(m, n, grad.device, LaunchRule(cfg.block_m, cfg.block_n, cfg.num_warps,
                                                                  cfg.loop_stages, resident, True))
                for c in dict.fromkeys([cfg, own]):
                    out.fill_(7)
                    out_t.fill_(7)
                    launch(c)
                    # The bias gradient's bits depend on the number of row groups: compared at the shipped grid.
                    ok = torch.equal(out, expected[0]) and torch.equal(out_t, expected[1]) and (
                        not with_dbias or c.groups != cfg.groups or torch.equal(dbias, expected[2]))
                    ms = graph_ms(lambda: launch(c), rep_ms=80)
                    rows.append(dict(kernel=name, M=m, N=n, variant=str(variant), groups=c.groups,
                                     regs=compiled.n_regs,
                                     resident=resident, ms=ms, frac_copy=nbytes / ms / 1e6 / copy_gbps,
                                     vs_shipped=t_shipped / ms, ok=ok))
                    print_table(rows[-1:], list(rows[-1]))
            except Exception as exc:  # a form the compiler rejects
                rows.append(dict(kernel=name, M=m, N=n, variant=str(variant), groups="", regs="", resident="",
                                 ms=float("nan"), frac_copy=float("nan"), vs_shipped=float("nan"), ok=repr(exc)[:120]))
        write_results(out_dir, "tma", rows, {"copy_GBps": copy_gbps})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(f"{m}x{n}" for m, n in SIZES))
    parser.add_argument("--out", default="results/tma")
    args = parser.parse_args()
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth_gbps()
    print(f"{environment()}  copy bandwidth {copy_gbps:.0f} GB/s")
    rows = run(parse_sizes(args.sizes), copy_gbps, args.out)
    best = {}
    for r in rows:
        key = (r["kernel"], r["M"], r["N"], r["variant"])
        if r["ms"] == r["ms"] and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    print_table(list(best.values()), ["kernel", "M", "N", "variant", "groups", "ms", "frac_copy", "vs_shipped", "ok"])


if __name__ == "__main__":
    main()
