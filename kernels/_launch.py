"""Input validation, reshaping and launch-size choices shared by the kernel launchers."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

__all__ = [
    "FLOAT_DTYPES",
    "LaunchConfig",
    "as_rows",
    "check_amax",
    "check_float_tensor",
    "check_margin",
    "check_scale",
    "device_has_fp8",
    "LAUNCH_RULES",
    "LaunchRule",
    "launch_config",
    "launcher",
    "row_groups_rule",
    "needs_index_64",
    "row_loop",
    "DEFAULT_ENCODER",
    "ENCODERS",
    "fp8_encoder",
    "use_triton",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


ENCODERS = {"int": 0, "ptx": 1, "ptx4": 2, "tile": 3}  # the kernels' ENCODER constexpr (fp8.py's fp8_codes)
DEFAULT_ENCODER = "ptx"


def fp8_encoder(t: torch.Tensor) -> int:
    """How kernels encode FP8 for ``t``'s device: integer arithmetic (0; the interpreter, GPUs before
    compute capability 8.9) or the hardware conversion: one value per instruction (1), four values
    per three instructions (2), or (3) where a pass stores a tile's codes both row-wise and as the
    transposed copy's words, both layouts at once (fp8.py's ``fp8_tile_codes``; elsewhere as 1).

    ``LIGHTNING_FUSE_FP8_ENCODER=int|ptx|ptx4|tile`` picks one on GPUs (tests/test_gpu.py checks the
    hardware ones against the integer encoder bit for bit); ``DEFAULT_ENCODER`` without it.
    """
    if not t.is_cuda:
        return 0
    choice = os.environ.get("LIGHTNING_FUSE_FP8_ENCODER", DEFAULT_ENCODER)
    if choice not in ENCODERS:
        raise ValueError(f"LIGHTNING_FUSE_FP8_ENCODER must be one of {', '.join(ENCODERS)}; got {choice!r}")
    return ENCODERS[choice] if device_has_fp8(t.device) else 0


_DEVICES: dict[int, tuple[tuple[int, int], int, str]] = {}  # index -> (compute capability, multiprocessors, name)


def _device_info(device: torch.device) -> tuple[tuple[int, int], int, str]:
    """Cached per CUDA device: asked on every launch and every FP8 forward. A plain dict, which
    ``torch.compile`` reads as a constant (it warns about ``lru_cache``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICES:
        props = torch.cuda.get_device_properties(index)
        _DEVICES[index] = ((props.major, props.minor), props.multi_processor_count, props.name)
    return _DEVICES[index]


def device_has_fp8(device: torch.device) -> bool:
    """A CUDA device with FP8 tensor cores and conversions (compute capability 8.9 or newer)."""
    return device.type == "cuda" and _device_info(device)[0] >= (8, 9)


def launcher(kernel, traced: bool):
    """How a launcher calls ``kernel``: through ``wrap_triton`` while ``torch.compile`` traces the
    registered op (so the graph holds the kernel), directly in eager mode. The wrapped call in eager
    mode goes through a higher-order-op dispatch that cost 0.6-2.5 ms of CPU time per launch on an
    H200 host (benchmarks/bench_overhead.py), 12 to 87 times the kernels' own device time.
    """
    return wrap_triton(kernel) if traced else kernel


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors when the Triton interpreter is on. Tensors on
    other devices (``meta`` among them: no data to run on) take the pure-torch references."""
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


def check_float_tensor(t: object, argument: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{argument}` must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        accepted = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"`{argument}` must have dtype {accepted}; got {t.dtype}")
    if t.dim() < 1:
        raise ValueError(f"`{argument}` must have at least one dimension ([*, N]); got a 0-d tensor")
    return t


def check_scale(scale: object, device: torch.device, argument: str = "scale") -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        raise TypeError(
            f"`{argument}` must be a float32 tensor with one element when `fp8_dtype` is given; "
            f"got {type(scale).__name__}"
        )
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(
            f"`{argument}` must be a float32 tensor with one element; got dtype {scale.dtype} "
            f"with {scale.numel()} elements"
        )
    if scale.device != device:
        raise ValueError(f"`{argument}` is on {scale.device} but the input is on {device}")
    return scale


def check_margin(margin: object) -> int:
    """``margin`` of ``scale = fp8_max / amax / 2**margin``: an int (the registered ops' schema says so)."""
    if not isinstance(margin, int) or isinstance(margin, bool):
        raise ValueError(f"`margin` must be an int (scale = fp8_max / amax / 2**margin); got {margin!r}")
    return margin


def check_amax(amax: object, device: torch.device) -> torch.Tensor | None:
    if amax is None:
        return None
    if not isinstance(amax, torch.Tensor):
        raise TypeError(f"`amax` must be a float32 tensor with one element or None; got {type(amax).__name__}")
    if amax.dtype != torch.float32 or amax.numel() != 1:
        raise ValueError(
            f"`amax` must be a float32 tensor with one element (it is max-reduced in place); "
            f"got dtype {amax.dtype} with {amax.numel()} elements"
        )
    if amax.device != device:
        raise ValueError(f"`amax` is on {amax.device} but the input is on {device}")
    return amax


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(M, N)`` over its last dimension: a view where the strides allow one, else a copy."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: N may be 0


def needs_index_64(m: int, n: int, *tensors: Optional[torch.Tensor]) -> bool:
    """Whether a pass over ``(m, n)`` rows (contiguous outputs) reading or writing ``tensors`` (``None``
    skipped) reaches an element offset of 2**31: then its kernel indexes in 64 bits (``INDEX_64``)."""
    extents = (1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
               for t in tensors if t is not None)
    return max(m * n, *extents) >= 2**31


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    groups: int  # programs along M; each walks ceil(M / groups) rows, tile by tile
    loop_stages: int = 0  # software-pipeline depth of the row loop (0: the compiler's choice)
    max_registers: int = 0  # per-thread register cap for the compiler (0: its choice); eager launches only
    # Row tiles dealt to the groups in turn (group g takes tiles g, g + groups, ...) instead of one
    # contiguous range per group, so programs running side by side write neighbouring bytes of each
    # transposed row. The launch rules take it where one wave holds 2 to ``LaunchRule.cyclic_max_groups``
    # row groups (1.03-1.07x on an H200; 17-18% slower at 16384x16384 in an earlier round: BENCHMARKS.md).
    cyclic_rows: bool = False
    # Each tile's inputs loaded one iteration ahead into registers (the loop carries them), so a
    # program has two tiles' loads in flight without the shared-memory round trip of a pipelined loop.
    prefetch: bool = False
    # The queued form of the backward passes (dact_dbias_quantize.py): one program per slot (``groups``
    # programs, at most one per chunk), each taking chunks of ``chunk_tiles`` row tiles of one column
    # strip from a queue until none is left. 0: row groups, one program per group and strip.
    chunk_tiles: int = 0

    def row_groups(self, m: int) -> tuple[int, int]:
        """``(rows_per_group, groups)`` for ``m`` rows: whole tiles per group, no empty group."""
        rows = -(-m // self.groups)
        rows = -(-rows // self.block_m) * self.block_m
        return rows, -(-m // rows)


@triton.jit
def row_loop(pid_m, rows_per_group, M, BLOCK_M: tl.constexpr, CYCLIC_ROWS: tl.constexpr):
    """``(start, end, step)`` of row group ``pid_m``'s tiles (``LaunchConfig.row_groups`` /
    ``cyclic_rows``): one contiguous range, or every ``groups``-th tile from its own first one."""
    if CYCLIC_ROWS:
        return pid_m * BLOCK_M, M, tl.num_programs(1) * BLOCK_M
    else:
        return pid_m * rows_per_group, pid_m * rows_per_group + rows_per_group, BLOCK_M


@dataclass(frozen=True)
class LaunchRule:
    """How one pass is launched on a GPU: its tiles, warps and loop pipelining, and its grid.

    With ``whole_waves`` the grid is the fewest whole waves (``programs_per_sm`` programs per
    multiprocessor each: the compiled kernel's residency) whose programs fill at least
    ``min_wave_fill`` of their slots; without, ``programs_per_sm`` programs per multiprocessor,
    rounded up to whole row groups.

    ``alternative``: another form of the pass (another loop form, so another residency),
    launched instead where this one's grid fills less than ``keep_fill`` of its waves' slots and the
    alternative's fills more.

    ``tiles_per_program``: where giving each program that many row tiles makes at least
    ``min_waves`` waves, the grid is that many programs instead of whole waves, and the GPU hands
    each program to whichever multiprocessor frees a slot first (the passes' traffic alone, one
    tile per program, moved 4-20% faster than in whole waves: benchmarks/access_patterns.py).
    Only for passes without the bias gradient, which measured slower in such grids (BENCHMARKS.md).
    ``max_rows_per_program``: whole waves are added (up to ``_MAX_WAVES``) while a program would
    walk more rows than this; 0 sets no bound.
    ``cyclic_max_groups``: where the grid is one wave (every program resident at once) of two to
    this many row groups, the row tiles are dealt to the groups in turn (``LaunchConfig.cyclic_rows``),
    so the programs running side by side read neighbouring rows; 0: never.
    ``cyclic_devices``: on the GPUs whose name holds one of these, the row tiles are dealt in turn
    over several waves too (still two to ``cyclic_max_groups`` row groups); empty: one wave only.
    """
    block_m: int
    block_n: int
    num_warps: int
    loop_stages: int
    programs_per_sm: int
    whole_waves: bool
    min_wave_fill: float = 0.85
    alternative: Optional["LaunchRule"] = None
    keep_fill: float = 0.0
    prefetch: bool = False  # LaunchConfig.prefetch
    tiles_per_program: int = 0
    min_waves: int = 0
    max_rows_per_program: int = 0
    chunk_tiles: int = 0  # LaunchConfig.chunk_tiles: the queued form, one program per slot
    # The queued form only for inputs of these dtypes, on the GPUs whose name holds one of
    # ``queued_devices`` (empty: every GPU, and the interpreter too), and where its chunks number at
    # least ``min_chunks_per_slot`` per slot (on a GPU); elsewhere the ``alternative`` rule. Few chunks
    # per program leave the last ones' programs a long tail.
    queued_dtypes: tuple = ()
    queued_devices: tuple = ()
    min_chunks_per_slot: int = 0
    cyclic_max_groups: int = 0
    cyclic_devices: tuple = ()


_MAX_WAVES = 4


# The fastest of the launch sweeps on an H200 (benchmarks/bench_kernels.py --sweep; BENCHMARKS.md).
# The passes tile by four interleaved row sets (block_m / 4 rows each): these tiles give each thread
# 16-byte loads of bf16 rows. Whole waves at the compiled kernels' residency on an H200 (3, 2, 4 and
# 5 programs per multiprocessor): the fewest waves, up to 4, whose programs fill 85% of their slots
# (N = 6400 in the fused pass: one wave of 3 row groups x 100 strips would fill 76%, two fill 88%).
# Every pass loads each tile's inputs one iteration ahead (``prefetch``): two tiles in flight per
# program, against one without (the bias gradient: 2-4% faster at the two smaller sizes of
# BENCHMARKS.md; the activation 3-9% at four of five sizes; the cast 2-5%) or three through shared
# memory in the fused pass's pipelined loop (2.5-6% faster at the two largest sizes).
# The fused pass has a second form, its loop pipelined two deep: 126 registers, so 4 programs per
# multiprocessor instead of the prefetching form's 3. Where the prefetching form's waves leave more
# than a tenth of the slots idle the two-deep form is the faster (16384x6400: 5 row groups x 100
# strips fill one wave to 95%, against two waves filled to 88%).
# The backward passes' programs walk at most 8192 rows (``max_rows_per_program``): two waves of
# shorter programs instead of one were 1-3% faster for the bias gradient where one wave's programs
# walk 16384 rows (128 x 64 tiles at 32768x8192 and 16384x16384), 0.9% for the fused pass at
# 32768x8192 (10944 rows), and slower where programs walk fewer (8192x3072, 16384x6400). The bias
# gradient's pass runs 128 x 64 tiles of 8 warps: 3-4% faster than 64 x 64 tiles of 4 warps at those
# two sizes, as fast at the other two.
# The two passes without a bias gradient, the cast and the forward activation, give each program a
# few row tiles where that makes 4 waves or more (``tiles_per_program``): two for the cast, 1.03-1.11x
# faster than whole waves and 1.02-1.03x faster than four tiles; four for the activation, 1.03-1.10x
# faster than whole waves. The backward passes keep whole waves: in programs of two or four row
# tiles they measured 5-31% slower.
# The backward passes deal their row tiles to the row groups in turn (``cyclic_max_groups``) where
# the grid is one wave of at most 8 groups: on an H200 the bias gradient's pass 1.05-1.07x and the
# fused pass's 1.03-1.04x faster at 8192x3072, 16384x3072 and 4096x4096 in a same-run comparison, and
# 0.96x / 0.99x at 8192x1024 (16 and 32 groups). (Over several waves the bias gradient's pass was
# 1.04-1.06x faster too, but 17% slower at 16384x16384 in an earlier round: not taken there.)
# The fused pass's queued form (LaunchConfig.chunk_tiles: one program per slot, each taking chunks of
# four 64-row tiles of one strip from a queue as it frees up) is taken on H100s only
# (``queued_devices``): there it is 2.5-8.2% faster than the row groups at 16384x6400 and larger with
# bf16 and fp16 inputs, tanh GELU and quick GELU alike; on the H200 the other rules are set for it was
# 6-7% slower (0.180 against 0.169 ms at 16384x6400, 0.457 against 0.420 at 32768x8192, 0.455
# against 0.429 at 16384x16384: BENCHMARKS.md). Only the H100 80GB HBM3 (SXM) was measured.
LAUNCH_RULES: dict[str, LaunchRule] = {
    "dact_dbias_quantize": LaunchRule(64, 64, 4, 0, 3, True, prefetch=True, chunk_tiles=4,
                                      queued_dtypes=(torch.bfloat16, torch.float16), queued_devices=("H100",),
                                      min_chunks_per_slot=8,
                                      alternative=LaunchRule(64, 64, 4, 0, 3, True, prefetch=True,
                                                             max_rows_per_program=8192, cyclic_max_groups=8,
                                                             alternative=LaunchRule(64, 64, 4, 2, 4, True),
                                                             keep_fill=0.9)),
    "dbias_quantize": LaunchRule(128, 64, 8, 0, 2, True, prefetch=True, max_rows_per_program=8192,
                                 cyclic_max_groups=8),
    "quantize": LaunchRule(64, 64, 8, 0, 4, True, prefetch=True, tiles_per_program=2, min_waves=4),
    "bias_act": LaunchRule(32, 64, 8, 0, 5, True, prefetch=True, tiles_per_program=4, min_waves=4),
}


def launch_config(pass_name: str, m: int, n: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    """Tiles and row groups for an ``(m, n)`` pass named in ``LAUNCH_RULES`` on inputs of ``dtype``.

    Each program walks a column strip over a group of rows, so per-column partial sums (the bias
    gradient) stay in registers; the group count gives every multiprocessor the rule's programs.
    """
    rule = LAUNCH_RULES[pass_name]
    if torch.compiler.is_compiling():  # sizes may be symbolic there (not hashable): no cache
        return _pick_config(m, n, device, rule, dtype)
    key = (pass_name, m, n, device, dtype)
    config = _CONFIGS.get(key)
    if config is None:
        config = _CONFIGS[key] = _pick_config(m, n, device, rule, dtype)
    return config


_CONFIGS: dict[tuple, LaunchConfig] = {}  # per shape: a launch costs tens of microseconds, this should not add to it


def row_groups_rule(rule: LaunchRule) -> LaunchRule:
    """The rule of ``rule``'s row groups: its ``alternative`` where ``rule`` is a queued form."""
    return rule.alternative if rule.chunk_tiles else rule


def _pick_config(m: int, n: int, device: torch.device, rule: LaunchRule,
                 dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    if rule.chunk_tiles:
        if dtype in rule.queued_dtypes and _queued_here(device, rule):
            config, enough = _queued_config(m, n, device, rule)
            if enough:
                return config
        return _pick_config(m, n, device, row_groups_rule(rule), dtype)
    config, fill = _config_and_fill(m, n, device, rule)
    if rule.alternative is not None and fill < rule.keep_fill:
        other, other_fill = _config_and_fill(m, n, device, rule.alternative)
        if other_fill > fill:
            return other
    return config


def _queued_here(device: torch.device, rule: LaunchRule) -> bool:
    """Whether ``rule``'s queued form is taken on ``device``: every device where the rule names none,
    else the GPUs whose name holds one of ``queued_devices`` (not the interpreter)."""
    return not rule.queued_devices or _named_gpu(device, rule.queued_devices)


def _named_gpu(device: torch.device, names: tuple) -> bool:
    """Whether ``device`` is a GPU whose name holds one of ``names`` (never the interpreter)."""
    return device.type == "cuda" and any(name in _device_info(device)[2] for name in names)


# Interpreter launches: small tiles (block_m, block_n, warps) and few slots (multiprocessors, programs
# on each), so that tests cross tile edges, row groups and chunks.
_INTERPRETER_TILES = (16, 32, 1)
_INTERPRETER_SLOTS = (2, 2)


def _queued_config(m: int, n: int, device: torch.device, rule: LaunchRule) -> tuple[LaunchConfig, bool]:
    """The rule's queued form for ``(m, n)`` (one program per slot), and whether it has enough chunks
    per slot (``min_chunks_per_slot``; any number in the interpreter, whose chunks are two tiles, so that
    tests cross chunk edges and strips within a program)."""
    if device.type != "cuda":
        (block_m, block_n, num_warps), (sms, programs_per_sm) = _INTERPRETER_TILES, _INTERPRETER_SLOTS
        chunk_tiles, slots, least = 2, sms * programs_per_sm, 1
    else:
        block_m, block_n, num_warps, chunk_tiles = rule.block_m, rule.block_n, rule.num_warps, rule.chunk_tiles
        slots, least = _device_info(device)[1] * rule.programs_per_sm, rule.min_chunks_per_slot
    chunks = -(-n // block_n) * -(-m // (block_m * chunk_tiles))
    config = LaunchConfig(block_m, block_n, num_warps, slots, prefetch=True, chunk_tiles=chunk_tiles)
    return config, chunks >= least * slots


def _config_and_fill(m: int, n: int, device: torch.device, rule: LaunchRule) -> tuple[LaunchConfig, float]:
    """The rule's configuration for ``(m, n)``, and the share of its waves' slots its programs fill."""
    block_m, block_n, num_warps = rule.block_m, rule.block_n, rule.num_warps
    programs_per_sm, loop_stages, whole_waves = rule.programs_per_sm, rule.loop_stages, rule.whole_waves
    if device.type != "cuda":
        (block_m, block_n, num_warps), (sms, programs_per_sm) = _INTERPRETER_TILES, _INTERPRETER_SLOTS
        loop_stages, whole_waves = 0, False
    else:
        sms = _device_info(device)[1]
    strips = max(1, -(-n // block_n))
    row_tiles = max(1, -(-m // block_m))
    slots = sms * programs_per_sm
    config = LaunchConfig(block_m, block_n, num_warps, 1, loop_stages=loop_stages, prefetch=rule.prefetch)
    if rule.tiles_per_program:
        groups = -(-row_tiles // rule.tiles_per_program)
        if groups * strips >= rule.min_waves * slots:
            return dataclasses.replace(config, groups=groups), 1.0
    if whole_waves:
        for waves in range(1, _MAX_WAVES + 1):
            groups = waves * slots // strips
            if groups >= row_tiles:
                break
            filled = groups * strips >= rule.min_wave_fill * waves * slots
            short = not rule.max_rows_per_program or (
                -(-row_tiles // max(1, groups)) * block_m <= rule.max_rows_per_program)
            if filled and short:
                break
    else:
        groups = -(-slots // strips)
    groups = max(1, min(row_tiles, groups))
    # Even out the tiles per group so no program is left with an empty range.
    tiles_per_group = -(-row_tiles // groups)
    groups = -(-row_tiles // tiles_per_group)
    programs = groups * strips
    waves = -(-programs // slots)
    # Never in the interpreter: its grids are not whole waves.
    cyclic = whole_waves and 1 < groups <= rule.cyclic_max_groups and (
        waves == 1 or _named_gpu(device, rule.cyclic_devices))
    return dataclasses.replace(config, groups=groups, cyclic_rows=cyclic), programs / (waves * slots)
