"""Tiny LightningModules for the callback tests, in the spirit of Lightning's ``BoringModel``.

Every width is a multiple of 16 (so FP8 GEMMs accept it) and small (<= 64), and a batch holds a few
dozen tokens, so the Triton interpreter runs a training step in well under a second on CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

D_MODEL = 32  # width of every model's input and output
TOKENS = 8  # tokens per sample: a (batch, TOKENS, D_MODEL) input is flattened to batch * TOKENS rows
NUM_SAMPLES = 64  # enough for any test here without a second epoch


def regression_data(num_samples: int = NUM_SAMPLES, d: int = D_MODEL, seed: int = 0) -> TensorDataset:
    """Fixed random inputs and targets (never zeros), the same for every run."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, TOKENS, d, generator=generator)
    target = torch.randn(num_samples, TOKENS, d, generator=generator)
    return TensorDataset(x, target)


class BoringMLPModel(LightningModule):
    """``Linear(d, 2d) -> GELU -> Linear(2d, d)`` regressing random targets with SGD.

    ``mlp.0 -> mlp.1`` is the chain; with ``convert="mlp"`` ``mlp.2`` becomes an ``FP8Linear`` too.
    The loss is a mean over the batch, so DDP's averaged gradient equals one process's gradient on
    the whole global batch.
    """

    def __init__(self, d: int = D_MODEL, batch_size: int = 2, lr: float = 0.1, dropout: float = 0.0) -> None:
        super().__init__()
        self.d = d
        self.batch_size = batch_size
        self.lr = lr
        self.mlp: Optional[nn.Module] = self.build(d, dropout)

    @staticmethod
    def build(d: int, dropout: float = 0.0) -> nn.Module:
        layers = [nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)]
        if dropout:
            layers.append(nn.Dropout(dropout))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)  # (B, T, d)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, target = batch
        loss = F.mse_loss(self(x).float(), target.float())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, target = batch
        loss = F.mse_loss(self(x).float(), target.float())
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(d=self.d), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(num_samples=4, d=self.d, seed=1), batch_size=self.batch_size)


class ShardedMLPModel(BoringMLPModel):
    """Each rank reads samples ``rank, rank + world_size, ...`` in order (run with
    ``use_distributed_sampler=False``), so ``world_size`` ranks of ``batch_size`` see exactly what
    one process of ``world_size * batch_size`` sees (Lightning's own sampler would shuffle)."""

    def train_dataloader(self) -> DataLoader:
        data = regression_data(d=self.d)
        rank, world_size = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(Subset(data, range(rank, len(data), world_size)), batch_size=self.batch_size)


class NanoGPTMLPModel(BoringMLPModel):
    """The same computation with nanoGPT's attribute names: ``c_fc -> gelu -> c_proj``."""

    def __init__(self, d: int = D_MODEL, batch_size: int = 2, lr: float = 0.1) -> None:
        super().__init__(d, batch_size, lr)
        self.mlp = None
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)  # (B, T, 4d)
        x = self.gelu(x)
        return self.c_proj(x)  # (B, T, d)


class ConfigureModelMLP(BoringMLPModel):
    """Builds its layers in ``configure_model`` (as FSDP users do), not in ``__init__``."""

    def __init__(self, d: int = D_MODEL, batch_size: int = 2, lr: float = 0.1) -> None:
        super().__init__(d, batch_size, lr)
        self.mlp = None

    def configure_model(self) -> None:
        if self.mlp is not None:  # Lightning may call the hook more than once
            return
        self.mlp = self.build(self.d)


class NoChainModel(BoringMLPModel):
    """``Linear -> LayerNorm -> Linear``: no activation follows a linear, so nothing can be fused."""

    @staticmethod
    def build(d: int, dropout: float = 0.0) -> nn.Module:
        return nn.Sequential(nn.Linear(d, 2 * d), nn.LayerNorm(2 * d), nn.Linear(2 * d, d))


class TinyGPT2Model(LightningModule):
    """A one-layer Hugging Face GPT-2 (HF ``Conv1D`` linears, ``NewGELUActivation``) on random tokens."""

    def __init__(self, vocab_size: int = 64, block_size: int = 16, batch_size: int = 2, lr: float = 1e-2) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=block_size, vocab_size=vocab_size,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.lm = GPT2LMHeadModel(config)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.batch_size = batch_size
        self.lr = lr

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch  # (B, T)
        loss = self.lm(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab_size, (16, self.block_size), generator=generator)
        return DataLoader(TensorDataset(tokens), batch_size=self.batch_size)


def keep_except(module: nn.Module, fqn: str, names: tuple[str, ...] = ("mlp.2",)) -> bool:
    """A module filter a config file can name by its import path: swap every linear but ``names``."""
    return fqn not in names


class Filters:
    """Module filters as static methods, named by a path through the class."""

    keep_except = staticmethod(keep_except)
