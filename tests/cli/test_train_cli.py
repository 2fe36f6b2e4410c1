"""`titan train` as a user runs it: torchtitan's debug TOML unchanged, the log line, clear errors for bad input,
and a clean stop on Ctrl-C."""
import json
import re
import signal
import subprocess
import time

from titan_testing import SOURCE_DIR, binary, run, shared

STEP_LINE = re.compile(
    r"step: +(\d+)  loss: +([\d.]+)  grad_norm: +([\d.]+)  memory: +([\d.]+)GiB\(([\d.]+)%\)  "
    r"tps: ([\d,]+)  tflops: ([\d,]+\.\d\d)  mfu: ([\d.]+)%  data: ([\d.]+)s\(([\d.]+)%\)$")


def step_lines(stdout):
    return [STEP_LINE.search(line) for line in stdout.splitlines() if STEP_LINE.search(line)]


def test_torchtitan_debug_toml_runs_unchanged(tmp_path):
    toml = shared("configs", "torchtitan", "debug_model.toml")
    result = run([binary("titan"), "train", "--job.config_file", str(toml),
                  "--model.hf_assets_path", str(shared("tokenizers", "torchtitan_test")),
                  "--training.dataset_path", str(shared("text", "tinyshakespeare.txt")),
                  "--job.dump_folder", str(tmp_path), "--training.steps", "2"])
    lines = step_lines(result.stdout)
    assert [int(m.group(1)) for m in lines] == [1, 2]  # log_freq = 1 in that TOML
    assert "selective activation checkpointing of every 2-th block (3 of 6)" in result.stdout
    assert "Model llama3 debugmodel size: 6,163,712 total parameters" in result.stdout
    for m in lines:
        assert 0 < float(m.group(2)) < 20 and float(m.group(3)) > 0 and float(m.group(8)) > 0


def test_default_job_loss_falls(tmp_path):
    result = run([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                  "--job.dump_folder", str(tmp_path), "--training.steps", "15", "--training.seq_len", "128"])
    lines = step_lines(result.stdout)
    assert [int(m.group(1)) for m in lines] == [1, 5, 10, 15]
    losses = [float(m.group(2)) for m in lines]
    assert losses[-1] < losses[0] - 1.0, losses
    assert "Training completed: 15 steps" in result.stdout
    assert (tmp_path / "builtin_tokenizer" / "fortunes_bpe_2048.tiktoken").exists()


def test_help_lists_keys():
    out = run([binary("titan"), "train", "--help"]).stdout
    assert "--training.steps (int, default 10000)" in out
    assert "--activation_checkpoint.selective_ac_option" in out


def expect_user_error(args, *needles):
    result = run([binary("titan"), "train", *args], check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ")
    for needle in needles:
        assert needle in result.stderr, result.stderr
    assert "frame #" not in result.stderr  # no C++ stack traces for bad input
    return result.stderr


def test_bad_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 3\nlocal_batchsize = 2\n")
    expect_user_error(["--job.config_file", str(bad)], "bad.toml:3", "local_batchsize", "training.local_batch_size")
    expect_user_error(["--optimizer.lr", "fast"], "optimizer.lr expects a number", '"fast"')
    expect_user_error(["--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(tmp_path)],
                      "tensor_parallel_degree = 2", "not supported yet")
    expect_user_error(["--job.dump_folder", str(tmp_path), "--model.hf_assets_path", "builtin"],
                      "c4_test", "--training.dataset_path")
    expect_user_error(["--job.dump_folder", str(tmp_path), "--model.hf_assets_path", str(tmp_path / "nope"),
                       "--training.dataset", "fortunes"], "does not exist")
    # A tokenizer larger than the flavor's vocabulary.
    expect_user_error(["--job.dump_folder", str(tmp_path), "--training.dataset", "fortunes",
                       "--model.hf_assets_path", str(shared("tokenizers", "cl100k_base.tiktoken"))],
                      "has 100277 ids", "vocab_size 2048")
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"text": "fine"}\n{"text": broken\n')
    expect_user_error(["--job.dump_folder", str(tmp_path), "--model.hf_assets_path", "builtin",
                       "--training.dataset_path", str(corrupt), "--training.seq_len", "4096", "--training.steps", "1"],
                      "corrupt.jsonl:2")


def test_config_is_saved_and_printed(tmp_path):
    result = run([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                  "--job.dump_folder", str(tmp_path), "--training.steps", "1", "--training.seq_len", "32",
                  "--job.save_config_file", "config.json", "--job.print_config"])
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["training"]["seq_len"] == 32 and saved["model"]["hf_assets_path"] == "builtin"
    assert "Running with configs:" in result.stdout


def test_ctrl_c_stops_cleanly_after_the_current_step(tmp_path):
    proc = subprocess.Popen([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
                             "--job.dump_folder", str(tmp_path), "--training.steps", "1000", "--metrics.log_freq", "1",
                             "--training.seq_len", "128"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    deadline = time.time() + 300
    for line in proc.stdout:
        seen.append(line)
        if "step:  2" in line:
            proc.send_signal(signal.SIGINT)
            break
        assert time.time() < deadline
    out, err = proc.communicate(timeout=120)
    seen.append(out)
    text = "".join(seen)
    assert proc.returncode == 130, text + err
    assert re.search(r"received SIGINT: stopped cleanly after step \d+ of 1000", text), text
    assert "Training completed" not in text
