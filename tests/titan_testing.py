"""Shared helpers for titan's Python tests: where the binaries and the shared third-party data are."""
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

SOURCE_DIR = Path(os.environ.get("TITAN_SOURCE_DIR", Path(__file__).resolve().parents[1]))
BIN_DIR = Path(os.environ.get("TITAN_BIN_DIR", SOURCE_DIR / "build" / "bin"))
SHARED_DATA = Path(os.environ.get("TITAN_SHARED_DATA", SOURCE_DIR.parent / "shared" / "data"))


def binary(name: str) -> str:
    path = BIN_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: build first (scripts/build.sh)")
    return str(path)


def shared(*parts: str) -> Path:
    """A file from ../shared/data, or skip the test when that folder is absent (a user's fresh clone)."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"skipped: third-party test data {path} is absent (../shared is not beside this clone)")
    return path


def run(args, input_text=None, check=True, env=None, timeout=600):
    """Runs a command; stdout/stderr are decoded as UTF-8 without newline translation (\r\n stays)."""
    merged_env = dict(os.environ)
    merged_env.setdefault("OMP_NUM_THREADS", "2")
    if env:
        merged_env.update(env)
    data = input_text.encode("utf-8") if isinstance(input_text, str) else input_text
    start = time.monotonic()
    result = subprocess.run(args, input=data, capture_output=True, env=merged_env, timeout=timeout)
    if os.environ.get("TITAN_TEST_LAUNCH_LOG"):  # where the suite's time goes: seconds, test and command per launch
        with open(os.environ["TITAN_TEST_LAUNCH_LOG"], "a") as log:
            log.write(f"{time.monotonic() - start:.1f}\t{os.environ.get('PYTEST_CURRENT_TEST', '?')}\t{' '.join(map(str, args))[:400]}\n")
    result.stdout = result.stdout.decode("utf-8", errors="surrogateescape")
    result.stderr = result.stderr.decode("utf-8", errors="surrogateescape")
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def compare_steps(meta, ref_meta, case, rel=1e-5, check_lr=False):
    """A probe run's per-step loss and gradient norm against the one-process reference's, each within `rel`
    (relative), and the validation loss likewise when both have one. Returns the worst relative loss difference."""
    worst = 0.0
    for mine, ref in zip(meta["steps"], ref_meta["steps"]):
        diff = abs(mine["loss"] - ref["loss"]) / ref["loss"]
        worst = max(worst, diff)
        assert diff <= rel, (case, mine, ref)
        assert abs(mine["grad_norm"] - ref["grad_norm"]) <= rel * ref["grad_norm"], (case, mine, ref)
        if check_lr:
            assert mine["lr"] == ref["lr"], (case, mine, ref)
    if "validation_loss" in ref_meta:
        assert abs(meta["validation_loss"] - ref_meta["validation_loss"]) <= rel * abs(ref_meta["validation_loss"]), (
            case, meta["validation_loss"], ref_meta["validation_loss"])
    return worst


def metadata_checksum(meta):
    """metadata_crc32 as docs/checkpoint.md defines it: the CRC-32 of the compact, key-sorted JSON of everything else."""
    import json
    import zlib

    rest = {k: v for k, v in meta.items() if k != "metadata_crc32"}
    return zlib.crc32(json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())


def write_metadata(directory, meta, reseal=True):
    """Writes an edited metadata.json, resealed with a fresh checksum unless reseal is False."""
    import json

    if reseal and meta.get("version", 0) >= 3:
        meta = dict(meta, metadata_crc32=metadata_checksum(meta))
    (Path(directory) / "metadata.json").write_text(json.dumps(meta))


def read_checkpoint(directory):
    """Full tensors of a titan checkpoint step directory, assembled from the pieces its metadata.json lists: boxes
    (versions 2 to 4) or dim-0 row ranges (version 1). An independent reader of the format in docs/checkpoint.md; it
    checks that the pieces cover every element exactly once, each file's CRC-32 and (version 4) each piece's, with
    Python's zlib."""
    import json
    import zlib

    import numpy as np

    dtypes = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "bfloat16": None}
    directory = Path(directory)
    meta = json.loads((directory / "metadata.json").read_text())
    assert meta["format"] == "titan-dcp" and meta["version"] in (1, 2, 3, 4), meta.get("version")
    if meta["version"] >= 3:
        assert meta["metadata_crc32"] == metadata_checksum(meta), "metadata checksum"
    files = {}  # each file read once (a piece used to read its whole file again)
    for name, info in meta["files"].items():
        files[name] = data = (directory / name).read_bytes()
        assert len(data) == info["bytes"] and zlib.crc32(data) == info["crc32"], f"{name}: size or CRC-32"
    out = {}
    for key, entry in meta["tensors"].items():
        shape = entry["shape"]
        if entry["dtype"] == "bfloat16":  # numpy has no bfloat16: widen to float32 through the upper 16 bits
            full = np.zeros(shape, dtype=np.float32)
        else:
            full = np.zeros(shape, dtype=dtypes[entry["dtype"]])
        count = np.zeros(shape, dtype=np.int64)
        for piece in entry["pieces"]:
            if piece["file"] not in files:
                files[piece["file"]] = (directory / piece["file"]).read_bytes()
            raw = files[piece["file"]][piece["offset"]:piece["offset"] + piece["bytes"]]
            if meta["version"] >= 4:
                assert zlib.crc32(raw) == piece["crc32"], f"{key}: a piece's CRC-32"
            if "box" in piece:
                offsets, lengths = piece["box"]["offsets"], piece["box"]["lengths"]
            else:
                a, b = piece["rows"]
                offsets, lengths = [a] + [0] * (len(shape) - 1), [b - a] + shape[1:]
            if entry["dtype"] == "bfloat16":
                values = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                values = np.frombuffer(raw, dtype=full.dtype)
            where = tuple(slice(o, o + l) for o, l in zip(offsets, lengths))
            full[where] = values.reshape(lengths)
            count[where] += 1
        assert (count == 1).all(), f"{key}: pieces do not cover every element exactly once"
        out[key] = full
    return meta, out


