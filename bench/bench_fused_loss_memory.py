#!/usr/bin/env python3
"""Peak memory and speed of the fused output projection + cross-entropy against the unfused path, on a model with
Llama 3's 128,256-token vocabulary (the debug model's blocks, so that it fits a laptop).

titan trains a few steps with training.fused_kernels on and off, at Llama 3's vocabulary and at the debug model's
2,048, fresh process each, and reads the peak memory and tokens/s from its step lines. The switch also turns off
the fused attention / RMSNorm / SwiGLU / RoPE kernels, so the loss's own share is the difference between the two
vocabularies: (unfused - fused at 128,256) - (unfused - fused at 2,048). Printed beside it: the size of the float32
logits of the whole batch, which the fused loss never materialises. Never passes or fails.

usage: bench/bench_fused_loss_memory.py [--batch 2] [--seq 1024] [--steps 4] [--precision bf16|fp32]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_VOCAB = 128256
STEP = re.compile(r"step: +(\d+) .*?memory: +([\d.]+)GiB.*?tps: ([\d,]+)")


def run(vocab, fused, args):
    binary = os.environ.get("TITAN_BIN", str(ROOT / "build" / "bin" / "titan"))
    with tempfile.TemporaryDirectory() as dump:
        cmd = [binary, "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--model.vocab_size", str(vocab),
               "--job.dump_folder", dump, "--training.steps", str(args.steps), "--training.seq_len", str(args.seq),
               "--training.local_batch_size", str(args.batch), "--metrics.log_freq", "1", "--activation_checkpoint.mode", "none",
               "--training.mixed_precision_param", "bfloat16" if args.precision == "bf16" else "float32",
               "--training.fused_kernels", "true" if fused else "false"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, NO_COLOR="1"))
    if out.returncode != 0:
        sys.exit(f"titan failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    steps = [(int(s), float(m), float(t.replace(",", ""))) for s, m, t in STEP.findall(out.stdout)]
    if not steps:
        sys.exit(f"no step lines in titan's output:\n{out.stdout[-3000:]}")
    peak = max(m for _, m, _ in steps)
    later = [t for s, _, t in steps if s > 1] or [steps[-1][2]]
    return peak, sorted(later)[len(later) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()
    tokens = args.batch * args.seq
    print(f"debug model blocks, {args.batch} x {args.seq} tokens, {args.precision}, {args.steps} steps, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    results = {}
    for vocab in (LLAMA3_VOCAB, 2048):
        for fused in (True, False):
            results[vocab, fused] = run(vocab, fused, args)
            peak, tps = results[vocab, fused]
            print(f"  vocab {vocab:>7,}  fused kernels {'on ' if fused else 'off'}: peak {peak:6.2f} GiB  {tps:8,.0f} tokens/s")
    logits_fp32 = tokens * LLAMA3_VOCAB * 4 / 2**30
    saved = results[LLAMA3_VOCAB, False][0] - results[LLAMA3_VOCAB, True][0]
    others = results[2048, False][0] - results[2048, True][0]
    print(f"float32 logits of the whole batch at vocab {LLAMA3_VOCAB:,}: {logits_fp32:.2f} GiB")
    print(f"peak saved at vocab {LLAMA3_VOCAB:,}: {saved:.2f} GiB; of which the other fused kernels (saved at vocab 2,048): "
          f"{others:.2f} GiB; the fused loss: {saved - others:.2f} GiB = {(saved - others) / logits_fp32:.2f}x the float32 logits")
    speed = results[LLAMA3_VOCAB, True][1] / results[LLAMA3_VOCAB, False][1]
    print(f"tokens/s at vocab {LLAMA3_VOCAB:,}, fused / unfused: {speed:.2f}x")


if __name__ == "__main__":
    main()
