#!/usr/bin/env python3
"""Pipeline parallelism on one machine: each schedule at PP 2 and PP 4 against one process (no PP) at the same
global batch. Prints step time, tokens/s of the job, the bubble rank 0 measured (its time not computing) next to
the schedule's simulated bubble and, for GPipe/1F1B, the analytic (p - 1) / (m + p - 1), and the bytes rank 0 sent
to neighbouring stages per step against the analytic figure. Figures and ratios only; never fails on time.

On a 2-core machine the ranks share the cores, so measured bubbles include time a rank waits for a core.

usage: bench/bench_pipeline_parallel.py [--steps 8] [--seq-len 128] [--local-batch 8]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BINARY = os.environ.get("TITAN_BIN", str(ROOT / "build" / "bin" / "titan"))
DIM = 256  # debugmodel
SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "LoopedBFS": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2,
             "DualPipeV": 2}


def run(args, pp=1, schedule="1F1B"):
    with tempfile.TemporaryDirectory() as dump:
        cmd = [BINARY, "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--job.dump_folder", dump,
               "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
               "--training.local_batch_size", str(args.local_batch), "--metrics.log_freq", str(max(2, args.steps // 3)),
               "--metrics.disable_color_printing", "--activation_checkpoint.mode", "none",
               "--training.mixed_precision_param", "float32", "--parallelism.pipeline_parallel_degree", str(pp),
               "--parallelism.pipeline_parallel_schedule", schedule]
        if pp > 1:
            cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(pp)] + cmd
        # The peer gets the machine's cores as threads; each pipeline rank one thread (as many ranks as cores or more).
        threads = str(os.cpu_count() if pp == 1 else max(1, os.cpu_count() // pp))
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=threads))
        if out.returncode != 0:
            sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    tps = [float(x.replace(",", "")) for x in re.findall(r"tps: ([\d,]+)", out.stdout)][1:]
    result = {"tokens_per_s": sum(tps) / len(tps) * pp}  # tps is per device
    result["step"] = args.local_batch * args.seq_len / result["tokens_per_s"]
    m = re.search(r"measured bubble ([\d.]+)% \(schedule's simulated bubble ([\d.]+)%\), ([\d.]+) MB sent", out.stdout)
    if m:
        result.update(bubble=float(m.group(1)), unit_bubble=float(m.group(2)), mb_sent=float(m.group(3)))
    return result


def analytic_mb_sent(args, pp, local):
    """Rank 0's bytes per step: each of its stages sends every micro-batch's activation (batch 1 x seq x dim floats;
    a 64-byte shape header goes with the first activation on each channel only, counted here as if with every one,
    0.06 KB per micro-batch) forward unless it is the last stage, and its input gradient back unless it is the
    first. Rank 0 holds stage 0 and, looped, stages p, 2p, ...; in the V it holds stage 0 and the last."""
    m = args.local_batch
    activation = args.seq_len * DIM * 4
    stages = pp * local
    mine = [0, stages - 1] if local == 2 and args.v else [k * pp for k in range(local)]
    total = 0
    for s in mine:
        if s < stages - 1:
            total += m * (activation + 64)
        if s > 0:
            total += m * activation
    return total / 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--local-batch", type=int, default=8, help="micro-batches of 1 per step")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, from: " + ", ".join(SCHEDULES))
    args = parser.parse_args()
    base = run(args)
    print(f"debugmodel, seq_len {args.seq_len}, {args.local_batch} micro-batches of 1 per step, float32, {os.cpu_count()} cores")
    print(f"{'layout':<28}{'step s':>8}{'tok/s':>9}{'vs 1 proc':>10}{'bubble':>8}{'simulated':>10}{'(p-1)/(m+p-1)':>15}"
          f"{'MB sent':>9}{'analytic':>9}")
    print(f"{f'one process x {os.cpu_count()} threads':<28}{base['step']:>8.3f}{base['tokens_per_s']:>9.0f}{1.0:>10.2f}")
    for pp in (2, 4):
        for schedule in args.schedules.split(","):
            if schedule not in SCHEDULES:
                sys.exit(f"--schedules: unknown schedule {schedule!r}; expected some of {', '.join(SCHEDULES)}")
            local = SCHEDULES[schedule]
            r = run(args, pp, schedule)
            args.v = schedule in ("ZBVZeroBubble", "DualPipeV")
            analytic = f"{100 * (pp - 1) / (args.local_batch + pp - 1):.1f}%" if local == 1 else "-"
            print(f"{f'PP{pp} {schedule}':<28}{r['step']:>8.3f}{r['tokens_per_s']:>9.0f}{r['tokens_per_s'] / base['tokens_per_s']:>10.2f}"
                  f"{r['bubble']:>7.1f}%{r['unit_bubble']:>9.1f}%{analytic:>15}{r['mb_sent']:>9.2f}{analytic_mb_sent(args, pp, local):>9.2f}")


if __name__ == "__main__":
    main()
