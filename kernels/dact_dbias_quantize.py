"""The fused backward of ``Linear -> bias -> activation``: one pass computing the activation
gradient, the bias gradient and the FP8 quantization of the result, row-wise and transposed.

Bytes per element of ``[M, N]`` (bf16/fp16 inputs, FP8 outputs): read ``grad`` and ``pre_act``
(2 + 2), write ``dx`` (1) and ``dx_t`` (1): 6 bytes, against 4 + 2 + 2 + 2 + ... for the PyTorch
sequence ``gelu_backward -> sum -> amax -> scale/cast -> transpose``. The bias gradient adds
one row of ``N`` fp32 partials per row group or chunk row (below), a fraction of a percent at
training sizes, which the last of each column strip to finish sums in a fixed order
(``_arrival_counters``).

Two forms of the pass: row groups (each program walks one column strip over a fixed range of rows;
``_dact_dbias_quantize_kernel``) and the queued form (one program per slot of the card taking chunks
of a few row tiles of one strip from a queue as it frees up; ``_dact_dbias_quantize_queued_kernel``,
``LaunchConfig.chunk_tiles``). Each chunk or row group stores one row of bias-gradient partials.
The launch rules (``_launch.LAUNCH_RULES``) take the queued form on H100s at large shapes, where it
is the faster, and the row groups elsewhere: on an H200 the queued form was slower (BENCHMARKS.md).

Also here: ``dbias_quantize`` (no activation term: the backward of a plain FP8 linear with bias),
and the current-scaling variant, which takes two passes because the scale depends on this
tensor's own amax: pass 1 reads ``grad`` and ``pre_act`` for the amax and the bias gradient,
pass 2 reads them again, derives the scale from pass 1's amax (each program on its own; one stores
it) and writes the FP8 copies. That is 4 + 4 + 2 = 10 bytes per element with the transposed copy;
``dx`` never exists in high precision, and nothing runs between the two passes.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from ._launch import (ENCODERS, FLOAT_DTYPES, LaunchConfig, as_rows, check_amax, check_float_tensor, check_margin,
                      check_scale, fp8_encoder, launch_config, launcher, needs_index_64, row_loop, use_triton)
from .activations import _PTX, act_derivative, activation_derivative_reference, activation_id, add_rounded
from .fp8 import (FORMAT_DTYPES, amax_finish, amax_update, fp8_codes, fp8_format, fp8_tile_codes, pass_scale,
                  scale_from_amax_reference)

__all__ = [
    "dact_dbias_quantize",
    "dact_dbias_quantize_current_scaling",
    "dact_dbias_quantize_reference",
    "dbias_quantize",
]

@triton.jit
def _load_rows(ptr, r0, offs_n, k0, k1, k2, k3, stride_m, stride_n):
    """The four interleaved row sets of one tile (rows ``r0 + j`` under masks ``kj``, ``j = 0..3``) in the
    input's dtype."""
    base = ptr + offs_n[None, :] * stride_n
    t0 = tl.load(base + r0[:, None] * stride_m, mask=k0, other=0.0)
    t1 = tl.load(base + (r0 + 1)[:, None] * stride_m, mask=k1, other=0.0)
    t2 = tl.load(base + (r0 + 2)[:, None] * stride_m, mask=k2, other=0.0)
    t3 = tl.load(base + (r0 + 3)[:, None] * stride_m, mask=k3, other=0.0)
    return t0, t1, t2, t3


# The encoder whose builds convert a tile's codes in both layouts at once (fp8_tile_codes) and widen
# the two-deep form's loaded bf16 pairs in two instructions (_widen).
_TILE_ENCODER = tl.constexpr(ENCODERS["tile"])


@triton.jit
def _row_masks(r0, limit, mask_n):
    """The masks of rows ``r0 + j`` (``j = 0..3``) below ``limit`` and columns under ``mask_n``."""
    return ((r0 < limit)[:, None] & mask_n[None, :], (r0 + 1 < limit)[:, None] & mask_n[None, :],
            (r0 + 2 < limit)[:, None] & mask_n[None, :], (r0 + 3 < limit)[:, None] & mask_n[None, :])


@triton.jit
def _widen(x, WIDEN: tl.constexpr):
    """Loaded ``x`` as fp32. With ``WIDEN`` (the ``tile`` encoder's builds) a bf16 pair in one
    register widens in two instructions, a shift and a mask, where the compiler's conversion took
    three (it moves the high half down, then shifts it back): the two-deep form's loop 23.3 -> 22.3
    per element (kernel_isa.py). Only for values straight from a load: the prefetching loops carry
    their tiles across iterations, and there the compiler packed the pairs again first (more
    instructions, not fewer)."""
    if _PTX and WIDEN and x.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=2)
    else:
        return x.to(tl.float32)


@triton.jit
def _dx(grad, pre_act, ACTIVATION: tl.constexpr):
    """``dx`` (fp32) of loaded rows: ``grad * act'(pre_act)``, or ``grad`` without an activation."""
    if ACTIVATION != 0:
        return grad.to(tl.float32) * act_derivative(pre_act.to(tl.float32), ACTIVATION)
    else:
        return grad.to(tl.float32)


@triton.jit
def _dx_sets(x0, x1, x2, x3, y0, y1, y2, y3, ACTIVATION: tl.constexpr):
    """``dx`` (fp32) of a tile's four row sets from their loaded ``grad`` (``xj``) and ``pre_act`` (``yj``)."""
    return _dx(x0, y0, ACTIVATION), _dx(x1, y1, ACTIVATION), _dx(x2, y2, ACTIVATION), _dx(x3, y3, ACTIVATION)


@triton.jit
def _dx_rows(grad_ptr, pre_act_ptr, rows, offs_n, mask, stride_grad_m, stride_grad_n, stride_pre_m, stride_pre_n,
             ACTIVATION: tl.constexpr, WIDEN: tl.constexpr):
    """``dx`` (fp32) of one set of rows, loaded here (``_dx``)."""
    grad = _widen(tl.load(grad_ptr + rows[:, None] * stride_grad_m + offs_n[None, :] * stride_grad_n,
                   mask=mask, other=0.0), WIDEN)
    pre_act = grad  # not read without an activation
    if ACTIVATION != 0:
        pre_act = _widen(tl.load(pre_act_ptr + rows[:, None] * stride_pre_m + offs_n[None, :] * stride_pre_n,
                          mask=mask, other=0.0), WIDEN)
    return _dx(grad, pre_act, ACTIVATION)


