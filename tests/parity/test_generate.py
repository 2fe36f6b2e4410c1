"""`titan generate` against Hugging Face transformers' generate(do_sample=False) on the HF export of the same
checkpoint, token for token, for every family the registry has (Llama 3, Qwen3 dense and MoE, DeepSeek-V3), with
a batch of two prompts of different lengths (left-padded in titan, each alone in transformers); seeded sampling
repeats; bad input is refused by name."""
import json

import pytest
import torch

from titan_testing import binary, run

COMMON = ["--model.hf_assets_path", "builtin", "--training.dataset", "fortunes", "--training.seq_len", "32",
          "--training.local_batch_size", "2", "--training.steps", "3", "--debug.seed", "0", "--checkpoint.enable",
          "--checkpoint.interval", "3", "--activation_checkpoint.mode", "none", "--training.mixed_precision_param", "float32"]
FAMILIES = {
    "llama3": ["--model.name", "llama3", "--model.flavor", "debugmodel", "--model.dim", "64", "--model.n_layers", "2",
               "--model.n_heads", "4", "--model.n_kv_heads", "2"],
    "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--model.dim", "64", "--model.n_layers", "2",
              "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.head_dim", "32", "--model.hidden_dim", "128"],
    "qwen3_moe": ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--model.dim", "64", "--model.n_layers", "2",
                  "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.head_dim", "32", "--model.moe_num_experts", "4",
                  "--model.moe_top_k", "2", "--model.moe_inter_dim", "32"],
    # The 671B flavor's routing (sigmoid scores over expert groups: what DeepseekV3ForCausalLM computes) on a tiny shape.
    "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "671B", "--model.vocab_size", "2048", "--model.dim", "64", "--model.n_layers", "2",
                    "--model.n_dense_layers", "1", "--model.n_heads", "4", "--model.hidden_dim", "128", "--model.q_lora_rank", "32",
                    "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16", "--model.qk_rope_head_dim", "16",
                    "--model.v_head_dim", "16", "--model.moe_num_experts", "16", "--model.moe_top_k", "2", "--model.moe_inter_dim", "32"],
}
PROMPTS = ["To be, or not to be, that is the question", "Now is"]
NEW = 12


def generate(checkpoint, *extra, check=True):
    cmd = [binary("titan"), "generate", "--checkpoint", str(checkpoint), "--max-new-tokens", str(NEW), *extra]
    return run(cmd, env={"OMP_NUM_THREADS": "2"}, check=check)


def rows(result):
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    dump = tmp_path_factory.mktemp(request.param) / "dump"
    run([binary("titan"), "train", "--job.dump_folder", str(dump), *FAMILIES[request.param], *COMMON],
        env={"OMP_NUM_THREADS": "2"})
    hf = dump / "hf"
    run([binary("titan"), "convert", "--from", str(dump / "checkpoint" / "step-3"), "--to", str(hf)])
    return request.param, dump / "checkpoint" / "step-3", hf


def test_greedy_continuations_equal_transformers_generate(checkpoint):
    from transformers import AutoModelForCausalLM

    family, step, hf = checkpoint
    ours = rows(generate(step, "--temperature", "0", "--ignore-eos", "--json", *sum((["--prompt", p] for p in PROMPTS), [])))
    assert [r["prompt"] for r in ours] == PROMPTS and len(ours[0]["prompt_ids"]) > len(ours[1]["prompt_ids"])
    model = AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    for row in ours:
        prompt = torch.tensor([row["prompt_ids"]])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW,
                                 min_new_tokens=NEW, pad_token_id=0)
        theirs = out[0, prompt.shape[1]:].tolist()
        assert len(row["ids"]) == NEW
        if row["ids"] != theirs:
            # Only a near-tie may part them: at the first difference transformers' two best logits nearly agree.
            first = next(i for i, (a, b) in enumerate(zip(row["ids"], theirs)) if a != b)
            with torch.no_grad():
                logits = model(torch.tensor([row["prompt_ids"] + theirs[:first]])).logits[0, -1]
            top = logits.topk(2).values
            assert (top[0] - top[1]).item() < 1e-4, (family, row["prompt"], row["ids"], theirs)
            print(f"{family}: a near-tie at token {first} ({(top[0] - top[1]).item():.1e})")
    # The Hugging Face export itself is a checkpoint titan generates from: the same tokens.
    again = rows(generate(hf, "--temperature", "0", "--ignore-eos", "--json", *sum((["--prompt", p] for p in PROMPTS), [])))
    assert [r["ids"] for r in again] == [r["ids"] for r in ours]


def test_sampling_repeats_with_its_seed_and_bad_input_is_refused(checkpoint):
    family, step, _ = checkpoint
    if family != "llama3":
        pytest.skip("one family shows the sampler and the errors")
    sample = lambda seed, *more: rows(generate(step, "--prompt", PROMPTS[0], "--temperature", "0.9", "--top-k", "50",
                                               "--top-p", "0.9", "--seed", str(seed), "--ignore-eos", "--json", *more))[0]["ids"]
    first = sample(7)
    assert sample(7) == first and len(first) == NEW
    assert any(sample(seed) != first for seed in (8, 9))
    # top-k 1 leaves only the most likely token: greedy.
    greedy = rows(generate(step, "--prompt", PROMPTS[0], "--temperature", "0", "--ignore-eos", "--json"))[0]["ids"]
    assert rows(generate(step, "--prompt", PROMPTS[0], "--top-k", "1", "--seed", "3", "--ignore-eos", "--json"))[0]["ids"] == greedy
    # Plain output: the prompt and its continuation; tokens/s on standard error.
    plain = generate(step, "--prompt", PROMPTS[0], "--temperature", "0")
    assert plain.stdout.startswith(PROMPTS[0]) and "tokens/s" in plain.stderr
    for extra, message in [(["--prompt", ""], "prompt 1 is empty"),
                           (["--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1], got 0"),
                           (["--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
                           (["--prompt", "x", "--max-new-tokens", "100000000"], "more than the model's context"),
                           (["--prompt", "x", "--temperature", "-1"], "--temperature must be 0 (greedy) or positive")]:
        result = generate(step, *extra, check=False)
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)
    missing = run([binary("titan"), "generate", "--checkpoint", str(step.parent / "nothing"), "--prompt", "x"], check=False)
    assert missing.returncode == 2 and "nothing" in missing.stderr, missing.stderr
