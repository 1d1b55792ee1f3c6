"""``FusedBackwardCallback`` in a real ``Trainer`` on CPU, in the style of Lightning's own callback tests:
tiny boring models, a few steps in ``tmp_path``, exact logged metrics through a mocked logger.

The FP8 path runs with ``emulate=True`` (FP8 GEMMs on CPU, Triton kernels in the interpreter).
On CPU a fused module is always slower than PyTorch's own ops, which makes ``benchmark="auto"``'s
decision deterministic here: every swapped module goes back to the original computation.
"""

from __future__ import annotations

import math
import pickle
import time
import warnings
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn

import lightning_fuse.modules
from lightning_fuse import (CurrentScaling, DelayedScaling, FP8Linear, FP8ScalingState, FusedBackwardCallback,
                            FusedLinearBiasActivation)
from lightning_fuse.kernels import quantize, quantize_current_scaling

from boring_models import (BoringMLPModel, ConfigureModelMLP, NanoGPTMLPModel, NoChainModel, TinyGPT2Model,
                           regression_data)

HEALTH_METRICS = {"fuse/nonfinite_amax", "fuse/scale_min", "fuse/scale_max", "fuse/step_time_ms"}
MLP_SPEEDUPS = {"fuse/speedup/mlp.0", "fuse/speedup/mlp.2", "fuse/speedup_mean", "fuse/chains_fused"}


def make_trainer(tmp_path: Path, callbacks: list[Callback], **kwargs: Any) -> Trainer:
    """A CPU Trainer for a few steps, without anything the test does not ask for."""
    defaults = dict(accelerator="cpu", devices=1, default_root_dir=tmp_path, max_steps=3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0, num_sanity_val_steps=0)
    defaults.update(kwargs)
    return Trainer(callbacks=callbacks, **defaults)


def mock_logger(tmp_path: Path) -> mock.MagicMock:
    """A logger whose ``log_metrics`` calls are recorded (as Lightning's throughput monitor tests do)."""
    logger = mock.MagicMock(spec=Logger)
    logger.save_dir = str(tmp_path)
    logger.log_dir = str(tmp_path)
    logger.name, logger.version = "mock", 0
    return logger


def logged(logger: mock.MagicMock, prefix: str = "fuse/") -> list[tuple[int, dict[str, float]]]:
    """``(step, {name: value})`` of every ``log_metrics`` call with a metric under ``prefix``, in call order."""
    calls = []
    for call in logger.log_metrics.call_args_list:
        metrics = call.kwargs.get("metrics", call.args[0] if call.args else None)
        step = call.kwargs.get("step", call.args[1] if len(call.args) > 1 else None)
        ours = {name: value for name, value in metrics.items() if name.startswith(prefix)}
        if ours:
            calls.append((step, ours))
    return calls


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _chain_faster_linear_slower(key: Any, *args: Any, **kwargs: Any) -> tuple[float, float]:
    """A stand-in for ``measure``: ``(original_ms, fused_ms)``, the chain 2x faster, the other linear 2x slower."""
    return (2.0, 1.0) if key.activation else (1.0, 2.0)


def assert_mlp_swapped(mlp: nn.Sequential) -> None:
    # mlp.0 -> mlp.1 (GELU) is the chain; mlp.2 alone consumes the activation (convert="mlp").
    assert type(mlp[0]) is FusedLinearBiasActivation and mlp[0].activation == "gelu"
    assert type(mlp[1]) is nn.Identity
    assert type(mlp[2]) is FP8Linear


# -- swapping and training --------------------------------------------------------------------------


@pytest.mark.parametrize("model_class, recipe, precision", [
    (BoringMLPModel, "delayed", "32-true"),
    (BoringMLPModel, "current", "32-true"),
    (NanoGPTMLPModel, "delayed", "bf16-mixed"),
    (BoringMLPModel, "delayed", "bf16-true"),
])
def test_swaps_and_trains_in_fp8(tmp_path, model_class, recipe, precision):
    torch.manual_seed(0)
    model = model_class()
    initial = params_of(model)
    callback = FusedBackwardCallback(recipe=recipe, emulate=True, benchmark="off")
    trainer = make_trainer(tmp_path, [callback], max_steps=2, precision=precision)
    # The FP8 path quantizes through these kernels; the high-precision path never calls them.
    kernel = "quantize" if recipe == "delayed" else "quantize_current_scaling"
    original = quantize if recipe == "delayed" else quantize_current_scaling
    with mock.patch.object(lightning_fuse.modules, kernel, wraps=original) as spy:
        trainer.fit(model)

    if model_class is BoringMLPModel:
        assert_mlp_swapped(model.mlp)
    else:
        assert type(model.c_fc) is FusedLinearBiasActivation and type(model.gelu) is nn.Identity
        assert type(model.c_proj) is FP8Linear
    assert all(module.fused for module in callback._modules.values())
    assert spy.call_count > 0
    assert math.isfinite(trainer.callback_metrics["train_loss"].item())
    assert trainer.global_step == 2
    trained = params_of(model)
    assert trained.keys() == initial.keys()  # the checkpoint format does not change
    assert all(not torch.equal(trained[name], initial[name]) for name in initial)
    if recipe == "delayed":
        assert isinstance(callback.recipe, DelayedScaling)
        assert callback.state.generation == 2  # one scale update per optimizer step
        assert callback.state.stats()["scale_min"] != 1.0  # scales moved from their initial value
    else:
        assert isinstance(callback.recipe, CurrentScaling)
        assert not callback.state.groups  # current scaling keeps no history


