"""Test set-up: on a machine without CUDA the Triton kernels run under the Triton interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is created, i.e. before lightning_fuse is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
