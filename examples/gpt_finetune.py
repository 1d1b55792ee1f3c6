"""Train or fine-tune a GPT with PyTorch Lightning, with lightning-fuse's FP8 fused backward on.

    python examples/gpt_finetune.py                              # tiny model on CPU, well under a minute
    python examples/gpt_finetune.py fuse=null                    # the same without the callback
    python examples/gpt_finetune.py experiment=gpt2_xl_fp8       # GPT-2 XL width on one H200
    python examples/gpt_finetune.py fuse.recipe.amax_history_len=16 fuse.convert=all
    python examples/gpt_finetune.py model.source=hf              # HF GPT2LMHeadModel instead
    python examples/gpt_finetune.py init_from=path/to/last.ckpt  # or a local HF model directory

Configuration lives in configs/ (train.yaml and its groups); outputs (checkpoints, CSV logs) go
to the Hydra run directory. The model is `gpt_model.GPT` (model.source=native) or Hugging
Face's GPT2LMHeadModel (model.source=hf); the data is `gpt_data.TextDataModule`.
"""

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Sequence

import hydra
import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from omegaconf import DictConfig, OmegaConf
from torch.nn import functional as F
from typing_extensions import override

from gpt_data import TextDataModule
from gpt_model import GPT, GPTConfig

log = logging.getLogger(__name__)

SOURCES = ("native", "hf")
INIT_FROM_EXPECTED = (
    "Expected 'scratch', a Lightning checkpoint file written by this example (*.ckpt), "
    "or a local Hugging Face GPT-2 model directory (with config.json, as written by `save_pretrained`). "
    "Nothing is downloaded."
)

# -----------------------------------------------------------------------------------------------
# the network: built from scratch, from a checkpoint of this example, or from a local HF directory


def resolve_init_from(init_from: str) -> tuple[str, Path | None]:
    """Which kind of start `init_from` asks for: ("scratch" | "checkpoint" | "hf", path).

    Raises:
        FileNotFoundError: if the path does not exist.
        ValueError: if it exists but is neither a `.ckpt` file nor a directory with config.json.
    """
    if init_from == "scratch":
        return "scratch", None
    path = Path(init_from).expanduser()
    if path.is_file() and path.suffix == ".ckpt":
        return "checkpoint", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf", path
    if not path.exists():
        raise FileNotFoundError(
            f"init_from={init_from!r} does not exist (resolved to {path.resolve()}). {INIT_FROM_EXPECTED}"
        )
    raise ValueError(
        f"init_from={init_from!r} is neither a .ckpt file nor a directory with config.json. {INIT_FROM_EXPECTED}"
    )


def new_network(architecture: dict[str, Any]) -> nn.Module:
    """A freshly initialized network: our GPT (source "native") or HF's GPT2LMHeadModel ("hf")."""
    if architecture["source"] == "native":
        return GPT(GPTConfig(**{key: value for key, value in architecture.items() if key != "source"}))
    # transformers is only needed for model.source=hf
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=architecture["vocab_size"],
        n_positions=architecture["block_size"],
        n_embd=architecture["n_embd"],
        n_layer=architecture["n_layer"],
        n_head=architecture["n_head"],
        resid_pdrop=architecture["dropout"],
        embd_pdrop=architecture["dropout"],
        attn_pdrop=architecture["dropout"],
        activation_function="gelu_new",  # the tanh GELU, as in our GPT's MLP
        bos_token_id=None,  # no special tokens: the data is one plain token stream
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


