"""``FusedBackwardCallback`` across a run's edges: measuring once even when nothing could be measured,
the FP8 context closed however the loop ends, layers built in the LightningModule's ``setup``, the
callback handed a second model, ``predict`` on its own, one warning per cause, and non-finite
gradients counted under current scaling."""

from __future__ import annotations

import time
import types
import warnings
from unittest import mock

import pytest
import torch
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_fuse.callback
import lightning_fuse.modules
from lightning_fuse import FuseConfig, FusedBackwardCallback, FusedLinearBiasActivation, fp8_autocast, fuse_
from lightning_fuse.autocast import _STACK, active_context

from boring_models import BoringMLPModel, NoChainModel, regression_data
from fp8_checks import sqnr_db
from test_callback import _InfiniteLossAtSecondStep, _ZeroNonFiniteGradients, logged, make_trainer, mock_logger


class _NoChain(BoringMLPModel):
    """``Linear -> LayerNorm -> Linear``: converted to FP8Linears with ``convert="all"``; on a CPU
    without emulation they compute what the linears do, so there is nothing to time."""

    @staticmethod
    def build(d: int, dropout: float = 0.0) -> nn.Module:
        return nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d))


def test_measures_once_even_when_nothing_could_be_measured(tmp_path):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(convert="all", benchmark="auto")
    with mock.patch.object(FusedBackwardCallback, "_measure", autospec=True,
                           side_effect=FusedBackwardCallback._measure) as measure:
        make_trainer(tmp_path, [callback], max_steps=4).fit(_NoChain())
    assert len(callback._modules) == 2 and callback.speedups == {}
    assert measure.call_count == 1


class _SkipRestOfEpoch(BoringMLPModel):
    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == 2 else None  # Lightning ends the epoch here, without on_train_batch_end


def test_fp8_context_is_closed_however_the_epoch_ends(tmp_path):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    make_trainer(tmp_path, [callback], max_epochs=1, max_steps=-1).fit(_SkipRestOfEpoch())
    left_open = active_context()
    _STACK.clear()  # so a failure here does not leak FP8 into the tests after it
    assert left_open is None


