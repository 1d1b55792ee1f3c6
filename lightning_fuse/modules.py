"""The swapped-in modules: ``FusedLinearBiasActivation`` (a chain) and ``FP8Linear`` (other linears).

Both hold the original ``Parameter`` objects, as stored (``nn.Linear``'s ``(out, in)`` weight or
HF ``Conv1D``'s ``(in, out)``), so ``state_dict`` keys and values do not change.

Paths, chosen per call:

- FP8, inside an enabled ``fp8_autocast`` on a GPU with FP8 (compute capability >= 8.9), or on
  CPU with ``emulate=True``: the input and weight are cast to e4m3 (the weight once per optimizer
  step), the forward GEMM runs through ``torch._scaled_mm`` (with the bias in its epilogue for bf16
  outputs); the backward runs the fused kernel
  (``dact_dbias_quantize``: activation and bias gradients and the FP8 gradient, row-wise and
  transposed, in one pass) and then the dgrad and wgrad GEMMs in FP8.
- high precision otherwise (no recipe, CPU, a GPU without FP8, shapes ``_scaled_mm`` rejects, an
  empty batch): PyTorch GEMMs, and a chain's backward is still the fused ``dact + dbias`` kernel.
  Falling back where FP8 was asked for warns once, saying why.

``torch._scaled_mm`` needs ``in_features`` and ``out_features`` to be multiples of 16 (every GEMM
contracts or produces them); the token count only enters the weight-gradient GEMM as its
contraction dimension, which is zero-padded to a multiple of 16 when it is not one.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_fuse.kernels import (
    ACTIVATIONS,
    bias_act,
    dact_dbias_quantize,
    dact_dbias_quantize_current_scaling,
    dbias_quantize,
    device_has_fp8,
    quantize,
    quantize_current_scaling,
    use_triton,
)

from .activation_skip import note_output, parent_running, suspended
from .autocast import FP8Context, active_context
from .recipe import DelayedScaling, Recipe
from .scaling import FP8ScalingState

__all__ = ["FP8Linear", "FP8LinearBase", "FusedLinearBiasActivation", "fp8_device_problem", "fp8_shape_reason", "is_linear_like",
           "linear_dims"]

_WARNED: set[str] = set()


def fp8_device_problem(device: torch.device, emulate: bool = False) -> str:
    """Why the swapped modules run in high precision on ``device``, or ``""`` where FP8 runs there."""
    if device_has_fp8(device) or (emulate and device.type == "cpu"):
        return ""
    if device.type == "cuda":
        return "the GPU has no FP8 (compute capability 8.9 or newer needed)"
    return f"FP8 GEMMs need a CUDA GPU; the input is on {device} (emulate=True runs them on CPU)"


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` or HF's ``Conv1D`` (matched by name: transformers is not a dependency)."""
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and hasattr(module, "nf"))