def test_hf_gpt2_swaps_and_trains_in_fp8(tmp_path):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = TinyGPT2Model()
    callback = FusedBackwardCallback(recipe={"amax_history_len": 16}, emulate=True, benchmark="off")
    trainer = make_trainer(tmp_path, [callback], max_steps=2)
    trainer.fit(model)

    block = model.lm.transformer.h[0]
    # HF Conv1D c_fc -> NewGELUActivation is the chain; c_proj alone consumes it; attention is left alone.
    assert type(block.mlp.c_fc) is FusedLinearBiasActivation and block.mlp.c_fc.activation == "gelu_tanh"
    assert type(block.mlp.act) is nn.Identity
    assert type(block.mlp.c_proj) is FP8Linear
    assert type(block.attn.c_attn).__name__ == "Conv1D"
    assert callback.state.names == ["lm.transformer.h.0.mlp.c_fc", "lm.transformer.h.0.mlp.c_proj"]
    assert callback.recipe == DelayedScaling(amax_history_len=16)
    assert callback.state.generation == 2 and callback.state.history_len == 16
    assert math.isfinite(trainer.callback_metrics["train_loss"].item())


def test_configure_model_layers_are_swapped_and_trained(tmp_path):
    torch.manual_seed(0)
    model = ConfigureModelMLP()
    assert model.mlp is None
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    trainer = make_trainer(tmp_path, [callback], max_steps=2)
    trainer.fit(model)

    assert_mlp_swapped(model.mlp)
    assert "configure_model" not in model.__dict__  # the callback's wrapper is gone again
    # The optimizer was built after the swap, on the very Parameters the swapped modules hold.
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    assert callback.state.generation == 2
    assert math.isfinite(trainer.callback_metrics["train_loss"].item())


def test_model_without_chains_warns_and_trains_unchanged(tmp_path):
    torch.manual_seed(0)
    reference = NoChainModel()
    torch.manual_seed(0)
    model = NoChainModel()
    make_trainer(tmp_path, [], max_steps=2).fit(reference)

    callback = FusedBackwardCallback(emulate=True)
    with pytest.warns(UserWarning, match="no Linear -> activation chain found; training runs unchanged"):
        make_trainer(tmp_path, [callback], max_steps=2).fit(model)

    assert [type(m) for m in model.mlp] == [nn.Linear, nn.LayerNorm, nn.Linear]
    assert callback.state is None and callback.speedups == {} and callback.decisions == {}
    for name, value in params_of(reference).items():
        assert torch.equal(model.state_dict()[name], value), name


# -- checkpoints ------------------------------------------------------------------------------------


class _RecordFP8State(Callback):
    """Records the fuse callback's FP8 state right after a resume restored it, and before the first
    resumed scale update (it runs before the fuse callback: it is first in the Trainer's list)."""

    def __init__(self, fuse: FusedBackwardCallback) -> None:
        self.fuse = fuse
        self.at_train_start: Optional[dict[str, Any]] = None
        self.before_first_update: Optional[dict[str, torch.Tensor]] = None
        self.decisions_at_train_start: Optional[dict[str, bool]] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.at_train_start = self.fuse.state.state_dict()
        self.decisions_at_train_start = {name: m.fused for name, m in self.fuse._modules.items()}

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.before_first_update is None:
            self.before_first_update = {f"{g}.{key}": value.clone() for g, group in self.fuse.state.groups.items()
                                        for key, value in group.tensors().items()}


