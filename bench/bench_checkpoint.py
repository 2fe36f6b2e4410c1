#!/usr/bin/env python3
"""Checkpoint speed: save and load times and MB/s of titan's checkpoints for the debug model and the ~100M
"100M" flavor, against the disk's raw sequential write speed measured here with dd (fdatasync), and, for
asynchronous saves, how long the training loop is blocked per save. Prints figures and ratios; never fails on
time.

usage: bench/bench_checkpoint.py [--ranks 1] [--dump /tmp/titan_ckpt_bench]
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("TITAN_BIN_DIR", ROOT / "build" / "bin"))


def dd_write_mb_s(folder):
    path = Path(folder) / "dd.bin"
    out = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=512", "conv=fdatasync"],
                         capture_output=True, text=True)
    path.unlink(missing_ok=True)
    m = re.search(r"([\d.]+) ([MG])B/s", out.stderr)
    return float(m.group(1)) * (1000 if m.group(2) == "G" else 1)


def train(dump, flavor, steps, ranks, extra=()):
    cmd = [str(BIN / "titan"), "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"),
           "--job.dump_folder", str(dump), "--model.flavor", flavor, "--training.seq_len", "32",
           "--training.local_batch_size", "1", "--training.steps", str(steps), "--checkpoint.enable",
           "--checkpoint.interval", "1", "--checkpoint.no_last_save_model_only", "--checkpoint.keep_latest_k", "0",
           "--metrics.disable_color_printing", "--activation_checkpoint.mode", "none", *extra]
    if ranks > 1:
        cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(ranks),
               *cmd, "--parallelism.data_parallel_shard_degree", str(ranks)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1" if ranks > 1 else "2"))
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--dump", default=None, help="folder on the disk to measure (default: a temporary folder)")
    args = parser.parse_args()
    base = Path(args.dump or tempfile.mkdtemp(prefix="titan_ckpt_bench_"))
    base.mkdir(parents=True, exist_ok=True)
    raw = dd_write_mb_s(base)
    print(f"disk: dd sequential write with fdatasync {raw:,.0f} MB/s ({base})")
    print(f"{'flavor':12} {'mode':8} {'MB':>8} {'save s':>8} {'save MB/s':>10} {'vs dd':>6} {'load s':>8} {'load MB/s':>10} {'blocked s':>10}")
    for flavor in ("debugmodel", "100M"):
        for mode in ("disabled", "async"):
            dump = base / f"{flavor}_{mode}"
            shutil.rmtree(dump, ignore_errors=True)
            out = train(dump, flavor, 3, args.ranks, ["--checkpoint.async_mode", mode])
            saves = [(float(m.group(1)), float(m.group(2))) for m in
                     re.finditer(r"Saved checkpoint .*?: ([\d.]+) MB in ([\d.]+) s", out)]
            blocked = [float(x) for x in re.findall(r"training blocked ([\d.]+) s", out)]
            mb, seconds = saves[-1]
            load_out = train(dump, flavor, 4, args.ranks, ["--checkpoint.async_mode", mode])
            load_s = float(re.search(r"Loaded checkpoint .* in ([\d.]+) s", load_out).group(1))
            block = f"{sum(blocked) / len(blocked):10.3f}" if blocked else f"{seconds:10.3f}"
            print(f"{flavor:12} {mode:8} {mb:8.1f} {seconds:8.2f} {mb / seconds:10.0f} {mb / seconds / raw:6.2f} "
                  f"{load_s:8.2f} {mb / load_s:10.0f} {block}")
            shutil.rmtree(dump, ignore_errors=True)
    if not args.dump:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
