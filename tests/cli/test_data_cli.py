"""`titan data tokenize` and `titan data inspect`: the shards hold exactly what Python tiktoken encodes, training
from the shards serves the same windows as tokenizing on the fly, and bad input is a clear error."""
import json
import subprocess

import numpy as np
import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from titan_testing import binary, run, shared


def cl100k():
    path = shared("tokenizers", "cl100k_base.tiktoken")
    meta = json.loads(path.with_suffix(".meta.json").read_text())
    ranks = load_tiktoken_bpe(str(path))
    return path, tiktoken.Encoding("cl100k_test", pat_str=meta["pat_str"], mergeable_ranks=ranks,
                                   special_tokens=meta["special_tokens"])


def read_shard(path):
    raw = path.read_bytes()
    assert raw[:8] == b"TITANTOK"
    version, width = np.frombuffer(raw[8:16], dtype="<u4")
    vocab, docs, tokens, bos, eos = np.frombuffer(raw[16:56], dtype="<i8")
    assert version == 1
    dtype = "<u2" if width == 2 else "<u4"
    ids = np.frombuffer(raw[64:64 + tokens * width], dtype=dtype)
    offsets = np.frombuffer(raw[64 + tokens * width:], dtype="<u8")
    assert len(offsets) == docs + 1
    return [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(docs)], dict(vocab=vocab, bos=bos, eos=eos)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    plays = shared("text", "tinyshakespeare.txt").read_text()
    paragraphs = [p + "\n" for p in plays.split("\n\n") if p.strip()]
    (root / "plays.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    subprocess.run(["zstd", "-q", "--rm", str(root / "plays.jsonl")], check=True)
    return root, paragraphs


def test_tokenize_writes_the_tokens_tiktoken_gives(corpus, tmp_path):
    root, paragraphs = corpus
    path, reference = cl100k()
    out = tmp_path / "shards"
    result = run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(root / "plays.jsonl.zst"),
                  "--output", str(out), "--shard-tokens", "100000", "--threads", "2"])
    summary = json.loads(result.stdout)
    assert summary["documents"] == len(paragraphs)
    assert "tokens/s" in result.stderr and "documents into" in result.stderr
    documents = []
    for shard in sorted(out.glob("*.tokens")):
        docs, header = read_shard(shard)
        assert header["vocab"] == 100277 and header["eos"] == 100257 and header["bos"] == -1
        documents += docs
    assert len(summary["shards"]) == len(list(out.glob("*.tokens"))) > 1
    expected = [reference.encode_ordinary(p) + [100257] for p in paragraphs]  # cl100k has EOS, no BOS
    assert documents == expected
    assert summary["tokens"] == sum(map(len, expected))
    inspect = json.loads(run([binary("titan"), "data", "inspect", *summary["shards"]]).stdout)
    assert sum(s["documents"] for s in inspect) == len(paragraphs)
    # The output folder stands for its shards.
    assert json.loads(run([binary("titan"), "data", "inspect", str(out)]).stdout) == inspect
    print(f"tokenized {summary['documents']} documents, {summary['tokens']} tokens at "
          f"{summary['tokens_per_second']:,.0f} tokens/s with {summary['threads']} threads")


def test_training_from_shards_serves_the_same_windows_as_from_text(corpus, tmp_path):
    root, _ = corpus
    path, _ = cl100k()
    shards = tmp_path / "shards"
    run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(root / "plays.jsonl.zst"),
         "--output", str(shards), "--shard-tokens", "30000"])
    common = ["--probe.batches", "20", "--model.hf_assets_path", str(path), "--training.seq_len", "128",
              "--training.local_batch_size", "3"]
    run([binary("titan_data_probe"), "--probe.out", str(tmp_path / "text"), "--training.dataset_path",
         str(root / "plays.jsonl.zst"), *common])
    run([binary("titan_data_probe"), "--probe.out", str(tmp_path / "tokens"), "--training.dataset_path", str(shards),
         *common])
    text = json.loads((tmp_path / "text" / "rank0.json").read_text())["batches"]
    tokens = json.loads((tmp_path / "tokens" / "rank0.json").read_text())["batches"]
    assert text == tokens