def _checkpointed_run(tmp_path: Path, max_epochs: int, ckpt_path: Optional[Path] = None, record: bool = False
                      ) -> tuple[BoringMLPModel, FusedBackwardCallback, Trainer, Optional[_RecordFP8State], int]:
    """``(model, callback, trainer, recorder, measure calls)`` of a delayed-scaling run with ``benchmark="auto"``."""
    torch.manual_seed(0)
    # 6 samples in batches of 2: an epoch is 3 optimizer steps, so a checkpoint at an epoch's end
    # resumes exactly where the uninterrupted run continues.
    model = BoringMLPModel()
    model.train_dataloader = lambda: torch.utils.data.DataLoader(regression_data(num_samples=6), batch_size=2)
    callback = FusedBackwardCallback(recipe=DelayedScaling(amax_history_len=4), emulate=True, benchmark="auto")
    recorder = _RecordFP8State(callback) if record else None
    trainer = make_trainer(tmp_path, [recorder, callback] if recorder else [callback], max_steps=-1,
                           max_epochs=max_epochs)
    with mock.patch("lightning_fuse.callback.measure", side_effect=_chain_faster_linear_slower) as measure:
        trainer.fit(model, ckpt_path=ckpt_path)
    return model, callback, trainer, recorder, measure.call_count


def test_checkpoint_loads_into_plain_model_and_resume_restores_fp8_state(tmp_path):
    model, _, trainer, _, measured = _checkpointed_run(tmp_path / "first", max_epochs=1)
    assert measured == 2 and [model.mlp[0].fused, model.mlp[2].fused] == [True, False]
    path = tmp_path / "fused.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # plain tensors and containers only
    saved = checkpoint["callbacks"]["FusedBackwardCallback"]
    assert saved["fp8_state"]["names"] == ["mlp.0", "mlp.2"]
    assert saved["fp8_state"]["generation"] == 3
    assert saved["decisions"] == {"mlp.0": True, "mlp.2": False}
    assert saved["speedups"] == {"mlp.0": 2.0, "mlp.2": 0.5}
    assert saved["recipe"]["amax_history_len"] == 4

    # The model's state_dict is the plain model's: it loads strictly into a never-fused model.
    plain = BoringMLPModel()
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    assert [type(m) for m in plain.mlp] == [nn.Linear, nn.GELU, nn.Linear]
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(plain(x), model(x), rtol=1e-5, atol=1e-6)  # outside fp8_autocast: high precision

    # Resume with a new callback: the FP8 state is the saved one, before and after it is allocated.
    resumed, resumed_callback, _, recorder, measured = _checkpointed_run(tmp_path / "resumed", max_epochs=2,
                                                                         ckpt_path=path, record=True)
    at_start = recorder.at_train_start
    assert at_start.keys() == saved["fp8_state"].keys()
    for key, value in saved["fp8_state"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(at_start[key], value), key
        else:
            assert at_start[key] == value, key
    before = recorder.before_first_update
    for key in ("forward.scale", "forward.scale_inv", "forward.nonfinite",
                "backward.scale", "backward.scale_inv", "backward.nonfinite"):
        assert torch.equal(before[key], saved["fp8_state"][key]), key
    for key in ("forward.history", "backward.history"):  # row 0 is this step's amaxes; older rows are restored
        assert torch.equal(before[key][1:], saved["fp8_state"][key][1:]), key
    # The decisions are restored too, not measured again.
    assert measured == 0
    assert recorder.decisions_at_train_start == {"mlp.0": True, "mlp.2": False}
    assert resumed_callback.speedups == saved["speedups"]

    # ... and the resumed run ends exactly where an uninterrupted one does.
    uninterrupted, _, _, _, _ = _checkpointed_run(tmp_path / "uninterrupted", max_epochs=2)
    for name, value in params_of(uninterrupted).items():
        assert torch.equal(resumed.state_dict()[name], value), name


def test_model_checkpoint_callback_saves_fp8_state(tmp_path):
    torch.manual_seed(0)
    model = BoringMLPModel()
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    checkpointing = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)
    make_trainer(tmp_path, [callback, checkpointing], max_steps=2, enable_checkpointing=True).fit(model)

    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    saved = checkpoint["callbacks"]["FusedBackwardCallback"]["fp8_state"]
    expected = callback.state.state_dict()
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(saved[key], value) if isinstance(value, torch.Tensor) else saved[key] == value, key
    BoringMLPModel().load_state_dict(checkpoint["state_dict"], strict=True)


# -- scale updates and gradient accumulation --------------------------------------------------------


