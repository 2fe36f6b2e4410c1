"""The start-up memory estimate against the peak memory titan then uses (CPU resident set, the step line's
`memory` field), and the check that refuses a job that cannot fit before anything large is allocated."""
import os
import re

import pytest

from titan_testing import SOURCE_DIR, binary, run

CONFIG = ["--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"), "--metrics.log_freq", "1"]
# The 10% layouts run the ATen compositions the estimate's terms were measured on; the fused CPU kernels (the default)
# save less for backward, estimated from what they keep (memory_estimate.cpp) and checked within 25% below.
UNFUSED = ["--training.fused_kernels", "false"]
# Each rank's log line (LOG_RANK=all; mpirun --tag-output prefixes "[1,R]<stdout>:").
ESTIMATE = re.compile(r"^(?:\[1,(\d+)\]<stdout>:)?.*Memory estimate for this rank: (.*): ([\d.]+) (GiB|MiB) of [\d.]+ GiB available",
                      re.M)
RUNTIME = re.compile(r"runtime ([\d.]+) (GiB|MiB)")
PEAK = re.compile(r"^(?:\[1,(\d+)\]<stdout>:)?.*memory: +([\d.]+)GiB\(", re.M)

MODEL_100M = [*UNFUSED, "--model.flavor", "100M", "--training.local_batch_size", "2", "--training.seq_len", "1024",
              "--activation_checkpoint.mode", "none"]
NO_FSDP = ["--parallelism.data_parallel_shard_degree", "1"]
# The layouts held to 25% run 8 of the 100M flavor's 16 blocks: half the time, and the ratios measured on 2026-11-28
# moved by 0.03 to 0.05 (the peak's unestimated ~0.1 GiB weighs more against a smaller model). The 10% layouts keep
# all 16.
HALF = ["--model.n_layers", "8"]
QWEN3_DEBUG = ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--training.local_batch_size", "2",
               "--training.seq_len", "1024", "--activation_checkpoint.mode", "none"]
# (ranks, options): activation checkpointing modes, compute dtypes, two flavors and every parallelism, each big
# enough that the model and its activations, not the runtime, dominate the peak.
LAYOUTS = {
    "debug op-level AC, seq 1024": (1, UNFUSED + ["--training.seq_len", "1024", "--activation_checkpoint.selective_ac_option", "op"]),
    "debug float32 compute, no AC": (1, UNFUSED + ["--training.seq_len", "1024", "--training.mixed_precision_param", "float32",
                                         "--activation_checkpoint.mode", "none"]),
    "100M FSDP 2": (2, MODEL_100M + ["--parallelism.data_parallel_shard_degree", "2"]),
    "100M DDP 2": (2, MODEL_100M + NO_FSDP + ["--parallelism.data_parallel_replicate_degree", "2"]),
    "100M PP 2 (1F1B)": (2, MODEL_100M + NO_FSDP + ["--parallelism.pipeline_parallel_degree", "2"]),
    # Qwen3's debug flavor: queries four times as wide as the residual stream (16 heads of 128), per-head q/k norms.
    "qwen3 debug, no AC, 2 x 1024": (1, UNFUSED + QWEN3_DEBUG),
}
# Kept in view with a wider bound (docs/metrics.md). Measured on 2026-11-24 with the host block cache: the debug
# model's selective AC 0.95x, its full AC 0.98x (its peak of about 0.45 GiB above the runtime varies by a few percent
# from run to run), context parallelism 0.95x (up to 0.1 GiB per rank that the estimate does not account for), TP 2
# 1.10x, and the 100M flavor without AC on one rank 1.15x: its peak comes at the end of the forward, before backward
# has allocated the gradients the estimate counts for the whole step (DDP's buckets hold them, so DDP 2 measures 1.00x).
WIDER = {
    "debug selective AC 2": (1, UNFUSED),
    "100M no AC, 2 x 1024": (1, MODEL_100M + HALF),
    "debug full AC, 4 x 2048": (1, UNFUSED + ["--training.local_batch_size", "4", "--training.seq_len", "2048", "--activation_checkpoint.mode", "full"]),
    "100M CP 2": (2, MODEL_100M + HALF + NO_FSDP + ["--parallelism.context_parallel_degree", "2"]),
    "100M TP 2": (2, MODEL_100M + HALF + NO_FSDP + ["--parallelism.tensor_parallel_degree", "2"]),
}


