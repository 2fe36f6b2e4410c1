#!/usr/bin/env python3
"""Sampling speed: `titan generate` against Hugging Face transformers' generate() on the same checkpoint and CPU.

A model of the chosen flavor (saved by a one-step titan run at 256 tokens, its context; both systems read the same weights) is exported to
Hugging Face; both then continue the same prompt ids greedily for --new
tokens (EOS ignored) at batch sizes 1 and 4, float32, on --threads threads. titan's rate is what it prints for the
decoding phase (tokens after the first per row / their time); transformers' is timed around generate() less a
one-token generate() of the same batch (its prefill), so both rates leave the prefill out. Each system runs as a
fresh process, interleaved, --repeats times; the table gives medians and the ratio. Never passes or fails on time.

usage: bench/bench_generate.py [--flavor debugmodel] [--new 128] [--prompt-tokens 32] [--repeats 3] [--threads 2]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TITAN = ROOT / "build" / "bin" / "titan"

HF_TIMER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(int(sys.argv[4]))
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
new = int(sys.argv[3])
mask = torch.ones_like(ids)
def timed(n):
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return time.perf_counter() - start
timed(2)  # warm-up
prefill = timed(1)
total = timed(new)
print(json.dumps({"tokens_per_s": ids.shape[0] * (new - 1) / (total - prefill)}))
"""


def titan_rate(checkpoint, prompt, batch, new, threads):
    cmd = [str(TITAN), "generate", "--checkpoint", str(checkpoint), "--temperature", "0", "--ignore-eos", "--json",
           "--max-new-tokens", str(new)] + ["--prompt", prompt] * batch
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, check=True)
    rate = float(re.search(r"then ([0-9.]+) tokens/s", result.stderr).group(1))
    ids = [json.loads(line)["prompt_ids"] for line in result.stdout.splitlines()]
    return rate, ids


def hf_rate(hf, ids, new, threads):
    result = subprocess.run([sys.executable, "-c", HF_TIMER, str(hf), json.dumps(ids), str(new), str(threads)],
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    subprocess.run([str(TITAN), "train", "--job.dump_folder", str(work / "dump"), "--model.flavor", a.flavor,
                    "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.seq_len", "256",
                    "--training.local_batch_size", "1", "--training.steps", "1",
                    "--checkpoint.enable", "--checkpoint.interval", "1"], check=True, capture_output=True)
    step = work / "dump" / "checkpoint" / "step-1"
    hf = work / "hf"
    subprocess.run([str(TITAN), "convert", "--from", str(step), "--to", str(hf)], check=True, capture_output=True)
    prompt = " ".join(["word"] * a.prompt_tokens)
    print(f"titan generate vs transformers generate(): {a.flavor}, float32, greedy, {a.new} new tokens, "
          f"{a.threads} threads, median of {a.repeats}")
    print("| batch | titan tokens/s | transformers tokens/s | titan / transformers |")
    print("|---|---|---|---|")
    for batch in (1, 4):
        ours, theirs = [], []
        for _ in range(a.repeats):
            rate, ids = titan_rate(step, prompt, batch, a.new, a.threads)
            ours.append(rate)
            theirs.append(hf_rate(hf, ids, a.new, a.threads))
        o, t = statistics.median(ours), statistics.median(theirs)
        print(f"| {batch} | {o:.1f} | {t:.1f} | {o / t:.2f}x |")


if __name__ == "__main__":
    main()
