"""`titan generate` against Hugging Face transformers' generate(do_sample=False) on the HF export of the same
checkpoint, token for token, for every family the registry has (Llama 3, Qwen3 dense and MoE, DeepSeek-V3), with
a batch of two prompts of different lengths (left-padded in titan, each alone in transformers); seeded sampling
repeats; bad input is refused by name; under mpirun, tensor parallelism over 2 ranks gives one process's tokens. `titan convert --format gguf` of the same checkpoints: the `gguf` package
reads every tensor back (F32, F16, BF16 exactly, Q8_0 within its step) with llama.cpp's names and metadata, and
llama.cpp itself (llama-cpp-python, where installed) tokenizes as titan does and continues greedily as
transformers does."""
import json
import os
import re

import numpy as np
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
                  "--model.moe_top_k", "2", "--model.moe_inter_dim", "32",
                  # Hugging Face's Qwen3-MoE has no routing bias: without balancing the export is exact (docs/moe.md).
                  "--model.moe_load_balance_coeff", "0"],
    # The 671B flavor's routing (sigmoid scores over expert groups: what DeepseekV3ForCausalLM computes) on a tiny shape,
    # with YaRN RoPE (8,192 positions over the original 4,096).
    "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "671B", "--model.vocab_size", "2048", "--model.dim", "64", "--model.n_layers", "2",
                    "--model.n_dense_layers", "1", "--model.n_heads", "4", "--model.hidden_dim", "128", "--model.q_lora_rank", "32",
                    "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16", "--model.qk_rope_head_dim", "16",
                    "--model.v_head_dim", "16", "--model.moe_num_experts", "16", "--model.moe_top_k", "2", "--model.moe_inter_dim", "32",
                    "--model.max_seq_len", "8192"],
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
        else:
            # Each new token's log-probability under the model, as transformers computes it over the whole sequence.
            with torch.no_grad():
                logits = model(torch.tensor([row["prompt_ids"] + theirs])).logits[0, len(row["prompt_ids"]) - 1:-1]
            expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(theirs).view(-1, 1)).view(-1)
            assert np.allclose(row["logprobs"], expected.numpy(), rtol=1e-4, atol=1e-4), (family, row["logprobs"], expected)
    # The Hugging Face export itself is a checkpoint titan generates from: the same tokens.
    again = rows(generate(hf, "--temperature", "0", "--ignore-eos", "--json", *sum((["--prompt", p] for p in PROMPTS), [])))
    assert [r["ids"] for r in again] == [r["ids"] for r in ours]


def test_past_the_trained_context_rope_continues_as_transformers(checkpoint):
    """Trained on 32 positions, asked for more with --context: titan continues RoPE with the model's frequencies, as
    transformers computes it for any position, and warns that those positions were never trained."""
    from transformers import AutoModelForCausalLM

    family, step, hf = checkpoint
    if family not in ("llama3", "qwen3"):
        pytest.skip("the families whose max_seq_len is the training seq_len (32) show it")
    new = 40
    refused = generate(step, "--prompt", PROMPTS[0], "--max-new-tokens", str(new), check=False)
    assert refused.returncode == 2 and "pass --context N to go past it" in refused.stderr, refused.stderr
    result = generate(step, "--prompt", PROMPTS[0], "--max-new-tokens", str(new), "--context", "64", "--temperature", "0",
                      "--ignore-eos", "--json")
    assert "past the model's max_seq_len of 32" in result.stderr, result.stderr
    ours = rows(result)[0]
    assert len(ours["prompt_ids"]) + new > 32 and len(ours["ids"]) == new
    model = AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    ids = ours["prompt_ids"] + ours["ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(ours["prompt_ids"]) - 1:-1]
    # Each token titan chose is transformers' most likely one (or within a near-tie of it), at its log-probability.
    best = logits.max(-1).values
    chosen = logits.gather(-1, torch.tensor(ours["ids"]).view(-1, 1)).view(-1)
    assert ((best - chosen) < 1e-4).all(), (family, (best - chosen).tolist())
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ours["ids"]).view(-1, 1)).view(-1)
    assert np.allclose(ours["logprobs"], expected.numpy(), rtol=1e-4, atol=1e-4), (family, ours["logprobs"], expected)
    # Too short a --context is refused by name.
    short = generate(step, "--prompt", PROMPTS[0], "--max-new-tokens", str(new), "--context", "33", check=False)
    assert short.returncode == 2 and "more than --context 33" in short.stderr, short.stderr


