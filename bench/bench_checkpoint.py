#!/usr/bin/env python3
"""Checkpoint speed: save and load times and MB/s of titan's checkpoints against the peer a torchtitan user has,
PyTorch's torch.distributed.checkpoint (DCP), on the same ranks, disk and state, and against the disk's raw
sequential write speed measured here with dd (fdatasync); for asynchronous saves, how long the training loop is
blocked per save, the first save and the later ones apart (both sides keep their staging memory between saves:
titan always, DCP through one DefaultStager passed to every async_save). Prints figures and ratios; never fails
on time.

The state is the same on both sides: titan trains 8 steps, saving every 4, a full checkpoint (weights and AdamW
moments, float32); `titan convert --format dcp` turns it into a DCP folder, from which the peer loads exactly those
tensors onto its ranks (gloo, each rank holding its row-block of every tensor as a DTensor, as FSDP would) and then
times `dcp.save` (FileSystemWriter's defaults: one thread, every file fsynced, as titan fsyncs) twice back to back,
two `dcp.async_save`
calls with one kept stager (the time until each returns is what blocks a training loop) and `dcp.load`. Loads on
both sides read files just written (the page cache holds them), so they measure the format's reading cost more
than the disk. Each side's save figure is its process's first synchronous save (before 2026-12-01 titan's was its
second, 3 steps after the first, against DCP's first: on a cloud disk past its burst that second save ran at a
third of the first's rate, as dd's did back to back); both sides' second saves are printed too. titan makes its staging memory in the background after the process's first step, so that the first
save (3 steps later here; hundreds in a real run) finds it ready; DCP's first async_save makes its stager's memory
itself.

Flavors are titan's (debugmodel, 100M, ...); "1B:4" is the 1B flavor's shapes with 4 of its 16 layers (its
128,256 x 2,048 embedding, 1 GB in float32, and 0.5B parameters: 6.2 GB of state, what fits the 24 GB machine twice
over for the asynchronous copies; the whole 1B flavor is 15 GB of state).

usage: bench/bench_checkpoint.py [--ranks 1,2,4] [--flavors debugmodel,100M,1B:4] [--dump /tmp/titan_ckpt_bench]
"""
import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("TITAN_BIN_DIR", ROOT / "build" / "bin"))
SAVE_EVERY = 4  # steps between saves
MPIRUN = ["mpirun", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none"]


def dd_write_mb_s(folder):
    path = Path(folder) / "dd.bin"
    out = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", "count=512", "conv=fdatasync"],
                         capture_output=True, text=True)
    path.unlink(missing_ok=True)
    m = re.search(r"([\d.]+) ([MG])B/s", out.stderr)
    return float(m.group(1)) * (1000 if m.group(2) == "G" else 1)


