"""Checkpoints across layouts with pipeline parallelism, on real MPI ranks: stages keep the global parameter names,
so a checkpoint saved by PP 2 loads on one process, one saved by PP 2 x FSDP 2 on FSDP 4, and one saved by one
process on PP 4 with 2 virtual stages per rank (Interleaved1F1B), with the gathered weights and AdamW moments
bitwise equal to what was saved and training continuing on the same data stream."""
import json
import os
import re

import numpy as np
import pytest
from safetensors.torch import load_file

from titan_testing import SOURCE_DIR, binary, read_checkpoint, run

COMMON = ["--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"), "--training.seq_len", "32",
          "--training.local_batch_size", "2", "--metrics.log_freq", "1", "--checkpoint.enable",
          "--checkpoint.interval", "10", "--checkpoint.no_last_save_model_only", "--debug.seed", "0",
          "--training.mixed_precision_param", "float32", "--lr_scheduler.total_steps", "20", "--training.data_lanes", "4",
          "--training.global_batch_size", "8", "--activation_checkpoint.mode", "none", "--metrics.disable_color_printing"]
LAYOUTS = {  # name: (ranks, pp, dp_shard, schedule)
    "single": (1, 1, 1, "1F1B"),
    "fsdp4": (4, 1, 4, "1F1B"),
    "pp2": (2, 2, 1, "1F1B"),
    "pp2_fsdp2": (4, 2, 2, "GPipe"),
    "pp4_virtual2": (4, 4, 1, "Interleaved1F1B"),
}


def command(layout, program):
    ranks, pp, shard, schedule = LAYOUTS[layout]
    mpi = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           "-np", str(ranks)] if ranks > 1 else []
    return mpi + [*program, *COMMON, "--parallelism.pipeline_parallel_degree", str(pp),
                  "--parallelism.pipeline_parallel_schedule", schedule, "--parallelism.data_parallel_shard_degree", str(shard)]


def losses(stdout):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step: +(\d+)  loss: +([\d.]+)", stdout)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """20 straight steps on each source layout, saving at steps 10 and 20."""
    runs = {}
    for layout in ["pp2", "pp2_fsdp2", "single"]:
        dump = tmp_path_factory.mktemp(layout)
        cmd = command(layout, [binary("titan"), "train"]) + ["--job.dump_folder", str(dump), "--training.steps", "20"]
        runs[layout] = (dump, losses(run(cmd, env={"OMP_NUM_THREADS": "1"}, timeout=600).stdout))
    return runs


@pytest.mark.parametrize("source,target", [("pp2", "single"), ("pp2_fsdp2", "fsdp4"), ("single", "pp4_virtual2"),
                                           ("pp2_fsdp2", "pp4_virtual2")])
def test_a_checkpoint_loads_bitwise_on_another_layout_and_training_continues(saved, tmp_path, source, target):
    dump, straight = saved[source]
    meta, stored = read_checkpoint(dump / "checkpoint" / "step-10")
    assert sorted(k for k in stored if k.startswith("model.")) == sorted(
        "model." + k for k in global_names()), "a stage renamed its parameters"
    out = tmp_path / "probe"
    cmd = command(target, [binary("titan_train_probe"), "--probe.out", str(out), "--probe.loaded_state"])
    run(cmd + ["--job.dump_folder", str(dump), "--training.steps", "20", "--checkpoint.load_step", "10"],
        env={"OMP_NUM_THREADS": "1"}, timeout=600)
    state = load_file(str(out / "loaded_state.safetensors"))
    continued = {s["step"]: s["loss"] for s in json.loads((out / "metrics.json").read_text())["steps"]}
    assert sorted(state) == sorted(stored) and len(stored) == 3 * 57
    for key, value in stored.items():
        assert np.array_equal(state[key].numpy(), value), f"{source} -> {target}: {key} differs after loading"
    assert sorted(continued) == list(range(11, 21))
    for step, loss in continued.items():
        assert abs(loss - straight[step]) <= 2e-5, (source, target, step, loss, straight[step])


def global_names():
    """The global parameter names of the debug model, as one process names them."""
    names = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    for i in range(6):
        names += [f"layers.{i}.{m}.weight" for m in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                                      "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
                                                      "attention_norm", "ffn_norm")]
    return names
