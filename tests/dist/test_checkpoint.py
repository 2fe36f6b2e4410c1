"""Distributed checkpoints on real MPI ranks: bitwise resume (10 steps straight against 5 + save + a new process +
5), loading under another layout (FSDP 4 -> 1 process, FSDP 2, HSDP 2x2, DDP 2), crash-atomicity with kills
injected inside the write and the commit and with kill -9 of a running rank, and clear errors for bad checkpoints.
Checkpoints are read back here with a small independent reader (metadata.json + raw rows)."""
import contextlib
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from titan_testing import SOURCE_DIR, binary, metadata_checksum, read_checkpoint, run, write_metadata

# The resume and layout tests: FULL steps straight against HALF + save + a new process + HALF.
HALF, FULL = 5, 10
COMMON = ["--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"), "--training.seq_len", "64",
          "--training.local_batch_size", "1", "--metrics.log_freq", "1", "--checkpoint.enable",
          "--checkpoint.interval", str(HALF), "--checkpoint.no_last_save_model_only", "--debug.seed", "0",
          "--training.mixed_precision_param", "float32", "--lr_scheduler.total_steps", str(FULL), "--training.data_lanes", "4",
          "--training.global_batch_size", "4", "--activation_checkpoint.mode", "none", "--metrics.disable_color_printing"]
LAYOUTS = {
    1: [],
    2: ["--parallelism.data_parallel_shard_degree", "2"],
    4: ["--parallelism.data_parallel_shard_degree", "4"],
    "hsdp": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    "ddp": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
}
RANKS = {1: 1, 2: 2, 4: 4, "hsdp": 4, "ddp": 2}


def train(dump, layout, steps, env=None, check=True, extra=()):
    np_ = RANKS[layout]
    mpi = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           "-np", str(np_)] if np_ > 1 else []
    cmd = mpi + [binary("titan"), "train", *COMMON, *LAYOUTS[layout], "--job.dump_folder", str(dump),
                 "--training.steps", str(steps), *extra]
    return run(cmd, env={"OMP_NUM_THREADS": "1", **(env or {})}, check=check, timeout=600)


def losses(stdout):
    return [(int(m.group(1)), m.group(2)) for m in re.finditer(r"step: +(\d+)  loss: +([\d.]+)", stdout)]


@pytest.fixture(scope="module")
def straight_runs():
    return {}


@pytest.mark.parametrize("layout,mode", [(1, "disabled"), (4, "disabled"), (2, "async"), (4, "async")])
def test_resume_is_bitwise_identical(tmp_path, tmp_path_factory, straight_runs, layout, mode):
    """FULL straight steps against HALF + save + a new process + HALF. One straight run per layout serves both save
    modes (a background save must not change training either: the resumed run's losses and last state are held to the
    straight run's, whatever mode that one saved in)."""
    extra = ["--checkpoint.async_mode", mode]
    if layout not in straight_runs:
        folder = tmp_path_factory.mktemp(f"straight{layout}")
        straight_runs[layout] = (folder, train(folder, layout, FULL, extra=extra))
    folder, straight = straight_runs[layout]
    train(tmp_path / "resumed", layout, HALF, extra=extra)
    resumed = train(tmp_path / "resumed", layout, FULL, extra=extra)
    if mode == "async":
        assert "training blocked" in resumed.stdout and "in the background" in resumed.stdout
        # The first save's staging memory was made ahead, after the process's first step, and that save used it.
        assert "staging memory for the first save made" in resumed.stdout, resumed.stdout[-3000:]
    assert f"Loaded checkpoint {tmp_path / 'resumed' / 'checkpoint' / f'step-{HALF}'}" in resumed.stdout
    assert losses(resumed.stdout) == losses(straight.stdout)[HALF:]
    meta_a, a = read_checkpoint(folder / "checkpoint" / f"step-{FULL}")
    meta_b, b = read_checkpoint(tmp_path / "resumed" / "checkpoint" / f"step-{FULL}")
    assert sorted(a) == sorted(b) and len(a) == 3 * 57  # model, exp_avg, exp_avg_sq of 57 parameters
    for key in a:
        assert np.array_equal(a[key], b[key]), key  # bitwise
    assert meta_a["train_state"] == meta_b["train_state"] == {"step": FULL, "tokens_seen": FULL * 4 * 64}
    assert meta_a["optimizer"] == meta_b["optimizer"]


