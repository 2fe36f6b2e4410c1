#!/usr/bin/env python3
"""Training throughput of titan against PyTorch peers on the same CPU, batch, precision and optimizer.

Systems: titan (fused kernels on, and off), torchtitan's own Llama 3 model code in PyTorch eager, the same under
torch.compile per transformer block and for the whole model, and HF transformers' LlamaForCausalLM. All train with
fused AdamW, gradient clipping at 1.0 and loss summed in float32 over the batch; bf16 runs compute under CPU
autocast from float32 weights (titan: training.mixed_precision_param = bfloat16). Each run is a fresh process; systems
are interleaved and repeated; the table gives the median tokens/s with min-max, each system's MFU against the
peak titan measures (a bf16 or fp32 matmul, printed), the ratio to the best torch.compile variant, and the time
the compiled variants spend compiling. Never passes or fails on time.

usage: bench/bench_train_vs_peers.py [--configs debug-bf16,debug-fp32,100M-4x512-bf16,...] [--repeats 3]
                                     [--steps 10] [--systems titan,titan-unfused,eager,compile-block,compile-model,hf]
       bench/bench_train_vs_peers.py --profile [--configs debug-bf16]   (titan's own time split)
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
SHAPES = {  # titan flavor -> torchtitan TransformerModelArgs fields
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=None, vocab_size=2048),
    "100M": dict(dim=768, n_layers=16, n_heads=12, n_kv_heads=4, vocab_size=2048),
}
CONFIGS = {  # name -> (flavor, batch, seq_len, precision)
    "debug-bf16": ("debugmodel", 8, 512, "bf16"),
    "debug-fp32": ("debugmodel", 8, 512, "fp32"),
    "100M-4x512-bf16": ("100M", 4, 512, "bf16"),
    "100M-1x2048-bf16": ("100M", 1, 2048, "bf16"),
    "100M-4x512-fp32": ("100M", 4, 512, "fp32"),
    "100M-1x2048-fp32": ("100M", 1, 2048, "fp32"),
}
SYSTEMS = ["titan", "titan-unfused", "eager", "compile-block", "compile-model", "hf"]


def titan_run(config, steps, threads, fused=True, profile_dir=None):
    flavor, batch, seq, precision = CONFIGS[config]
    binary = os.environ.get("TITAN_BIN", str(ROOT / "build" / "bin" / "titan"))
    warm = max(2, steps // 3)
    with tempfile.TemporaryDirectory() as dump:
        cmd = [binary, "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--model.flavor", flavor,
               "--job.dump_folder", dump, "--training.steps", str(steps), "--training.seq_len", str(seq),
               "--training.local_batch_size", str(batch), "--metrics.log_freq", "1",
               "--training.mixed_precision_param", "bfloat16" if precision == "bf16" else "float32",
               "--activation_checkpoint.mode", "none", "--optimizer.implementation", "fused",
               "--training.fused_kernels", "true" if fused else "false"]
        if profile_dir:
            cmd += ["--profiling.enable_profiling", "--profiling.profile_freq", str(steps), "--profiling.profiler_warmup", "1",
                    "--profiling.profiler_active", "1", "--job.dump_folder", profile_dir]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        if out.returncode != 0:
            sys.exit(f"titan failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    times = [float(m) for m in re.findall(r"end_to_end.*?([\d.]+)", "")]  # (not logged on stdout)
    del times
    tps = [float(m.replace(",", "")) for m in re.findall(r"tps: ([\d,]+)", out.stdout)]
    losses = [float(m) for m in re.findall(r"step:\s+\d+\s+loss:\s+([\d.]+)", out.stdout)]
    peak = re.search(r"CPU peak ([\d.]+) GFLOP/s", out.stdout)
    flops = re.search(r"([\d.]+) MFLOP per token", out.stdout)
    # log_freq 1: each line is one step's tokens/s; the median of the steps after warm-up.
    return dict(tps=statistics.median(tps[warm:]), loss=losses[-1], peak=float(peak.group(1)) * 1e9 if peak else None,
                flops_per_token=float(flops.group(1)) * 1e6 if flops else None, compile_s=0.0)


def torch_worker(system, config, steps, threads):
    """Runs in a fresh process: one PyTorch peer, prints a JSON line."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    flavor, batch, seq, precision = CONFIGS[config]
    shape = SHAPES[flavor]
    if system == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        from torchtitan.models.llama3 import TransformerModelArgs
        tt = TransformerModelArgs(**shape, multiple_of=256, rope_theta=500000, max_seq_len=seq)
        hidden = tt.dim * 4
        hidden = int(2 * hidden / 3)
        hidden = 256 * ((hidden + 255) // 256)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=shape["vocab_size"], hidden_size=shape["dim"], intermediate_size=hidden,
            num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
            num_key_value_heads=shape["n_kv_heads"] or shape["n_heads"], rope_theta=500000.0,
            max_position_embeddings=seq, attn_implementation="sdpa"))
        forward = lambda x: model(input_ids=x).logits  # noqa: E731
    else:
        from torchtitan.models.llama3 import Transformer, TransformerModelArgs

        model = Transformer(TransformerModelArgs(**shape, multiple_of=256, rope_theta=500000, max_seq_len=seq))
        with torch.no_grad():
            model.init_weights()
        if system == "compile-block":
            for key in list(model.layers.keys()):
                model.layers[key] = torch.compile(model.layers[key])
            forward = model
        elif system == "compile-model":
            forward = torch.compile(model)
        else:
            forward = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    tokens = torch.randint(0, shape["vocab_size"], (batch, seq + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = forward(inputs)
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            loss = loss / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        return loss

    start = time.perf_counter()
    step()  # the first step compiles under torch.compile
    compile_s = time.perf_counter() - start
    warm = max(2, steps // 3)
    per_step = []
    for i in range(1, steps):
        t0 = time.perf_counter()
        step()
        per_step.append(time.perf_counter() - t0)
    tps = batch * seq / statistics.median(per_step[warm - 1:])
    steady = statistics.median(per_step)
    print(json.dumps(dict(tps=tps, compile_s=max(0.0, compile_s - steady) if system.startswith("compile") else 0.0)))


def run_system(system, config, steps, threads):
    if system in ("titan", "titan-unfused"):
        return titan_run(config, steps, threads, fused=system == "titan")
    out = subprocess.run([sys.executable, __file__, "--worker", system, "--configs", config, "--steps", str(steps),
                          "--threads", str(threads)], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if out.returncode != 0:
        print(f"  {system} failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def profile_split(config, steps, threads):
    """titan's own time split of one step from LibTorch's profiler (self time of each op, by category)."""
    with tempfile.TemporaryDirectory() as dump:
        titan_run(config, steps, threads, profile_dir=dump)
        trace = next(Path(dump).glob("profile_traces/iteration_*/rank0_trace.json"))
        events = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    by_thread = {}
    for e in events:
        by_thread.setdefault(e["tid"], []).append(e)
    self_time = {}
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                self_time[stack[-1]["name"]] = self_time.get(stack[-1]["name"], 0) - e["dur"]
            self_time[e["name"]] = self_time.get(e["name"], 0) + e["dur"]
            stack.append(e)

    def category(name):
        n = name.lower()
        if n.startswith("titan::") and any(c in n for c in ("all_", "reduce", "broadcast", "send", "recv", "wait", "barrier")):
            return "communication"
        if "attention" in n or "flash" in n or "sdpa" in n:
            return "attention"
        if any(k in n for k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "mmbackward")):
            return "matmul"
        if any(k in n for k in ("softmax", "nll_loss", "cross_entropy")):
            return "loss"
        if any(k in n for k in ("adam", "foreach", "clip", "norm")) and "rms" not in n:
            return "optimizer"
        if "data" in n:
            return "data"
        return "elementwise and other"

    totals = {}
    for name, t in self_time.items():
        totals[category(name)] = totals.get(category(name), 0) + t
    whole = sum(totals.values())
    print(f"titan's time split, {config}, one profiled step ({whole / 1e3:.0f} ms of op time):")
    for cat, t in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:24} {t / 1e3:9.1f} ms  {100 * t / whole:5.1f}%")
    print("  the largest ops by self time:")
    for name, t in sorted(self_time.items(), key=lambda kv: -kv[1])[:15]:
        short = name if len(name) <= 60 else "..." + name[-57:]
        print(f"    {short:60} {t / 1e3:9.1f} ms  {100 * t / whole:5.1f}%  ({category(name)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="debug-bf16,debug-fp32,100M-4x512-bf16")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return torch_worker(args.worker, args.configs, args.steps, args.threads)
    configs = args.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            sys.exit(f"unknown config {c!r}; known: {', '.join(CONFIGS)}")
    if args.profile:
        for c in configs:
            profile_split(c, args.steps, args.threads)
        return
    systems = args.systems.split(",")
    print(f"{args.threads} threads, {args.steps} steps per run (median after warm-up), {args.repeats} interleaved repeats, "
          f"fresh process per run")
    for config in configs:
        flavor, batch, seq, precision = CONFIGS[config]
        results = {s: [] for s in systems}
        info = {}
        for r in range(args.repeats):
            for s in systems:
                res = run_system(s, config, args.steps, args.threads)
                if res:
                    results[s].append(res)
                    if s == "titan":
                        info = res
        print(f"\n{config}: {flavor} {batch}x{seq} {precision}; peak {info.get('peak', 0) / 1e9:.0f} GFLOP/s (titan's "
              f"measured {precision} matmul), {info.get('flops_per_token', 0) / 1e6:.1f} MFLOP per token")
        medians = {s: statistics.median(x["tps"] for x in v) for s, v in results.items() if v}
        compiled = [medians[s] for s in ("compile-block", "compile-model") if s in medians]
        best_compiled = max(compiled) if compiled else None
        for s in systems:
            if s not in medians:
                print(f"  {s:16} (no result)")
                continue
            tps = [x["tps"] for x in results[s]]
            mfu = 100 * medians[s] * info["flops_per_token"] / info["peak"] if info.get("peak") and info.get("flops_per_token") else 0
            line = f"  {s:16} {medians[s]:9,.0f} tok/s  [{min(tps):,.0f}-{max(tps):,.0f}]  MFU {mfu:5.1f}%"
            if best_compiled:
                line += f"  vs best torch.compile {medians[s] / best_compiled:5.2f}x"
            comp = [x["compile_s"] for x in results[s] if x.get("compile_s")]
            if comp:
                line += f"  (compile {statistics.median(comp):.1f} s)"
            print(line)
        if "titan" in results and "titan-unfused" in results and results["titan"] and results["titan-unfused"]:
            print(f"  losses after {args.steps} steps: titan {results['titan'][0]['loss']:.5f}, unfused "
                  f"{results['titan-unfused'][0]['loss']:.5f}")


if __name__ == "__main__":
    main()
