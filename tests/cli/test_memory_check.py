"""The start-up memory estimate against the peak memory titan then uses (CPU resident set, the step line's
`memory` field), and the check that refuses a job that cannot fit before anything large is allocated."""
import os
import re

import pytest

from titan_testing import SOURCE_DIR, binary, run

CONFIG = ["--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"), "--metrics.log_freq", "1"]
ESTIMATE = re.compile(r"Memory estimate for this rank: .*: ([\d.]+) (GiB|MiB) of ([\d.]+) GiB available")
PEAK = re.compile(r"memory: +([\d.]+)GiB\(")

# Activation checkpointing modes, compute dtypes and two flavors, each big enough that the model and its
# activations, not the runtime, dominate the peak.
CASES = {
    "debug selective 2": [],
    "debug full, 4 x 2048": ["--training.local_batch_size", "4", "--training.seq_len", "2048", "--activation_checkpoint.mode", "full"],
    "debug op-level, seq 1024": ["--training.seq_len", "1024", "--activation_checkpoint.selective_ac_option", "op"],
    "debug float32 compute, none": ["--training.seq_len", "1024", "--training.mixed_precision_param", "float32",
                                    "--activation_checkpoint.mode", "none"],
    "100M none, 2 x 1024": ["--model.flavor", "100M", "--training.local_batch_size", "2", "--training.seq_len", "1024",
                            "--activation_checkpoint.mode", "none"],
}


def estimate_and_peak(output):
    m = ESTIMATE.search(output)
    assert m, output[-3000:]
    estimate = float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1)
    return estimate, max(float(x) for x in PEAK.findall(output))


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_is_within_20_percent_of_the_measured_peak(tmp_path, case):
    result = run([binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path), "--training.steps", "4",
                  *CASES[case]])
    estimate, peak = estimate_and_peak(result.stdout)
    print(f"{case}: estimate {estimate:.2f} GiB, measured peak {peak:.2f} GiB ({estimate / peak:.2f}x)")
    assert abs(estimate / peak - 1) <= 0.20, (case, estimate, peak)


def test_fsdp_ranks_estimate_their_shards(tmp_path):
    mpirun = os.environ.get("TITAN_MPIRUN", "mpirun")
    result = run([mpirun, "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "2", binary("titan"),
                  "train", *CONFIG, "--job.dump_folder", str(tmp_path), "--training.steps", "4", "--model.flavor", "100M",
                  "--training.local_batch_size", "2", "--training.seq_len", "1024", "--activation_checkpoint.mode", "none",
                  "--parallelism.data_parallel_shard_degree", "2"], env=dict(os.environ, OMP_NUM_THREADS="1"))
    estimate, peak = estimate_and_peak(result.stdout)
    print(f"FSDP 2: estimate {estimate:.2f} GiB, measured peak {peak:.2f} GiB ({estimate / peak:.2f}x)")
    assert abs(estimate / peak - 1) <= 0.20, (estimate, peak)


def test_a_job_that_cannot_fit_is_refused_before_allocating(tmp_path):
    def refused(extra, env=None):
        result = run([binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path), "--training.steps", "1", *extra],
                     check=False, env=env)
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr
        for needle in ["this rank needs about", "GiB is available", "activation_checkpoint.mode", "--debug.skip_memory_check"]:
            assert needle in result.stderr, result.stderr
        assert "Parameters on this rank" not in result.stdout  # nothing of the model was allocated
        return result.stderr

    assert "parameters 29.92 GiB" in refused(["--model.flavor", "8B"])  # 8.03 B float32 weights
    refused(["--training.local_batch_size", "100000"])
    refused(["--training.seq_len", "1000000000"])
    # Less memory than the debug model needs (the test hook stands in for a small machine), and the override.
    small = dict(os.environ, TITAN_TEST_AVAILABLE_MEMORY_BYTES=str(300 << 20))
    assert "TITAN_TEST_AVAILABLE_MEMORY_BYTES" in refused([], env=small)
    result = run([binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path), "--training.steps", "1",
                  "--debug.skip_memory_check"], env=small)
    assert "starting anyway (debug.skip_memory_check)" in result.stdout + result.stderr
    assert "Training completed: 1 steps" in result.stdout
