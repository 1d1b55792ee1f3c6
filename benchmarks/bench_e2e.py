"""End-to-end benchmark (GPU): examples/gpt_finetune.py's GPT under Lightning ``bf16-mixed``,
without the callback vs with it (FP8 + fused backward), same model and data.

For each d in {768, 1600, 2048, 4096} (configs/experiment/gpt_d*.yaml, sequence 1024, 16384
tokens per step) it runs ``--steps`` optimizer steps each way and reports tokens/s after the
warm-up steps. With ``--parity-steps N`` it also runs d=1600 for N steps both ways with validation
and writes both validation losses and the overlaid training-loss curves (PNG). With
``--profile-steps N`` it profiles N steps of each run after warm-up and writes where the GPU time
went (``profile.csv``: device ms per step by kernel category, and the GPU's idle time).

    python benchmarks/bench_e2e.py --out results/e2e --steps 30 --parity-steps 200
    python benchmarks/bench_e2e.py --dims 2048 --steps 12 --profile-steps 3 --out results/e2e_profile
    python benchmarks/bench_e2e.py --dims 768 --repeats 3 --out results/e2e_768   # pairs in turn, median

With ``--repeats N`` each size runs N (bf16, fused) pairs in turn; the speedup is the median of the
pairs' ratios, with their range and the bf16 runs' spread beside it.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from hydra import compose, initialize_config_dir  # noqa: E402

from common import environment, print_table, write_results  # noqa: E402
from gpt_finetune import train  # noqa: E402
from step_profile import StepProfile  # noqa: E402

EXPERIMENTS = {768: "gpt_d768", 1600: "gpt2_xl_fp8", 2048: "gpt_d2048", 4096: "gpt_d4096"}


def run(d: int, fused: bool, steps: int, out_dir: Path, validate: bool, extra: list[str], callbacks=()):
    overrides = [f"experiment={EXPERIMENTS[d]}", f"trainer.max_steps={steps}", f"output_dir={out_dir}",
                 "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                 "trainer.enable_checkpointing=false", *extra]
    if not fused:
        overrides = [o for o in overrides if not o.startswith("fuse.")] + ["fuse=null"]
    if validate:
        overrides += [f"trainer.val_check_interval={steps}", "trainer.limit_val_batches=16"]
    else:
        overrides += ["trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    return train(cfg, extra_callbacks=callbacks)


def train_losses(out_dir: Path) -> list[tuple[int, float]]:
    """``(step, train loss)`` from the run's CSV log."""
    rows = []
    for path in sorted(out_dir.glob("csv/version_*/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                loss = row.get("train/loss") or row.get("train_loss") or row.get("loss")
                if loss:
                    rows.append((int(row["step"]), float(loss)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/e2e")
    parser.add_argument("--dims", default="768,1600,2048,4096")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--parity-steps", type=int, default=0)
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many steps of each run (0: off)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each pair (bf16, then fused) this many times in turn; report medians and the spread")
    parser.add_argument("--convert", default="all", choices=["chains", "mlp", "all"],
                        help="which linears the callback makes FP8 (fuse.convert; its measurement reverts the slower)")
    args = parser.parse_args()
    print(environment())
    rows, profiles = [], []
    work = Path(tempfile.mkdtemp())
    convert = [f"fuse.convert={args.convert}"]
    for d in [int(v) for v in args.dims.split(",")]:
        row = {"d": d, "convert": args.convert}
        measured = {False: [], True: []}
        for repeat, fused in itertools.product(range(args.repeats), (False, True)):  # interleaved: drift hits both
            profile = [StepProfile(start=min(5, args.steps - args.profile_steps), steps=args.profile_steps)] \
                if args.profile_steps and repeat == 0 else []
            result = run(d, fused, args.steps, work / f"d{d}_{fused}_{repeat}", False, convert, profile)
            measured[fused].append(result.tokens_per_sec)
            if profile and profile[0].per_step_ms:
                variant = "fused" if fused else "bf16"
                profiles += [{"d": d, "run": variant, "category": k, "ms_per_step": v}
                             for k, v in profile[0].per_step_ms.items()]
                write_results(args.out, "profile", profiles)
                write_results(args.out, f"kernels_d{d}_{variant}",
                              [{"kernel": k, "ms_per_step": v} for k, v in profile[0].kernels[:60]])
        row["bf16_tok_s"] = statistics.median(measured[False])
        row["fused_tok_s"] = statistics.median(measured[True])
        ratios = [f / b for b, f in zip(measured[False], measured[True])]  # each fused run over the bf16 run before it
        row["speedup"] = statistics.median(ratios)
        if args.repeats > 1:
            row["speedup_min"], row["speedup_max"] = min(ratios), max(ratios)
            row["bf16_spread"] = max(measured[False]) / min(measured[False]) - 1
        rows.append(row)
        print_table(rows[-1:], list(row))
        write_results(args.out, "e2e", rows)
    print_table(rows, list(rows[0]))
    if profiles:
        table = {}
        for p in profiles:
            table.setdefault(p["category"], {"category": p["category"]})[f"d{p['d']} {p['run']}"] = p["ms_per_step"]
        print_table(list(table.values()), ["category"] + sorted({f"d{p['d']} {p['run']}" for p in profiles}))
    if args.parity_steps:
        curves, parity = {}, []
        for fused in (False, True):
            out = work / f"parity_{fused}"
            result = run(1600, fused, args.parity_steps, out, True, convert)
            label = "lightning-fuse FP8" if fused else "bf16-mixed"
            curves[label] = train_losses(out)
            parity.append({"run": label, "steps": result.steps, "val_loss": result.val_loss,
                           "train_loss": result.train_loss, "tokens_per_sec": result.tokens_per_sec})
        parity.append({"run": "relative val loss difference", "steps": args.parity_steps,
                        "val_loss": parity[1]["val_loss"] / parity[0]["val_loss"] - 1, "train_loss": float("nan"),
                        "tokens_per_sec": parity[1]["tokens_per_sec"] / parity[0]["tokens_per_sec"]})
        write_results(args.out, "parity", parity)
        print_table(parity, list(parity[0]))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for label, points in curves.items():
            if points:
                steps, losses = zip(*points)
                ax.plot(steps, losses, label=label, lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.set_title(f"GPT d=1600, seq 1024: {args.parity_steps} steps")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(args.out) / "parity.png", dpi=120)


if __name__ == "__main__":
    main()
