"""titan's Qwen3-MoE (a Mixture of Experts in every block) against Hugging Face transformers' Qwen3MoeForCausalLM on
identical weights: logits, loss and every parameter gradient (router and per-expert weights included) on small random
configurations (renormalised top-k or not, experts that receive no token, tied and untied embeddings); the Hugging
Face round trip through `titan convert` (per-expert HF tensors <-> titan's 3-D expert weights, bitwise); config.json
fields titan cannot compute refused by name; parameter counts and FLOPs per token (active parameters) of the MoE
flavors against torchtitan's own Qwen3 model; and a short training run of the debug MoE flavor."""
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from titan_testing import SOURCE_DIR, binary, probe_published_hf_model, read_checkpoint, run

CONFIGS = {
    # name: (hidden, layers, heads, kv heads, head_dim, experts, top_k, expert width, renormalise, tied)
    "top2_of_8_renormalised": (64, 2, 4, 2, 16, 8, 2, 32, True, False),
    "top3_of_6_plain_tied": (48, 2, 4, 4, 12, 6, 3, 24, False, True),
    # 64 experts for 2 x 40 tokens with top 1: many receive no token. (Not renormalised: one renormalised score is
    # 1 whatever the logits, which leaves the router only rounding noise for a gradient.)
    "top1_of_64_sparse": (32, 1, 2, 1, 16, 64, 1, 16, False, False),
}


def hf_model(name, seed=0, dense=()):
    """`dense`: Qwen3-MoE's mlp_only_layers (titan's leading dense blocks, model.n_dense_layers)."""
    hidden, layers, heads, kv, head_dim, experts, top_k, width, renorm, tied = CONFIGS[name]
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, num_experts=experts,
                            num_experts_per_tok=top_k, moe_intermediate_size=width, norm_topk_prob=renorm,
                            rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096, tie_word_embeddings=tied,
                            mlp_only_layers=list(dense))
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # non-trivial norm weights, so their gradients are checked
                p.uniform_(0.5, 1.5)
            elif "mlp.gate" in pname:  # a router that prefers some experts clearly (no near-ties to flip)
                p.normal_(0.0, 0.5)
    return model


def make_batch(seq_len=40, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    labels[1, :5] = -100
    return inputs, labels


@pytest.mark.parametrize("name", list(CONFIGS) + ["first_dense"])
def test_logits_loss_and_gradients_match_transformers(tmp_path, name):
    # first_dense: layer 0 a dense MLP (mlp_only_layers = [0]), the rest Mixture-of-Experts.
    model = hf_model("top2_of_8_renormalised", dense=(0,)) if name == "first_dense" else hf_model(name)
    inputs, labels = make_batch()
    got, logits, loss, grads = probe_published_hf_model(tmp_path, model, inputs, labels)
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)

    diff = (got["logits"] - logits.detach()).abs().max().item()
    print(f"{name}: logits max abs diff {diff:.3e}")
    assert diff <= 1e-4
    assert abs(got["loss"].item() - loss.item()) <= 1e-5 * loss.item()
    assert sorted(k[5:] for k in got if k.startswith("grad.")) == sorted(grads)
    worst, idle = 0.0, 0
    for pname, ref in grads.items():
        mine = got["grad." + pname]
        if ref.abs().max() == 0:  # an expert no token reached: no gradient in either
            idle += 1
            assert mine.abs().max() == 0, pname
            continue
        worst = max(worst, ((mine - ref).abs().max() / ref.abs().max()).item())
        torch.testing.assert_close(mine, ref, rtol=1e-3, atol=1e-6, msg=lambda m: f"{name} {pname}: {m}")
    print(f"{name}: worst gradient error relative to the tensor's largest entry {worst:.3e}; {idle} tensors of experts "
          f"that received no token")
    assert worst < 1e-3
    if name == "top1_of_64_sparse":
        assert idle > 0  # the case is meant to have idle experts


