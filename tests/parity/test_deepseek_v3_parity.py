"""titan's DeepSeek-V3 (multi-head latent attention, YaRN RoPE, dense blocks before Mixture-of-Experts blocks with
shared experts) against two references we did not write, on identical weights: torchtitan 0.2.2's own DeepSeekV3Model
(loss, logits and every gradient, its flavors' softmax routing and the 671B flavor's sigmoid routing over groups;
and with float8 linears of each recipe, torchtitan's model converted by torchao) and
Hugging Face transformers' DeepseekV3ForCausalLM (with and without the queries' low-rank projection, YaRN on and off,
node-limited groups on and off, one and two shared experts); the Hugging Face round trip through `titan convert`
(per-expert tensors and e_score_correction_bias, bitwise; a published checkpoint's multi-token-prediction layer skipped
with a warning); config.json settings titan cannot compute refused by name;
parameter counts and FLOPs per token of every flavor, and torchtitan's DeepSeek-V3 TOMLs, against torchtitan's own.

torchtitan runs here with its for-loop experts (use_grouped_mm = False) and torch.histc counted in float, as in
test_moe_layer_parity.py."""
import dataclasses
import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from titan_testing import binary, probe_published_hf_model, run, shared

VOCAB = 256


def make_batch(seq_len=40, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    labels[1, :5] = -100
    return inputs, labels


def compare(case, got, logits, loss, grads, rtol=1e-4):
    """titan's probe output against the reference's logits, loss and gradients (an expert no token reached has a
    zero gradient in both)."""
    diff = ((got["logits"] - logits.detach()).abs().max() / logits.detach().abs().max()).item()
    print(f"{case}: logits max difference {diff:.2e} of the largest; loss {got['loss'].item():.7f} vs {loss.item():.7f}")
    assert diff < 1e-5, case
    assert abs(got["loss"].item() - loss.item()) <= 1e-5 * loss.item(), case
    assert sorted(k[5:] for k in got if k.startswith("grad.")) == sorted(grads)
    worst = 0.0
    for name, expected in grads.items():
        mine = got["grad." + name]
        if expected.abs().max() == 0:
            assert mine.abs().max() == 0, name
            continue
        worst = max(worst, ((mine - expected).abs().max() / expected.abs().max()).item())
        torch.testing.assert_close(mine, expected, rtol=rtol, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")
    print(f"{case}: worst gradient difference {worst:.2e} of the tensor's largest entry")
    assert worst < rtol


# torchtitan's DeepSeek-V3 at width 64, three blocks (the first dense), 4 heads of 32 + 16 query/key and 24 value
# columns, 8 experts of width 32.
TORCHTITAN_CASES = {
    # The debugmodel/16B flavors' routing: softmax, top 3, not renormalised, two shared experts; plain queries; the
    # sequence within the original context (no YaRN).
    "softmax_shared2_plain_queries": dict(
        routing=dict(num_experts=8, num_shared_experts=2, top_k=3, score_func="softmax", route_norm=False, route_scale=1.0,
                     score_before_experts=False, num_expert_groups=None, num_limited_groups=None),
        q_lora_rank=0, max_seq_len=64, original_seq_len=4096),
    # The 671B flavor's routing: sigmoid over 4 groups keeping 2, top 3, renormalised and scaled, one shared expert;
    # low-rank queries; YaRN (a 128-position model over a 32-position original context, mscale 0.7).
    "sigmoid_groups_lora_queries_yarn": dict(
        routing=dict(num_experts=8, num_shared_experts=1, top_k=3, score_func="sigmoid", route_norm=True, route_scale=2.5,
                     score_before_experts=False, num_expert_groups=4, num_limited_groups=2),
        q_lora_rank=48, max_seq_len=128, original_seq_len=32),
}


def torchtitan_model(case):
    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model
    from torchtitan.models.moe import MoEArgs

    c = TORCHTITAN_CASES[case]
    args = DeepSeekV3ModelArgs(vocab_size=VOCAB, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=3, n_dense_layers=1, n_heads=4,
                               moe_args=MoEArgs(use_grouped_mm=False, load_balance_coeff=1e-3, **c["routing"]),
                               q_lora_rank=c["q_lora_rank"], kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                               v_head_dim=24, max_seq_len=c["max_seq_len"], original_seq_len=c["original_seq_len"],
                               rope_factor=4.0, mscale=0.7)
    args.moe_impl = "standard"  # what update_from_config sets from parallelism.expert_parallel_comm_backend
    torch.manual_seed(0)
    model = DeepSeekV3Model(args)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norm weights, so that their gradients are checked
                p.uniform_(0.5, 1.5, generator=g)
            elif "router" in name:  # clear preferences: no near-ties for rounding to flip
                p.normal_(0.0, 0.5, generator=g)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model, g


def titan_args(case):
    """The same model's arguments for titan_model_probe --args-json (ModelArgs::to_json's fields)."""
    c = TORCHTITAN_CASES[case]
    return dict(family="deepseek_v3", dim=64, n_layers=3, n_heads=4, n_kv_heads=4, vocab_size=VOCAB, ffn_hidden_dim=128,
                norm_eps=1e-5, rope_theta=10000.0, rope_layout="interleaved", max_seq_len=c["max_seq_len"],
                tie_word_embeddings=False, depth_init=True, final_norm_dtype_eps=True, n_dense_layers=1,
                moe=dict(hidden_dim=32, load_balance_coeff=1e-3, **c["routing"]),
                mla=dict(q_lora_rank=c["q_lora_rank"], kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24),
                yarn=dict(original_seq_len=c["original_seq_len"], factor=4.0, beta_fast=32, beta_slow=1, mscale=0.7))


@pytest.mark.parametrize("case", list(TORCHTITAN_CASES))
def test_whole_model_matches_torchtitan(tmp_path, monkeypatch, case):
    """Loss, logits and every gradient of torchtitan's DeepSeekV3Model against titan's (float32, 2 x 40 tokens), with
    non-zero balancing biases steering the choice of experts in both."""
    against_torchtitan(tmp_path, monkeypatch, case)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_linears_match_torchtitan_converted_by_torchao(tmp_path, monkeypatch, recipe):
    """Float8 linears (emulated, the output projection in high precision) in DeepSeek-V3: torchtitan's model with
    low-rank queries, YaRN and sigmoid group routing, converted by torchao's convert_to_float8_training with
    torchtitan's own layer filter, against titan's float8 converter on the same weights and batch. Both convert the
    latent attention's five projections, the dense block's feed-forward and the shared experts (24 linears); neither
    converts the router (8 outputs, not a multiple of 16) or the routed experts (no linear units)."""
    from torchao import float8 as torchao_float8
    from torchao.float8.float8_linear import Float8Linear
    from torchtitan.components.quantization.utils import module_filter_fn

    def convert(model):
        config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        torchao_float8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda mod, fqn: module_filter_fn(mod, fqn, ["output"]))
        converted = [fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]
        assert len(converted) == 24 and not any("router" in f or ".experts." in f for f in converted), converted

    against_torchtitan(tmp_path, monkeypatch, "sigmoid_groups_lora_queries_yarn", float8=recipe, convert=convert)


def against_torchtitan(tmp_path, monkeypatch, case, float8=None, convert=None):
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda t, bins, min, max: histc(t.float(), bins=bins, min=min, max=max).to(t.dtype))
    model, g = torchtitan_model(case)
    state = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    if convert:
        convert(model)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert len(biases) == 2  # the MoE blocks only
    inputs, labels = make_batch(seed=5)
    weights, batch, out = tmp_path / "w.safetensors", tmp_path / "b.safetensors", tmp_path / "o.safetensors"
    save_file({**state, **biases}, str(weights))
    save_file({"inputs": inputs, "labels": labels}, str(batch))
    (tmp_path / "args.json").write_text(json.dumps(titan_args(case)))
    result = run([binary("titan_model_probe"), "--args-json", str(tmp_path / "args.json"), "--titan-weights", str(weights),
                  "--batch", str(batch), "--out", str(out), *(["--float8", float8] if float8 else [])])
    if float8:
        assert f"Float8 linears ({float8}, emulated): 24 converted" in result.stdout + result.stderr, result.stdout[-2000:]
    got = load_file(str(out))

    logits = model(inputs)
    valid = (labels != -100).sum()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100) / valid
    loss.backward()
    compare(f"{case}, float8 {float8}" if float8 else case, got, logits, loss, {n: p.grad for n, p in model.named_parameters()})