def test_gradient_accumulation_updates_scales_once_per_optimizer_step(tmp_path):
    torch.manual_seed(0)
    model = BoringMLPModel(batch_size=2)
    callback = FusedBackwardCallback(recipe=DelayedScaling(amax_history_len=8), emulate=True, benchmark="off")
    trainer = make_trainer(tmp_path, [callback], max_steps=2, accumulate_grad_batches=3)
    with mock.patch.object(FP8ScalingState, "update", autospec=True, side_effect=FP8ScalingState.update) as update:
        trainer.fit(model)

    assert trainer.global_step == 2 and trainer.fit_loop.total_batch_idx == 5  # 6 micro-batches
    assert update.call_count == 2
    assert callback.state.generation == 2
    # The first update saw the input amax of all three micro-batches of step 1 (6 samples), not just the last.
    x = regression_data()[:12][0]
    assert x[:6].abs().max() > x[4:6].abs().max()  # the last micro-batch alone would give another amax
    history = callback.state.groups["forward"].history  # rows: newest first; row 0 restarts after each update
    assert history[2, 0].item() == x[:6].abs().max().item()
    assert history[1, 0].item() == x[6:12].abs().max().item()


def test_health_is_logged_once_per_optimizer_step_with_accumulation(tmp_path):
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(emulate=True, benchmark="off", log_every_n_steps=1)
    trainer = make_trainer(tmp_path, [callback], max_steps=2, accumulate_grad_batches=3, logger=logger)
    trainer.fit(BoringMLPModel())

    steps = [step for step, metrics in logged(logger) if "fuse/scale_min" in metrics]
    assert steps == [0, 1]  # Lightning's logging steps of the two optimizer steps' last micro-batches


class _InfiniteLossAtSecondStep(BoringMLPModel):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == 1 else loss


class _ZeroNonFiniteGradients(Callback):
    """Skips a poisoned step's update the way a GradScaler would (so SGD does not turn the weights to NaN)."""

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        for param in pl_module.parameters():
            param.grad.nan_to_num_(0.0, 0.0, 0.0)


class _RecordBackwardScales(Callback):
    def __init__(self, fuse: FusedBackwardCallback) -> None:
        self.fuse = fuse
        self.scales: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.scales.append(self.fuse.state.groups["backward"].scale.clone())


def test_nonfinite_gradient_is_counted_logged_and_training_continues(tmp_path):
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(emulate=True, benchmark="off", log_every_n_steps=1)
    recorder = _RecordBackwardScales(callback)
    model = _InfiniteLossAtSecondStep()
    trainer = make_trainer(tmp_path, [_ZeroNonFiniteGradients(), callback, recorder], max_steps=3, logger=logger)
    trainer.fit(model)

    # Step 2's output gradient (mlp.2's, backward slot 1) is infinite: counted once, never forgotten.
    # mlp.0 receives mlp.2's input gradient, computed from the saturated FP8 copy: finite.
    nonfinite = [metrics["fuse/nonfinite_amax"] for _, metrics in logged(logger)]
    assert nonfinite == [0.0, 1.0, 1.0]
    assert callback.state.groups["backward"].nonfinite.tolist() == [0, 1]
    # That tensor kept its scale through the poisoned update; the history holds no inf or NaN.
    assert recorder.scales[1][1] == recorder.scales[0][1]
    assert all(torch.isfinite(group.history).all() for group in callback.state.groups.values())
    # Training went on, in FP8, with finite numbers.
    assert trainer.global_step == 3 and all(module.fused for module in callback._modules.values())
    assert math.isfinite(trainer.callback_metrics["train_loss"].item())
    assert all(torch.isfinite(param).all() for param in model.parameters())


# -- logged metrics ----------------------------------------------------------------------------------


def test_logged_metric_names_and_values(tmp_path):
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(emulate=True, benchmark="log", log_every_n_steps=1)
    trainer = make_trainer(tmp_path, [callback], max_steps=3, logger=logger, log_every_n_steps=1)
    with mock.patch("lightning_fuse.callback.measure", side_effect=_chain_faster_linear_slower):
        trainer.fit(BoringMLPModel())

    calls = logged(logger)
    names = set().union(*(metrics.keys() for _, metrics in calls))
    assert names == MLP_SPEEDUPS | HEALTH_METRICS
    # Measured once, on the first batch, and logged at the step Lightning logs that batch's metrics at.
    assert [(step, metrics) for step, metrics in calls if "fuse/speedup_mean" in metrics] == [(0, {
        "fuse/speedup/mlp.0": 2.0,
        "fuse/speedup/mlp.2": 0.5,
        "fuse/speedup_mean": 1.25,
        "fuse/chains_fused": 1.0,  # benchmark="log" keeps the one chain, though mlp.2 measured slower
    })]

    health = [(step, metrics) for step, metrics in calls if "fuse/scale_min" in metrics]
    assert [step for step, _ in health] == [0, 1, 2]
    for step, metrics in health:
        # the first batch (step 0) ran the measurement (and the first compiles): it is no step's time
        assert metrics.keys() == HEALTH_METRICS - ({"fuse/step_time_ms"} if step == 0 else set())
        assert metrics["fuse/nonfinite_amax"] == 0.0
        assert 0 < metrics["fuse/scale_min"] <= metrics["fuse/scale_max"]
        assert step == 0 or metrics["fuse/step_time_ms"] > 0
    stats = callback.state.stats()
    assert health[-1][1]["fuse/scale_min"] == stats["scale_min"]
    assert health[-1][1]["fuse/scale_max"] == stats["scale_max"]


