"""titan's tokenizers against tiktoken and HF tokenizers (and torchtitan's wrapper) on varied text."""
import json
import time

import pytest

from titan_testing import binary, run, shared

TEXTS = [
    "Hello world, the cat! It's 2026; we're testing.",
    "def main(argc, argv):\n    return {'x': [1, 2, 3]}  # code\n\tindented\r\n",
    "Ünïcödé: naïve café, Ærøskøbing, Straße, İstanbul",
    "日本語のテキストと中文混合，한국어도 있습니다。",
    "Русский текст и ελληνικά, עברית, العربية, हिन्दी",
    "emoji 🎉🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵, ZWJ sequences",
    "    leading spaces\n\n\n   \t  mixed \u00a0whitespace\u2003runs   \n",
    "numbers 1234567890 3.14159 1e-9 0xDEADBEEF 1,000,000",
    "a" * 3000,
    "abc" * 1000 + " " + "xyz " * 500,
    "don't I'LL WE'VE they'D she'S",
    "next\u0085line and\u2028separator",
    "<|endoftext|> special-looking <|begin_of_text|> text",
    "",
]


def titan_encode(tokenizer, text, document=False):
    args = [binary("titan"), "tokenizer", "encode", "--tokenizer", str(tokenizer)] + (["--document"] if document else [])
    return json.loads(run(args, input_text=text).stdout)


def titan_encode_many(tokenizer, texts, document=False):
    """One titan process encodes many texts (--jsonl), one JSON array per line."""
    args = [binary("titan"), "tokenizer", "encode", "--jsonl", "--tokenizer", str(tokenizer)] + (["--document"] if document else [])
    out = run(args, input_text="".join(json.dumps(t) + "\n" for t in texts)).stdout
    return [json.loads(line) for line in out.splitlines()]


def titan_decode(tokenizer, ids):
    return run([binary("titan"), "tokenizer", "decode", "--tokenizer", str(tokenizer)], input_text=json.dumps(ids)).stdout


def cl100k():
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    path = shared("tokenizers", "cl100k_base.tiktoken")
    meta = json.loads(shared("tokenizers", "cl100k_base.meta.json").read_text())
    enc = tiktoken.Encoding("cl100k_base", pat_str=meta["pat_str"], mergeable_ranks=load_tiktoken_bpe(str(path)),
                            special_tokens=meta["special_tokens"])
    return path, enc


def test_tiktoken_cl100k():
    path, enc = cl100k()
    all_ids = titan_encode_many(path, TEXTS)
    for text, ids in zip(TEXTS, all_ids):
        assert ids == enc.encode_ordinary(text), text[:80]
    for text in TEXTS[:3]:
        ids = titan_encode(path, text)  # raw stdin, \r\n kept
        assert ids == enc.encode_ordinary(text)
        assert titan_decode(path, ids) == enc.decode(ids)


def test_tiktoken_prose_file_and_speed():
    path, enc = cl100k()
    text = shared("text", "tinyshakespeare.txt").read_text()
    ids = titan_encode(path, text)
    assert ids == enc.encode_ordinary(text)
    # A long word must not take quadratic time: 200k bytes without a pre-tokenizer split.
    long_word = "x" * 200_000
    start = time.time()
    assert titan_encode(path, long_word) == enc.encode_ordinary(long_word)
    assert time.time() - start < 30


def test_torchtitan_test_tokenizer_matches_hf_tokenizers():
    from tokenizers import Tokenizer

    folder = shared("tokenizers", "torchtitan_test")
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # torchtitan adds the tokenizer_config.json specials to the HF tokenizer; do the same through its own wrapper.
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    wrapped = HuggingFaceTokenizer(str(folder))
    texts = TEXTS + [shared("text", "tinyshakespeare.txt").read_text()[:20000]]
    assert titan_encode_many(folder, texts) == [wrapped.tokenizer.encode(t).ids for t in texts]
    assert titan_encode_many(folder, texts, document=True) == [wrapped.encode(t, add_bos=True, add_eos=True) for t in texts]
    assert titan_encode(folder, texts[1]) == wrapped.tokenizer.encode(texts[1]).ids
    info = json.loads(run([binary("titan"), "tokenizer", "info", "--tokenizer", str(folder)]).stdout)
    assert info["bos_id"] == wrapped.bos_id and info["eos_id"] == wrapped.eos_id
    assert info["vocab_size"] == wrapped.get_vocab_size()


def llama3_style_tokenizer_json(tmp_path):
    """A Llama 3-layout tokenizer.json (Split regex + ByteLevel, ignore_merges, BOS template) built by
    transformers' own tiktoken converter from the cl100k ranks."""
    from tokenizers import processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path, enc = cl100k()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok = TikTokenConverter(vocab_file=str(path), extra_special_tokens=specials).converted()
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    folder = tmp_path / "llama3_style"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder, tok


def test_llama3_layout_tokenizer_json(tmp_path):
    folder, ref = llama3_style_tokenizer_json(tmp_path)
    texts = TEXTS + [shared("text", "tinyshakespeare.txt").read_text()[:50000]]
    all_ids = titan_encode_many(folder, texts)
    for text, ids in zip(texts, all_ids):
        assert ids == ref.encode(text).ids, text[:80]
    for ids in all_ids[:4]:
        assert titan_decode(folder, ids) == ref.decode(ids, skip_special_tokens=False)