def build_network(model: DictConfig, init_from: str, vocab_size: int) -> tuple[nn.Module, dict[str, Any]]:
    """The network to train and its architecture (what a checkpoint of this example stores to rebuild it).

    From scratch the sizes come from `model`; from a checkpoint or an HF directory they come from
    there, and only `model.dropout` (and, for an HF directory, `model.source`) is taken from `model`.

    Args:
        model: the `model` config group.
        init_from: "scratch", a `.ckpt` path or a local HF model directory.
        vocab_size: the data's vocabulary size; the model's must be at least this.

    Raises:
        FileNotFoundError, ValueError: for a bad `init_from` or `model.source`, or a vocabulary too small.
    """
    if model.source not in SOURCES:
        raise ValueError(f"model.source={model.source!r}; expected one of {SOURCES}")
    kind, path = resolve_init_from(init_from)

    if kind == "scratch":
        architecture = dict(
            source=model.source,
            n_layer=model.n_layer,
            n_head=model.n_head,
            n_embd=model.n_embd,
            block_size=model.block_size,
            vocab_size=model.vocab_size or vocab_size,
            dropout=model.dropout,
        )
        network = new_network(architecture)

    elif kind == "checkpoint":
        # weights_only: a checkpoint is a pickle, and this refuses anything but tensors and plain containers
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        if "architecture" not in checkpoint.get("hyper_parameters", {}):
            raise ValueError(
                f"init_from={init_from!r} is a checkpoint without hyper_parameters['architecture']. "
                + INIT_FROM_EXPECTED
            )
        architecture = dict(checkpoint["hyper_parameters"]["architecture"], dropout=model.dropout)
        network = new_network(architecture)
        # the LightningModule keeps the network as `self.model`, so its keys start with "model."
        network.load_state_dict({key.removeprefix("model."): value for key, value in checkpoint["state_dict"].items()})
        rank_zero_info(f"init_from: loaded {path}; its architecture replaces model.*: {architecture}")

    else:
        from transformers import AutoConfig, GPT2LMHeadModel

        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        if hf_config.model_type != "gpt2":
            raise ValueError(
                f"init_from={init_from!r} holds a {hf_config.model_type!r} model. {INIT_FROM_EXPECTED}"
            )
        dropout = model.dropout
        # float32 master weights whatever the saved dtype: the Trainer's precision decides the compute dtype
        hf_model = GPT2LMHeadModel.from_pretrained(
            path, local_files_only=True, dtype=torch.float32,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        )
        # from_pretrained returns the model in eval mode, and Lightning keeps the modes it finds
        hf_model.train()
        architecture = dict(
            source=model.source,
            n_layer=hf_config.n_layer,
            n_head=hf_config.n_head,
            n_embd=hf_config.n_embd,
            block_size=hf_config.n_positions,
            vocab_size=hf_config.vocab_size,
            dropout=dropout,
        )
        network = GPT.from_hf_gpt2(hf_model, dropout) if model.source == "native" else hf_model
        rank_zero_info(f"init_from: loaded {path}; its architecture replaces model.*: {architecture}")

    if architecture["vocab_size"] < vocab_size:
        raise ValueError(
            f"the model's vocab_size is {architecture['vocab_size']}, but the data's tokens need {vocab_size}; "
            "use a tokenizer that matches the model (data.tokenizer) or a larger model.vocab_size"
        )
    return network, architecture


# -----------------------------------------------------------------------------------------------
# the LightningModule


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to `min_ratio` at `total_steps` (nanoGPT's get_lr)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step >= total_steps:
        return min_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)  # 0 -> 1
    return min_ratio + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - min_ratio)


