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
