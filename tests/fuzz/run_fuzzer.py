#!/usr/bin/env python3
"""Runs one libFuzzer harness for a fixed time from a seed corpus made here from the test data (../shared/data,
the repository's configs, and small files written with the same libraries users produce them with). Exit status:
the fuzzer's (0 when it found nothing). Crashing inputs are kept under WORK/NAME/artifacts/.

usage: run_fuzzer.py BINARY NAME [--seconds S] [--work DIR]"""
import argparse
import base64
import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

SOURCE = Path(os.environ.get("TITAN_SOURCE_DIR", Path(__file__).resolve().parents[2]))
SHARED = Path(os.environ.get("TITAN_SHARED_DATA", SOURCE.parent / "shared" / "data"))
TEXTS = ["Hello world, the cat! It's 2026; we're testing.", "def f(x):\n    return {'a': [1, 2]}\n",
         "naïve café, 日本語, Русский, emoji 🎉👩‍👩‍👧", "<|endoftext|> and <|begin_of_text|>", "", "   \t\n  ",
         "a" * 300]


def shakespeare(n):
    path = SHARED / "text" / "tinyshakespeare.txt"
    return path.read_text()[:n] if path.exists() else "\n".join(TEXTS)


def seeds_config():
    tomls = sorted((SOURCE / "configs").glob("*.toml")) + sorted((SHARED / "configs" / "torchtitan").glob("*.toml"))
    out = [b"\x00" + p.read_bytes() for p in tomls]
    out.append(b"\x00[training]\nsteps = 3\n[[training.datasets]]\npath = \"x.jsonl\"\nweight = 0.5\n")
    for args in (["--training.steps", "10", "--optimizer.lr", "3e-4"],
                 ["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_schedule", "1F1B", "--training.seq_len", "128"],
                 ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
                 ["--checkpoint.enable", "--checkpoint.exclude_from_loading", "optimizer,dataloader"]):
        out.append(b"\x01" + "\n".join(args).encode())
    return out


def tiktoken_file(extra):
    ranks = [bytes([b]) for b in range(256)] + extra
    return "".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)).encode()


def seeds_tokenizer_files():
    out = [b"\x00" + tiktoken_file([b"he", b"ll", b"hell", b"hello", b" w", b" wo"])]
    tok = SHARED / "tokenizers" / "torchtitan_test" / "tokenizer.json"
    if tok.exists():
        out.append(b"\x01" + tok.read_bytes())
    small = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
             "added_tokens": [{"id": 3, "content": "<s>", "special": True}],
             "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}, "decoder": {"type": "ByteLevel"}}
    out.append(b"\x01" + json.dumps(small).encode())
    return out


def seeds_encode():
    text = shakespeare(4000)
    return [t.encode() for t in TEXTS] + [text[i:i + 500].encode() for i in range(0, len(text), 500)]


def zstd(data):
    if not shutil.which("zstd"):
        return None
    return subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True).stdout


def token_shard(docs, vocab=2048, bos=1, eos=2):
    body = b"".join(struct.pack(f"<{len(d)}H", *d) for d in docs)
    offsets = [0]
    for d in docs:
        offsets.append(offsets[-1] + len(d))
    header = b"TITANTOK" + struct.pack("<IIQQQqq", 1, 2, vocab, len(docs), offsets[-1], bos, eos)
    return header.ljust(64, b"\0") + body + struct.pack(f"<{len(offsets)}Q", *offsets)