class GPTFineTune(L.LightningModule):
    """Next-token prediction with cross-entropy; AdamW with warm-up and cosine decay.

    Args:
        model: the network, a `gpt_model.GPT` or a HF `GPT2LMHeadModel`.
        architecture: how to rebuild `model` (saved in checkpoints for `init_from`).
        optimizer: lr, min_lr, warmup_steps, weight_decay, betas.
    """

    def __init__(self, model: nn.Module, architecture: dict[str, Any], optimizer: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.save_hyperparameters(ignore=["model"])
        # (global step, validation loss: mean over every token of every rank) of every validation; the
        # sanity check counts as the one at init
        self.val_history: list[tuple[int, float]] = []
        # the last few training losses, kept on the device so recording them costs no sync
        self.recent_train_losses: deque[torch.Tensor] = deque(maxlen=10)
        self._val_sums: list[torch.Tensor] = []  # (sum of the token losses, tokens) of each validation batch

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab_size) for token ids `idx` (B, T)."""
        if self.hparams.architecture["source"] == "hf":
            return self.model(input_ids=idx).logits
        return self.model(idx)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.recent_train_losses.append(loss.detach())
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch  # (B, T), (B, T)
        total = F.cross_entropy(self(x).flatten(0, 1), y.flatten(), reduction="sum").float()
        tokens = y.numel()
        # batch_size=tokens: Lightning's epoch value of val/loss is a mean over tokens too, not over batches
        self.log("val/loss", total / tokens, prog_bar=True, batch_size=tokens)
        self._val_sums.append(torch.stack([total.detach(), total.new_tensor(tokens)]))

    @override
    def on_validation_epoch_end(self) -> None:
        if not self._val_sums:
            return
        # a mean over tokens (a smaller last batch weighs by its tokens), over all ranks' batches
        total, tokens = self.trainer.strategy.reduce(torch.stack(self._val_sums).sum(0), reduce_op="sum")
        self.val_history.append((self.global_step, (total / tokens).item()))
        self._val_sums.clear()

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        settings = self.hparams.optimizer
        # weight decay on matrices (linears, embeddings) only, not on biases and LayerNorm gains, as in GPT-2
        parameters = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in parameters if p.dim() >= 2], "weight_decay": settings["weight_decay"]},
            {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0},
        ]
        # fused=True: one kernel over all parameters instead of a sequence of foreach kernels (10 ms of
        # a 93 ms step at d=2048 on an H200, BENCHMARKS.md). Gradients are then clipped here, see
        # configure_gradient_clipping.
        optimizer = torch.optim.AdamW(groups, lr=settings["lr"], betas=tuple(settings["betas"]),
                                      fused=self._can_fuse_optimizer())
        schedule = partial(
            lr_multiplier,
            warmup_steps=settings["warmup_steps"],
            total_steps=self.trainer.estimated_stepping_batches,
            min_ratio=settings["min_lr"] / settings["lr"],
        )
        # A resumed run rebuilds this schedule from its own trainer.max_steps: with a different max_steps
        # it continues on the new cosine from the step it resumes at (the learning rate jumps there; see
        # on_train_start).
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_train_start(self) -> None:
        # A resumed run restores the optimizer's learning rates as the checkpoint's schedule left them, and
        # LambdaLR only recomputes them after the next step: with a different trainer.max_steps the first
        # resumed step would take the old schedule's rate. Set them from this run's schedule now (a fresh
        # run: the rates LambdaLR set at step 0 already).
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                continue
            groups = scheduler.optimizer.param_groups
            for group, base_lr, multiplier in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
                group["lr"] = base_lr * multiplier(scheduler.last_epoch)
            scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() (and the LR monitor) report

    def _can_fuse_optimizer(self) -> bool:
        """Fused AdamW where clipping its gradients here is right: no gradient scaler (fp16-mixed
        scales them) and every rank holding whole gradients (one device, or DDP after its all-reduce;
        not FSDP's shards)."""
        strategy = self.trainer.strategy
        no_scaler = getattr(strategy.precision_plugin, "scaler", None) is None
        return no_scaler and isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))

    @override
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # Lightning's mixed-precision plugin refuses to clip for a fused optimizer, taking "fused" to
        # mean "unscales the gradients itself"; without a scaler there is nothing to unscale.
        if not gradient_clip_val or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        if gradient_clip_algorithm in (None, "norm"):
            torch.nn.utils.clip_grad_norm_(parameters, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_value_(parameters, gradient_clip_val)


# -----------------------------------------------------------------------------------------------
# throughput


class TokensPerSecond(Callback):
    """Logs `train/tokens_per_sec` (all devices together) every optimizer step, over a sliding window.

    The device is synchronized at each optimizer step so the clock sees the work queued on it.
    Time spent in validation is not counted.

    Args:
        window: optimizer steps in the logged moving average.
        warmup_steps: first optimizer steps this run makes (a resumed run too) left out of the logged
            window and of `tokens_per_sec` (they pay for allocator growth, library initialization and
            the FP8 callback's benchmark, not training).
    """

    def __init__(self, window: int = 10, warmup_steps: int = 2) -> None:
        self.warmup_steps = warmup_steps
        self.recent: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds) per step
        self.total_tokens = 0
        self.total_seconds = 0.0
        self._start: float | None = None
        self._tokens = 0
        self._last_step = -1
        self._steps = 0  # optimizer steps seen by this run

    @property
    def tokens_per_sec(self) -> float:
        """Mean over all optimizer steps after the warm-up; NaN before any."""
        return self.total_tokens / self.total_seconds if self.total_seconds > 0 else float("nan")

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:
            _synchronize(pl_module.device)
            self._start = time.perf_counter()
            self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._tokens += batch[0].numel() * trainer.world_size
        if trainer.global_step == self._last_step:
            return  # gradient accumulation: the optimizer has not stepped yet
        _synchronize(pl_module.device)
        now = time.perf_counter()
        tokens, seconds = self._tokens, now - self._start
        self._start, self._tokens, self._last_step = now, 0, trainer.global_step
        self._steps += 1
        if self._steps <= self.warmup_steps:
            return  # warm-up (compilation, the callback's benchmark): in neither the total nor the window
        self.recent.append((tokens, seconds))
        self.total_tokens += tokens
        self.total_seconds += seconds

        tokens = sum(tokens for tokens, _ in self.recent)
        seconds = sum(seconds for _, seconds in self.recent)
        pl_module.log("train/tokens_per_sec", tokens / seconds, prog_bar=True)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # drop the half-measured step around validation; the clock restarts at the next batch
        self._start, self._tokens = None, 0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -----------------------------------------------------------------------------------------------
