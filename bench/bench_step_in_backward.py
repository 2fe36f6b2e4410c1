#!/usr/bin/env python3
"""optimizer.early_step_in_backward against the ordinary step on the same job: each layout (one process, FSDP 2,
DDP 2) trains the 100M flavor on a few of its blocks twice, once stepping every parameter during backward and once
after it, and prints both runs' peak memory (the step line's `memory`, the most over the steps), the estimate the
trainer printed at start-up, tokens/s, and the ratios early / ordinary. Figures and ratios only; never fails on time.

The saving is at most one copy of this rank's gradients: it shows where parameters and optimizer state outweigh the
activations (small micro-batches of a large model). Both runs leave gradients unclipped (the ordinary one with a
max_norm no norm reaches), so they train the same.

usage: bench/bench_step_in_backward.py [--layers 4] [--batch 1] [--seq-len 256] [--steps 4]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("TITAN_BIN_DIR", str(ROOT / "build" / "bin")))
LAYOUTS = {
    "one process": (1, []),
    "FSDP 2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "DDP 2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree", "2"]),
}


def train(args, ranks, layout, early):
    mpi = [] if ranks == 1 else ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(ranks)]
    with tempfile.TemporaryDirectory() as dump:
        cmd = mpi + [str(BIN / "titan"), "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"),
                     "--job.dump_folder", dump, "--metrics.disable_color_printing", "--metrics.log_freq", "1",
                     "--model.flavor", "100M", "--model.n_layers", str(args.layers), "--training.local_batch_size", str(args.batch),
                     "--training.seq_len", str(args.seq_len), "--training.steps", str(args.steps),
                     "--activation_checkpoint.mode", "none", "--training.max_norm", "1e9", *layout]
        if early:
            cmd.append("--optimizer.early_step_in_backward")
        threads = str(max(1, (os.cpu_count() or 1) // ranks))
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=threads))
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    peak = max(float(x) for x in re.findall(r"step: +\d+ .*memory: +([\d.]+)GiB", out.stdout))
    m = re.search(r"Memory estimate for this rank: .*: ([\d.]+) (GiB|MiB) of", out.stdout)
    estimate = float(m.group(1)) / (1 if m.group(2) == "GiB" else 1024)
    tps = [float(x.replace(",", "")) for x in re.findall(r"tps: ([\d,]+)", out.stdout)][1:]  # step 1 warms up
    return {"peak": peak, "estimate": estimate, "tps": sum(tps) / len(tps)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"100M flavor, {args.layers} blocks, {args.batch} x {args.seq_len} tokens per rank, {args.steps} steps, no AC")
    print(f"{'layout':<12} {'peak GiB':>18} {'estimate GiB':>18} {'tokens/s per rank':>20} {'peak ratio':>11} {'tps ratio':>10}")
    for name, (ranks, layout) in LAYOUTS.items():
        plain, early = train(args, ranks, layout, False), train(args, ranks, layout, True)
        print(f"{name:<12} {plain['peak']:>8.2f} -> {early['peak']:<7.2f} {plain['estimate']:>8.2f} -> {early['estimate']:<7.2f} "
              f"{plain['tps']:>9,.0f} -> {early['tps']:<8,.0f} {early['peak'] / plain['peak']:>11.2f} {early['tps'] / plain['tps']:>10.2f}")


if __name__ == "__main__":
    main()
