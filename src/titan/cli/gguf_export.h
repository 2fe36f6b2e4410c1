// `titan convert --format gguf`: a model read by model_source.h as a GGUF file that llama.cpp loads: the
// architecture's metadata (llama for Llama 3, qwen3 for dense Qwen3), llama.cpp's tensor names, Llama 3.1's RoPE
// scaling as its rope_freqs factors, and the tokenizer embedded (tokens, merges, token types, BOS/EOS, the
// pre-tokenizer named by its split pattern).
#pragma once
#include <string>

#include "titan/cli/model_source.h"
#include "titan/components/tokenizer/tokenizer.h"

namespace titan::cli {

// `type`: "f32", "f16", "bf16" or "q8_0" for the matrices (norms and RoPE factors stay F32; a matrix whose rows are
// not a multiple of 32 long stays F16 under q8_0). UserError for a family or tokenizer GGUF cannot carry.
void write_gguf(const ModelSource& source, const std::string& to, const std::string& type, const tokenizer::Tokenizer& tok);

}  // namespace titan::cli