# transformers' DeepseekV3ForCausalLM: three layers (the first dense), 4 heads, 8 routed experts of width 32, top 3,
# sigmoid scores with the correction bias.
HF_CASES = {
    # name: (q_lora_rank, YaRN, (n_group, topk_group), shared experts, norm_topk_prob)
    "plain_queries_yarn_groups": (None, True, (4, 2), 1, True),
    "lora_queries_no_yarn_no_groups": (48, False, (1, 1), 2, False),
    "lora_queries_yarn_groups": (48, True, (2, 1), 1, True),
}


def hf_model(name, seed=0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    q_lora, yarn, (groups, limited), shared_experts, renorm = HF_CASES[name]
    rope = ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
             "mscale": 0.7, "mscale_all_dim": 0.7, "rope_theta": 10000.0} if yarn else None)
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=shared_experts,
                              n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=q_lora,
                              qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=32, n_group=groups, topk_group=limited,
                              num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=renorm,
                              max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=rope,
                              tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).float()
    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5, generator=g)
            elif pname.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5, generator=g)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("name", list(HF_CASES))
def test_logits_loss_and_gradients_match_transformers(tmp_path, name):
    model = hf_model(name)  # saved with the correction biases, as DeepSeek-V3 is published
    inputs, labels = make_batch()
    compare(name, *probe_published_hf_model(tmp_path, model, inputs, labels), rtol=1e-3)


