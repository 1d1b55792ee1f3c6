"""Tests of the GPT example (examples/gpt_finetune.py and its model, data and configs), on CPU.

The example is a script folder, not a package: its modules import each other as siblings
(`from gpt_model import GPT`), so this file puts examples/ on sys.path the way running the
script does.
"""

import math
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch import Callback
from omegaconf import DictConfig, OmegaConf
from torch.nn import functional as F

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs"
sys.path.insert(0, str(REPO / "examples"))

from gpt_data import NOT_STDLIB, RandomBlockDataset, TextDataModule, stdlib_source_files  # noqa: E402
from gpt_finetune import TokensPerSecond, TrainResult, lr_multiplier, summary, train  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402


def fuse_callback_exists() -> bool:
    try:
        import lightning_fuse
    except ImportError:
        return False
    return hasattr(lightning_fuse, "FusedBackwardCallback")


@pytest.fixture(
    params=[
        pytest.param(["fuse=null"], id="fuse-off"),
        pytest.param(
            [],
            id="fuse-on",
            marks=pytest.mark.skipif(
                not fuse_callback_exists(), reason="lightning_fuse.FusedBackwardCallback not written yet"
            ),
        ),
    ]
)
def fuse(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Overrides that run a training test without the callback, and with it as configs/ set it up.

    On CPU the callback's modules run the kernels' pure-torch references here, not the Triton
    interpreter (10-100x slower): these tests check the example's wiring; tests/test_kernels.py
    runs the kernels themselves under the interpreter.
    """
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


# the tiny preset, shortened: a few seconds per run on two CPU cores
QUICK = [
    "trainer.max_steps=30",
    "trainer.val_check_interval=15",
    "trainer.limit_val_batches=4",
    "trainer.log_every_n_steps=5",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "data.max_bytes=300_000",
]


# for tests that train twice: the second run (or both) only needs to show where it starts
SHORT = ["trainer.max_steps=10", "trainer.val_check_interval=10"]


def compose_config(overrides: list[str]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def quick_config(tmp_path: Path, overrides: list[str]) -> DictConfig:
    return compose_config([*QUICK, f"output_dir={tmp_path}", *overrides])


class MicroBatches(Callback):
    """A fingerprint of every training micro-batch, with the optimizer step it belongs to."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, int(batch[0].sum())))


class SeenSamples(Callback):
    """The dataset indices of every training micro-batch, with the optimizer step it belongs to
    (found by content, so the test does not trust the sampler it checks)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int]]] = []
        self._index: dict[tuple[int, ...], int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self._index:
            dataset = trainer.datamodule.train_dataset
            self._index = {tuple(dataset[i][0].tolist()): i for i in range(len(dataset))}
            assert len(self._index) == len(dataset), "two blocks alike: indices cannot be told apart"
        self.seen.append((trainer.global_step, [self._index[tuple(row.tolist())] for row in batch[0]]))


class Crash(Exception):
    pass


class CrashAtStep(Callback):
    """Stops a run the hard way (an exception, not a graceful end) as optimizer step `step` begins."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Crash(f"crashed at step {self.step}")


def stub_trainer(rank: int, world_size: int, completed: int) -> SimpleNamespace:
    """What TextDataModule.train_dataloader reads of a Trainer: its rank, the world size and the
    batches this epoch has completed (non-zero on a resumed run)."""
    progress = SimpleNamespace(current=SimpleNamespace(completed=completed))
    return SimpleNamespace(global_rank=rank, world_size=world_size,
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))