def test_bad_input_is_reported_with_file_and_line(corpus, tmp_path):
    path, _ = cl100k()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n{"text": "also fine"}\n')
    result = run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(bad), "--output",
                  str(tmp_path / "o1")], check=False)
    assert result.returncode == 2 and "bad.jsonl:2" in result.stderr, result.stderr
    assert not list((tmp_path / "o1").glob("*.tokens"))  # nothing that looks complete was left behind
    result = run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(bad), "--output",
                  str(tmp_path / "o2"), "--skip-malformed-rows"])
    summary = json.loads(result.stdout)
    assert summary["documents"] == 2 and summary["skipped_rows"] == 1
    # A second run into the same folder would overwrite shards: refused.
    again = run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(bad), "--output",
                 str(tmp_path / "o2"), "--skip-malformed-rows"], check=False)
    assert again.returncode == 2 and "already holds token shards" in again.stderr
    # A truncated shard is refused by the training loader, naming the file.
    shard = tmp_path / "o2" / "part-00000.tokens"
    data = shard.read_bytes()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "part-00000.tokens").write_bytes(data[:-5])
    result = run([binary("titan_data_probe"), "--probe.out", str(tmp_path / "p"), "--probe.batches", "1",
                  "--model.hf_assets_path", str(path), "--training.dataset_path", str(cut)], check=False)
    assert result.returncode == 2 and "part-00000.tokens" in result.stderr and "truncated" in result.stderr, result.stderr
    # Non-positive mixture weights are rejected when the config is read.
    result = run([binary("titan"), "train", "--training.datasets", '[{path="%s", weight=0}]' % bad], check=False)
    assert result.returncode == 2 and "weight must be a positive number" in result.stderr, result.stderr


def test_command_lines_without_documents_flags_or_values_are_refused(corpus, tmp_path):
    """Found by a new user's walk through the commands (2026-12-03): each of these exited 0 or misnamed the problem."""
    path, _ = cl100k()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    # Nothing to tokenize: an error, as training gives for a source without documents.
    result = run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(empty), "--output",
                  str(tmp_path / "o")], check=False)
    assert result.returncode == 2 and "no documents in" in result.stderr and "empty.jsonl" in result.stderr, result.stderr
    # --help after a subcommand gives the usage; a misspelled flag at the end of the line is an unknown option.
    for command in (["data", "tokenize"], ["tokenizer", "encode"], ["tokenizer", "train"]):
        result = run([binary("titan"), *command, "--help"], check=False)
        assert result.returncode == 0 and "usage" in result.stdout, (command, result.stderr)
    for command in (["data", "tokenize", "--input", str(empty), "--inptu"], ["tokenizer", "encode", "--jsnol"],
                    ["generate", "--checkpoint", "x", "--jsn"], ["convert", "--from", "a", "--to", "b", "--bogus"]):
        result = run([binary("titan"), *command], check=False)
        assert result.returncode == 2 and "unknown option" in result.stderr and "expects a value" not in result.stderr, (command, result.stderr)
    result = run([binary("titan"), "generate", "--checkpoint", "x", "--seed", "-3"], check=False)
    assert result.returncode == 2 and "--seed must be 0 or positive" in result.stderr, result.stderr
    # A train option whose value was left out does not take the next option as its value.
    result = run([binary("titan"), "train", "--job.dump_folder", "--checkpoint.enable"], check=False)
    assert result.returncode == 2 and 'followed by the option "--checkpoint.enable"' in result.stderr, result.stderr
    # `titan plan --help` prints its percentages (its usage was a printf format).
    result = run([binary("titan"), "plan", "--help"])
    assert "within 15% (10% on memory)" in result.stdout, result.stdout[-400:]
    # A folder holding one *.tiktoken file is a tokenizer folder (titan's own {dump_folder}/builtin_tokenizer/).
    folder = tmp_path / "tok"
    folder.mkdir()
    for suffix in (".tiktoken", ".meta.json"):  # the ranks and, beside them, cl100k's pattern and special tokens
        (folder / ("cl100k_base" + suffix)).write_bytes(path.with_suffix(suffix).read_bytes())
    by_folder = run([binary("titan"), "tokenizer", "encode", "--tokenizer", str(folder)], input_text="hello world").stdout
    by_file = run([binary("titan"), "tokenizer", "encode", "--tokenizer", str(path)], input_text="hello world").stdout
    assert by_folder == by_file and by_folder.strip(), (by_folder, by_file)


