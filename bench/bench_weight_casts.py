#!/usr/bin/env python3
"""Time saved by casting each weight to bfloat16 once per training step, against LibTorch's autocast alone.

Under autocast (float32 parameters, bfloat16 compute, no FSDP) LibTorch keeps a weight's bfloat16 copy only until
the forward ends: every micro-batch's forward casts every weight again, and activation checkpointing casts it once
more in backward. titan keeps the copies over the whole step (training.autocast_weight_casts = "step", the default); the peer here
is the same binary with --training.autocast_weight_casts forward (LibTorch's behaviour), run interleaved, fresh process each.
Prints tokens/s (median of the steps after the first, median over repeats) and peak memory per layout, and the
ratio. The printed losses (every step of the last repeat, as the log rounds them) should agree; the script says
so when they do not (tests/unit/test_trainer.cpp checks them bit for bit). Never passes or fails on time.

usage: bench/bench_weight_casts.py [--flavor 100M] [--seq 512] [--repeats 2] [--steps 5]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"step: +(\d+) +loss: +([\d.]+) .*?memory: +([\d.]+)GiB.*?tps: ([\d,]+)")
LAYOUTS = {  # name -> (local batch, global batch, activation checkpointing)
    "1 micro-batch, no AC": (4, 4, ["--activation_checkpoint.mode", "none"]),
    "1 micro-batch, full AC": (4, 4, ["--activation_checkpoint.mode", "full"]),
    "4 micro-batches, no AC": (1, 4, ["--activation_checkpoint.mode", "none"]),
    "4 micro-batches, full AC": (1, 4, ["--activation_checkpoint.mode", "full"]),
}


def run(layout, casts, args):
    local, global_batch, ac = LAYOUTS[layout]
    binary = os.environ.get("TITAN_BIN", str(ROOT / "build" / "bin" / "titan"))
    with tempfile.TemporaryDirectory() as dump:
        cmd = [binary, "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--model.flavor", args.flavor,
               "--job.dump_folder", dump, "--training.steps", str(args.steps), "--training.seq_len", str(args.seq),
               "--training.local_batch_size", str(local), "--training.global_batch_size", str(global_batch),
               "--metrics.log_freq", "1", "--training.mixed_precision_param", "bfloat16",
               "--training.autocast_weight_casts", casts, *ac]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, NO_COLOR="1"))
    if out.returncode != 0:
        sys.exit(f"titan failed ({' '.join(cmd)}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    steps = [(int(s), l, float(m), float(t.replace(",", ""))) for s, l, m, t in STEP.findall(out.stdout)]
    if not steps:
        sys.exit(f"no step lines in titan's output:\n{out.stdout[-3000:]}")
    later = [t for s, _, _, t in steps if s > 1] or [steps[-1][3]]
    return statistics.median(later), max(m for _, _, m, _ in steps), [l for _, l, _, _ in steps]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="100M")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"{args.flavor}, 4 x {args.seq} tokens per step, bfloat16 autocast, {args.steps} steps, {args.repeats} repeats, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"{'layout':<26} {'once per step':>22} {'every forward':>22} {'ratio':>6}")
    for layout in LAYOUTS:
        tps = {"step": [], "forward": []}
        peak, losses = {}, {}
        for _ in range(args.repeats):
            for casts in ("step", "forward"):
                t, m, l = run(layout, casts, args)
                tps[casts].append(t)
                peak[casts] = max(peak.get(casts, 0), m)
                losses[casts] = l
        once, every = statistics.median(tps["step"]), statistics.median(tps["forward"])
        same = "" if losses["step"] == losses["forward"] else "  LOSSES DIFFER: " + f"{losses['step']} vs {losses['forward']}"
        print(f"{layout:<26} {once:>8,.0f} tok/s {peak['step']:5.2f} GiB {every:>8,.0f} tok/s {peak['forward']:5.2f} GiB "
              f"{once / every:>5.2f}x{same}")


if __name__ == "__main__":
    main()
