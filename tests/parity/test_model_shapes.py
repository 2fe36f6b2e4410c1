"""Model shapes from configuration: any Llama 3-architecture shape from [model] keys or from a Hugging Face
config.json, checked against transformers' LlamaForCausalLM (logits, parameter count, exported config), and every
config.json field that changes the computation compared with the configured model, naming both values."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_testing import SOURCE_DIR, binary, read_checkpoint, run, shared

# An odd shape no flavor has: GQA 6/2 heads of 16, feed-forward 200 wide, RoPE base 10000 without scaling, eps 1e-6.
ODD = dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, intermediate_size=200,
           vocab_size=2048, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=False)


def hf_model(directory, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**ODD, **overrides})).eval()
    model.save_pretrained(str(directory))
    return model


def train(dump, extra, steps=1):
    return run([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                "--job.dump_folder", str(dump), "--training.seq_len", "64", "--training.local_batch_size", "2",
                "--training.steps", str(steps), "--debug.seed", "0", *extra], check=False, env={"OMP_NUM_THREADS": "2"})


def titan_logits(tmp_path, config_json, weights, tokens):
    save_file({"inputs": tokens, "labels": torch.roll(tokens, -1, 1)}, str(tmp_path / "batch.safetensors"))
    run([binary("titan_model_probe"), "--hf-config", str(config_json), "--weights", str(weights),
         "--batch", str(tmp_path / "batch.safetensors"), "--out", str(tmp_path / "out.safetensors")])
    return load_file(str(tmp_path / "out.safetensors"))["logits"]


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
def test_config_json_shape_gives_transformers_logits(tmp_path, scaling):
    """titan builds the model config.json describes (theta 10000, eps 1e-6, with and without Llama 3.1 scaling
    at a short original context, so that scaling changes the result) and computes HF's logits."""
    hf = tmp_path / "hf"
    model = hf_model(hf, rope_scaling=scaling)
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
    got = titan_logits(tmp_path, hf / "config.json", hf / "model.safetensors", tokens)
    assert (got - expected).abs().max().item() < 2e-5