def linear_dims(module: nn.Module) -> tuple[int, int, bool]:
    """``(in_features, out_features, weight_is_in_out)`` of a linear-like module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if is_linear_like(module):
        return module.weight.shape[0], module.weight.shape[1], True
    raise TypeError(f"expected nn.Linear or transformers' Conv1D; got {type(module).__name__}")


def fp8_shape_reason(in_features: int, out_features: int) -> str:
    """Why ``torch._scaled_mm`` cannot run these dimensions, or ``""``."""
    bad = [f"{name}={value}" for name, value in (("in_features", in_features), ("out_features", out_features))
           if value % 16]
    return f"{' and '.join(bad)} not a multiple of 16, which torch._scaled_mm requires" if bad else ""


def activation_forward(h: torch.Tensor, activation: str) -> torch.Tensor:
    """PyTorch's own ops for each activation name (the plain, unfused computation)."""
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    if activation == "silu":
        return F.silu(h)
    if activation == "quick_gelu":
        return h * torch.sigmoid(1.702 * h)
    if activation == "squared_relu":
        return torch.square(F.relu(h))
    raise ValueError(f"`activation` must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the Triton kernels take


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


@dataclass
class _FP8Plan:
    """What one FP8 call needs besides its tensors (non-tensor arguments of the autograd function)."""

    module: "FP8LinearBase"
    recipe: Recipe
    state: Optional[FP8ScalingState]
    dtype: torch.dtype
    need_wgrad: bool  # decided outside the autograd function, where grad mode is still visible
    handed: Optional[tuple] = None  # the input's (FP8, FP8 transposed, scale_inv, amax), written by the producing chain
    grad_enabled: bool = True  # grad mode at the call (the autograd function's forward runs without it)
    handoff: Optional[tuple] = None  # set by the forward: (consumer, FP8, FP8 transposed, scale_inv, amax) of the output
    replay: Optional[tuple] = None  # a checkpointed recomputation's (scale, scale_inv): its forward's forward group

    def forward_slot(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scale, scale_inv, amax)`` of forward slot ``index``: the state's; in the recomputation of a
        checkpointed forward, the scales that forward used (an update may have replaced them since) and
        a scratch amax (the forward recorded the real one)."""
        if self.replay is None:
            return self.state.slot("forward", index)
        scale, scale_inv = self.replay
        return scale[index], scale_inv[index], scale.new_zeros(1)


def _pad_tokens(t: torch.Tensor) -> torch.Tensor:
    """Zero-pads the last (token) dimension of an FP8 ``(rows, M)`` operand to a multiple of 16."""
    pad = -t.shape[1] % 16
    if not pad:
        return t
    padded = t.new_zeros((t.shape[0], t.shape[1] + pad))
    padded[:, :t.shape[1]] = t
    return padded


@torch.library.custom_op("lightning_fuse::scaled_mm", mutates_args=())
def _scaled_mm_op(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: Optional[torch.Tensor], out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    return _scaled_mm_eager(a, b, scale_a, scale_b, bias, out_dtype, fast_accum)


@_scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, bias, out_dtype, fast_accum):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


_EPILOGUE_BIAS_DTYPES = (torch.bfloat16,)  # measured on an H200; torch also takes fp16, not checked there


def epilogue_bias(bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The bias as the GEMM's epilogue takes it, or ``None`` where it is added after the GEMM.

    cuBLASLt adds a bias to the FP8 GEMM's fp32 accumulator for free when the output and the bias are
    bf16 (``torch._scaled_mm`` rejects an fp32 bias); a separate add of the bias cost 0.09-0.31 ms
    per GEMM at 16384 tokens on an H200 (BENCHMARKS.md). The bias is rounded to the output dtype
    first, as ``torch.autocast`` rounds it for ``F.linear``.
    """
    if bias is None or out_dtype not in _EPILOGUE_BIAS_DTYPES:
        return None
    return bias if bias.dtype == out_dtype else bias.to(out_dtype)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype, fast_accum: bool = False, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) (+ bias)``: ``a`` row-major, ``b`` column-major, per-tensor scales;
    ``bias`` (from ``epilogue_bias``) is added in the GEMM's epilogue.

    Under ``torch.compile`` the GEMM is an opaque op (the same cuBLASLt call): Inductor's own
    lowering of ``_scaled_mm`` failed an internal assertion on these operands with torch 2.11.
    """
    if scale_a.dim():
        scale_a = scale_a.reshape(())
    if scale_b.dim():
        scale_b = scale_b.reshape(())
    if torch.compiler.is_compiling():
        return _scaled_mm_op(a, b, scale_a, scale_b, bias, out_dtype, fast_accum)
    return _scaled_mm_eager(a, b, scale_a, scale_b, bias, out_dtype, fast_accum)


def _scaled_mm_eager(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                     bias: Optional[torch.Tensor], out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """The GEMM itself, eager or inside the opaque op: cuBLASLt on GPUs, the emulation on CPU."""
    if a.device.type == "cpu":
        return _emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                        out_dtype: torch.dtype, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``_scaled_mm`` on CPU (``emulate=True``): the FP8 operands widened to float32 (exactly), one
    float32 matmul, the scales and the bias applied to its result, as cuBLASLt applies them to its
    float32 accumulator.

    ``torch._scaled_mm``'s own CPU kernel took 2.2 s for a 2048x128x512 e4m3 GEMM (1000 times this),
    and it accepts operands cuBLASLt rejects; so the operands are checked here as the GPU would
    take them: ``a`` row-major, ``b`` column-major, the contraction and output widths multiples of
    16, not both e5m2, a bias only in the output's dtype, scales 16-byte aligned
    (``tests/test_gpu.py`` checks each of these on the GPU).
    """
    (m, k), (k_b, n) = a.shape, b.shape
    problems = []
    if k != k_b:
        problems.append(f"inner dimensions {k} and {k_b} differ")
    if k % 16 or n % 16:
        problems.append(f"contraction width {k} and output width {n} must be multiples of 16")
    if a.stride(1) != 1 and m > 1:
        problems.append(f"`a` must be row-major; got strides {a.stride()}")
    if b.stride(0) != 1 and k_b > 1:
        problems.append(f"`b` must be column-major; got strides {b.stride()}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        problems.append("e5m2 x e5m2 has no cuBLASLt kernel")
    if bias is not None and bias.dtype != out_dtype:
        problems.append(f"a {bias.dtype} bias with {out_dtype} output")
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if scale.data_ptr() % 16:
            problems.append(f"`{name}` not 16-byte aligned (cuBLASLt: CUBLAS_STATUS_NOT_SUPPORTED)")
    if problems:
        raise RuntimeError(f"FP8 GEMM {m}x{k} @ {k_b}x{n} ({a.dtype}, {b.dtype}) that cuBLASLt would reject: "
                           + "; ".join(problems))
    with torch.autocast(a.device.type, enabled=False):  # float32 throughout, as the GPU's accumulator
        out = torch.mm(a.to(torch.float32), b.to(torch.float32)).mul_(scale_a.float() * scale_b.float())
        if bias is not None:
            out += bias.to(torch.float32)
        return out.to(out_dtype)


def _add_bias_and_activate(h: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str]):
    """``(pre_act, y)``: the bias (if any) added to the GEMM output, then the activation (one pass on
    GPUs, into the GEMM output)."""
    if activation and use_triton(h):
        y, _, _ = bias_act(h, bias, activation, pre_act_out=h)
        return h, y
    if bias is not None:
        # Out of place (the same traffic): without an activation h is the FP8 function's output, and torch
        # 2.11's trace of an autograd.Function whose output its forward changed in place gave that
        # output's gradient as zeros.
        h = h + bias.to(h.dtype)
    return h, (activation_forward(h, activation) if activation else h)