@triton.jit
def store_codes(out_ptr, out_t_ptr, rows, offs_n, mask, stride_out_m, stride_out_t_n, x, scale,
                FP8_FORMAT: tl.constexpr, ENCODER: tl.constexpr, TRANSPOSE: tl.constexpr, PACK_T: tl.constexpr):
    """Stores the FP8 codes of ``x * scale`` for one set of rows row-wise, and returns them (int32).
    Without ``PACK_T`` it also stores them transposed, one byte per element."""
    codes = fp8_codes(x * scale, FP8_FORMAT, ENCODER)
    tl.store(out_ptr.to(tl.pointer_type(tl.uint8)) + rows[:, None] * stride_out_m + offs_n[None, :],
             codes.to(tl.uint8), mask=mask)
    if TRANSPOSE and not PACK_T:
        tl.store(out_t_ptr.to(tl.pointer_type(tl.uint8)) + offs_n[:, None] * stride_out_t_n + rows[None, :],
                 tl.trans(codes).to(tl.uint8), mask=tl.trans(mask))
    return codes


@triton.jit
def store_packed_transpose(out_t_ptr, m0, quarter, offs_n, mask_n, M, stride_out_t_n, c0, c1, c2, c3):
    """The transposed copy of four interleaved row sets (rows ``m0 + 4 quarter + j`` hold codes ``cj``) as 32-bit
    words: one word holds four consecutive rows of one column, which is four consecutive bytes of
    the transposed copy's row. The bytes never move between threads one by one: the words are
    packed where the codes are, and only they go through the layout conversion of ``tl.trans``.
    Needs ``M % 4 == 0``. Word indices and their mask are written as ``m0 // 4 + quarter`` against
    ``M // 4``, not from the rows: the compiler sees those as contiguous and stores four words per
    instruction; from ``rows // 4`` it stored them one by one, 3.4 times slower (BENCHMARKS.md)."""
    words = c0 | (c1 << 8) | (c2 << 16) | (c3 << 24)
    store_transposed_words(out_t_ptr, m0, quarter, offs_n, mask_n, M, stride_out_t_n, words)


