"""Tensors handed to ``torch.distributed`` collectives, kept by their owner from one call to the next.

A process group's worker thread may drop its reference to a collective's tensor after the call has
returned. Where that reference is the last, the thread frees the tensor's Python object itself, which
takes the GIL; in a process that is exiting (the interpreter finalizing) that aborts it ("terminate
called without an active exception"). With gloo, one rank of a two-process run died so in about 1 of
40 runs while its last health log summed the ranks' counts in a temporary. So the tensors
lightning-fuse hands to collectives come from here, owned by the callback or the scaling state.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

__all__ = ["CollectiveBuffers"]


class CollectiveBuffers:
    """One kept tensor per key, made again only when its size, dtype or device changes."""

    def __init__(self) -> None:
        self._tensors: dict[Hashable, torch.Tensor] = {}

    def get(self, key: Hashable, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The 1-D tensor of ``numel`` elements kept under ``key`` (its values are whatever the last use left)."""
        tensor = self._tensors.get(key)
        if tensor is None or tensor.numel() != numel or tensor.dtype != dtype or tensor.device != device:
            tensor = self._tensors[key] = torch.empty(numel, dtype=dtype, device=device)
        return tensor

    def __getstate__(self) -> dict[str, Any]:  # scratch space: a copy (ddp_spawn's pickle) makes its own
        return {"_tensors": {}}