class _FP8LinearFunction(torch.autograd.Function):
    """FP8 forward and backward of ``act(x @ W^T + b)`` (``act`` may be absent)."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], plan: _FP8Plan):
        # 2-D in, 2-D out: the caller reshapes outside, so the output is no view made in here (autograd
        # refuses in-place changes to those) and its in-place use stays possible.
        module = plan.module
        need_wgrad = plan.need_wgrad
        recipe = plan.recipe
        index = module.fp8_index
        handed = plan.handed
        if handed is not None:
            # The producing chain's activation pass already wrote this input's FP8 copies and its amax.
            xq, xq_t, scale_inv_x, amax_handed = handed
            plan.handed = None  # the plan lives on in the backward's context, which needs no row-wise copy
            amax_x = plan.forward_slot(2 * index)[2]
            torch.maximum(amax_x, amax_handed, out=amax_x)
        elif isinstance(recipe, DelayedScaling):
            scale_x, scale_inv_x, amax_x = plan.forward_slot(2 * index)
            xq, xq_t = quantize(x2, scale=scale_x, fp8_dtype=recipe.forward_dtype, amax=amax_x, transpose=need_wgrad)
        else:
            xq, xq_t, _, scale_x = quantize_current_scaling(x2, fp8_dtype=recipe.forward_dtype,
                                                            transpose=need_wgrad, margin=recipe.margin)
            scale_inv_x = scale_x.reciprocal()
        w_nk, w_kn, scale_inv_w = module._fp8_weight(plan)
        gemm_bias = epilogue_bias(bias, plan.dtype)
        h = _scaled_mm(xq, w_nk.t(), scale_inv_x, scale_inv_w, plan.dtype, fast_accum=True, bias=gemm_bias)
        # Where the GEMM added the bias, h is already the pre-activation; else the activation pass adds it.
        later_bias = bias if gemm_bias is None else None
        activation = module.activation
        consumer = module._consumer_for(plan)
        if consumer is None:
            h, y = _add_bias_and_activate(h, later_bias, activation)
        else:
            # One pass: bias, activation, and the consumer's FP8 input (row-wise, transposed, amax).
            scale_c, scale_inv_c, amax_c = plan.forward_slot(2 * consumer.fp8_index)
            # The output's amax goes into the consumer's history only if the consumer uses this copy (it
            # may get another input, or none): it does so itself, from this tensor.
            amax_y = torch.zeros_like(amax_c)
            consumer_wgrad = consumer.weight.requires_grad and plan.grad_enabled
            y, yq, yq_t = bias_act(h, later_bias, activation, scale=scale_c, fp8_dtype=recipe.forward_dtype,
                                   amax=amax_y, transpose=consumer_wgrad, pre_act_out=h)
            plan.handoff = (consumer, yq, yq_t, scale_inv_c, amax_y)
        ctx.plan = plan
        ctx.has_bias = bias is not None
        ctx.save_for_backward(h if activation else None, xq_t if need_wgrad else None, w_kn, scale_inv_x, scale_inv_w)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        _no_double_backward()
        h, xq_t, w_kn, scale_inv_x, scale_inv_w = ctx.saved_tensors
        plan: _FP8Plan = ctx.plan
        module = plan.module
        recipe = plan.recipe
        n = module.out_features
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_wgrad = need_wgrad and xq_t is not None
        dy2 = dy.reshape(-1, n)
        activation = module.activation
        bwd_dtype = recipe.backward_dtype
        if isinstance(recipe, DelayedScaling):
            scale_g, scale_inv_g, amax_g = plan.state.slot("backward", module.fp8_index)
            dbias_dtype = module.bias.dtype if ctx.has_bias else torch.float32
            if activation:
                dq, dq_t, dbias = dact_dbias_quantize(dy2, h, activation, scale=scale_g, fp8_dtype=bwd_dtype,
                                                      amax=amax_g, transpose=need_wgrad, dbias_dtype=dbias_dtype)
            else:
                dq, dq_t, dbias = dbias_quantize(dy2, scale=scale_g, fp8_dtype=bwd_dtype, amax=amax_g,
                                                 transpose=need_wgrad, dbias_dtype=dbias_dtype)
        else:
            dq, dq_t, dbias, amax_g, scale_g = dact_dbias_quantize_current_scaling(
                dy2, h, activation, fp8_dtype=bwd_dtype, transpose=need_wgrad, margin=recipe.margin,
                dbias_dtype=module.bias.dtype if ctx.has_bias else torch.float32)
            if plan.state is not None and not torch.compiler.is_compiling():
                plan.state.count_nonfinite(amax_g)
            scale_inv_g = scale_g.reciprocal()
        if dy.dtype == torch.float16:
            scale_inv_g = _poisoned_where_nonfinite(scale_inv_g, amax_g)
        dx = dweight = dbias_out = None
        if need_dgrad:
            dx = _scaled_mm(dq, w_kn.t(), scale_inv_g, scale_inv_w, plan.dtype)
        if need_wgrad:
            weight = module.weight
            if module.weight_is_in_out:  # (K, N) = x^T @ dy
                dweight = _scaled_mm(_pad_tokens(xq_t), _pad_tokens(dq_t).t(), scale_inv_x, scale_inv_g, weight.dtype)
            else:  # (N, K) = dy^T @ x
                dweight = _scaled_mm(_pad_tokens(dq_t), _pad_tokens(xq_t).t(), scale_inv_g, scale_inv_x, weight.dtype)
        if need_bgrad and ctx.has_bias:
            dbias_out = dbias.to(module.bias.dtype)
        return dx, dweight, dbias_out, None


def _poisoned_where_nonfinite(scale_inv: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``scale_inv``, or NaN where the gradient's ``amax`` is NaN or infinite (``scale_inv + 0 * amax``).

    The FP8 cast saturates, so an infinite gradient would leave the weight and input gradients finite,
    and a ``GradScaler`` (``16-mixed``) would take the step its overflow should have skipped: with this
    scale the two GEMMs return NaN instead. Applied to float16 gradients only, where a ``GradScaler``
    relies on the overflow reaching the gradients; two one-element ops, no host sync.
    """
    return scale_inv + amax.reshape(scale_inv.shape) * 0