def test_sampling_repeats_with_its_seed_and_bad_input_is_refused(checkpoint, tmp_path):
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
    # The prompt from a file or standard input: the same tokens.
    (tmp_path / "prompt.txt").write_text(PROMPTS[0])
    from_file = rows(generate(step, "--prompt-file", str(tmp_path / "prompt.txt"), "--temperature", "0", "--ignore-eos", "--json"))
    from_stdin = run([binary("titan"), "generate", "--checkpoint", str(step), "--max-new-tokens", str(NEW), "--temperature", "0",
                      "--ignore-eos", "--json"], input_text=PROMPTS[0])
    assert from_file[0]["ids"] == rows(from_stdin)[0]["ids"] == greedy
    # Plain output: the prompt and its continuation; tokens/s on standard error.
    plain = generate(step, "--prompt", PROMPTS[0], "--temperature", "0")
    assert plain.stdout.startswith(PROMPTS[0]) and "tokens/s" in plain.stderr
    for extra, message in [(["--prompt", ""], "prompt 1 is empty"),
                           (["--prompt", "x", "--top-p", "0"], "--top-p must be in (0, 1], got 0"),
                           (["--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
                           (["--prompt", "x", "--max-new-tokens", "100000000"], "more than the model's context"),
                           (["--prompt", "x", "--context", "0"], "--context must be a positive number of positions, got 0"),
                           (["--prompt", "x", "--temperature", "-1"], "--temperature must be 0 (greedy) or positive"),
                           (["--prompt", "x", "--device", "tpu"], "--device \"tpu\": expected cpu or cuda")] + \
                          ([] if torch.cuda.is_available() else [(["--prompt", "x", "--device", "cuda"], "LibTorch sees no GPU here")]):
        result = generate(step, *extra, check=False)
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)
    missing = run([binary("titan"), "generate", "--checkpoint", str(step.parent / "nothing"), "--prompt", "x"], check=False)
    assert missing.returncode == 2 and "nothing" in missing.stderr, missing.stderr


def test_tensor_parallel_sampling_equals_one_process(checkpoint):
    """Under mpirun the model runs tensor-parallel over the ranks (the training plan without sequence parallelism):
    TP 2 gives one process's greedy tokens for every family, rank 0 holding about half the parameters; for Llama 3
    also a seeded sample and a prompt on standard input (read by rank 0 alone), an empty one refused on every rank;
    a degree the heads do not divide by is refused by name."""
    family, step, hf = checkpoint
    mpirun = [os.environ.get("TITAN_MPIRUN", "mpirun"), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "-np"]
    tp = lambda np, *extra, **kw: run([*mpirun, str(np), binary("titan"), "generate", "--checkpoint", str(step),
                                       "--max-new-tokens", str(NEW), *extra], env={"OMP_NUM_THREADS": "1"}, **kw)
    prompts = sum((["--prompt", p] for p in PROMPTS), [])
    one = rows(generate(step, "--temperature", "0", "--ignore-eos", "--json", *prompts))
    two = tp(2, "--temperature", "0", "--ignore-eos", "--json", *prompts)
    same = lambda a, b: (all(x["ids"] == y["ids"] and np.allclose(x["logprobs"], y["logprobs"], rtol=1e-5, atol=1e-5)
                             for x, y in zip(a, b)) and len(a) == len(b))
    assert same(rows(two), one), (family, rows(two), one)
    held, whole = map(int, re.search(r"rank 0 holds (\d+) of (\d+) parameters", two.stderr).groups())
    assert 0.4 * whole < held < 0.75 * whole, (family, held, whole)
    # Each rank reads only its slices: from the Hugging Face export too (per-expert files, permuted rotary rows).
    assert same(rows(tp(2, "--checkpoint", str(hf), "--temperature", "0", "--ignore-eos", "--json", *prompts)), one), family
    if family != "llama3":
        return
    sampled = ["--prompt", PROMPTS[0], "--temperature", "0.9", "--top-k", "50", "--top-p", "0.9", "--seed", "7", "--ignore-eos", "--json"]
    assert same(rows(tp(2, *sampled)), rows(generate(step, *sampled)))
    from_stdin = tp(2, "--temperature", "0", "--ignore-eos", "--json", input_text=PROMPTS[0])
    assert same(rows(from_stdin), one[:1])
    # A failure on rank 0 alone (nothing on standard input) stops every rank: rank 0's error, printed once. The other
    # rank, told by the collective, would only say that rank 0 failed; the job ends before it does.
    empty = tp(2, input_text="", check=False)
    assert empty.returncode != 0 and empty.stderr.count("prompt 1 is empty") == 1, empty.stderr
    assert "failed on rank(s)" not in empty.stderr, empty.stderr
    # A failure on rank 1 alone (only its checkpoint is missing: mpirun's MPMD form gives it other options): rank 0
    # learns of it through the same collective and waits, so what the job prints is rank 1's own error, with its rank.
    args = ["generate", "--max-new-tokens", str(NEW), "--prompt", "x"]
    alone = run([*mpirun, "1", binary("titan"), *args, "--checkpoint", str(step), ":", "-np", "1", binary("titan"), *args,
                 "--checkpoint", str(step.parent / "missing")], env={"OMP_NUM_THREADS": "1"}, check=False)
    assert alone.returncode != 0 and "error (rank 1 of 2)" in alone.stderr and "missing" in alone.stderr, alone.stderr
    assert "failed on rank(s)" not in alone.stderr, alone.stderr
    refused = tp(3, "--prompt", "x", check=False)
    assert refused.returncode != 0 and "tensor parallelism over the launch's ranks = 3" in refused.stderr, refused.stderr


GGUF_NAMES = {"attention_norm": "attn_norm", "attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
              "attention.wo": "attn_output", "attention.q_norm": "attn_q_norm", "attention.k_norm": "attn_k_norm",
              "ffn_norm": "ffn_norm", "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
              # Qwen3-MoE: the router and the grouped experts ([experts, out, in], llama.cpp's order too).
              "moe.router.gate": "ffn_gate_inp", "moe.experts.w1": "ffn_gate_exps", "moe.experts.w3": "ffn_up_exps",
              "moe.experts.w2": "ffn_down_exps"}
# DeepSeek-V3 (llama.cpp's deepseek2): latent attention, shared experts, routing biases; wkv_b is split in two.
LATENT_NAMES = {"attention.wq_a": "attn_q_a", "attention.q_norm": "attn_q_a_norm", "attention.wq_b": "attn_q_b",
                "attention.wkv_a": "attn_kv_a_mqa", "attention.kv_norm": "attn_kv_a_norm", "moe.expert_bias": "exp_probs_b",
                "moe.shared_experts.w1": "ffn_gate_shexp", "moe.shared_experts.w3": "ffn_up_shexp",
                "moe.shared_experts.w2": "ffn_down_shexp"}


def gguf_name(name, latent=False):
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        if rest == "moe.expert_bias":
            return f"blk.{layer}.exp_probs_b.bias"
        key = rest.removesuffix(".weight")
        return f"blk.{layer}.{(LATENT_NAMES if latent and key in LATENT_NAMES else GGUF_NAMES)[key]}.weight"
    return {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}.get(name, name)


def test_gguf_export_reads_back_with_llama_cpps_names_and_metadata(checkpoint, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from titan_testing import read_checkpoint

    family, step, hf = checkpoint
    if family == "qwen3_moe":
        # A Qwen3-MoE whose top-k weights are not renormalised would load in llama.cpp's qwen3moe (which always
        # renormalises) and compute another model: refused by name.
        config = json.loads((hf / "config.json").read_text())
        assert config["norm_topk_prob"] is True
        unnormalised = tmp_path / "unnormalised"
        unnormalised.mkdir()
        for f in hf.iterdir():
            (unnormalised / f.name).symlink_to(f)
        (unnormalised / "config.json").unlink()
        (unnormalised / "config.json").write_text(json.dumps(dict(config, norm_topk_prob=False)))
        refused = run([binary("titan"), "convert", "--from", str(unnormalised), "--to", str(tmp_path / "m.gguf")], check=False)
        assert refused.returncode == 2 and "norm_topk_prob = false" in refused.stderr, refused.stderr
    meta, weights = read_checkpoint(step)
    latent = family == "deepseek_v3"
    if latent:
        # llama.cpp's deepseek2 keeps wkv_b as attn_k_b ([heads, latent, nope], transposed) and attn_v_b.
        m, model = meta["model"], meta["model"]["mla"]
        for name in [k for k in weights if k.endswith("attention.wkv_b.weight")]:
            kv = weights.pop(name).reshape(m["n_heads"], model["qk_nope_head_dim"] + model["v_head_dim"], model["kv_lora_rank"])
            layer = name.split(".")[2]
            weights[f"blk.{layer}.attn_k_b.weight"] = np.ascontiguousarray(kv[:, :model["qk_nope_head_dim"]].transpose(0, 2, 1))
            weights[f"blk.{layer}.attn_v_b.weight"] = np.ascontiguousarray(kv[:, model["qk_nope_head_dim"]:])
    for kind in ("f32", "f16", "bf16", "q8_0"):
        path = tmp_path / f"{kind}.gguf"
        run([binary("titan"), "convert", "--from", str(step), "--to", str(path), "--gguf-type", kind])
        reader = GGUFReader(str(path))
        field = lambda key: reader.fields[key].contents()
        arch = {"llama3": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "deepseek_v3": "deepseek2"}[family]
        assert field("general.architecture") == arch and field(f"{arch}.block_count") == meta["model"]["n_layers"]
        assert field(f"{arch}.embedding_length") == meta["model"]["dim"]
        assert field(f"{arch}.attention.head_count_kv") == (1 if latent else meta["model"]["n_kv_heads"])
        assert field(f"{arch}.feed_forward_length") == meta["model"]["ffn_hidden_dim"]
        assert len(field("tokenizer.ggml.tokens")) == meta["model"]["vocab_size"] and field("tokenizer.ggml.pre") == "llama-bpe"
        if latent:
            mla, moe = meta["model"]["mla"], meta["model"]["moe"]
            assert (field(f"{arch}.attention.kv_lora_rank"), field(f"{arch}.attention.q_lora_rank"),
                    field(f"{arch}.attention.key_length_mla"), field(f"{arch}.attention.value_length_mla"),
                    field(f"{arch}.rope.dimension_count"), field(f"{arch}.leading_dense_block_count"),
                    field(f"{arch}.expert_shared_count"), field(f"{arch}.expert_gating_func"),
                    field(f"{arch}.expert_group_count"), field(f"{arch}.expert_group_used_count")) == \
                (mla["kv_lora_rank"], mla["q_lora_rank"], mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"], mla["v_head_dim"],
                 mla["qk_rope_head_dim"], meta["model"]["n_dense_layers"], moe["num_shared_experts"], 2,
                 moe["num_expert_groups"], moe["num_limited_groups"])
            assert field(f"{arch}.expert_weights_scale") == pytest.approx(moe["route_scale"]) and field(f"{arch}.expert_weights_norm") is True
            yarn = meta["model"]["yarn"]
            assert (field(f"{arch}.rope.scaling.type"), field(f"{arch}.rope.scaling.factor"),
                    field(f"{arch}.rope.scaling.original_context_length"), field(f"{arch}.context_length")) == \
                ("yarn", yarn["factor"], yarn["original_seq_len"], 8192)
        if family in ("qwen3_moe", "deepseek_v3"):
            moe = meta["model"]["moe"]
            assert (field(f"{arch}.expert_count"), field(f"{arch}.expert_used_count"), field(f"{arch}.expert_feed_forward_length")) == \
                (moe["num_experts"], moe["top_k"], moe["hidden_dim"])
        tensors = {t.name: t for t in reader.tensors}
        # The routing biases (zero here: trained without balancing) have no qwen3moe tensor.
        expected = {k if k.startswith("blk.") else gguf_name(k[len("model."):], latent): v for k, v in weights.items()
                    if latent or not k.endswith(".moe.expert_bias")}
        if family == "llama3":
            assert "rope_freqs.weight" in tensors  # Llama 3.1's scaling as llama.cpp's frequency factors
            tensors.pop("rope_freqs.weight")
        assert sorted(tensors) == sorted(expected)
        for name, value in expected.items():
            t = tensors[name]
            got = dequantize(t.data, t.tensor_type).reshape(value.shape)
            if value.ndim == 1 or kind == "f32" or name.endswith("ffn_gate_inp.weight"):  # norms and routers stay F32
                assert t.tensor_type.name == "F32" and np.array_equal(got, value), name
            elif kind == "q8_0" and value.shape[-1] % 32 == 0:
                # Each block of 32 keeps max|x| / 127 as its step, in float16: every value within half a step, plus
                # 127 times the step's float16 rounding (2^-11 relative).
                blocks = value.reshape(-1, 32)
                step_size = np.abs(blocks).max(axis=1, keepdims=True) / 127
                assert t.tensor_type.name == "Q8_0"
                assert (np.abs(got.reshape(-1, 32) - blocks) <= step_size * (0.5 + 127 / 2048) + 1e-9).all(), name
            else:  # F16/BF16, and F16 for a Q8_0 matrix whose rows are not a multiple of 32 long
                half = "f16" if kind == "q8_0" else kind
                cast = torch.from_numpy(value).to(torch.float16 if half == "f16" else torch.bfloat16).float().numpy()
                assert t.tensor_type.name == half.upper() and np.array_equal(got, cast), name


def test_llama_cpp_runs_the_gguf_export_as_transformers_runs_the_hf_one(checkpoint, tmp_path):
    try:
        from llama_cpp import Llama
    except ImportError:
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python builds llama.cpp; docs/generate.md)")
    from transformers import AutoModelForCausalLM

    family, step, hf = checkpoint
    ours = rows(generate(step, "--temperature", "0", "--ignore-eos", "--json", "--prompt", PROMPTS[0]))[0]
    model = AutoModelForCausalLM.from_pretrained(str(hf), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(torch.tensor([ours["prompt_ids"]])).logits[0].numpy()
    report = {}
    for kind in ("f32", "f16", "q8_0"):
        path = tmp_path / f"{kind}.gguf"
        run([binary("titan"), "convert", "--from", str(step), "--to", str(path), "--gguf-type", kind])
        llm = Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
        # The embedded tokenizer: llama.cpp splits and merges the prompt as titan does.
        assert llm.tokenize(PROMPTS[0].encode(), add_bos=True) == ours["prompt_ids"], kind
        llm.eval(ours["prompt_ids"])
        logits = np.array(llm.scores[:len(ours["prompt_ids"])])
        report[kind] = float(np.abs(logits - reference).max())
        llm.reset()
        tokens = []
        for token in llm.generate(ours["prompt_ids"], temp=0.0, top_k=1, reset=True):
            tokens.append(token)
            if len(tokens) == NEW:
                break
        if kind != "q8_0":
            assert tokens == ours["ids"], (kind, tokens, ours["ids"])
        report[kind + "_same_tokens"] = sum(a == b for a, b in zip(tokens, ours["ids"]))
    print(f"{family}: llama.cpp against transformers, largest logit difference over the prompt:", json.dumps(report))
    assert report["f32"] < 1e-3 and report["f16"] < 5e-2
