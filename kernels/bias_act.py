"""Forward activation with an optional bias add, optionally writing the FP8 copies of the output
(row-wise and transposed, with its amax) that the next FP8 linear consumes, in the same pass.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from ._launch import (LaunchConfig, as_rows, check_amax, check_float_tensor, check_scale, fp8_encoder, launch_config,
                      launcher, needs_index_64, row_loop, use_triton)
from .activations import act_forward, activation_id, activation_reference
from .fp8 import FORMAT_DTYPES, amax_finish, amax_update, fp8_codes, fp8_format

__all__ = ["bias_act", "bias_act_reference"]

@triton.jit
def _bias_act_kernel(
    h_ptr, bias_ptr, y_ptr, q_ptr, q_t_ptr, scale_ptr, amax_ptr, pre_ptr,
    stride_h_m, stride_h_n, stride_y_m, stride_q_m, stride_q_t_n, stride_pre_m,
    M, N, rows_per_group,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE_PRE: tl.constexpr,  # write h + bias (the pre-activation the backward needs); may alias h
    STORE_Y: tl.constexpr,
    FP8_FORMAT: tl.constexpr,  # 0: no FP8 copy
    TRANSPOSE: tl.constexpr,
    COMPUTE_AMAX: tl.constexpr,
    ENCODER: tl.constexpr,  # FP8 encoder: _launch.fp8_encoder
    LOOP_STAGES: tl.constexpr,  # software-pipeline depth of the row loop; None leaves it to the compiler
    CYCLIC_ROWS: tl.constexpr,  # row tiles dealt to the row groups in turn (_launch.LaunchConfig.cyclic_rows)
    PREFETCH: tl.constexpr,  # each tile's input loaded one iteration ahead, in registers (LaunchConfig.prefetch)
    INDEX_64: tl.constexpr,  # some element offset reaches 2**31: 64-bit index arithmetic
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.arange(0, BLOCK_M)
    if INDEX_64:
        offs_n = offs_n.to(tl.int64)
        rows = rows.to(tl.int64)
    row_start, row_end, row_step = row_loop(pid_m, rows_per_group, M, BLOCK_M, CYCLIC_ROWS)
    amax_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if FP8_FORMAT != 0:
        scale = tl.load(scale_ptr)
    h_cols = h_ptr + offs_n[None, :] * stride_h_n
    if PREFETCH:
        # Each tile's input is loaded one iteration ahead; rows past this group's are masked off.
        limit = tl.minimum(row_end, M)
        offs_m = row_start + rows
        h_next = tl.load(h_cols + offs_m[:, None] * stride_h_m, mask=(offs_m < limit)[:, None] & mask_n[None, :],
                         other=0.0)
    for m0 in tl.range(row_start, row_end, row_step, num_stages=LOOP_STAGES):
        offs_m = m0 + rows
        mask = (offs_m < M)[:, None] & mask_n[None, :]
        if PREFETCH:
            h = h_next.to(tl.float32)
            offs_next = offs_m + row_step
            h_next = tl.load(h_cols + offs_next[:, None] * stride_h_m,
                             mask=(offs_next < limit)[:, None] & mask_n[None, :], other=0.0)
        else:
            h = tl.load(h_cols + offs_m[:, None] * stride_h_m, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            h += bias[None, :]
        if STORE_PRE:
            # The activation reads the rounded pre-activation, as the unfused addmm -> act would.
            h = h.to(pre_ptr.dtype.element_ty)
            tl.store(pre_ptr + offs_m[:, None] * stride_pre_m + offs_n[None, :], h, mask=mask)
            h = h.to(tl.float32)
        y = act_forward(h, ACTIVATION)
        if STORE_Y:
            # Rounded to the output dtype first, so the FP8 copy quantizes exactly what is returned.
            y = y.to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + offs_m[:, None] * stride_y_m + offs_n[None, :], y, mask=mask)
            y = y.to(tl.float32)
        if COMPUTE_AMAX:
            # Masked rows hold act(0 + bias): keep them out of the amax.
            amax_acc = amax_update(amax_acc, tl.where(mask, y, 0.0))
        if FP8_FORMAT != 0:
            codes = fp8_codes(y * scale, FP8_FORMAT, ENCODER)
            q_ptrs = q_ptr.to(tl.pointer_type(tl.uint8)) + offs_m[:, None] * stride_q_m + offs_n[None, :]
            tl.store(q_ptrs, codes.to(tl.uint8), mask=mask)
            if TRANSPOSE:
                q_t_ptrs = q_t_ptr.to(tl.pointer_type(tl.uint8)) + offs_n[:, None] * stride_q_t_n + offs_m[None, :]
                tl.store(q_t_ptrs, tl.trans(codes).to(tl.uint8),
                         mask=tl.trans(mask))
    if COMPUTE_AMAX:
        tl.atomic_max(amax_ptr, amax_finish(amax_acc), sem="relaxed")


def _launch(h: torch.Tensor, bias: Optional[torch.Tensor], activation: int, scale: Optional[torch.Tensor],
            fp8_code: int, amax: Optional[torch.Tensor], transpose: bool, pre_act_out: Optional[torch.Tensor],
            y: torch.Tensor, q: Optional[torch.Tensor], q_t: Optional[torch.Tensor], config: LaunchConfig,
            traced: bool):
    """Runs the pass on 2-D ``h`` (``m > 0`` rows) into preallocated outputs. Returns what the launch
    returned (in eager mode the compiled kernel, whose resources the benchmark's sweep reports)."""
    m, n = h.shape
    rows_per_group, groups = config.row_groups(m)
    stride_h = h.stride()
    return launcher(_bias_act_kernel, traced)[(-(-n // config.block_n), groups)](
        h, bias if bias is not None else h, y, q if q is not None else y, q_t if q_t is not None else y,
        scale if scale is not None else h, amax if amax is not None else h,
        pre_act_out if pre_act_out is not None else h,
        stride_h[0], stride_h[1], y.stride(0), q.stride(0) if fp8_code else 0,
        q_t.stride(0) if transpose else 0, pre_act_out.stride(0) if pre_act_out is not None else 0,
        m, n, rows_per_group,
        ACTIVATION=activation, HAS_BIAS=bias is not None, STORE_PRE=pre_act_out is not None,
        STORE_Y=True, FP8_FORMAT=fp8_code,
        TRANSPOSE=transpose, COMPUTE_AMAX=amax is not None, ENCODER=fp8_encoder(h),
        LOOP_STAGES=config.loop_stages or None, CYCLIC_ROWS=config.cyclic_rows, PREFETCH=config.prefetch,
        INDEX_64=needs_index_64(m, n, h, pre_act_out),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
    )


def _bias_act_run(h: torch.Tensor, bias: Optional[torch.Tensor], activation: int, out_dtype: torch.dtype,
                  scale: Optional[torch.Tensor], fp8_code: int, amax: Optional[torch.Tensor], transpose: bool,
                  pre_act_out: Optional[torch.Tensor], traced: bool):
    """Allocates and launches: ``(y, y_fp8 or None, y_fp8_t or None)``."""
    m, n = h.shape
    dev = h.device
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    q = torch.empty((m, n), dtype=FORMAT_DTYPES[fp8_code], device=dev) if fp8_code else None
    q_t = torch.empty((n, m), dtype=q.dtype, device=dev) if transpose else None
    if m > 0 and n > 0:
        _launch(h, bias, activation, scale, fp8_code, amax, transpose, pre_act_out, y, q, q_t,
                launch_config("bias_act", m, n, dev), traced)
    return y, q, q_t


def _bias_act_impl(h: torch.Tensor, bias: Optional[torch.Tensor], activation: int, out_dtype: torch.dtype,
                   scale: Optional[torch.Tensor], fp8_code: int, amax: Optional[torch.Tensor],
                   transpose: bool, pre_act_out: Optional[torch.Tensor], traced: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, q, q_t = _bias_act_run(h, bias, activation, out_dtype, scale, fp8_code, amax, transpose, pre_act_out, traced)
    # A registered op returns tensors: empty ones stand for the outputs not asked for, one each (no
    # output of a custom op may alias another).
    def placeholder():
        return torch.empty((0, 0), dtype=torch.uint8, device=h.device)

    return y, (q if q is not None else placeholder()), (q_t if q_t is not None else placeholder())


_bias_act_op = triton_op("lightning_fuse::bias_act", _bias_act_impl, mutates_args={"amax", "pre_act_out"})


@torch.no_grad()  # not differentiable, as the kernel is not: no autograd history on the outputs or on amax
def bias_act_reference(h: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str], *,
                       scale: Optional[torch.Tensor] = None, fp8_dtype: Optional[torch.dtype] = None,
                       amax: Optional[torch.Tensor] = None, transpose: bool = False,
                       compute_dtype: torch.dtype = torch.float32, out_dtype: Optional[torch.dtype] = None):
    """Pure-torch ``bias_act`` on 2-D ``h``; returns ``(y, y_fp8, y_fp8_t)``, ``y`` in ``out_dtype``
    (default ``h``'s) and never ``h`` itself."""
    x = h.to(compute_dtype)
    if bias is not None:
        x = x + bias.to(compute_dtype)
    y = x if activation is None else activation_reference(x, activation)
    y = y.to(out_dtype or h.dtype, memory_format=torch.contiguous_format, copy=True)  # row-major, as the kernel writes
    if amax is not None:
        yf = y.to(torch.float32)
        absolute = torch.where(torch.isnan(yf), torch.full_like(yf, float("inf")), yf.abs())
        current = absolute.max() if yf.numel() else torch.zeros((), device=yf.device)
        amax.copy_(torch.maximum(amax.view(()), current).view_as(amax))
    if fp8_dtype is None:
        return y, None, None
    fmt = fp8_format(fp8_dtype)
    q = (y.to(torch.float32) * scale.to(torch.float32).reshape(())).clamp(-fmt.max, fmt.max).to(fp8_dtype)
    return y, q, (q.t().contiguous() if transpose else None)


def bias_act(h: torch.Tensor, bias: Optional[torch.Tensor] = None, activation: Optional[str] = "gelu_tanh", *,
             scale: Optional[torch.Tensor] = None, fp8_dtype: Optional[torch.dtype] = None,
             amax: Optional[torch.Tensor] = None, transpose: bool = False,
             pre_act_out: Optional[torch.Tensor] = None):
    """``y = act(h + bias)`` in ``h``'s dtype, plus the FP8 copy of ``y`` for the next FP8 linear.

    Args:
        h: ``[*, N]`` GEMM output (fp32, bf16, fp16).
        bias: ``(N,)`` added in fp32 before the activation, or ``None`` where the GEMM added it.
        activation: an activation name (see ``ACTIVATIONS``) or ``None`` for the bias add alone.
        scale, fp8_dtype, amax, transpose: as in ``quantize``, applied to ``y``.
        pre_act_out: receives ``h + bias`` in its dtype (the pre-activation a backward needs); it may be
            ``h`` itself (written in place). Same shape as ``h``, rows contiguous.

    Returns:
        ``(y, y_fp8, y_fp8_t)``; the FP8 entries are ``None`` without ``fp8_dtype`` / ``transpose``.
    """
    check_float_tensor(h, "h")
    act = activation_id(activation) if activation is not None else 0
    n = h.shape[-1]
    if bias is not None:
        check_float_tensor(bias, "bias")
        if bias.shape != (n,):
            raise ValueError(f"`bias` must have shape ({n},) to match `h`'s last dimension; got {tuple(bias.shape)}")
        if bias.device != h.device:
            raise ValueError(f"`bias` is on {bias.device} but `h` is on {h.device}")
    code = 0
    if fp8_dtype is not None:
        code = fp8_format(fp8_dtype).code
        check_scale(scale, h.device)
    elif transpose or scale is not None:
        raise ValueError("`scale` and `transpose` describe the FP8 copy: pass `fp8_dtype` with them")
    check_amax(amax, h.device)
    if pre_act_out is not None:
        check_float_tensor(pre_act_out, "pre_act_out")
        if pre_act_out.device != h.device:
            raise ValueError(f"`pre_act_out` is on {pre_act_out.device} but `h` is on {h.device}")
        if pre_act_out.shape != h.shape or pre_act_out.stride(-1) != 1:
            raise ValueError(f"`pre_act_out` must have `h`'s shape {tuple(h.shape)} with contiguous rows; got shape "
                             f"{tuple(pre_act_out.shape)}, strides {pre_act_out.stride()}")
        try:  # a view, never a copy: it is written in place (and no data_ptr test, which torch.compile cannot trace)
            pre_rows = pre_act_out if pre_act_out.dim() == 2 else pre_act_out.view(h.shape[:-1].numel(), n)
        except RuntimeError:
            raise ValueError(f"`pre_act_out` must be viewable as ({h.shape[:-1].numel()}, {n}) rows (it is written "
                             f"in place); got shape {tuple(pre_act_out.shape)}, strides {pre_act_out.stride()}") from None
        if bias is None and pre_act_out is h:
            pre_act_out = None  # h already is the pre-activation: writing it back would copy it onto itself
    leading = h.shape[:-1]
    h2 = h if h.dim() == 2 else as_rows(h)
    if not use_triton(h2):
        if pre_act_out is not None:
            with torch.no_grad():  # written as the kernel writes it: no autograd history
                pre = h2.to(torch.float32) + (bias.to(torch.float32) if bias is not None else 0.0)
                pre_act_out.copy_(pre.view_as(pre_act_out))
            h2, bias = as_rows(pre_act_out), None
        y, q, q_t = bias_act_reference(h2, bias, activation, scale=scale, fp8_dtype=fp8_dtype, amax=amax,
                                       transpose=transpose, out_dtype=h.dtype)
        return y.view(*leading, n), (q.view(*leading, n) if q is not None else None), q_t
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if scale is not None and scale.dim() != 0:
        scale = scale.reshape(())
    if pre_act_out is not None:
        pre_act_out = pre_rows
    if torch.compiler.is_compiling():
        y, q, q_t = _bias_act_op(h2, bias, act, h.dtype, scale, code, amax, transpose, pre_act_out, True)
    else:
        y, q, q_t = _bias_act_run(h2, bias, act, h.dtype, scale, code, amax, transpose, pre_act_out, False)
    if h.dim() != 2:
        y = y.view(h.shape)
        q = q.view(h.shape) if code else None
    return y, (q if code else None), (q_t if transpose else None)