def test_checkpoint_loads_under_other_layouts(tmp_path, tmp_path_factory, straight_runs):
    """Saved by FSDP over 4 ranks, resumed by 1 process, FSDP 2, HSDP 2x2 and DDP 2: the same training continues
    (same data stream: 4 lanes), so the last weights agree with the straight FSDP 4 run to float32 reduction order.
    (The straight run is the resume test's, when it ran first.)"""
    if 4 not in straight_runs:
        folder = tmp_path_factory.mktemp("straight4")
        straight_runs[4] = (folder, train(folder, 4, FULL))
    source, straight = straight_runs[4]
    _, reference = read_checkpoint(source / "checkpoint" / f"step-{FULL}")
    for layout in [1, 2, "hsdp", "ddp"]:
        dump = tmp_path / f"to_{layout}"
        (dump / "checkpoint").mkdir(parents=True)
        shutil.copytree(source / "checkpoint" / f"step-{HALF}", dump / "checkpoint" / f"step-{HALF}")
        resumed = train(dump, layout, FULL)
        assert "Loaded checkpoint" in resumed.stdout and "saved by 4 rank(s)" in resumed.stdout
        for (s1, l1), (s2, l2) in zip(losses(resumed.stdout), losses(straight.stdout)[HALF:]):
            assert s1 == s2 and abs(float(l1) - float(l2)) <= 2e-5, (layout, s1, l1, l2)
        _, got = read_checkpoint(dump / "checkpoint" / f"step-{FULL}")
        for key, ref in reference.items():
            np.testing.assert_allclose(got[key], ref, rtol=1e-3, atol=2e-5, err_msg=f"{layout} {key}")


@pytest.fixture(scope="module")
def half_the_steps_on_two_ranks(tmp_path_factory):
    dump = tmp_path_factory.mktemp("prefix") / "run"
    train(dump, 2, HALF)
    return dump


# Killed before the first byte, inside the data (20 MB in: a later file), before the metadata and before the rename.
@pytest.mark.parametrize("crash,mode", [("bytes:0", "disabled"), ("bytes:20000000", "disabled"),
                                        ("before_metadata", "disabled"), ("before_rename", "disabled"),
                                        ("bytes:20000000", "async"), ("before_rename", "async")])
def test_a_save_killed_anywhere_leaves_the_previous_checkpoint(tmp_path, half_the_steps_on_two_ranks, crash, mode):
    dump = tmp_path / "run"
    shutil.copytree(half_the_steps_on_two_ranks, dump, symlinks=True)  # the same first steps and their checkpoint
    killed = train(dump, 2, FULL, env={"TITAN_TEST_CHECKPOINT_CRASH": crash, "TITAN_TEST_CHECKPOINT_CRASH_RANK": "0"}, check=False,
                   extra=["--checkpoint.async_mode", mode])
    assert killed.returncode != 0
    folder = dump / "checkpoint"
    assert (folder / f"step-{HALF}" / "metadata.json").exists()
    assert not (folder / f"step-{FULL}" / "metadata.json").exists()
    resumed = train(dump, 2, FULL)
    assert "removing incomplete checkpoint" in resumed.stdout
    assert f"Loaded checkpoint {folder / f'step-{HALF}'}" in resumed.stdout
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"step-{HALF}", f"step-{FULL}"])