def test_health_every_n_steps(tmp_path):
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(emulate=True, benchmark="off", log_every_n_steps=2)
    make_trainer(tmp_path, [callback], max_steps=5, logger=logger).fit(BoringMLPModel())

    calls = logged(logger)
    assert [step for step, _ in calls] == [1, 3]  # after the 2nd and the 4th optimizer step, at Lightning's steps
    assert all(metrics.keys() == HEALTH_METRICS for _, metrics in calls)


class _TwoOptimizers(BoringMLPModel):
    """Manual optimization stepping two optimizers per batch (a GAN's generator and discriminator, say):
    ``trainer.global_step`` counts both steps, Lightning's logging step counts the batch once."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.head = self.build(self.d)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, target = batch
        for optimizer, net in zip(self.optimizers(), (self.mlp, self.head)):
            loss = F.mse_loss(net(x), target)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("train_loss", loss)

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.mlp.parameters(), lr=self.lr), torch.optim.SGD(self.head.parameters(), lr=self.lr)]


@pytest.mark.parametrize("model_class, max_steps", [(BoringMLPModel, 4), (_TwoOptimizers, 8)])
def test_fuse_metrics_are_logged_at_the_step_lightning_logs_the_same_batch_at(tmp_path, model_class, max_steps):
    # In a CSV or TensorBoard log, a batch's fuse/* metrics sit beside its train_loss, as Lightning's own
    # LearningRateMonitor and DeviceStatsMonitor put theirs; log_every_n_steps counts as Lightning's does.
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(emulate=True, benchmark="log", log_every_n_steps=2)
    with mock.patch("lightning_fuse.callback.measure", side_effect=_chain_faster_linear_slower):
        make_trainer(tmp_path, [callback], max_steps=max_steps, logger=logger, log_every_n_steps=2).fit(model_class())

    losses = [step for step, _ in logged(logger, prefix="train_loss")]
    health = [step for step, metrics in logged(logger) if "fuse/scale_min" in metrics]
    assert losses == [1, 3]  # 4 batches: Lightning logs the 2nd and the 4th
    assert health == losses
    ((speedup_step, _),) = [(step, m) for step, m in logged(logger) if "fuse/speedup_mean" in m]
    assert speedup_step == 0  # measured on the first batch, whose own metrics Lightning logs at step 0


@pytest.mark.parametrize("recipe, emulate", [("current", True), ("delayed", False), (None, True)],
                         ids=["current-scaling", "delayed-without-fp8-on-cpu", "no-recipe"])
def test_no_scale_is_logged_where_no_fp8_scale_exists(tmp_path, recipe, emulate):
    # Current scaling keeps no scales (each cast computes its own); without FP8 there are none at all: a
    # logged 1.0 would read as "amax history still warming up" (README), forever.
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(recipe=recipe, emulate=emulate, benchmark="off", log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the CPU fallback's own warning)
        make_trainer(tmp_path, [callback], max_steps=2, logger=logger).fit(BoringMLPModel())
    calls = logged(logger)
    assert len(calls) == 2
    assert all(metrics.keys() == {"fuse/nonfinite_amax", "fuse/step_time_ms"} for _, metrics in calls), calls


def test_first_step_time_excludes_time_before_fit(tmp_path):
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(recipe=None, benchmark="off", log_every_n_steps=1)
    time.sleep(0.5)  # e.g. Hydra builds the callback, then the model and the data
    start = time.perf_counter()
    make_trainer(tmp_path, [callback], max_steps=1, logger=logger).fit(BoringMLPModel())
    fit_ms = (time.perf_counter() - start) * 1e3

    ((_, metrics),) = logged(logger)
    assert metrics["fuse/step_time_ms"] < fit_ms


# -- benchmark modes ----------------------------------------------------------------------------------


def test_benchmark_auto_reverts_what_is_slower(tmp_path):
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    # convert="chains": one swapped module, so one shape to time for real (the interpreter is slow)
    callback = FusedBackwardCallback(emulate=True, benchmark="auto", convert="chains")
    model = BoringMLPModel()
    make_trainer(tmp_path, [callback], max_steps=2, logger=logger).fit(model)

    # Still the swapped type (state_dict and optimizer unchanged), running the original computation.
    assert [type(m) for m in model.mlp] == [FusedLinearBiasActivation, nn.Identity, nn.Linear]
    assert model.mlp[0].fused is False
    assert callback.decisions == {"mlp.0": False}
    assert callback.speedups.keys() == {"mlp.0"} and callback.speedups["mlp.0"] < 1.0
    ((_, speedup),) = [(step, m) for step, m in logged(logger) if "fuse/speedup_mean" in m]
    assert speedup == {"fuse/speedup/mlp.0": callback.speedups["mlp.0"],
                       "fuse/speedup_mean": callback.speedups["mlp.0"], "fuse/chains_fused": 0.0}
    assert "reverted (slower)" in callback.table()


def test_benchmark_auto_keeps_what_is_faster(tmp_path):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="auto")
    model = BoringMLPModel()
    with mock.patch("lightning_fuse.callback.measure", side_effect=_chain_faster_linear_slower):
        make_trainer(tmp_path, [callback], max_steps=2).fit(model)

    assert [model.mlp[0].fused, model.mlp[2].fused] == [True, False]
    assert callback.decisions == {"mlp.0": True, "mlp.2": False}
    assert callback.speedups == {"mlp.0": 2.0, "mlp.2": 0.5}


def test_benchmark_log_measures_and_keeps_everything(tmp_path):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="log")
    model = BoringMLPModel()
    with mock.patch("lightning_fuse.callback.measure", return_value=(1.0, 2.0)):  # everything 2x slower
        make_trainer(tmp_path, [callback], max_steps=2).fit(model)

    assert [model.mlp[0].fused, model.mlp[2].fused] == [True, True]
    assert callback.decisions == {"mlp.0": True, "mlp.2": True}
    assert callback.speedups == {"mlp.0": 0.5, "mlp.2": 0.5}


def test_benchmark_off_measures_nothing(tmp_path):
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(emulate=True, benchmark="off", log_every_n_steps=1)
    model = BoringMLPModel()
    with mock.patch("lightning_fuse.callback.measure") as measure:
        make_trainer(tmp_path, [callback], max_steps=2, logger=logger).fit(model)

    measure.assert_not_called()
    assert callback.speedups == {} and callback.decisions == {}
    assert [model.mlp[0].fused, model.mlp[2].fused] == [True, True]
    names = set().union(*(metrics.keys() for _, metrics in logged(logger)))
    assert names == HEALTH_METRICS  # no fuse/speedup*, no fuse/chains_fused


def test_benchmark_tokens_measures_at_fit_start_with_that_count(tmp_path):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="log", benchmark_tokens=32)
    with mock.patch("lightning_fuse.callback.measure", return_value=(1.0, 1.0)) as measure:
        make_trainer(tmp_path, [callback], max_steps=1).fit(BoringMLPModel())

    keys = [call.args[0] for call in measure.call_args_list]
    assert sorted((key.in_features, key.out_features, key.activation, key.tokens) for key in keys) == \
        [(32, 64, "gelu", 32), (64, 32, None, 32)]


def test_benchmark_measures_the_real_token_count(tmp_path):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="log")
    with mock.patch("lightning_fuse.callback.measure", return_value=(1.0, 1.0)) as measure:
        make_trainer(tmp_path, [callback], max_steps=1).fit(BoringMLPModel(batch_size=2))

    keys = [call.args[0] for call in measure.call_args_list]
    assert {key.tokens for key in keys} == {2 * 8}  # batch 2 x 8 tokens
    assert {key.input_dtype for key in keys} == {torch.float32}


class _FrozenWeights(BoringMLPModel):
    """LoRA-style fine-tuning: the MLP's weights are frozen, its biases train."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp[0].weight.requires_grad_(False)
        self.mlp[2].weight.requires_grad_(False)