@pytest.mark.parametrize("name", ["plain_queries_yarn_groups", "lora_queries_no_yarn_no_groups"])
def test_hugging_face_round_trip_is_bitwise(tmp_path, name):
    from transformers import DeepseekV3ForCausalLM

    model = hf_model(name, seed=2)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    original = load_file(str(hf_dir / "model.safetensors"))
    mtp = {}
    if name == "lora_queries_no_yarn_no_groups":
        # As DeepSeek-V3 is published: one multi-token-prediction layer past the last block (its projection of the
        # concatenated embedding and hidden state, their norms, its own attention, experts and output head), which
        # the conversion skips with a warning.
        mtp = {"model.layers.3.eh_proj.weight": torch.randn(64, 128), "model.layers.3.enorm.weight": torch.ones(64),
               "model.layers.3.hnorm.weight": torch.ones(64), "model.layers.3.shared_head.norm.weight": torch.ones(64),
               "model.layers.3.shared_head.head.weight": torch.randn(VOCAB, 64),
               "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": torch.randn(48, 64),
               "model.layers.3.mlp.experts.0.gate_proj.weight": torch.randn(32, 64),
               "model.layers.3.mlp.gate.e_score_correction_bias": torch.zeros(8)}
        save_file({**original, **mtp}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    converted = run([binary("titan"), "convert", "--from", str(hf_dir), "--to", str(tmp_path / "titan")])
    if mtp:
        assert "skipped 8 tensor(s) of the multi-token-prediction layer past the model's 3 blocks" in converted.stdout + converted.stderr
    meta = json.loads((tmp_path / "titan" / "metadata.json").read_text())
    assert meta["model"]["family"] == "deepseek_v3"
    run([binary("titan"), "convert", "--from", str(tmp_path / "titan"), "--to", str(tmp_path / "back"), "--format", "hf"])
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(original) == sorted(back)
    assert any(k.endswith("e_score_correction_bias") for k in back)
    for key, value in original.items():
        assert torch.equal(value, back[key]), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    for field in ["hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
                  "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok",
                  "first_k_dense_replace", "norm_topk_prob", "vocab_size", "rms_norm_eps", "max_position_embeddings"]:
        assert config[field] == getattr(model.config, field), field
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    # transformers reads the export and computes what the original computes.
    reread = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").float()
    inputs, _ = make_batch(seq_len=16)
    with torch.no_grad():
        torch.testing.assert_close(reread(input_ids=inputs).logits, model(input_ids=inputs).logits, rtol=0, atol=0)


def test_config_json_fields_titan_cannot_compute_are_refused(tmp_path):
    model = hf_model("plain_queries_yarn_groups")
    base = tmp_path / "base"
    model.save_pretrained(base)
    original = json.loads((base / "config.json").read_text())
    cases = [("hidden_act", "gelu", "hidden_act"), ("rope_interleave", False, "rope_interleave = false"),
             ("attention_bias", True, "attention_bias = true"), ("topk_method", "greedy", "topk_method"),
             ("rope_parameters", dict(original["rope_parameters"], mscale=1.0), "mscale_all_dim"),
             ("rope_parameters", dict(original["rope_parameters"], rope_type="linear"), "\"linear\"")]
    for i, (field, value, needle) in enumerate(cases):
        hf_dir = tmp_path / f"case{i}"
        hf_dir.mkdir()
        (hf_dir / "model.safetensors").symlink_to(base / "model.safetensors")
        (hf_dir / "config.json").write_text(json.dumps(dict(original, **{field: value})))
        result = run([binary("titan"), "convert", "--from", str(hf_dir), "--to", str(tmp_path / f"out{i}")], check=False)
        assert result.returncode != 0 and needle in result.stderr and "config.json" in result.stderr, (field, result.stderr)


def torchtitan_counts(flavor, seq_len):
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args

    args = deepseekv3_args[flavor]
    args.moe_impl = "standard"
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    return args.get_nparams_and_flops(model, seq_len)


@pytest.mark.parametrize("flavor", ["debugmodel", "16B", "236B", "671B"])
def test_counts_match_torchtitan(flavor):
    for seq_len in (2048, 4096):
        nparams, flops = torchtitan_counts(flavor, seq_len)
        out = json.loads(run([binary("titan"), "estimate", "--json", "--model.name", "deepseek_v3", "--model.flavor", flavor,
                              "--training.seq_len", str(seq_len)]).stdout)
        assert out["name"] == "deepseek_v3"
        assert out["parameters"] == nparams, (flavor, seq_len)
        assert out["flops_per_token"] == flops, (flavor, seq_len)
    if flavor == "671B":  # DeepSeek-V3's published "37B activated for each token"
        assert abs(out["active_parameters"] / 37e9 - 1) < 0.02, out["active_parameters"]


@pytest.mark.parametrize("toml", ["debug_model.toml", "deepseek_v3_16b.toml", "deepseek_v3_671b.toml"])
def test_torchtitan_deepseek_v3_tomls_load_unchanged(toml):
    path = shared("configs", "torchtitan", "deepseek_v3", toml)
    result = run([binary("titan"), "estimate", "--json", "--job.config_file", str(path)], check=False)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    nparams, _ = torchtitan_counts(out["flavor"], 4096)
    assert out["name"] == "deepseek_v3" and out["parameters"] == nparams


def test_float8_block_quantized_checkpoints_dequantize_as_pytorchs_reader(tmp_path):
    """DeepSeek-V3 is published in float8 (E4M3) with a float32 scale per 128 x 128 block of each projection
    (`*.weight_scale_inv`, config.json's quantization_config). titan reads such a directory as PyTorch's
    QuantizedHuggingFaceStorageReader dequantizes it (what torchtitan's checkpoint.initial_load_in_hf_quantized uses):
    every tensor bitwise, on weights of several blocks with partial ones at the edges; and a run starts from it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    # A vocabulary the built-in tokenizer can fill (the run below).
    config = DeepseekV3Config(vocab_size=2048, hidden_size=160, intermediate_size=272, moe_intermediate_size=144,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                              n_routed_experts=4, kv_lora_rank=144, q_lora_rank=136, qk_rope_head_dim=16, v_head_dim=24,
                              qk_nope_head_dim=32, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                              max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(config).float()
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    weights = load_file(str(plain / "model.safetensors"))
    projections = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    stored, quantized = {}, []
    for name, w in weights.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in projections):
            stored[name] = w
            continue
        # DeepSeek's block quantization: scale_inv = amax / 448 per 128 x 128 block, values w / scale_inv in E4M3.
        rows, cols = w.shape
        blocks = torch.zeros((rows + 127) // 128, (cols + 127) // 128)
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(blocks.shape[0]):
            for j in range(blocks.shape[1]):
                tile = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                blocks[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
                q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (tile / blocks[i, j]).to(torch.float8_e4m3fn)
        stored[name], stored[name + "_scale_inv"] = q, blocks
        quantized.append(name)
    assert any(stored[n + "_scale_inv"].numel() > 1 for n in quantized)  # weights of several blocks
    published = tmp_path / "published"
    published.mkdir()
    save_file(stored, str(published / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    (published / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in stored}}))
    hf_config = json.loads((plain / "config.json").read_text())
    hf_config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": [128, 128]}
    (published / "config.json").write_text(json.dumps(hf_config))

    reference = {name: torch.empty(w.shape, dtype=torch.float32) for name, w in weights.items()}
    dcp.load(reference, storage_reader=QuantizedHuggingFaceStorageReader(str(published), target_dtype=torch.float32,
                                                                         block_size=128))
    converted = run([binary("titan"), "convert", "--from", str(published), "--to", str(tmp_path / "out"), "--format", "hf",
                     "--dtype", "float32"])
    assert f"{len(quantized)} float8 weights dequantized to float32 with their 128 x 128 block scales" in \
        converted.stdout + converted.stderr
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(out) == sorted(weights)
    for name in weights:
        assert out[name].dtype == torch.float32 and torch.equal(out[name], reference[name].to(torch.float32)), name
    # The dequantized weights are the originals within E4M3's step (3 mantissa bits).
    worst = max(float(((out[n] - weights[n]).abs() / weights[n].abs().max()).max()) for n in quantized)
    assert 0 < worst < 0.07, worst
    # torchtitan's key for it: a run starts from the published directory.
    run([binary("titan"), "train", "--job.dump_folder", str(tmp_path / "dump"), "--model.name", "deepseek_v3",
         "--model.flavor", "hf", "--model.hf_assets_path", "builtin", "--checkpoint.initial_load_path", str(published),
         "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_in_hf_quantized", "--training.steps", "1",
         "--training.dataset", "fortunes",
         "--training.seq_len", "32", "--training.local_batch_size", "1", "--training.mixed_precision_param", "float32"])


def test_flavors_carry_torchtitans_attention_masks(tmp_path):
    """torchtitan's flavors carry their attention mask: its flex and varlen flavors and DeepSeek-V3's 16B, 236B and
    671B are block-causal. A titan job of such a flavor trains with document masks unless model.attn_mask_type says
    otherwise, and the same flavor names are causal where torchtitan's are."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.qwen3 import qwen3_args

    tiny = {"llama3": ["--model.dim", "64", "--model.n_layers", "1", "--model.n_heads", "4", "--model.n_kv_heads", "2"],
            "qwen3": ["--model.dim", "64", "--model.n_layers", "1", "--model.n_heads", "4", "--model.n_kv_heads", "2",
                      "--model.head_dim", "16", "--model.hidden_dim", "64"],
            "deepseek_v3": ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4", "--model.hidden_dim", "64",
                            "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16", "--model.qk_rope_head_dim", "16",
                            "--model.v_head_dim", "16", "--model.moe_inter_dim", "32"]}

    def train(family, flavor, *extra):
        dump = tmp_path / f"{family}-{flavor}-{len(extra)}"
        result = run([binary("titan"), "train", "--model.name", family, "--model.flavor", flavor, *tiny[family],
                      "--model.vocab_size", "2048", "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes",
                      "--training.seq_len", "256", "--training.local_batch_size", "1", "--training.steps", "1",
                      "--training.mixed_precision_param", "float32", "--debug.seed", "0", "--job.dump_folder", str(dump),
                      "--metrics.disable_color_printing", *extra], env={"OMP_NUM_THREADS": "2", "TITAN_PEAK_FLOPS": "1e11"})
        loss = float(re.search(r"step:\s+1\s+loss:\s+([0-9.]+)", result.stdout).group(1))
        return "Attention mask: block_causal" in result.stdout, loss

    trained = []
    for family, table in [("llama3", llama3_args), ("qwen3", qwen3_args), ("deepseek_v3", deepseekv3_args)]:
        causal_checked = False
        for flavor, args in table.items():
            block = getattr(args, "attn_mask_type", "causal") == "block_causal"
            known = run([binary("titan"), "estimate", "--model.name", family, "--model.flavor", flavor], check=False).returncode == 0
            assert known or not block, (family, flavor)  # every block-causal flavor of torchtitan's is titan's too
            if not known or (not block and causal_checked):
                continue
            causal_checked = causal_checked or not block
            assert train(family, flavor)[0] == block, (family, flavor)
            trained.append(flavor)
    assert len(trained) >= 8, trained
    # The flavor's mask is the mask: the same loss as the base flavor with the key set, another without it.
    _, flex = train("deepseek_v3", "debugmodel_flex_attn")
    _, keyed = train("deepseek_v3", "debugmodel", "--model.attn_mask_type", "block_causal")
    _, causal = train("deepseek_v3", "debugmodel_flex_attn", "--model.attn_mask_type", "causal")
    assert flex == keyed != causal


