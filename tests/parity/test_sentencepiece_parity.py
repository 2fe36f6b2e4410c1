"""SentencePiece tokenizers (Llama 2 family) against Python `sentencepiece` and HF `tokenizers`: a .model file
read through the SentencePiece library, and the two tokenizer.json layouts Hugging Face uses for such models
(Metaspace pre-tokenizer; the older Prepend/Replace normalizer), with byte fallback; plus added special and
chat-template tokens."""
import json

import pytest

from titan_testing import shared
from test_tokenizer_parity import TEXTS, titan_decode, titan_encode_many

EXTRA = TEXTS + [" leading space", "two  spaces and\ttabs\t\tand\nnewlines\n\n", "x", "<s> and </s> as text"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("spm")
    corpus = shared("text", "tinyshakespeare.txt")
    out = {}
    # Llama 2's trainer settings: BPE, byte fallback, digits split, no normalisation or whitespace folding.
    for name, kind in (("bpe", "bpe"), ("unigram", "unigram")):
        spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(root / name), vocab_size=1000, model_type=kind,
                                       byte_fallback=True, split_digits=True, normalization_rule_name="identity",
                                       remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
                                       character_coverage=1.0, num_threads=2, minloglevel=2)
        out[name] = root / f"{name}.model"
    return out


def hf_json_from_spm(model_path, layout, tmp_path):
    """The tokenizer.json Hugging Face derives from a SentencePiece BPE model, in the modern (Metaspace) or legacy
    (Prepend + Replace normalizer) layout."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    # Vocabulary and merges as HF's converter derives them: every split of a piece into two pieces is a merge,
    # ranked by the merged piece's id (SentencePiece BPE ids follow merge order).
    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    ranked = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_unknown(pid) or sp.is_byte(pid):
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((pid, vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(ranked)]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if layout == "metaspace":
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<s>", "</s>", "<unk>"])
    path = tmp_path / f"{layout}.json"
    tok.save(str(path))
    return path, tok


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_sentencepiece_model_matches_python_sentencepiece(models, kind):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(models[kind]))
    texts = EXTRA + [shared("text", "tinyshakespeare.txt").read_text()[:30000]]
    mine = titan_encode_many(models[kind], texts)
    for text, ids in zip(texts, mine):
        assert ids == sp.encode(text), text[:80]
    for text, ids in zip(texts[:8], mine[:8]):
        assert titan_decode(models[kind], ids) == sp.decode(ids), text[:80]
    # BOS/EOS come from the model, as the training pipeline adds them.
    doc = titan_encode_many(models[kind], ["Hello"], document=True)[0]
    assert doc == [sp.bos_id()] + sp.encode("Hello") + [sp.eos_id()]


@pytest.mark.parametrize("layout", ["metaspace", "legacy"])
def test_spm_style_tokenizer_json_matches_hf_tokenizers(models, tmp_path, layout):
    import sentencepiece as spm

    path, ref = hf_json_from_spm(models["bpe"], layout, tmp_path)
    sp = spm.SentencePieceProcessor(model_file=str(models["bpe"]))
    texts = [t for t in EXTRA if t] + [shared("text", "tinyshakespeare.txt").read_text()[:30000]]
    mine = titan_encode_many(path, texts)
    for text, ids in zip(texts, mine):
        expected = ref.encode(text).ids
        assert ids == expected, text[:80]
        # The reference itself agrees with sentencepiece, except on runs of whitespace, which sentencepiece's own
        # BPE (allow_whitespace_only_pieces) groups differently from HF's, and on a leading space, where HF's
        # prepend scheme adds no second "▁".
        if layout == "metaspace" and "<s>" not in text and not text.startswith(" ") and not any(w in text for w in ("  ", "\t", "\u2003", "\n\n")):
            assert expected[1:] == sp.encode(text), text[:80]
    for ids in mine[:10]:
        assert titan_decode(path, ids) == ref.decode(ids, skip_special_tokens=False)


def test_added_chat_template_tokens_are_recognised(tmp_path):
    """Chat-template tokens added to a tokenizer.json are single ids wherever they appear, as in HF tokenizers."""
    from tokenizers import Tokenizer

    base = shared("tokenizers", "torchtitan_test", "tokenizer.json")
    tok = Tokenizer.from_file(str(base))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    chat = ("<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>")
    texts = [chat, "no specials here", "<|im_start|><|im_start|>x<|im_end|>"]
    for text, ids in zip(texts, titan_encode_many(path, texts)):
        assert ids == tok.encode(text).ids, text
    assert titan_decode(path, tok.encode(chat).ids) == tok.decode(tok.encode(chat).ids, skip_special_tokens=False)
