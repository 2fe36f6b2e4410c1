#!/usr/bin/env python3
"""Training throughput of titan against PyTorch eager running torchtitan's own Llama 3 model code.

Both train the debug model on the CPU with the same threads, batch, sequence length, optimizer (fused AdamW),
clipping and precision policy; titan reads the built-in corpus, the PyTorch loop random tokens (data loading is
not what is measured; titan reports its data wait separately). Prints tokens/s for both and titan/PyTorch.
Falls back to HF transformers' Llama if torchtitan cannot be imported. Never passes or fails on time.

usage: bench/bench_train_vs_torchtitan.py [--steps 12] [--seq-len 512] [--batch 8] [--threads 2]
                                          [--precision bf16|fp32] [--ac none|selective|full]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def titan_tokens_per_second(args):
    binary = os.environ.get("TITAN_BIN", str(ROOT / "build" / "bin" / "titan"))
    warm = max(2, args.steps // 4)
    with tempfile.TemporaryDirectory() as dump:
        cmd = [binary, "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"),
               "--job.dump_folder", dump, "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
               "--training.local_batch_size", str(args.batch), "--metrics.log_freq", str(warm),
               "--training.mixed_precision_param", "bfloat16" if args.precision == "bf16" else "float32",
               "--activation_checkpoint.mode", args.ac, "--optimizer.implementation", "fused"]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        start = time.time()
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if out.returncode != 0:
            sys.exit(f"titan failed:\n{out.stdout}\n{out.stderr}")
        wall = time.time() - start
    # Windows after the first warm-up window: the log line reports tokens/s since the previous line.
    tps = [float(m.replace(",", "")) for m in re.findall(r"tps: ([\d,]+)", out.stdout)]
    steady = tps[2:] if len(tps) > 2 else tps[-1:]
    return sum(steady) / len(steady), wall


def pytorch_tokens_per_second(args):
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        from torchtitan.models.llama3 import Transformer, llama3_args

        model_args = llama3_args["debugmodel"]
        model_args.max_seq_len = args.seq_len
        model = Transformer(model_args)
        with torch.no_grad():
            model.init_weights()
        forward = lambda x: model(x)  # noqa: E731
        name = "torchtitan llama3 (PyTorch eager)"
    except Exception as error:  # pragma: no cover - depends on the installed packages
        from transformers import LlamaConfig, LlamaForCausalLM

        print(f"torchtitan unavailable ({error}); using HF transformers' Llama")
        model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768,
                                             num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16))
        forward = lambda x: model(input_ids=x).logits  # noqa: E731
        name = "HF transformers Llama (PyTorch eager)"
    if args.ac != "none":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers = model.layers if hasattr(model, "layers") else model.model.layers
        for key in list(layers.keys() if hasattr(layers, "keys") else range(len(layers))):
            i = int(key)
            if args.ac == "full" or (i + 1) % 2 == 0:
                layers[key] = checkpoint_wrapper(layers[key], preserve_rng_state=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    tokens = torch.randint(0, 2048, (args.batch, args.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")
    warm = max(2, args.steps // 4)
    for step in range(args.steps):
        if step == warm:
            start = time.perf_counter()
        optimizer.zero_grad()
        with autocast:
            logits = forward(inputs)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            loss = loss / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
    elapsed = time.perf_counter() - start
    return (args.steps - warm) * args.batch * args.seq_len / elapsed, name


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--ac", choices=["none", "selective", "full"], default="none")
    args = parser.parse_args()
    print(f"debugmodel, batch {args.batch} x seq {args.seq_len}, {args.steps} steps, {args.threads} threads, "
          f"{args.precision}, activation checkpointing {args.ac}")
    titan_tps, wall = titan_tokens_per_second(args)
    torch_tps, name = pytorch_tokens_per_second(args)
    print(f"titan.cpp                         : {titan_tps:10,.0f} tokens/s  (process wall time {wall:.1f} s)")
    print(f"{name:34}: {torch_tps:10,.0f} tokens/s")
    print(f"ratio titan / PyTorch             : {titan_tps / torch_tps:10.2f}")


if __name__ == "__main__":
    main()