# The fused kernels' layouts: the estimate of what they keep is newer and coarser (1.04x to 1.16x on 2026-11-24, with
# the host block cache), so they are held to the wider bound until it is refined.
FUSED = {
    "fused: debug full AC, 4 x 2048": (1, ["--training.local_batch_size", "4", "--training.seq_len", "2048",
                                           "--activation_checkpoint.mode", "full"]),
    "fused: debug op-level AC, seq 1024": (1, ["--training.seq_len", "1024", "--activation_checkpoint.selective_ac_option", "op"]),
    "fused: 100M no AC, 2 x 1024": (1, MODEL_100M[2:] + HALF),
    "fused: 100M TP 2": (2, MODEL_100M[2:] + HALF + NO_FSDP + ["--parallelism.tensor_parallel_degree", "2"]),
    # Measured 1.05x on 2026-11-27 (0.72x before Qwen3's q/k norms ran the fused kernel under autocast).
    "fused: qwen3 debug, no AC, 2 x 1024": (1, QWEN3_DEBUG),
    "fused: Llama 3 vocabulary, 2 x 1024": (1, ["--model.vocab_size", "128256", "--training.local_batch_size", "2",
                                                "--training.seq_len", "1024", "--activation_checkpoint.mode", "none"]),
    # The estimate does not model float8 (docs/float8.md): at 2 x 1024 measured 1.02x on 2026-11-27 (1.07x without
    # float8); without FSDP float8 linears skip autocast's weight cache, measured 1.11x. One sequence per rank here:
    # emulated float8 is slow.
    "fused: 100M FSDP 2, float8 linears and all-gathers, 1 x 1024": (2, MODEL_100M[2:] + HALF + [
        "--parallelism.data_parallel_shard_degree", "2", "--model.converters", "float8", "--quantize.linear.float8.emulate",
        "--quantize.linear.float8.filter_fqns", "output", "--quantize.linear.float8.enable_fsdp_float8_all_gather",
        "--training.local_batch_size", "1"]),
}


# Mixture of Experts (Qwen3's debugmodel_moe with 2 layers: 64 experts of width 768, top 8), bf16 compute, no AC; the
# experts run titan's grouped kernels. Measured on 2026-11-27: one process 1.02x, EP 2 1.05x and 1.07x (FSDP 2
# without EP 0.94x and 1.04x). Float32 compute measures 1.27x (its peak comes early in backward, before most
# gradients exist) and training.fused_kernels = false 0.74x (oneDNN's cache of a bf16 product per expert and row
# count): docs/moe.md.
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.n_layers", "2", "--training.local_batch_size", "2",
       "--training.seq_len", "1024", "--activation_checkpoint.mode", "none"]
MOE_LAYOUTS = {
    "MoE, one process": (1, MOE),
    "MoE, EP 2": (2, MOE + ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]),
    # torchtitan's op-level policy: attention and every other linear kept, the routed experts recomputed.
    "MoE, EP 2, op-level AC": (2, MOE + ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2",
                                        "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
}

# DeepSeek-V3's debugmodel (latent attention: 16 heads of 192 query/key columns over a 256-wide stream, a 512-wide
# latent; one dense block, then five MoE blocks of 8 experts, top 3, 2 shared), bf16 compute, titan's kernels, no AC
# unless said. Measured on 2026-11-28: one process 0.98x, TP 2 0.92x and 0.93x, EP 2 x FSDP 2 under op-level AC
# 0.92x and 0.95x. PP 2 (1F1B, 2 x 1024) measures 0.86x and 0.83x: the pipeline's unestimated ~0.1 GiB per rank,
# which the debug Llama 3 shows too (docs/metrics.md).
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--training.local_batch_size", "4",
            "--training.seq_len", "512", "--activation_checkpoint.mode", "none"]
DEEPSEEK_LAYOUTS = {
    "DeepSeek-V3, one process": (1, DEEPSEEK),
    "DeepSeek-V3, TP 2": (2, DEEPSEEK + NO_FSDP + ["--parallelism.tensor_parallel_degree", "2"]),
    "DeepSeek-V3, EP 2 x FSDP 2, op-level AC": (2, DEEPSEEK + ["--parallelism.data_parallel_shard_degree", "2",
                                                             "--parallelism.expert_parallel_degree", "2",
                                                             "--activation_checkpoint.mode", "selective",
                                                             "--activation_checkpoint.selective_ac_option", "op"]),
}


