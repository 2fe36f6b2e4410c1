"""Complete Hugging Face exports: checkpoint.last_save_in_hf and `titan convert --to <dir> --format hf` write
config.json with BOS/EOS ids, generation_config.json and the run's tokenizer files, so that transformers'
AutoTokenizer gives the ids the reference libraries give (tiktoken for tiktoken-format ranks, HF tokenizers for a
tokenizer.json) and pipeline("text-generation") runs with no hand copying."""
import json
import shutil

import pytest
import torch

from titan_testing import SOURCE_DIR, binary, run, shared

# Meta's Llama 3 split pattern (tiktoken's format).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TEXTS = ["ROMEO: But, soft! what light through yonder window breaks?",
         "  leading spaces, tabs\tand\nnewlines\n\n", "numbers 1234567 and 3.14159, code: for (int i=0;i<n;++i) {}",
         "unicode: café, naïve, 日本語, emoji 🙂", "'s 're 've CAPS MiXeD"]


def train_with_hf_export(dump, tokenizer, extra=()):
    return run([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                "--job.dump_folder", str(dump), "--training.seq_len", "32", "--training.local_batch_size", "2",
                "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "10",
                "--checkpoint.last_save_in_hf", "--model.hf_assets_path", str(tokenizer), "--debug.seed", "0", *extra],
               env={"OMP_NUM_THREADS": "2"})


def tiktoken_reference(ranks_path, pattern, specials):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    return tiktoken.Encoding(name="reference", pat_str=pattern, mergeable_ranks=load_tiktoken_bpe(str(ranks_path)),
                             special_tokens=specials)


