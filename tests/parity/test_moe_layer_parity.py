"""titan's Mixture-of-Experts layer (models/common/moe.h) against torchtitan 0.2.2's own MoE module on this CPU, from
the same weights and input: output, input gradient and every parameter gradient (router, routed experts, shared
experts), for the routing options Hugging Face's Qwen3-MoE cannot express: sigmoid scores, node-limited expert groups,
shared experts, route_scale and scores applied before the experts.

torchtitan runs here with two test-side adjustments: its for-loop experts (use_grouped_mm = False; its grouped
matmul needs a GPU), and torch.histc, which its router calls on an integer tensor that the CPU kernel refuses,
counted in float32 and converted back."""
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
