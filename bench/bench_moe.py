#!/usr/bin/env python3
"""Mixture-of-Experts training throughput: titan against torchtitan's own model on the same CPU (Qwen3-MoE or
DeepSeek-V3), and titan's expert parallelism against FSDP on the same ranks.

Models (--model): `qwen3-moe`, torchtitan's debugmodel_moe shape (dim 256, 64 experts of width 768, top 8, softmax
routing renormalised, scores on the outputs) with fewer layers (--layers, default 2); `deepseek-v3`, torchtitan's
DeepSeek-V3 debugmodel (dim 256, multi-head latent attention with 16 heads of 128 + 64 query/key and 128 value
columns over a 512-wide latent, one dense block of width 1024, then MoE blocks of 8 experts of width 256, top 3, two
shared experts; --layers default 6, its own). Single process: titan (the trainer, fused kernels on) against
torchtitan's model in PyTorch eager with its for-loop experts (use_grouped_mm = False: its grouped matmul needs a
GPU) and its integer torch.histc counted in float (the CPU kernel refuses integers), and the same under torch.compile
per block where it compiles. The model's context is the batch's sequence (torchtitan sets max_seq_len from
training.seq_len, so DeepSeek-V3's YaRN is off in both). Both train with fused AdamW, clipping at 1.0, bf16 autocast
from float32 weights (or float32).
Two ranks on the same cores: titan with FSDP 2 (every rank gathers every expert) against EP 2 (each rank keeps half
the experts and exchanges tokens), one thread each, with the bytes EP moves per step from the routed counts' figure
(2 x (sent + received rows) x dim x dtype bytes per block and pass, forward and backward).

Each run is a fresh process; systems are interleaved and repeated; the table gives the median tokens/s (min-max)
and ratios. Never passes or fails on time.

usage: bench/bench_moe.py [--model qwen3-moe|deepseek-v3] [--layers N] [--batch 4] [--seq 256] [--precision bf16|fp32]
                          [--repeats 3] [--steps 8] [--systems titan,eager,compile-block,titan-fsdp2,titan-ep2]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ["titan", "eager", "compile-block", "titan-fsdp2", "titan-ep2"]
# Per model: titan's flavor, the default block count, routed experts per token, MoE blocks among `layers`.
MODELS = {
    "qwen3-moe": dict(titan=["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"], layers=2, top_k=8, dense_layers=0),
    "deepseek-v3": dict(titan=["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"], layers=6, top_k=3, dense_layers=1),
}


def titan_run(args, ranks=1, ep=1):
    binary = os.environ.get("TITAN_BIN", str(ROOT / "build" / "bin" / "titan"))
    warm = max(2, args.steps // 3)
    with tempfile.TemporaryDirectory() as dump:
        cmd = [binary, "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"), *MODELS[args.model]["titan"],
               "--model.n_layers", str(args.layers), "--job.dump_folder", dump,
               "--training.steps", str(args.steps), "--training.seq_len", str(args.seq),
               "--training.local_batch_size", str(args.batch // ranks), "--metrics.log_freq", "1",
               "--training.mixed_precision_param", "bfloat16" if args.precision == "bf16" else "float32",
               "--activation_checkpoint.mode", "none", "--optimizer.implementation", "fused"]
        threads = os.cpu_count() or 1
        if ranks > 1:
            cmd = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
                   "-np", str(ranks)] + cmd + ["--parallelism.expert_parallel_degree", str(ep)]
            threads = max(1, threads // ranks)
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        if out.returncode != 0:
            sys.exit(f"titan failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    # tps is per device: the whole job's tokens/s is that times the ranks.
    tps = [float(m.replace(",", "")) * ranks for m in re.findall(r"tps: ([\d,]+)", out.stdout)]
    health = re.findall(r"experts: max ([\d.]+)x", out.stdout)
    return dict(tps=statistics.median(tps[warm:]), max_load=float(health[-1]) if health else None)


def torchtitan_model(args):
    """torchtitan's own model for --model, with its for-loop experts, initialised by its init_weights."""
    import torch
    from torchtitan.models.moe import MoEArgs

    torch.manual_seed(0)
    if args.model == "qwen3-moe":
        from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
        from torchtitan.models.qwen3.model.model import Qwen3Model

        model_args = Qwen3ModelArgs(vocab_size=2048, max_seq_len=args.seq, dim=256, n_layers=args.layers, n_heads=16, n_kv_heads=8,
                                    head_dim=128, qk_norm=True, moe_enabled=True, moe_inter_dim=768,
                                    moe_args=MoEArgs(num_experts=64, num_shared_experts=0, top_k=8, score_func="softmax",
                                                     route_norm=True, route_scale=1.0, score_before_experts=False,
                                                     use_grouped_mm=False))
        model = Qwen3Model(model_args)
    else:
        import dataclasses

        from torchtitan.models.deepseek_v3 import deepseekv3_args
        from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model

        debug = deepseekv3_args["debugmodel"]
        model_args = dataclasses.replace(debug, max_seq_len=args.seq, n_layers=args.layers,
                                         moe_args=dataclasses.replace(debug.moe_args, use_grouped_mm=False))
        model_args.moe_impl = "standard"  # what update_from_config sets from parallelism.expert_parallel_comm_backend
        model = DeepSeekV3Model(model_args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def torch_worker(system, args):
    """Runs in a fresh process: torchtitan's model, prints a JSON line."""
    import torch

    histc = torch.histc
    torch.histc = lambda t, bins, min, max: histc(t.float(), bins=bins, min=min, max=max).to(t.dtype)
    torch.set_num_threads(os.cpu_count() or 1)
    model = torchtitan_model(args)
    forward = model
    if system == "compile-block":
        for key in list(model.layers.keys()):
            model.layers[key] = torch.compile(model.layers[key])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    tokens = torch.randint(0, 2048, (args.batch, args.seq + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = forward(inputs)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    per_step = []
    for _ in range(1, args.steps):
        t0 = time.perf_counter()
        step()
        per_step.append(time.perf_counter() - t0)
    warm = max(2, args.steps // 3)
    steady = statistics.median(per_step[warm - 1:])
    print(json.dumps(dict(tps=args.batch * args.seq / steady, compile_s=max(0.0, first - steady) if system.startswith("compile") else 0.0)))


def run_system(system, args):
    if system == "titan":
        return titan_run(args)
    if system == "titan-fsdp2":
        return titan_run(args, ranks=2, ep=1)
    if system == "titan-ep2":
        return titan_run(args, ranks=2, ep=2)
    cmd = [sys.executable, __file__, "--worker", system, "--model", args.model, "--layers", str(args.layers), "--batch", str(args.batch), "--seq",
           str(args.seq), "--precision", args.precision, "--steps", str(args.steps)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        print(f"  {system} failed: {lines[-1] if lines else out.returncode}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-moe")
    parser.add_argument("--layers", type=int, help="blocks (default: 2 for qwen3-moe, 6 for deepseek-v3)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.layers is None:
        args.layers = MODELS[args.model]["layers"]
    if args.worker:
        torch_worker(args.worker, args)
        return
    systems = args.systems.split(",")
    results = {s: [] for s in systems}
    for r in range(args.repeats):
        for s in systems:
            out = run_system(s, args)
            if out:
                results[s].append(out)
                print(f"  repeat {r + 1} {s}: {out['tps']:,.0f} tokens/s", flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    shape = "debugmodel_moe shape" if args.model == "qwen3-moe" else "DeepSeek-V3 debugmodel"
    print(f"\n{shape}, {args.layers} layers, {args.batch} x {args.seq} tokens, {args.precision}; {cpu}, "
          f"{os.cpu_count()} cores; median of {args.repeats} runs (min-max), tokens/s of the whole job")
    medians = {s: statistics.median(x["tps"] for x in v) for s, v in results.items() if v}
    for s in systems:
        if s not in medians:
            print(f"  {s:14} failed")
            continue
        v = [x["tps"] for x in results[s]]
        note = ""
        if s == "titan" and "eager" in medians:
            note = f"  {medians['titan'] / medians['eager']:.2f}x torchtitan eager"
            if "compile-block" in medians:
                note += f", {medians['titan'] / medians['compile-block']:.2f}x compiled"
        if s == "titan-ep2" and "titan-fsdp2" in medians:
            note = f"  {medians['titan-ep2'] / medians['titan-fsdp2']:.2f}x FSDP 2 on the same ranks"
        if s == "compile-block":
            note = f"  (compiling: {statistics.median(x['compile_s'] for x in results[s]):.0f} s)"
        print(f"  {s:14} {medians[s]:10,.0f}  ({min(v):,.0f}-{max(v):,.0f}){note}")
    # The bytes EP moves: each block and pass sends what other ranks' experts get and returns what it received.
    if "titan-ep2" in medians:
        top_k = MODELS[args.model]["top_k"]
        moe_blocks = args.layers - MODELS[args.model]["dense_layers"]
        rows = args.batch // 2 * args.seq * top_k  # a rank's routed rows
        element = 2 if args.precision == "bf16" else 4
        print(f"  EP 2 exchange: about {rows // 2:,} of a rank's {rows:,} routed rows go to the other rank's experts per block "
              f"when the load is even; {2 * 2 * (rows // 2) * 256 * element * moe_blocks / 1e6:.1f} MB sent per rank per step "
              f"(forward and backward, {moe_blocks} MoE blocks)")


if __name__ == "__main__":
    main()