def test_builtin_bpe_training_round_trips_through_tiktoken(tmp_path):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    corpus = shared("text", "tinyshakespeare.txt")
    out = tmp_path / "shakespeare.tiktoken"
    run([binary("titan"), "tokenizer", "train", "--input", str(corpus), "--vocab-size", "1024", "--output", str(out)])
    ranks = load_tiktoken_bpe(str(out))
    assert len(ranks) == 1024 - 256
    from titan_testing import SOURCE_DIR  # noqa: F401

    pattern = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
    enc = tiktoken.Encoding("trained", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    text = corpus.read_text()[:50000]
    ids = titan_encode(out, text)
    assert ids == enc.encode_ordinary(text)
    # Learned merges compress: far fewer tokens than bytes.
    assert len(ids) < 0.5 * len(text.encode())


def test_decode_refuses_ids_that_are_not_tokens(tmp_path):
    """Floats, negatives, ids past int32 and ids no token has (a gap in the ranks) are errors naming the value,
    never truncated or decoded to nothing; tiktoken's own decode agrees that the gap is not a token."""
    import base64

    import tiktoken

    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 300  # ids 256..299 belong to no token
    path = tmp_path / "gappy.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    enc = tiktoken.Encoding("gappy", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    assert titan_decode(path, [104, 300, 105]) == enc.decode([104, 300, 105]) == "habi"
    with pytest.raises(KeyError):
        enc.decode([260])
    for ids, needle in [([104, 1.5], "element 1 of the input is 1.5"), ([-3], "element 0 of the input is -3"),
                        ([4294967296], "element 0 of the input is 4294967296"), (["7"], 'element 0 of the input is "7"'),
                        ([260], "token id 260 is outside the vocabulary")]:
        result = run([binary("titan"), "tokenizer", "decode", "--tokenizer", str(path)], input_text=json.dumps(ids),
                     check=False)
        assert result.returncode == 2 and needle in result.stderr, (ids, result.stderr)


# Text whose forms differ: precomposed and decomposed accents, compatibility characters (ligatures, full-width
# letters, superscripts, the Kelvin sign), Hangul, final sigma for lowercasing, and Qwen-like code and Chinese.
UNICODE_TEXTS = [
    "caf\u00e9 vs cafe\u0301, \u00c5ngstr\u00f6m vs A\u030angstro\u0308m, \u212b and \u212a",
    "\ufb01nance \ufb02ow \uff21\uff22\uff23\uff11\uff12\uff13 x\u00b2 \u2460 \u3231",
    "\u1100\u1161\u11a8 \uac01 \u00bd \u2126",
    "\u039f\u0394\u03a5\u03a3\u03a3\u0395\u03a5\u03a3 \u0399\u03a3 \u0130stanbul \u00df STRASSE",
    "def f(x):\n    return \"\u4f60\u597d\uff0c\u4e16\u754c\" + str(x)  # \u65e5\u672c\u8a9e\u30c6\u30ad\u30b9\u30c8",
    "plain ASCII only, unchanged by every form",
]


@pytest.mark.parametrize("normalizer", ["NFC", "NFD", "NFKC", "NFKD", "Lowercase", "NFC+Lowercase"])
def test_unicode_normalizers_match_hf_tokenizers(tmp_path, normalizer):
    """Qwen2/2.5/3's tokenizer.json normalizes with NFC before its Split + ByteLevel pre-tokenizer: the same layout
    with each of HF tokenizers' Unicode normalizers (and two in a Sequence) gives HF tokenizers' ids and decoding."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    steps = [getattr(normalizers, name)() for name in normalizer.split("+")]
    tok = Tokenizer(models.BPE())
    tok.normalizer = steps[0] if len(steps) == 1 else normalizers.Sequence(steps)
    # Qwen2's split pattern, then bytes.
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = shared("text", "tinyshakespeare.txt").read_text()[:50000].splitlines() + UNICODE_TEXTS * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        special_tokens=["<|endoftext|>"], show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    texts = UNICODE_TEXTS + TEXTS[:4]
    for text, ids in zip(texts, titan_encode_many(path, texts)):
        assert ids == tok.encode(text).ids, (normalizer, text)
        assert titan_decode(path, ids) == tok.decode(ids), (normalizer, text)


def test_tokenizer_train_reads_what_training_reads(tmp_path):
    """`titan tokenizer train` learns from the documents training reads: a gzipped JSONL file's text field (here
    "content", given by --text-field) through a glob, not the files' bytes (JSON syntax, gzip's)."""
    import base64
    import gzip

    lines = shared("text", "tinyshakespeare.txt").read_text().splitlines()[:4000]
    with gzip.open(tmp_path / "part-0.jsonl.gz", "wt") as f:
        for line in lines:
            f.write(json.dumps({"id": 1, "content": line}) + "\n")
    out = tmp_path / "trained.tiktoken"
    run([binary("titan"), "tokenizer", "train", "--input", str(tmp_path / "*.jsonl.gz"), "--text-field", "content",
         "--vocab-size", "1024", "--output", str(out)])
    merges = [base64.b64decode(token) for token in out.read_text().split()[0::2][256:]]
    assert len(merges) == 1024 - 512
    text = "\n".join(lines).encode()
    assert all(m in text for m in merges[:100]), [m for m in merges[:100] if m not in text]
    assert not any(b'"' in m or b"{" in m or b"content" in m for m in merges)