def hf_per_expert_grads(model):
    """A transformers MoE model's gradients under the names of its files: transformers keeps each layer's experts
    fused in memory (gate_up_proj [E, 2I, H] with the gate rows first, down_proj [E, H, I]); its files hold one
    tensor per expert."""
    out = {}
    for pname, p in model.named_parameters():
        fused = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", pname)
        if not fused:
            out[pname] = p.grad
            continue
        prefix, kind = fused.groups()
        for j in range(p.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{j}.down_proj.weight"] = p.grad[j]
            else:
                gate, up = p.grad[j].chunk(2, dim=0)
                out[f"{prefix}.{j}.gate_proj.weight"], out[f"{prefix}.{j}.up_proj.weight"] = gate, up
    return out


def probe_published_hf_model(tmp_path, model, inputs, labels):
    """A transformers MoE model saved as such models are published (save_pretrained: one tensor per expert), loaded by
    titan_model_probe, which runs the batch forward and backward; and the model itself run forward and backward on
    the same batch (mean cross-entropy over the labels that are not -100). Returns the probe's tensors (logits, loss,
    grad.<HF name>), the reference's logits and loss, and its gradients under the files' names."""
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    batch, out = tmp_path / "b.safetensors", tmp_path / "o.safetensors"
    save_file({"inputs": inputs, "labels": labels}, str(batch))
    run([binary("titan_model_probe"), "--hf-config", str(hf_dir / "config.json"), "--weights", str(hf_dir / "model.safetensors"),
         "--batch", str(batch), "--out", str(out)])
    model.zero_grad()
    logits = model(input_ids=inputs).logits
    valid = (labels != -100).sum()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100) / valid
    loss.backward()
    return load_file(str(out)), logits, loss, hf_per_expert_grads(model)