@triton.jit
def store_transposed_words(out_t_ptr, m0, quarter, offs_n, mask_n, M, stride_out_t_n, words):
    """``store_packed_transpose``'s store of the words themselves (rows ``m0 + 4 quarter + j`` in byte ``j``)."""
    word = m0 // 4 + quarter
    mask = (word < M // 4)[None, :] & mask_n[:, None]
    tl.store(out_t_ptr.to(tl.pointer_type(tl.int32)) + offs_n[:, None] * (stride_out_t_n // 4) + word[None, :],
             tl.trans(words), mask=mask)


@triton.jit
def _dact_dbias_quantize_kernel(
    grad_ptr, pre_act_ptr, out_ptr, out_t_ptr, partial_ptr, dbias_ptr, counter_ptr, scale_ptr, amax_ptr,
    stride_grad_m, stride_grad_n, stride_pre_m, stride_pre_n, stride_out_m, stride_out_t_n,
    M, N, rows_per_group,
    margin_factor,  # 2**margin, with SCALE_FROM_AMAX (last: the other arguments keep their places, and the SASS)
    ACTIVATION: tl.constexpr,  # 0: none (plain bias gradient / quantize), else activations.py's ids
    FP8_FORMAT: tl.constexpr,  # 0: write dx in out's dtype; 1: e4m3fn codes; 2: e5m2 codes
    STORE_OUT: tl.constexpr,  # False for the amax-only first pass of current scaling
    TRANSPOSE: tl.constexpr,
    PACK_T: tl.constexpr,  # M % 4 == 0: the transposed copy is written as 32-bit words (store_packed_transpose)
    COMPUTE_DBIAS: tl.constexpr,
    FINISH_DBIAS: tl.constexpr,  # the last program of each column strip sums the partials (counter_ptr)
    DBIAS_BF16: tl.constexpr,
    COMPUTE_AMAX: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr,  # current scaling's pass 2: the scale from amax_ptr's amax (fp8.pass_scale)
    ENCODER: tl.constexpr,  # FP8 encoder: _launch.fp8_encoder
    LOOP_STAGES: tl.constexpr,  # software-pipeline depth of the row loop; None leaves it to the compiler
    CYCLIC_ROWS: tl.constexpr,  # row tiles dealt to the row groups in turn (_launch.LaunchConfig.cyclic_rows)
    PREFETCH: tl.constexpr,  # each tile's inputs loaded one iteration ahead, in registers (LaunchConfig.prefetch)
    INDEX_64: tl.constexpr,  # some element offset reaches 2**31: 64-bit index arithmetic
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # A tile of BLOCK_M rows is four interleaved row sets (rows m0 + 4 i + j, j = 0..3) of the same
    # layout, so each thread holds four consecutive rows of its columns: the transposed copy is
    # packed into words in registers, and the accumulators are a quarter of the tile.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    quarter = tl.arange(0, BLOCK_M // 4)
    if INDEX_64:
        offs_n = offs_n.to(tl.int64)
        quarter = quarter.to(tl.int64)
    row_start, row_end, row_step = row_loop(pid_m, rows_per_group, M, BLOCK_M, CYCLIC_ROWS)
    # 2-D accumulators: one reduction at the end instead of a cross-warp reduction per tile.
    dbias_acc = tl.zeros((BLOCK_M // 4, BLOCK_N), dtype=tl.float32)
    amax_acc = tl.zeros((BLOCK_M // 4, BLOCK_N), dtype=tl.float32)
    scale = pass_scale(scale_ptr, amax_ptr, margin_factor, (pid_n == 0) & (pid_m == 0), FP8_FORMAT, SCALE_FROM_AMAX)
    limit = tl.minimum(row_end, M)  # the last group's range may end past the last row
    if PREFETCH:
        # The first tile's inputs, rows past this group's masked off (as in every prefetch below).
        r0 = row_start + 4 * quarter
        k0, k1, k2, k3 = _row_masks(r0, limit, mask_n)
        g0, g1, g2, g3 = _load_rows(grad_ptr, r0, offs_n, k0, k1, k2, k3, stride_grad_m, stride_grad_n)
        if ACTIVATION != 0:
            p0, p1, p2, p3 = _load_rows(pre_act_ptr, r0, offs_n, k0, k1, k2, k3, stride_pre_m, stride_pre_n)
    # Every tile but the last in the loop; the last one after it (below), so that the program arrives
    # with its bias-gradient partial before that tile's stores rather than after them.
    last = row_start + (limit - row_start - 1) // row_step * row_step
    for m0 in tl.range(row_start, last, row_step, num_stages=LOOP_STAGES):
        r0 = m0 + 4 * quarter
        k0, k1, k2, k3 = _row_masks(r0, M, mask_n)
        if PREFETCH:
            # This tile's inputs were loaded last iteration; the next tile's are loaded before it is computed.
            x0, x1, x2, x3 = g0, g1, g2, g3
            y0, y1, y2, y3 = x0, x1, x2, x3  # stand-ins without an activation (not read)
            n0 = r0 + row_step
            q0, q1, q2, q3 = _row_masks(n0, limit, mask_n)
            if ACTIVATION != 0:
                # The next tile's loads after this tile's dx, as in the queued form (its comment says why;
                # here quick-GELU with fp16 inputs waited on two of them 10 instructions after issuing them).
                y0, y1, y2, y3 = p0, p1, p2, p3
                d0, d1, d2, d3 = _dx_sets(x0, x1, x2, x3, y0, y1, y2, y3, ACTIVATION)
                g0, g1, g2, g3 = _load_rows(grad_ptr, n0, offs_n, q0, q1, q2, q3, stride_grad_m, stride_grad_n)
                p0, p1, p2, p3 = _load_rows(pre_act_ptr, n0, offs_n, q0, q1, q2, q3, stride_pre_m, stride_pre_n)
            else:
                # The cast and the bias gradient (no exp to share a scoreboard with) in the order they were timed in.
                g0, g1, g2, g3 = _load_rows(grad_ptr, n0, offs_n, q0, q1, q2, q3, stride_grad_m, stride_grad_n)
                d0, d1, d2, d3 = _dx_sets(x0, x1, x2, x3, y0, y1, y2, y3, ACTIVATION)
        else:
            # Row set by row set, each grad load beside its pre_act load: in this order the two-deep
            # pipelined form compiles to 126 registers (4 programs per multiprocessor); with every grad
            # row set loaded first, to 152-154 (3).
            d0, d1, d2, d3 = _dx_tile(grad_ptr, pre_act_ptr, r0, offs_n, k0, k1, k2, k3, stride_grad_m,
                                      stride_grad_n, stride_pre_m, stride_pre_n, ACTIVATION, ENCODER == _TILE_ENCODER)
        dbias_acc, amax_acc = _take_tile(out_ptr, out_t_ptr, m0, r0, quarter, offs_n, mask_n, k0, k1, k2, k3, M,
                                         stride_out_m, stride_out_t_n, d0, d1, d2, d3, dbias_acc, amax_acc, scale,
                                         FP8_FORMAT, ENCODER, TRANSPOSE, PACK_T, COMPUTE_DBIAS, COMPUTE_AMAX,
                                         STORE_OUT, ENCODER == _TILE_ENCODER)
    # The last tile: its inputs are in registers already with PREFETCH (loaded by the loop's last
    # iteration, or before the loop for a one-tile group).
    r0 = last + 4 * quarter
    k0, k1, k2, k3 = _row_masks(r0, M, mask_n)
    if PREFETCH:
        y0, y1, y2, y3 = g0, g1, g2, g3  # stand-ins without an activation (not read)
        if ACTIVATION != 0:
            y0, y1, y2, y3 = p0, p1, p2, p3
        d0, d1, d2, d3 = _dx_sets(g0, g1, g2, g3, y0, y1, y2, y3, ACTIVATION)
    else:
        d0, d1, d2, d3 = _dx_tile(grad_ptr, pre_act_ptr, r0, offs_n, k0, k1, k2, k3, stride_grad_m, stride_grad_n,
                                  stride_pre_m, stride_pre_n, ACTIVATION, ENCODER == _TILE_ENCODER)
    if COMPUTE_DBIAS:
        dbias_acc += add_rounded(d0, d1) + add_rounded(d2, d3)
        # Arriving before the last tile's stores, the program's release waits only on the earlier
        # tiles' stores, and the last program's sum of the partials overlaps the others' last stores
        # (dbias_quantize 2.4% and 3.1% faster at 8192x3072 and 32768x8192 on an H100, the other passes
        # within 1%: BENCHMARKS.md, "The last tile after the loop").
        store_bias_gradient_partial(partial_ptr, dbias_ptr, counter_ptr, dbias_acc, pid_m, pid_n, offs_n, mask_n, N,
                                    tl.num_programs(1), FINISH_DBIAS, DBIAS_BF16)
    if COMPUTE_AMAX:
        amax_acc = amax_update(amax_update(amax_update(amax_update(amax_acc, d0), d1), d2), d3)
        tl.atomic_max(amax_ptr, amax_finish(amax_acc), sem="relaxed")
    if STORE_OUT:
        _store_tile(out_ptr, out_t_ptr, last, r0, quarter, offs_n, mask_n, k0, k1, k2, k3, M, stride_out_m,
                    stride_out_t_n, d0, d1, d2, d3, scale, FP8_FORMAT, ENCODER, TRANSPOSE, PACK_T,
                    ENCODER == _TILE_ENCODER)


@triton.jit
def _chunk(chunk, strips, chunk_rows, M):
    """Chunk ``chunk`` of the queued form: its column strip, its row of chunks and its rows
    ``[start, end)``. Chunks are numbered strip first, so the programs running at one time work on
    the same few rows across all strips, as the row groups of the other form do. A chunk past the
    last one has no rows (``start >= M``)."""
    strip = chunk % strips
    row = chunk // strips
    start = row * chunk_rows
    return strip, row, start, tl.minimum(start + chunk_rows, M)


@triton.jit
def _take_chunk(queue_ptr, chunk, programs, DYNAMIC: tl.constexpr):
    """The chunk a program takes after ``chunk``: the queue's next one (every program starts on the
    chunk of its own index, so the queue hands out ``programs``, ``programs + 1``, ...), or without
    ``DYNAMIC`` the chunk ``programs`` further on."""
    if DYNAMIC:
        return programs + tl.atomic_add(queue_ptr, 1, sem="relaxed")
    else:
        return chunk + programs


@triton.jit
def _dact_dbias_quantize_queued_kernel(
    grad_ptr, pre_act_ptr, out_ptr, out_t_ptr, partial_ptr, dbias_ptr, counter_ptr, queue_ptr, scale_ptr, amax_ptr,
    stride_grad_m, stride_grad_n, stride_pre_m, stride_pre_n, stride_out_m, stride_out_t_n,
    M, N, chunk_rows, chunks_per_strip, margin_factor,
    ACTIVATION: tl.constexpr, FP8_FORMAT: tl.constexpr, STORE_OUT: tl.constexpr, TRANSPOSE: tl.constexpr,
    PACK_T: tl.constexpr, COMPUTE_DBIAS: tl.constexpr, FINISH_DBIAS: tl.constexpr, DBIAS_BF16: tl.constexpr,
    COMPUTE_AMAX: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr, ENCODER: tl.constexpr,
    DYNAMIC: tl.constexpr,  # chunks handed out by the queue (queue_ptr) as programs free up, else in a fixed stride
    INDEX_64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # The queued form of the pass (LaunchConfig.chunk_tiles): one program per slot of the card, each
    # taking chunks of a few row tiles of one column strip until none is left. A chunk's bias-gradient
    # partial is row `row` of the partials, whichever program computed it, so the sum has the same
    # bits with or without the queue. Every tile's inputs are loaded one iteration ahead, across
    # chunks too: the first tile of the next chunk while the last of this one is computed.
    programs = tl.num_programs(0)
    strips = tl.cdiv(N, BLOCK_N)
    total = strips * chunks_per_strip
    lanes = tl.arange(0, BLOCK_N)
    quarter = tl.arange(0, BLOCK_M // 4)
    if INDEX_64:
        lanes = lanes.to(tl.int64)
        quarter = quarter.to(tl.int64)
    amax_acc = tl.zeros((BLOCK_M // 4, BLOCK_N), dtype=tl.float32)
    chunk = tl.program_id(0)
    scale = pass_scale(scale_ptr, amax_ptr, margin_factor, chunk == 0, FP8_FORMAT, SCALE_FROM_AMAX)
    strip, row, start, end = _chunk(chunk, strips, chunk_rows, M)
    r0 = start + 4 * quarter
    offs_n = strip * BLOCK_N + lanes
    k0, k1, k2, k3 = _row_masks(r0, end, offs_n < N)
    g0, g1, g2, g3 = _load_rows(grad_ptr, r0, offs_n, k0, k1, k2, k3, stride_grad_m, stride_grad_n)
    p0, p1, p2, p3 = g0, g1, g2, g3  # stand-ins without an activation (not read)
    if ACTIVATION != 0:
        p0, p1, p2, p3 = _load_rows(pre_act_ptr, r0, offs_n, k0, k1, k2, k3, stride_pre_m, stride_pre_n)
    following = _take_chunk(queue_ptr, chunk, programs, DYNAMIC)
    while chunk < total:
        n_strip, n_row, n_start, n_end = _chunk(following, strips, chunk_rows, M)
        offs_n = strip * BLOCK_N + lanes
        mask_n = offs_n < N
        dbias_acc = tl.zeros((BLOCK_M // 4, BLOCK_N), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            r0 = m0 + 4 * quarter
            k0, k1, k2, k3 = _row_masks(r0, M, mask_n)
            x0, x1, x2, x3 = g0, g1, g2, g3
            y0, y1, y2, y3 = x0, x1, x2, x3  # stand-ins without an activation (not read)
            if ACTIVATION != 0:
                y0, y1, y2, y3 = p0, p1, p2, p3
            # The next tile: the next of this chunk, or after its last the first of the next chunk.
            inside = m0 + BLOCK_M < end
            n0 = tl.where(inside, m0 + BLOCK_M, n_start) + 4 * quarter
            n_offs = tl.where(inside, strip, n_strip) * BLOCK_N + lanes
            q0, q1, q2, q3 = _row_masks(n0, tl.where(inside, end, n_end), n_offs < N)
            # The next tile's loads written after this tile's dx: written before it, ptxas gave some of them
            # the scoreboard of an exp or reciprocal it issued beside them and waited on them there, a dozen
            # instructions later (fp16 tanh-GELU, bf16 and fp16 SiLU and quick-GELU), not at the loop's end
            # (kernel_isa.py's "load_wait" column; tests/test_instruction_budget.py).
            d0, d1, d2, d3 = _dx_sets(x0, x1, x2, x3, y0, y1, y2, y3, ACTIVATION)
            g0, g1, g2, g3 = _load_rows(grad_ptr, n0, n_offs, q0, q1, q2, q3, stride_grad_m, stride_grad_n)
            if ACTIVATION != 0:
                p0, p1, p2, p3 = _load_rows(pre_act_ptr, n0, n_offs, q0, q1, q2, q3, stride_pre_m, stride_pre_n)
            # Codes per value (not fp8_tile_codes): with both layouts converted at once, ptxas gave a load of
            # the fp16 quick-GELU build an exp's scoreboard again (kernel_isa.py's load_wait: 20).
            dbias_acc, amax_acc = _take_tile(out_ptr, out_t_ptr, m0, r0, quarter, offs_n, mask_n, k0, k1, k2, k3, M,
                                             stride_out_m, stride_out_t_n, d0, d1, d2, d3, dbias_acc, amax_acc, scale,
                                             FP8_FORMAT, ENCODER, TRANSPOSE, PACK_T, COMPUTE_DBIAS, COMPUTE_AMAX,
                                             STORE_OUT, False)
        # The next chunk's first tile is in flight: taking the chunk after it waits on the queue meanwhile.
        after = _take_chunk(queue_ptr, following, programs, DYNAMIC)
        if COMPUTE_DBIAS:
            store_bias_gradient_partial(partial_ptr, dbias_ptr, counter_ptr, dbias_acc, row, strip, offs_n, mask_n,
                                        N, chunks_per_strip, FINISH_DBIAS, DBIAS_BF16)
        chunk, strip, row, start, end, following = following, n_strip, n_row, n_start, n_end, after
    if COMPUTE_AMAX:
        tl.atomic_max(amax_ptr, amax_finish(amax_acc), sem="relaxed")
    if DYNAMIC:
        # Every program took its last chunk before it arrives here: the last to arrive empties the
        # queue for the next launch.
        done = tl.atomic_add(queue_ptr + 1, 1, sem="relaxed")
        if done == programs - 1:
            tl.store(queue_ptr, 0)
            tl.store(queue_ptr + 1, 0)


@triton.jit
def _take_tile(out_ptr, out_t_ptr, m0, r0, quarter, offs_n, mask_n, k0, k1, k2, k3, M, stride_out_m, stride_out_t_n,
               d0, d1, d2, d3, dbias_acc, amax_acc, scale, FP8_FORMAT: tl.constexpr, ENCODER: tl.constexpr,
               TRANSPOSE: tl.constexpr, PACK_T: tl.constexpr, COMPUTE_DBIAS: tl.constexpr, COMPUTE_AMAX: tl.constexpr,
               STORE_OUT: tl.constexpr, TILE_CODES: tl.constexpr):
    """One tile's ``dx`` (row sets ``dj``) into the accumulators and the outputs (``_store_tile``):
    returns the bias-gradient and amax accumulators."""
    if COMPUTE_DBIAS:
        dbias_acc += add_rounded(d0, d1) + add_rounded(d2, d3)
    if COMPUTE_AMAX:
        amax_acc = amax_update(amax_update(amax_update(amax_update(amax_acc, d0), d1), d2), d3)
    if STORE_OUT:
        _store_tile(out_ptr, out_t_ptr, m0, r0, quarter, offs_n, mask_n, k0, k1, k2, k3, M, stride_out_m,
                    stride_out_t_n, d0, d1, d2, d3, scale, FP8_FORMAT, ENCODER, TRANSPOSE, PACK_T, TILE_CODES)
    return dbias_acc, amax_acc


@triton.jit
def _dx_tile(grad_ptr, pre_act_ptr, r0, offs_n, k0, k1, k2, k3, stride_grad_m, stride_grad_n, stride_pre_m,
             stride_pre_n, ACTIVATION: tl.constexpr, WIDEN: tl.constexpr):
    """``dx`` (fp32) of the four row sets of the tile at rows ``r0``, each loaded here (``_dx_rows``)."""
    d0 = _dx_rows(grad_ptr, pre_act_ptr, r0, offs_n, k0, stride_grad_m, stride_grad_n, stride_pre_m, stride_pre_n,
                  ACTIVATION, WIDEN)
    d1 = _dx_rows(grad_ptr, pre_act_ptr, r0 + 1, offs_n, k1, stride_grad_m, stride_grad_n, stride_pre_m,
                  stride_pre_n, ACTIVATION, WIDEN)
    d2 = _dx_rows(grad_ptr, pre_act_ptr, r0 + 2, offs_n, k2, stride_grad_m, stride_grad_n, stride_pre_m,
                  stride_pre_n, ACTIVATION, WIDEN)
    d3 = _dx_rows(grad_ptr, pre_act_ptr, r0 + 3, offs_n, k3, stride_grad_m, stride_grad_n, stride_pre_m,
                  stride_pre_n, ACTIVATION, WIDEN)
    return d0, d1, d2, d3


@triton.jit
def _store_tile(out_ptr, out_t_ptr, m0, r0, quarter, offs_n, mask_n, k0, k1, k2, k3, M, stride_out_m, stride_out_t_n,
                d0, d1, d2, d3, scale, FP8_FORMAT: tl.constexpr, ENCODER: tl.constexpr, TRANSPOSE: tl.constexpr,
                PACK_T: tl.constexpr, TILE_CODES: tl.constexpr):
    """Stores the tile at rows ``m0`` (row sets ``r0 + j`` under masks ``kj`` hold ``dj``): its FP8 codes
    row-wise and transposed, or ``dx`` itself in ``out``'s dtype without an FP8 format."""
    if FP8_FORMAT != 0 and TRANSPOSE and PACK_T and TILE_CODES:
        # Both layouts from the hardware conversion at once (fp8_tile_codes): the row sets' codes and
        # the transposed copy's words, never an fp8-typed value (fp8.py says why).
        q0, q1, q2, q3, words = fp8_tile_codes(d0 * scale, d1 * scale, d2 * scale, d3 * scale, FP8_FORMAT)
        out_rows = out_ptr.to(tl.pointer_type(tl.uint8)) + offs_n[None, :]
        tl.store(out_rows + r0[:, None] * stride_out_m, q0, mask=k0)
        tl.store(out_rows + (r0 + 1)[:, None] * stride_out_m, q1, mask=k1)
        tl.store(out_rows + (r0 + 2)[:, None] * stride_out_m, q2, mask=k2)
        tl.store(out_rows + (r0 + 3)[:, None] * stride_out_m, q3, mask=k3)
        store_transposed_words(out_t_ptr, m0, quarter, offs_n, mask_n, M, stride_out_t_n, words)
    elif FP8_FORMAT != 0:
        # Integer codes, not fp8 values: see fp8.py for why the transposed copy needs it.
        c0 = store_codes(out_ptr, out_t_ptr, r0, offs_n, k0, stride_out_m, stride_out_t_n, d0, scale,
                         FP8_FORMAT, ENCODER, TRANSPOSE, PACK_T)
        c1 = store_codes(out_ptr, out_t_ptr, r0 + 1, offs_n, k1, stride_out_m, stride_out_t_n, d1, scale,
                         FP8_FORMAT, ENCODER, TRANSPOSE, PACK_T)
        c2 = store_codes(out_ptr, out_t_ptr, r0 + 2, offs_n, k2, stride_out_m, stride_out_t_n, d2, scale,
                         FP8_FORMAT, ENCODER, TRANSPOSE, PACK_T)
        c3 = store_codes(out_ptr, out_t_ptr, r0 + 3, offs_n, k3, stride_out_m, stride_out_t_n, d3, scale,
                         FP8_FORMAT, ENCODER, TRANSPOSE, PACK_T)
        if TRANSPOSE and PACK_T:
            store_packed_transpose(out_t_ptr, m0, quarter, offs_n, mask_n, M, stride_out_t_n, c0, c1, c2, c3)
    else:
        out_rows = out_ptr + offs_n[None, :]
        tl.store(out_rows + r0[:, None] * stride_out_m, d0.to(out_ptr.dtype.element_ty), mask=k0)
        tl.store(out_rows + (r0 + 1)[:, None] * stride_out_m, d1.to(out_ptr.dtype.element_ty), mask=k1)
        tl.store(out_rows + (r0 + 2)[:, None] * stride_out_m, d2.to(out_ptr.dtype.element_ty), mask=k2)
        tl.store(out_rows + (r0 + 3)[:, None] * stride_out_m, d3.to(out_ptr.dtype.element_ty), mask=k3)


@triton.jit
def _partial_row(partial_ptr, g, groups, N, offs_n, mask_n):
    """Row ``g`` of the partials; -0.0 past the last row (adding it changes no value, not even a
    zero's sign). Written by other programs: loaded past L1."""
    return tl.load(partial_ptr + g * N + offs_n, mask=mask_n & (g < groups), other=-0.0, cache_modifier=".cg")


@triton.jit
def _sum_partials(partial_ptr, out_ptr, offs_n, mask_n, groups, N, OUT_BF16: tl.constexpr):
    """Sums ``groups`` rows of fp32 partials in a fixed order (the same bits on every run) and stores
    the result in ``out_ptr``'s dtype. The chunks of eight rows are unrolled, and the compiled code
    issues a chunk's eight loads before its first add (``kernel_isa.py --dump``), so the sum waits
    on memory once per eight rows, not once per row; the additions keep the row order."""
    acc = tl.zeros(offs_n.shape, dtype=tl.float32)
    for g in range(0, groups, 8):
        for i in tl.static_range(8):
            acc += _partial_row(partial_ptr, g + i, groups, N, offs_n, mask_n)
    if OUT_BF16:
        # Nearest-even by hand: the Triton interpreter's fp32 -> bf16 conversion truncates.
        bits = acc.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
        rounded = tl.where(acc != acc, 0x7FC0, rounded)  # a NaN stays NaN (its carry would overflow into the sign)
        tl.store(out_ptr.to(tl.pointer_type(tl.int16)) + offs_n, rounded, mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def store_bias_gradient_partial(partial_ptr, dbias_ptr, counter_ptr, dbias_acc, pid_m, pid_n, offs_n, mask_n, N,
                                groups, FINISH_DBIAS: tl.constexpr, DBIAS_BF16: tl.constexpr):
    """Stores row ``pid_m`` of column strip ``pid_n``'s fp32 partials of the bias gradient (``dbias_acc``
    summed over its rows), one of ``groups``. With ``FINISH_DBIAS`` the last program of the strip to
    arrive sums them all.

    Split-reduction semaphore: every thread's partial is stored before the program's one arrival
    (barrier, then a release at GPU scope); the program that arrives last acquires every other
    partial and sums them in group order, so the bits do not depend on which program that is. It
    resets the counter for the next launch."""
    tl.store(partial_ptr + pid_m * N + offs_n, tl.sum(dbias_acc, axis=0), mask=mask_n)
    if FINISH_DBIAS:
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == groups - 1:
            tl.debug_barrier()
            _sum_partials(partial_ptr, dbias_ptr, offs_n, mask_n, groups, N, DBIAS_BF16)
            tl.store(counter_ptr + pid_n, 0)


@triton.jit
def _sum_partials_kernel(partial_ptr, out_ptr, groups, N, OUT_BF16: tl.constexpr, BLOCK_N: tl.constexpr):
    # The bias gradient's second launch, where the pass cannot finish it (_arrival_counters).
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _sum_partials(partial_ptr, out_ptr, offs_n, offs_n < N, groups, N, OUT_BF16)


# Arrival counters for the in-kernel bias-gradient sum, one int32 per column strip. The last program
# of a strip resets its counter, so a buffer is zero again once a launch ends; launches that share a
# buffer must therefore run one after another. Eager launches get one buffer per (device, stream).
# Launches captured into CUDA graphs share one per device, zeroed outside the capture (a buffer
# created inside one would only become zero when its graph replays); a capture before any eager
# launch on the device takes the separate sum kernel instead.
_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: a captured graph may still point at one


def _arrival_counters(device: torch.device, strips: int) -> Optional[torch.Tensor]:
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" and not capturing else None
    counters = _COUNTERS.get((device, stream))
    if counters is not None and counters.numel() >= strips:
        return counters
    if capturing:
        return None
    size = max(4096, strips)
    keys = [(device, stream)] + ([(device, None)] if stream is not None else [])
    for key in keys:
        if key not in _COUNTERS or _COUNTERS[key].numel() < strips:
            if key in _COUNTERS:
                _RETIRED.append(_COUNTERS[key])
            _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _COUNTERS[(device, stream)]


def _pass_name(activation: int, compute_dbias: bool) -> str:
    """The ``LAUNCH_RULES`` entry of a pass: with an activation, without one but with the bias
    gradient, or the plain cast."""
    return "dact_dbias_quantize" if activation else ("dbias_quantize" if compute_dbias else "quantize")


def _launch(grad, pre_act, activation: int, scale, fp8_code: int, amax, transpose: bool,
            compute_dbias: bool, store_out: bool, config: LaunchConfig, out, out_t, dbias, traced: bool,
            margin: Optional[int] = None):
    """Runs the pass on 2-D ``grad``/``pre_act`` into preallocated outputs (``out_t``/``dbias`` may be
    ``None`` when not written). Returns what the main launch returned (in eager mode the compiled
    kernel, whose register and shared-memory use the benchmark's sweep reports).

    With ``margin`` (current scaling's second pass) ``amax`` is read, not reduced: the pass casts with
    ``fp8.scale_from_amax`` of it and stores that scale into ``scale``."""
    m, n = grad.shape
    strips = -(-n // config.block_n)
    if config.chunk_tiles:
        chunk_rows = config.chunk_tiles * config.block_m
        rows_per_group, groups = chunk_rows, -(-m // chunk_rows)  # one row of partials per chunk row
    else:
        rows_per_group, groups = config.row_groups(m)
    partials = torch.empty((groups, n), dtype=torch.float32, device=grad.device) if compute_dbias else out
    # torch.compile's graphs get the second launch: a module-level buffer has no place in them. The
    # queued form's queue is two more counters after the strips' (it needs them with or without the
    # bias gradient).
    wants_counters = (compute_dbias or config.chunk_tiles) and not traced
    counters = _arrival_counters(grad.device, strips + 2) if wants_counters else None
    dbias_bf16 = compute_dbias and dbias.dtype == torch.bfloat16
    stride_grad = grad.stride()
    stride_pre = pre_act.stride() if pre_act is not None else (0, 0)
    tensors = (grad, pre_act if pre_act is not None else grad, out, out_t if transpose else out, partials,
               dbias if compute_dbias else out, counters if counters is not None else partials)
    scalars = (scale if scale is not None else grad, amax if amax is not None else grad,
               stride_grad[0], stride_grad[1], stride_pre[0], stride_pre[1],
               out.stride(0), out_t.stride(0) if transpose else 0, m, n)
    flags = dict(
        margin_factor=2.0 ** (margin or 0),
        ACTIVATION=activation, FP8_FORMAT=fp8_code, STORE_OUT=store_out, TRANSPOSE=transpose,
        PACK_T=m % 4 == 0, COMPUTE_DBIAS=compute_dbias, FINISH_DBIAS=compute_dbias and counters is not None,
        DBIAS_BF16=dbias_bf16, COMPUTE_AMAX=amax is not None and margin is None,
        SCALE_FROM_AMAX=margin is not None, ENCODER=fp8_encoder(grad),
        INDEX_64=needs_index_64(m, n, grad, pre_act),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
        **({"maxnreg": config.max_registers} if config.max_registers and not traced else {}),
    )
    if config.chunk_tiles:
        programs = max(1, min(config.groups, strips * groups))
        queue = counters[strips:strips + 2] if counters is not None else partials
        compiled = launcher(_dact_dbias_quantize_queued_kernel, traced)[(programs,)](
            *tensors, queue, *scalars, rows_per_group, groups, DYNAMIC=counters is not None, **flags)
    else:
        compiled = launcher(_dact_dbias_quantize_kernel, traced)[(strips, groups)](
            *tensors, *scalars, rows_per_group, LOOP_STAGES=config.loop_stages or None,
            CYCLIC_ROWS=config.cyclic_rows, PREFETCH=config.prefetch, **flags)
    if compute_dbias and counters is None:
        block = 256 if grad.is_cuda else 32
        launcher(_sum_partials_kernel, traced)[(-(-n // block),)](
            partials, dbias, groups, n, OUT_BF16=dbias_bf16, BLOCK_N=block)
    return compiled


@torch.no_grad()  # not differentiable, as the kernel is not: no autograd history on the outputs or on amax
def dact_dbias_quantize_reference(grad: torch.Tensor, pre_act: Optional[torch.Tensor], activation: str | None, *,
                                  scale: Optional[torch.Tensor] = None, fp8_dtype: Optional[torch.dtype] = None,
                                  amax: Optional[torch.Tensor] = None, transpose: bool = False,
                                  compute_dtype: torch.dtype = torch.float32):
    """Pure-torch ``dact_dbias_quantize`` on 2-D inputs, computed in ``compute_dtype``.

    ``activation=None`` drops the activation term (``dbias_quantize``). Returns the same triple.
    """
    g = grad.to(compute_dtype)
    dx = g if activation is None else g * activation_derivative_reference(pre_act.to(compute_dtype), activation)
    dbias = dx.sum(0).to(torch.float32)
    if amax is not None:
        absolute = torch.where(torch.isnan(dx), torch.full_like(dx, float("inf")), dx.abs())
        current = absolute.max() if dx.numel() else torch.zeros((), dtype=compute_dtype, device=dx.device)
        amax.copy_(torch.maximum(amax.view(()), current.to(torch.float32)).view_as(amax))
    # New row-major tensors, as the kernel writes: never the caller's grad, nor its layout.
    if fp8_dtype is None:
        out = dx.to(grad.dtype, memory_format=torch.contiguous_format, copy=True)
        return out, None, dbias
    fmt = fp8_format(fp8_dtype)
    scaled = dx * scale.to(compute_dtype).reshape(())  # any one-element scale, as the kernel reads it
    out = scaled.clamp(-fmt.max, fmt.max).to(torch.float32).to(fp8_dtype, memory_format=torch.contiguous_format)
    return out, (out.t().contiguous() if transpose else None), dbias


def _run(grad: torch.Tensor, pre_act: Optional[torch.Tensor], activation: int, scale: Optional[torch.Tensor],
         fp8_code: int, amax: Optional[torch.Tensor], transpose: bool, compute_dbias: bool, config: LaunchConfig,
         traced: bool, dbias_dtype: torch.dtype = torch.float32,
         ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Allocates the outputs and runs the pass: ``(out, out_t or None, dbias or None)``."""
    m, n = grad.shape
    device = grad.device
    out = torch.empty((m, n), dtype=FORMAT_DTYPES[fp8_code] if fp8_code else grad.dtype, device=device)
    out_t = torch.empty((n, m), dtype=out.dtype, device=device) if transpose else None
    dbias = None
    if compute_dbias:
        # Every element is written by the partial-sum kernel; only an empty batch needs the zeros.
        dbias = (torch.empty if m > 0 else torch.zeros)((n,), dtype=dbias_dtype, device=device)
    if m > 0 and n > 0:
        _launch(grad, pre_act, activation, scale, fp8_code, amax, transpose, compute_dbias, True, config, out, out_t,
                dbias, traced)
    return out, out_t, dbias


def _dact_dbias_quantize_impl(
    grad: torch.Tensor, pre_act: Optional[torch.Tensor], activation: int, scale: Optional[torch.Tensor],
    fp8_code: int, amax: Optional[torch.Tensor], transpose: bool, compute_dbias: bool,
    block_m: int, block_n: int, num_warps: int, groups: int, loop_stages: int, prefetch: bool, chunk_tiles: int,
    traced: bool, dbias_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    config = LaunchConfig(block_m, block_n, num_warps, groups, loop_stages, prefetch=prefetch, chunk_tiles=chunk_tiles)
    out, out_t, dbias = _run(grad, pre_act, activation, scale, fp8_code, amax, transpose, compute_dbias, config,
                             traced, dbias_dtype)
    # A registered op returns tensors: empty ones stand for the outputs not asked for.
    if out_t is None:
        out_t = torch.empty((0, 0), dtype=out.dtype, device=out.device)
    if dbias is None:
        dbias = torch.empty((0,), dtype=dbias_dtype, device=out.device)
    return out, out_t, dbias


# torch.compile sees the op; eager calls skip the custom-op dispatch (tens of microseconds a call).
_dact_dbias_quantize_op = triton_op("lightning_fuse::dact_dbias_quantize", _dact_dbias_quantize_impl,
                                    mutates_args={"amax"})


def _validate(grad, pre_act, activation, scale, fp8_dtype, amax, transpose, dbias_dtype=torch.float32,
              scale_given_by_caller=True, argument="grad"):
    check_float_tensor(grad, argument)
    if dbias_dtype not in FLOAT_DTYPES:
        raise ValueError(f"`dbias_dtype` must be one of {', '.join(map(str, FLOAT_DTYPES))}; got {dbias_dtype!r}")
    act = 0
    if activation is not None:
        act = activation_id(activation)
        check_float_tensor(pre_act, "pre_act")
        if pre_act.shape != grad.shape:
            raise ValueError(f"`pre_act` must have the shape of `grad` {tuple(grad.shape)}; got {tuple(pre_act.shape)}")
        if pre_act.device != grad.device:
            raise ValueError(f"`pre_act` is on {pre_act.device} but `grad` is on {grad.device}")
    code = 0
    if fp8_dtype is not None:
        code = fp8_format(fp8_dtype).code
        if scale_given_by_caller:
            check_scale(scale, grad.device)
    elif scale is not None:
        raise ValueError("`scale` was given without `fp8_dtype`: pass the FP8 dtype to quantize into, or drop `scale`")
    if transpose and fp8_dtype is None:
        raise ValueError("`transpose=True` needs `fp8_dtype`: the transposed copy is an FP8 operand")
    check_amax(amax, grad.device)
    return act, code


def run_pass(grad, pre_act, activation, scale, fp8_dtype, amax, transpose, compute_dbias=True,
             dbias_dtype=torch.float32, argument="grad"):
    """Validates, flattens to rows, and runs the kernel (or the reference where Triton does not run).
    ``argument``: the caller's name for ``grad``, for the error messages.

    Kept lean: it runs for every FP8 tensor of every step, and its CPU time adds to the launch's.
    """
    act, code = _validate(grad, pre_act, activation, scale, fp8_dtype, amax, transpose, dbias_dtype,
                          argument=argument)
    n = grad.shape[-1]
    flat = grad.dim() == 2
    g2 = grad if flat else as_rows(grad)
    p2 = (pre_act if pre_act.dim() == 2 else as_rows(pre_act)) if act else None
    if not use_triton(g2):
        out, out_t, dbias = dact_dbias_quantize_reference(g2, p2, activation if act else None, scale=scale,
                                                          fp8_dtype=fp8_dtype, amax=amax, transpose=transpose)
        return out.view(grad.shape), out_t, (dbias.to(dbias_dtype) if compute_dbias else None)
    cfg = launch_config(_pass_name(act, compute_dbias), g2.shape[0], n, g2.device, g2.dtype)
    if scale is not None and scale.dim() != 0:
        scale = scale.reshape(())
    if torch.compiler.is_compiling():
        out, out_t, dbias = _dact_dbias_quantize_op(g2, p2, act, scale, code, amax, transpose, compute_dbias,
                                                    cfg.block_m, cfg.block_n, cfg.num_warps, cfg.groups,
                                                    cfg.loop_stages, cfg.prefetch, cfg.chunk_tiles, True,
                                                    dbias_dtype)
        out_t = out_t if transpose else None
        dbias = dbias if compute_dbias else None
    else:
        out, out_t, dbias = _run(g2, p2, act, scale, code, amax, transpose, compute_dbias, cfg, False, dbias_dtype)
    return (out if flat else out.view(grad.shape)), out_t, dbias


def dact_dbias_quantize(grad: torch.Tensor, pre_act: torch.Tensor, activation: str, *,
                        scale: Optional[torch.Tensor] = None, fp8_dtype: Optional[torch.dtype] = None,
                        amax: Optional[torch.Tensor] = None, transpose: bool = False,
                        dbias_dtype: torch.dtype = torch.float32):
    """Activation gradient, bias gradient and FP8 quantization in one pass.

    Args:
        grad: ``[*, N]`` gradient of the activation's output (fp32, bf16 or fp16; any strides).
        pre_act: ``[*, N]`` the activation's input (``x @ W^T + b``), same shape as ``grad``.
        activation: one of ``gelu``, ``gelu_tanh``, ``relu``, ``silu``, ``quick_gelu``, ``squared_relu``.
        scale: fp32 tensor with one element; required with ``fp8_dtype``.
        fp8_dtype: ``torch.float8_e5m2`` or ``torch.float8_e4m3fn``; ``None`` returns ``dx`` in
            ``grad``'s dtype (fused ``dact + dbias`` only).
        amax: fp32 tensor with one element, max-reduced in place with ``max(|dx|)`` of the unscaled
            values (``inf`` if any value is NaN or infinite).
        transpose: also write the ``(M, N) -> (N, M)`` transposed FP8 copy (``M`` = leading elements).
        dbias_dtype: dtype of the returned bias gradient (summed in fp32, rounded once at the end): the
            bias parameter's dtype saves a cast.

    Returns:
        ``(dx, dx_t, dbias)``: ``dx`` shaped like ``grad``; ``dx_t`` of shape ``(N, M)`` or ``None``;
        ``dbias`` ``(N,)`` in ``dbias_dtype``, summed in fp32 with a fixed order (the same bits every run).
        With ``fp8_dtype``: ``dx = saturate(dx * scale)`` rounded to nearest-even.

    Raises:
        TypeError: a non-tensor or a non-float input, a missing scale (or one that is not a tensor).
        ValueError: mismatched shapes or devices, an unknown activation or FP8 dtype, a scale or amax that is
            not a float32 tensor of one element, a scale without ``fp8_dtype``.
    """
    if activation is None:
        raise ValueError("`activation` must name an activation; use dbias_quantize for the plain bias gradient")
    return run_pass(grad, pre_act, activation, scale, fp8_dtype, amax, transpose, dbias_dtype=dbias_dtype)


def dbias_quantize(grad: torch.Tensor, *, scale: Optional[torch.Tensor] = None,
                   fp8_dtype: Optional[torch.dtype] = None, amax: Optional[torch.Tensor] = None,
                   transpose: bool = False, dbias_dtype: torch.dtype = torch.float32):
    """``dact_dbias_quantize`` without the activation term: the backward of a plain linear with bias.

    Returns ``(dx, dx_t, dbias)`` where ``dx`` is ``grad`` quantized (or copied, without ``fp8_dtype``).
    """
    return run_pass(grad, None, None, scale, fp8_dtype, amax, transpose, dbias_dtype=dbias_dtype)


def dact_dbias_quantize_current_scaling(grad: torch.Tensor, pre_act: Optional[torch.Tensor],
                                        activation: Optional[str], *, fp8_dtype: torch.dtype,
                                        transpose: bool = False, margin: int = 0, compute_dbias: bool = True,
                                        dbias_dtype: torch.dtype = torch.float32):
    """Current scaling: the scale comes from this tensor's own amax, so two passes (module docstring).

    ``activation=None`` gives the current-scaling ``dbias_quantize``; ``dbias_dtype`` as in
    ``dact_dbias_quantize``.

    Returns:
        ``(dx, dx_t, dbias, amax, scale)`` with ``scale = fp8_max / amax / 2**margin`` (1 where the
        amax is zero or non-finite), ``amax`` and ``scale`` fp32 tensors of one element.
    """
    return current_scaling_pass(grad, pre_act, activation, fp8_dtype, transpose, margin, compute_dbias, dbias_dtype)


def current_scaling_pass(grad, pre_act, activation, fp8_dtype, transpose, margin, compute_dbias, dbias_dtype,
                         argument="grad"):
    """``dact_dbias_quantize_current_scaling``; ``argument`` is the caller's name for ``grad`` (error messages)."""
    if fp8_dtype is None:
        raise ValueError("`fp8_dtype` is required: current scaling casts to torch.float8_e4m3fn or torch.float8_e5m2")
    fmt = fp8_format(fp8_dtype, optional=False)
    check_margin(margin)
    act, code = _validate(grad, pre_act, activation, None, fp8_dtype, None, transpose, dbias_dtype,
                          scale_given_by_caller=False, argument=argument)
    amax = torch.zeros(1, dtype=torch.float32, device=grad.device)
    leading = grad.shape[:-1]
    g2 = as_rows(grad)
    p2 = as_rows(pre_act) if act else None
    n = g2.shape[1]
    if not use_triton(g2):
        _, _, dbias = dact_dbias_quantize_reference(g2, p2, activation if act else None, amax=amax)
        scale = scale_from_amax_reference(amax, fmt.max, margin)
        out, out_t, _ = dact_dbias_quantize_reference(g2, p2, activation if act else None, scale=scale,
                                                      fp8_dtype=fp8_dtype, transpose=transpose)
        return out.view(*leading, n), out_t, (dbias.to(dbias_dtype) if compute_dbias else None), amax, scale
    traced = torch.compiler.is_compiling()
    op = _current_scaling_op if traced else _current_scaling_impl
    out, out_t, dbias, scale = op(g2, p2, act, code, amax, transpose, margin, compute_dbias, traced,
                                  dbias_dtype)
    return (out.view(*leading, n), out_t if transpose else None,
            (dbias if compute_dbias else None), amax, scale)


def _current_scaling_impl(grad: torch.Tensor, pre_act: Optional[torch.Tensor], activation: int, fp8_code: int,
                        amax: torch.Tensor, transpose: bool, margin: int, compute_dbias: bool,
                        traced: bool, dbias_dtype: torch.dtype,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = grad.shape
    # Pass 1 reads and reduces as the one-pass form does; pass 2 sums no bias gradient, so without an
    # activation it is the cast and takes the cast's launch.
    first = launch_config(_pass_name(activation, compute_dbias), m, n, grad.device, grad.dtype)
    second = launch_config(_pass_name(activation, False), m, n, grad.device, grad.dtype)
    out = torch.empty((m, n), dtype=FORMAT_DTYPES[fp8_code], device=grad.device)
    out_t = torch.empty((n, m) if transpose else (0, 0), dtype=FORMAT_DTYPES[fp8_code], device=grad.device)
    dbias = torch.empty((n if compute_dbias else 0,), dtype=dbias_dtype, device=grad.device)  # pass 1 writes it
    if m == 0 or n == 0:  # an empty batch: amax 0, so scale 1, as scale_from_amax gives; a zero bias gradient
        return out, out_t, dbias.zero_(), torch.ones((), dtype=torch.float32, device=grad.device)
    # Pass 1: amax (and bias gradient); nothing written per element.
    _launch(grad, pre_act, activation, None, 0, amax, False, compute_dbias, False, first, out, out_t, dbias, traced)
    # Pass 2: the FP8 copies, with the scale it derives from pass 1's amax and stores (fp8.scale_from_amax).
    # In the pass, not in torch between the two: there it was about nine tiny launches, 20-24 us a call
    # on an H100 (BENCHMARKS.md, "Current scaling").
    scale = torch.empty((), dtype=torch.float32, device=grad.device)
    _launch(grad, pre_act, activation, scale, fp8_code, amax, transpose, False, True, second, out, out_t, dbias,
            traced, margin=margin)
    return out, out_t, dbias, scale


_current_scaling_op = triton_op("lightning_fuse::quantize_current_scaling", _current_scaling_impl,
                                mutates_args={"amax"})