# training


@dataclass
class TrainResult:
    train_loss: float  # mean of the last few training losses
    val_loss: float  # at the end of training
    val_loss_init: float  # before the first step (the sanity check)
    val_history: list[tuple[int, float]]  # (step, val loss) of every validation
    tokens_per_sec: float
    steps: int
    checkpoint_path: str  # checkpoints/last.ckpt, usable as init_from; "" if none was written


def train(cfg: DictConfig, extra_callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Builds data, model, callbacks and Trainer from `cfg` (configs/train.yaml), then fits.

    Every input is checked (data.path, data.tokenizer, init_from, resume_from) before training starts.
    `extra_callbacks` join the Trainer's (the benchmarks add a profiler this way).
    """
    check_trainer_config(cfg.trainer)
    L.seed_everything(cfg.seed, workers=True)
    torch.set_float32_matmul_precision(cfg.matmul_precision)
    resume_from = cfg.get("resume_from")
    resume_path = Path(resume_from).expanduser() if resume_from is not None else None
    if resume_path is not None and not resume_path.is_file():
        raise FileNotFoundError(
            f"resume_from={resume_from!r} is not a file (resolved to {resume_path.resolve()}). "
            "Expected a checkpoint this example wrote (checkpoints/last.ckpt in a run's output_dir), or null"
        )

    datamodule = TextDataModule(**OmegaConf.to_container(cfg.data, resolve=True), seed=cfg.seed)
    network, architecture = build_network(cfg.model, cfg.init_from, datamodule.vocab_size)
    if datamodule.block_size > architecture["block_size"]:
        raise ValueError(
            f"data.block_size={datamodule.block_size} exceeds the model's block_size={architecture['block_size']} "
            "(its number of position embeddings); use a data.block_size of at most that"
        )
    module = GPTFineTune(network, architecture, OmegaConf.to_container(cfg.optimizer, resolve=True))

    output_dir = Path(cfg.output_dir)
    throughput = TokensPerSecond()
    callbacks: list[Callback] = [throughput, LearningRateMonitor(logging_interval="step")]
    save_checkpoints = cfg.trainer.get("enable_checkpointing", True)
    last_checkpoint = output_dir / "checkpoints" / "last.ckpt"
    if save_checkpoints:
        # only last.ckpt, rewritten at each validation: GPT-2 XL-sized checkpoints are tens of GB each.
        # (save_top_k=0 with save_last=True writes nothing at validation: Lightning then only saves
        # last.ckpt at the end of fit, so a run that crashes leaves none.)
        callbacks.append(ModelCheckpoint(dirpath=last_checkpoint.parent, filename=last_checkpoint.stem, monitor=None,
                                         save_top_k=1, enable_version_counter=False, save_last=False,
                                         save_on_train_epoch_end=False))
    if cfg.get("fuse") is not None:
        callbacks.append(hydra.utils.instantiate(cfg.fuse))
    callbacks.extend(extra_callbacks)
    trainer = build_trainer(cfg, callbacks)

    trainer.fit(module, datamodule=datamodule, ckpt_path=str(resume_path) if resume_path else None)
    last_validated = module.val_history[-1][0] if module.val_history else None
    if last_validated != trainer.global_step:
        # no validation at the last step (none scheduled there, or none at all), so no checkpoint of it
        # either: validate and save the final model
        if trainer.limit_val_batches != 0:
            trainer.validate(module, datamodule=datamodule, verbose=False)
        if save_checkpoints:
            trainer.save_checkpoint(last_checkpoint)

    history = module.val_history
    nan = float("nan")
    return TrainResult(
        train_loss=torch.stack(list(module.recent_train_losses)).mean().item() if module.recent_train_losses else nan,
        val_loss=history[-1][1] if history else nan,
        val_loss_init=history[0][1] if history and history[0][0] == 0 else nan,
        val_history=history,
        tokens_per_sec=throughput.tokens_per_sec,
        steps=trainer.global_step,
        checkpoint_path=str(last_checkpoint) if last_checkpoint.is_file() else "",
    )


def check_trainer_config(trainer: DictConfig) -> None:
    """Refuses trainer settings the example would train or resume wrongly with.

    Raises:
        ValueError: if an integer `val_check_interval` (micro-batches) is not a multiple of
            `accumulate_grad_batches`: validation, and the last.ckpt written there, would fall inside a
            gradient accumulation, and a run resumed from it would lose the gradients accumulated so far.
    """
    interval, accumulate = trainer.get("val_check_interval"), trainer.get("accumulate_grad_batches", 1)
    if isinstance(interval, int) and not isinstance(interval, bool) and interval % accumulate:
        raise ValueError(
            f"trainer.val_check_interval={interval} is not a multiple of trainer.accumulate_grad_batches={accumulate}: "
            "validation (and the checkpoint written there) would fall inside a gradient accumulation, and a run "
            f"resumed from that checkpoint would lose the gradients accumulated so far; use a multiple of {accumulate}, "
            f"e.g. {max(accumulate, interval - interval % accumulate)}"
        )


def build_trainer(cfg: DictConfig, callbacks: Sequence[Callback]) -> L.Trainer:
    """The Trainer of `cfg.trainer`, logging CSV to `cfg.output_dir`.

    `use_distributed_sampler=False`: the data's sampler already gives each rank its own share, in an
    order a resumed run can continue (Lightning's DistributedSampler would reshuffle it).
    """
    return hydra.utils.instantiate(cfg.trainer, callbacks=list(callbacks), logger=CSVLogger(cfg.output_dir, name="csv"),
                                   use_distributed_sampler=False)


@rank_zero_only
def summary(result: TrainResult, warmup_steps: int = 2) -> str:
    """The run's closing lines; a figure the run did not measure says why instead of printing nan."""
    at_init = f" (at init {result.val_loss_init:.4f})" if math.isfinite(result.val_loss_init) else \
        " (no validation before the first step of this run)"
    speed = f"{result.tokens_per_sec:,.0f} tokens/s" if math.isfinite(result.tokens_per_sec) else \
        f"tokens/s not measured (the first {warmup_steps} steps of a run are left out)"
    return (f"\nfinished {result.steps} steps: train loss {result.train_loss:.4f} | "
            f"val loss {result.val_loss:.4f}{at_init} | {speed}\ncheckpoint: {result.checkpoint_path}")


def print_summary(result: TrainResult) -> None:
    print(summary(result, TokensPerSecond().warmup_steps))


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        log.warning("TRITON_INTERPRET=1 is set: the Triton kernels run in the interpreter (how the CPU tests "
                    "check them), many times slower than PyTorch's own ops; unset it to train")
    print_summary(train(cfg))


if __name__ == "__main__":
    main()