@pytest.mark.parametrize("name", ["top2_of_8_renormalised", "top3_of_6_plain_tied", "first_dense"])
def test_hugging_face_round_trip_is_bitwise(tmp_path, name):
    model = hf_model("top2_of_8_renormalised", seed=2, dense=(0,)) if name == "first_dense" else hf_model(name, seed=2)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    run([binary("titan"), "convert", "--from", str(hf_dir), "--to", str(tmp_path / "titan")])
    meta = json.loads((tmp_path / "titan" / "metadata.json").read_text())
    assert meta["model"]["family"] == "qwen3" and meta["model"]["moe"]["num_experts"] == model.config.num_experts
    assert meta["model"].get("n_dense_layers", 0) == len(model.config.mlp_only_layers)
    run([binary("titan"), "convert", "--from", str(tmp_path / "titan"), "--to", str(tmp_path / "back"), "--format", "hf"])
    original, back = load_file(str(hf_dir / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    if model.config.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    assert sorted(original) == sorted(back)
    for key, value in original.items():
        assert torch.equal(value, back[key]), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    for field in ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                  "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "tie_word_embeddings",
                  "mlp_only_layers"]:
        assert config[field] == getattr(model.config, field), field
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    reread = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "back").float()
    inputs, _ = make_batch(seq_len=16)
    with torch.no_grad():
        torch.testing.assert_close(reread(input_ids=inputs).logits, model(input_ids=inputs).logits, rtol=0, atol=0)


