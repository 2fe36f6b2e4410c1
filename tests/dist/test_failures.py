"""A rank that dies (SIGKILL) or hangs (SIGSTOP) mid-training ends the whole job, non-zero, in bounded time,
with a message saying what happened - never a silent hang."""
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from titan_testing import SOURCE_DIR, binary
from test_data_parallel_parity import mpirun


def rank_pids(launcher_pid):
    """The titan processes mpirun started, by rank (read from their environment)."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
        except OSError:
            continue
        ppid = next((int(l.split()[1]) for l in status.splitlines() if l.startswith("PPid:")), None)
        rank = next((int(e.split(b"=")[1]) for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        if rank is not None and ppid == launcher_pid:
            ranks[rank] = int(proc.name)
    return ranks


def start_job(tmp_path, timeout_s, layout=("--parallelism.data_parallel_shard_degree", "2"), extra_env=None, until="step:  3",
              steps=100000):
    cmd = mpirun(2) + [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                       "--job.dump_folder", str(tmp_path), "--training.steps", str(steps), "--training.seq_len", "64",
                       "--metrics.log_freq", "1", "--metrics.disable_color_printing", *layout,
                       "--comm.train_timeout_seconds", str(timeout_s)]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(extra_env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    deadline = time.time() + 300
    for line in proc.stdout:
        lines.append(line)
        if until in line:
            break
        assert time.time() < deadline, "".join(lines)
    return proc, lines


def finish(proc, lines, limit):
    start = time.time()
    out, _ = proc.communicate(timeout=limit)
    return "".join(lines) + out, time.time() - start


def stop_rank_1_of(proc, lines):
    """Stops rank 1 of a running job (alive but never answering) and waits for the job to end."""
    pids = rank_pids(proc.pid)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        text, seconds = finish(proc, lines, limit=180)
    finally:
        try:
            os.kill(pids[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
    return text, seconds


def stop_rank_1(tmp_path, *layout):
    """Starts a job with an 8 s timeout, stops rank 1 after step 3, and waits for the job to end."""
    proc, lines = start_job(tmp_path, 8, *layout)
    text, seconds = stop_rank_1_of(proc, lines)
    return proc, text, seconds


def test_killed_rank_ends_the_job(tmp_path):
    proc, lines = start_job(tmp_path, timeout_s=20)
    pids = rank_pids(proc.pid)
    assert set(pids) == {0, 1}, pids
    os.kill(pids[1], signal.SIGKILL)
    text, seconds = finish(proc, lines, limit=120)
    assert proc.returncode != 0
    assert "signal 9" in text or "did not complete" in text, text[-3000:]
    print(f"job ended {seconds:.1f} s after rank 1 was killed (exit {proc.returncode})")


def test_hung_rank_ends_the_job_after_the_timeout(tmp_path):
    proc, text, seconds = stop_rank_1(tmp_path)
    assert proc.returncode != 0
    assert "[rank 0]" in text and "did not complete within 8 s" in text and "another rank has died or hangs" in text, text[-3000:]
    assert seconds < 8 + 60
    print(f"job ended {seconds:.1f} s after rank 1 stopped (timeout 8 s, exit {proc.returncode})")


def test_ctrl_c_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    proc, lines = start_job(tmp_path, timeout_s=60)
    pids = rank_pids(proc.pid)
    os.kill(pids[1], signal.SIGINT)  # only rank 1 receives it
    text, seconds = finish(proc, lines, limit=120)
    assert "stopped cleanly after step" in text, text[-3000:]
    assert "did not complete" not in text  # no rank was left waiting for the other
    assert proc.returncode == 130, text[-3000:]
    print(f"both ranks stopped {seconds:.1f} s after rank 1 got SIGINT")


def test_hung_pipeline_stage_ends_the_job_naming_the_stage(tmp_path):
    """PP 2 (1F1B, 8 micro-batches): the last stage stops itself (SIGSTOP, TITAN_TEST_STOP_BEFORE) just before the
    backward of step 4's first micro-batch, while the first stage waits for that gradient; the first stage's receive
    times out and ends the job with an error naming the stage, the micro-batch and the peer."""
    layout = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
              "--training.local_batch_size", "8")
    proc, lines = start_job(tmp_path, 8, layout, extra_env={"TITAN_TEST_STOP_BEFORE": "4:1B0"})
    pids = rank_pids(proc.pid)
    try:
        text, seconds = finish(proc, lines, limit=180)
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    assert ("pipeline rank 0: stage 0 receiving micro-batch 0's gradient from stage 1 (pipeline rank 1) failed" in text
            and "did not complete within 8 s" in text), text[-3000:]
    assert seconds < 8 + 60
    print(f"job ended {seconds:.1f} s after step 3 was logged; the pipeline receive named the stage and peer")


def test_sigusr1_on_one_rank_saves_a_checkpoint_and_every_rank_stops(tmp_path):
    """SLURM's --signal=USR1@N warning reaches rank 1 only: both ranks stop after the same step, write a complete
    checkpoint of it (the interval would not have saved one), and exit with 138 (128 + SIGUSR1); a new run resumes
    from it."""
    layout = ("--parallelism.data_parallel_shard_degree", "2", "--checkpoint.enable", "--checkpoint.interval", "100000")
    proc, lines = start_job(tmp_path, 60, layout)
    pids = rank_pids(proc.pid)
    os.kill(pids[1], signal.SIGUSR1)
    text, seconds = finish(proc, lines, limit=120)
    assert proc.returncode == 138, text[-3000:]
    m = re.search(r"received SIGUSR1: stopped cleanly after step (\d+) of 100000; checkpoint step-(\d+) is complete", text)
    assert m and m.group(1) == m.group(2), text[-3000:]
    step = int(m.group(1))
    assert (tmp_path / "checkpoint" / f"step-{step}" / "metadata.json").exists()
    print(f"both ranks stopped and saved step {step} {seconds:.1f} s after rank 1 got SIGUSR1")


def test_a_signal_during_validation_ends_it_and_the_step_is_saved(tmp_path):
    """A full validation pass over a large set (the built-in corpus: 7,586 batches) runs right after step 1 is logged;
    SIGUSR1 to rank 1 then ends the validation at its next batch on both ranks (without waiting for the pass), and
    the step is saved."""
    layout = ("--parallelism.data_parallel_shard_degree", "2", "--checkpoint.enable", "--checkpoint.interval", "100000",
              "--validation.enable", "--validation.dataset", "fortunes", "--validation.freq", "100", "--validation.steps", "-1",
              "--validation.seq_len", "64", "--validation.local_batch_size", "1")
    proc, lines = start_job(tmp_path, 60, layout, until="step:  1")
    pids = rank_pids(proc.pid)
    time.sleep(1)
    os.kill(pids[1], signal.SIGUSR1)
    text, seconds = finish(proc, lines, limit=60)
    assert proc.returncode == 138, text[-3000:]
    assert re.search(r"validation at step 1 stopped after \d+ batch\(es\): SIGUSR1 received", text), text[-3000:]
    assert "validate step:" not in text
    m = re.search(r"received SIGUSR1: stopped cleanly after step (\d+) of 100000; checkpoint step-(\d+) is complete", text)
    assert m and m.group(1) == m.group(2) == "1", text[-3000:]
    assert (tmp_path / "checkpoint" / "step-1" / "metadata.json").exists()
    print(f"the validation stopped and step 1 was saved {seconds:.1f} s after rank 1 got SIGUSR1")


def single_job(tmp_path, seq_len, extra=()):
    cmd = [binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
           "--job.dump_folder", str(tmp_path), "--training.steps", "100000", "--training.seq_len", str(seq_len),
           "--metrics.log_freq", "1", "--metrics.disable_color_printing", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step:  2" in line:
            break
    return proc, lines


def test_sighup_stops_after_the_step_with_a_checkpoint(tmp_path):
    proc, lines = single_job(tmp_path, 64, ["--checkpoint.enable", "--checkpoint.interval", "100000"])
    proc.send_signal(signal.SIGHUP)
    text, _ = finish(proc, lines, limit=120)
    assert proc.returncode == 129, text[-3000:]  # 128 + SIGHUP
    m = re.search(r"received SIGHUP: stopped cleanly after step (\d+) .*checkpoint step-(\d+) is complete", text)
    assert m and (tmp_path / "checkpoint" / f"step-{m.group(1)}" / "metadata.json").exists(), text[-3000:]


def test_a_second_signal_ends_the_process_at_once(tmp_path):
    """SIGTERM asks for a stop after the current (long) step; a SIGINT sent right after it ends the process at once,
    killed by the signal, without finishing the step. (The two are sent back to back: a pause between them could let
    the first one's clean stop win at a step boundary.)"""
    proc, lines = single_job(tmp_path, 512, ["--training.local_batch_size", "2"])
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)
    text, _ = finish(proc, lines, limit=60)
    # Pending together, they may be handled in either order: whichever comes second kills the process.
    assert proc.returncode in (-signal.SIGINT, -signal.SIGTERM), (proc.returncode, text[-2000:])
    assert "stopped cleanly" not in text
    assert time.time() - start < 10


