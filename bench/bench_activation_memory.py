#!/usr/bin/env python3
"""Activation memory of titan's blocks against torchtitan's own model under the same activation checkpointing, on
this CPU: the same model shape, batch, precision and weights, forward + summed cross-entropy + backward on one
process. Measured on each side by its own allocator accounting: torchtitan's with PyTorch's profiler (the CPU
allocator's "Total Allocated" over the step), titan's with its allocation tracker (titan_model_probe
--memory-json); both count from just before the forward. Printed per configuration and AC mode: what the forward and
loss leave allocated for backward, the peak through backward, and titan / torchtitan. Never passes or fails.

torchtitan's op-level policy is applied with `_apply_op_sac` and its own save list, plus the CPU's flash attention
op (the list names the GPU's attention ops only, so on a CPU torchtitan would recompute attention); its MoE runs its
grouped experts (as on a GPU: their products are not saved) with the CPU version of its token permutation.

usage: bench/bench_activation_memory.py [--configs llama3-debug-fp32,llama3-debug-bf16,qwen3-moe-bf16]
                                        [--modes none,op,full]
"""
import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start and stop lines
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
PROBE = os.environ.get("TITAN_MODEL_PROBE", str(ROOT / "build" / "bin" / "titan_model_probe"))
# name -> (family, shape, batch, seq_len, bf16)
CONFIGS = {
    "llama3-debug-fp32": ("llama3", dict(dim=256, n_layers=6, n_heads=16, vocab_size=2048), 4, 1024, False),
    "llama3-debug-bf16": ("llama3", dict(dim=256, n_layers=6, n_heads=16, vocab_size=2048), 4, 1024, True),
    "qwen3-moe-bf16": ("qwen3-moe", dict(dim=256, n_layers=4, n_heads=16, n_kv_heads=8, head_dim=32, vocab_size=2048,
                                         hidden_dim=512), 2, 1024, True),
}


def torchtitan_model(family, shape):
    torch.manual_seed(0)
    if family == "llama3":
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer
        from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list
        model = Transformer(TransformerModelArgs(max_seq_len=4096, **shape))
    else:
        from torchtitan.models.moe import MoEArgs
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
        from torchtitan.models.qwen3.model.model import Qwen3Model
        from torchtitan.models.qwen3.infra.parallelize import _op_sac_save_list
        model = Qwen3Model(Qwen3ModelArgs(max_seq_len=4096, moe_enabled=True, moe_inter_dim=128,
                                          moe_args=MoEArgs(num_experts=8, top_k=2, use_grouped_mm=True,
                                                           load_balance_coeff=1e-3), **shape))
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model, _op_sac_save_list


