"""The kernels' instruction budget, without a GPU: each kernel is compiled for sm_90 (H100/H200) with
the Triton toolchain's own `ptxas`, and its row loop's SASS instructions are counted per element.

Why it matters: a pass that moves B bytes per element at the copy bandwidth must finish one
element every ``B / (bandwidth / SMs / clock)`` cycles on each multiprocessor, and a multiprocessor
issues at most 4 warp instructions (128 thread instructions) per cycle. So at full issue it can
afford ``128 * B * SMs * clock / bandwidth`` instructions per element; no kernel issues every cycle,
so the share of that budget a kernel needs is the issue efficiency it must sustain to run at the
copy bandwidth. The defaults are an H200's (132 SMs, 4249 GB/s measured copy bandwidth; the clock,
1.98 GHz, is the data-sheet boost clock, not a measurement).

    python benchmarks/kernel_isa.py            # table of every kernel at its shipped launch
    python benchmarks/kernel_isa.py --dump out  # also writes each kernel's PTX and SASS there
    python benchmarks/kernel_isa.py --only dbias --inputs bf16,fp16  # one pass, two input dtypes

The specialization matches a launch at sizes divisible by 16 (as Triton specializes them): unit
strides as constants, every other integer and pointer 16-divisible.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lightning_fuse.kernels._launch import DEFAULT_ENCODER, ENCODERS, LAUNCH_RULES
from lightning_fuse.kernels.bias_act import _bias_act_kernel
from lightning_fuse.kernels.dact_dbias_quantize import _dact_dbias_quantize_kernel, _dact_dbias_quantize_queued_kernel

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

_DACT_ARGS = ["grad_ptr", "pre_act_ptr", "out_ptr", "out_t_ptr", "partial_ptr", "dbias_ptr", "counter_ptr",
              "scale_ptr", "amax_ptr",
              "stride_grad_m", "stride_grad_n", "stride_pre_m", "stride_pre_n", "stride_out_m", "stride_out_t_n",
              "M", "N", "rows_per_group", "margin_factor"]
_DACT_TYPES = ["*bf16", "*bf16", "*u8", "*u8", "*fp32", "*fp32", "*i32", "*fp32", "*fp32"] + ["i32"] * 9 + ["fp32"]
# The queued form: a queue pointer after the counters, chunk sizes instead of the row groups' rows.
_QUEUED_ARGS = _DACT_ARGS[:7] + ["queue_ptr"] + _DACT_ARGS[7:-2] + ["chunk_rows", "chunks_per_strip", "margin_factor"]
_QUEUED_TYPES = _DACT_TYPES[:7] + ["*i32"] + _DACT_TYPES[7:-1] + ["i32", "fp32"]
_BIAS_ACT_ARGS = ["h_ptr", "bias_ptr", "y_ptr", "q_ptr", "q_t_ptr", "scale_ptr", "amax_ptr", "pre_ptr",
                  "stride_h_m", "stride_h_n", "stride_y_m", "stride_q_m", "stride_q_t_n", "stride_pre_m",
                  "M", "N", "rows_per_group"]
_BIAS_ACT_TYPES = ["*bf16", "*bf16", "*bf16", "*u8", "*u8", "*fp32", "*fp32", "*bf16"] + ["i32"] * 9


def _dact_case(pass_name, activation, bytes_per_element, alternative=False):
    rule = LAUNCH_RULES[pass_name]
    while alternative and rule.loop_stages == 0:  # the rule's form with a pipelined loop
        rule = rule.alternative
    constants = dict(ACTIVATION=activation, FP8_FORMAT=2 if pass_name != "quantize" else 1, STORE_OUT=True,
                     TRANSPOSE=True, COMPUTE_DBIAS=pass_name != "quantize",
                     FINISH_DBIAS=pass_name != "quantize", DBIAS_BF16=pass_name != "quantize", COMPUTE_AMAX=True,
                     SCALE_FROM_AMAX=False, ENCODER=ENCODERS[DEFAULT_ENCODER], PACK_T=True,
                     LOOP_STAGES=rule.loop_stages or None, CYCLIC_ROWS=False, PREFETCH=rule.prefetch, INDEX_64=False,
                     BLOCK_M=rule.block_m, BLOCK_N=rule.block_n)
    return (_dact_dbias_quantize_kernel, _DACT_ARGS, _DACT_TYPES, {"stride_grad_n": 1, "stride_pre_n": 1},
            constants, rule.num_warps, bytes_per_element)


def _queued_case(activation):
    """The fused pass's queued form: the row groups' case with a queue instead of their loop's options."""
    _, _, _, unit_strides, constants, warps, nbytes = _dact_case("dact_dbias_quantize", activation, 6)
    constants = {k: v for k, v in constants.items() if k not in ("LOOP_STAGES", "CYCLIC_ROWS", "PREFETCH")}
    return (_dact_dbias_quantize_queued_kernel, _QUEUED_ARGS, _QUEUED_TYPES, unit_strides,
            dict(constants, DYNAMIC=True), warps, nbytes)


