"""Text data for the GPT example: a corpus on disk -> a token stream -> random fixed-length blocks.

With `path=None` the corpus is the Python standard library's own `.py` sources, which exist on
every machine that runs this example, so nothing is ever downloaded. Tokens are raw bytes
(vocabulary 256) unless `tokenizer` names a local Hugging Face tokenizer directory.
"""

import itertools
import logging
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

log = logging.getLogger(__name__)

BYTE_VOCAB_SIZE = 256

# the interpreter's lib folder also holds installed packages; only the standard library is wanted
NOT_STDLIB = frozenset({"site-packages", "dist-packages"})


def stdlib_source_files() -> list[Path]:
    """The standard library's `.py` files, sorted so every run reads them in the same order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path for path in root.rglob("*.py") if NOT_STDLIB.isdisjoint(path.relative_to(root).parts)]
    return sorted(files)


def corpus_files(path: str | Path | None, glob: str) -> list[Path]:
    """The files that make up the corpus, in a fixed order.

    Raises:
        FileNotFoundError: if `path` does not exist, or is a folder with no file matching `glob`.
    """
    if path is None:
        return stdlib_source_files()
    given = Path(path).expanduser()
    expected = (
        f"Expected a text file or a folder of text files matching data.glob={glob!r}; "
        "data.path=null uses the default corpus (the Python standard library's .py sources)."
    )
    if given.is_file():
        return [given]
    if not given.is_dir():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist (resolved to {given.resolve()}). {expected}")
    files = sorted(file for file in given.glob(glob) if file.is_file())
    if not files:
        raise FileNotFoundError(
            f"data.path={str(path)!r} is a folder, but no file in it matches data.glob={glob!r}. {expected}"
        )
    return files


def read_corpus(files: list[Path], max_bytes: int) -> bytes:
    """The files' bytes joined by newlines, cut off after `max_bytes` (so large folders stay fast)."""
    chunks: list[bytes] = []
    total = 0
    for file in files:
        if total >= max_bytes:
            break
        chunk = file.read_bytes()[: max_bytes - total] + b"\n"
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)[:max_bytes]


class RandomBlockDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed-length blocks of one token stream at random offsets, like nanoGPT's `get_batch`.

    The offsets are drawn once from `seed`, so item `i` is always the same block: runs repeat
    exactly, and every DataLoader worker (or DDP rank) agrees on what item `i` is.

    Args:
        tokens: the token stream, a 1-D integer tensor.
        block_size: tokens per sample.
        num_blocks: samples in one pass over the dataset.
        seed: seed of the offsets.
        split: what the stream is ("train", "val"), for error messages.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, num_blocks: int, seed: int, split: str = "train") -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(
                f"the {split} split has {len(tokens)} tokens, but a block needs block_size + 1 = {block_size + 1} "
                "(inputs and the targets shifted by one); use a smaller data.block_size, more data (data.path, "
                "data.max_bytes) or a data.val_fraction that leaves this split more"
            )
        self.tokens = tokens
        self.block_size = block_size
        generator = torch.Generator().manual_seed(seed)
        # the last valid start leaves room for block_size + 1 tokens
        self.offsets = torch.randint(len(tokens) - block_size, (num_blocks,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.offsets[index])
        chunk = self.tokens[start : start + self.block_size + 1].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]  # inputs (T,), targets (T,)


