"""What the training loop reads back on the host, and how often the ranks agree on control decisions: one control
reduction per step (data exhausted, valid tokens, stop signals and failed saves together) and one after the last, and each step's loss and
gradient norm read right after the step only for a log line, a checkpoint, validation or the last step; otherwise
one step later, before the next update (nothing still running is waited for). Counted by the trainer and printed
at the end of the run; the losses in the log stay those of every step."""
import re

from titan_testing import SOURCE_DIR, binary, run
from test_data_parallel_parity import mpirun

COUNTS = re.compile(r"Step results read on the host: (\d+) right after their step .*?, (\d+) one step later .*?; (\d+) control "
                    r"reduction\(s\) over (\d+) rank\(s\) on (host memory|the device); (\d+) read\(s\) of device memory")
STEP = re.compile(r"step: +(\d+) +loss: +([\d.]+)")


def train(tmp_path, name, *extra):
    cmd = mpirun(2) + [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                       "--job.dump_folder", str(tmp_path / name), "--training.steps", "10", "--training.seq_len", "64",
                       "--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2",
                       "--metrics.log_freq", "5", "--metrics.disable_color_printing", *extra]
    out = run(cmd, env={"OMP_NUM_THREADS": "1"}).stdout
    m = COUNTS.search(out)
    assert m, out[-3000:]
    at_once, later, control, ranks, where, device = int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5], int(m[6])
    return at_once, later, control, ranks, where, device, {int(s): float(l) for s, l in STEP.findall(out)}


def test_one_control_reduction_per_step_and_step_results_read_only_when_needed(tmp_path):
    # Fused AdamW skips a non-finite step on the device, so steps 2-4 and 6-9 are read a step later; steps 1, 5 and
    # 10 (log lines, the last step) right after.
    at_once, later, control, ranks, where, device, losses = train(tmp_path, "fused", "--optimizer.implementation", "fused")
    assert (at_once, later) == (3, 7)
    # One control reduction before each step, and one after the last (a failed background save of its checkpoint).
    assert (control, ranks, where, device) == (11, 2, "host memory", 0)
    # A checkpoint (every 3 steps) needs its step's results before it is written: steps 3, 6 and 9 too.
    at_once, later, control, *_ = train(tmp_path, "checkpoints", "--optimizer.implementation", "fused", "--checkpoint.enable",
                                       "--checkpoint.interval", "3")
    assert (at_once, later, control) == (6, 4, 11)
    # An optimizer that decides on the host reads every step at once; the losses are the same.
    at_once, later, control, _, _, _, host_losses = train(tmp_path, "foreach", "--optimizer.implementation", "foreach")
    assert (at_once, later, control) == (10, 0, 11)
    assert sorted(losses) == sorted(host_losses) == [1, 5, 10]
    for step in losses:
        assert abs(losses[step] - host_losses[step]) <= 1e-4 * abs(host_losses[step]), (losses, host_losses)


def test_the_pipeline_reads_one_activation_shape_per_channel(tmp_path):
    """ZBVZeroBubble on 2 pipeline ranks: rank 0 holds stages 0 and 3 (the loss) and receives stage 2's activations,
    whose shape it reads from the device once, in the first step, though validation (which sends every activation
    with its shape) runs in between; the last stage's losses are summed on the device and read with the step's
    other results (the counts above, unchanged by the pipeline)."""
    pp = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
          "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--parallelism.pipeline_parallel_microbatch_size", "1",
          "--optimizer.implementation", "fused", "--validation.enable", "--validation.freq", "4", "--validation.steps", "1",
          "--validation.dataset", "fortunes", "--validation.seq_len", "32", "--validation.local_batch_size", "2"]
    cmd = mpirun(2) + [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                       "--job.dump_folder", str(tmp_path / "pp"), "--training.steps", "10", "--training.seq_len", "64",
                       "--training.local_batch_size", "2", "--metrics.log_freq", "5", "--metrics.disable_color_printing", *pp]
    out = run(cmd, env={"OMP_NUM_THREADS": "1"}).stdout
    m = re.search(r"(\d+) activation shape header\(s\) read back from the device over (\d+) training pass\(es\)", out)
    assert m, out[-3000:]
    # One in training; each validation reads one per micro-batch received (2 of them).
    validations = len(re.findall(r"validate step:", out))
    assert validations >= 2, out[-3000:]
    assert (int(m[1]), int(m[2])) == (1 + 2 * validations, 10), m[0]
    m = COUNTS.search(out)
    assert m, out[-3000:]
