#!/usr/bin/env python3
"""Data pipeline speed. (1) Tokenizer: titan's encoder on one thread against Python tiktoken's encode_ordinary on
the same text with the same ranks file (cl100k), on prose, dictionary entries and C code; the token counts must
agree. (2) Pipeline: `titan data tokenize` (read + decompress + parse + encode + write) on 1 and 2 threads, and
the training dataloader (mixture, shuffling, packing) on its own thread. Prints figures and ratios; never fails on
time.

usage: bench/bench_data.py [--repeat 3]   (needs ../shared/data, a build, and the test venv for tiktoken)
"""
import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("TITAN_BIN_DIR", ROOT / "build" / "bin"))
SHARED = Path(os.environ.get("TITAN_SHARED_DATA", ROOT.parent / "shared" / "data"))
RANKS = SHARED / "tokenizers" / "cl100k_base.tiktoken"


def corpora(tmp):
    texts = {"prose (tinyshakespeare)": (SHARED / "text" / "tinyshakespeare.txt").read_text()}
    code = "".join(Path(p).read_text(errors="replace") for p in sorted(glob.glob("/usr/include/*.h")))
    texts["code (/usr/include/*.h)"] = code
    dz = Path("/usr/share/dictd/gcide.dict.dz")
    if dz.exists():
        texts["dictionary (gcide, first 4 MB)"] = gzip.open(dz).read(4_000_000).decode("utf-8", errors="replace")
    files = {}
    for i, (name, text) in enumerate(texts.items()):
        path = Path(tmp) / f"corpus{i}.txt"
        path.write_text(text)
        files[name] = path
    return texts, files


def titan_speed(path, repeat):
    out = subprocess.run([str(BIN / "titan"), "tokenizer", "speed", "--tokenizer", str(RANKS), "--input", str(path),
                          "--repeat", str(repeat)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def tiktoken_speed(text, repeat):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    meta = json.loads(RANKS.with_suffix(".meta.json").read_text())
    enc = tiktoken.Encoding("cl100k_bench", pat_str=meta["pat_str"], mergeable_ranks=load_tiktoken_bpe(str(RANKS)),
                            special_tokens=meta["special_tokens"])
    tokens = len(enc.encode_ordinary(text))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        tokens = len(enc.encode_ordinary(text))
        best = min(best, time.perf_counter() - start)
    return {"tokens": tokens, "seconds": best, "tokens_per_second": tokens / best}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not RANKS.exists():
        sys.exit(f"needs {RANKS} (../shared/data beside the clone)")
    with tempfile.TemporaryDirectory() as tmp:
        texts, files = corpora(tmp)
        print("== tokenizer, one thread, cl100k ranks ==")
        print(f"{'text':34} {'MB':>6} {'titan tok/s':>13} {'tiktoken tok/s':>15} {'ratio':>6}")
        for name, path in files.items():
            mine = titan_speed(path, args.repeat)
            ref = tiktoken_speed(texts[name], args.repeat)
            if mine["tokens"] != ref["tokens"]:
                print(f"  ! token counts differ on {name}: titan {mine['tokens']}, tiktoken {ref['tokens']}")
            print(f"{name:34} {mine['bytes'] / 1e6:6.2f} {mine['tokens_per_second']:13,.0f} "
                  f"{ref['tokens_per_second']:15,.0f} {mine['tokens_per_second'] / ref['tokens_per_second']:6.2f}")

        print("\n== pipeline: titan data tokenize (JSONL.zst + gzip + text -> token shards) ==")
        inputs = Path(tmp) / "inputs"
        inputs.mkdir()
        for i, (name, text) in enumerate(texts.items()):
            rows = [p for p in text.split("\n\n") if p.strip()]
            raw = "".join(json.dumps({"text": r}) + "\n" for r in rows)
            if i % 2 == 0:
                (inputs / f"c{i}.jsonl").write_text(raw)
                subprocess.run(["zstd", "-q", "--rm", str(inputs / f"c{i}.jsonl")], check=True)
            else:
                with gzip.open(inputs / f"c{i}.jsonl.gz", "wt") as f:
                    f.write(raw)
        per_threads = {}
        for threads in (1, 2):
            out = subprocess.run([str(BIN / "titan"), "data", "tokenize", "--tokenizer", str(RANKS), "--input", str(inputs),
                                  "--output", str(Path(tmp) / f"shards{threads}"), "--threads", str(threads)],
                                 capture_output=True, text=True, check=True)
            summary = json.loads(out.stdout)
            per_threads[threads] = summary["tokens_per_second"]
            print(f"{threads} thread(s): {summary['documents']:,} documents, {summary['tokens']:,} tokens, "
                  f"{summary['seconds']:.2f} s, {summary['tokens_per_second']:,.0f} tokens/s")
        print(f"2 threads / 1 thread: {per_threads[2] / per_threads[1]:.2f}")

        probe = BIN / "titan_data_probe"
        if probe.exists():
            print("\n== training dataloader on its own thread (mixture of the three, shuffle 1000, packing) ==")
            mix = "[" + ", ".join(f'{{path="{p}", weight={w}}}' for p, w in
                                  zip(sorted(inputs.iterdir()), [0.5, 0.3, 0.2])) + "]"
            for seq_len, batch, batches in ((2048, 8, 60),):
                out_dir = Path(tmp) / "probe"
                subprocess.run([str(probe), "--probe.out", str(out_dir), "--probe.batches", str(batches),
                                "--model.hf_assets_path", str(RANKS), "--training.datasets", mix,
                                "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch),
                                "--training.shuffle_buffer", "1000", "--training.shuffle_shards",
                                "--training.prefetch_batches", "0"], check=True, capture_output=True)
                served = json.loads((out_dir / "rank0.json").read_text())
                tokens = batches * batch * (seq_len + 1)
                print(f"seq_len {seq_len} x batch {batch}: {tokens:,} tokens in {served['wait_seconds']:.2f} s = "
                      f"{tokens / served['wait_seconds']:,.0f} tokens/s on one thread")


if __name__ == "__main__":
    main()