def gib(value, unit):
    return float(value) / (1024 if unit == "MiB" else 1)


def measure(tmp_path, ranks, options):
    """Per rank: (estimate, runtime term, measured peak) in GiB, all from the rank's own log lines."""
    command = [binary("titan"), "train", *CONFIG, "--job.dump_folder", str(tmp_path), "--training.steps", "2", *options]
    env = {"LOG_RANK": "all"}
    if ranks > 1:
        mpirun = os.environ.get("TITAN_MPIRUN", "mpirun")
        command = [mpirun, "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "--tag-output", "-np", str(ranks)] + command
        env["OMP_NUM_THREADS"] = "1"
    output = run(command, env=env).stdout
    estimates = {int(m.group(1) or 0): m for m in ESTIMATE.finditer(output)}
    peaks = {}
    for m in PEAK.finditer(output):
        rank = int(m.group(1) or 0)
        peaks[rank] = max(peaks.get(rank, 0.0), float(m.group(2)))
    assert sorted(estimates) == list(range(ranks)) and sorted(peaks) == list(range(ranks)), output[-3000:]
    out = {}
    for rank, m in estimates.items():
        runtime = RUNTIME.search(m.group(2))
        out[rank] = (gib(m.group(3), m.group(4)), gib(*runtime.groups()), peaks[rank])
    return out


def check(tmp_path, name, ranks, options, bound):
    for rank, (estimate, runtime, peak) in sorted(measure(tmp_path, ranks, options).items()):
        # What the job adds above the process's footprint when the estimate is made (LibTorch, MPI): the model's
        # own memory, predicted against measured.
        ratio = (estimate - runtime) / (peak - runtime)
        print(f"{name}, rank {rank}: estimate {estimate:.2f} GiB, measured peak {peak:.2f} GiB, process before the "
              f"model {runtime:.2f} GiB; above it {ratio:.2f}x")
        assert abs(ratio - 1) <= bound, (name, rank, estimate, runtime, peak)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_estimate_is_within_10_percent_of_titans_own_peak(tmp_path, name):
    check(tmp_path, name, *LAYOUTS[name], 0.10)


@pytest.mark.parametrize("name", list(FUSED))
def test_the_estimate_of_the_fused_kernels_is_within_25_percent(tmp_path, name):
    check(tmp_path, name, *FUSED[name], 0.25)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_the_moe_estimate_is_within_10_percent(tmp_path, name):
    check(tmp_path, name, *MOE_LAYOUTS[name], 0.10)


@pytest.mark.parametrize("name", list(DEEPSEEK_LAYOUTS))
def test_the_latent_attention_estimate_is_within_10_percent(tmp_path, name):
    check(tmp_path, name, *DEEPSEEK_LAYOUTS[name], 0.10)


@pytest.mark.parametrize("name", list(WIDER))
def test_known_gaps_stay_within_25_percent(tmp_path, name):
    check(tmp_path, name, *WIDER[name], 0.25)


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


def test_the_fused_loss_saves_more_than_the_float32_logits(tmp_path):
    """Llama 3's 128,256-token vocabulary on the debug model's blocks, 2 x 1024 tokens: the fused output projection
    and loss never holds the logits of the whole batch, so the peak drops by more than their float32 size. The switch
    turns the other fused kernels off too; their share is what it saves at a small vocabulary."""
    shape = ["--training.local_batch_size", "2", "--training.seq_len", "1024", "--activation_checkpoint.mode", "none"]
    peak = {}
    for vocab in (128256, 2048):
        for fused in ("true", "false"):
            runs = measure(tmp_path / f"{vocab}-{fused}", 1, shape + ["--model.vocab_size", str(vocab), "--training.fused_kernels", fused])
            peak[vocab, fused] = runs[0][2]
    saved = (peak[128256, "false"] - peak[128256, "true"]) - (peak[2048, "false"] - peak[2048, "true"])
    logits = 2 * 1024 * 128256 * 4 / 2**30
    print(f"peaks {peak}; the fused loss saves {saved:.2f} GiB against {logits:.2f} GiB of float32 logits")
    assert saved >= logits, peak