def test_text_is_utf8_in_every_format_and_a_files_byte_order_mark_is_not_text(tmp_path):
    """Python decodes text strictly and Hugging Face's tokenizers take only str: a row that is not UTF-8 is refused
    in every format, naming the file and the line or row, and --skip-malformed-rows skips that row alone. A UTF-8
    byte-order mark that starts a .txt, .jsonl or fortune file marks the encoding and is not encoded; a U+FEFF
    inside a Parquet value is text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, reference = cl100k()
    eos = 100257
    rows = [b"first row", b"caf\xe9 au lait", b"third row"]  # a Latin-1 byte in the second row

    def tokenize(source, *extra):
        out = tmp_path / ("out-" + source.name + "-" + str(len(extra)))
        result = run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(source),
                      "--output", str(out), *extra], check=False)
        docs = [d for shard in sorted(out.glob("*.tokens")) for d in read_shard(shard)[0]]
        return result, docs

    text = tmp_path / "rows.txt"
    text.write_bytes(b"\n".join(rows) + b"\n")
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes(b"".join(b'{"text": "' + r + b'"}\n' for r in rows))
    fortune = tmp_path / "rows"
    fortune.write_bytes(b"\n%\n".join(rows) + b"\n")
    table = pa.table({"text": pa.array(rows, type=pa.binary()).view(pa.string())})
    parquet = tmp_path / "rows.parquet"
    pq.write_table(table, str(parquet))
    arrow = tmp_path / "rows.arrow"
    with pa.ipc.new_stream(str(arrow), table.schema) as writer:
        writer.write_table(table)
    for source, extra, where in [(text, [], "rows.txt:2: not valid UTF-8 (byte 0xE9 at byte offset 13)"),
                                 (jsonl, [], "rows.jsonl:2: malformed JSON line"),
                                 (fortune, ["--format", "fortune"], "rows:3: not valid UTF-8 (byte 0xE9 at byte offset 15)"),
                                 (parquet, [], 'rows.parquet: row 1: column "text" is not valid UTF-8 (byte 0xE9 at offset 3'),
                                 (arrow, [], 'rows.arrow: row 1: column "text" is not valid UTF-8 (byte 0xE9 at offset 3')]:
        result, docs = tokenize(source, *extra)
        assert result.returncode == 2 and where in result.stderr and not docs, (source, result.stderr)
        if source is text:
            continue  # a .txt file is one document: nothing would be left
        result, docs = tokenize(source, *extra, "--skip-malformed-rows")
        assert json.loads(result.stdout)["skipped_rows"] == 1, result.stderr
        assert docs == [reference.encode_ordinary(r.decode() + ("\n" if source is fortune else "")) + [eos]
                        for r in (rows[0], rows[2])], (source, docs)
    # A byte-order mark at the start of a file: the same tokens as without it.
    good = ["first row", "second row"]
    for name, body, extra in [("bom.txt", "\n".join(good) + "\n", []),
                              ("bom.jsonl", "".join(json.dumps({"text": g}) + "\n" for g in good), []),
                              ("bom", "\n%\n".join(good) + "\n", ["--format", "fortune"])]:
        plain, marked = tmp_path / ("plain-" + name), tmp_path / name
        plain.write_text(body)
        marked.write_bytes(b"\xef\xbb\xbf" + body.encode())
        (_, expected), (result, docs) = tokenize(plain, *extra), tokenize(marked, *extra)
        assert result.returncode == 0 and docs == expected and expected, (name, result.stderr)
    # Inside a value, U+FEFF is a character like any other.
    value = tmp_path / "feff.parquet"
    pq.write_table(pa.table({"text": ["\ufefffirst row"]}), str(value))
    assert tokenize(value)[1] == [reference.encode_ordinary("\ufefffirst row") + [eos]]


def test_text_by_lines_and_paragraphs_as_datasets_reads_it_and_one_file_is_not_dealt_to_several_lanes(tmp_path):
    """format "lines" serves what Hugging Face datasets' text loader (torchtitan's reader of a .txt path) gives with
    sample_by="line", "paragraphs" what it gives with sample_by="paragraph" (blank rows are no documents); a whole
    .txt file is one document, which several data lanes would each read from its start: refused by name."""
    from datasets import load_dataset

    path, reference = cl100k()
    text = tmp_path / "plays.txt"
    text.write_text("\n".join(shared("text", "tinyshakespeare.txt").read_text().splitlines()[:300]) + "\n")
    for fmt, sample_by in [("lines", "line"), ("paragraphs", "paragraph")]:
        out = tmp_path / fmt
        run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(text), "--format", fmt,
             "--output", str(out)])
        ours = [d for shard in sorted(out.glob("*.tokens")) for d in read_shard(shard)[0]]
        rows = load_dataset("text", data_files=str(text), sample_by=sample_by, split="train")["text"]
        expected = [reference.encode_ordinary(r.strip("\n")) + [100257] for r in rows if r.strip()]
        assert len(expected) > (100 if fmt == "lines" else 20) and ours == expected, fmt
    probe = [binary("titan_data_probe"), "--probe.out", str(tmp_path / "p"), "--probe.batches", "2", "--model.hf_assets_path",
             str(path), "--training.dataset_path", str(text), "--training.seq_len", "64", "--training.local_batch_size", "2",
             "--training.data_lanes", "2"]
    refused = run(probe, check=False)
    assert refused.returncode == 2 and "plays.txt\" holds 1 document(s)" in refused.stderr and \
        'training.dataset_format = "paragraphs" or "lines"' in refused.stderr, refused.stderr
    run(probe + ["--training.dataset_format", "paragraphs"])
    lanes = json.loads((tmp_path / "p" / "rank0.json").read_text())["batches"]
    assert all(len({tuple(w) for w in batch}) == len(batch) for batch in lanes)  # the two lanes' windows differ
    # Validation: a full pass over one file on two lanes is refused at start, before any step; a fixed number of
    # batches (which loops over the data) runs.
    train = [binary("titan"), "train", "--model.hf_assets_path", str(shared("tokenizers", "torchtitan_test")),
             "--training.dataset_path", str(text),
             "--training.dataset_format", "paragraphs", "--training.data_lanes", "2", "--training.local_batch_size", "2",
             "--training.seq_len", "64", "--training.steps", "1", "--job.dump_folder", str(tmp_path / "run"),
             "--validation.enable", "--validation.dataset_path", str(text), "--validation.seq_len", "64",
             "--validation.local_batch_size", "1"]
    refused = run(train + ["--validation.steps", "-1"], check=False, env={"TITAN_PEAK_FLOPS": "1e11"})
    assert refused.returncode == 2 and "validation data:" in refused.stderr and "step:" not in refused.stdout, refused.stderr
    assert 'validation.dataset_format = "paragraphs" or "lines"' in refused.stderr
    looped = run(train + ["--validation.steps", "2"], env={"TITAN_PEAK_FLOPS": "1e11"})
    assert "validate step:" in looped.stdout


def test_parquet_sources_serve_the_same_windows_as_jsonl_and_resume(corpus, tmp_path):
    """Parquet (Hugging Face datasets' format) through Arrow C++: the same rows as JSONL give the same windows,
    also shuffled and across a resume that lands inside a row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, paragraphs = corpus
    path, reference = cl100k()
    pq_dir, jl_dir = tmp_path / "pq", tmp_path / "jl"
    pq_dir.mkdir(), jl_dir.mkdir()
    halves = [paragraphs[:3000], paragraphs[3000:6000]]
    for i, rows in enumerate(halves):
        pq.write_table(pa.table({"id": list(range(len(rows))), "content": rows}), pq_dir / f"part-{i}.parquet",
                       row_group_size=128)
        (jl_dir / f"part-{i}.jsonl").write_text("".join(json.dumps({"content": r}) + "\n" for r in rows))

    def probe(source, out, batches, resume=None):
        cmd = [binary("titan_data_probe"), "--probe.out", str(out), "--probe.batches", str(batches),
               "--model.hf_assets_path", str(path), "--training.dataset_path", str(source), "--training.text_field",
               "content", "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.shuffle_buffer",
               "50", "--training.shuffle_shards", "--training.data_seed", "9"]
        run(cmd + (["--probe.resume", str(resume)] if resume else []))
        return json.loads((out / "rank0.json").read_text())["batches"]

    from_jsonl = probe(jl_dir, tmp_path / "j", 30)
    assert probe(pq_dir, tmp_path / "p", 30) == from_jsonl
    first = probe(pq_dir, tmp_path / "a", 13)
    assert first + probe(pq_dir, tmp_path / "b", 17, resume=tmp_path / "a") == from_jsonl

    # titan data tokenize reads Parquet too; a null text is an error naming the file and row, or skipped.
    pq.write_table(pa.table({"content": ["first row", None, "third row"]}), tmp_path / "nulls.parquet")
    result = run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(tmp_path / "nulls.parquet"),
                  "--text-field", "content", "--output", str(tmp_path / "t1")], check=False)
    assert result.returncode == 2 and "nulls.parquet: row 1" in result.stderr, result.stderr
    result = run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(tmp_path / "nulls.parquet"),
                  "--text-field", "content", "--output", str(tmp_path / "t2"), "--skip-malformed-rows"])
    docs, _ = read_shard(tmp_path / "t2" / "part-00000.tokens")
    assert docs == [reference.encode_ordinary(t) + [100257] for t in ["first row", "third row"]]
    # A missing column lists the ones there are.
    result = run([binary("titan"), "data", "tokenize", "--tokenizer", str(path), "--input", str(tmp_path / "nulls.parquet"),
                  "--output", str(tmp_path / "t3")], check=False)
    assert result.returncode == 2 and 'no column "text"' in result.stderr and "[content]" in result.stderr, result.stderr