def test_benchmark_times_the_gradients_training_computes(tmp_path):
    # A frozen weight has no weight-gradient GEMM in training (nor an input that wants no gradient a
    # dgrad GEMM): timing them anyway would compare other work than the run does.
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="log")
    with mock.patch("lightning_fuse.callback.measure", return_value=(1.0, 1.0)) as measure:
        make_trainer(tmp_path, [callback], max_steps=1).fit(_FrozenWeights())
    keys = {(key.in_features, key.weight_requires_grad, key.bias_requires_grad, key.input_requires_grad)
            for key in (call.args[0] for call in measure.call_args_list)}
    # mlp.0 reads the data (no gradient wanted); mlp.2 reads mlp.0's output, which mlp.0's bias needs a gradient of
    assert keys == {(32, False, True, False), (64, False, True, True)}


@pytest.mark.parametrize("weight, bias, inputs", [(False, True, True), (False, False, False)])
def test_measure_runs_only_the_backward_training_runs(weight, bias, inputs):
    from lightning_fuse import speed

    key = speed.ShapeKey(32, 64, "gelu", True, False, 16, torch.float32, torch.float32, weight_requires_grad=weight,
                         bias_requires_grad=bias, input_requires_grad=inputs)
    made = []

    def copy_of(*args: Any, **kwargs: Any) -> nn.Module:
        made.append(real_copy_of(*args, **kwargs))
        return made[-1]

    real_copy_of = speed._copy_of
    with mock.patch.object(speed, "_copy_of", side_effect=copy_of):
        original_ms, fused_ms = speed.measure(key, torch.device("cpu"), None, warmup=0, reps=2)
    (module,) = made
    assert original_ms > 0 and fused_ms > 0
    assert (module.weight.requires_grad, module.bias.requires_grad) == (weight, bias)
    assert module.weight.grad is None and (module.bias.grad is not None) is bias