def _no_double_backward() -> None:
    """The backward passes run kernels outside autograd: a graph of them (``create_graph=True``) would
    miss the activation's second derivative and give a wrong answer, so it is refused."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            "lightning_fuse's fused linear modules do not support double backward (backward with "
            "create_graph=True, as a gradient penalty needs): their backward runs Triton kernels that autograd "
            "cannot differentiate. Run that model unfused (unfuse_(model)), or leave the module out of fuse_ "
            "(FuseConfig.exclude)")


class _LinearActFunction(torch.autograd.Function):
    """High-precision ``act(x @ W^T + b)`` whose backward is the fused ``dact + dbias`` kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str,
                weight_is_in_out: bool, dtype: torch.dtype):
        w = weight.to(dtype)
        h = F.linear(x.to(dtype), w.t() if weight_is_in_out else w, bias.to(dtype) if bias is not None else None)
        ctx.activation = activation
        ctx.weight_is_in_out = weight_is_in_out
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        ctx.save_for_backward(x.to(dtype), w, h)
        return activation_forward(h, activation)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        _no_double_backward()
        x, w, h = ctx.saved_tensors
        n = h.shape[-1]
        dh, _, dbias = dact_dbias_quantize(dy, h, ctx.activation)
        dh2 = dh.reshape(-1, n)
        dx = dweight = None
        if ctx.needs_input_grad[0]:
            dx = (dh2 @ (w.t() if ctx.weight_is_in_out else w)).view(*dy.shape[:-1], x.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            dweight = (x2.t() @ dh2 if ctx.weight_is_in_out else dh2.t() @ x2).to(ctx.param_dtypes[0])
        dbias_out = dbias.to(ctx.param_dtypes[1]) if ctx.needs_input_grad[2] else None
        return dx, dweight, dbias_out, None, None, None


class FP8LinearBase(nn.Module):
    """What ``FusedLinearBiasActivation`` and ``FP8Linear`` share: parameters, paths, FP8 state."""

    activation: Optional[str] = None

    def __init__(self, linear: nn.Module, *, emulate: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.weight_is_in_out = linear_dims(linear)
        if self.weight_is_in_out:  # code that reads HF Conv1D's sizes keeps working
            self.nf, self.nx = self.out_features, self.in_features
        self.weight = linear.weight
        self.bias = linear.bias if isinstance(getattr(linear, "bias", None), nn.Parameter) else None
        # Kept for unfuse_ and never registered (its parameters are ours): a tuple hides it from nn.Module.
        self._original = (linear,)
        self.emulate = emulate
        self.fused = True  # False: run the original PyTorch computation (set when measured slower)
        self.fp8_reason = fp8_shape_reason(self.in_features, self.out_features)
        self.fp8_state: Optional[FP8ScalingState] = None
        self.fp8_index = -1
        self._weight_cache: Optional[tuple] = None
        # What a checkpointed recomputation of the last forward runs: (recipe, its forward scales under delayed
        # scaling). Written to __dict__ on every forward (skipping nn.Module.__setattr__'s bookkeeping).
        self._recompute: tuple = (None, None)
        self._consumer: tuple = ()  # (FP8Linear,) when fuse_ linked the linear this chain feeds

    def __getstate__(self) -> dict:
        # The FP8 weight copies are a cache (float8 storages do not unpickle in torch 2.13): drop them.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "_weight_cache": None, "_fp8_input": None, "_recompute": (None, None)}

    def link_consumer(self, consumer: "FP8Linear") -> None:
        """Lets this chain write ``consumer``'s FP8 input in its activation pass (delayed scaling).

        ``fuse_`` links a chain to the linear that alone consumes its activation's output. The
        consumer uses the hand-off only when it receives that very tensor, unmodified; otherwise it
        quantizes its input itself, so a link never changes results, only saves a pass and a launch.
        """
        if not isinstance(consumer, FP8Linear) or consumer.in_features != self.out_features:
            raise ValueError(f"a chain with out_features={self.out_features} can only hand its output to an FP8Linear "
                             f"with in_features={self.out_features}; got {consumer!r}")
        self._consumer = (consumer,)  # a tuple hides it from nn.Module registration (it is registered elsewhere)

    def _consumer_for(self, plan: _FP8Plan) -> Optional["FP8Linear"]:
        """The linked consumer when this call can write its FP8 input, else ``None``."""
        consumer = self._consumer[0] if self._consumer else None
        # (not in a checkpointed recomputation: its consumer may be outside the region and never take it)
        if (consumer is None or not self.activation or not isinstance(plan.recipe, DelayedScaling)
                or plan.replay is not None
                or torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or not use_triton(self.weight)):
            # (inference tensors have no version counter, so a change in place could not be seen)
            return None
        if not consumer.fused or consumer.fp8_reason or consumer.fp8_state is not plan.state:
            return None
        return consumer

    def bind_fp8_state(self, state: FP8ScalingState, name: str) -> None:
        """Registers this module's three FP8 tensors in the model's ``state`` under ``name``."""
        self.fp8_state = state
        self.fp8_index = state.register(name)

    def to_original(self) -> nn.Module:
        """The original linear module, holding this module's current parameters."""
        original = self._original[0]
        original.weight = self.weight
        if self.bias is not None:
            original.bias = self.bias
        return original

    def extra_repr(self) -> str:
        parts = [f"in_features={self.in_features}", f"out_features={self.out_features}",
                 f"bias={self.bias is not None}"]
        if self.activation:
            parts.append(f"activation={self.activation}")
        if self.weight_is_in_out:
            parts.append("weight_layout=(in, out)")
        if not self.fused:
            parts.append("fused=False")
        return ", ".join(parts)

    # -- forward ------------------------------------------------------------------------------

    def _plain_forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.t() if self.weight_is_in_out else self.weight
        h = F.linear(x, w, self.bias)
        return activation_forward(h, self.activation) if self.activation else h

    def _fp8_recipe(self, x: torch.Tensor) -> tuple[Optional[Recipe], Optional[tuple]]:
        """``(recipe, replay)``: the recipe when this call runs FP8, else ``None`` (warning once where FP8
        was asked for); in a checkpointed recomputation, the forward scales its forward used
        (``_FP8Plan.replay``), else ``None``."""
        ctx = active_context()
        compiling = torch.compiler.is_compiling()  # (the graph task id below is not traceable)
        if not compiling and torch._C._current_graph_task_id() != -1:
            # Activation checkpointing recomputes the forward during backward (outside the context, or in
            # it): it must take the path the original forward took, with the scales it took (an update
            # since, at the context's exit or at an optimizer step, made new scale tensors).
            return self._recompute
        recipe = self._fp8_recipe_in(ctx, x) if ctx is not None else None
        if not compiling:  # what a recomputation of this forward must do
            forward = self.fp8_state.groups.get("forward") if isinstance(recipe, DelayedScaling) else None
            self.__dict__["_recompute"] = (recipe, (forward.scale, forward.scale_inv) if forward is not None else None)
        return recipe, None

    def _fp8_recipe_in(self, ctx: FP8Context, x: torch.Tensor) -> Optional[Recipe]:
        if not ctx.enabled:
            return None
        if self.fp8_reason:
            name = self._fqn()
            # keyed by the model's scaling state too: another model's module of the same name warns for itself
            _warn_once(f"shape:{id(self.fp8_state)}:{name}", f"{name}: running in high precision: {self.fp8_reason}")
            return None
        why = fp8_device_problem(x.device, self.emulate)
        if why:
            _warn_once(f"device:{x.device.type}", f"lightning_fuse: running in high precision: {why}")
            return None
        if x.dtype not in _KERNEL_DTYPES:
            message = (f"lightning_fuse: running in high precision: input dtype {x.dtype} has no FP8 path "
                       "(float32, bfloat16 or float16 expected)")
            unfused = _compute_dtype(x) not in _KERNEL_DTYPES
            if unfused:  # one warning for both: the unfused fallback below would warn again
                _WARNED.add(f"kernel-dtype:{_compute_dtype(x)}")
                message += "; PyTorch's own linear and activation run instead"
            # one key for chains and plain FP8 linears alike: a fused MLP warns once
            _warn_once(f"dtype:{x.dtype}:{unfused}", message)
            return None
        if self.fp8_state is None:
            raise RuntimeError(f"{self._fqn()} has no FP8 state: create fused modules with fuse_(model), which registers "
                               "them, or call bind_fp8_state")
        ctx.states[id(self.fp8_state)] = self.fp8_state
        if isinstance(ctx.recipe, DelayedScaling):
            # Even for an empty batch: the scaling state must exist on every rank by the first update, whose
            # amax all-reduce every rank joins (a rank without it would skip the collective and the others wait).
            self.fp8_state.ensure(ctx.recipe.amax_history_len, x.device)
        if x.numel() == 0:
            return None
        return ctx.recipe

    def _fqn(self) -> str:
        state = self.fp8_state
        if state is not None and 0 <= self.fp8_index < len(state.names):
            return state.names[self.fp8_index]
        return type(self).__name__

    def _fp8_weight(self, plan: _FP8Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(W (out, in), W (in, out), scale_inv)`` in e4m3, cached until the weight or its scale changes."""
        weight = self.weight
        recipe = plan.recipe
        delayed = isinstance(recipe, DelayedScaling)
        compiling = torch.compiler.is_compiling()
        key = None
        # (a traced graph makes its copy each call: reading _version there breaks the trace; a checkpointed
        # recomputation makes it with its forward's scale, which may no longer be the cached copy's)
        if not compiling and plan.replay is None:
            # Copies made under inference mode are inference tensors, which training cannot save for backward.
            key = (weight._version, weight.data_ptr(), weight.dtype, type(recipe), recipe.margin, plan.state.steps,
                   plan.state.generation if delayed else None, torch.is_inference_mode_enabled())
            if self._weight_cache is not None and self._weight_cache[0] == key:
                return self._weight_cache[1]
        with torch.no_grad():
            if delayed:
                scale, scale_inv, amax = plan.forward_slot(2 * self.fp8_index + 1)
                q, q_t = quantize(weight, scale=scale, fp8_dtype=recipe.forward_dtype, amax=amax, transpose=True)
            else:
                q, q_t, _, scale = quantize_current_scaling(weight, fp8_dtype=recipe.forward_dtype, transpose=True,
                                                            margin=recipe.margin)
                scale_inv = scale.reciprocal()
        value = (q_t, q, scale_inv) if self.weight_is_in_out else (q, q_t, scale_inv)
        if key is not None:
            self.__dict__["_weight_cache"] = (key, value)  # a cache: skip nn.Module.__setattr__'s bookkeeping
        return value

    def forward(self, input: Optional[torch.Tensor] = None, *, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        # Named as the originals name it: nn.Linear.forward(input), HF Conv1D.forward(x), so keyword calls still work.
        if (input is None) == (x is None):
            raise TypeError(f"{type(self).__name__}.forward() takes one input tensor, as `input` (nn.Linear's name) or "
                            f"`x` (Conv1D's); got {'both' if input is not None else 'neither'}")
        x = input if x is None else x
        if not parent_running():
            return self._forward(x)
        with suspended():
            out = self._forward(x)
        note_output(self, out)  # the parent forward running now may skip its call of this chain's activation
        return out

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0:
            raise RuntimeError("both arguments to linear need to be at least 1D, but they are 0D and 2D")
        if x.shape[-1] != self.in_features:
            rows = math.prod(x.shape[:-1])
            raise RuntimeError(
                f"mat1 and mat2 shapes cannot be multiplied ({rows}x{x.shape[-1]} and "
                f"{self.in_features}x{self.out_features}): {type(self).__name__} expects inputs [*, {self.in_features}]"
            )
        # An input's FP8 copies handed over by the chain before (link_consumer): used once, or dropped.
        handed = None if torch.compiler.is_compiling() else self.__dict__.pop("_fp8_input", None)
        if not self.fused:
            return self._plain_forward(x)
        fp8, replay = self._fp8_recipe(x)
        if fp8 is not None:
            grad_enabled = torch.is_grad_enabled()
            need_wgrad = self.weight.requires_grad and grad_enabled
            # Only for that very tensor, unchanged since, with the transposed copy when wgrad needs it.
            usable = (handed is not None and handed[0] is x and handed[1] == x._version
                      and (handed[3] is not None or not need_wgrad) and isinstance(fp8, DelayedScaling))
            plan = _FP8Plan(self, fp8, self.fp8_state, _compute_dtype(x), need_wgrad,
                            handed[2:] if usable else None, grad_enabled, replay=replay)
            y = _FP8LinearFunction.apply(x.reshape(-1, self.in_features), self.weight, self.bias, plan)
            out = y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
            if plan.handoff is not None:
                consumer, yq, yq_t, scale_inv, amax_y = plan.handoff
                plan.handoff = None  # the plan lives on in the backward's context: it must not keep these alive
                consumer.__dict__["_fp8_input"] = (out, out._version, yq, yq_t, scale_inv, amax_y)
            return out
        if self.activation is None:
            return self._plain_forward(x)
        if _compute_dtype(x) not in _KERNEL_DTYPES:  # float64, say: PyTorch's own ops, as nn.Linear and act
            _warn_once(f"kernel-dtype:{_compute_dtype(x)}",
                       f"lightning_fuse: {_compute_dtype(x)} runs PyTorch's unfused linear and activation: the fused "
                       "backward kernel takes float32, bfloat16 or float16")
            return self._plain_forward(x)
        return _LinearActFunction.apply(x, self.weight, self.bias, self.activation, self.weight_is_in_out,
                                        _compute_dtype(x))


class FusedLinearBiasActivation(FP8LinearBase):
    """``act(x @ W^T + b)`` as one module: FP8 GEMMs under a recipe, one fused kernel in backward.

    Args:
        linear: the ``nn.Linear`` or HF ``Conv1D`` of the chain; its parameters are taken as they are.
        activation: ``gelu``, ``gelu_tanh``, ``relu``, ``silu``, ``quick_gelu`` or ``squared_relu``.
        emulate: run the FP8 path on CPU too (tests the FP8 logic; not fast).

    Raises:
        TypeError: ``linear`` is not linear-like.
        ValueError: an unknown activation.
    """

    def __init__(self, linear: nn.Module, activation: str, *, emulate: bool = False) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"`activation` must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
        super().__init__(linear, emulate=emulate)
        self.activation = activation


class FP8Linear(FP8LinearBase):
    """A linear layer (no activation) with FP8 GEMMs; its backward fuses the bias gradient with the
    FP8 quantization of the incoming gradient (row-wise and transposed).

    Args:
        linear: an ``nn.Linear`` or HF ``Conv1D``; its parameters are taken as they are.
        emulate: run the FP8 path on CPU too (tests the FP8 logic; not fast).
    """