def with_encoder(case, encoder: str):
    """``case`` built with FP8 encoder ``encoder`` (a name of ``_launch.ENCODERS``)."""
    kernel, names, types, unit_strides, constants, warps, nbytes = case
    return kernel, names, types, unit_strides, dict(constants, ENCODER=ENCODERS[encoder]), warps, nbytes


def with_inputs(case, dtype: str):
    """``case`` built for ``dtype`` inputs (``"bf16"``, ``"fp16"``, ``"fp32"``) instead of bf16 ones."""
    kernel, names, types, unit_strides, constants, warps, nbytes = case
    if "DBIAS_BF16" in constants:  # the launch rounds the bias gradient to bf16 by hand for bf16 inputs only
        constants = dict(constants, DBIAS_BF16=constants["COMPUTE_DBIAS"] and dtype == "bf16")
    return kernel, names, [t.replace("bf16", dtype) for t in types], unit_strides, constants, warps, nbytes


def _bias_act_case(activation=2):
    rule = LAUNCH_RULES["bias_act"]
    constants = dict(ACTIVATION=activation, HAS_BIAS=False, STORE_PRE=False, STORE_Y=True, FP8_FORMAT=1, TRANSPOSE=True,
                     COMPUTE_AMAX=True, ENCODER=ENCODERS[DEFAULT_ENCODER], LOOP_STAGES=rule.loop_stages or None,
                     CYCLIC_ROWS=False, PREFETCH=rule.prefetch, INDEX_64=False, BLOCK_M=rule.block_m, BLOCK_N=rule.block_n)
    return _bias_act_kernel, _BIAS_ACT_ARGS, _BIAS_ACT_TYPES, {"stride_h_n": 1}, constants, rule.num_warps, 6


# name -> (kernel, argument names, types, unit strides, constexprs, warps, bytes per element): the shipped launch
CASES = {
    "dact_dbias_quantize gelu_tanh": _dact_case("dact_dbias_quantize", 2, 6),
    "dact_dbias_quantize gelu": _dact_case("dact_dbias_quantize", 1, 6),
    "dact_dbias_quantize relu": _dact_case("dact_dbias_quantize", 3, 6),
    "dact_dbias_quantize silu": _dact_case("dact_dbias_quantize", 4, 6),
    "dact_dbias_quantize gelu_tanh, 2-deep form": _dact_case("dact_dbias_quantize", 2, 6, alternative=True),
    "dact_dbias_quantize gelu_tanh, queued": _queued_case(2),
    "dbias_quantize": _dact_case("dbias_quantize", 0, 4),
    "quantize": _dact_case("quantize", 0, 4),
    "bias_act gelu_tanh": _bias_act_case(),
    "bias_act gelu": _bias_act_case(1),
}


