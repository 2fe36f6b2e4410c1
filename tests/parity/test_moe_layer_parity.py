"""titan's Mixture-of-Experts layer (models/common/moe.h) against torchtitan 0.2.2's own MoE module on this CPU, from
the same weights and input: output, input gradient and every parameter gradient (router, routed experts, shared
experts), for the routing options Hugging Face's Qwen3-MoE cannot express: sigmoid scores, node-limited expert groups,
shared experts, route_scale and scores applied before the experts. And the whole model: torchtitan's Qwen3 MoE
model against titan's from the same weights and balancing biases (logits, loss, every gradient), with Qwen3's routing
and with the other options.

torchtitan runs here with two test-side adjustments: its for-loop experts (use_grouped_mm = False; its grouped
matmul needs a GPU), and torch.histc, which its router calls on an integer tensor that the CPU kernel refuses,
counted in float32 and converted back."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_testing import binary, run

DIM, HIDDEN = 32, 24
CASES = {
    # DeepSeek-V3's routing: sigmoid, 4 groups of 4 experts of which 2 are kept, top 4, renormalised and scaled,
    # scores on the outputs, one shared expert.
    "sigmoid_groups_shared": dict(num_experts=16, num_shared_experts=1, top_k=4, score_func="sigmoid", route_norm=True,
                                  route_scale=2.5, score_before_experts=False, num_expert_groups=4, num_limited_groups=2),
    # Llama 4's: the scores scale the expert inputs; two shared experts (one SwiGLU twice as wide).
    "softmax_scores_first_two_shared": dict(num_experts=8, num_shared_experts=2, top_k=2, score_func="softmax",
                                            route_norm=False, route_scale=1.0, score_before_experts=True,
                                            num_expert_groups=None, num_limited_groups=None),
    "sigmoid_top1_scores_first": dict(num_experts=8, num_shared_experts=0, top_k=1, score_func="sigmoid", route_norm=False,
                                      route_scale=1.0, score_before_experts=True, num_expert_groups=None,
                                      num_limited_groups=None),
}


def torchtitan_moe(case, seed=0):
    from torchtitan.models.moe import MoE, MoEArgs

    args = MoEArgs(use_grouped_mm=False, **CASES[case])
    torch.manual_seed(seed)
    moe = MoE(args, dim=DIM, hidden_dim=HIDDEN)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device("cpu"))  # the buffers (expert_bias, tokens_per_expert) as zeros
        for name, p in moe.named_parameters():
            p.normal_(0.0, 0.5 if "router" in name else 0.1)  # a router with clear preferences (no near-ties)
    return moe


@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_matches_torchtitan(tmp_path, monkeypatch, case):
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda t, bins, min, max: histc(t.float(), bins=bins, min=min, max=max).to(t.dtype))
    moe = torchtitan_moe(case)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, DIM, generator=g)
    grad_output = torch.randn(2, 24, DIM, generator=g)
    weights, data, out = tmp_path / "w.safetensors", tmp_path / "x.safetensors", tmp_path / "o.safetensors"
    save_file({n: p.detach().contiguous() for n, p in moe.named_parameters()}, str(weights))
    save_file({"x": x, "grad_output": grad_output}, str(data))
    (tmp_path / "args.json").write_text(json.dumps(dict(dim=DIM, hidden_dim=HIDDEN, **CASES[case])))
    run([binary("titan_moe_probe"), "--args", str(tmp_path / "args.json"), "--weights", str(weights), "--input", str(data),
         "--out", str(out)])
    got = load_file(str(out))

    x_ref = x.clone().requires_grad_(True)
    ref = moe(x_ref)
    ref.backward(grad_output)
    diff = ((got["output"] - ref.detach()).abs().max() / ref.detach().abs().max()).item()
    print(f"{case}: output max difference {diff:.2e} of its largest entry")
    assert diff < 1e-5
    grads = {"x": x_ref.grad, **{n: p.grad for n, p in moe.named_parameters()}}
    assert sorted(k[5:] for k in got if k.startswith("grad.")) == sorted(grads)
    worst = 0.0
    for name, expected in grads.items():
        mine = got["grad." + name]
        scale = expected.abs().max().clamp_min(1e-12)
        worst = max(worst, ((mine - expected).abs().max() / scale).item())
        torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")
    print(f"{case}: worst gradient difference {worst:.2e} of the tensor's largest entry")
    assert worst < 1e-4


def test_balancing_bias_matches_torchtitan(tmp_path, monkeypatch):
    """Auxiliary-loss-free balancing over three passes: after each forward and backward the bias update runs (titan's
    update_expert_biases; torchtitan's optimizer pre-step hook from build_optimizers_with_moe_load_balancing, its
    optimizer at lr 0), and the next pass routes with the moved bias. Token counts, biases, outputs and gradients of
    every pass agree. A step of 0.05 (torchtitan's flavors use 1e-3) makes the bias change which experts are chosen."""
    from torch import nn
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
    from torchtitan.config import JobConfig
    from torchtitan.models.moe import MoE, MoEArgs

    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda t, bins, min, max: histc(t.float(), bins=bins, min=min, max=max).to(t.dtype))
    case = dict(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=True, route_scale=1.0,
                score_before_experts=False, num_expert_groups=None, num_limited_groups=None, load_balance_coeff=0.05)
    torch.manual_seed(0)
    moe = MoE(MoEArgs(use_grouped_mm=False, **case), dim=DIM, hidden_dim=HIDDEN)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device("cpu"))
        for name, p in moe.named_parameters():
            p.normal_(0.0, 0.05 if "router" in name else 0.1)  # close scores, so that the bias matters

    class Block(nn.Module):  # what torchtitan's hook walks: model_part.layers[i].moe
        def __init__(self):
            super().__init__()
            self.moe_enabled, self.moe = True, moe

    class Part(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"0": Block()})

    class OneProcess:  # no data-parallel "loss" mesh: the counts are this process's
        def get_optional_mesh(self, name):
            return None

    config = JobConfig().optimizer
    config.lr = 0.0
    optimizers = build_optimizers_with_moe_load_balancing([Part()], config, OneProcess())

    g = torch.Generator().manual_seed(2)
    inputs = {}
    for i in range(3):
        suffix = "" if i == 0 else f".{i}"
        inputs["x" + suffix] = torch.randn(2, 24, DIM, generator=g)
        inputs["grad_output" + suffix] = torch.randn(2, 24, DIM, generator=g)
    weights, data, out = tmp_path / "w.safetensors", tmp_path / "x.safetensors", tmp_path / "o.safetensors"
    save_file({n: p.detach().contiguous() for n, p in moe.named_parameters()}, str(weights))
    save_file(inputs, str(data))
    (tmp_path / "args.json").write_text(json.dumps(dict(dim=DIM, hidden_dim=HIDDEN, **case)))
    run([binary("titan_moe_probe"), "--args", str(tmp_path / "args.json"), "--weights", str(weights), "--input", str(data),
         "--out", str(out)])
    got = load_file(str(out))

    biases = []
    for i in range(3):
        suffix = "" if i == 0 else f".{i}"
        optimizers.zero_grad()
        x = inputs["x" + suffix].clone().requires_grad_(True)
        y = moe(x)
        y.backward(inputs["grad_output" + suffix])
        torch.testing.assert_close(got[f"tokens_per_expert.{i}"], moe.tokens_per_expert.float(), rtol=0, atol=0)
        torch.testing.assert_close(got["output" + suffix], y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["grad.x" + suffix], x.grad, rtol=1e-4, atol=1e-6)
        for name, p in moe.named_parameters():
            torch.testing.assert_close(got[f"grad.{name}{suffix}"], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"pass {i} {name}: {m}")
        optimizers.step()  # torchtitan's balancing hook runs first
        torch.testing.assert_close(got[f"expert_bias.{i}"], moe.expert_bias, rtol=0, atol=1e-7)
        biases.append(moe.expert_bias.clone())
    assert biases[-1].abs().max() > 0.05, biases  # the bias moved
    # ... far enough to change the routing: pass 3 without the bias would pick other experts.
    with torch.no_grad():
        scores = torch.softmax(moe.router.gate(inputs["x.2"].view(-1, DIM)).float(), dim=1)
        plain = scores.topk(2, dim=1).indices.sort(dim=1).values
        biased = (scores + biases[1]).topk(2, dim=1).indices.sort(dim=1).values
    assert (plain != biased).any(dim=1).sum() > 0
    print(f"balancing: bias after 3 passes {biases[-1].tolist()}; "
          f"{int((plain != biased).any(dim=1).sum())} of {plain.shape[0]} tokens routed differently because of it")


