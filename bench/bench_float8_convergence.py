#!/usr/bin/env python3
"""Does float8 leave the loss curve unchanged? The same training run (same seed, data and schedule) in bf16 autocast
and with float8 linears for each recipe (emulated on a CPU: float8 values, float32 matmuls), and the loss of each
float8 run against the bf16 run's: per step, and as the mean of the last 10 steps. The output projection stays in
high precision (torchtitan's float8 TOMLs filter it). Prints a table every 25 steps and the seconds per step of each
run (emulated float8 is slower than bf16 on a CPU, docs/float8.md). Never passes or fails.

On a slow CPU the runs take hours (the 100M flavor at 2 x 256 tokens: about 16 s per bf16 step on a 2-core AVX2
EPYC, emulated float8 slower still). With --results FILE each finished run's losses are saved there (JSON, keyed by
flavor, shape, steps and run), and a run already in the file is read back instead of trained again, so the
comparison can be built one run at a time: --recipes "" trains the bf16 run alone.

usage: bench/bench_float8_convergence.py [--flavor 100M] [--steps 200] [--batch 2] [--seq 512]
                                         [--recipes tensorwise,rowwise,rowwise_with_gw_hp] [--mx] [--float32]
                                         [--results FILE]
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"step: +(\d+) +loss: +([\d.]+)")


def train(args, extra):
    binary = os.environ.get("TITAN_BIN", str(ROOT / "build" / "bin" / "titan"))
    with tempfile.TemporaryDirectory() as dump:
        cmd = [binary, "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--model.flavor", args.flavor,
               "--job.dump_folder", dump, "--training.steps", str(args.steps), "--training.seq_len", str(args.seq),
               "--training.local_batch_size", str(args.batch), "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps",
               str(max(1, args.steps // 10)), "--training.mixed_precision_param", "bfloat16", "--debug.seed", "0",
               "--activation_checkpoint.mode", "none", *extra]
        start = time.time()
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, NO_COLOR="1"))
        seconds = time.time() - start
    if out.returncode != 0:
        sys.exit(f"titan failed ({' '.join(cmd)}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    losses = {int(s): float(l) for s, l in STEP.findall(out.stdout)}
    if len(losses) != args.steps:
        sys.exit(f"expected {args.steps} step lines, got {len(losses)}:\n{out.stdout[-3000:]}")
    return [losses[s] for s in sorted(losses)], seconds / args.steps


def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def cached_train(args, name, extra):
    """train(), or the run's saved result from --results (and saved there when trained)."""
    key = f"{args.flavor} {args.batch}x{args.seq} {args.steps} steps {name}"
    path = Path(args.results) if args.results else None
    saved = json.loads(path.read_text()) if path and path.exists() else {}
    if key in saved:
        entry = saved[key]
        print(f"{name}: read from {path} (trained {entry['date']} by commit {entry.get('commit', '?')} on {entry['cpu']}; "
              f"its seconds per step are that machine's)", flush=True)
        return saved[key]["losses"], saved[key]["seconds_per_step"]
    losses, seconds = train(args, extra)
    if path:
        saved = json.loads(path.read_text()) if path.exists() else {}
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        saved[key] = {"losses": losses, "seconds_per_step": seconds, "date": time.strftime("%Y-%m-%d"), "commit": commit or "?",
                      "cpu": cpu_model()}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(saved, indent=1))
        os.replace(tmp, path)
    return losses, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="100M")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--recipes", default="tensorwise,rowwise,rowwise_with_gw_hp")
    parser.add_argument("--mx", action="store_true", help="also MXFP8 (mxfp8_cublas_rceil, emulated)")
    parser.add_argument("--float32", action="store_true",
                        help="also the same run in float32 compute: how far a higher precision lands from bf16")
    parser.add_argument("--results", help="JSON file keeping each finished run's losses; runs found there are not trained again")
    args = parser.parse_args()
    print(f"{args.flavor}, {args.batch} x {args.seq} tokens per step, {args.steps} steps, bf16 autocast, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)
    runs = {}
    runs["bf16"] = cached_train(args, "bf16", [])
    print(f"bf16: {runs['bf16'][1]:.2f} s per step", flush=True)
    variants = {r: ["--model.converters", "float8", "--quantize.linear.float8.emulate", "--quantize.linear.float8.recipe_name", r,
                    "--quantize.linear.float8.filter_fqns", "output"] for r in args.recipes.split(",") if r}
    if args.float32:
        variants["float32"] = ["--training.mixed_precision_param", "float32"]
    if args.mx:
        variants["mxfp8_cublas_rceil"] = ["--model.converters", "mx", "--quantize.linear.mx.emulate",
                                          "--quantize.linear.mx.recipe_name", "mxfp8_cublas_rceil"]
    for name, extra in variants.items():
        runs[name] = cached_train(args, name, extra)
        print(f"{name}: {runs[name][1]:.2f} s per step ({runs[name][1] / runs['bf16'][1]:.1f}x bf16's)", flush=True)
    names = list(runs)
    print("\nstep  " + "  ".join(f"{n:>18}" for n in names))
    for step in list(range(0, args.steps, 25)) + [args.steps - 1]:
        print(f"{step + 1:4}  " + "  ".join(f"{runs[n][0][step]:18.4f}" for n in names))
    tail = min(10, args.steps)
    base = statistics.mean(runs["bf16"][0][-tail:])
    print(f"\nmean loss of the last {tail} steps: bf16 {base:.4f}")
    for name in names[1:]:
        mean = statistics.mean(runs[name][0][-tail:])
        worst = max(abs(a - b) / b for a, b in zip(runs[name][0], runs["bf16"][0]))
        print(f"  {name}: {mean:.4f} ({100 * (mean - base) / base:+.2f}% against bf16); largest per-step difference {100 * worst:.2f}%")


if __name__ == "__main__":
    main()
