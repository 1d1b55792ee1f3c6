"""Several GPUs: the GPT example's GPU preset under DDP or FSDP, one configuration per invocation.

Lightning starts one process per device and runs this script again in each, so every invocation
is a single run. Each rank writes ``rank<N>.json`` under ``--out``:

- which modules it fused, the ``auto`` benchmark's decisions and speedups;
- the FP8 scales after every optimizer step (exact values), and the training losses;
- tokens/s of the whole run (all devices together);
- the names of the FP8 modules as the strategy's wrapped model holds them (inside the FSDP units);
- with ``--resume-check``: a checkpoint (sharded under FSDP) is saved at the end, a second run
  resumes from it for two more steps, and whether every FP8 tensor came back identical to the
  saved (rank 0's) state.

``--summarize DIR`` reads every run under DIR and prints: ranks agree on chains and decisions,
the largest scale difference across ranks at any step (amaxes are all-reduced before each update,
so it must be 0), the final loss against the one-device run, and tokens/s against it.

    python bench_multi_gpu.py --devices 1 --out results/multi/gpu1_fused
    python bench_multi_gpu.py --devices 1 --no-fuse --out results/multi/gpu1_bf16
    python bench_multi_gpu.py --devices 2 --strategy ddp --out results/multi/gpu2_ddp_fused
    python bench_multi_gpu.py --devices 2 --strategy ddp --no-fuse --out results/multi/gpu2_ddp_bf16
    python bench_multi_gpu.py --devices 2 --strategy fsdp --resume-check --out results/multi/gpu2_fsdp_fused
    python bench_multi_gpu.py --summarize results/multi

The global batch stays the preset's (``data.batch_size`` per step): each of N devices gets 1/N.
``--accelerator cpu --experiment none --emulate --benchmark off`` runs the tiny preset in CPU
processes (gloo) with FP8 emulated and kept on, a dry run of the DDP path; Lightning refuses FSDP on
CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from hydra import compose, initialize_config_dir  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from common import print_table  # noqa: E402
from gpt_finetune import train  # noqa: E402
from lightning_fuse import FusedBackwardCallback  # noqa: E402
from lightning_fuse.modules import FP8LinearBase  # noqa: E402


def _fuse_callback(trainer) -> FusedBackwardCallback | None:
    found = [c for c in trainer.callbacks if isinstance(c, FusedBackwardCallback)]
    return found[0] if found else None


def _fp8_tensors(callback: FusedBackwardCallback) -> dict[str, torch.Tensor]:
    state = callback.state.state_dict() if callback.state is not None else {}
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


class RankRecorder(Callback):
    """What one rank did, written to ``rank<N>.json`` at the end of training."""

    def __init__(self, out: Path, tag: str) -> None:
        self.out, self.tag = out, tag
        self.losses: list[float] = []
        self.scales: list[list[float]] = []  # per optimizer step: forward then backward scales
        self.final_fp8: dict[str, torch.Tensor] = {}
        self.record: dict[str, Any] = {}
        self._last_step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        callback = _fuse_callback(trainer)
        if trainer.global_step != self._last_step and callback is not None and callback.state is not None:
            self._last_step = trainer.global_step
            groups = callback.state.groups
            self.scales.append([float(v) for g in ("forward", "backward") if g in groups
                                for v in groups[g].scale.detach().cpu().flatten()])

    def on_train_end(self, trainer, pl_module) -> None:
        callback = _fuse_callback(trainer)
        wrapped = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        self.record = {
            "tag": self.tag, "rank": trainer.global_rank, "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__, "steps": trainer.global_step,
            "fused": {n: m.fused for n, m in pl_module.named_modules() if isinstance(m, FP8LinearBase)},
            "decisions": dict(callback.decisions) if callback else {},
            "speedups": {k: float(v) for k, v in callback.speedups.items()} if callback else {},
            "fp8_modules_in_wrapped_model": [n for n, m in wrapped.named_modules() if isinstance(m, FP8LinearBase)],
            "losses": self.losses, "scales": self.scales,
        }
        if callback is not None:
            self.final_fp8 = {k: v.clone() for k, v in _fp8_tensors(callback).items()}

    def write(self, extra: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"rank{self.record['rank']}.json"
        path.write_text(json.dumps({**self.record, **extra}, indent=1))


class ResumedState(Callback):
    """The FP8 tensors of the fuse callback as a resumed run starts, before any new step."""

    def __init__(self) -> None:
        self.fp8: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        callback = _fuse_callback(trainer)
        if callback is not None:
            self.fp8 = {k: v.clone() for k, v in _fp8_tensors(callback).items()}


def config(args, steps: int, out: Path, resume_from: str | None = None):
    overrides = [f"trainer.max_steps={steps}", f"output_dir={out}", "trainer.enable_progress_bar=false",
                 "trainer.enable_model_summary=false", f"trainer.devices={args.devices}",
                 f"trainer.accelerator={args.accelerator}"]
    if args.experiment != "none":
        overrides.insert(0, f"experiment={args.experiment}")
    if args.no_fuse:
        overrides.append("fuse=null")
    else:
        overrides.append(f"fuse.benchmark={args.benchmark}")
        if args.emulate:
            overrides.append("fuse.emulate=true")
    if args.resume_check:  # one validation at the last step writes checkpoints/last.ckpt
        overrides += [f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=2",
                      "trainer.num_sanity_val_steps=0", "trainer.enable_checkpointing=true"]
    else:
        overrides += ["trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0",
                      "trainer.enable_checkpointing=false"]
    if resume_from:
        overrides.append(f"resume_from={resume_from}")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with open_dict(cfg):
        global_batch = cfg.data.batch_size
        if global_batch % args.devices:
            raise ValueError(f"the preset's global batch {global_batch} does not split over {args.devices} devices")
        cfg.data.batch_size = global_batch // args.devices
        if args.strategy == "fsdp":
            # sharded checkpoints: each rank saves and loads its own shard
            cfg.trainer.strategy = {"_target_": "lightning.pytorch.strategies.FSDPStrategy",
                                    "state_dict_type": "sharded"}
        elif args.devices > 1:
            cfg.trainer.strategy = args.strategy
    return cfg


def run(args) -> None:
    out = Path(args.out)
    recorder = RankRecorder(out, out.name)
    result = train(config(args, args.steps, out / "run"), extra_callbacks=[recorder])
    extra: dict[str, Any] = {"tokens_per_sec": result.tokens_per_sec, "train_loss": result.train_loss}
    if args.resume_check:
        if not result.checkpoint_path:
            raise RuntimeError(f"the first run wrote no checkpoint under {out / 'run'}")
        # The checkpoint holds rank 0's FP8 state (Lightning saves callback state from rank 0), and
        # every rank resumes from it: each rank compares what it resumed with rank 0's final state.
        # (Ranks differ only in the newest amax slot before its all-reduce: validation fills it locally.)
        torch.save(recorder.final_fp8, out / f"final_fp8_rank{recorder.record['rank']}.pt")
        resumed = ResumedState()
        second = train(config(args, args.steps + 2, out / "resumed", result.checkpoint_path),
                       extra_callbacks=[resumed])
        saved = torch.load(out / "final_fp8_rank0.pt", weights_only=True)  # written before run 2's collectives
        differ = sorted(k for k in set(saved) | set(resumed.fp8)
                        if k not in saved or k not in resumed.fp8 or not torch.equal(saved[k], resumed.fp8[k]))
        extra.update(checkpoint=result.checkpoint_path, resumed_steps=second.steps, fp8_state_restored=not differ,
                     fp8_tensors_compared=len(saved), fp8_tensors_differing=differ)
    recorder.write(extra)


def summarize(directory: Path) -> list[dict[str, Any]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(directory.glob("*/rank*.json")):
        runs.setdefault(path.parent.name, []).append(json.loads(path.read_text()))
    single = {tag: ranks[0] for tag, ranks in runs.items() if ranks[0]["world_size"] == 1}
    rows = []
    for tag, ranks in sorted(runs.items()):
        first = ranks[0]
        fused = "bf16" not in tag
        # the one-device run of the same kind (fused or not) is the reference
        reference = next((r for t, r in single.items() if ("bf16" in t) != fused), None)
        steps = min(len(r["scales"]) for r in ranks)
        scale_diff = max((abs(a - b) for i in range(steps) for r in ranks[1:]
                          for a, b in zip(first["scales"][i], r["scales"][i])), default=0.0)
        row = {
            "run": tag, "strategy": first["strategy"], "devices": first["world_size"],
            "ranks_reported": len(ranks),
            "same_chains": all(r["fused"] == first["fused"] for r in ranks),
            "same_decisions": all(r["decisions"] == first["decisions"] for r in ranks),
            "fp8_modules": len(first["fused"]), "fp8_in_wrapped": len(first["fp8_modules_in_wrapped_model"]),
            "max_scale_diff": scale_diff, "train_loss": first["train_loss"],
            "tokens_per_sec": first["tokens_per_sec"],
        }
        if reference is not None:
            row["loss_vs_1dev"] = first["train_loss"] / reference["train_loss"] - 1
            row["speed_vs_1dev"] = first["tokens_per_sec"] / reference["tokens_per_sec"]
        if "fp8_state_restored" in first:
            row["resume_fp8_restored"] = all(r.get("fp8_state_restored") for r in ranks)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/multi/run")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--experiment", default="gpt_d2048", help="a configs/experiment preset, or none")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-fuse", action="store_true", help="train without the callback (bf16-mixed only)")
    parser.add_argument("--benchmark", default="auto", choices=["off", "log", "auto"],
                        help="the callback's benchmark mode (fuse.benchmark); off keeps every module in FP8")
    parser.add_argument("--emulate", action="store_true", help="FP8 on CPU too (fuse.emulate; for the CPU dry run)")
    parser.add_argument("--resume-check", action="store_true", help="save, resume and compare the FP8 state")
    parser.add_argument("--summarize", metavar="DIR", help="compare the runs written under DIR and stop")
    args = parser.parse_args()
    if args.summarize:
        rows = summarize(Path(args.summarize))
        if not rows:
            raise SystemExit(f"no rank*.json under {args.summarize}/*/")
        Path(args.summarize, "summary.json").write_text(json.dumps(rows, indent=1))
        print_table(rows, list(dict.fromkeys(k for r in rows for k in r)))
        return
    run(args)


if __name__ == "__main__":
    main()