@pytest.mark.parametrize("case", ["softmax_top2_shared", "sigmoid_groups_scores_first"])
def test_mxfp8_grouped_experts_match_torchtitan_converted_by_torchao(tmp_path, monkeypatch, case):
    """quantize.grouped_mm.mx with fqns = ["experts"]: torchtitan's MoE with its grouped-matmul experts, converted as
    its MXGroupedMMConverter does (torchao's MXFP8 training config on every module named "experts", here with
    torchao's emulated kernels, and token groups aligned to 32 rows), against titan's layer converted by titan's
    converter. The routed experts run MXFP8 grouped matmuls, the shared expert's linears MXFP8 linears. Test-side
    adjustments: torchao's EMULATED kernel preference (its default needs a Blackwell GPU), torchtitan's permutation
    indices computed on the CPU (its default is a Triton kernel), and torch.histc as above. Expected bitwise: the same
    casts, the same bf16 products."""
    import functools
    import torchtitan.models.moe.utils as moe_utils
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization.quant_api import quantize_
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    from torchtitan.models.moe import MoE, MoEArgs

    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda t, bins, min, max: histc(t.float(), bins=bins, min=min, max=max).to(t.dtype))
    monkeypatch.setattr(moe_utils, "generate_permute_indices", functools.partial(moe_utils.generate_permute_indices, use_cpu=True))
    monkeypatch.setattr(moe_utils, "TOKEN_GROUP_ALIGN_SIZE_M", 32)  # what the converter sets (set_token_group_alignment_size_m)
    routing = {
        "softmax_top2_shared": dict(num_experts=8, num_shared_experts=1, top_k=2, score_func="softmax", route_norm=True,
                                    route_scale=1.0, score_before_experts=False, num_expert_groups=None, num_limited_groups=None),
        "sigmoid_groups_scores_first": dict(num_experts=8, num_shared_experts=0, top_k=3, score_func="sigmoid",
                                            route_norm=True, route_scale=2.5, score_before_experts=True, num_expert_groups=4,
                                            num_limited_groups=2),
    }[case]
    dim, hidden = 64, 96  # the experts' widths divide into MX blocks of 32
    torch.manual_seed(0)
    moe = MoE(MoEArgs(use_grouped_mm=True, **routing), dim=dim, hidden_dim=hidden)
    with torch.no_grad():
        moe.init_weights(0.02, torch.device("cpu"))
        for name, p in moe.named_parameters():
            p.normal_(0.0, 0.5 if "router" in name else 0.1)
    weights = {n: p.detach().contiguous().clone() for n, p in moe.named_parameters()}
    quantize_(moe, config=MXFP8TrainingOpConfig(kernel_preference=KernelPreference.EMULATED), filter_fn=lambda m, fqn: "experts" in fqn)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 48, dim, generator=g)  # 96 tokens: the shared expert's MXFP8 linears need multiples of 32
    grad_output = torch.randn(2, 48, dim, generator=g)
    paths = {k: tmp_path / f"{k}.safetensors" for k in ("w", "x", "o")}
    save_file(weights, str(paths["w"]))
    save_file({"x": x, "grad_output": grad_output}, str(paths["x"]))
    (tmp_path / "args.json").write_text(json.dumps(dict(dim=dim, hidden_dim=hidden, mx=True, **routing)))
    run([binary("titan_moe_probe"), "--args", str(tmp_path / "args.json"), "--weights", str(paths["w"]), "--input",
         str(paths["x"]), "--out", str(paths["o"])])
    got = load_file(str(paths["o"]))
    x_ref = x.clone().requires_grad_(True)
    ref = moe(x_ref)
    ref.backward(grad_output)
    expected = {"output": ref.detach(), "grad.x": x_ref.grad, **{"grad." + n: p.grad for n, p in moe.named_parameters()}}
    for name, want in expected.items():
        assert got[name].dtype == want.dtype, (name, got[name].dtype, want.dtype)
        assert torch.equal(got[name], want), (case, name, (got[name] - want).abs().max().item())
    # The conversion mattered: without it the output differs.
    unconverted = MoE(MoEArgs(use_grouped_mm=True, **routing), dim=dim, hidden_dim=hidden)
    with torch.no_grad():
        unconverted.init_weights(0.02, torch.device("cpu"))
        for name, p in unconverted.named_parameters():
            p.copy_(weights[name])
    assert not torch.equal(unconverted(x).detach(), ref.detach())


