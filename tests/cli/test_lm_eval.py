"""End to end with lm-evaluation-harness: train, export with checkpoint.last_save_in_hf, and score the export with
lm-eval's Hugging Face backend on a local multiple-choice task (a YAML over a local JSONL; no network)."""
import json
import os
import sys

from titan_testing import SOURCE_DIR, binary, run

DOCS = [
    {"context": "To be, or not to be, that is the", "choices": [" question", " banana", " seven"], "answer": 0},
    {"context": "All the world's a", "choices": [" stage", " potato", " eleven"], "answer": 0},
    {"context": "A horse! a horse! my kingdom for a", "choices": [" horse", " spoon", " cloud"], "answer": 0},
    {"context": "Now is the winter of our", "choices": [" discontent", " keyboard", " tuesday"], "answer": 0},
    {"context": "Friends, Romans, countrymen, lend me your", "choices": [" ears", " wheels", " laptops"], "answer": 0},
    {"context": "The quality of mercy is not", "choices": [" strained", " purple", " digital"], "answer": 0},
]


def test_lm_eval_scores_a_titan_export(tmp_path):
    dump = tmp_path / "run"
    run([binary("titan"), "train", "--job.config_file", str(SOURCE_DIR / "configs" / "debug_model.toml"),
         "--job.dump_folder", str(dump), "--training.seq_len", "128", "--training.local_batch_size", "4",
         "--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "100", "--checkpoint.last_save_in_hf",
         "--debug.seed", "0"], env={"OMP_NUM_THREADS": "2"})
    export = dump / "checkpoint" / "step-20"
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    with open(tasks / "docs.jsonl", "w") as f:
        for doc in DOCS:
            f.write(json.dumps(doc) + "\n")
    (tasks / "titan_local.yaml").write_text(f"""task: titan_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tasks / "docs.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    out = tmp_path / "results"
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "2",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache")}
    result = run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={export},dtype=float32",
                  "--tasks", "titan_local", "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2",
                  "--output_path", str(out), "--log_samples"], env=env, timeout=900)
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert results, result.stdout[-2000:] + result.stderr[-2000:]
    scores = results[0]["results"]["titan_local"]
    assert 0.0 <= scores["acc,none"] <= 1.0
    samples = [json.loads(line) for p in out.rglob("samples_titan_local_*.jsonl") for line in p.read_text().splitlines()]
    assert len(samples) == len(DOCS)
    # Every choice was scored by the model (a finite log-likelihood each).
    for sample in samples:
        assert len(sample["filtered_resps"]) == 3
        assert all(float(r[0]) < 0 for r in sample["filtered_resps"])
