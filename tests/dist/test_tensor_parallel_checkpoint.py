"""Checkpoints across layouts with tensor parallelism, on real MPI ranks: a checkpoint saved by TP 2 x FSDP 2 loads
on one process, on FSDP 4 and on TP 4 (and one saved by FSDP 4 on TP 2 x FSDP 2) with the gathered weights and
AdamW moments bitwise equal to what was saved, and training continues on the same data stream; version-1 (row)
checkpoints still load; `titan convert` reads TP-sharded checkpoints."""
import json
import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from titan_testing import SOURCE_DIR, binary, read_checkpoint, run

COMMON = ["--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"), "--training.seq_len", "64",
          "--training.local_batch_size", "1", "--metrics.log_freq", "1", "--checkpoint.enable",
          "--checkpoint.interval", "10", "--checkpoint.no_last_save_model_only", "--debug.seed", "0",
          "--training.mixed_precision_param", "float32", "--lr_scheduler.total_steps", "20", "--training.data_lanes", "4",
          "--training.global_batch_size", "4", "--activation_checkpoint.mode", "none", "--metrics.disable_color_printing"]
LAYOUTS = {  # name: (ranks, tp, dp_shard)
    "single": (1, 1, 1),
    "fsdp4": (4, 1, 4),
    "tp4": (4, 4, 1),
    "tp2_fsdp2": (4, 2, 2),
}


def command(layout, program):
    ranks, tp, shard = LAYOUTS[layout]
    mpi = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           "-np", str(ranks)] if ranks > 1 else []
    return mpi + [*program, *COMMON, "--parallelism.tensor_parallel_degree", str(tp),
                  "--parallelism.data_parallel_shard_degree", str(shard)]


def train(dump, layout, steps, extra=()):
    cmd = command(layout, [binary("titan"), "train"]) + ["--job.dump_folder", str(dump), "--training.steps", str(steps), *extra]
    return run(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=600)


def losses(stdout):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step: +(\d+)  loss: +([\d.]+)", stdout)}


def load_on(dump, layout, tmp_path):
    """Starts `layout` on `dump`'s checkpoint step 10 (the probe never saves), dumps the loaded state gathered to full
    tensors, trains to step 20; returns that state and the step losses."""
    out = tmp_path / f"probe_{layout}"
    cmd = command(layout, [binary("titan_train_probe"), "--probe.out", str(out), "--probe.loaded_state"])
    run(cmd + ["--job.dump_folder", str(dump), "--training.steps", "20", "--checkpoint.load_step", "10"],
        env={"OMP_NUM_THREADS": "1"}, timeout=600)
    meta = json.loads((out / "metrics.json").read_text())
    return load_file(str(out / "loaded_state.safetensors")), {s["step"]: s["loss"] for s in meta["steps"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """20 straight steps on TP 2 x FSDP 2 and on FSDP 4, each saving at steps 10 and 20."""
    runs = {}
    for layout in ["tp2_fsdp2", "fsdp4"]:
        dump = tmp_path_factory.mktemp(layout)
        runs[layout] = (dump, losses(train(dump, layout, 20).stdout))
    return runs


@pytest.mark.parametrize("source,target", [("tp2_fsdp2", "single"), ("tp2_fsdp2", "fsdp4"), ("tp2_fsdp2", "tp4"),
                                           ("fsdp4", "tp2_fsdp2")])
def test_a_checkpoint_loads_bitwise_on_another_layout_and_training_continues(saved, tmp_path, source, target):
    dump, straight = saved[source]
    meta, stored = read_checkpoint(dump / "checkpoint" / "step-10")
    assert meta["version"] == 4
    if source == "tp2_fsdp2":
        # Row-parallel weights were saved as boxes of rows of column blocks.
        boxes = [p["box"] for p in meta["tensors"]["model.layers.0.attention.wo.weight"]["pieces"]]
        assert sorted((b["offsets"], b["lengths"]) for b in boxes) == [([0, 0], [128, 128]), ([0, 128], [128, 128]),
                                                                      ([128, 0], [128, 128]), ([128, 128], [128, 128])]
    state, continued = load_on(dump, target, tmp_path)
    assert sorted(state) == sorted(stored) and len(stored) == 3 * 57
    for key, value in stored.items():
        assert np.array_equal(state[key].numpy(), value), f"{source} -> {target}: {key} differs after loading"
    # The same data stream continues: steps 11..20 as in the straight run, to float32 reduction order.
    assert sorted(continued) == list(range(11, 21))
    for step, loss in continued.items():
        assert abs(loss - straight[step]) <= 2e-5, (source, target, step, loss, straight[step])


def test_version_1_row_checkpoints_still_load(saved, tmp_path):
    """FSDP 4's pieces are whole rows: rewritten in the version-1 form (`rows` instead of `box`, no CRC-32 per
    piece), the checkpoint loads to the same state."""
    dump, _ = saved["fsdp4"]
    old = tmp_path / "old"
    (old / "checkpoint").mkdir(parents=True)
    source = dump / "checkpoint" / "step-10"
    target = old / "checkpoint" / "step-10"
    target.mkdir()
    for f in source.iterdir():
        if f.name != "metadata.json":
            os.link(f, target / f.name)
    meta = json.loads((source / "metadata.json").read_text())
    meta["version"] = 1
    del meta["metadata_crc32"]  # version 3's
    for entry in meta["tensors"].values():
        for piece in entry["pieces"]:
            box = piece.pop("box")
            del piece["crc32"]  # version 4's: the files' CRC-32s are checked instead
            assert box["offsets"][1:] == [0] * (len(box["offsets"]) - 1) and box["lengths"][1:] == entry["shape"][1:]
            piece["rows"] = [box["offsets"][0], box["offsets"][0] + box["lengths"][0]]
    (target / "metadata.json").write_text(json.dumps(meta))
    state_old, losses_old = load_on(old, "tp2_fsdp2", tmp_path / "a")
    state_new, losses_new = load_on(dump, "tp2_fsdp2", tmp_path / "b")
    assert losses_old == losses_new
    for key in state_new:
        assert torch.equal(state_old[key], state_new[key]), key


def test_convert_reads_tensor_parallel_checkpoints(saved, tmp_path):
    dump, _ = saved["tp2_fsdp2"]
    _, stored = read_checkpoint(dump / "checkpoint" / "step-20")
    pt = tmp_path / "weights.pt"
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-20"), "--to", str(pt)])
    weights = torch.load(pt, weights_only=True)
    for name, tensor in weights.items():
        assert np.array_equal(tensor.numpy(), stored["model." + name]), name
    hf = tmp_path / "hf"
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-20"), "--to", str(hf)])
    hf_weights = load_file(str(hf / "model.safetensors"))
    assert np.array_equal(hf_weights["model.layers.1.self_attn.o_proj.weight"].numpy(),
                          stored["model.layers.1.attention.wo.weight"])
