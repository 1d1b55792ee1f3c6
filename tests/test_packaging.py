"""How the package installs: the kernels/ folder as ``lightning_fuse.kernels`` only."""

import importlib.util
from pathlib import Path


def test_the_repository_kernels_folder_does_not_shadow_the_pypi_kernels_package():
    # lightning_fuse.kernels comes from the repository's kernels/ folder; a top-level `import kernels`
    # (transformers does one) must not find that folder (tests/conftest.py keeps the root off sys.path).
    import lightning_fuse.kernels

    ours = Path(lightning_fuse.kernels.__file__).resolve().parent
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin).resolve().parent != ours