class _BuildsInSetup(BoringMLPModel):
    """Builds its layers in ``LightningModule.setup``, which Lightning runs after the callbacks' ``setup``."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = None

    def setup(self, stage: str) -> None:
        if self.mlp is None:
            self.mlp = self.build(self.d)


def test_layers_built_in_the_modules_setup_are_swapped(tmp_path):
    torch.manual_seed(0)
    model = _BuildsInSetup()
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    trainer = make_trainer(tmp_path, [callback], max_steps=2)
    trainer.fit(model)
    assert type(model.mlp[0]) is FusedLinearBiasActivation and "configure_model" not in model.__dict__
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    assert callback.state.generation == 2


def test_a_callback_handed_a_second_model_fuses_and_tracks_that_one(tmp_path):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    first, second = BoringMLPModel(), BoringMLPModel()
    make_trainer(tmp_path, [callback], max_steps=2).fit(first)
    first_state = callback.state
    make_trainer(tmp_path, [callback], max_steps=3).fit(second)  # a sweep or k-fold loop reusing its callbacks
    assert type(first.mlp[0]) is FusedLinearBiasActivation and type(second.mlp[0]) is FusedLinearBiasActivation
    assert callback.state is not first_state and callback.state.generation == 3
    assert set(callback._modules) == {"mlp.0", "mlp.2"}
    assert all(m is second.get_submodule(name) for name, m in callback._modules.items())


class _Predict(BoringMLPModel):
    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def predict_dataloader(self):
        x, _ = regression_data(num_samples=16, seed=1).tensors
        return DataLoader(TensorDataset(x * 1000.0), batch_size=2)  # far above e4m3's 448 at scale 1


def test_predict_on_its_own_calibrates_the_forward_scales(tmp_path):
    torch.manual_seed(0)
    plain = _Predict()
    fused = _Predict()
    fused.load_state_dict(plain.state_dict())
    reference = torch.cat(make_trainer(tmp_path, []).predict(plain)[1:])
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    out = torch.cat(make_trainer(tmp_path, [callback]).predict(fused)[1:])  # every batch after the first
    assert callback.state.generation == 8  # one forward update per batch
    # what an fp8_autocast loop over the same batches gives, not the 3 dB of scales left at 1
    assert sqnr_db(out, reference) >= 15


def test_a_model_without_chains_gets_one_warning(tmp_path):
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [FusedBackwardCallback(emulate=True)], max_steps=2).fit(NoChainModel())
    ours = [str(w.message) for w in caught if "chain" in str(w.message)]
    assert ours == ["FusedBackwardCallback: no Linear -> activation chain found; training runs unchanged"]


class _OddChain(BoringMLPModel):
    @staticmethod
    def build(d: int, dropout: float = 0.0) -> nn.Module:
        return nn.Sequential(nn.Linear(d, 40), nn.GELU(), nn.Linear(40, d))


def test_an_ineligible_shape_warns_once_per_module_not_again_for_the_benchmark(tmp_path):
    torch.manual_seed(0)
    lightning_fuse.modules._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [FusedBackwardCallback(emulate=True, benchmark="log")], max_steps=2).fit(_OddChain())
    fallbacks = [str(w.message) for w in caught if "running in high precision" in str(w.message)]
    # mlp.2, a plain linear of that width, is not converted at all (nothing to fall back from)
    assert len(fallbacks) == 1 and fallbacks[0].startswith("mlp.0: "), fallbacks


def test_current_scaling_counts_nonfinite_gradients(tmp_path):
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(recipe="current", emulate=True, benchmark="off", log_every_n_steps=1)
    make_trainer(tmp_path, [_ZeroNonFiniteGradients(), callback], max_steps=3, logger=logger).fit(
        _InfiniteLossAtSecondStep())
    counts = [metrics["fuse/nonfinite_amax"] for _, metrics in logged(logger) if "fuse/nonfinite_amax" in metrics]
    assert counts[0] == 0 and counts[-1] >= 1  # step 1 clean, step 2's infinite loss counted


def test_fp8_autocast_reference_for_the_predict_test_is_what_the_threshold_says(tmp_path):
    # The 15 dB above is what delayed scaling reaches on these batches when its scales are updated:
    # the same loop by hand, fp8_autocast updating the scales on exit of each batch.
    torch.manual_seed(0)
    plain = _Predict()
    fused = _Predict()
    fused.load_state_dict(plain.state_dict())
    fuse_(fused, FuseConfig(emulate=True))
    batches = [b[0] for b in fused.predict_dataloader()]
    outs = []
    with torch.no_grad():
        for x in batches:
            with fp8_autocast():
                outs.append(fused(x))
        reference = torch.cat([plain(x) for x in batches[1:]])
    assert sqnr_db(torch.cat(outs[1:]), reference) >= 15


def test_setup_twice_before_the_layers_exist_swaps_once(tmp_path):
    torch.manual_seed(0)
    model = _BuildsInSetup()
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    trainer = make_trainer(tmp_path, [callback], max_steps=1)
    callback.setup(trainer, model, "fit")  # e.g. a second entry point calling the hooks again
    trainer.fit(model)
    assert type(model.mlp[0]) is FusedLinearBiasActivation and "configure_model" not in model.__dict__


def test_the_table_says_a_cpu_run_is_high_precision_and_why(tmp_path):
    torch.manual_seed(0)
    on_cpu = FusedBackwardCallback(benchmark="off")
    make_trainer(tmp_path, [on_cpu], max_steps=1).fit(BoringMLPModel())
    table = on_cpu.table()
    assert "fused, high precision" in table and "FP8 GEMMs need a CUDA GPU" in table and "│ FP8 " not in table
    # the plain linear after the chain (an FP8Linear) fuses nothing: "high precision" alone
    row = next(line for line in table.splitlines() if "mlp.2" in line)
    assert "│ high precision" in row and "fused" not in row
    emulated = FusedBackwardCallback(benchmark="off", emulate=True)  # FP8 runs on CPU: the table says FP8
    make_trainer(tmp_path, [emulated], max_steps=1).fit(BoringMLPModel())
    assert "│ FP8 " in emulated.table() and "need a CUDA GPU" not in emulated.table()


def test_the_table_is_printed_again_once_a_checkpoint_changes_the_decisions(tmp_path):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    make_trainer(tmp_path, [callback], max_steps=1).fit(BoringMLPModel())
    with mock.patch("lightning_fuse.callback.rank_zero_info") as info:
        callback.load_state_dict({**callback.state_dict(), "decisions": {"mlp.0": False, "mlp.2": True}})
    (printed,), _ = info.call_args
    assert "reverted (slower)" in printed and not callback._modules["mlp.0"].fused


class _SlowValidation(BoringMLPModel):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.25)
        return super().validation_step(batch, batch_idx)


def test_step_time_leaves_out_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' torch references: steps of a few ms on CPU
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(recipe=None, benchmark="off", log_every_n_steps=4)
    # a validation of two 0.25 s batches after step 2, inside the 4 logged steps: 125 ms more a step if it counted
    make_trainer(tmp_path, [callback], max_steps=4, logger=logger, val_check_interval=2, limit_val_batches=2,
                 check_val_every_n_epoch=None).fit(_SlowValidation())
    ((step, metrics),) = [(s, m) for s, m in logged(logger) if "fuse/step_time_ms" in m]
    assert step == 3 and metrics["fuse/step_time_ms"] < 60, metrics  # the 4th step, at Lightning's logging step


@pytest.mark.parametrize("recipe,order", [("delayed", "validate,fit"), ("current", "validate,fit"),
                                          ("delayed", "fit,validate,fit")])
def test_validate_before_or_between_fits_leaves_a_state_training_can_use(tmp_path, recipe, order):
    # Lightning's validate runs under torch.inference_mode: the FP8 state and the FP8 weight copies made
    # there must not be inference tensors, which the next training step would have to save for backward.
    torch.manual_seed(0)
    model = BoringMLPModel()
    callback = FusedBackwardCallback(emulate=True, benchmark="off", recipe=recipe)
    for i, what in enumerate(order.split(",")):
        trainer = make_trainer(tmp_path, [callback], max_steps=2 * (i + 1), limit_val_batches=2)
        if what == "validate":
            trainer.validate(model, dataloaders=model.val_dataloader(), verbose=False)
        else:
            trainer.fit(model)
    assert trainer.global_step == 2 * len(order.split(","))
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _FailsSetupOnce(BoringMLPModel):
    failed = False

    def setup(self, stage):
        if not self.failed:
            self.failed = True
            raise RuntimeError("data not ready")


def test_a_failed_fit_leaves_no_wrapper_and_a_retry_is_fused_by_its_own_callback(tmp_path):
    torch.manual_seed(0)
    model = _FailsSetupOnce()
    first = FusedBackwardCallback(benchmark="off", convert="chains")
    with pytest.raises(RuntimeError, match="data not ready"):
        make_trainer(tmp_path, [first], max_steps=1).fit(model)
    assert "configure_model" not in model.__dict__  # the model is as it was given, and picklable
    second = FusedBackwardCallback(benchmark="off", emulate=True)
    make_trainer(tmp_path, [second], max_steps=2).fit(model)
    assert first.report is None
    assert second.report is not None and second.state.generation == 2
    assert second.fuse_config.emulate and "mlp.2" in second._modules  # its own config (convert="mlp")


def test_a_callback_reused_for_another_fit_updates_the_scales_at_every_step(tmp_path):
    torch.manual_seed(0)
    model = BoringMLPModel()
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    make_trainer(tmp_path, [callback], fast_dev_run=True).fit(model)  # one step, global_step 0
    smoke = callback.state.generation
    make_trainer(tmp_path, [callback], max_steps=3).fit(model)  # a new Trainer: global_step 0 again
    assert callback.state.generation == smoke + 3


class _SleepyTraining(BoringMLPModel):
    def training_step(self, batch, batch_idx):
        time.sleep(0.1)
        return super().training_step(batch, batch_idx)


def test_step_time_of_a_second_fit_does_not_count_the_gap_after_the_first_ones_last_validation(tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    callback = FusedBackwardCallback(recipe=None, benchmark="off", log_every_n_steps=1)
    model = _SleepyTraining()
    make_trainer(tmp_path, [callback], max_steps=2, limit_val_batches=1, val_check_interval=2,
                 check_val_every_n_epoch=None).fit(model)  # ends with a validation
    time.sleep(0.5)
    logger = mock_logger(tmp_path)
    make_trainer(tmp_path, [callback], max_steps=2, logger=logger).fit(model)
    times = [m["fuse/step_time_ms"] for _, m in logged(logger) if "fuse/step_time_ms" in m]
    assert len(times) == 2 and all(100 <= t < 400 for t in times), times


def test_the_measured_first_step_is_not_logged_as_a_step_time(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    logger = mock_logger(tmp_path)
    callback = FusedBackwardCallback(recipe=None, benchmark="log", log_every_n_steps=1)
    make_trainer(tmp_path, [callback], max_steps=3, logger=logger).fit(_SleepyTraining())
    logged_steps = {step: m["fuse/step_time_ms"] for step, m in logged(logger) if "fuse/step_time_ms" in m}
    # the first batch (logging step 0) ran the measurement; the next two each slept 100 ms
    assert sorted(logged_steps) == [1, 2] and all(100 <= t < 400 for t in logged_steps.values()), logged_steps


def test_a_second_model_is_measured_at_its_own_token_count(tmp_path):
    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="log")
    tokens = []
    real_measure = lightning_fuse.callback.measure

    def spy(key, *args, **kwargs):
        tokens.append(key.tokens)
        return real_measure(key, *args, **kwargs)

    with mock.patch.object(lightning_fuse.callback, "measure", spy):
        make_trainer(tmp_path, [callback], max_steps=1).fit(BoringMLPModel(batch_size=16))
        first = list(tokens)
        tokens.clear()
        make_trainer(tmp_path, [callback], max_steps=1).fit(BoringMLPModel(batch_size=64))
    assert len(set(first)) == 1 and set(tokens) == {4 * first[0]}, (first, tokens)


def test_fp8_linears_are_not_timed_where_the_device_runs_them_in_high_precision(tmp_path):
    # on CPU without emulate an FP8Linear computes what nn.Linear does: a ratio of the two is only noise
    torch.manual_seed(0)
    callback = FusedBackwardCallback(benchmark="log")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(tmp_path, [callback], max_steps=1).fit(BoringMLPModel())
    assert "mlp.2" in callback._modules and "mlp.2" not in callback.speedups and "mlp.0" in callback.speedups


class _FusedAdamW(BoringMLPModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, fused=True)  # leaves weight._version as it was


def test_fp8_weight_copies_are_made_again_after_each_optimizer_step_under_current_scaling(tmp_path):
    torch.manual_seed(0)
    model = _FusedAdamW()
    callback = FusedBackwardCallback(emulate=True, benchmark="off", recipe="current")
    make_trainer(tmp_path, [callback], max_steps=3, accumulate_grad_batches=2).fit(model)
    assert callback.state.steps == 3  # once per optimizer step, not per micro-batch
    fc = model.mlp[0]
    with fp8_autocast("current", update_scales=False):
        cached = fc._fp8_weight(types.SimpleNamespace(recipe=callback.recipe, state=callback.state, replay=None))
    fresh_q = lightning_fuse.modules.quantize_current_scaling(fc.weight.detach(), fp8_dtype=torch.float8_e4m3fn,
                                                              transpose=False, margin=0)[0]
    assert torch.equal(cached[0].view(torch.uint8), fresh_q.view(torch.uint8))


def test_a_callback_used_for_one_fit_pickles_for_the_next_as_ddp_spawn_does(tmp_path):
    # ddp_spawn (and any process-pool sweep) pickles the Trainer with its callbacks: a callback kept for a
    # second run must pickle after its first, and its copy must fuse the model it is handed there.
    import pickle

    torch.manual_seed(0)
    callback = FusedBackwardCallback(emulate=True, benchmark="off")
    make_trainer(tmp_path, [callback], max_steps=1).fit(BoringMLPModel())
    copy = pickle.loads(pickle.dumps(callback))
    model = BoringMLPModel()
    make_trainer(tmp_path, [copy], max_steps=2).fit(model)
    assert type(model.mlp[0]) is FusedLinearBiasActivation
    assert all(m is model.get_submodule(name) for name, m in copy._modules.items())
    assert copy.state.generation == 2


class _SkipsEveryBatch(BoringMLPModel):
    def on_train_batch_start(self, batch, batch_idx):
        return -1  # e.g. a module waiting for something: the epoch ends before any batch has run


def test_no_measuring_hook_is_left_on_the_model_when_no_batch_completed(tmp_path):
    import pickle

    torch.manual_seed(0)
    model = _SkipsEveryBatch()
    callback = FusedBackwardCallback(emulate=True, benchmark="log")
    make_trainer(tmp_path, [callback], max_epochs=1, max_steps=-1).fit(model)
    assert [name for name, m in model.named_modules() if m._forward_pre_hooks] == []
    pickle.dumps(model)  # a hook of the callback's would make the model unpicklable
    # the next fit still measures, on its own first batch
    with mock.patch.object(lightning_fuse.callback, "measure", return_value=(1.0, 1.0)) as measure:
        make_trainer(tmp_path, [callback], max_steps=1).fit(BoringMLPModel())
    assert measure.call_count == 2 and set(callback.speedups) == {"mlp.0", "mlp.2"}


def test_a_model_without_chains_warns_once_when_resumed(tmp_path):
    torch.manual_seed(0)
    trainer = make_trainer(tmp_path, [FusedBackwardCallback(emulate=True)], max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(NoChainModel())
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, [FusedBackwardCallback(emulate=True)], max_steps=2).fit(
            NoChainModel(), ckpt_path=tmp_path / "plain.ckpt")
    ours = [str(w.message) for w in caught if "chain" in str(w.message)]
    assert ours == ["FusedBackwardCallback: no Linear -> activation chain found; training runs unchanged"]


class _SkipNonFiniteSteps(Callback):
    """Skips the whole update of a step with any non-finite gradient, as a GradScaler does."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not all(torch.isfinite(p.grad).all() for p in pl_module.parameters()):
            for p in pl_module.parameters():
                p.grad.zero_()


