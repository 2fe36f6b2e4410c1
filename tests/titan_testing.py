"""Shared helpers for titan's Python tests: where the binaries and the shared third-party data are."""
import os
import subprocess
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
    result = subprocess.run(args, input=data, capture_output=True, env=merged_env, timeout=timeout)
    result.stdout = result.stdout.decode("utf-8", errors="surrogateescape")
    result.stderr = result.stderr.decode("utf-8", errors="surrogateescape")
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def read_checkpoint(directory):
    """Full tensors of a titan checkpoint step directory, assembled from the row pieces its metadata.json lists
    (an independent reader of the format described in docs/checkpoint.md)."""
    import json

    import numpy as np

    dtypes = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "bfloat16": None}
    directory = Path(directory)
    meta = json.loads((directory / "metadata.json").read_text())
    out = {}
    for key, entry in meta["tensors"].items():
        shape = entry["shape"]
        if entry["dtype"] == "bfloat16":  # numpy has no bfloat16: widen to float32 through the upper 16 bits
            full = np.zeros(shape, dtype=np.float32)
        else:
            full = np.zeros(shape, dtype=dtypes[entry["dtype"]])
        covered = 0
        for piece in entry["pieces"]:
            raw = (directory / piece["file"]).read_bytes()[piece["offset"]:piece["offset"] + piece["bytes"]]
            a, b = piece["rows"]
            if entry["dtype"] == "bfloat16":
                values = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                values = np.frombuffer(raw, dtype=full.dtype)
            full[a:b] = values.reshape([b - a] + shape[1:])
            covered += b - a
        assert covered == shape[0], key
        out[key] = full
    return meta, out
