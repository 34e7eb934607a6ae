"""Writes config.json folders of real model shapes for random-weight (load_format=dummy) runs."""

import json
import sys
from pathlib import Path

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

if __name__ == "__main__":
    root = Path(sys.argv[1])
    for name, cfg in SHAPES.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(cfg, indent=1))
    print("wrote", ", ".join(SHAPES))
