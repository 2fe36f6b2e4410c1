"""titan's Qwen3 against Hugging Face transformers' Qwen3ForCausalLM on identical weights: logits, loss and every
parameter gradient, on small random configurations (tied and untied embeddings, head_dim wider than, narrower than
and equal to hidden_size / heads, with and without grouped-query attention); the Hugging Face round trip through
`titan convert` (bitwise, config.json checked); parameter counts and FLOPs per token of every dense flavor against
torchtitan's own Qwen3 model."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from titan_testing import binary, run, shared

CONFIGS = {
    # name: (hidden, layers, heads, kv heads, head_dim, intermediate, tied)
    "tied_wide_heads": (64, 2, 4, 2, 32, 160, True),
    "untied_narrow_heads": (96, 3, 4, 4, 20, 144, False),
    "untied_gqa": (64, 2, 8, 2, 8, 128, False),
}


def hf_model(name, seed=0):
    hidden, layers, heads, kv, head_dim, inter, tied = CONFIGS[name]
    config = Qwen3Config(vocab_size=512, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # non-trivial norm weights (the q/k norms' too), so their gradients are checked
                p.uniform_(0.5, 1.5)
    return model


def make_batch(seq_len=80, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (batch, seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    labels[1, :5] = -100
    return inputs, labels


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_gradients_match_transformers(tmp_path, name):
    model = hf_model(name)
    hf_dir = tmp_path / "hf"
    model.config.save_pretrained(hf_dir)
    inputs, labels = make_batch()
    weights, batch, out = tmp_path / "w.safetensors", tmp_path / "b.safetensors", tmp_path / "o.safetensors"
    save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, str(weights))
    save_file({"inputs": inputs, "labels": labels}, str(batch))
    run([binary("titan_model_probe"), "--hf-config", str(hf_dir / "config.json"), "--weights", str(weights),
         "--batch", str(batch), "--out", str(out)])
    got = load_file(str(out))

    model.zero_grad()
    logits = model(input_ids=inputs).logits
    valid = (labels != -100).sum()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100) / valid
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}

    diff = (got["logits"] - logits.detach()).abs().max().item()
    print(f"{name}: logits max abs diff {diff:.3e}")
    assert diff <= 1e-4
    assert abs(got["loss"].item() - loss.item()) <= 1e-5 * loss.item()
    assert sorted(k[5:] for k in got if k.startswith("grad.")) == sorted(grads)
    worst = 0.0
    for pname, ref in grads.items():
        mine = got["grad." + pname]
        worst = max(worst, ((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
        torch.testing.assert_close(mine, ref, rtol=1e-3, atol=1e-6, msg=lambda m: f"{name} {pname}: {m}")
    print(f"{name}: worst gradient error relative to the tensor's largest entry {worst:.3e}")
    assert worst < 1e-3


def test_bf16_autocast_is_close_to_the_float32_reference(tmp_path):
    """Under bf16 autocast the q/k norms meet bf16 projections and float32 weights (normalised in float32 by the fused
    kernel, the weight handed over in bf16)."""
    model = hf_model("untied_gqa", seed=3)
    hf_dir = tmp_path / "hf"
    model.config.save_pretrained(hf_dir)
    inputs, labels = make_batch(seed=7)
    weights, batch, out = tmp_path / "w.safetensors", tmp_path / "b.safetensors", tmp_path / "o.safetensors"
    save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, str(weights))
    save_file({"inputs": inputs, "labels": labels}, str(batch))
    result = run([binary("titan_model_probe"), "--hf-config", str(hf_dir / "config.json"), "--weights", str(weights),
                  "--batch", str(batch), "--out", str(out), "--autocast-bf16"])
    assert "Mismatch dtype" not in result.stderr, result.stderr
    got = load_file(str(out))
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    valid = (labels != -100).sum()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100) / valid
    # bfloat16 matmuls: a few parts in a thousand.
    assert abs(got["loss"].item() - loss.item()) < 2e-2 * loss.item()
    assert all(torch.isfinite(v).all() for k, v in got.items() if k.startswith("grad."))


@pytest.mark.parametrize("name", ["tied_wide_heads", "untied_narrow_heads"])
def test_hugging_face_round_trip_is_bitwise(tmp_path, name):
    model = hf_model(name, seed=2)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    run([binary("titan"), "convert", "--from", str(hf_dir), "--to", str(tmp_path / "titan")])
    meta = json.loads((tmp_path / "titan" / "metadata.json").read_text())
    assert meta["model"]["family"] == "qwen3"
    run([binary("titan"), "convert", "--from", str(tmp_path / "titan"), "--to", str(tmp_path / "back"), "--format", "hf"])
    original, back = load_file(str(hf_dir / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    if model.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)  # transformers may store the tied table twice; titan stores it once
    assert sorted(original) == sorted(back)
    for key, value in original.items():
        assert torch.equal(value, back[key]), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    for field in ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"]:
        assert config[field] == getattr(model.config, field), field
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    # transformers reads the export and computes what the original computes.
    reread = Qwen3ForCausalLM.from_pretrained(tmp_path / "back").float()
    inputs, _ = make_batch(seq_len=16)
    with torch.no_grad():
        torch.testing.assert_close(reread(input_ids=inputs).logits, model(input_ids=inputs).logits, rtol=0, atol=0)


def test_config_json_fields_titan_cannot_compute_are_refused(tmp_path):
    model = hf_model("untied_gqa")
    for field, value, needle in [("attention_bias", True, "attention_bias = true"),
                                 ("use_sliding_window", True, "use_sliding_window = true"),
                                 ("hidden_act", "gelu", "hidden_act")]:
        hf_dir = tmp_path / field
        model.save_pretrained(hf_dir)
        config = json.loads((hf_dir / "config.json").read_text())
        config[field] = value
        (hf_dir / "config.json").write_text(json.dumps(config))
        result = run([binary("titan"), "convert", "--from", str(hf_dir), "--to", str(tmp_path / (field + "_out"))], check=False)
        assert result.returncode != 0 and needle in result.stderr and "config.json" in result.stderr, result.stderr


@pytest.mark.parametrize("flavor", ["debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B"])
def test_counts_match_torchtitan(flavor):
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    args = qwen3_args[flavor]
    with torch.device("meta"):
        model = Qwen3Model(args)
    nparams, flops = args.get_nparams_and_flops(model, 4096)
    out = json.loads(run([binary("titan"), "estimate", "--json", "--model.name", "qwen3", "--model.flavor", flavor,
                          "--training.seq_len", "4096"]).stdout)
    assert out["name"] == "qwen3"
    assert out["parameters"] == nparams
    assert out["flops_per_token"] == flops


@pytest.mark.parametrize("toml", ["qwen3_0.6b.toml", "qwen3_1.7b.toml", "qwen3_32b.toml", "qwen3_moe_debug.toml"])
def test_torchtitan_qwen3_tomls_load_unchanged(toml):
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    path = shared("configs", "torchtitan", "qwen3", toml)
    result = run([binary("titan"), "estimate", "--json", "--job.config_file", str(path)], check=False)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    args = qwen3_args[out["flavor"]]
    with torch.device("meta"):
        model = Qwen3Model(args)
    assert out["name"] == "qwen3" and out["parameters"] == args.get_nparams_and_flops(model, 4096)[0]


def test_training_from_a_qwen3_directory_takes_the_family_from_config_json(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_model("untied_gqa").save_pretrained(hf_dir)
    common = [binary("titan"), "train", "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes",
              "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "2", "--debug.seed", "0",
              "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_in_hf", "--model.flavor", "hf",
              "--metrics.disable_color_printing", "--job.dump_folder", str(tmp_path / "dump")]
    result = run(common)
    assert "Model qwen3 from" in result.stdout and "Loaded Hugging Face weights" in result.stdout, result.stdout
    mismatch = run(common + ["--model.name", "llama3"], check=False)
    assert mismatch.returncode != 0
    for needle in ['model.name = "llama3"', 'model_type = "qwen3"', 'model.name = "qwen3"']:
        assert needle in mismatch.stderr, mismatch.stderr


def test_a_run_from_hugging_face_weights_resumes_with_the_model_its_checkpoint_records(tmp_path):
    """A run that took its shape from a Hugging Face folder (model.flavor "hf") resumes from its own checkpoint with
    the shape that checkpoint records: the folder may be gone, or its config.json edited, by then (a requeued job
    whose model cache was cleared), and the resumed steps equal the uninterrupted run's. A run that starts from the
    folder converted to a titan checkpoint trains the same model without naming it."""
    import re
    import shutil

    hf_dir = tmp_path / "hf"
    hf_model("untied_gqa").save_pretrained(hf_dir)

    def train(dump, steps, source):
        result = run([binary("titan"), "train", "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes",
                      "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(steps),
                      "--debug.seed", "0", "--checkpoint.initial_load_path", str(source), "--checkpoint.initial_load_in_hf",
                      "--model.flavor", "hf", "--checkpoint.enable", "--checkpoint.interval", "2",
                      "--checkpoint.last_save_model_only", "false",
                      "--metrics.disable_color_printing", "--job.dump_folder", str(dump)])
        return {int(m.group(1)): m.group(2) for m in re.finditer(r"step: +(\d+)  loss: +([\d.]+)", result.stdout)}

    straight = train(tmp_path / "straight", 4, hf_dir)
    for change in ("removed", "edited"):
        source = tmp_path / f"hf_{change}"
        shutil.copytree(hf_dir, source)
        first = train(tmp_path / change, 2, source)
        if change == "removed":
            shutil.rmtree(source)
        else:
            config = json.loads((source / "config.json").read_text())
            config.update(rope_theta=10000.0, rms_norm_eps=1e-5)
            (source / "config.json").write_text(json.dumps(config))
        resumed = train(tmp_path / change, 4, source)
        assert {**first, **resumed} == straight, (change, first, resumed, straight)
    # A checkpoint.load_step with no checkpoint is named as such, not as the folder that is gone.
    missing = run([binary("titan"), "train", "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes",
                   "--checkpoint.initial_load_path", str(tmp_path / "hf_removed"), "--checkpoint.initial_load_in_hf",
                   "--model.flavor", "hf", "--checkpoint.enable", "--checkpoint.load_step", "7",
                   "--job.dump_folder", str(tmp_path / "removed")], check=False)
    assert missing.returncode != 0 and "checkpoint.load_step = 7" in missing.stderr and "step-7" in missing.stderr, missing.stderr
    # A family named against the checkpoint's record is refused by name.
    wrong = run([binary("titan"), "train", "--model.name", "llama3", "--model.hf_assets_path", "builtin", "--training.dataset",
                 "fortunes", "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "6",
                 "--checkpoint.initial_load_path", str(tmp_path / "hf_removed"), "--checkpoint.initial_load_in_hf",
                 "--checkpoint.enable", "--job.dump_folder", str(tmp_path / "removed")], check=False)
    assert wrong.returncode != 0 and 'model.name = "llama3"' in wrong.stderr and "records a qwen3 model" in wrong.stderr, wrong.stderr
    # The same weights converted to a titan checkpoint start the same run, with no flavor or family named: the
    # checkpoint records its model; and that run resumes from its own checkpoints with it.
    run([binary("titan"), "convert", "--from", str(hf_dir), "--to", str(tmp_path / "start")])

    def from_titan(steps):
        result = run([binary("titan"), "train", "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes",
                      "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(steps),
                      "--debug.seed", "0", "--checkpoint.initial_load_path", str(tmp_path / "start"), "--checkpoint.enable",
                      "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false",
                      "--metrics.disable_color_printing", "--job.dump_folder", str(tmp_path / "from_titan")])
        assert "Model qwen3" in result.stdout, result.stdout
        return result.stdout, {int(m.group(1)): m.group(2) for m in re.finditer(r"step: +(\d+)  loss: +([\d.]+)", result.stdout)}
    started, first = from_titan(2)
    assert "the checkpoint the run starts from (model.flavor is not set)" in started
    resumed_log, resumed = from_titan(4)
    assert "the model is the one it records" in resumed_log
    assert {**first, **resumed} == straight


@pytest.mark.parametrize("name", ["tied_wide_heads", "untied_gqa"])
def test_dcp_export_is_torchtitans_qwen3_layout(tmp_path, name):
    """A Qwen3 titan checkpoint exported with `titan convert --format dcp` holds exactly torchtitan's Qwen3Model state
    dict (names and shapes), with the values torchtitan's own Qwen3StateDictAdapter gives the Hugging Face weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    model = hf_model(name, seed=4)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    run([binary("titan"), "convert", "--from", str(hf_dir), "--to", str(tmp_path / "titan")])
    run([binary("titan"), "convert", "--from", str(tmp_path / "titan"), "--to", str(tmp_path / "dcp"), "--format", "dcp"])
    metadata = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    exported = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
                if isinstance(m, TensorStorageMetadata)}
    dcp.load(exported, checkpoint_id=str(tmp_path / "dcp"))

    hidden, layers, heads, kv, head_dim, inter, tied = CONFIGS[name]
    args = Qwen3ModelArgs(dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv, head_dim=head_dim, hidden_dim=inter,
                          vocab_size=512, enable_weight_tying=tied, rope_theta=1000000, qk_norm=True)
    with torch.device("meta"):
        reference = Qwen3Model(args)
    # torchtitan's state dict (what its checkpointer saves and loads): a tied output under its own name too.
    expected = {k: tuple(v.shape) for k, v in get_model_state_dict(reference).items()}
    assert {k: tuple(v.shape) for k, v in exported.items()} == expected
    converted = Qwen3StateDictAdapter(args, None).from_hf(load_file(str(hf_dir / "model.safetensors")))
    for key, value in exported.items():
        assert torch.equal(value, converted[key]), key
    # And back: a run of the same shape starts from that DCP directory (a tied output under its own name included).
    shape = ["--model.dim", str(hidden), "--model.n_layers", str(layers), "--model.n_heads", str(heads), "--model.n_kv_heads",
             str(kv), "--model.head_dim", str(head_dim), "--model.hidden_dim", str(inter), "--model.vocab_size", "512",
             "--model.tie_word_embeddings", "true" if tied else "false"]
    result = run([binary("titan"), "train", "--model.name", "qwen3", "--model.flavor", "debugmodel", *shape,
                  "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.seq_len", "32",
                  "--training.local_batch_size", "2", "--training.steps", "1", "--checkpoint.enable",
                  "--checkpoint.initial_load_path", str(tmp_path / "dcp"), "--checkpoint.interval", "100",
                  "--job.dump_folder", str(tmp_path / "dump"), "--metrics.disable_color_printing"])
    assert "Loaded model weights from torch DCP checkpoint" in result.stdout, result.stdout