def compile_for_sm90(kernel, names, types, unit_strides, constants, warps):
    """The compiled kernel for an sm_90 target: no GPU needed."""
    signature = dict(zip(names, types))
    for name in unit_strides:
        signature[name] = "constexpr"
    for name in constants:
        signature[name] = "constexpr"
    divisible = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(zip(names, types))
                 if name not in unit_strides and kind != "fp32"}
    source = ASTSource(fn=kernel, signature=signature, constexprs={**unit_strides, **constants}, attrs=divisible)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def sass_and_registers(ptx: str) -> tuple[str, int]:
    """Assembles the PTX with the bundled ptxas (as Triton does) and disassembles it."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        info = subprocess.run([str(TOOLS / "ptxas"), "-arch=sm_90a", "-v", str(src), "-o", str(cubin)],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(TOOLS / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return sass, int(re.search(r"Used (\d+) registers", info).group(1))


def _instructions(sass: str) -> list[tuple[int, str, str, Optional[int]]]:
    """``(address, opcode, operands, control)`` of every instruction in cuobjdump's SASS. ``control`` is
    the scheduling word ptxas puts in the top bits of each 128-bit instruction (the second hex word
    cuobjdump prints, shifted right by 41: stall cycles, yield, write and read scoreboards, the mask of
    scoreboards waited on, register reuse), or ``None`` where the text has no encodings."""
    lines = sass.splitlines()
    instructions = []
    for i, line in enumerate(lines):
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            control = None
            high = re.match(r"\s+/\* (0x[0-9a-f]{16}) \*/\s*$", lines[i + 1]) if i + 1 < len(lines) else None
            if high:
                control = int(high.group(1), 16) >> 41
            instructions.append((int(m.group(1), 16), m.group(2), m.group(3), control))
    return instructions


def _loop(instructions, innermost: bool = False) -> list[int]:
    """Indices (into ``instructions``) of one iteration of the row loop: see ``loop_body``."""
    branches = []  # (address, target)
    for address, opcode, operands, _ in instructions:
        target = re.match(r"\s+(0x[0-9a-f]+)", operands)
        if opcode == "BRA" and target:
            branches.append((address, int(target.group(1), 16)))
    loops = [(target, address) for address, target in branches if target < address]
    if not loops:
        raise ValueError("no loop found in the SASS")
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    if innermost:
        tiles = [(first, last) for first, last in loops  # converts, or loads a tile 16 bytes a thread
                 if any(first <= a <= last and (op.startswith("F2FP") or op == "LDG.E.128")
                        for a, op, _, _ in instructions)]
        start, end = min(tiles or loops, key=lambda loop: loop[1] - loop[0])
    skipped = [(address, target) for address, target in branches
               if start <= address < target <= end
               and any(address < inner_start and inner_end < target for inner_start, inner_end in loops)]
    return [i for i, (a, _, _, _) in enumerate(instructions)
            if start <= a <= end and not any(first < a < target for first, target in skipped)]


def loop_body(sass: str, innermost: bool = False) -> list[str]:
    """Opcodes of one iteration of the row loop: the instructions between the target of the outermost
    backward branch and it, less any block a forward branch skips that holds a loop of its own (work a
    program does once, on its last row tile, such as summing the bias gradient's partials). With
    ``innermost`` (the queued form, whose tile loop sits in its loop over chunks), the shortest loop
    that converts (``F2FP``) or loads a tile (``LDG.E.128``; a pass that stores nothing, the first of
    current scaling, converts nothing), not the loop that sums the bias gradient's partials."""
    instructions = _instructions(sass)
    return [instructions[i][1] for i in _loop(instructions, innermost)]


def load_wait(sass: str, innermost: bool = False) -> Optional[int]:
    """The fewest instructions, over the row loop's global loads (``LDG``), from a load to the first
    instruction that waits on its scoreboard, following the loop round once (``None`` without such
    loads). A prefetched tile's loads should be waited on near the end of the iteration, hundreds of
    instructions on. ptxas has six scoreboards per warp; where it runs out it gives a load the
    scoreboard of some other variable-latency instruction (an exp, a reciprocal), and whatever waits
    on that one waits on the load as well: the prefetch is then waited on a few instructions after it
    was issued, and the fused pass ran 12-20% slower (H100 and H200, BENCHMARKS.md)."""
    instructions = _instructions(sass)
    body = _loop(instructions, innermost)
    fewest = None
    for position, i in enumerate(body):
        _, opcode, _, control = instructions[i]
        board = None if control is None else (control >> 5) & 7
        if not opcode.startswith("LDG") or board in (None, 7):  # 7: no scoreboard
            continue
        after = body[position + 1:] + body[:position + 1]
        distance = next((d for d, j in enumerate(after, 1)
                         if instructions[j][3] is not None and instructions[j][3] >> 11 & 1 << board), None)
        if distance is not None and (fewest is None or distance < fewest):
            fewest = distance
    return fewest


def analyse(name, case, copy_gbps, sms, clock_ghz, dump: Path | None = None) -> dict:
    kernel, names, types, unit_strides, constants, warps, nbytes = case
    compiled = compile_for_sm90(kernel, names, types, unit_strides, constants, warps)
    sass, registers = sass_and_registers(compiled.asm["ptx"])
    innermost = kernel is _dact_dbias_quantize_queued_kernel
    body = loop_body(sass, innermost)
    per_thread = constants["BLOCK_M"] * constants["BLOCK_N"] // (32 * warps)  # elements per thread per tile
    per_element = len(body) / per_thread
    budget = 128 * nbytes * sms * clock_ghz / copy_gbps  # instructions per element at full issue and copy bandwidth
    kinds = collections.Counter(op.split(".")[0] for op in body)
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        stem = name.replace(" ", "_")
        (dump / f"{stem}.ptx").write_text(compiled.asm["ptx"])
        (dump / f"{stem}.sass").write_text(sass)
    return dict(kernel=name, block=f"{constants['BLOCK_M']}x{constants['BLOCK_N']}", warps=warps,
                bytes_per_element=nbytes, registers=registers,
                shared_bytes=compiled.metadata.shared,
                # what one multiprocessor holds: 64K registers, 64 warps, 228 KB of shared memory
                programs_per_sm=min(65536 // (registers * 32 * warps), 64 // warps,
                                    233472 // max(compiled.metadata.shared + 1024, 1)),
                loop_sass_per_element=round(per_element, 1), budget_at_copy=round(budget, 1),
                issue_needed_at_copy=round(per_element / budget, 2),
                issue_needed_at_085=round(0.85 * per_element / budget, 2),
                top=", ".join(f"{op} {count / per_thread:.1f}" for op, count in kinds.most_common(6)),
                # the row loop's global stores by width (tests/test_instruction_budget.py)
                loop_stores=dict(collections.Counter(op for op in body if op.startswith("STG"))),
                # memory fences in the whole kernel: each holds its program's slot until its stores land
                fences=len(re.findall(r"\bMEMBAR\b", sass)),
                # instructions from a loop's load to the first wait on it (load_wait)
                load_wait=load_wait(sass, innermost))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copy-gbps", type=float, default=4249.0, help="measured copy bandwidth (bench_kernels.py)")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--clock-ghz", type=float, default=1.98)
    parser.add_argument("--dump", type=Path, help="write each kernel's PTX and SASS into this folder")
    parser.add_argument("--only", help="analyse only the kernels whose name contains this")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    parser.add_argument("--inputs", default="bf16", help="input dtypes, comma-separated: bf16, fp16, fp32")
    parser.add_argument("--encoder", choices=sorted(ENCODERS), default=DEFAULT_ENCODER,
                        help="the FP8 encoder the kernels are built with (kernels/_launch.py's ENCODERS)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("kernel_isa.py compiles for a GPU target: run it without TRITON_INTERPRET=1")
    rows = [analyse(name if dtype == "bf16" else f"{name}, {dtype}", with_encoder(with_inputs(case, dtype), args.encoder),
                    args.copy_gbps,
                    args.sms, args.clock_ghz, args.dump)
            for name, case in CASES.items() if args.only is None or args.only in name
            for dtype in args.inputs.split(",")]
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths)))


if __name__ == "__main__":
    main()