def test_an_export_transformers_cannot_express_writes_nothing(tmp_path):
    """The debug flavor's softmax routing has no Hugging Face DeepseekV3ForCausalLM form: `titan convert` refuses it
    by name before writing any file, so the folder is not left half-written (a retry says the same, not "already
    holds weights")."""
    dump = tmp_path / "run"
    run([binary("titan"), "train", "--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--model.dim", "64",
         "--model.n_layers", "2", "--model.n_heads", "4", "--model.hidden_dim", "64", "--model.kv_lora_rank", "32",
         "--model.qk_nope_head_dim", "16", "--model.qk_rope_head_dim", "16", "--model.v_head_dim", "16",
         "--model.moe_inter_dim", "32", "--model.hf_assets_path", "builtin", "--training.dataset", "fortunes",
         "--training.seq_len", "32", "--training.local_batch_size", "1", "--training.steps", "1", "--checkpoint.enable",
         "--job.dump_folder", str(dump)], env={"OMP_NUM_THREADS": "2", "TITAN_PEAK_FLOPS": "1e11"})
    out = tmp_path / "hf"
    for _ in range(2):
        result = run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-1"), "--to", str(out)], check=False)
        assert result.returncode == 2 and "DeepseekV3ForCausalLM cannot express" in result.stderr, result.stderr
        assert not list(tmp_path.glob("hf*/*.safetensors"))
