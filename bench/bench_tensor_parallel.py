#!/usr/bin/env python3
"""Tensor parallelism on one machine: TP 2 and TP 2 x FSDP 2 (with and without async TP) against DDP 2, FSDP 2 and
one process at the same global batch. Prints tokens/s of the whole job, the step-time breakdown (compute, exposed TP communication, time
blocked on FSDP/DDP communication) and the bytes each rank sends per step in TP collectives against the analytic
figure. Prints figures and ratios; never fails on time.

usage: bench/bench_tensor_parallel.py [--steps 12] [--seq-len 256] [--global-batch 8]
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
DIM, LAYERS = 256, 6  # debugmodel


def run(args, ranks, threads, tp=1, shard=1, replicate=1, async_tp=False):
    dp = shard * replicate
    with tempfile.TemporaryDirectory() as dump:
        cmd = [BINARY, "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--job.dump_folder", dump,
               "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
               "--training.local_batch_size", str(args.global_batch // dp), "--metrics.log_freq", str(max(2, args.steps // 3)),
               "--metrics.disable_color_printing", "--activation_checkpoint.mode", "none",
               "--training.mixed_precision_param", "float32", "--parallelism.tensor_parallel_degree", str(tp),
               "--parallelism.data_parallel_shard_degree", str(shard), "--parallelism.data_parallel_replicate_degree",
               str(replicate)] + (["--parallelism.enable_async_tensor_parallel"] if async_tp else [])
        if ranks > 1:
            cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(ranks)] + cmd
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        if out.returncode != 0:
            sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    tps = [float(x.replace(",", "")) for x in re.findall(r"tps: ([\d,]+)", out.stdout)][1:]
    # tps is per device (torchtitan's definition); the job's throughput is that times the devices.
    result = {"tokens_per_s": sum(tps) / len(tps) * ranks, "dp_wait": 0.0, "tp": 0.0, "tp_mb": None}
    result["step"] = args.global_batch * args.seq_len / result["tokens_per_s"]
    m = re.search(r"Data-parallel communication per step on this rank: ([\d.]+) MB sent, ([\d.]+) s blocked waiting, .*; "
                  r"([\d.]+) s per step", out.stdout)
    if m:
        result.update(dp_wait=float(m.group(2)), step=float(m.group(3)))
    m = re.search(r"Tensor-parallel communication per step on this rank: ([\d.]+) MB sent, ([\d.]+) s .*; ([\d.]+) s per step",
                  out.stdout)
    if m:
        result.update(tp_mb=float(m.group(1)), tp=float(m.group(2)), step=float(m.group(3)))
    return result


def analytic_tp_mb(args, tp, dp):
    """Bytes one rank sends per step in TP collectives, as ring collectives move them (float32 activations).
    Per micro-batch: every block all-gathers its attention and feed-forward inputs over the sequence and
    reduce-scatters wo's and w2's outputs (4 collectives), each of which has the reverse one in backward; the
    embedding's reduce-scatter and the output's all-gather add 2 more with their backward ones. Each moves
    (tp - 1) / tp of a batch x seq x dim activation. Loss parallel all-reduces 3 floats per token; once per step
    the sequence-parallel norms' gradients (2 per block + the final one) are all-reduced."""
    batch = args.global_batch // dp  # one micro-batch per step here
    share = (tp - 1) / tp
    activation = batch * args.seq_len * DIM * 4
    per_microbatch = (8 * LAYERS + 4) * share * activation + 3 * 2 * share * batch * args.seq_len * 4
    norms = 2 * share * (2 * LAYERS + 1) * DIM * 4
    return (per_microbatch + norms) / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    print(f"debugmodel, global batch {args.global_batch} x {args.seq_len} tokens, {args.steps} steps, float32, "
          f"activation checkpointing off; {os.cpu_count()} cores")
    rows = [("1 process x 2 threads", run(args, 1, 2), None),
            ("DDP 2 (2 x 1 thread)", run(args, 2, 1, replicate=2), None),
            ("FSDP 2 (2 x 1 thread)", run(args, 2, 1, shard=2), None),
            ("TP 2 (2 x 1 thread)", run(args, 2, 1, tp=2), (2, 1)),
            ("TP 2, async TP", run(args, 2, 1, tp=2, async_tp=True), (2, 1)),
            ("TP 2 x FSDP 2 (4 x 1 thread)", run(args, 4, 1, tp=2, shard=2), (2, 2)),
            ("TP 2 x FSDP 2, async TP", run(args, 4, 1, tp=2, shard=2, async_tp=True), (2, 2))]
    base = rows[0][1]["tokens_per_s"]
    print(f"{'configuration':30} {'tokens/s':>9} {'vs 1x2':>6} {'step s':>7} {'compute':>7} {'TP comm':>7} "
          f"{'DP wait':>7} {'TP MB/step':>10} {'analytic':>8} {'ratio':>6}")
    for name, r, kind in rows:
        compute = r["step"] - r["tp"] - r["dp_wait"]
        line = (f"{name:30} {r['tokens_per_s']:9,.0f} {r['tokens_per_s'] / base:6.2f} {r['step']:7.3f} {compute:7.3f} "
                f"{r['tp']:7.3f} {r['dp_wait']:7.3f}")
        if kind:
            mb = analytic_tp_mb(args, *kind)
            line += f" {r['tp_mb']:10.2f} {mb:8.2f} {r['tp_mb'] / mb:6.3f}"
        print(line)
    print("TP comm: exposed TP communication, i.e. time inside TP's synchronous collectives plus, with async TP, time "
          "waiting for its background ones; DP wait: time blocked on FSDP/DDP communication; compute = step - both "
          "(includes data loading and the optimizer). With more ranks than cores the ranks share cores, so the 4-rank "
          "rows are slower by design.")


if __name__ == "__main__":
    main()