# The whole model: torchtitan's Qwen3 MoE model (its Qwen3Model with moe_enabled) and titan's, from the same weights
# and balancing biases, on the same tokens.
MODEL_CASES = {
    # Qwen3-MoE's own routing (torchtitan's flavors): softmax, top 2 of 8, renormalised.
    "qwen3_softmax_top2": dict(num_experts=8, num_shared_experts=0, top_k=2, score_func="softmax", route_norm=True,
                               route_scale=1.0, score_before_experts=False, num_expert_groups=None, num_limited_groups=None),
    # The other options through torchtitan's MoEArgs: sigmoid over 4 groups keeping 2, top 3, scaled, the scores on
    # the expert inputs, one shared expert.
    "sigmoid_groups_shared_scores_first": dict(num_experts=8, num_shared_experts=1, top_k=3, score_func="sigmoid",
                                               route_norm=True, route_scale=2.5, score_before_experts=True,
                                               num_expert_groups=4, num_limited_groups=2),
}


def torchtitan_qwen3(routing, grouped=False, vary_norms=False):
    """torchtitan's Qwen3 model, two blocks of width 64: MoE with `routing` (dense when None), its own init, then
    routers drawn wider (clear preferences: no near-ties for rounding to flip) and, with vary_norms, non-trivial
    norm weights (so that their gradients are checked)."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    moe = dict(moe_enabled=True, moe_inter_dim=32,
               moe_args=MoEArgs(use_grouped_mm=grouped, load_balance_coeff=1e-3, **routing)) if routing else {}
    args = Qwen3ModelArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128,
                          max_seq_len=64, **moe)
    torch.manual_seed(0)
    model = Qwen3Model(args)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
        for name, p in model.named_parameters():
            if vary_norms and "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "router" in name:
                p.normal_(0.0, 0.5, generator=g)
    return model, g


def titan_qwen3_args(routing):
    """The same model's arguments for titan_model_probe --args-json."""
    args = dict(family="qwen3", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256,
                ffn_hidden_dim=128, norm_eps=1e-6, rope_theta=1000000.0, rope_layout="half_split", qk_norm=True,
                max_seq_len=64, tie_word_embeddings=False, depth_init=True)
    if routing:
        args["moe"] = dict(hidden_dim=32, load_balance_coeff=1e-3, **routing)
    return args


