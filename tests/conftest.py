"""Test set-up: on a machine without CUDA the Triton kernels run under the Triton interpreter; the
repository root is taken off ``sys.path``."""

import os
import sys
from pathlib import Path

import pytest
import torch

# The top-level kernels/ folder installs as lightning_fuse.kernels. `python -m pytest` run from the
# repository root puts the root on sys.path, where that folder would shadow the PyPI package
# `kernels`, which transformers (5.25 on) imports. The tests use the installed package only.
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != REPO_ROOT]

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
