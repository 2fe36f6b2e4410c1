"""Validation: the loss titan's trainer reports for a validation set equals the loss HF transformers' Llama
computes with the trained weights on windows packed in Python from HF `tokenizers` ids (one full pass in file order,
the last batch partial: the summed loss over all the pass's tokens)."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from titan_testing import binary, run, shared
from test_model_parity import hf_model

SEQ, BATCH = 32, 3


def test_validation_loss_matches_transformers(tmp_path):
    plays = shared("text", "tinyshakespeare.txt").read_text()
    paragraphs = [p + "\n" for p in plays.split("\n\n") if p.strip()][-40:]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    tokenizer_dir = shared("tokenizers", "torchtitan_test")
    out = tmp_path / "probe"
    run([binary("titan_train_probe"), "--probe.out", str(out), "--probe.validate", "--job.dump_folder", str(tmp_path),
         "--model.hf_assets_path", str(tokenizer_dir), "--training.dataset_path", str(shared("text", "tinyshakespeare.txt")),
         "--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--training.mixed_precision_param", "float32", "--debug.seed", "0", "--activation_checkpoint.mode", "none",
         "--validation.enable", "--validation.dataset_path", str(val), "--validation.seq_len", str(SEQ),
         "--validation.local_batch_size", str(BATCH), "--validation.steps", "-1"])
    meta = json.loads((out / "metrics.json").read_text())

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos, eos = meta["bos_id"], meta["eos_id"]
    stream = []
    for p in paragraphs:
        ids = tok.encode(p).ids
        if bos >= 0 and (not ids or ids[0] != bos):
            ids = [bos] + ids
        if eos >= 0 and (not ids or ids[-1] != eos):
            ids = ids + [eos]
        stream += ids
    windows = [stream[i:i + SEQ + 1] for i in range(0, len(stream) - SEQ, SEQ + 1)]
    # Every window, the last batch partial (titan pads its missing rows, which add no tokens).
    batches = [torch.tensor(windows[i:i + BATCH]) for i in range(0, len(windows), BATCH)]
    assert len(batches) >= 3 and len(windows) % BATCH != 0

    model = hf_model(16)
    model.load_state_dict(load_file(str(out / "final.safetensors")), strict=True)
    losses = []
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b[:, :-1]).logits
            labels = b[:, 1:]
            losses.append(F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum").item())
    # A full pass's loss: over all its tokens (torchtitan averages the batches' means, the same when all are full).
    expected = sum(losses) / (len(windows) * SEQ)
    assert meta["validation_loss"] == pytest.approx(expected, rel=2e-6), (meta["validation_loss"], expected)
    print(f"validation loss {meta['validation_loss']:.6f}, transformers {expected:.6f} over {len(batches)} batches")