@pytest.mark.parametrize("case,float8,ac", [(case, None, None) for case in MODEL_CASES] +
                         [("qwen3_softmax_top2", "tensorwise", None), ("sigmoid_groups_shared_scores_first", "rowwise", None),
                          # titan under op-level checkpointing: the kept outputs of attention and of every other
                          # linear, float8 or MX ones included, reused by the recomputation
                          ("sigmoid_groups_shared_scores_first", "rowwise", "op"), ("qwen3_softmax_top2", "tensorwise", "op"),
                          # MXFP8 (torchao's MXFP8Linear, FLOOR scales: titan's mxfp8_cublas)
                          ("sigmoid_groups_shared_scores_first", "mxfp8_cublas", None),
                          ("sigmoid_groups_shared_scores_first", "mxfp8_cublas", "op")])
def test_whole_qwen3_moe_model_matches_torchtitan(tmp_path, monkeypatch, case, float8, ac):
    """Loss, logits and every gradient of torchtitan's Qwen3 MoE model against titan's (float32, 2 x 40 tokens, two
    blocks), with non-zero balancing biases so that they steer the choice of experts in both. With float8, both
    models' linears (attention, shared experts; not the output, and not the 8-expert router, whose 8 rows do not
    divide by 16) are float8 linears, emulated: torchao's Float8Linear in torchtitan's model, as its converter makes
    them; the routed experts stay in float32 in both. With MXFP8 likewise, torchao's MXFP8Linear (FLOOR scales) in
    place of every linear whose dimensions are multiples of 32 but the output."""
    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda t, bins, min, max: histc(t.float(), bins=bins, min=min, max=max).to(t.dtype))
    routing = MODEL_CASES[case]
    model, g = torchtitan_qwen3(routing, vary_norms=True)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert len(biases) == 2
    state = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    if float8 and float8.startswith("mxfp8"):
        from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        converted = []
        for fqn, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                # titan's MX selection: both dimensions multiples of 32, the output projection filtered.
                if type(child) is torch.nn.Linear and child_name != "output" and child.in_features % 32 == 0 and child.out_features % 32 == 0:
                    mx = MXFP8Linear(child.in_features, child.out_features, bias=False, kernel_preference=KernelPreference.EMULATED,
                                     scale_calculation_mode=ScaleCalculationMode.FLOOR)
                    with torch.no_grad():
                        mx.weight.copy_(child.weight)
                    setattr(module, child_name, mx)
                    converted.append(f"{fqn}.{child_name}")
        shared = 3 if routing["num_shared_experts"] else 0
        assert len(converted) == 2 * (4 + shared) and not any("router" in f for f in converted), converted
    elif float8:
        from torchao import float8 as torchao_float8
        from torchao.float8.float8_linear import Float8Linear
        from torchtitan.components.quantization.utils import module_filter_fn

        config = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(float8), emulate=True)
        torchao_float8.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda mod, fqn: module_filter_fn(mod, fqn, ["output"]))
        converted = sorted(fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear))
        shared = 3 if routing["num_shared_experts"] else 0
        assert len(converted) == 2 * (4 + shared) and not any("router" in f or f == "output" for f in converted), converted

    # MXFP8's weight gradients take blocks of 32 along the tokens: 2 x 32 tokens there, else 2 x 40.
    tokens = torch.randint(0, 256, (2, 33 if float8 and float8.startswith("mxfp8") else 41), generator=g)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    labels[1, :5] = -100
    weights, batch, out = tmp_path / "w.safetensors", tmp_path / "b.safetensors", tmp_path / "o.safetensors"
    save_file({**state, **biases}, str(weights))
    save_file({"inputs": inputs, "labels": labels}, str(batch))
    (tmp_path / "args.json").write_text(json.dumps(titan_qwen3_args(routing)))
    run([binary("titan_model_probe"), "--args-json", str(tmp_path / "args.json"), "--titan-weights", str(weights),
         "--batch", str(batch), "--out", str(out),
         *((["--mx", float8] if float8.startswith("mxfp8") else ["--float8", float8]) if float8 else []),
         *(["--ac-mode", "selective", "--ac-option", ac] if ac else [])])
    got = load_file(str(out))

    logits = model(inputs)
    valid = (labels != -100).sum()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100) / valid
    loss.backward()
    diff = ((got["logits"] - logits.detach()).abs().max() / logits.detach().abs().max()).item()
    kind = ("MX " if float8.startswith("mxfp8") else "float8 ") + float8 if float8 else ""
    case = f"{case}{', ' + kind if float8 else ''}{', titan under ' + ac + ' AC' if ac else ''}"
    print(f"{case}: logits max difference {diff:.2e} of the largest; loss {got['loss'].item():.7f} vs {loss.item():.7f}")
    assert diff < 1e-5
    assert abs(got["loss"].item() - loss.item()) <= 1e-5 * loss.item()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert sorted(k[5:] for k in got if k.startswith("grad.")) == sorted(grads)
    worst = 0.0
    for name, expected in grads.items():
        mine = got["grad." + name]
        if expected.abs().max() == 0:  # an expert no token reached
            assert mine.abs().max() == 0, name
            continue
        worst = max(worst, ((mine - expected).abs().max() / expected.abs().max()).item())
        torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-6, msg=lambda m: f"{case} {name}: {m}")
    print(f"{case}: worst gradient difference {worst:.2e} of the tensor's largest entry")
    assert worst < 1e-4