def test_hugging_face_datasets_arrow_files_serve_the_same_windows_as_jsonl_and_resume(corpus, tmp_path):
    """Arrow IPC as the `datasets` package writes it (save_to_disk folders, its cache files; the stream format)
    and pyarrow's file format: the same rows as JSONL give the same windows, shuffled, across a resume, and in a
    mixture; a DatasetDict folder, a missing column and a damaged file are refused by name."""
    import datasets
    import pyarrow as pa

    _, paragraphs = corpus
    path, _ = cl100k()
    rows = paragraphs[:6000]
    jl_dir, saved = tmp_path / "jl", tmp_path / "saved"
    jl_dir.mkdir()
    for i in range(2):
        (jl_dir / f"part-{i}.jsonl").write_text("".join(json.dumps({"content": r}) + "\n" for r in rows[i * 3000:(i + 1) * 3000]))
    dataset = datasets.Dataset.from_dict({"id": list(range(len(rows))), "content": rows})
    dataset.save_to_disk(str(saved), num_shards=2)
    assert sorted(p.name for p in saved.glob("*.arrow")) == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]

    def probe(out, batches, resume=None, **source):
        cmd = [binary("titan_data_probe"), "--probe.out", str(out), "--probe.batches", str(batches),
               "--model.hf_assets_path", str(path), "--training.seq_len", "64", "--training.local_batch_size", "2",
               "--training.shuffle_buffer", "50", "--training.shuffle_shards", "--training.data_seed", "9"]
        for key, value in source.items():
            cmd += [f"--training.{key}", str(value)]
        result = run(cmd + (["--probe.resume", str(resume)] if resume else []), check=False)
        assert result.returncode == 0, result.stderr
        return json.loads((out / "rank0.json").read_text())["batches"]

    column = {"text_field": "content"}
    from_jsonl = probe(tmp_path / "j", 30, dataset_path=str(jl_dir), **column)
    assert probe(tmp_path / "s", 30, dataset_path=str(saved), **column) == from_jsonl  # the folder, its JSON skipped
    # A .map() on the loaded dataset leaves a cache-*.arrow in the folder; state.json lists the dataset's own files.
    datasets.load_from_disk(str(saved)).map(lambda r: {"content": r["content"].upper()})
    assert list(saved.glob("cache-*.arrow"))
    assert probe(tmp_path / "s2", 30, dataset_path=str(saved), **column) == from_jsonl
    # Hidden folders (a notebook's checkpoint copies) are not data.
    (jl_dir / ".ipynb_checkpoints").mkdir()
    (jl_dir / ".ipynb_checkpoints" / "part-0-checkpoint.jsonl").write_text((jl_dir / "part-0.jsonl").read_text())
    assert probe(tmp_path / "j2", 30, dataset_path=str(jl_dir), **column) == from_jsonl
    assert probe(tmp_path / "g", 30, dataset_path=str(saved / "data-*.arrow"), **column) == from_jsonl  # a glob
    first = probe(tmp_path / "a", 13, dataset_path=str(saved), **column)
    assert first + probe(tmp_path / "b", 17, resume=tmp_path / "a", dataset_path=str(saved), **column) == from_jsonl

    # The file format (pyarrow.ipc.new_file) and one file alone: the same rows as one JSONL file.
    table = pa.table({"content": rows[:3000]})
    with pa.ipc.new_file(str(tmp_path / "one.arrow"), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=100):
            writer.write_batch(batch)
    one = probe(tmp_path / "f", 10, dataset_path=str(tmp_path / "one.arrow"), **column)
    assert one == probe(tmp_path / "fj", 10, dataset_path=str(jl_dir / "part-0.jsonl"), **column)

    # The `datasets` cache: a JSON file loaded by datasets.load_dataset, read from the .arrow file it cached.
    cached = datasets.load_dataset("json", data_files=str(jl_dir / "part-0.jsonl"), cache_dir=str(tmp_path / "cache"),
                                   split="train")
    cache_file = cached.cache_files[0]["filename"]
    assert probe(tmp_path / "c", 10, dataset_path=cache_file, **column) == one

    # In a mixture with JSONL: the same draws as the same mixture of two JSONL sources.
    mixture = lambda first_path: '[{name="a", path="%s", text_field="content", weight=0.7}, ' \
                                 '{name="b", path="%s", text_field="content", weight=0.3}]' % (first_path, jl_dir / "part-1.jsonl")
    assert probe(tmp_path / "m1", 12, datasets=mixture(saved / "data-00000-of-00002.arrow")) == \
        probe(tmp_path / "m2", 12, datasets=mixture(jl_dir / "part-0.jsonl"))

    # A DatasetDict folder names its splits; a missing column lists the columns; a damaged file names itself.
    datasets.DatasetDict({"train": dataset.select(range(10)), "test": dataset.select(range(5))}).save_to_disk(str(tmp_path / "dd"))
    bad = run([binary("titan_data_probe"), "--probe.out", str(tmp_path / "x"), "--probe.batches", "1",
               "--model.hf_assets_path", str(path), "--training.dataset_path", str(tmp_path / "dd")], check=False)
    assert bad.returncode == 2 and "DatasetDict with the splits [test, train]" in bad.stderr, bad.stderr
    bad = run([binary("titan_data_probe"), "--probe.out", str(tmp_path / "x"), "--probe.batches", "1",
               "--model.hf_assets_path", str(path), "--training.dataset_path", str(saved)], check=False)
    assert bad.returncode == 2 and 'no column "text"' in bad.stderr and "[id, content]" in bad.stderr, bad.stderr
    damaged = tmp_path / "damaged.arrow"
    damaged.write_bytes((saved / "data-00000-of-00002.arrow").read_bytes()[:5000])
    bad = run([binary("titan_data_probe"), "--probe.out", str(tmp_path / "x"), "--probe.batches", "1",
               "--model.hf_assets_path", str(path), "--training.dataset_path", str(damaged), "--training.text_field",
               "content"], check=False)
    assert bad.returncode == 2 and "damaged.arrow" in bad.stderr, bad.stderr
