"""Weights & Biases (metrics.enable_wandb): titan writes an offline run, and W&B's own `wandb sync` (the wandb package's
client, which parses the run file) uploads it to a recording server (wandb_recorder.py). What arrives must be the run:
every logged step's values equal to the JSONL metrics file's, validation merged into its step's row, the resolved job
config, torchtitan's WANDB_* variables, and the process's exit code."""
import json
import math
import os
import signal
import subprocess

import pytest

from titan_testing import SOURCE_DIR, binary, run, shared

pytest.importorskip("wandb")
from wandb_recorder import Recorder  # noqa: E402

KEYS = ["loss_metrics/global_avg_loss", "grad_norm", "throughput(tps)", "tflops", "mfu(%)", "time_metrics/end_to_end(s)",
        "time_metrics/data_loading(s)", "time_metrics/data_loading(%)", "memory/max_active(GiB)", "memory/max_active(%)",
        "n_tokens_seen", "lr"]


def command(dump, *extra):
    return [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
            "--job.dump_folder", str(dump), "--training.seq_len", "32", "--training.local_batch_size", "2",
            "--metrics.enable_wandb", "--metrics.disable_color_printing", "--debug.seed", "0", *extra]


def run_directory(dump):
    runs = list(dump.glob("tb/*/wandb/offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture
def recorder():
    r = Recorder()
    yield r
    r.close()


def test_offline_run_syncs_every_logged_step_and_the_config(tmp_path, recorder):
    dump = tmp_path / "run"
    variables = {"WANDB_PROJECT": "titan-tests", "WANDB_TEAM": "ml-team", "WANDB_RUN_NAME": "debug 24 steps",
                 "WANDB_RUN_ID": "titan-debug-24", "WANDB_RUN_GROUP": "sweep-a", "WANDB_RUN_JOB_TYPE": "pretrain",
                 "WANDB_RUN_NOTES": "a test run", "WANDB_RUN_TAGS": "llama3, debug"}
    validation = ["--validation.enable", "--validation.dataset_path", str(shared("text", "tinyshakespeare.txt")),
                  "--validation.freq", "8", "--validation.steps", "1", "--validation.seq_len", "32",
                  "--validation.local_batch_size", "2"]
    result = run(command(dump, "--training.steps", "24", "--metrics.log_freq", "1", "--metrics.enable_jsonl",
                         "--job.save_config_file", "config.json", *validation), env=variables)
    directory = run_directory(dump)
    assert directory.name.endswith("-titan-debug-24")
    assert f"wandb sync {directory}" in result.stdout
    # 24 rows and the config make the file cross W&B's 32 KiB log blocks, so records are split into fragments.
    assert (directory / "run-titan-debug-24.wandb").stat().st_size > 32768

    synced = recorder.sync(directory, tmp_path)
    assert synced.returncode == 0, synced.stdout + synced.stderr

    first = recorder.upserts()[0]
    assert (first["name"], first["project"], first["entity"]) == ("titan-debug-24", "titan-tests", "ml-team")
    assert (first["displayName"], first["groupName"], first["jobType"], first["notes"]) == (
        "debug 24 steps", "sweep-a", "pretrain", "a test run")
    assert first["tags"] == ["llama3", "debug"]
    config = json.loads(recorder.upserts()[-1]["config"])
    saved = json.loads((dump / "config.json").read_text())
    for section, value in saved.items():
        assert config[section]["value"] == value, section
    assert config["training"]["value"]["steps"] == 24

    rows = recorder.history()
    assert [row["_step"] for row in rows] == list(range(1, 25))
    lines = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    by_step = {}
    for line in lines:
        by_step.setdefault(line["step"], {}).update(line)
    for row in rows:
        logged = by_step[row["_step"]]
        for key in KEYS:
            assert row[key] == logged[key], (row["_step"], key)  # 17 significant digits both ways: bitwise
        assert ("validation_metrics/loss" in row) == ("validation_metrics/loss" in logged)
        if "validation_metrics/loss" in row:
            assert row["validation_metrics/loss"] == logged["validation_metrics/loss"]
        assert row["_runtime"] >= 0 and row["_timestamp"] > 1.7e9
    assert {8, 16, 24} <= {r["_step"] for r in rows if "validation_metrics/loss" in r}
    assert [r["_runtime"] for r in rows] == sorted(r["_runtime"] for r in rows)
    summary = recorder.summary()
    assert summary["_step"] == 24 and summary["loss_metrics/global_avg_loss"] == by_step[24]["loss_metrics/global_avg_loss"]
    assert recorder.exit_code() == 0


def test_the_exit_code_of_a_stopped_a_failed_and_a_killed_run(tmp_path, recorder):
    """SIGHUP stops the run after a step (exit code 129): W&B receives 129. A run that fails (non-finite steps beyond
    training.skip_nonfinite_steps, exit code 2) sends 2, with its NaN gradient norms as NaN. A run killed with SIGKILL
    writes no exit record, and every step whose logging had ended still uploads."""
    for name, sig, code in (("stopped", signal.SIGHUP, 129), ("killed", signal.SIGKILL, None)):
        dump = tmp_path / name
        proc = subprocess.Popen(command(dump, "--training.steps", "100000", "--metrics.log_freq", "1"),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        for line in proc.stdout:
            if "step:  5" in line:
                break
        proc.send_signal(sig)
        text = proc.stdout.read()
        proc.wait(timeout=120)
        assert proc.returncode == (129 if code else -signal.SIGKILL), text[-3000:]
        recorder.file_stream.clear()
        synced = recorder.sync(run_directory(dump), tmp_path)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        steps = [row["_step"] for row in recorder.history()]
        # Step 5's row is written once its logging ends, just after its log line: a SIGKILL sent on seeing the line
        # may come before it. Step 4's was written before step 5 began. A stop (SIGHUP) comes after a step ends.
        logged = 5 if code else 4
        assert steps[:logged] == list(range(1, logged + 1)) and steps == list(range(1, len(steps) + 1)), steps
        if code:
            assert recorder.exit_code() == 129
        else:
            assert recorder.exit_code() != 0
        print(f"{name}: {len(steps)} rows synced, W&B's exit code {recorder.exit_code()}")

    # A learning rate of 1e30: steps 2 and 3 are skipped with a NaN gradient norm, step 4 ends the run (exit code 2).
    failed = run(command(tmp_path / "failed", "--training.steps", "10", "--training.seq_len", "64", "--optimizer.lr", "1e30",
                         "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1", "--training.skip_nonfinite_steps", "2"),
                 check=False)
    assert failed.returncode == 2, failed.stdout[-2000:] + failed.stderr
    recorder.file_stream.clear()
    synced = recorder.sync(run_directory(tmp_path / "failed"), tmp_path)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    rows = recorder.history()
    assert [row["_step"] for row in rows] == [1, 2, 3]
    assert math.isfinite(rows[0]["grad_norm"]) and math.isnan(rows[1]["grad_norm"]) and math.isnan(rows[2]["grad_norm"])
    assert recorder.exit_code() == 2


def test_a_resumed_run_continues_the_same_w_and_b_run(tmp_path, recorder):
    """A job restarted from its checkpoint with the same WANDB_RUN_ID (a SLURM requeue) writes a second offline run of
    that id with the resume flag; `wandb sync` of both asks W&B for the run's state and appends the second's rows
    after the first's (the recording server answers with the rows it holds). With WANDB_RESUME=never the second sync
    starts the run's history again, as W&B's SDK would."""
    dump = tmp_path / "run"
    args = ["--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]
    run(command(dump, "--training.steps", "4", *args), env={"WANDB_RUN_ID": "requeued"})
    resumed = run(command(dump, "--training.steps", "8", *args), env={"WANDB_RUN_ID": "requeued"})
    assert "step:  5" in resumed.stdout and "step:  1 " not in resumed.stdout
    runs = sorted(dump.glob("tb/*/wandb/offline-run-*-requeued"))
    assert len(runs) == 2, runs
    synced = recorder.sync(runs, tmp_path)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    assert [row["_step"] for row in recorder.history_lines["requeued"]] == list(range(1, 9))
    assert [name for name, _ in recorder.graphql].count("RunResumeStatus") == 2

    dump = tmp_path / "never"
    run(command(dump, "--training.steps", "4", *args), env={"WANDB_RUN_ID": "restarted"})
    run(command(dump, "--training.steps", "8", *args), env={"WANDB_RUN_ID": "restarted", "WANDB_RESUME": "never"})
    synced = recorder.sync(sorted(dump.glob("tb/*/wandb/offline-run-*-restarted")), tmp_path)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    assert [row["_step"] for row in recorder.history_lines["restarted"]] == [5, 6, 7, 8]


def test_environment_errors_and_wandb_mode_disabled(tmp_path):
    for variables, message in (({"WANDB_RESUME_FROM": "abc?_step=10"}, "WANDB_RESUME_FROM=\"abc?_step=10\": rewinding"),
                               ({"WANDB_FORK_FROM": "abc?_step=10"}, "WANDB_FORK_FROM"),
                               ({"WANDB_RUN_ID": "a/b"}, "WANDB_RUN_ID=\"a/b\": a W&B run id is 1-128 letters")):
        result = run(command(tmp_path / "bad", "--training.steps", "1"), env=variables, check=False)
        assert result.returncode != 0 and message in result.stdout + result.stderr, result.stdout + result.stderr
    # A job that fails while starting (a checkpoint that is not there) leaves no W&B run.
    result = run(command(tmp_path / "start", "--training.steps", "1", "--checkpoint.initial_load_path", str(tmp_path / "none")),
                 check=False)
    assert result.returncode == 2 and not list((tmp_path / "start").glob("tb/*/wandb/offline-run-*")), result.stderr
    result = run(command(tmp_path / "off", "--training.steps", "1"), env={"WANDB_MODE": "disabled"})
    assert "Weights & Biases logging is off: WANDB_MODE=disabled" in result.stdout
    assert not list((tmp_path / "off").glob("tb/*/wandb"))
    # metrics.save_for_all_ranks: a run per rank, in its rank_R folder, the given id suffixed with the rank.
    mpi = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np", "2"]
    run(mpi + command(tmp_path / "ranks", "--training.steps", "1", "--metrics.save_for_all_ranks"),
        env={"WANDB_RUN_ID": "job7", "OMP_NUM_THREADS": "1"})
    for rank in (0, 1):
        files = list((tmp_path / "ranks").glob(f"tb/*/rank_{rank}/wandb/offline-run-*-job7-rank{rank}/run-job7-rank{rank}.wandb"))
        assert len(files) == 1, rank
