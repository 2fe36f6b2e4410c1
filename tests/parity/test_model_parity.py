"""titan's Llama 3 against Hugging Face transformers' LlamaForCausalLM on identical weights: logits, loss and
every parameter gradient, for the debug model and a grouped-query-attention variant."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from titan_testing import binary, run

FLAVORS = {"debugmodel": 16, "debugmodel_gqa": 4}


def hf_model(n_kv_heads: int, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=16,
        num_key_value_heads=n_kv_heads, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norm weights, so their gradients and use are checked too
                p.uniform_(0.5, 1.5)
    return model


def make_batch(seq_len=96, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 2048, (batch, seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    labels[0, :7] = -100  # ignored positions
    return inputs, labels


def run_probe(tmp_path, flavor, model, inputs, labels, extra=()):
    weights, batch, out = tmp_path / "weights.safetensors", tmp_path / "batch.safetensors", tmp_path / "out.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    save_file({"inputs": inputs, "labels": labels}, str(batch))
    run([binary("titan_model_probe"), "--flavor", flavor, "--weights", str(weights), "--batch", str(batch),
         "--out", str(out), *extra])
    return load_file(str(out))


def reference(model, inputs, labels):
    model.zero_grad()
    logits = model(input_ids=inputs).logits
    valid = (labels != -100).sum()
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100) / valid
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_logits_loss_and_gradients_match_transformers(tmp_path, flavor):
    model = hf_model(FLAVORS[flavor])
    inputs, labels = make_batch()
    out = run_probe(tmp_path, flavor, model, inputs, labels)
    logits, loss, grads = reference(model, inputs, labels)

    diff = (out["logits"] - logits).abs().max().item()
    print(f"{flavor}: logits max abs diff {diff:.3e}, loss {out['loss'].item():.8f} vs {loss.item():.8f}")
    assert diff <= 1e-4
    assert abs(out["loss"].item() - loss.item()) <= 1e-5 * abs(loss.item())
    assert len(grads) == len([k for k in out if k.startswith("grad.")])
    worst = 0.0
    for name, ref in grads.items():
        mine = out["grad." + name]
        rel = ((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, rel)
        torch.testing.assert_close(mine, ref, rtol=1e-3, atol=1e-6, msg=lambda m: f"{name}: {m}")
    print(f"{flavor}: worst gradient error relative to the tensor's largest entry {worst:.3e}")
    assert worst < 1e-3


def test_activation_checkpointing_keeps_gradients(tmp_path):
    model = hf_model(4, seed=3)
    inputs, labels = make_batch(seed=5)
    plain = run_probe(tmp_path, "debugmodel_gqa", model, inputs, labels)
    for mode, option in [("full", "1"), ("selective", "2"), ("selective", "op")]:
        ac = run_probe(tmp_path, "debugmodel_gqa", model, inputs, labels, ["--ac-mode", mode, "--ac-option", option])
        for key, value in plain.items():
            if option == "op":  # float32 rounding from reassociated sums, relative to the tensor's scale
                assert ((ac[key] - value).abs().max() / value.abs().max()).item() < 1e-5, key
            else:
                assert torch.equal(ac[key], value), f"{mode}/{option}: {key}"


def test_bf16_autocast_forward_is_close_to_fp32_reference(tmp_path):
    model = hf_model(16, seed=4)
    inputs, labels = make_batch(seed=6)
    out = run_probe(tmp_path, "debugmodel", model, inputs, labels, ["--autocast-bf16"])
    _, loss, _ = reference(model, inputs, labels)
    # bfloat16 matmuls: a few parts in a thousand.
    assert abs(out["loss"].item() - loss.item()) < 2e-2 * loss.item()
