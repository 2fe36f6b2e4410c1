"""The training dataloader on real MPI processes, over a three-way mixture of real corpora nobody here wrote: prose
(tinyshakespeare, by paragraph, JSONL.gz), dictionary entries (Debian's dict-gcide, JSONL.zst) and code (C headers
from /usr/include, one document per file). Ranks of 1, 2 and 4 processes serve the same windows per step; a run
stopped and resumed under another rank count continues that stream exactly; source shares follow the weights."""
import base64
import collections
import gzip
import json
import os
import subprocess
from pathlib import Path

import pytest

from titan_testing import binary, run, shared

GCIDE_INDEX = Path("/usr/share/dictd/gcide.index")
GCIDE_DICT = Path("/usr/share/dictd/gcide.dict.dz")
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def dictd_number(text):
    value = 0
    for ch in text:
        value = value * 64 + B64.index(ch)
    return value


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    plays = shared("text", "tinyshakespeare.txt").read_text()
    with gzip.open(root / "prose.jsonl.gz", "wt") as f:
        for paragraph in plays.split("\n\n"):
            if paragraph.strip():
                f.write(json.dumps({"text": paragraph + "\n"}) + "\n")
    if not GCIDE_INDEX.exists():
        pytest.skip("skipped: Debian's dict-gcide is not installed (scripts/setup.sh installs it)")
    data = gzip.open(GCIDE_DICT).read()
    lines = []
    for line in GCIDE_INDEX.read_text(encoding="utf-8", errors="replace").splitlines()[:20000]:
        parts = line.split("\t")
        if len(parts) != 3 or parts[0].startswith("00-database"):
            continue
        start, length = dictd_number(parts[1]), dictd_number(parts[2])
        entry = data[start:start + length].decode("utf-8", errors="replace")
        lines.append(json.dumps({"headword": parts[0], "definition": entry}))
    (root / "dictionary.jsonl").write_text("\n".join(lines) + "\n")
    subprocess.run(["zstd", "-q", "--rm", str(root / "dictionary.jsonl")], check=True)
    return root


def mixture(corpora):
    return ("[{name=\"prose\", path=\"%s\", weight=0.5}, "
            "{name=\"dictionary\", path=\"%s\", weight=0.3, text_field=\"definition\"}, "
            "{name=\"code\", path=\"/usr/include/*.h\", format=\"text\", weight=0.2}]"
            % (corpora / "prose.jsonl.gz", corpora / "dictionary.jsonl.zst"))


def mpirun(np):
    return [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
            "-np", str(np)]


def probe(corpora, out, np, batches, resume=None, extra=()):
    cmd = mpirun(np) + [binary("titan_data_probe"), "--probe.out", str(out), "--probe.batches", str(batches),
                        "--model.hf_assets_path", str(shared("tokenizers", "cl100k_base.tiktoken")),
                        "--training.datasets", mixture(corpora), "--training.seq_len", "96",
                        "--training.local_batch_size", str(4 // np), "--training.data_lanes", "4",
                        "--training.shuffle_buffer", "64", "--training.shuffle_shards", "--training.data_seed", "3",
                        *extra]
    if resume:
        cmd += ["--probe.resume", str(resume)]
    run(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=600)
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(np)]
    # Per step: the multiset of windows all ranks served.
    return [sorted(tuple(w) for rank in per_rank for w in rank["batches"][b]) for b in range(batches)]


@pytest.fixture(scope="module")
def reference(corpora, tmp_path_factory):
    return probe(corpora, tmp_path_factory.mktemp("single"), 1, 18)


@pytest.mark.parametrize("np", [2, 4])
def test_ranks_serve_disjoint_parts_whose_union_is_the_single_process_stream(corpora, reference, tmp_path, np):
    steps = probe(corpora, tmp_path / f"np{np}", np, 12)
    assert steps == reference[:12]
    for step in steps:  # every window of a step is served once
        assert len(set(step)) == len(step)


def test_resume_under_other_rank_counts_continues_the_stream_exactly(corpora, reference, tmp_path):
    first = probe(corpora, tmp_path / "a", 2, 5)
    second = probe(corpora, tmp_path / "b", 4, 4, resume=tmp_path / "a")
    third = probe(corpora, tmp_path / "c", 1, 3, resume=tmp_path / "b")
    assert first + second + third == reference[:12]


def test_changing_the_seed_at_a_restart_serves_no_window_twice(corpora, reference, tmp_path):
    """The new seed draws from the first document no lane had reached, so lanes first finish the documents they (and
    the lanes behind them) had started under the old one: how many windows that takes depends on the documents'
    lengths (here /usr/include, which differs between machines). Twelve steps after the restart leave room for it."""
    first = probe(corpora, tmp_path / "a", 2, 6)
    second = probe(corpora, tmp_path / "b", 2, 12, resume=tmp_path / "a", extra=["--training.data_seed", "4"])
    assert first == reference[:6]
    windows = [w for step in first + second for w in step]
    assert len(set(windows)) == len(windows)
    assert second != reference[6:]  # the new seed took effect


def test_mixture_shares_follow_the_weights(corpora, tmp_path):
    out = tmp_path / "mix"
    run([binary("titan_data_probe"), "--probe.out", str(out), "--probe.mixture", "20000",
         "--model.hf_assets_path", str(shared("tokenizers", "cl100k_base.tiktoken")),
         "--training.datasets", mixture(corpora), "--training.shuffle_buffer", "1000", "--training.shuffle_shards"])
    result = json.loads((out / "mixture.json").read_text())
    shares = [r / 20000 for r in result["rows"]]
    for share, weight in zip(shares, [0.5, 0.3, 0.2]):
        assert abs(share - weight) < 0.015, (result, shares)
    # The code source (a few thousand headers at most) and the prose loop; their epoch counters say so.
    print("mixture over 20,000 documents:", dict(zip(result["names"], shares)), "epochs", result["epochs"])