@pytest.mark.parametrize("case,float8", [("dense", None), ("qwen3_softmax_top2", None), ("sigmoid_groups_shared_scores_first", None),
                                        ("dense", "tensorwise"), ("sigmoid_groups_shared_scores_first", "rowwise")])
def test_op_level_checkpointing_keeps_what_torchtitans_policy_keeps(tmp_path, monkeypatch, case, float8):
    """Op-level selective activation checkpointing (selective_ac_option = "op") against torchtitan's own policy on
    its own Qwen3 model (dense, and MoE without and with a shared expert), each block checkpointed as torchtitan's
    apply_ac does it: every tensor titan's blocks keep from the forward, in order, against every output torchtitan's
    policy marks MUST_SAVE; and titan's loss and gradients, which go through the kept outputs in its backward,
    against torchtitan's float32 model.

    Test-side adjustments, so that torchtitan's policy takes its GPU path's decisions here: its grouped experts
    (torch._grouped_mm, which its policy does not save; they compute in bf16, so the gradients are compared with
    the float32 for-loop experts of the same model instead) with the CPU version of its token permutation; the CPU's
    flash attention op added to its save list (the list names the GPU's attention ops only); torch.histc as in the
    other tests.

    With float8 (torchao's Float8Linear, emulated, on every linear but the output and the router, as the float8
    converter makes them): torchao's linears call torch.mm on float8 tensors, which the policy counts and keeps as
    it does a bf16 product's, so titan's float8 linears keep the same outputs (the loss and gradients of titan's
    float8 and MX linears under op-level checkpointing, which go through the kept outputs, are compared with torchao's
    in test_whole_qwen3_moe_model_matches_torchtitan). The policy also keeps each
    tensorwise cast's absolute maximum (aten.max, a scalar), which titan's casts recompute; those are left out."""
    import functools

    import torch.utils.checkpoint as checkpoint
    import torchtitan.models.moe.utils as moe_utils
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import _apply_op_sac
    from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list

    histc = torch.histc
    monkeypatch.setattr(torch, "histc", lambda t, bins, min, max: histc(t.float(), bins=bins, min=min, max=max).to(t.dtype))
    monkeypatch.setattr(moe_utils, "generate_permute_indices",
                        functools.partial(moe_utils.generate_permute_indices, use_cpu=True))
    saved = []  # per block forward: the shapes of the outputs torchtitan's policy keeps
    policy_contexts = checkpoint.create_selective_checkpoint_contexts

    def logging_contexts(policy, *args, **kwargs):
        saved.append([])

        def logged(ctx, func, *a, **kw):
            decision = policy(ctx, func, *a, **kw)
            if not ctx.is_recompute and decision == checkpoint.CheckpointPolicy.MUST_SAVE:
                if func == torch.ops.aten.max.default and float8:
                    pass  # a float8 cast's amax (a scalar)
                elif func == torch.ops.aten.mm.default:
                    saved[-1].append([a[0].shape[0], a[1].shape[1]])
                else:  # attention: its output and log-sum-exp
                    assert "scaled_dot_product" in str(func), func
                    q = a[0]
                    saved[-1] += [list(q.shape), list(q.shape[:3])]
            return decision
        return policy_contexts(logged, *args, **kwargs)
    monkeypatch.setattr(checkpoint, "create_selective_checkpoint_contexts", logging_contexts)

    routing = MODEL_CASES.get(case)
    model, _ = torchtitan_qwen3(routing, grouped=True)
    state = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    if float8:
        from torchao import float8 as torchao_float8
        from torchao.float8.float8_linear import Float8Linear
        from torchtitan.components.quantization.utils import module_filter_fn

        config8 = dataclasses.replace(torchao_float8.Float8LinearConfig.from_recipe_name(float8), emulate=True)
        torchao_float8.convert_to_float8_training(
            model, config=config8, module_filter_fn=lambda mod, fqn: module_filter_fn(mod, fqn, ["output"]))
        converted = [fqn for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]
        assert converted and not any("router" in f or f == "output" for f in converted), converted
    save_list = set(_op_sac_save_list) | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    config = ActivationCheckpoint(mode="selective", selective_ac_option="op")
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, _apply_op_sac(block, config, base_fqn=f"layers.{name}", op_sac_save_list=save_list))
    tokens = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(5))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    model(inputs)  # the forward records what the policy keeps

    model, _ = torchtitan_qwen3(routing)  # the same weights, float32 throughout
    weights, batch, out, kept = (tmp_path / n for n in ("w.safetensors", "b.safetensors", "o.safetensors", "kept.json"))
    save_file({**state, **buffers}, str(weights))
    save_file({"inputs": inputs, "labels": labels}, str(batch))
    (tmp_path / "args.json").write_text(json.dumps(titan_qwen3_args(routing)))
    run([binary("titan_model_probe"), "--args-json", str(tmp_path / "args.json"), "--titan-weights", str(weights),
         "--batch", str(batch), "--out", str(out), "--ac-mode", "selective", "--ac-option", "op",
         "--kept-shapes", str(kept), *(["--float8", float8] if float8 else [])])
    got = load_file(str(out))
    if float8:
        titan_kept = json.loads(kept.read_text())
        numel = lambda blocks: [[int(torch.Size(s).numel()) for s in b] for b in blocks]
        print(f"{case}, float8 {float8}: torchtitan keeps {saved}; titan {titan_kept}")
        assert len(saved) == 2 and all(saved), saved
        assert numel(titan_kept) == numel(saved)
        return

    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()
    titan_kept = json.loads(kept.read_text())
    numel = lambda blocks: [[int(torch.Size(s).numel()) for s in b] for b in blocks]
    print(f"{case}: torchtitan keeps {saved}; titan {titan_kept}")
    assert len(saved) == 2 and all(saved), saved
    # A linear's output is (batch, seq, out) in titan and (batch x seq, out) in torchtitan's matmul: same elements.
    assert numel(titan_kept) == numel(saved)
    assert abs(got["loss"].item() - loss.item()) <= 1e-5 * loss.item()
    for name, p in model.named_parameters():
        if p.grad.abs().max() == 0:
            assert got["grad." + name].abs().max() == 0, name
            continue
        worst = ((got["grad." + name] - p.grad).abs().max() / p.grad.abs().max()).item()
        assert worst < 1e-5, f"{case} {name}: gradients differ by {worst:.2e} of the largest entry"
