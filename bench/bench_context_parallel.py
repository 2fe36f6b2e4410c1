#!/usr/bin/env python3
"""Context parallelism on one machine: the debug model on long sequences with CP 2 and CP 4 (both rotate methods,
headtail load balancing) against one process at the same global batch. Prints step time, tokens/s of the job and
its ratio to one process, the time rank 0 spent blocked on keys/values or their gradients (exposed
communication), and the bytes rank 0 sent over the cp group per step against the analytic figure; then rank 0's
peak memory above the start of the step at seq_len 16384 for CP 1, 2 and 4. Figures and ratios only; never fails
on time.

On a 2-core machine the ranks share the cores: CP 4 runs 4 processes on 2 cores, so its tokens/s says what
communication and the extra work cost, not what 4 devices would give.

With --mask block_causal the documents packed into each window attend within themselves only (the fortunes are
about a hundred tokens long), on one process and under CP alike.

usage: bench/bench_context_parallel.py [--steps 4] [--seq-len 4096] [--memory-seq-len 16384 | 0] [--mask causal|block_causal]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("TITAN_BIN_DIR", str(ROOT / "build" / "bin")))
N_LAYERS, N_KV_HEADS, HEAD_DIM = 6, 16, 16  # debugmodel: dim 256, 16 heads, no GQA
COMMON = ["--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--metrics.disable_color_printing",
          "--activation_checkpoint.mode", "none", "--training.mixed_precision_param", "float32", "--training.local_batch_size", "1"]


def mpi(ranks):
    return [] if ranks == 1 else ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", str(ranks)]


def cp_args(degree, rotate):
    if degree == 1:
        return []
    return ["--parallelism.context_parallel_degree", str(degree), "--parallelism.context_parallel_rotate_method", rotate,
            "--parallelism.data_parallel_shard_degree", "1"]


def threads(ranks):
    return str(max(1, (os.cpu_count() or 1) // ranks))


def train(args, degree, rotate):
    with tempfile.TemporaryDirectory() as dump:
        cmd = mpi(degree) + [str(BIN / "titan"), "train", *COMMON, "--job.dump_folder", dump, "--training.steps", str(args.steps),
                             "--training.seq_len", str(args.seq_len), "--metrics.log_freq", "1", "--model.attn_mask_type", args.mask,
                             *cp_args(degree, rotate)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=threads(degree)))
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    tps = [float(x.replace(",", "")) for x in re.findall(r"tps: ([\d,]+)", out.stdout)][1:]  # step 1 warms up
    result = {"tokens_per_s": sum(tps) / len(tps) * degree}  # tps is per device
    result["step"] = args.seq_len / result["tokens_per_s"]
    m = re.search(r"Context-parallel communication per step on this rank: ([\d.]+) MB sent, ([\d.]+) s blocked", out.stdout)
    if m:
        result.update(mb_sent=float(m.group(1)), blocked=float(m.group(2)))
    return result


def analytic_mb(args, degree, rotate):
    """Rank 0's bytes per step over the cp group: each layer's key/value block (2 x kv_heads x seq/cp x head_dim
    float32) goes out cp - 1 times forward (all-gather, or one ring shift per step) and again in backward; its
    float32 gradient goes cp - 1 times (reduce-scatter) or cp times (the ring brings it home)."""
    block = 2 * N_KV_HEADS * (args.seq_len // degree) * HEAD_DIM * 4
    grads = degree - 1 if rotate == "allgather" else degree
    return N_LAYERS * block * (2 * (degree - 1) + grads) / 1e6


def peak_memory(seq_len, degree):
    with tempfile.TemporaryDirectory() as dump:
        out_dir = Path(dump) / "probe"
        cmd = mpi(degree) + [str(BIN / "titan_train_probe"), "--probe.out", str(out_dir), *COMMON, "--job.dump_folder", dump,
                             "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.steps", "1",
                             "--training.seq_len", str(seq_len), "--training.global_batch_size", "1",
                             *cp_args(degree, "alltoall")]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=threads(degree)))
        if out.returncode != 0:
            sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        meta = json.loads((out_dir / "metrics.json").read_text())
    return meta["peak_rss_bytes"] - meta["rss_before_steps_bytes"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--memory-seq-len", type=int, default=16384, help="0 skips the memory runs")
    parser.add_argument("--mask", choices=["causal", "block_causal"], default="causal")
    args = parser.parse_args()
    base = train(args, 1, "allgather")
    print(f"debugmodel, seq_len {args.seq_len}, batch 1, float32, {args.mask} attention, {os.cpu_count()} cores")
    print(f"{'layout':<26}{'step s':>8}{'tok/s':>8}{'vs 1 proc':>10}{'blocked s':>10}{'MB sent':>9}{'analytic':>9}")
    print(f"{f'one process x {os.cpu_count()} threads':<26}{base['step']:>8.3f}{base['tokens_per_s']:>8.0f}{1.0:>10.2f}")
    for degree in (2, 4):
        for rotate in ("allgather", "alltoall"):
            r = train(args, degree, rotate)
            print(f"{f'CP{degree} {rotate}':<26}{r['step']:>8.3f}{r['tokens_per_s']:>8.0f}{r['tokens_per_s'] / base['tokens_per_s']:>10.2f}"
                  f"{r['blocked']:>10.3f}{r['mb_sent']:>9.2f}{analytic_mb(args, degree, rotate):>9.2f}")
    if args.memory_seq_len <= 0:
        return
    print(f"\npeak memory of rank 0 above the start of the step, seq_len {args.memory_seq_len} (one step, no activation checkpointing)")
    grown = {d: peak_memory(args.memory_seq_len, d) for d in (1, 2, 4)}
    for d, b in grown.items():
        print(f"CP{d}: {b / 2**20:8.0f} MiB  ({b / grown[1]:.2f} x CP1, 1/cp = {1 / d:.2f})")


if __name__ == "__main__":
    main()