def folder_mb(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6


def flavor_args(flavor):
    name, _, layers = flavor.partition(":")
    return ["--model.flavor", name, *(["--model.n_layers", layers] if layers else [])]


def train(dump, flavor, steps, ranks, extra=(), may_not_fit=False):
    """titan's output; None when `may_not_fit` and its start-up memory check refused the job."""
    # The plain loss (training.fused_kernels = false): the fused one keeps a float32 gradient of the whole output
    # weight from forward to backward (1 GB for the 1B shapes' 128,256 x 2,048), where 32 tokens' logits take 66 MB,
    # so that the 1B shapes' synchronous saves fit 4 ranks on a 24 GB machine. The state saved is the same.
    cmd = [str(BIN / "titan"), "train", "--job.config_file", str(ROOT / "configs" / "debug_model.toml"),
           "--job.dump_folder", str(dump), *flavor_args(flavor), "--training.seq_len", "32", "--training.fused_kernels", "false",
           "--training.local_batch_size", "1", "--training.steps", str(steps), "--checkpoint.enable",
           "--checkpoint.interval", str(SAVE_EVERY), "--checkpoint.no_last_save_model_only", "--checkpoint.keep_latest_k", "0",
           "--metrics.disable_color_printing", "--activation_checkpoint.mode", "none", *extra]
    if ranks > 1:
        cmd = [*MPIRUN, "-np", str(ranks), *cmd, "--parallelism.data_parallel_shard_degree", str(ranks)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1" if ranks > 1 else "2"))
    if may_not_fit and out.returncode == 2 and "this rank needs about" in out.stderr:
        print(f"{flavor} on {ranks} rank(s), {' '.join(extra)}: does not fit this machine ({out.stderr.strip().splitlines()[0][:160]})",
              flush=True)
        return None
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def titan_figures(base, flavor, ranks, mode):
    """Save MB and seconds, load seconds and blocked seconds (first save, later saves) of titan's checkpoint in `mode`;
    None when an asynchronous save's staging copy does not fit this machine beside the job."""
    dump = base / f"titan_{flavor.replace(':', '_')}_{ranks}_{mode}"
    shutil.rmtree(dump, ignore_errors=True)
    out = train(dump, flavor, 2 * SAVE_EVERY, ranks, ["--checkpoint.async_mode", mode], may_not_fit=mode != "disabled")
    if out is None:
        return None
    saves = [(float(m.group(1)), float(m.group(2))) for m in re.finditer(r"Saved checkpoint .*?: ([\d.]+) MB in ([\d.]+) s", out)]
    blocked = [float(x) for x in re.findall(r"training blocked ([\d.]+) s", out)]
    # The first save is the one timed, as DCP's (a real run's saves come minutes apart); the second follows it 3 steps
    # later, where a cloud disk past its burst writes slower, and is printed beside DCP's second save.
    mb, seconds = saves[0]
    load_out = train(dump, flavor, 2 * SAVE_EVERY + 1, ranks, ["--checkpoint.async_mode", mode])
    load_s = float(re.search(r"Loaded checkpoint .* in ([\d.]+) s", load_out).group(1))
    later = sorted(blocked[1:])
    return dict(mb=mb, save_s=seconds, second_save_s=saves[-1][1], load_s=load_s, blocked_first_s=blocked[0] if blocked else seconds,
                blocked_later_s=later[len(later) // 2] if later else seconds, folder=dump / "checkpoint" / f"step-{2 * SAVE_EVERY}")


def dcp_figures(base, flavor, ranks, titan_step):
    """The same state through torch DCP on `ranks` gloo processes (this script's --dcp-worker)."""
    source = base / f"dcp_source_{flavor.replace(':', '_')}_{ranks}"
    shutil.rmtree(source, ignore_errors=True)
    conv = subprocess.run([str(BIN / "titan"), "convert", "--from", str(titan_step), "--to", str(source), "--format", "dcp"],
                          capture_output=True, text=True)
    if conv.returncode != 0:
        sys.exit(f"titan convert failed:\n{conv.stdout[-2000:]}\n{conv.stderr[-2000:]}")
    out_dir = base / f"dcp_{flavor.replace(':', '_')}_{ranks}"
    shutil.rmtree(out_dir, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--dcp-worker", str(source), str(out_dir)]
    if ranks > 1:
        cmd = [*MPIRUN, "-np", str(ranks), "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}", *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1" if ranks > 1 else "2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    shutil.rmtree(source, ignore_errors=True)
    m = re.search(r"^DCP (\{.*\})$", out.stdout, re.M)
    if out.returncode != 0 or not m:
        sys.exit(f"DCP worker failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    figures = json.loads(m.group(1))
    shutil.rmtree(out_dir, ignore_errors=True)
    return figures


def dcp_worker(source, out_dir):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    metadata = dcp.FileSystemReader(source).read_metadata()
    state = {}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        mesh = init_device_mesh("cpu", (world,))
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue  # the few non-tensor items (LR scheduler, train state): bytes, not throughput
        full_shape = list(item.size)
        if world == 1:
            state[key] = torch.empty(full_shape, dtype=item.properties.dtype)
        elif full_shape and full_shape[0] >= world:
            rows = [len(c) for c in torch.arange(full_shape[0]).chunk(world)]
            local = torch.empty([rows[rank], *full_shape[1:]], dtype=item.properties.dtype)
            state[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(full_shape),
                                            stride=torch.empty(full_shape, device="meta").stride())
        else:
            state[key] = DTensor.from_local(torch.empty(full_shape, dtype=item.properties.dtype), mesh, [Replicate()],
                                            run_check=False)
    dcp.load(state, checkpoint_id=source)  # the tensors titan saved, on this rank

    def timed(fn):
        dist.barrier()
        start = time.perf_counter()
        result = fn()
        dist.barrier()
        return time.perf_counter() - start, result

    sync_dir = os.path.join(out_dir, "sync")
    save_s, _ = timed(lambda: dcp.save(state, checkpoint_id=sync_dir))
    second_save_s, _ = timed(lambda: dcp.save(state, checkpoint_id=os.path.join(out_dir, "sync2")))  # back to back, as titan's
    # Two asynchronous saves through one stager, which keeps its staging memory for the second (as titan keeps its).
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    stager = DefaultStager(StagingOptions(False, False, False, False))
    blocked, async_total = [], []
    for i in range(2):
        dist.barrier()
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=os.path.join(out_dir, f"async{i}"), async_stager=stager)
        blocked.append(time.perf_counter() - start)
        (future.result() if hasattr(future, "result") else future.upload_completion.result())
        async_total.append(time.perf_counter() - start)
        dist.barrier()
    stager.close()
    load_s, _ = timed(lambda: dcp.load(state, checkpoint_id=sync_dir))
    totals = torch.tensor([*blocked, max(async_total)], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("DCP " + json.dumps(dict(mb=folder_mb(sync_dir), save_s=save_s, second_save_s=second_save_s, load_s=load_s, blocked_first_s=totals[0].item(),
                                       blocked_later_s=totals[1].item(), async_s=totals[2].item())), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--flavors", default="debugmodel,100M,1B:4")
    parser.add_argument("--dump", default=None, help="folder on the disk to measure (default: a temporary folder)")
    parser.add_argument("--dcp-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dcp_worker:
        dcp_worker(*args.dcp_worker)
        return
    base = Path(args.dump or tempfile.mkdtemp(prefix="titan_ckpt_bench_"))
    base.mkdir(parents=True, exist_ok=True)
    raw = dd_write_mb_s(base)
    print(f"disk: dd sequential write with fdatasync {raw:,.0f} MB/s ({base})")
    print("MB/s are state MB over seconds; 'vs DCP' is titan's figure against DCP's, above 1 when titan is better (rates: "
          "titan/DCP; blocked: DCP/titan); blocked = the time an async save keeps the training loop waiting, on the first "
          "save and on later ones")
    print(f"{'flavor':11} {'ranks':>5} {'system':10} {'MB':>8} {'save s':>7} {'save MB/s':>9} {'vs dd':>6} {'vs DCP':>6} "
          f"{'load s':>7} {'load MB/s':>9} {'vs DCP':>6} {'blocked 1st':>11} {'vs DCP':>6} {'later':>7} {'vs DCP':>6}")
    for flavor in args.flavors.split(","):
        for ranks in (int(r) for r in args.ranks.split(",")):
            sync = titan_figures(base, flavor, ranks, "disabled")
            asyn = titan_figures(base, flavor, ranks, "async")
            if asyn:
                shutil.rmtree(asyn["folder"].parent.parent, ignore_errors=True)
            peer = dcp_figures(base, flavor, ranks, sync["folder"])
            shutil.rmtree(sync["folder"].parent.parent, ignore_errors=True)
            for name, figures in (("titan", sync), ("torch DCP", peer)):
                mine = name == "titan"
                blocked = asyn if mine else peer
                save_rate, load_rate = figures["mb"] / figures["save_s"], figures["mb"] / figures["load_s"]
                if blocked:
                    blocking = (f"{blocked['blocked_first_s']:11.3f} {(peer['blocked_first_s'] / blocked['blocked_first_s'] if mine else 1):6.2f} "
                                f"{blocked['blocked_later_s']:7.3f} {(peer['blocked_later_s'] / blocked['blocked_later_s'] if mine else 1):6.2f}")
                else:
                    blocking = f"{'(async does not fit)':>32}"
                print(f"{flavor:11} {ranks:5d} {name:10} {figures['mb']:8.1f} {figures['save_s']:7.2f} {save_rate:9.0f} "
                      f"{save_rate / raw:6.2f} {(save_rate / (peer['mb'] / peer['save_s']) if mine else 1):6.2f} "
                      f"{figures['load_s']:7.2f} {load_rate:9.0f} {(load_rate / (peer['mb'] / peer['load_s']) if mine else 1):6.2f} "
                      f"{blocking}", flush=True)
            print(f"{'':11} {'':5} {'':10} (DCP's async saves finished writing after at most {peer['async_s']:.2f} s; second saves, "
                  f"back to back with the first: titan {sync['second_save_s']:.2f} s, DCP {peer['second_save_s']:.2f} s)", flush=True)
    if not args.dump:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