def test_the_two_computations_are_timed_in_turn_so_a_slow_spell_slows_both_alike():
    # The `auto` decision compares two timings: measured one after the other, a spell of interference
    # (another process on the machine) during one of them alone would flip it. Timed in turn, the
    # spell slows both, and each one's fastest sample is one it spared.
    import time as _time

    from lightning_fuse import speed

    calls = []

    def make(ms: float) -> Any:
        def fn() -> None:
            calls.append(ms)
            slow = 2 <= len(calls) <= 13  # right after the warm-up: the first 6 samples of each
            _time.sleep((ms + (30.0 if slow else 0.0)) / 1e3)
        return fn

    slower, faster = speed._interleaved_ms(torch.device("cpu"), (make(4.0), make(2.0)), warmup=1, reps=10)
    assert calls[2:6] == [4.0, 2.0, 4.0, 2.0]  # in turn
    # (timed one after the other, 9 of the first one's 10 samples would fall in the spell: 34 ms against 2)
    assert 1.5 < slower / faster < 2.5
    assert slower < 10.0


def test_a_shape_that_fails_to_measure_is_kept_with_one_warning_and_training_goes_on(tmp_path):
    # The measurement allocates a module and its activations beside the training's own, right after the
    # first step: a GPU near its memory limit may refuse. Measuring is optional; the run is not.
    def measure(key: Any, *args: Any, **kwargs: Any) -> tuple[float, float]:
        if key.activation:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return 1.0, 2.0  # the other linear: slower

    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="auto")
    model = BoringMLPModel()
    trainer = make_trainer(tmp_path, [callback], max_steps=3)
    with mock.patch("lightning_fuse.callback.measure", side_effect=measure), \
            pytest.warns(UserWarning, match=r"could not measure 32x64 gelu \(16 tokens\): OutOfMemoryError: CUDA "
                                            r"out of memory.*mlp\.0.*kept as swapped") as caught:
        trainer.fit(model)
    assert len([w for w in caught if "could not measure" in str(w.message)]) == 1
    assert trainer.global_step == 3
    assert callback.speedups == {"mlp.2": 0.5}
    assert [model.mlp[0].fused, model.mlp[2].fused] == [True, False]  # unmeasured: left as it was


def test_benchmark_does_not_change_training(tmp_path):
    def train(benchmark: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = BoringMLPModel(dropout=0.5)
        make_trainer(tmp_path, [FusedBackwardCallback(recipe=None, benchmark=benchmark)], max_steps=3).fit(model)
        return params_of(model)

    measured, unmeasured = train("log"), train("off")
    for name, value in unmeasured.items():
        assert torch.equal(measured[name], value), name


@pytest.mark.parametrize("fp8_eval", [True, False])
def test_fp8_eval_runs_validation_under_the_recipe(tmp_path, fp8_eval):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="off", fp8_eval=fp8_eval)
    trainer = make_trainer(tmp_path, [callback], limit_val_batches=2)
    with mock.patch.object(lightning_fuse.modules, "quantize", wraps=quantize) as spy:
        (metrics,) = trainer.validate(BoringMLPModel(), verbose=False)
    assert spy.called is fp8_eval
    assert math.isfinite(metrics["val_loss"])


def test_model_pickles_after_fp8_training(tmp_path):
    torch.manual_seed(0)
    model = BoringMLPModel()
    make_trainer(tmp_path, [FusedBackwardCallback(emulate=True, benchmark="off")], max_steps=1).fit(model)
    copy = pickle.loads(pickle.dumps(model))  # what a plain-pickle launcher or a queue does with it
    assert_mlp_swapped(copy.mlp)
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(copy(x), model(x))