def check_export(directory, expected_ids, bos, eos, expected_text=lambda ids, text: text):
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM, pipeline

    config = json.loads((directory / "config.json").read_text())
    assert config["bos_token_id"] == bos and config["eos_token_id"] == eos
    generation = GenerationConfig.from_pretrained(str(directory))
    tok = AutoTokenizer.from_pretrained(str(directory))
    assert tok.bos_token_id == bos and tok.eos_token_id == eos and generation.eos_token_id == eos
    for text in TEXTS:
        assert tok(text)["input_ids"] == expected_ids(text), text
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == expected_text(ids, text)
    model = LlamaForCausalLM.from_pretrained(str(directory), torch_dtype=torch.float32)
    generate = pipeline("text-generation", model=model, tokenizer=tok)
    out = generate("ROMEO:", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert out.startswith("ROMEO:") and len(out) > len("ROMEO:")
    # generate() stops at EOS by the exported generation config: weights edited so that EOS always wins (blocks
    # silenced, the residual stream's first feature 1 for every token and read only by EOS's output row).
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos, 0] = 10.0
    prompt = tok("ROMEO:", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=10, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert generated.tolist() == [eos]


def test_builtin_tokenizer_export(tmp_path):
    dump = tmp_path / "run"
    result = train_with_hf_export(dump, "builtin")
    assert "Saved the last checkpoint as a Hugging Face model" in result.stdout
    export = dump / "checkpoint" / "step-2"
    assert not (export / "metadata.json").exists() and (export / "model.safetensors").exists()
    ranks = next((dump / "builtin_tokenizer").glob("*.tiktoken"))
    # The built-in BPE has Llama 3's layout: its 256 special tokens follow the ranks, BOS and EOS first.
    bos = sum(1 for line in ranks.read_text().splitlines() if line.strip())
    eos = bos + 1
    reference = tiktoken_reference(ranks, LLAMA3_PATTERN, {})
    check_export(export, lambda text: [bos] + reference.encode_ordinary(text), bos, eos)
    # The run resumes from its newest titan checkpoint and leaves the export alone (it is not quarantined).
    again = train_with_hf_export(dump, "builtin", ["--training.steps", "3"])
    assert "quarantined" not in again.stdout + again.stderr


def test_tiktoken_llama3_layout_export(tmp_path):
    """cl100k's ranks as a Llama 3-layout tokenizer.model (no meta file: Llama 3's pattern and 256 special tokens
    after the ranks); a custom model shape with a vocabulary that holds them."""
    assets = tmp_path / "assets"
    assets.mkdir()
    shutil.copy(shared("tokenizers", "cl100k_base.tiktoken"), assets / "tokenizer.model")
    dump = tmp_path / "run"
    train_with_hf_export(dump, assets, ["--model.vocab_size", "100608", "--model.dim", "64", "--model.n_heads", "4",
                                        "--model.n_layers", "2"])
    reference = tiktoken_reference(assets / "tokenizer.model", LLAMA3_PATTERN, {})
    bos, eos = 100256, 100257  # <|begin_of_text|>, <|end_of_text|> right after the ranks
    check_export(dump / "checkpoint" / "step-2", lambda text: [bos] + reference.encode_ordinary(text), bos, eos)
    tok_config = json.loads((dump / "checkpoint" / "step-2" / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<|begin_of_text|>" and tok_config["eos_token"] == "<|end_of_text|>"


def test_hf_tokenizer_json_export_and_convert(tmp_path):
    """torchtitan's test tokenizer (tokenizer.json + tokenizer_config.json) goes along as it is; `titan convert`
    of a titan checkpoint finds the tokenizer its run recorded."""
    from transformers import AutoTokenizer

    source = shared("tokenizers", "torchtitan_test")
    dump = tmp_path / "run"
    train_with_hf_export(dump, source, ["--checkpoint.interval", "1"])
    expected = AutoTokenizer.from_pretrained(str(source))
    bos, eos = expected.bos_token_id, expected.eos_token_id
    assert bos is not None and eos is not None
    # This tokenizer.json has no decoder (it joins tokens without spaces): the export decodes as the source does.
    same_decode = lambda ids, text: expected.decode(ids, skip_special_tokens=True)  # noqa: E731
    check_export(dump / "checkpoint" / "step-2", lambda text: expected(text)["input_ids"], bos, eos, same_decode)
    out = tmp_path / "converted"
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-1"), "--to", str(out)])
    check_export(out, lambda text: expected(text)["input_ids"], bos, eos, same_decode)


def test_last_save_in_hf_needs_a_model_only_last_save(tmp_path):
    result = run([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                  "--job.dump_folder", str(tmp_path), "--training.steps", "1", "--checkpoint.enable",
                  "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "false"], check=False)
    assert result.returncode == 2 and \
        "checkpoint.last_save_in_hf needs checkpoint.last_save_model_only = true" in result.stderr, result.stderr


def test_a_longer_run_after_an_hf_last_save_keeps_the_export(tmp_path):
    """The run's last save became step-2's Hugging Face export; the same job with more steps resumes from step-1
    (titan's), keeps the export where its own step-2 would go (a warning says so) and saves steps 3 and 4."""
    dump = tmp_path / "dump"
    common = [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
              "--job.dump_folder", str(dump), "--training.seq_len", "32", "--training.local_batch_size", "2",
              "--checkpoint.enable", "--checkpoint.interval", "1", "--debug.seed", "0"]
    run(common + ["--training.steps", "2", "--checkpoint.last_save_in_hf"])
    export = dump / "checkpoint" / "step-2"
    files = sorted(p.name for p in export.iterdir())
    assert "config.json" in files and not (export / "metadata.json").exists()
    result = run(common + ["--training.steps", "4"])
    assert "step-2 already exists and is not a titan checkpoint" in result.stdout + result.stderr, result.stdout
    assert sorted(p.name for p in export.iterdir()) == files
    for step in (3, 4):
        assert (dump / "checkpoint" / f"step-{step}" / "metadata.json").exists()
    assert not list((dump / "checkpoint").glob("*.partial"))


def test_last_save_in_hf_exports_the_routing_biases_or_says_it_cannot(tmp_path):
    """The in-place export of the last save carries what `titan convert` carries: DeepSeek-V3's balancing biases as
    e_score_correction_bias; Qwen3-MoE's format has no place for them, and the run warns (docs/moe.md)."""
    from safetensors.torch import load_file

    moe = ["--model.moe_top_k", "2", "--model.moe_inter_dim", "32", "--model.moe_load_balance_coeff", "0.01"]
    families = {
        # The 671B flavor's routing (sigmoid scores over groups: what Hugging Face's model computes) on a tiny shape.
        "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "671B", "--model.vocab_size", "2048", "--model.dim", "64",
                        "--model.n_layers", "2", "--model.n_dense_layers", "1", "--model.n_heads", "4", "--model.hidden_dim", "128",
                        "--model.q_lora_rank", "32", "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16",
                        "--model.qk_rope_head_dim", "16", "--model.v_head_dim", "16", "--model.moe_num_experts", "16",
                        "--model.max_seq_len", "8192"],
        "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.dim", "64", "--model.n_layers", "2",
                  "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.head_dim", "16", "--model.moe_num_experts", "4"],
    }
    for family, shape in families.items():
        dump = tmp_path / family
        result = run([binary("titan"), "train", "--job.dump_folder", str(dump), *shape, *moe, "--model.hf_assets_path", "builtin",
                      "--training.dataset", "fortunes", "--training.seq_len", "32", "--training.local_batch_size", "2",
                      "--training.steps", "3", "--checkpoint.enable", "--checkpoint.interval", "10", "--checkpoint.last_save_in_hf",
                      "--debug.seed", "0"])
        weights = load_file(str(dump / "checkpoint" / "step-3" / "model.safetensors"))
        biases = [k for k in weights if k.endswith("e_score_correction_bias")]
        if family == "deepseek_v3":
            assert biases and any(weights[k].abs().max() > 0 for k in biases), sorted(weights)
        else:
            assert not biases and "has no place for" in result.stdout + result.stderr, result.stdout[-3000:]