def save_tiny_hf_gpt2(directory: Path) -> Path:
    """A randomly initialized GPT-2 with byte vocabulary, saved as a local HF model directory."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None
    )
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


# -----------------------------------------------------------------------------------------------
# configs


def config_names(group: str) -> list[str]:
    return sorted(path.stem for path in (CONFIG_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize(
    ("group", "name"),
    [(group, name) for group in ("model", "data", "trainer") for name in config_names(group)],
)
def test_every_group_config_composes(group: str, name: str) -> None:
    cfg = compose_config([f"{group}={name}", "output_dir=/tmp/unused"])
    assert cfg[group] is not None


@pytest.mark.parametrize("name", config_names("experiment"))
def test_every_experiment_composes_into_a_model_that_builds(name: str) -> None:
    cfg = compose_config([f"experiment={name}", "output_dir=/tmp/unused"])
    # sequence 1024 on one bf16 GPU, ~16k tokens per optimizer step (the benchmark's setting)
    assert cfg.model.block_size == 1024
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.precision == "bf16-mixed"
    tokens_per_step = cfg.data.batch_size * cfg.data.block_size * cfg.trainer.accumulate_grad_batches
    assert 12_000 <= tokens_per_step <= 20_000
    # on the meta device: checks the sizes (n_head divides n_embd) without allocating anything
    with torch.device("meta"):
        GPT(GPTConfig(**{k: cfg.model[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}))


def test_trainer_default_instantiates_on_cpu(tmp_path: Path) -> None:
    from hydra.utils import instantiate

    cfg = compose_config([f"output_dir={tmp_path}"])
    trainer = instantiate(cfg.trainer, logger=False)
    assert trainer.max_steps == cfg.trainer.max_steps


def test_fuse_callback_is_on_by_default_and_can_be_disabled() -> None:
    cfg = compose_config(["output_dir=/tmp/unused"])
    assert cfg.fuse._target_ == "lightning_fuse.FusedBackwardCallback"
    assert cfg.fuse.recipe._target_.startswith("lightning_fuse.")
    assert compose_config(["fuse=null", "output_dir=/tmp/unused"]).fuse is None
    assert "fuse" not in compose_config(["~fuse", "output_dir=/tmp/unused"])


def test_fuse_flags_are_set_from_the_command_line() -> None:
    cfg = compose_config(["output_dir=/tmp/unused"])
    if "convert" not in cfg.fuse or "amax_history_len" not in cfg.fuse.recipe:
        pytest.skip("configs/callbacks and configs/recipe do not list convert / amax_history_len yet")
    cfg = compose_config(["fuse.recipe.amax_history_len=16", "fuse.convert=all", "output_dir=/tmp/unused"])
    assert cfg.fuse.recipe.amax_history_len == 16
    assert cfg.fuse.convert == "all"


# -----------------------------------------------------------------------------------------------
# model and data


def test_native_gpt_matches_hf_gpt2_after_weight_copy(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    hf_model = GPT2LMHeadModel.from_pretrained(save_tiny_hf_gpt2(tmp_path / "hf"), local_files_only=True).eval()
    native = GPT.from_hf_gpt2(hf_model).eval()
    idx = torch.randint(0, 256, (3, 77))
    torch.testing.assert_close(native(idx), hf_model(input_ids=idx).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting", [dict(tie_word_embeddings=False), dict(scale_attn_by_inverse_layer_idx=True),
                                     dict(scale_attn_weights=False), dict(n_inner=128)])
def test_an_hf_gpt2_this_gpt_cannot_compute_is_refused_not_loaded(setting) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=1, n_head=4, **setting))
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"the Hugging Face model has {name}=.*load it with model.source=hf"):
        GPT.from_hf_gpt2(hf_model)


def test_random_blocks_are_deterministic_and_shifted_by_one() -> None:
    tokens = torch.randint(0, 256, (5000,), dtype=torch.int32)
    first, again, other = (RandomBlockDataset(tokens, 64, 32, seed) for seed in (7, 7, 8))
    x, y = first[5]
    assert x.shape == y.shape == (64,) and x.dtype == torch.long
    torch.testing.assert_close(x[1:], y[:-1])
    assert all(torch.equal(first[i][0], again[i][0]) for i in range(32))
    assert not all(torch.equal(first[i][0], other[i][0]) for i in range(32))


def test_default_corpus_is_the_standard_library_only() -> None:
    files = stdlib_source_files()
    assert files and all(file.suffix == ".py" for file in files)
    assert not any(NOT_STDLIB.intersection(file.parts) for file in files)


def test_data_from_a_folder_and_a_local_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"part{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * 200)
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe_trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([path.read_text() for path in corpus.iterdir()], bpe_trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="[UNK]").save_pretrained(tmp_path / "tokenizer")

    data = TextDataModule(path=str(corpus), glob="*.txt", tokenizer=str(tmp_path / "tokenizer"), block_size=16)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert data.vocab_size > 256
    assert x.shape == (16, 16) and 0 <= int(x.min()) and int(x.max()) < data.vocab_size


def test_ddp_ranks_share_an_epoch_disjointly_and_a_resumed_epoch_serves_only_what_is_left() -> None:
    # 10 blocks, 2 ranks of batch 2: global batches of 4, so an epoch is 2 steps over blocks 0..7
    data = TextDataModule(block_size=16, batch_size=2, train_blocks=10, val_blocks=11, max_bytes=50_000)
    data.setup("fit")

    def batches(rank: int, completed: int) -> list[list[int]]:
        data.trainer = stub_trainer(rank, world_size=2, completed=completed)
        loader = data.train_dataloader()
        # the batches Lightning takes in this epoch: len(loader) less those the resumed epoch has done
        return [list(batch) for _, batch in zip(range(len(loader) - completed), loader.batch_sampler)]

    whole = {rank: batches(rank, completed=0) for rank in (0, 1)}
    assert whole == {0: [[0, 2], [4, 6]], 1: [[1, 3], [5, 7]]}  # rank-strided over the global order
    every = Counter(i for rank in (0, 1) for batch in whole[rank] for i in batch)
    assert every == Counter(range(8))  # each block of the epoch exactly once, over both ranks
    seen_in_step_0 = set(whole[0][0] + whole[1][0])
    resumed = {rank: batches(rank, completed=1) for rank in (0, 1)}  # resumed after one optimizer step
    assert resumed == {rank: whole[rank][1:] for rank in (0, 1)}  # step for step, on each rank
    assert set(resumed[0][0] + resumed[1][0]) == set(range(8)) - seen_in_step_0
    # validation: 11 blocks over 2 ranks, 5 each (the odd one left out), none on both
    shares = []
    for rank in (0, 1):
        data.trainer = stub_trainer(rank, world_size=2, completed=0)
        shares.append([i for batch in data.val_dataloader().batch_sampler for i in batch])
    assert sorted(shares[0] + shares[1]) == list(range(10)) and len(shares[0]) == len(shares[1]) == 5


def test_lightning_keeps_the_example_sampler_under_ddp(tmp_path: Path) -> None:
    # Lightning's default (use_distributed_sampler=True) wraps any sampler in a shuffling
    # DistributedSamplerWrapper, which breaks the resume order the example's sampler keeps.
    from lightning.pytorch.trainer.states import RunningStage

    from gpt_finetune import build_trainer

    cfg = quick_config(tmp_path, ["trainer.devices=2", "trainer.strategy=ddp", "data.train_blocks=64", "fuse=null"])
    trainer = build_trainer(cfg, [])
    data = TextDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    data.trainer = trainer
    data.setup("fit")
    loader = data.train_dataloader()
    # what trainer.fit does to the training loader before iterating it (Lightning's own, private, step)
    prepared = trainer._data_connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING)
    assert type(prepared.sampler).__name__ == "ResumingSampler" and prepared.sampler is loader.sampler


def test_a_split_too_short_for_one_block_is_named(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("x" * 1000)  # 1000 bytes + the newline read_corpus adds: 900 train tokens, 101 val
    data = TextDataModule(path=str(corpus), block_size=128, val_fraction=0.1)
    with pytest.raises(ValueError, match=r"the val split has 101 tokens.*block_size \+ 1 = 129"):
        data.setup("fit")


def test_lr_schedule_warms_up_then_decays_to_min() -> None:
    multipliers = [lr_multiplier(step, warmup_steps=5, total_steps=50, min_ratio=0.1) for step in range(60)]
    assert multipliers[0] < multipliers[4] < multipliers[5] == 1.0
    assert multipliers[50:] == [0.1] * 10
    assert all(a >= b for a, b in zip(multipliers[5:], multipliers[6:]))


# -----------------------------------------------------------------------------------------------
# training


@pytest.mark.parametrize("source", ["native", "hf"])
def test_tiny_run_learns(tmp_path: Path, source: str, fuse: list[str]) -> None:
    result = train(quick_config(tmp_path, [f"model.source={source}", *fuse]))
    assert result.steps == 30
    assert all(math.isfinite(loss) for loss in (result.train_loss, result.val_loss, result.val_loss_init))
    # from ~ln(256) = 5.5 at init; 30 steps of the tiny model reach ~3
    assert result.val_loss < result.val_loss_init - 1.0
    assert result.tokens_per_sec > 0
    assert Path(result.checkpoint_path).is_file()


def test_fused_optimizer_clips_gradients_itself(tmp_path: Path) -> None:
    # Lightning's mixed-precision plugin refuses to clip for a fused optimizer; the example clips
    # there itself. After a short run (which clipped every step), clip large gradients by hand.
    from lightning.pytorch.callbacks import Callback

    class ClipProbe(Callback):
        def on_train_end(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            self.fused = optimizer.defaults["fused"]
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            torch.manual_seed(0)
            for p in parameters:
                p.grad = torch.randn_like(p) * 100
            pl_module.configure_gradient_clipping(optimizer, 0.5, "norm")
            self.norm = torch.cat([p.grad.flatten() for p in parameters]).norm().item()
            for p in parameters:
                p.grad = torch.randn_like(p) * 100
            pl_module.configure_gradient_clipping(optimizer, 0.25, "value")
            self.largest = max(p.grad.abs().max().item() for p in parameters)

    probe = ClipProbe()
    result = train(quick_config(tmp_path, ["trainer.max_steps=3", "trainer.gradient_clip_val=1.0", "fuse=null"]),
                   extra_callbacks=[probe])
    assert result.steps == 3
    assert probe.fused is True
    assert probe.norm == pytest.approx(0.5, rel=1e-3)
    assert probe.largest == pytest.approx(0.25)


def test_final_validation_and_checkpoint_when_the_schedule_misses_the_last_step(tmp_path: Path) -> None:
    result = train(quick_config(tmp_path, ["trainer.max_steps=20", "trainer.val_check_interval=15", "fuse=null"]))
    assert [step for step, _ in result.val_history] == [0, 15, 20]
    assert torch.load(result.checkpoint_path, weights_only=True)["global_step"] == 20


def test_init_from_a_checkpoint_continues_from_its_weights(tmp_path: Path, fuse: list[str]) -> None:
    first = train(quick_config(tmp_path / "first", fuse))
    # different model sizes on the command line: a checkpoint's own architecture wins
    overrides = [f"init_from={first.checkpoint_path}", "model.n_layer=5", *SHORT, *fuse]
    second = train(quick_config(tmp_path / "second", overrides))
    # same seed, so the same validation blocks: the second run starts where the first ended
    assert second.val_loss_init == pytest.approx(first.val_loss, abs=1e-4)
    assert second.val_loss < first.val_loss


def test_resume_from_a_checkpoint_continues_the_run_and_its_fp8_state(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the pure-torch kernel references: this tests the wiring
    emulate = ["fuse.emulate=true"]  # FP8 on CPU, so the scales move and their restoration shows
    first = train(quick_config(tmp_path / "first", [*SHORT, *emulate]))
    saved = torch.load(first.checkpoint_path, weights_only=False)
    (fuse_state,) = [v for k, v in saved["callbacks"].items() if "FusedBackwardCallback" in k]
    restored = {}

    from lightning.pytorch import Callback

    class Capture(Callback):  # the callback's FP8 state as training resumes, before any new step
        def on_train_start(self, trainer, pl_module):
            (fuse,) = [c for c in trainer.callbacks if type(c).__name__ == "FusedBackwardCallback"]
            restored.update(fuse.state_dict())

    overrides = [f"resume_from={first.checkpoint_path}", "trainer.max_steps=14", "trainer.val_check_interval=14",
                 *emulate]
    second = train(quick_config(tmp_path / "second", overrides), extra_callbacks=[Capture()])
    assert second.steps == 14  # continued from step 10, not restarted
    assert [step for step, _ in second.val_history] == [14]  # Lightning skips the sanity check on resume
    saved = fuse_state["fp8_state"]
    assert (saved["forward.scale"] != 1.0).any() and (saved["backward.scale"] != 1.0).any()  # the scales moved
    tensors = [name for name, value in saved.items() if isinstance(value, torch.Tensor)]
    assert {"forward.scale", "forward.history", "backward.scale", "backward.history"} <= set(tensors)
    for name in tensors:
        assert torch.equal(restored["fp8_state"][name], saved[name]), name
    assert restored["decisions"] == fuse_state["decisions"]


def test_a_resumed_run_trains_on_what_the_uninterrupted_run_trains_on(tmp_path: Path) -> None:
    from lightning.pytorch import Callback

    class Batches(Callback):  # a fingerprint of every training batch, by optimizer step
        def __init__(self) -> None:
            self.seen: dict[int, int] = {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen[trainer.global_step] = int(batch[0].sum())

    # warm-up longer than the run: the learning-rate schedule does not depend on max_steps
    common = ["trainer.val_check_interval=3", "optimizer.warmup_steps=10", "fuse=null"]
    whole, first, second = Batches(), Batches(), Batches()
    uninterrupted = train(quick_config(tmp_path / "whole", ["trainer.max_steps=6", *common]), extra_callbacks=[whole])
    half = train(quick_config(tmp_path / "half", ["trainer.max_steps=3", *common]), extra_callbacks=[first])
    resumed = train(quick_config(tmp_path / "resumed", [f"resume_from={half.checkpoint_path}", "trainer.max_steps=6",
                                                        *common]), extra_callbacks=[second])
    assert {**first.seen, **second.seen} == whole.seen and sorted(second.seen) == [3, 4, 5]
    assert resumed.val_loss == pytest.approx(uninterrupted.val_loss, rel=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_crashed_run_resumes_from_the_last_ckpt_of_its_last_validation(tmp_path: Path, accumulate: int) -> None:
    # validations at optimizer steps 3 and 6 (val_check_interval counts micro-batches); the crash
    # comes at step 5, so only the checkpoint written at the validation of step 3 can resume the run
    common = ["trainer.max_steps=6", f"trainer.val_check_interval={3 * accumulate}",
              f"trainer.accumulate_grad_batches={accumulate}", "fuse=null"]
    whole, crashed, resumed = MicroBatches(), MicroBatches(), MicroBatches()
    uninterrupted = train(quick_config(tmp_path / "whole", common), extra_callbacks=[whole])
    assert [step for step, _ in uninterrupted.val_history] == [0, 3, 6]
    with pytest.raises(Crash):
        train(quick_config(tmp_path / "crashed", common), extra_callbacks=[crashed, CrashAtStep(5)])
    checkpoint = tmp_path / "crashed" / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file(), "no last.ckpt was written at the validation of step 3"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 3
    result = train(quick_config(tmp_path / "resumed", [f"resume_from={checkpoint}", *common]),
                   extra_callbacks=[resumed])
    assert [step for step, _ in result.val_history] == [6]
    assert resumed.seen[0][0] == 3 and len(whole.seen) == 6 * accumulate
    assert [batch for batch in crashed.seen if batch[0] < 3] + resumed.seen == whole.seen  # micro-batch for micro-batch
    assert result.val_loss == pytest.approx(uninterrupted.val_loss, rel=1e-6)


def test_a_validation_inside_a_gradient_accumulation_is_refused(tmp_path: Path) -> None:
    overrides = ["trainer.max_steps=2", "trainer.accumulate_grad_batches=2", "trainer.val_check_interval=3", "fuse=null"]
    expected = r"trainer\.val_check_interval=3 is not a multiple of trainer\.accumulate_grad_batches=2"
    with pytest.raises(ValueError, match=expected):
        train(quick_config(tmp_path, overrides))
    assert not (tmp_path / "checkpoints").exists()  # refused before any training


def test_a_resumed_run_sees_what_the_uninterrupted_run_sees_when_the_blocks_do_not_fill_the_last_batch(
    tmp_path: Path,
) -> None:
    # 10 blocks in batches of 3: only whole batches, so every epoch is [0, 1, 2], [3, 4, 5], [6, 7, 8]
    # warm-up longer than the run: the learning-rate schedule does not depend on max_steps
    common = ["data.train_blocks=10", "data.batch_size=3", "optimizer.warmup_steps=10", "fuse=null"]
    expected = [(step, [3 * (step % 3) + i for i in range(3)]) for step in range(8)]
    whole = SeenSamples()
    uninterrupted = train(quick_config(tmp_path / "whole", ["trainer.max_steps=8", "trainer.val_check_interval=8",
                                                            *common]), extra_callbacks=[whole])
    assert whole.seen == expected
    # stopped at the end of the first epoch (its last.ckpt written at the validation there, or after
    # fit when no validation is due), and inside the second
    for stop, interval in ((3, 3), (3, 8), (5, 5)):
        first, second = SeenSamples(), SeenSamples()
        half = train(quick_config(tmp_path / f"half{stop}-{interval}", [f"trainer.max_steps={stop}",
                                                                         f"trainer.val_check_interval={interval}",
                                                                         *common]),
                     extra_callbacks=[first])
        resumed = train(quick_config(tmp_path / f"resumed{stop}-{interval}", [f"resume_from={half.checkpoint_path}",
                                                                              "trainer.max_steps=8",
                                                                              "trainer.val_check_interval=8",
                                                                              *common]),
                        extra_callbacks=[second])
        assert first.seen + second.seen == expected, f"interrupted at step {stop}, validating every {interval}"
        assert resumed.val_loss == pytest.approx(uninterrupted.val_loss, rel=1e-6)


def test_a_run_resumed_with_a_longer_max_steps_follows_its_own_lr_schedule_from_the_first_step(tmp_path: Path) -> None:
    class LearningRates(Callback):  # the learning rate each optimizer step applies
        def __init__(self) -> None:
            self.lrs: dict[int, float] = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.lrs[trainer.global_step] = optimizer.param_groups[0]["lr"]

    common = ["optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "optimizer.warmup_steps=2", "fuse=null"]
    first, second = LearningRates(), LearningRates()
    half = train(quick_config(tmp_path / "half", ["trainer.max_steps=4", "trainer.val_check_interval=4", *common]),
                 extra_callbacks=[first])
    train(quick_config(tmp_path / "resumed", [f"resume_from={half.checkpoint_path}", "trainer.max_steps=10",
                                              "trainer.val_check_interval=10", *common]), extra_callbacks=[second])
    assert first.lrs == pytest.approx({step: 1e-3 * lr_multiplier(step, 2, 4, 0.1) for step in range(4)}, rel=1e-9)
    # the resumed run's own schedule (a cosine to step 10), already at its first step
    assert second.lrs == pytest.approx({step: 1e-3 * lr_multiplier(step, 2, 10, 0.1) for step in range(4, 10)},
                                       rel=1e-9)


def test_the_summary_val_loss_is_the_mean_over_tokens_not_over_batches(tmp_path: Path) -> None:
    class TokenMean(Callback):  # each validation's loss recomputed directly, over every val token at once
        def __init__(self) -> None:
            self.rows: list[tuple[float, float, float]] = []  # (summary, token mean, mean of batch means)

        def on_validation_end(self, trainer, pl_module):  # after the module's on_validation_epoch_end
            dataset = trainer.datamodule.val_dataset
            x, y = (torch.stack(parts) for parts in zip(*(dataset[i] for i in range(len(dataset)))))
            with torch.no_grad():
                losses = F.cross_entropy(pl_module(x).flatten(0, 1), y.flatten(), reduction="none").view(len(x), -1)
            batch_means = [losses[i : i + 4].mean() for i in range(0, len(x), 4)]  # batches of 4, 4, 2
            self.rows.append((pl_module.val_history[-1][1], losses.mean().item(), torch.stack(batch_means).mean().item()))

    probe = TokenMean()
    overrides = ["data.val_blocks=10", "data.batch_size=4", "trainer.limit_val_batches=3", "trainer.max_steps=4",
                 "trainer.val_check_interval=4", "fuse=null"]
    result = train(quick_config(tmp_path, overrides), extra_callbacks=[probe])
    assert [step for step, _ in result.val_history] == [0, 4] and len(probe.rows) == 2
    for logged, token_mean, mean_of_batch_means in probe.rows:
        assert abs(token_mean - mean_of_batch_means) > 1e-4  # the batches differ enough to tell them apart
        assert logged == pytest.approx(token_mean, rel=1e-6, abs=0)


@pytest.mark.parametrize(("limit", "batches"), [("0.5", 4), ("1.0", 8), ("3", 3)])
def test_the_sanity_check_runs_the_validation_batches(tmp_path: Path, limit: str, batches: int) -> None:
    class Count(Callback):
        def __init__(self) -> None:
            self.sanity = self.validation = 0

        def on_validation_batch_end(self, trainer, *args):
            if trainer.sanity_checking:
                self.sanity += 1
            else:
                self.validation += 1

    count = Count()
    # 32 validation blocks in batches of 4: 8 batches
    overrides = [f"trainer.limit_val_batches={limit}", "data.val_blocks=32", "data.batch_size=4",
                 "trainer.max_steps=2", "trainer.val_check_interval=2", "fuse=null"]
    result = train(quick_config(tmp_path, overrides), extra_callbacks=[count])
    assert [step for step, _ in result.val_history] == [0, 2]
    assert (count.sanity, count.validation) == (batches, batches)


def test_a_run_without_scheduled_validation_still_ends_with_one(tmp_path: Path) -> None:
    result = train(quick_config(tmp_path, ["trainer.max_steps=5", "trainer.num_sanity_val_steps=0", "fuse=null"]))
    assert [step for step, _ in result.val_history] == [5] and math.isfinite(result.val_loss)
    assert torch.load(result.checkpoint_path, weights_only=True)["global_step"] == 5


def test_the_logged_tokens_per_sec_leaves_out_the_warm_up_as_the_summary_does(tmp_path: Path) -> None:
    from lightning.pytorch import Callback

    class Logged(Callback):
        def on_train_end(self, trainer, pl_module):
            self.value = trainer.callback_metrics["train/tokens_per_sec"].item()

    logged = Logged()
    # 6 steps, 2 of warm-up, a window of 10: the last logged window holds exactly the summary's steps
    result = train(quick_config(tmp_path, ["trainer.max_steps=6", "trainer.val_check_interval=6", "fuse=null"]),
                   extra_callbacks=[logged])
    assert logged.value == pytest.approx(result.tokens_per_sec, rel=1e-5)


def test_a_misspelt_recipe_field_names_the_valid_ones() -> None:
    import hydra.errors
    import hydra.utils

    cfg = compose_config(["+fuse.recipe.amax_histroy_len=16", "output_dir=/tmp/unused"])
    # Hydra wraps the callback's ValueError; without `_recursive_: false` it was a bare TypeError of
    # DelayedScaling.__init__ naming no valid field
    with pytest.raises(hydra.errors.InstantiationException, match=r"unknown DelayedScaling field\(s\) \['amax_histroy_len'\]; valid fields"):
        hydra.utils.instantiate(cfg.fuse)
    callback = hydra.utils.instantiate(compose_config(["fuse.recipe.amax_history_len=16", "fuse.convert=all",
                                                       "output_dir=/tmp/unused"]).fuse)
    assert callback.recipe.amax_history_len == 16 and callback.fuse_config.convert == "all"


def test_missing_resume_from_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"resume_from='.*gone\.ckpt' is not a file.*Expected a checkpoint"):
        train(quick_config(tmp_path, [f"resume_from={tmp_path / 'gone.ckpt'}", "fuse=null"]))


def test_init_from_a_local_hf_directory(tmp_path: Path, fuse: list[str]) -> None:
    hf_dir = save_tiny_hf_gpt2(tmp_path / "hf")
    results = {
        source: train(quick_config(tmp_path / source, [f"init_from={hf_dir}", f"model.source={source}", *SHORT, *fuse]))
        for source in ("native", "hf")
    }
    # both sources start from the same weights, so they see the same loss at init
    assert results["native"].val_loss_init == pytest.approx(results["hf"].val_loss_init, abs=1e-4)
    for result in results.values():
        assert result.val_loss < result.val_loss_init


# -----------------------------------------------------------------------------------------------
# bad input: clear errors, before any training


def test_missing_data_path_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_corpus.txt"
    expected = r"data\.path='.*no_such_corpus\.txt' does not exist.*Expected a text file"
    with pytest.raises(FileNotFoundError, match=expected):
        train(quick_config(tmp_path, [f"data.path={missing}", "fuse=null"]))


def test_folder_without_matching_files_names_the_glob(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("not a .py file")
    with pytest.raises(FileNotFoundError, match=r"no file in it matches data\.glob='\*\*/\*\.py'"):
        train(quick_config(tmp_path, [f"data.path={tmp_path}", "fuse=null"]))


def test_missing_tokenizer_directory_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data\.tokenizer='.*no_tokenizer' is not a directory"):
        train(quick_config(tmp_path, [f"data.tokenizer={tmp_path / 'no_tokenizer'}", "fuse=null"]))


def test_missing_init_from_names_it_and_what_was_expected(tmp_path: Path) -> None:
    missing = tmp_path / "gone" / "last.ckpt"
    with pytest.raises(FileNotFoundError, match=r"init_from='.*gone/last\.ckpt' does not exist.*Expected 'scratch'"):
        train(quick_config(tmp_path, [f"init_from={missing}", "fuse=null"]))
    assert not (tmp_path / "checkpoints").exists()


def test_init_from_a_folder_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"neither a \.ckpt file nor a directory with config\.json"):
        train(quick_config(tmp_path, [f"init_from={tmp_path / 'empty'}", "fuse=null"]))


def test_unknown_model_source_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.source='jax'; expected one of \('native', 'hf'\)"):
        train(quick_config(tmp_path, ["model.source=jax", "fuse=null"]))


def test_the_summary_says_why_a_figure_is_missing():
    # A run of 2 steps measures no speed (its first steps are left out); a resumed run has no
    # validation before its first step: the summary says so instead of printing nan.
    result = TrainResult(train_loss=4.5, val_loss=3.9, val_loss_init=float("nan"), val_history=[],
                         tokens_per_sec=float("nan"), steps=2, checkpoint_path="last.ckpt")
    text = summary(result, warmup_steps=TokensPerSecond().warmup_steps)
    assert "nan" not in text
    assert "tokens/s not measured (the first 2 steps of a run are left out)" in text
    assert "(no validation before the first step of this run)" in text
    measured = summary(TrainResult(4.5, 3.9, 5.3, [], 1234.4, 60, "last.ckpt"))
    assert "val loss 3.9000 (at init 5.3000) | 1,234 tokens/s" in measured