def test_config_json_fields_titan_cannot_compute_are_refused(tmp_path):
    model = hf_model("top2_of_8_renormalised")
    for field, value, needle in [("decoder_sparse_step", 2, "decoder_sparse_step = 2"),
                                 ("mlp_only_layers", [1], "mlp_only_layers = [1]"),
                                 ("hidden_act", "gelu", "hidden_act")]:
        hf_dir = tmp_path / field
        model.save_pretrained(hf_dir)
        config = json.loads((hf_dir / "config.json").read_text())
        config[field] = value
        (hf_dir / "config.json").write_text(json.dumps(config))
        result = run([binary("titan"), "convert", "--from", str(hf_dir), "--to", str(tmp_path / (field + "_out"))], check=False)
        assert result.returncode != 0 and needle in result.stderr and "config.json" in result.stderr, result.stderr
    # A missing expert is named.
    hf_dir = tmp_path / "missing"
    model.save_pretrained(hf_dir)
    weights = load_file(str(hf_dir / "model.safetensors"))
    del weights["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    result = run([binary("titan"), "convert", "--from", str(hf_dir), "--to", str(tmp_path / "missing_out")], check=False)
    assert result.returncode != 0 and "model.layers.1.mlp.experts.5.up_proj.weight" in result.stderr, result.stderr


@pytest.mark.parametrize("flavor", ["debugmodel_moe", "30B-A3B", "235B-A22B"])
def test_counts_match_torchtitan(flavor):
    """Parameters (all experts) and FLOPs per token (the active ones: top_k of the experts) as torchtitan's
    get_moe_model_nparams_and_flops counts them."""
    from torchtitan.models.qwen3 import Qwen3Model, qwen3_args

    args = qwen3_args[flavor]
    with torch.device("meta"):
        model = Qwen3Model(args)
    nparams, flops = args.get_nparams_and_flops(model, 4096)
    out = json.loads(run([binary("titan"), "estimate", "--json", "--model.name", "qwen3", "--model.flavor", flavor,
                          "--training.seq_len", "4096"]).stdout)
    assert out["parameters"] == nparams
    assert out["flops_per_token"] == flops
    # Activated parameters per token as Qwen's model cards give them (3.3B, 22B), every parameter but the routed
    # experts a token is not sent to.
    card = {"30B-A3B": 3.3e9, "235B-A22B": 22e9}.get(flavor)
    if card:
        assert abs(out["active_parameters"] / card - 1) < 0.02, (flavor, out["active_parameters"])


def test_the_debug_moe_flavor_trains(tmp_path):
    """A short run of torchtitan's debugmodel_moe shape (64 experts, top 8; fewer layers to keep it short): the loss
    falls and the routing health is logged; MX linears train (the router among them); under TP, float8 linears that
    would take partial output gradients (the router) are refused by name."""
    common = [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
              "--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.n_layers", "2",
              "--training.seq_len", "64", "--training.local_batch_size", "4", "--training.steps", "12",
              "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.disable_color_printing",
              "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
    result = run(common + ["--job.dump_folder", str(tmp_path / "run"), "--metrics.enable_tensorboard"])
    losses = [float(x) for x in re.findall(r"step: +\d+ +loss: +([\d.]+)", result.stdout)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses
    # Routing health on every log line and in TensorBoard (read by TensorBoard's own reader): the busiest and idlest
    # expert over the mean, and the balancing bias range, which moves by 1e-3 per step.
    health = re.findall(r"step: +(\d+) .*experts: max ([\d.]+)x min ([\d.]+)x, bias \[([-\d.e]+), ([-\d.e]+)\]", result.stdout)
    assert len(health) == 12, result.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    files = list((tmp_path / "run").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    tb = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert {"moe/max_load_ratio", "moe/min_load_ratio", "moe/layer_0/max_load_ratio", "moe/layer_1/max_load_ratio",
            "moe/expert_bias_min", "moe/expert_bias_max"} <= set(tb), sorted(tb)
    for step, high, low, bias_min, bias_max in health:
        step = int(step)
        assert abs(tb["moe/max_load_ratio"][step] - float(high)) < 0.006 and float(high) > 1, (step, high)
        assert abs(tb["moe/min_load_ratio"][step] - float(low)) < 0.006 and float(low) < 1, (step, low)
        assert max(tb["moe/layer_0/max_load_ratio"][step], tb["moe/layer_1/max_load_ratio"][step]) == tb["moe/max_load_ratio"][step]
    assert float(health[-1][3]) < 0 < float(health[-1][4]) and tb["moe/expert_bias_max"][12] <= 12e-3, health[-1]
    # MX linears: attention and the router (64 x 256) in both blocks.
    mx = run(common + ["--job.dump_folder", str(tmp_path / "mx"), "--model.converters", "mx", "--quantize.linear.mx.emulate",
                       "--training.steps", "2"])
    assert "MXFP8 linears (mxfp8_cublas, floor scales, emulated): 10 converted, 1 kept in high precision (output)" in mx.stdout, mx.stdout
    assert len(re.findall(r"step: +\d+ +loss: +[\d.]+", mx.stdout)) == 2
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "-np", "2"]
    refused = run(mpirun + common + ["--job.dump_folder", str(tmp_path / "f8"), "--model.converters", "float8",
                                     "--quantize.linear.float8.emulate", "--parallelism.tensor_parallel_degree", "2"],
                  check=False)
    message = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "tensor_parallel_degree = 2" in message and '"layers.0.moe.router.gate"' in message, message
    assert "run whole on every tensor-parallel rank" in message and "filter_fqns" in message, message


def test_balancing_biases_travel_to_torchtitan_dcp_and_back(tmp_path):
    """A titan checkpoint of a balanced MoE model holds the biases (model.layers.N.moe.expert_bias); `titan convert
    --format dcp` writes them where torchtitan's Qwen3 MoE model keeps them, so torch.distributed.checkpoint loads
    the export into torchtitan's own model state dict (which has no optional keys) with every weight and bias equal.
    The HF export has no place for them (HF Qwen3-MoE has none)."""
    import numpy as np
    import torch.distributed.checkpoint as dcp
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    dump = tmp_path / "run"
    run([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"), "--model.name", "qwen3",
         "--model.flavor", "debugmodel_moe", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.head_dim", "32", "--model.moe_num_experts", "8", "--model.moe_top_k", "2",
         "--model.moe_inter_dim", "32", "--model.moe_load_balance_coeff", "0.01", "--training.seq_len", "32",
         "--training.local_batch_size", "4", "--training.steps", "3", "--job.dump_folder", str(dump), "--checkpoint.enable",
         "--checkpoint.interval", "3", "--checkpoint.no_last_save_model_only"])
    _, saved = read_checkpoint(dump / "checkpoint" / "step-3")
    bias = saved["model.layers.1.moe.expert_bias"]
    assert bias.shape == (8,) and np.abs(bias).max() > 0.005, bias
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-3"), "--to", str(tmp_path / "dcp"), "--format", "dcp"])
    args = Qwen3ModelArgs(vocab_size=2048, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, moe_enabled=True, moe_inter_dim=32,
                          moe_args=MoEArgs(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=True,
                                           score_before_experts=False, use_grouped_mm=False))
    state = Qwen3Model(args).state_dict()
    assert "layers.0.moe.expert_bias" in state
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    for key, value in state.items():
        if "rope_cache" in key or "tokens_per_expert" in key:
            continue
        np.testing.assert_array_equal(value.float().numpy(), saved["model." + key], err_msg=key)
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-3"), "--to", str(tmp_path / "hf"), "--format", "hf"])
    assert not any("bias" in k for k in load_file(str(tmp_path / "hf" / "model.safetensors")))


def test_titan_plan_models_moe_with_and_without_expert_parallelism():
    """titan plan on Qwen3 30B-A3B over 8 H100s: EP 8 adds an all-to-all term with the bytes the routing implies
    (each rank's top_k copies of its tokens out to the experts and back, forward, backward and the recomputed forward
    of full AC, 7/8 of them leaving the rank), keeps E / EP experts per rank, and gathers only those in FSDP's weight
    copies; the matmul FLOPs count the active experts and do not change with EP, their rate by shape does."""
    def plan(*extra):
        out = run([binary("titan"), "plan", "--json", "--cluster", "h100-sxm", "--model.name", "qwen3", "--model.flavor",
                   "30B-A3B", "--training.seq_len", "4096", "--training.local_batch_size", "2", "--activation_checkpoint.mode",
                   "full", "--parallelism.data_parallel_shard_degree", "8", *extra])
        return json.loads(out.stdout)

    ep8, fsdp = plan("--parallelism.expert_parallel_degree", "8"), plan()
    assert ep8["degrees"]["ep"] == 8 and "ep 8" in ep8["layout"] and fsdp["degrees"]["ep"] == 1
    dim, layers, top_k, experts, hidden = 2048, 48, 8, 128, 768
    rows = 2 * 4096 * top_k
    expected = 2 * rows * dim * 2 * 7 / 8 * layers * 3
    term = ep8["time"]["terms"]["expert parallel"]
    moved = float(re.search(r"([\d.e+]+) GB", term["detail"]).group(1)) * 1e9
    assert abs(moved - expected) <= 0.005 * expected, (term, expected)
    assert f"{experts // 8 * 3 * hidden * dim * layers / 1e6:.0f} M expert parameters" in term["detail"]
    assert "expert parallel" not in fsdp["time"]["terms"]
    # The same FLOPs either way; EP gives each of a rank's 16 experts 8 times the rows of the 128 it computes without
    # EP, so the grouped products fill the GPU's tiles better (docs/plan.md, "Matmul shapes").
    flops = [re.match(r"([\d.]+) TFLOP at", p["time"]["terms"]["matmuls"]["detail"]).group(1) for p in (ep8, fsdp)]
    shapes = [float(re.search(r"x ([\d.]+) for their shapes", p["time"]["terms"]["matmuls"]["detail"]).group(1)) for p in (ep8, fsdp)]
    assert flops[0] == flops[1] and shapes[0] >= shapes[1], (ep8["time"]["terms"]["matmuls"], fsdp["time"]["terms"]["matmuls"])
    # Every rank holds 1/8 of every parameter either way. FSDP's weight copies (two gathered units in bf16 and one
    # unit's float32 gradients: 8 bytes per element) hold the largest unit: without EP a whole block; with EP the
    # block's dense part and this rank's 16 experts, smaller than the embedding, which is then the largest.
    assert ep8["memory"]["terms"]["parameters"] == fsdp["memory"]["terms"]["parameters"]
    attention = 2048 * 32 * 128 * 2 + 2048 * 4 * 128 * 2 + 2 * 128 + 2 * 2048
    block = attention + experts * dim + experts * 3 * hidden * dim
    assert fsdp["memory"]["terms"]["weight copies"] == 8 * block
    assert attention + experts * dim + experts // 8 * 3 * hidden * dim < 151936 * dim
    assert ep8["memory"]["terms"]["weight copies"] == 8 * 151936 * dim

def test_titan_plan_search_tries_expert_parallel_degrees():
    """For a MoE model the search also tries every EP degree that divides the experts and the ranks it borrows,
    with ETP 1 and ETP = TP."""
    out = run([binary("titan"), "plan", "--json", "--search", "--gpus", "8", "--top", "100000", "--cluster", "h100-sxm",
               "--model.name", "qwen3", "--model.flavor", "30B-A3B", "--training.seq_len", "4096",
               "--training.global_batch_size", "16"])
    found = json.loads(out.stdout)
    degrees = [p["degrees"] for p in found["best"]]
    assert {d["ep"] for d in degrees} >= {1, 2, 4, 8}, sorted({d["ep"] for d in degrees})
    assert any(d["tp"] > 1 and d["etp"] == d["tp"] and d["ep"] > 1 for d in degrees)
    assert any(d["tp"] > 1 and d["etp"] == 1 and d["ep"] > 1 for d in degrees)
    for d in degrees:
        borrowed = d["dp_shard"] * d["cp"] * (d["tp"] if d["etp"] == 1 else 1)
        assert borrowed % d["ep"] == 0 and 128 % d["ep"] == 0, d
