"""Writes config.json folders of real model shapes for random-weight (load_format=dummy) runs.

usage: python3 scripts/make_configs.py OUT [--tokenizer DIR]

``--tokenizer DIR`` (a model folder with a Hugging Face tokenizer, e.g. the prepared SmolLM2)
also writes ``llama-3.1-8b-text``: the Llama-3.1-8B shape with that tokenizer, its vocabulary
size set to the tokenizer's, for runs that need text (prompt injection as frameworks do it).
"""

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")

SHAPES = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": 128009, "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "sliding_window": None,
        "use_sliding_window": False,
    },
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32768, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", "sliding_window": None,
    },
}


def with_tokenizer(root: Path, tokenizer: Path) -> str:
    """``llama-3.1-8b-text`` under ``root``: the Llama shape, ``tokenizer``'s files and vocabulary."""
    out = root / "llama-3.1-8b-text"
    out.mkdir(parents=True, exist_ok=True)
    own = json.loads((tokenizer / "config.json").read_text())
    cfg = {**SHAPES["llama-3.1-8b"], "vocab_size": own["vocab_size"], "bos_token_id": own.get("bos_token_id"),
           "eos_token_id": own.get("eos_token_id")}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    return out.name


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer", type=Path, help="model folder whose tokenizer a text-capable shape gets")
    args = p.parse_args()
    for name, cfg in SHAPES.items():
        (args.out / name).mkdir(parents=True, exist_ok=True)
        (args.out / name / "config.json").write_text(json.dumps(cfg, indent=1))
    names = list(SHAPES) + ([with_tokenizer(args.out, args.tokenizer)] if args.tokenizer else [])
    print("wrote", ", ".join(names))