def test_kill_9_of_a_running_rank_then_resume(tmp_path):
    dump = tmp_path / "run"
    cmd = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           "-np", "2", binary("titan"), "train", *COMMON, *LAYOUTS[2], "--job.dump_folder", str(dump),
           "--training.steps", "400", "--checkpoint.interval", "3", "--lr_scheduler.total_steps", "400"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 300
    for line in proc.stdout:
        if "Saved checkpoint" in line and "step-9" in line:
            break
        assert time.time() < deadline
    # SIGKILL one rank's titan process while it trains (and possibly writes the next checkpoint).
    pids = subprocess.run(["pgrep", "-f", f"^{binary('titan')} train .*{dump}"], capture_output=True, text=True).stdout.split()
    assert len(pids) == 2, pids
    os.kill(int(pids[-1]), signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    folder = dump / "checkpoint"
    complete = sorted(int(p.name[5:]) for p in folder.iterdir() if p.name.startswith("step-") and (p / "metadata.json").exists())
    assert complete and complete[-1] >= 9
    resumed = train(dump, 2, complete[-1] + 2, extra=["--checkpoint.interval", "3", "--lr_scheduler.total_steps", "400"])
    assert f"Loaded checkpoint {folder / f'step-{complete[-1]}'}" in resumed.stdout
    assert losses(resumed.stdout)[0][0] == complete[-1] + 1


def test_bad_checkpoints_are_refused_by_name(tmp_path):
    dump = tmp_path / "run"
    train(dump, 1, 10, extra=["--checkpoint.interval", "10"])
    step10 = dump / "checkpoint" / "step-10"
    data = step10 / "rank-00000.bin"

    def expect(needle, ranks=1, **kw):
        result = train(dump, ranks, 12, check=False, **kw)
        assert result.returncode == 2 and needle in result.stderr, result.stdout[-2000:] + result.stderr
        assert "frame #" not in result.stderr

    original = data.read_bytes()
    data.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    expect("fails its CRC-32 check")
    # FSDP 2 reads half of each piece saved by one rank: the whole piece is still checked.
    expect('fails its CRC-32 check (corrupt) in the 2097152 bytes at 0 that hold "model.tok_embeddings.weight"', ranks=2)
    data.write_bytes(original[:-10])
    expect("truncated or changed")
    data.write_bytes(original)
    expect('"model.layers.0.attention.wk.weight" has shape [256, 256], the model expects [64, 256]',
           extra=["--model.flavor", "debugmodel_gqa"])
    expect('was saved from a llama3 model (flavor "debugmodel"); this run trains qwen3 (model.name)',
           extra=["--model.name", "qwen3", "--model.flavor", "debugmodel"])
    # The same flavor with another shape: the error names what differs, from the checkpoint's recorded arguments.
    expect("(the checkpoint's vs this run's: n_layers (num_hidden_layers): ", extra=["--model.n_layers", "1"])
    # metadata.json: its own checksum catches any edit (swapped offsets loaded the wrong weights silently before).
    pristine = json.loads((step10 / "metadata.json").read_text())
    assert pristine["version"] == 4 and pristine["metadata_crc32"] == metadata_checksum(pristine)
    meta = copy.deepcopy(pristine)
    wq, wk = (meta["tensors"][f"model.layers.0.attention.{w}.weight"]["pieces"][0] for w in ("wq", "wk"))
    wq["offset"], wk["offset"] = wk["offset"], wq["offset"]
    write_metadata(step10, meta, reseal=False)
    expect("metadata.json: the metadata fails its checksum")
    # Resealed edits are caught by the field checks.
    for edit, needle in [(lambda m: m["tensors"].pop("model.norm.weight"), 'no tensor "model.norm.weight"'),
                         (lambda m: m["train_state"].update(step=9), "train_state.step is 9 but the checkpoint's step is 10"),
                         (lambda m: m.update(step="10"), 'field "step" is "10"'),
                         (lambda m: m["lr_scheduler"].update(completed=11), 'field "completed" is 11'),
                         (lambda m: m["ranks"].pop(), 'field "ranks" must list 1 rank'),
                         (lambda m: m["tensors"]["optimizer.exp_avg.norm.weight"].update(dtype="bfloat16"),
                          "a piece of optimizer.exp_avg.norm.weight has 1024 bytes, its box needs 512")]:
        meta = copy.deepcopy(pristine)
        edit(meta)
        write_metadata(step10, meta)
        expect(needle)
    write_metadata(step10, pristine, reseal=False)
    (dump / "checkpoint" / "step-10").rename(dump / "checkpoint" / "step-11")
    expect("the metadata says step 10 but the folder is \"step-11\"")
    (dump / "checkpoint" / "step-11").rename(step10)
    expect("no complete checkpoint", extra=["--checkpoint.load_step", "7"])
    # An unwritable checkpoint folder (a file stands where the folder should be) is a clear error.
    blocker = tmp_path / "blocked"
    blocker.write_text("not a folder")
    result = train(tmp_path / "other", 1, 10, check=False, extra=["--checkpoint.folder", str(blocker / "x")])
    assert result.returncode == 2 and "cannot create checkpoint folder" in result.stderr, result.stderr


def test_seed_checkpoint_starts_every_layout_from_the_same_weights(tmp_path):
    seeded = tmp_path / "seeded"
    created = train(seeded, 1, 2, extra=["--checkpoint.create_seed_checkpoint", "--checkpoint.last_save_model_only"])
    assert "Created seed checkpoint at step 0" in created.stdout and losses(created.stdout) == []
    assert json.loads((seeded / "checkpoint" / "step-0" / "metadata.json").read_text())["model_only"]
    # FSDP 2 from the seed checkpoint, with another init seed, trains exactly like FSDP 2 initialised with seed 0.
    from_seed = train(seeded, 2, 3, extra=["--debug.seed", "5"])
    assert "Loaded model weights from" in from_seed.stdout
    plain = train(tmp_path / "plain", 2, 3, extra=["--checkpoint.no_enable"])
    assert losses(from_seed.stdout) == losses(plain.stdout)
    refused = train(tmp_path / "multi", 2, 2, check=False, extra=["--checkpoint.create_seed_checkpoint"])
    assert refused.returncode != 0 and "runs on a single process" in refused.stderr + refused.stdout


def test_a_finished_runs_model_only_last_save_is_not_resumed_from(tmp_path):
    """A run that ended with the default model-only last save, started again with more steps in the same folder,
    would restart at step 1 from it, and every restart would load it again (its own checkpoints sort below): refused,
    naming the newest full checkpoint, from which load_step continues the run."""
    dump = tmp_path / "run"
    train(dump, 1, 4, extra=["--checkpoint.interval", "2", "--checkpoint.last_save_model_only"])
    assert json.loads((dump / "checkpoint" / "step-4" / "metadata.json").read_text())["model_only"]
    refused = train(dump, 1, 6, check=False, extra=["--checkpoint.interval", "2"])
    assert refused.returncode == 2 and "step-4 is a model-only save" in refused.stderr and \
        "checkpoint.load_step = 2 (its newest full checkpoint)" in refused.stderr, refused.stderr
    resumed = train(dump, 1, 6, extra=["--checkpoint.interval", "2", "--checkpoint.load_step", "2"])
    assert "Loaded checkpoint" in resumed.stdout and losses(resumed.stdout)[0][0] == 3


@contextlib.contextmanager
def small_disk(tmp_path):
    """A 110 MB tmpfs: one 74 MB training state fits, two do not (skipped where tmpfs cannot be mounted)."""
    disk = tmp_path / "small_disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=110m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"skipped: cannot mount a small tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_config_file_that_cannot_be_written_is_an_error(tmp_path):
    """job.save_config_file on a full disk: the write is checked (a short file used to pass silently)."""
    with small_disk(tmp_path) as disk:
        filler = subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=1M", "count=200"], capture_output=True)
        assert b"No space left" in filler.stderr, filler.stderr
        (disk / "run").mkdir()
        result = train(disk / "run", 1, 1, check=False, extra=["--job.save_config_file", "config.json"])
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr
        assert "cannot write" in result.stderr and "config.json" in result.stderr and "disk is full" in result.stderr, result.stderr
        assert not (disk / "run" / "config.json").exists()


def test_a_full_disk_fails_the_save_by_name_and_keeps_the_previous_checkpoint(tmp_path):
    """A 110 MB tmpfs holds one 74 MB training state but not two: the second save fails with ENOSPC, naming the
    file; the first stays loadable, and a smaller (model-only bfloat16) final save then fits."""
    with small_disk(tmp_path) as disk:
        extra = ["--checkpoint.folder", str(disk / "ckpt"), "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0"]
        full = train(tmp_path / "run", 1, 10, check=False, extra=extra)
        assert full.returncode == 2, full.stdout[-2000:] + full.stderr
        assert "rank-00000.bin" in full.stderr and "disk is full" in full.stderr, full.stderr
        assert (disk / "ckpt" / "step-5" / "metadata.json").exists()
        resumed = train(tmp_path / "run", 1, 7, extra=extra + ["--checkpoint.last_save_model_only",
                                                                 "--checkpoint.export_dtype", "bfloat16"])
        assert f"Loaded checkpoint {disk / 'ckpt' / 'step-5'}" in resumed.stdout
        assert "removing incomplete checkpoint" in resumed.stdout
        meta = json.loads((disk / "ckpt" / "step-7" / "metadata.json").read_text())
        assert meta["model_only"] and {t["dtype"] for t in meta["tensors"].values()} == {"bfloat16"}


@pytest.mark.parametrize("layout", [1, 2])
def test_a_failed_background_save_stops_the_run_with_an_error(tmp_path, layout):
    """async_mode: the save at step 10 cannot fit on the 110 MB tmpfs. It fails in the background; at the next step
    boundary every rank stops with an error naming the file and the cause, the exit code is not success, and the
    step-5 checkpoint stays complete. (Before, training went on and exited 0 without the checkpoint.)"""
    with small_disk(tmp_path) as disk:
        extra = ["--checkpoint.folder", str(disk / "ckpt"), "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "0",
                 "--checkpoint.async_mode", "async"]
        run_ = train(tmp_path / "run", layout, 30, check=False, extra=extra)
        assert run_.returncode == 2, run_.stdout[-2000:] + run_.stderr
        assert "asynchronous checkpoint failed" in run_.stderr and "disk is full" in run_.stderr, run_.stderr[-3000:]
        assert "Training completed" not in run_.stdout
        last = max(step for step, _ in losses(run_.stdout))
        assert 10 <= last < 15, last  # stopped at a step boundary soon after the failed save
        assert (disk / "ckpt" / "step-5" / "metadata.json").exists()
        assert not (disk / "ckpt" / "step-10" / "metadata.json").exists()


def test_a_step_folder_titan_did_not_write_is_moved_aside_not_deleted(tmp_path):
    dump = tmp_path / "run"
    foreign = dump / "checkpoint" / "step-99"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    result = train(dump, 1, 2)
    assert "was not written by titan; moved to" in result.stdout, result.stdout[-2000:]
    assert (dump / "checkpoint" / "step-99.quarantined" / "notes.txt").read_text() == "mine"
    assert not foreign.exists()


def test_checkpoint_keys_behave_as_torchtitans(tmp_path):
    dump = tmp_path / "keys"
    keys = ["--checkpoint.enable_first_step_checkpoint", "--checkpoint.keep_latest_k", "2", "--checkpoint.interval", "2"]
    saved = train(dump, 1, 3, extra=keys)
    folder = dump / "checkpoint"
    # Steps 1 (enable_first_step_checkpoint), 2 (interval) and 3 (the last) were saved; keep_latest_k = 2 purged 1.
    assert saved.stdout.count("Saved checkpoint") == 3
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3"]
    # exclude_from_loading = train_state: the weights load, the step count does not.
    again = train(dump, 1, 2, extra=["--checkpoint.exclude_from_loading", "train_state,dataloader", "--checkpoint.interval", "100"])
    assert "Loaded checkpoint" in again.stdout and losses(again.stdout)[0][0] == 1
    # initial_load_path with a titan checkpoint directory: weights only, training starts at step 1.
    fresh = train(tmp_path / "fresh", 1, 2, extra=["--checkpoint.initial_load_path", str(folder / "step-3")])
    assert "Loaded model weights from" in fresh.stdout and losses(fresh.stdout)[0][0] == 1
    # A training state saved in bfloat16 parameters does not resume a float32 run.
    bf16 = tmp_path / "bf16"
    train(bf16, 1, 1, extra=["--training.dtype", "bfloat16"])
    refused = train(bf16, 1, 2, check=False)
    assert refused.returncode == 2 and "is bfloat16, the model trains in float32" in refused.stderr, refused.stderr