def test_a_resumed_run_also_switches_to_the_training_timeout(tmp_path):
    """A run resumed from step 5 uses comm.train_timeout_seconds (8 s) after its first step, not the 300 s start-up
    timeout: a rank that hangs then ends the job one short timeout later."""
    first, lines = start_job(tmp_path, 8, ("--parallelism.data_parallel_shard_degree", "2", "--checkpoint.enable",
                                           "--checkpoint.no_last_save_model_only"), steps=5, until="Training completed")
    first.communicate(timeout=120)
    assert (tmp_path / "checkpoint" / "step-5" / "metadata.json").exists()
    proc, lines = start_job(tmp_path, 8, ("--parallelism.data_parallel_shard_degree", "2", "--checkpoint.enable",
                                          "--checkpoint.interval", "100000", "--comm.init_timeout_seconds", "300"),
                            until="step:  8")
    assert any("Loaded checkpoint" in line for line in lines), "".join(lines)
    text, seconds = stop_rank_1_of(proc, lines)
    assert proc.returncode != 0 and "did not complete within 8 s" in text, text[-3000:]
    assert seconds < 8 + 60


def test_an_error_every_rank_meets_is_printed_once_and_one_rank_s_own_error_names_the_rank(tmp_path):
    """Three ranks given the same bad option all fail at start-up: rank 0 prints the error and the job ends before
    the others (which wait 5 s) print theirs. Then only rank 1 is given the bad option (mpirun's MPMD form): rank 0
    starts and waits for it, so after its wait rank 1 prints its error with its rank, once, and the job fails."""
    config = ["--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"), "--job.dump_folder", str(tmp_path),
              "--training.steps", "2", "--metrics.disable_color_printing"]
    bad = ["--training.seq_len", "-3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    every = subprocess.run(mpirun(3) + [binary("titan"), "train", *config, *bad], capture_output=True, text=True, env=env)
    seconds = time.time() - start
    text = every.stdout + every.stderr
    assert every.returncode != 0
    assert text.count("training.seq_len must be at least 1, got -3") == 1, text
    assert "error: command line (--training.seq_len)" in text and "(rank " not in text, text
    print(f"same error on 3 ranks: printed once, job ended in {seconds:.1f} s")

    launch = mpirun(1)
    titan = [binary("titan"), "train", *config, "--parallelism.data_parallel_shard_degree", "2"]
    start = time.time()
    one = subprocess.run(launch + titan + [":", "-np", "1"] + titan + bad, capture_output=True, text=True, env=env, timeout=300)
    seconds = time.time() - start
    text = one.stdout + one.stderr
    assert one.returncode != 0
    assert text.count("training.seq_len must be at least 1, got -3") == 1, text
    assert "error (rank 1 of 2): command line (--training.seq_len)" in text, text
    assert seconds >= 5, seconds
    print(f"rank 1's own error: printed once with its rank after the wait, job ended in {seconds:.1f} s")
