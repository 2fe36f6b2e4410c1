"""Metrics files: TensorBoard event files read back by TensorBoard's own EventAccumulator (every record's masked
CRC-32C checked against TensorBoard's implementation), with torchtitan's scalar keys and the values of the log
line, and the JSONL metrics file; from rank 0, or from every rank with metrics.save_for_all_ranks."""
import json
import os
import re
import struct

import pytest

from titan_testing import SOURCE_DIR, binary, run, shared

KEYS = ["loss_metrics/global_avg_loss", "grad_norm", "throughput(tps)", "tflops", "mfu(%)", "time_metrics/end_to_end(s)",
        "time_metrics/data_loading(s)", "time_metrics/data_loading(%)", "memory/max_active(GiB)", "memory/max_active(%)",
        "n_tokens_seen", "lr"]


def train(dump, extra=(), np_=1):
    mpi = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           "-np", str(np_)] if np_ > 1 else []
    return run(mpi + [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                      "--job.dump_folder", str(dump), "--training.seq_len", "32", "--training.local_batch_size", "2",
                      "--training.steps", "4", "--metrics.log_freq", "2", "--metrics.enable_tensorboard",
                      "--metrics.enable_jsonl", "--debug.seed", "0", *extra],
               env={"OMP_NUM_THREADS": "1" if np_ > 1 else "2"})


def records(path):
    """TFRecord framing, checked with TensorBoard's masked CRC-32C."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    data = path.read_bytes()
    out, pos = [], 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
        body = data[pos + 12:pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == masked_crc32c(body)
        out.append(body)
        pos += 16 + length
    return out


def scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(folder.rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    assert len(records(files[0])) >= 4
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_and_jsonl_hold_the_logged_figures(tmp_path):
    dump = tmp_path / "run"
    validation = ["--validation.enable", "--validation.dataset_path", str(shared("text", "tinyshakespeare.txt")),
                  "--validation.freq", "2", "--validation.steps", "2", "--validation.seq_len", "32",
                  "--validation.local_batch_size", "2"]
    result = train(dump, validation)
    logged = {int(m.group(1)): float(m.group(2)) for line in result.stdout.splitlines() if "validate" not in line
              for m in [re.search(r"step: +(\d+) .*?loss: +([0-9.]+)", line)] if m}
    assert sorted(logged) == [1, 2, 4]
    tb = scalars(dump / "tb")
    for key in KEYS:
        assert sorted(tb[key]) == [1, 2, 4], key
    assert sorted(tb["validation_metrics/loss"]) == [1, 2, 4]
    lines = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in lines if "grad_norm" in r]
    assert [r["step"] for r in train_lines] == [1, 2, 4]
    for record in train_lines:
        step = record["step"]
        assert record["loss_metrics/global_avg_loss"] == pytest.approx(logged[step], abs=6e-6)
        for key in KEYS:  # TensorBoard keeps float32
            assert tb[key][step] == pytest.approx(record[key], rel=1e-6, abs=1e-30), key
        assert record["n_tokens_seen"] == step * 2 * 32
    assert tb["lr"][4] > 0 and tb["throughput(tps)"][4] > 0


def test_every_rank_writes_its_own_files_when_asked(tmp_path):
    dump = tmp_path / "run"
    train(dump, ["--parallelism.data_parallel_shard_degree", "2", "--metrics.save_for_all_ranks"], np_=2)
    for rank in (0, 1):
        folder = next((dump / "tb").iterdir()) / f"rank_{rank}"
        tb = scalars(folder)
        lines = [json.loads(line) for line in (dump / f"metrics_rank_{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines] == [1, 2, 4] and all(r["rank"] == rank for r in lines)
        assert tb["loss_metrics/global_avg_loss"][4] == pytest.approx(lines[-1]["loss_metrics/global_avg_loss"], rel=1e-6)
    # Without save_for_all_ranks only rank 0 writes.
    dump = tmp_path / "rank0"
    train(dump, ["--parallelism.data_parallel_shard_degree", "2"], np_=2)
    assert not any("rank_" in p.name for p in (dump / "tb").rglob("*"))
    assert (dump / "metrics.jsonl").exists() and not (dump / "metrics_rank_1.jsonl").exists()


def test_a_poisoned_peak_cache_is_measured_again_and_mfu_stays_at_most_100(tmp_path):
    """A CPU peak measured in a slow moment and cached used to be kept for ever (MFU printed at 112-272%). Here the
    cache is poisoned with a figure 1000x too low for this very build and machine: the first step beats it, titan
    measures again (saying so), rewrites the cache, and no step prints an MFU above 100%."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "2"}
    cache = tmp_path / "cache" / "titan" / "peak_flops.json"

    def train_steps(dump, steps):
        return run([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                    "--job.dump_folder", str(tmp_path / dump), "--training.seq_len", "64", "--training.local_batch_size",
                    "2", "--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.disable_color_printing"],
                   env=env)

    train_steps("first", 1)
    entries = json.loads(cache.read_text())
    assert len(entries) == 1, entries
    honest = next(iter(entries.values()))["flops"]
    for entry in entries.values():
        entry["flops"] = honest / 1000
        # Recorded as measured on a quiet machine: a figure measured while other work held the CPUs is measured again
        # at the next quiet start-up (test_peak_flops.cpp), which would replace the poison before any step could beat
        # it (seen in a CI run whose first start-up here shared the cores with other tests).
        entry["cpu_share"] = 1.0
    cache.write_text(json.dumps(entries))
    out = train_steps("second", 4)
    text = out.stdout + out.stderr
    assert re.search(r"MFU peak: CPU peak [\d.]+ GFLOP/s \(.* matmul rate, measured again", text), text[-3000:]
    mfus = [float(m) for m in re.findall(r"mfu: +([\d.]+)%", text)]
    assert len(mfus) == 4 and max(mfus) <= 100.0, mfus
    rewritten = next(iter(json.loads(cache.read_text()).values()))["flops"]
    assert rewritten > honest / 10, (rewritten, honest)
