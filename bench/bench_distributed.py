#!/usr/bin/env python3
"""Data-parallel training on one machine: 1 process x 2 threads against 2 processes x 1 thread (DDP and FSDP) at
the same global batch, with a per-step breakdown (compute, time blocked on communication, time inside MPI) and
the bytes each rank sends per step against the analytic figure; and FSDP with float8 linears (tensorwise, emulated)
whose weights are gathered in the compute dtype against the same with float8 all-gathers (precomputed scales).
Prints figures and ratios; never fails on time.

usage: bench/bench_distributed.py [--steps 12] [--seq-len 256] [--global-batch 8] [--precision fp32|bf16]
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
PARAMS = 6_163_712              # debugmodel
NORM_OUTPUT = 256 + 2048 * 256  # the FSDP unit kept gathered after forward by default


def run(args, ranks, threads, extra):
    with tempfile.TemporaryDirectory() as dump:
        cmd = [BINARY, "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--job.dump_folder", dump,
               "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
               "--training.local_batch_size", str(args.global_batch // ranks), "--metrics.log_freq", str(max(2, args.steps // 3)),
               "--metrics.disable_color_printing", "--activation_checkpoint.mode", "none",
               "--training.mixed_precision_param", "bfloat16" if args.precision == "bf16" else "float32", *extra]
        if ranks > 1:
            cmd = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(ranks)] + cmd
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        if out.returncode != 0:
            sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    tps = [float(x.replace(",", "")) for x in re.findall(r"tps: ([\d,]+)", out.stdout)][1:]
    result = {"tokens_per_s": sum(tps) / len(tps) * ranks}
    f8 = re.search(r"float8 linear weights \(([\d,]+) elements on this rank\)", out.stdout)
    if f8:
        result["float8_elements"] = int(f8.group(1).replace(",", ""))
    m = re.search(r"([\d.]+) MB sent, ([\d.]+) s blocked waiting, ([\d.]+) s inside MPI calls .*; ([\d.]+) s per step", out.stdout)
    if m:
        result.update(mb=float(m.group(1)), wait=float(m.group(2)), busy=float(m.group(3)), step=float(m.group(4)))
    else:
        result["step"] = args.global_batch * args.seq_len / result["tokens_per_s"]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    gather_bytes = 2 if args.precision == "bf16" else 4
    n = 2
    analytic = {
        # ring all-reduce of fp32 gradients: 2 (n - 1) / n of the gradient bytes
        "ddp": 2 * (n - 1) / n * PARAMS * 4,
        # all-gather in forward (every unit) and in backward (all but norm + output), reduce-scatter in float32
        "fsdp": (n - 1) / n * (PARAMS * gather_bytes + (PARAMS - NORM_OUTPUT) * gather_bytes + PARAMS * 4),
    }
    print(f"debugmodel, global batch {args.global_batch} x {args.seq_len} tokens, {args.steps} steps, {args.precision}, "
          f"activation checkpointing off")
    rows = [("1 process x 2 threads", run(args, 1, 2, []), None),
            ("2 processes x 1 thread, DDP", run(args, 2, 1, ["--parallelism.data_parallel_replicate_degree", "2",
                                                             "--parallelism.data_parallel_shard_degree", "1"]), "ddp"),
            ("2 processes x 1 thread, FSDP", run(args, 2, 1, ["--parallelism.data_parallel_shard_degree", "2"]), "fsdp")]
    float8 = ["--parallelism.data_parallel_shard_degree", "2", "--model.converters", "float8", "--quantize.linear.float8.emulate",
              "--quantize.linear.float8.filter_fqns", "output"]
    rows.append(("FSDP, float8 linears", run(args, 2, 1, float8), "fsdp"))
    gathered = run(args, 2, 1, float8 + ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                                         "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"])
    # The converted weights (all in blocks, gathered in forward and backward) at 1 byte per element instead of the
    # compute dtype's; one all-reduce of their 42 amaxes per step.
    analytic["fsdp_float8"] = analytic["fsdp"] - (n - 1) * gathered["float8_elements"] * 2 * (gather_bytes - 1) + 42 * 4 * 2 * (n - 1) / n
    rows.append(("FSDP, float8 linears and all-gathers", gathered, "fsdp_float8"))
    base = rows[0][1]["tokens_per_s"]
    print(f"{'configuration':38} {'tokens/s':>10} {'vs 1x2':>7} {'step s':>7} {'blocked s':>9} {'in MPI s':>8} "
          f"{'MB/step':>8} {'analytic':>8} {'ratio':>6}")
    for name, r, kind in rows:
        line = f"{name:38} {r['tokens_per_s']:10,.0f} {r['tokens_per_s'] / base:7.2f} {r['step']:7.3f}"
        if kind:
            mb = analytic[kind] / 1e6
            line += f" {r['wait']:9.3f} {r['busy']:8.3f} {r['mb']:8.2f} {mb:8.2f} {r['mb'] / mb:6.3f}"
        print(line)
    f8_plain, f8_gathered = rows[-2][1], rows[-1][1]
    print(f"float8 all-gathers against compute-dtype gathers of the same float8 model: {f8_gathered['mb'] / f8_plain['mb']:.3f}x "
          f"the bytes, {f8_plain['step'] / f8_gathered['step']:.2f}x the speed, {f8_gathered['wait']:.3f} s against "
          f"{f8_plain['wait']:.3f} s blocked per step")
    print("blocked: time the training thread waited for communication; in MPI: time the communication thread spent in "
          "MPI calls (the rest of it overlapped with compute); compute ~ step - blocked - data loading.")


if __name__ == "__main__":
    main()