def test_current_scaling_nonfinite_count_survives_a_resume(tmp_path):
    # fuse/nonfinite_amax is a count "so far": a resumed run goes on from the checkpoint's, as it does under
    # delayed scaling (whose counters are part of the FP8 state)
    torch.manual_seed(0)
    first = FusedBackwardCallback(recipe="current", emulate=True, benchmark="off")
    trainer = make_trainer(tmp_path, [_SkipNonFiniteSteps(), first], max_steps=3)
    trainer.fit(_InfiniteLossAtSecondStep())
    counted = first.state.stats()["nonfinite_amax"]
    assert counted >= 1
    trainer.save_checkpoint(tmp_path / "current.ckpt")

    logger = mock_logger(tmp_path)
    resumed = FusedBackwardCallback(recipe="current", emulate=True, benchmark="off", log_every_n_steps=1)
    make_trainer(tmp_path, [resumed], max_steps=5, logger=logger).fit(BoringMLPModel(),
                                                                      ckpt_path=tmp_path / "current.ckpt")
    counts = [metrics["fuse/nonfinite_amax"] for _, metrics in logged(logger)]
    assert counts == [counted, counted]  # two clean steps after the resume: nothing new, nothing forgotten
    # ... and a checkpoint of the resumed run carries it on again
    assert resumed.state_dict()["current_nonfinite"] == counted