def test_training_takes_the_shape_from_hugging_face_weights_and_exports_it_back(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tmp_path / "hf"
    model = hf_model(hf)
    dump = tmp_path / "run"
    result = train(dump, ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.initial_load_path", str(hf),
                          "--checkpoint.initial_load_in_hf", "--optimizer.lr", "1e-30", "--model.flavor", "hf"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Model llama3 from {hf}/config.json size: {model.num_parameters():,} total parameters" in result.stdout
    meta, saved = read_checkpoint(dump / "checkpoint" / "step-1")
    assert meta["model"]["ffn_hidden_dim"] == 200 and meta["model"]["rope_scaling"] is None
    # Back to HF without naming a flavor: the checkpoint knows its shape; transformers gives the original logits.
    out = tmp_path / "out"
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-1"), "--to", str(out)])
    config = json.loads((out / "config.json").read_text())
    for key in ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                "vocab_size", "rope_theta", "rms_norm_eps"]:
        assert config[key] == ODD[key], key
    assert config["rope_scaling"] is None
    exported = LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 2048, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (exported(input_ids=tokens).logits - model(input_ids=tokens).logits).abs().max().item() < 1e-5
    # HF -> titan without --flavor keeps the shape too.
    back = tmp_path / "back"
    run([binary("titan"), "convert", "--from", str(hf), "--to", str(back)])
    back_meta, back_tensors = read_checkpoint(back)
    assert back_meta["model"] == {**meta["model"], "max_seq_len": 128}
    for key in saved:
        assert (back_tensors[key] == saved[key]).all(), key


def test_shape_keys_in_a_toml_train_the_shape_transformers_counts(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    toml = tmp_path / "shape.toml"
    toml.write_text((SOURCE_DIR / "configs" / "debug_model.toml").read_text().replace(
        'flavor = "debugmodel"', 'flavor = "debugmodel"\ndim = 96\nn_layers = 2\nn_heads = 6\nn_kv_heads = 2\n'
        'multiple_of = 64\nffn_dim_multiplier = 1.2\nnorm_eps = 1e-6\nrope_theta = 10000.0\nrope_scaling = "none"'))
    dump = tmp_path / "run"
    result = run([binary("titan"), "train", "--job.config_file", str(toml), "--job.dump_folder", str(dump),
                  "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "2",
                  "--checkpoint.enable", "--checkpoint.interval", "2"], check=False, env={"OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-3000:]
    # int(8 * 96 / 3) = 256, x 1.2 = 307, rounded up to a multiple of 64: 320
    expected = LlamaForCausalLM(LlamaConfig(**{**ODD, "intermediate_size": 320})).num_parameters()
    assert f"size: {expected:,} total parameters" in result.stdout
    out = tmp_path / "out"
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-2"), "--to", str(out)])
    config = json.loads((out / "config.json").read_text())
    assert config["intermediate_size"] == 320 and config["rms_norm_eps"] == 1e-6 and config["rope_theta"] == 10000.0


@pytest.mark.parametrize("change,needle", [
    ({"rope_theta": 10000.0}, "rope_theta: 10000 vs 500000"),
    ({"rms_norm_eps": 1e-6}, "norm_eps (rms_norm_eps): 1e-06 vs 1e-05"),
    ({"rope_scaling": None}, "rope scaling (rope_scaling): none vs llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "rope_scaling factor: 32 vs 8"),
    ({"num_key_value_heads": 4}, "n_kv_heads (num_key_value_heads): 4 vs 16"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings: true vs false"),
    ({"hidden_act": "gelu"}, 'hidden_act = "gelu"'),
    ({"attention_bias": True}, "attention_bias = true; Llama 3 has no biases"),
    ({"mlp_bias": True}, "mlp_bias = true"),
    ({"head_dim": 32}, "head_dim = 32, but titan's attention uses hidden_size / num_attention_heads = 16"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 'rope_scaling type "linear" is not supported'),
])
def test_hugging_face_fields_that_change_the_computation_are_checked(tmp_path, change, needle):
    """Each field of config.json that the debug flavor computes differently is an error naming it and both values
    (before, theta 10000, eps 1e-6 or a missing rope_scaling loaded silently into a different model)."""
    debug = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
             "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 2048,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**debug, **change}))
    save_file({"model.norm.weight": torch.ones(256)}, str(hf / "model.safetensors"))
    result = run([binary("titan"), "convert", "--from", str(hf), "--to", str(tmp_path / "out"), "--flavor", "debugmodel"],
                 check=False)
    assert result.returncode == 2 and needle in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
    # Training from these weights with model.flavor named says the same.
    if "rope_theta" in change:
        result = train(tmp_path / "run", ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"])
        assert result.returncode == 2 and needle in result.stderr and "model.flavor" in result.stderr, result.stderr


def test_bad_shape_keys_name_the_key(tmp_path):
    cases = [(["--model.n_heads", "5"], "model dim 256 is not divisible by n_heads 5"),
             (["--model.n_kv_heads", "3"], "n_heads 16 must be a multiple of n_kv_heads 3"),
             (["--model.rope_scaling", "none", "--model.rope_scaling_factor", "4"],
              "model.rope_scaling_factor (set at command line (--model.rope_scaling_factor)) has no effect: RoPE scaling is off"),
             (["--model.max_seq_len", "32"], "model.max_seq_len = 32 (set at command line (--model.max_seq_len)) is shorter than training.seq_len = 64"),
             (["--model.dim", "0"], "model.dim must be greater than 0"),
             (["--model.rope_scaling", "yarn"], "model.rope_scaling must be one of {flavor, llama3, none}")]
    for extra, needle in cases:
        result = train(tmp_path / "run", extra)
        assert result.returncode == 2 and needle in result.stderr, (extra, result.stderr[-2000:])
    # Shape keys over a Hugging Face config.json must agree with it.
    hf = tmp_path / "hf"
    hf_model(hf)
    result = train(tmp_path / "run2", ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf",
                                       "--model.flavor", "hf", "--model.rope_theta", "500000"])
    assert result.returncode == 2 and "rope_theta: 10000 vs 500000" in result.stderr, result.stderr[-2000:]


def test_files_of_older_and_tied_exports_train_as_transformers_reads_them(tmp_path):
    """What transformers ignores titan ignores too, saying so: RoPE frequencies older versions saved
    (rotary_emb.inv_freq) and an lm_head.weight beside tied embeddings. The folder's own tokenizer is the default, and
    training past max_position_embeddings is said. The run keeps its own copy of that tokenizer: it resumes with the
    folder's tokenizer changed, and with the folder gone."""
    hf = tmp_path / "hf"
    hf_model(hf, tie_word_embeddings=True)
    weights = load_file(str(hf / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(hf / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = shared("tokenizers", "torchtitan_test")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).write_bytes((tokenizer / name).read_bytes())
    def train(steps):
        return run([binary("titan"), "train", "--job.dump_folder", str(tmp_path / "run"), "--training.dataset", "fortunes",
                    "--training.seq_len", "256", "--training.local_batch_size", "1", "--training.steps", str(steps),
                    "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf", "--model.flavor", "hf",
                    "--checkpoint.enable", "--checkpoint.last_save_model_only", "false", "--metrics.disable_color_printing"],
                   env={"OMP_NUM_THREADS": "2"})
    result = train(1)
    for needle in ['skipped 1 tensor(s) of RoPE frequencies older transformers versions saved',
                   '"lm_head.weight" is not read: the model\'s output uses the embedding\'s table',
                   f'Tokenizer of "{hf}", the folder the weights come from',
                   'training.seq_len = 256 is longer than the 128 positions of']:
        assert needle in result.stdout + result.stderr, (needle, result.stdout[-3000:])
    assert "step:  1" in result.stdout
    (hf / "tokenizer.json").write_text("{}")  # no longer a tokenizer
    for steps in (2, 3):
        resumed = train(steps)
        assert "the model is the one it records" in resumed.stdout, resumed.stdout[-3000:]
        assert f"Training completed: {steps} steps" in resumed.stdout, resumed.stdout[-3000:]
        assert f"Tokenizer: the copy {tmp_path / 'run' / 'hf_tokenizer'}" in resumed.stdout, resumed.stdout[-3000:]
        if hf.exists():  # and then no folder at all
            for path in hf.iterdir():
                path.unlink()
            hf.rmdir()


def test_a_titan_checkpoint_gives_its_model_mask_included_to_train_plan_and_estimate(tmp_path):
    """A run that starts from a titan checkpoint and names no flavor (or flavor "hf") trains the model the checkpoint
    records, with its flavor's attention mask (block-causal here); titan estimate and titan plan take the same one."""
    def train_plain(dump, extra):  # no TOML: it would name a flavor
        return run([binary("titan"), "train", "--job.dump_folder", str(dump), "--model.hf_assets_path", "builtin",
                    "--training.dataset", "fortunes", "--training.seq_len", "32", "--training.local_batch_size", "2",
                    "--training.steps", "1", "--metrics.disable_color_printing", *extra], env={"OMP_NUM_THREADS": "2"})
    train_plain(tmp_path / "first", ["--model.flavor", "debugmodel_flex_attn", "--model.n_layers", "2", "--checkpoint.enable"])
    start = tmp_path / "first" / "checkpoint" / "step-1"
    meta, _ = read_checkpoint(start)
    for flavor in ([], ["--model.flavor", "hf"]):
        result = train_plain(tmp_path / f"from{len(flavor)}", ["--checkpoint.initial_load_path", str(start), *flavor])
        assert "the checkpoint the run starts from" in result.stdout and "Attention mask: block_causal" in result.stdout, result.stdout
        assert "Model llama3 debugmodel_flex_attn size: " in result.stdout, result.stdout
    explicit = ["--model.flavor", "debugmodel_flex_attn", "--model.n_layers", "2"]
    for command in (["estimate", "--json"], ["plan", "--json", "--cluster", "h100-sxm", "--gpus", "1"]):
        mine = json.loads(run([binary("titan"), *command, "--checkpoint.initial_load_path", str(start)]).stdout)
        named = json.loads(run([binary("titan"), *command, *explicit]).stdout)
        for key in ("flavor", "model"):  # labels
            mine.pop(key, None), named.pop(key, None)
        assert mine == named, (command, mine, named)
    assert meta["model"]["n_layers"] == 2 and meta["model"]["attn_mask"] == "block_causal"