def titan_args(family, shape, model):
    w1 = model.layers["0"].feed_forward.w1.weight if family == "llama3" else None
    args = dict(family="qwen3" if family != "llama3" else "llama3", dim=shape["dim"], n_layers=shape["n_layers"],
                n_heads=shape["n_heads"], n_kv_heads=shape.get("n_kv_heads") or shape["n_heads"],
                head_dim=shape.get("head_dim", shape["dim"] // shape["n_heads"]), vocab_size=shape["vocab_size"],
                max_seq_len=4096, tie_word_embeddings=False, depth_init=True)
    if family == "llama3":
        args.update(ffn_hidden_dim=w1.shape[0], norm_eps=1e-5, rope_theta=10000.0, rope_layout="interleaved")
    else:
        args.update(ffn_hidden_dim=shape["hidden_dim"], norm_eps=1e-6, rope_theta=1000000.0, rope_layout="half_split",
                    qk_norm=True, moe=dict(num_experts=8, top_k=2, hidden_dim=128, num_shared_experts=0,
                                           score_func="softmax", route_norm=False, route_scale=1.0,
                                           score_before_experts=False, load_balance_coeff=1e-3))
    return args


def torchtitan_memory(config, mode):
    from torch.profiler import ProfilerActivity, profile, record_function
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import _apply_full_ac, _apply_op_sac

    family, shape, batch, seq, bf16 = CONFIGS[config]
    model, save_list = torchtitan_model(family, shape)
    ac = ActivationCheckpoint(mode="selective" if mode == "op" else mode, selective_ac_option="op")
    for name, block in list(model.layers.named_children()):
        if mode == "op":
            block = _apply_op_sac(block, ac, base_fqn=f"layers.{name}", op_sac_save_list=set(save_list) | {
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default})
        elif mode == "full":
            block = _apply_full_ac(block, ac)
        model.layers.register_module(name, block)
    tokens = torch.randint(0, shape["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    # No garbage from before may be freed inside the profiled step: the profiler would count it as negative.
    gc.collect()
    gc.disable()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench_forward"), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
        loss.backward()
    gc.enable()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    forward = next(e for e in events if e.get("name") == "bench_forward" and e.get("ph") == "X")
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]")
    end = forward["ts"] + forward["dur"]
    after_forward = [m for t, m in memory if t <= end][-1]
    return {"after_forward": after_forward, "peak": max(m for _, m in memory)}, model, inputs, labels


def titan_memory(config, mode, model, inputs, labels, tmp):
    family, shape, batch, seq, bf16 = CONFIGS[config]
    state = {n.replace("._checkpoint_wrapped_module", ""): p.detach().clone().contiguous() for n, p in model.named_parameters()}
    state.update({n.replace("._checkpoint_wrapped_module", ""): b.clone() for n, b in model.named_buffers()
                  if n.endswith("expert_bias")})
    tmp = Path(tmp)
    save_file(state, str(tmp / "w.safetensors"))
    save_file({"inputs": inputs, "labels": labels}, str(tmp / "b.safetensors"))
    (tmp / "args.json").write_text(json.dumps(titan_args(family, shape, model)))
    ac = {"none": ["--ac-mode", "none"], "op": ["--ac-mode", "selective", "--ac-option", "op"], "full": ["--ac-mode", "full"]}[mode]
    subprocess.run([PROBE, "--args-json", str(tmp / "args.json"), "--titan-weights", str(tmp / "w.safetensors"),
                    "--batch", str(tmp / "b.safetensors"), "--out", str(tmp / "o.safetensors"), "--memory-json",
                    str(tmp / "m.json"), *ac, *(["--autocast-bf16"] if bf16 else [])], check=True)
    return json.loads((tmp / "m.json").read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--modes", default="none,op,full")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # CONFIG:MODE:OUT.json, one measurement in this process
    args = parser.parse_args()
    if args.one:
        # One measurement per process: PyTorch's profiler reports 50-110 MiB more on a second profiled step in the
        # same process (measured), so every step gets a fresh one.
        import torchtitan.models.moe.utils as moe_utils
        moe_utils.generate_permute_indices = functools.partial(moe_utils.generate_permute_indices, use_cpu=True)
        histc = torch.histc
        torch.histc = lambda t, bins, min, max: histc(t.float(), bins=bins, min=min, max=max).to(t.dtype)
        config, mode, out = args.one.split(":", 2)
        theirs, model, inputs, labels = torchtitan_memory(config, mode)
        with tempfile.TemporaryDirectory() as tmp:
            ours = titan_memory(config, mode, model, inputs, labels, tmp)
        Path(out).write_text(json.dumps({"torchtitan": theirs, "titan": ours}))
        return 0
    mib = 1 << 20
    print(f"{'configuration':<20} {'AC':<5} {'kept after forward, MiB':>36} {'peak through backward, MiB':>36}")
    print(f"{'':<20} {'':<5} {'torchtitan':>12}{'titan':>12}{'ratio':>12} {'torchtitan':>12}{'titan':>12}{'ratio':>12}")
    for config in args.configs.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "m.json"
                subprocess.run([sys.executable, __file__, "--one", f"{config}:{mode}:{out}"], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                m = json.loads(out.read_text())
            theirs, ours = m["torchtitan"], m["titan"]
            a, b = theirs["after_forward"] / mib, ours["after_forward"] / mib
            c, d = theirs["peak"] / mib, ours["peak"] / mib
            print(f"{config:<20} {mode:<5} {a:>12.1f}{b:>12.1f}{b / a:>11.2f}x {c:>12.1f}{d:>12.1f}{d / c:>11.2f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