class ResumingSampler(Sampler[int]):
    """One rank's share of indices ``0 .. n-1``, rank-strided over the global order, in whole global batches.

    The global order is ``0 .. n-1``; global batch ``k`` is positions ``k*B*W .. (k+1)*B*W - 1``
    (``B = batch_size`` per rank, ``W = world_size`` ranks), and rank ``r`` takes the positions
    ``r, r + W, r + 2W, ...`` of it. So the ranks' ``k``-th batches together are global batch ``k``, no
    sample is in two ranks' shares, and ``W`` ranks see what one process of batch ``B*W`` sees. The last
    ``n % (B*W)`` indices are left out (drop_last): an epoch is ``n // (B*W)`` whole steps on every rank,
    which keeps a resumed epoch in step with an uninterrupted one.

    The first pass starts at global position ``start`` (what a resumed epoch has already trained on,
    ``completed batches * B * W``); the samples before it come last, past where Lightning ends the epoch.
    A ``start`` at the end of the epoch (a run stopped after its last batch) makes the first pass empty:
    the resumed epoch has nothing left (Lightning, resuming from a checkpoint written at the validation
    of an epoch's last batch, asks it for one more batch before it starts the next epoch). Later passes
    start at 0.

    Lightning must not wrap this sampler in its DistributedSampler (``use_distributed_sampler=False``).

    Raises:
        ValueError: for a rank outside ``0 .. world_size - 1``, or a ``start`` that is not a whole number of
            global batches.
    """

    def __init__(self, n: int, batch_size: int = 1, start: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in 0 .. world_size - 1 = {world_size - 1}")
        global_batch = batch_size * world_size
        if start % global_batch:
            raise ValueError(
                f"start={start} must be a whole number of global batches of batch_size x world_size = "
                f"{batch_size} x {world_size} = {global_batch} samples"
            )
        self.n, self.rank, self.world_size = n, rank, world_size
        self.used = n - n % global_batch  # global positions 0 .. used-1 are trained on
        self.start = start

    def __len__(self) -> int:
        return self.used // self.world_size

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start // self.world_size, 0  # this rank's share of what is done
        share = range(self.rank, self.used, self.world_size)
        if start >= len(share):
            return iter(())  # the resumed epoch is over
        return itertools.chain(share[start:], share[:start])


class TextDataModule(L.LightningDataModule):
    """Train and validation blocks from a text corpus.

    The corpus is tokenized once and split in two: the first `1 - val_fraction` of the tokens
    for training, the rest for validation. The validation blocks are the same at every
    evaluation, so validation losses are comparable across a run (and across runs with one seed).

    Args:
        path: a text file, a folder of text files, or None for the standard library's sources.
        glob: which files of a folder to read (ignored for a single file).
        max_bytes: read at most this many bytes of the corpus.
        tokenizer: None for byte tokens, or a local Hugging Face tokenizer directory.
        block_size: tokens per sample.
        batch_size: samples per batch (per device).
        val_fraction: share of the token stream held out for validation.
        train_blocks: training samples per epoch (training usually stops at `max_steps` first); an epoch
            is train_blocks // (batch_size x devices) whole steps, the remaining blocks are left out.
        val_blocks: validation samples.
        num_workers: DataLoader worker processes.
        seed: seed of the random block offsets.

    Raises:
        FileNotFoundError: if `path` or `tokenizer` do not exist, or a folder has no matching file.
        ValueError: if a number is out of range.
    """

    def __init__(
        self,
        path: str | None = None,
        glob: str = "**/*.txt",
        max_bytes: int = 2_000_000,
        tokenizer: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        train_blocks: int = 100_000,
        val_blocks: int = 128,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={val_fraction} must lie strictly between 0 and 1")
        counts = dict(
            max_bytes=max_bytes,
            block_size=block_size,
            batch_size=batch_size,
            train_blocks=train_blocks,
            val_blocks=val_blocks,
        )
        for name, value in counts.items():
            if value < 1:
                raise ValueError(f"data.{name}={value} must be a positive integer")
        # look at the inputs now, so a wrong path fails before any model is built
        self.files = corpus_files(path, glob)
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer is not None else None
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.train_blocks = train_blocks
        self.val_blocks = val_blocks
        self.num_workers = num_workers
        self.seed = seed
        self.train_dataset: RandomBlockDataset | None = None
        self.val_dataset: RandomBlockDataset | None = None

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE if self.tokenizer is None else len(self.tokenizer)

    def tokenize(self, corpus: bytes) -> torch.Tensor:
        """The corpus as a 1-D int32 tensor of token ids (int32: GPT-2's 50257 ids overflow int16)."""
        if self.tokenizer is None:
            return torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(torch.int32)
        # the byte cap may cut a multi-byte character in two; replace it rather than fail
        text = corpus.decode("utf-8", errors="replace")
        return torch.tensor(self.tokenizer(text, verbose=False)["input_ids"], dtype=torch.int32)

    def setup(self, stage: str) -> None:
        if self.train_dataset is not None:
            return
        corpus = read_corpus(self.files, self.max_bytes)
        tokens = self.tokenize(corpus)
        n_train = int(len(tokens) * (1.0 - self.val_fraction))
        log.info(
            "corpus: %d files, %d bytes, %d tokens (%d train, %d val)",
            len(self.files), len(corpus), len(tokens), n_train, len(tokens) - n_train,
        )
        # different seeds for the two splits, so their offset sequences are unrelated
        self.train_dataset = RandomBlockDataset(tokens[:n_train], self.block_size, self.train_blocks, self.seed,
                                                split="train")
        self.val_dataset = RandomBlockDataset(tokens[n_train:], self.block_size, self.val_blocks, self.seed + 1,
                                              split="val")

    def _rank(self) -> tuple[int, int]:
        """(this process's rank, the number of ranks); (0, 1) without a Trainer."""
        if self.trainer is None:
            return 0, 1
        return self.trainer.global_rank, self.trainer.world_size

    def train_dataloader(self) -> DataLoader:
        """This rank's share of every global batch (see ResumingSampler), whole global batches only.

        Raises:
            ValueError: if data.train_blocks is less than one global batch.
        """
        rank, world_size = self._rank()
        if self.train_blocks < self.batch_size * world_size:
            raise ValueError(
                f"data.train_blocks={self.train_blocks} is less than one global batch of data.batch_size x ranks = "
                f"{self.batch_size} x {world_size}; use a data.train_blocks of at least {self.batch_size * world_size}"
            )
        # A run resumed mid-epoch: Lightning restores its loops before it asks for the loader, so the
        # samples all ranks together have already trained on this epoch are known; start after them
        # rather than replay the epoch from its first block.
        start = 0
        if self.trainer is not None:
            done = self.trainer.fit_loop.epoch_loop.batch_progress.current.completed
            start = done * self.batch_size * world_size
        sampler = ResumingSampler(self.train_blocks, self.batch_size, start, rank, world_size)
        return self._dataloader(self.train_dataset, sampler)

    def val_dataloader(self) -> DataLoader:
        """This rank's share of the validation blocks, rank-strided; every rank gets as many (the last
        val_blocks % ranks blocks are left out), so all ranks run the same number of batches."""
        rank, world_size = self._rank()
        if self.val_blocks < world_size:
            raise ValueError(
                f"data.val_blocks={self.val_blocks} is less than one block for each of the {world_size} ranks; "
                f"use a data.val_blocks of at least {world_size}"
            )
        return self._dataloader(self.val_dataset, ResumingSampler(self.val_blocks, 1, 0, rank, world_size))

    def _dataloader(self, dataset: RandomBlockDataset | None, sampler: ResumingSampler) -> DataLoader:
        if dataset is None:
            raise RuntimeError("TextDataModule.setup() must run before its dataloaders are asked for")
        # no shuffling: the offsets are already random, and a fixed order keeps runs repeatable
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )


def load_tokenizer(directory: str) -> Any:
    """A Hugging Face tokenizer from a local directory; nothing is downloaded.

    Raises:
        FileNotFoundError: if `directory` is not a folder.
    """
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"data.tokenizer={directory!r} is not a directory (resolved to {path.resolve()}). Expected a local "
            "Hugging Face tokenizer directory (as written by `tokenizer.save_pretrained(dir)`), or "
            "data.tokenizer=null for byte tokens."
        )
    # transformers is only needed on this path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
