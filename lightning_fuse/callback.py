"""``FusedBackwardCallback``: swap chains at setup, measure them on the real shapes, keep what is
faster, run FP8 during training and log its health."""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from dataclasses import asdict, replace
from typing import Any, Callable, Literal, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from .autocast import fp8_autocast
from .collective_buffers import CollectiveBuffers
from .config import FuseConfig, make_fuse_config, resolve_module_filter
from .fuse import FuseReport, fp8_state_of, fuse_
from .modules import FP8LinearBase, fp8_device_problem
from .recipe import DelayedScaling, Recipe, make_recipe
from .scaling import FP8ScalingState
from .speed import measure, shape_key

__all__ = ["FusedBackwardCallback"]

_BENCHMARK_MODES = ("off", "log", "auto")
_DEFAULT_TOKENS = 4096


def _log_step(trainer: Trainer) -> int:
    """The step Lightning logs the current training batch's own metrics at (and its LearningRateMonitor and
    DeviceStatsMonitor theirs): batches that stepped the optimizers before this one. ``trainer.global_step``
    is one more after the batch's optimizer step, and counts each optimizer of a manual step once."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


class FusedBackwardCallback(Callback):
    r"""Swaps ``Linear -> bias -> activation`` chains for FP8 modules with a one-kernel fused backward.

    - ``setup``: finds and swaps chains before the strategy wraps the model and builds optimizers,
      after the LightningModule's own ``setup`` and ``configure_model`` (either may build layers),
      and prints a table. Handed another model later, it starts again for that one.
    - First training batch (or ``on_fit_start`` when ``benchmark_tokens`` is given): each distinct
      swapped shape is timed, original vs fused, forward + backward, on the real device and dtypes
      with the batch's token count; ``fuse/speedup/<name>``, ``fuse/speedup_mean`` and
      ``fuse/chains_fused`` go to the Trainer's loggers. With ``benchmark="auto"``, modules that
      measured slower go back to the original computation, so the callback never makes a model
      slower. Rank 0 measures and decides; the decision is broadcast.
    - Training: the recipe is active for each training step's forward and backward (and for
      validation, test and predict with ``fp8_eval``); delayed scales update once per optimizer step,
      after gradient accumulation (in ``validate``/``test``/``predict`` runs, where no optimizer
      steps, the forward scales update after each batch from the rank's own amaxes); every
      ``log_every_n_steps`` optimizer steps ``fuse/nonfinite_amax``, ``fuse/scale_min`` and
      ``fuse/scale_max`` (where delayed scaling keeps scales: not under current scaling, nor where
      FP8 never ran) and ``fuse/step_time_ms`` (wall time per optimizer step, validation and
      the checkpoints saved after it left out, and the first step, whose compile and measurement
      are not a step's time) are logged.
    - Logged metrics go to the Trainer's loggers at the step Lightning logs the same batch's own
      metrics at (as its ``LearningRateMonitor`` does), and steps are counted as Lightning counts
      them for its ``log_every_n_steps``: a batch that steps several optimizers (manual
      optimization) is one step.
    - ``state_dict``: the FP8 state (amax histories, scales, counters) and the benchmark decisions,
      so a resumed run continues with the same scales; the model's own ``state_dict`` stays the plain
      model's.

    Args:
        recipe: ``"delayed"`` (default), ``"current"``, a ``DelayedScaling``/``CurrentScaling``, a
            mapping of a recipe's fields, or ``None`` (no FP8: fused high-precision backward only).
        benchmark: ``"auto"`` (measure, log, revert what is slower), ``"log"`` (measure and log only)
            or ``"off"``.
        log_every_n_steps: optimizer steps between FP8 health logs (batches that stepped, as Lightning counts
            them).
        benchmark_tokens: tokens to time each shape with, measured at ``on_fit_start``; ``None``
            takes the real count from the first training batch (4096 for a module it did not run).
        fp8_eval: run validation, test and predict under the recipe too.
        module_filter_fn: ``(module, fqn) -> bool``; a linear is swapped only where it returns ``True``. From
            a config file: the function's import path (``mypkg.filters.keep``), or a Hydra node
            ``{_target_: mypkg.filters.keep_except, _partial_: true, names: [lm_head]}``.
        **fuse_config: ``FuseConfig`` fields (``convert``, ``activations``, ``exclude``, ``emulate``).

    Raises:
        ValueError: an unknown argument (the message lists the valid ones) or a bad value.
        TypeError: an argument of the wrong type.

    Example::

        trainer = Trainer(precision="bf16-mixed",
                          callbacks=[FusedBackwardCallback(recipe="delayed", convert="mlp")])
        trainer.fit(model)
    """

    def __init__(
        self,
        *,
        recipe: Any = "delayed",
        benchmark: Literal["off", "log", "auto"] = "auto",
        log_every_n_steps: int = 50,
        benchmark_tokens: Optional[int] = None,
        fp8_eval: bool = True,
        module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
        **fuse_config: Any,
    ) -> None:
        own = ("recipe", "benchmark", "log_every_n_steps", "benchmark_tokens", "fp8_eval", "module_filter_fn")
        try:
            self.fuse_config: FuseConfig = make_fuse_config(fuse_config)
        except ValueError as err:
            if "unknown FuseConfig key" not in str(err):
                raise
            unknown = sorted(fuse_config.keys() - FuseConfig.__dataclass_fields__.keys())
            valid = sorted(own + tuple(FuseConfig.__dataclass_fields__))
            raise ValueError(f"FusedBackwardCallback got unknown argument(s) {unknown}; valid arguments: "
                             f"{', '.join(valid)}") from err
        if benchmark not in _BENCHMARK_MODES:
            raise ValueError(f"`benchmark` must be one of {', '.join(_BENCHMARK_MODES)}; got {benchmark!r}")
        if not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 1:
            raise ValueError(f"`log_every_n_steps` must be a positive int; got {log_every_n_steps!r}")
        if not isinstance(fp8_eval, bool):
            raise TypeError(f"`fp8_eval` must be a bool; got {fp8_eval!r} ({type(fp8_eval).__name__})")
        if benchmark_tokens is not None and (not isinstance(benchmark_tokens, int) or isinstance(benchmark_tokens, bool)
                                             or benchmark_tokens < 1):
            raise ValueError(f"`benchmark_tokens` must be a positive int or None; got {benchmark_tokens!r}")
        module_filter_fn = resolve_module_filter(module_filter_fn)  # a config file gives an import path or a node
        self.recipe: Optional[Recipe] = make_recipe(recipe) if recipe is not None else None
        self.benchmark = benchmark
        self.log_every_n_steps = log_every_n_steps
        self.benchmark_tokens = benchmark_tokens
        self.fp8_eval = bool(fp8_eval)
        self.module_filter_fn = module_filter_fn

        self.report: Optional[FuseReport] = None
        self.state: Optional[FP8ScalingState] = None
        self.speedups: dict[str, float] = {}  # module fqn -> original time / fused time
        self.decisions: dict[str, bool] = {}  # module fqn -> kept fused
        self._modules: dict[str, FP8LinearBase] = {}
        self._loaded: Optional[dict[str, Any]] = None
        self._context: Optional[contextlib.ExitStack] = None
        self._capture: dict[str, tuple[int, torch.dtype, bool, bool]] = {}  # tokens, dtype, input grad, grad mode
        self._capture_handles: list = []
        self._last_update_step = -1
        self._measured = False  # measured (or restored) once: never again, even when nothing was measurable
        self._fused_for: Optional[weakref.ref] = None
        self._device_reason = ""  # why the training device runs the swapped modules in high precision, if it does
        self._stepped = False  # an optimizer step happened since the last on_train_batch_end
        self._steps_since_log = 0
        self._log_clock = time.perf_counter()
        self._paused_at: Optional[float] = None  # when validation inside fit began (its time is not a step's)
        # Non-finite current-scaling amaxes counted before the checkpoint this run resumed from (delayed
        # scaling's counters are part of the FP8 state; current scaling's count lives outside it, per rank),
        # and (all ranks' count, this rank's count) since then, as of the last health log.
        self._nonfinite_before = 0.0
        self._nonfinite_synced = (0.0, 0.0)
        self._collective = CollectiveBuffers()  # the tensor the ranks' counts are summed in

    def __getstate__(self) -> dict[str, Any]:
        # ddp_spawn and process-pool sweeps pickle the Trainer's callbacks, this one maybe after a first run:
        # the weak reference to that run's model, an open FP8 context and hook handles do not pickle, and a
        # copy in another process is handed another model anyway (setup starts again for it).
        return {**self.__dict__, "_fused_for": None, "_context": None, "_capture_handles": []}

    # -- setup: swap ------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # a new run: nothing of a previous fit's step bookkeeping carries over
            self._last_update_step, self._paused_at, self._stepped = -1, None, False
        wrapper = pl_module.__dict__.get("configure_model")
        owner = getattr(wrapper, "_lightning_fuse", None)
        if owner is not None and owner is not self:  # left behind by another callback's run that failed
            del pl_module.configure_model
        if self.report is not None and self._fused_for is not None and self._fused_for() is pl_module:
            return
        if self.report is not None:  # the same callback handed a new model: start again for it
            self.report, self.state, self._modules = None, None, {}
            self.speedups, self.decisions, self._measured, self._capture = {}, {}, False, {}
            self._nonfinite_before, self._nonfinite_synced = 0.0, (0.0, 0.0)
        self._fused_for = weakref.ref(pl_module)
        problem = fp8_device_problem(trainer.strategy.root_device, self.fuse_config.emulate)
        self._device_reason = f"high precision: {problem}" if problem else ""
        # Callbacks' setup runs before the LightningModule's own setup and configure_model, either of
        # which may build the layers: swap in the configure_model slot, which Lightning calls after both
        # (an instance attribute counts as overridden), still before the strategy wraps the model.
        if owner is self:
            return  # setup again before Lightning called the hook: the wrapper is in place already
        build = pl_module.configure_model

        def configure_model_then_fuse() -> None:
            build()
            del pl_module.configure_model
            self._fuse(pl_module)

        configure_model_then_fuse._lightning_fuse = self  # whose wrapper it is
        pl_module.configure_model = configure_model_then_fuse

    def _remove_wrapper(self, pl_module: LightningModule) -> None:
        """Takes this callback's ``configure_model`` wrapper off a model whose run ended before Lightning
        called it (an exception in the module's own setup, say): the model is left as it was given."""
        if getattr(pl_module.__dict__.get("configure_model"), "_lightning_fuse", None) is self:
            del pl_module.configure_model

    def _fuse(self, pl_module: LightningModule) -> None:
        with warnings.catch_warnings():  # an unchanged model: the callback's own warning below says so, once
            warnings.filterwarnings("ignore", message=r"lightning_fuse: no fusable .*the model is unchanged")
            self.report = fuse_(pl_module, self.fuse_config, module_filter_fn=self.module_filter_fn)
        self.state = fp8_state_of(pl_module)
        self._modules = {name: m for name, m in pl_module.named_modules() if isinstance(m, FP8LinearBase)}
        if self._loaded is not None:
            self._apply_loaded(self._loaded)
            self._loaded = None
        self._print_table()

    # -- measuring --------------------------------------------------------------------------------

    def _should_measure(self) -> bool:
        return self.benchmark != "off" and bool(self._modules) and not self._measured

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._should_measure() and self.benchmark_tokens is not None:
            self._measure(trainer, {})

    def _start_capture(self) -> None:
        def hook(name: str):
            def record(module: nn.Module, args: tuple) -> None:
                if args and isinstance(args[0], torch.Tensor) and name not in self._capture:
                    x = args[0]
                    self._capture[name] = (x.numel() // max(1, x.shape[-1]), x.dtype, x.requires_grad,
                                           torch.is_grad_enabled())
            return record
        self._capture_handles = [m.register_forward_pre_hook(hook(name)) for name, m in self._modules.items()]

    def _stop_capture(self) -> None:
        for handle in self._capture_handles:
            handle.remove()
        self._capture_handles = []

    def _measure(self, trainer: Trainer, captured: dict[str, tuple[int, torch.dtype, bool, bool]]) -> None:
        decisions: Optional[dict[str, Any]] = None
        if trainer.is_global_zero:
            device = trainer.strategy.root_device
            # The measurement draws random weights and inputs: it must not move the training's RNG.
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                decisions = self._measure_here(trainer, captured)
        decisions = trainer.strategy.broadcast(decisions, src=0)
        self._measured = True
        self.speedups = dict(decisions["speedups"])
        self.decisions = dict(decisions["fused"])
        self._apply_decisions()
        metrics = {f"fuse/speedup/{name}": value for name, value in self.speedups.items()}
        if self.speedups:
            metrics["fuse/speedup_mean"] = sum(self.speedups.values()) / len(self.speedups)
        metrics["fuse/chains_fused"] = float(sum(
            1 for name, m in self._modules.items() if m.activation and self.decisions.get(name, True)))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=_log_step(trainer))
        self._print_table()
        # The step it follows ran the first, compiling forward and backward: neither it nor the
        # measurement is a training step's time. The window starts again after both.
        self._reset_clock()

    def _measure_here(self, trainer: Trainer, captured: dict[str, tuple[int, torch.dtype, bool, bool]]
                      ) -> dict[str, Any]:
        device = trainer.strategy.root_device
        by_shape: dict = {}
        for name, module in self._modules.items():
            if module.activation is None and (self.recipe is None or module.fp8_reason or self._device_reason):
                continue  # an FP8Linear that cannot run FP8 computes exactly what nn.Linear does
            tokens, dtype, input_grad, grad_enabled = captured.get(
                name, (self.benchmark_tokens or _DEFAULT_TOKENS, module.weight.dtype, True, True))
            key = shape_key(module, max(1, tokens), dtype, input_requires_grad=input_grad, grad_enabled=grad_enabled)
            by_shape.setdefault(key, []).append(name)
        speedups: dict[str, float] = {}
        for key, names in by_shape.items():
            try:
                original_ms, fused_ms = measure(key, device, self.recipe, emulate=self.fuse_config.emulate,
                                                precision_context=trainer.precision_plugin.forward_context)
            except Exception as err:  # noqa: BLE001 - measuring is optional: a failure must not end the run
                # (nor leave the other ranks waiting for the broadcast of a decision that never comes)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # what the failed attempt allocated
                rank_zero_warn(f"FusedBackwardCallback: could not measure {key.label()}: {type(err).__name__}: "
                               f"{str(err).splitlines()[0] if str(err) else ''}; {', '.join(names)} kept as swapped "
                               "(no fuse/speedup logged for them)")
                continue
            for name in names:
                speedups[name] = original_ms / fused_ms
        keep = {name: (self.benchmark != "auto" or speedups[name] >= 1.0) for name in speedups}
        return {"speedups": speedups, "fused": keep}

    def _apply_decisions(self) -> None:
        for name, module in self._modules.items():
            module.fused = self.decisions.get(name, True)

    # -- training ---------------------------------------------------------------------------------

    def _enter(self) -> None:
        self._exit()
        if self.state is None:
            return
        self._context = contextlib.ExitStack()
        self._context.enter_context(fp8_autocast(self.recipe, enabled=self.recipe is not None, update_scales=False))

    def _exit(self) -> None:
        if self._context is not None:
            self._context.close()
            self._context = None

    def _reset_clock(self) -> None:
        self._log_clock, self._steps_since_log = time.perf_counter(), 0

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset_clock()

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            # The queued training work finishes first, so it is counted as training, not validation.
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._paused_at = time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._paused_at is not None:  # validation and the checkpoint saved after it: not step time
            self._log_clock += time.perf_counter() - self._paused_at
            self._paused_at = None
        if self._should_measure() and not self._capture_handles:
            self._start_capture()
        self._enter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._exit()
        measured = False
        if self._capture_handles:
            self._stop_capture()
            self._measure(trainer, self._capture)
            measured = True
        if not self._stepped:
            return  # gradient accumulation: no optimizer step yet
        self._stepped = False
        self._steps_since_log += 0 if measured else 1
        # Counted as Lightning counts steps for its own log_every_n_steps: batches that stepped (this one too).
        if (_log_step(trainer) + 1) % self.log_every_n_steps == 0:
            self._log_health(trainer)

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # Once per optimizer step, after every accumulated micro-batch's backward.
        if self._last_update_step == trainer.global_step:
            return
        self._last_update_step = trainer.global_step
        self._stepped = True
        if self.state is not None:
            # The step changes the weights, maybe without their version counter: their FP8 copies are made again.
            if isinstance(self.recipe, DelayedScaling) and self.state.groups:
                self.state.update(self.recipe)  # (counts the step too)
            else:
                self.state.steps += 1

    def _log_health(self, trainer: Trainer) -> None:
        now = time.perf_counter()
        # No step timed since the window began (the step before was the measured one): no step time.
        metrics = ({"fuse/step_time_ms": (now - self._log_clock) * 1e3 / self._steps_since_log}
                   if self._steps_since_log else {})
        self._log_clock, self._steps_since_log = now, 0
        if self.state is not None:
            stats = self.state.stats()
            if not self.state.groups:
                # No delayed-scaling state, so no scales. Current scaling counts a non-finite gradient on the
                # rank whose backward saw it (delayed scaling all-reduces its amaxes first): summed over the
                # ranks, each of which logs here (in a kept tensor: collective_buffers.py says why).
                local = self._local_nonfinite()
                count = self._collective.get("nonfinite", 1, torch.float64, trainer.strategy.root_device)
                total = trainer.strategy.reduce(count.fill_(local), reduce_op="sum")
                self._nonfinite_synced = (float(total), local)
                stats["nonfinite_amax"] = self._nonfinite_before + self._nonfinite_synced[0]
            metrics.update({f"fuse/{key}": value for key, value in stats.items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=_log_step(trainer))

    def _eval_start(self, *args: Any) -> None:
        if self.fp8_eval:
            self._enter()

    def _eval_end(self, trainer: Trainer, *args: Any) -> None:
        self._exit()
        # Outside fit no optimizer step ever updates the scales: update the forward ones after each batch,
        # from this rank's amaxes alone (ranks may run different numbers of batches in validate, test and
        # predict, so a collective here could wait forever).
        if (self.fp8_eval and trainer.state.fn != "fit" and isinstance(self.recipe, DelayedScaling)
                and self.state is not None and self.state.groups):
            self.state.update(replace(self.recipe, reduce_amax=False), groups=("forward",))

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._exit()  # on_train_batch_start returning -1 ends the epoch without on_train_batch_end

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._exit()
        self._remove_wrapper(pl_module)
        # A run that ended before its first training batch did (every batch start returned -1, say): no hook
        # of this callback stays on the model (it would make the model unpicklable); the next fit measures.
        self._stop_capture()

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _eval_start
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _eval_end

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._exit()
        self._remove_wrapper(pl_module)
        self._stop_capture()

    # -- checkpointing ----------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "fp8_state": self.state.state_dict() if self.state is not None else None,
            "speedups": dict(self.speedups),
            "decisions": dict(self.decisions),
            "recipe": asdict(self.recipe) if self.recipe is not None else None,
            "current_nonfinite": self._current_nonfinite(),
        }

    def _local_nonfinite(self) -> float:
        count = self.state.current_nonfinite if self.state is not None else None
        return float(count.item()) if count is not None else 0.0

    def _current_nonfinite(self) -> float:
        """Non-finite current-scaling amaxes so far, those before a resume included: all ranks' as of the
        last health log, and this rank's since (a checkpoint is no place for a collective)."""
        synced_total, synced_local = self._nonfinite_synced
        return self._nonfinite_before + synced_total + self._local_nonfinite() - synced_local

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.report is None:
            self._loaded = dict(state_dict)
        else:
            self._apply_loaded(state_dict)
            if self._modules:  # (without any, the swap's warning said all there is: it is not given twice)
                self._print_table()  # the one printed at the swap showed the decisions before the checkpoint's

    def _apply_loaded(self, state_dict: dict[str, Any]) -> None:
        if self.state is not None and state_dict.get("fp8_state") is not None:
            self.state.load_state_dict(state_dict["fp8_state"])
        if self.state is not None:
            self.state.current_nonfinite = None  # the checkpoint's count replaces this run's, as every counter does
        self._nonfinite_before = float(state_dict.get("current_nonfinite", 0.0))
        self._nonfinite_synced = (0.0, 0.0)
        self.speedups = dict(state_dict.get("speedups", {}))
        self.decisions = dict(state_dict.get("decisions", {}))
        self._measured = self._measured or bool(self.speedups)
        self._apply_decisions()

    # -- the table --------------------------------------------------------------------------------

    def _print_table(self) -> None:
        if self.report is None:
            return
        if not self._modules:
            if not self.report.chains and not self.report.linears:
                rank_zero_warn("FusedBackwardCallback: no Linear -> activation chain found; training runs unchanged")
                return
            rank_zero_warn("FusedBackwardCallback: no chain could be swapped (the table says why); training runs "
                           "unchanged")
        rank_zero_info(self.table())

    def table(self) -> str:
        """Name, shape, activation, FP8 or fallback, reason, and the measured speedup per module."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title="lightning-fuse", title_justify="left")
        for column in ("name", "shape", "activation", "path", "speedup", "reason"):
            table.add_column(column)
        entries = [(c.name, c.in_features, c.out_features, c.activation, c.fused, c.fp8, c.reason or c.fp8_reason)
                   for c in self.report.chains]
        entries += [(lin.name, lin.in_features, lin.out_features, "-", lin.fused, lin.fp8,
                     lin.reason or lin.fp8_reason) for lin in self.report.linears]
        for name, fan_in, fan_out, activation, swapped, fp8, reason in entries:
            if not swapped:
                path = "unchanged"
            elif not self.decisions.get(name, True):
                path = "reverted (slower)"
            else:
                path = ("FP8" if fp8 and self.recipe is not None and not self._device_reason
                        else "fused, high precision" if activation != "-" else "high precision")
                if self.recipe is not None and fp8 and not reason:
                    reason = self._device_reason
            speedup = f"{self.speedups[name]:.2f}x" if name in self.speedups else "-"
            table.add_row(name, f"{fan_in} -> {fan_out}", activation, path, speedup, reason)
        console = Console(width=160)
        with console.capture() as capture:
            console.print(table)
        return capture.get()