def seeds_data_readers():
    jsonl = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)).encode()
    out = [b"\x00" + shakespeare(2000).encode(), b"\x01" + jsonl, b"\x02" + gzip.compress(jsonl),
           b"\x04" + token_shard([[1, 5, 6, 2], [], [1, 2047, 2]]), b"\x06" + b"first\n%\nsecond one\n%\n"]
    if (compressed := zstd(jsonl)) is not None:
        out.append(b"\x03" + compressed)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        buffer = io.BytesIO()
        pq.write_table(pa.table({"text": TEXTS + [None], "n": list(range(len(TEXTS) + 1))}), buffer, row_group_size=3)
        out.append(b"\x05" + buffer.getvalue())
        table = pa.table({"text": TEXTS + [None], "n": list(range(len(TEXTS) + 1))})
        for writer in (pa.ipc.new_stream, pa.ipc.new_file):  # the stream format (datasets') and the file format
            sink = io.BytesIO()
            with writer(sink, table.schema) as w:
                for batch in table.to_batches(max_chunksize=3):
                    w.write_batch(batch)
            out.append(b"\x07" + sink.getvalue())
    except ImportError:
        pass
    return out


def seeds_checkpoint_files():
    out = []
    try:
        import torch
        from safetensors.torch import save as save_safetensors
        tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}
        out.append(b"\x00" + save_safetensors(tensors, metadata={"format": "pt"}))
        buffer = io.BytesIO()
        base = torch.arange(20, dtype=torch.float32)
        torch.save({"w": base[4:16].view(3, 4), "n": torch.ones(3, dtype=torch.bfloat16), "i": torch.tensor([7])}, buffer)
        out.append(b"\x01" + buffer.getvalue())
        # torch DCP: the .metadata of a small checkpoint, and one data item (a torch.save'd tensor).
        import tempfile
        import torch.distributed.checkpoint as dcp
        with tempfile.TemporaryDirectory() as d:
            dcp.save({"w": torch.ones(2, 3), "s": torch.tensor(3.0), "n": 5, "e": {"x": [1.5]}}, checkpoint_id=d)
            with open(os.path.join(d, ".metadata"), "rb") as f:
                out.append(b"\x02" + f.read())
        buffer = io.BytesIO()
        torch.save(torch.arange(6, dtype=torch.bfloat16).view(2, 3).t(), buffer)
        out.append(b"\x03" + buffer.getvalue())
    except ImportError:
        pass
    meta = {"format": "titan-dcp", "version": 3, "step": 1, "model_only": False, "world_size": 1, "flavor": "debugmodel",
            "files": {"rank-00000.bin": {"bytes": 56, "crc32": 0}},
            "tensors": {"model.w": {"dtype": "float32", "shape": [2, 7], "pieces": [
                {"file": "rank-00000.bin", "offset": 0, "bytes": 56, "box": {"offsets": [0, 0], "lengths": [2, 7]}}]}}}
    rest = json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    meta["metadata_crc32"] = zlib.crc32(rest)
    out.append(b"\x04" + json.dumps(meta, indent=1).encode())
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("name")
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--work", default="fuzz")
    # A fixed seed keeps CI's short runs reproducible (each still explores for the fixed time); 0 picks one at random.
    parser.add_argument("--seed", type=int, default=int(os.environ.get("TITAN_FUZZ_SEED", "1")))
    args = parser.parse_args()
    work = Path(args.work) / args.name
    seeds, corpus, artifacts = work / "seeds", work / "corpus", work / "artifacts"
    for d in (seeds, corpus):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    made = globals()[f"seeds_{args.name}"]()
    for i, data in enumerate(made):
        (seeds / f"seed-{i:03d}").write_bytes(data)
    max_len = max(4096, max(len(d) for d in made))
    cmd = [args.binary, str(corpus), str(seeds), f"-max_total_time={args.seconds}", "-timeout=30", "-rss_limit_mb=4096",
           f"-max_len={max_len}", f"-artifact_prefix={artifacts}/", "-print_final_stats=1",
           f"-seed={args.seed}"]
    print(f"[fuzz] {args.name}: {len(made)} seeds, {args.seconds} s: {' '.join(cmd)}", flush=True)
    status = subprocess.run(cmd).returncode
    if status != 0:
        print(f"[fuzz] {args.name}: FAILED (exit {status}); the input is under {artifacts}; reproduce with "
              f"{args.binary} <that file>", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
