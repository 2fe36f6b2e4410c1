"""torchtitan's own checkpoints, made and read by torchtitan (v0.2.2, from the test venv) for titan's torch DCP tests.

  save WORLD OUT     trains torchtitan's llama3 debugmodel for 3 steps on WORLD CPU ranks (FSDP2 over gloo, AdamW,
                     warmup + linear decay) and saves with torchtitan's CheckpointManager: OUT/checkpoint/step-2 (the
                     full training state) and step-3 (model only, bfloat16, torchtitan's last save).
  load WORLD BASE OUT  loads the newest BASE/checkpoint/step-N with torchtitan's CheckpointManager (its data loader
                     excluded: titan cannot write torchtitan's) and writes what it loaded to OUT (safetensors: every
                     model and optimizer tensor in full, and OUT.json: step, tokens, LR epoch).
"""
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset


class Tokens(IterableDataset, Stateful):
    def __init__(self):
        self.index = 0

    def __iter__(self):
        while True:
            self.index += 1
            x = torch.randint(0, 2048, (17,), generator=torch.Generator().manual_seed(self.index))
            yield x[:-1], x[1:]

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


class TrainState(Stateful):  # as torchtitan's Trainer.state_dict / load_state_dict
    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main(rank, world, mode, base, out, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import Checkpoint, LRScheduler, Optimizer
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp

    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = Transformer(llama3_args["debugmodel"])
    apply_fsdp(model, mesh, torch.float32, torch.float32, pp_enabled=False)
    for m in model.modules():  # gloo has no PREMUL_SUM reduce-scatter
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    optimizers = build_optimizers([model], Optimizer(implementation="for-loop"), dims)
    schedulers = build_lr_schedulers(optimizers, LRScheduler(warmup_steps=2, decay_ratio=0.8), training_steps=10)
    loader = ParallelAwareDataloader(Tokens(), dp_rank=rank, dp_world_size=world, batch_size=2)
    train = TrainState()
    manager = CheckpointManager(
        dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train},
        checkpoint_config=Checkpoint(enable=True, folder="checkpoint", interval=2, last_save_model_only=True,
                                     export_dtype="bfloat16", keep_latest_k=0,
                                     exclude_from_loading=["dataloader"] if mode == "load" else []),
        sd_adapter=None, base_folder=base)
    if mode == "load":
        assert manager.load()
        tensors = {k: full(v).detach().contiguous() for k, v in model.state_dict().items()}
        for k, v in optimizers.state_dict().items():
            if torch.is_tensor(v):
                tensors["optimizer." + k] = full(v).detach().contiguous().reshape(full(v).shape)
        if rank == 0:
            from safetensors.torch import save_file
            save_file(tensors, out)
            with open(out + ".json", "w") as f:
                json.dump({"step": train.step, "ntokens_seen": train.ntokens_seen,
                           "last_epoch": schedulers.schedulers[0].last_epoch,
                           "lr": optimizers.optimizers[0].param_groups[0]["lr"]}, f)
    else:
        batches = iter(loader)
        for step in (1, 2, 3):
            x, y = next(batches)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizers.step()
            schedulers.step()
            optimizers.zero_grad()
            train.step, train.ntokens_seen = step, train.ntokens_seen + x.numel()  # this rank's, as torchtitan counts
            manager.save(curr_step=step, last_step=step == 3)
    dist.barrier()
    manager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, world, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    out = sys.argv[4] if len(sys.argv) > 4 else ""
    if mode == "save":
        shutil.rmtree(base, ignore_errors=True)
    import socket
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # torchtitan is imported once, here, and the ranks are forked with it (spawned ranks would each import it again,
    # about 10 s of CPU apiece); one rank runs in this process.
    import torchtitan.components.checkpoint  # noqa: F401
    import torchtitan.models.llama3  # noqa: F401
    if world == 1:
        main(0, world, mode, base, out, port)
    else:
        mp.start_processes(main, args=(world, mode, base, out, port), nprocs=world, start_method="fork")