# -- bad arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"benchmarks": "log"}, ValueError, r"unknown argument\(s\) \['benchmarks'\]; valid arguments: .*benchmark, "
                                        r"benchmark_tokens, convert, emulate, exclude, fp8_eval, log_every_n_steps"),
    ({"emulte": True}, ValueError, r"unknown argument\(s\) \['emulte'\]; valid arguments: .*emulate"),
    ({"benchmark": "fast"}, ValueError, r"`benchmark` must be one of off, log, auto; got 'fast'"),
    ({"benchmark": True}, ValueError, r"`benchmark` must be one of off, log, auto; got True"),
    ({"log_every_n_steps": 0}, ValueError, r"`log_every_n_steps` must be a positive int; got 0"),
    ({"log_every_n_steps": 2.5}, ValueError, r"`log_every_n_steps` must be a positive int; got 2.5"),
    ({"log_every_n_steps": True}, ValueError, r"`log_every_n_steps` must be a positive int; got True"),
    ({"benchmark_tokens": 0}, ValueError, r"`benchmark_tokens` must be a positive int or None; got 0"),
    ({"benchmark_tokens": True}, ValueError, r"`benchmark_tokens` must be a positive int or None; got True"),
    ({"fp8_eval": "no"}, TypeError, r"`fp8_eval` must be a bool; got 'no' \(str\)"),
    ({"recipe": {"reduce_amax": "no"}}, TypeError, r"`reduce_amax` must be a bool; got 'no' \(str\)"),
    ({"recipe": {"name": "curent"}}, ValueError, r"must name DelayedScaling or CurrentScaling \('delayed', "
                                                  r"'current'\); got 'curent'"),
    ({"recipe": {"_target_": "lightning_fuse.MXFP8Scaling"}}, ValueError, r"got 'lightning_fuse.MXFP8Scaling'"),
    ({"recipe": "fp8"}, ValueError, r"`recipe` must be one of delayed, current or a recipe object; got 'fp8'"),
    ({"recipe": {"amax_history": 16}}, ValueError, r"unknown DelayedScaling field\(s\) \['amax_history'\]"),
    ({"recipe": 8}, TypeError, r"`recipe` must be a DelayedScaling, CurrentScaling"),
    ({"convert": "everything"}, ValueError, r"`convert` must be one of chains, mlp, all; got 'everything'"),
    ({"activations": ["gleu"]}, ValueError, r"`activations` holds an unknown activation 'gleu'"),
    ({"module_filter_fn": "lm_head"}, ValueError, r"`module_filter_fn` must be an import path with a module and a "
                                                   r"name, such as 'mypkg.filters.keep'; got 'lm_head'"),
    ({"module_filter_fn": "boring_models.keep_all"}, ValueError, r"'boring_models' has no attribute 'keep_all'"),
    ({"module_filter_fn": "no_such_package.keep"}, ValueError, r"no module named 'no_such_package'"),
    ({"module_filter_fn": ".keep"}, ValueError, r"must be an import path with a module and a name"),
    ({"module_filter_fn": "boring_models.D_MODEL"}, TypeError, r"gives \d+, which is not callable"),
    ({"module_filter_fn": {"names": ["mlp.2"]}}, ValueError, r"must have a `_target_` naming a function"),
    ({"module_filter_fn": {"_target_": "boring_models.keep_except", "_partial_": True, "_convert_": "all"}},
     ValueError, r"takes only `_target_` and `_partial_` of Hydra's special keys; got \['_convert_'\]"),
    ({"module_filter_fn": 3}, TypeError, r"`module_filter_fn` must be a callable \(module, fqn\) -> bool, the import "
                                         r"path of one .*; got 3 \(int\)"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        FusedBackwardCallback(**kwargs)


@pytest.mark.parametrize("module_filter_fn", [
    lambda module, fqn: fqn != "mlp.2",
    "boring_models.keep_except",  # as a config file names it
    "boring_models:keep_except",
    "boring_models.Filters.keep_except",  # an attribute of an attribute, as Hydra's _target_ resolves it
    {"_target_": "boring_models.keep_except", "_partial_": True, "names": ["mlp.2"]},
], ids=["callable", "path", "colon-path", "class-attribute-path", "partial-node"])
def test_module_filter_fn_is_applied(tmp_path, module_filter_fn):
    torch.manual_seed(0)
    model = BoringMLPModel()
    callback = FusedBackwardCallback(emulate=True, benchmark="off", module_filter_fn=module_filter_fn)
    make_trainer(tmp_path, [callback], max_steps=1).fit(model)
    # mlp.2 is rejected by the filter; the chain mlp.0 -> GELU is still fused
    assert [type(m) for m in model.mlp] == [FusedLinearBiasActivation, nn.Identity, nn.Linear]
