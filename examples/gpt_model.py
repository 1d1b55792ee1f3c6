"""A GPT language model in one file, in the style of nanoGPT's model.py.

Module and parameter names follow Hugging Face's GPT-2 (`transformer.h.0.mlp.c_fc`, ...), so
`GPT.from_hf_gpt2` can copy a `GPT2LMHeadModel`'s weights in. The MLP is the chain
lightning-fuse looks for: `c_fc` (Linear with bias) -> `gelu` (tanh GELU) -> `c_proj`.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence; the position embedding has this many rows
    vocab_size: int = 256  # 256: raw bytes; 50257: GPT-2's BPE
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0  # 0.0 for pre-training; 0.1 is a common choice for fine-tuning

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "each head gets n_embd // n_head channels, so pick n_head dividing n_embd"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees itself and the positions before it."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # query, key and value projections for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding size (n_embd)
        head_size = C // self.n_head

        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, head_size).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, head_size).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, head_size).transpose(1, 2)  # (B, nh, T, hs)

        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side again

        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward block: Linear(d, 4d) -> tanh GELU -> Linear(4d, d)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        # GPT-2 was trained with the tanh approximation of GELU (HF's "gelu_new")
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)  # (B, T, 4C)
        x = self.gelu(x)  # (B, T, 4C)
        x = self.c_proj(x)  # (B, T, C)
        return self.dropout(x)


class Block(nn.Module):
    """One transformer layer: pre-LayerNorm attention and MLP, each added to the residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    """Token and position embeddings, `n_layer` blocks, a final LayerNorm and a tied output head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying (as in GPT-2): the output head reuses the token embedding matrix
        self.transformer.wte.weight = self.lm_head.weight

        self.apply(self._init_weights)
        # GPT-2 scales the init of the projections that write into the residual stream by
        # 1/sqrt(2 * n_layer): each layer adds two of them, and the sum should not grow with depth
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token logits for every position of `idx` (B, T) of token ids: (B, T, vocab_size)."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(
                f"got a sequence of length {T}, but this model's block_size is {self.config.block_size}; "
                "feed at most block_size tokens"
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)

        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C)
        x = self.transformer.drop(tok_emb + pos_emb)  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, vocab_size)

    def num_parameters(self) -> int:
        """Parameter count, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_hf_gpt2(cls, hf_model: Any, dropout: float = 0.0) -> "GPT":
        """A GPT holding a copy of the weights of a Hugging Face `GPT2LMHeadModel`.

        Raises:
            ValueError: if the HF model's activation, LayerNorm epsilon, head tying, attention scaling or
                MLP width differ from this model's.
        """
        hf_config = hf_model.config
        if hf_config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(
                f"the Hugging Face model uses activation_function={hf_config.activation_function!r}; "
                "this GPT's MLP uses the tanh GELU ('gelu_new' or 'gelu_pytorch_tanh'): "
                "load it with model.source=hf instead"
            )
        if hf_config.layer_norm_epsilon != 1e-5:
            raise ValueError(
                f"the Hugging Face model uses layer_norm_epsilon={hf_config.layer_norm_epsilon}; "
                "this GPT's LayerNorms use PyTorch's 1e-5: load it with model.source=hf instead"
            )
        # Settings this GPT does not have (it would load the weights and compute something else).
        expected = {"tie_word_embeddings": True, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                    "reorder_and_upcast_attn": False}
        for name, value in expected.items():
            if getattr(hf_config, name, value) != value:
                raise ValueError(f"the Hugging Face model has {name}={getattr(hf_config, name)!r}; this GPT computes "
                                 f"{name}={value!r}: load it with model.source=hf instead")
        n_inner = getattr(hf_config, "n_inner", None)
        if n_inner not in (None, 4 * hf_config.n_embd):
            raise ValueError(f"the Hugging Face model has n_inner={n_inner}; this GPT's MLP is 4 * n_embd = "
                             f"{4 * hf_config.n_embd} wide: load it with model.source=hf instead")
        config = GPTConfig(
            block_size=hf_config.n_positions,
            vocab_size=hf_config.vocab_size,
            n_layer=hf_config.n_layer,
            n_head=hf_config.n_head,
            n_embd=hf_config.n_embd,
            dropout=dropout,
        )
        model = cls(config)

        hf_state = hf_model.state_dict()
        # HF's Conv1D stores its weight as (in, out); nn.Linear stores (out, in)
        conv1d_weights = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                source = hf_state[name]
                if name.endswith(conv1d_weights):
                    source = source.t()
                tensor.copy_(source)
        return model
