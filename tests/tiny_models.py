"""Builders for tiny random-weight models used by the test suite.

No model hub is reachable from the test machines, so tests that need a real
Hugging Face checkpoint on disk get one from here: a locally trained byte-level
BPE tokenizer (~1000 tokens, ChatML chat template) plus a 4-layer,
256-hidden model of one of the architectures InferScale cares about.

* ``llama``   -- llama3 rope scaling, so rope-scaling code paths get exercised.
* ``qwen2``   -- q/k/v projections with bias (Qwen2 always has them).
* ``mistral`` -- plain (default) rope, no sliding window.

All three use grouped-query attention (4 query heads, 2 KV heads) so KV-cache
code sees ``num_kv_heads != num_heads``.  Weights are seeded, hence identical
across runs and machines.

Run ``python tests/tiny_models.py [OUT_DIR]`` to build all three and smoke
test them in vLLM (CPU, in-process).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "ARCHS",
    "CHATML_TEMPLATE",
    "TINY_DEFAULTS",
    "VLLM_CPU_TEST_ENV",
    "build_tiny_model",
    "build_tokenizer",
]

logger = logging.getLogger(__name__)

Arch = Literal["llama", "qwen2", "mistral"]
ARCHS: tuple[Arch, ...] = ("llama", "qwen2", "mistral")

BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
# Order fixes the ids: 0 bos, 1 im_start, 2 eos/im_end, 3 pad.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, IM_START, EOS_TOKEN, PAD_TOKEN)

VOCAB_TARGET = 1000

# GPT-4/Llama-3 style split, verbatim from transformers' Qwen2Tokenizer.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: ChatML, the same layout as SmolLM2/Qwen2 but without a default system
#: prompt, so tests control every token of the prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Shape shared by all tiny models; ``build_tiny_model(**overrides)`` wins.
TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}

#: Environment for running vLLM in-process on a small CPU box (set before
#: importing vllm).  Tests and the smoke test below use it.
VLLM_CPU_TEST_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}

# Training text for the tokenizer: plain English plus the kind of sentences
# memory/KV-injection tests use (names, facts, questions), so those prompts
# tokenize into a handful of real merges rather than single bytes.
_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "My dog is called Rex. What is my dog's name? Your dog's name is Rex.",
    "My cat is called Luna and she likes to sleep in the sun.",
    "My name is Alice and I live in Paris, the capital of France.",
    "Bob works as an engineer in Berlin, the capital of Germany.",
    "What is the capital of Italy? The capital of Italy is Rome.",
    "What is your favourite colour? My favourite colour is blue.",
    "Remember that the meeting is on Monday at ten o'clock in the morning.",
    "The user prefers short answers and writes in English.",
    "You are a helpful assistant. Answer the question using the memory below.",
    "Memory: the user has two children, Tom and Emma, who go to school.",
    "Question: how old is the user? Answer: the user is forty two years old.",
    "The weather today is sunny with a light wind from the west.",
    "It rained all night, so the streets were wet in the morning.",
    "She opened the window and looked at the mountains in the distance.",
    "He drinks coffee every morning before he goes to work.",
    "They walked along the river and talked about their holidays.",
    "We are going to the market to buy apples, bread, cheese and milk.",
    "The train to London leaves at half past eight from platform four.",
    "Please send me the report by Friday afternoon.",
    "Thank you very much for your help with the project.",
    "I am sorry, but I do not know the answer to that question.",
    "Can you tell me a story about a dragon who lived in a castle?",
    "Once upon a time there was a little girl who loved to read books.",
    "The children played in the garden until it was time for dinner.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The sun rises in the east and sets in the west.",
    "There are seven days in a week and twelve months in a year.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "January, February, March, April, May, June, July, August.",
    "September, October, November, December are the last months.",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.",
    "Red, orange, yellow, green, blue, indigo and violet are colours.",
    "The computer stores data in memory and on the disk.",
    "A language model predicts the next token given the previous tokens.",
    "The cache keeps keys and values for every layer of the model.",
    "Attention lets each token look at the tokens that came before it.",
    "The server received a request and returned a response in JSON.",
    "Install the package with pip and run the tests with pytest.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "Hello! How are you today? I am fine, thank you. And you?",
    "Good morning, good afternoon, good evening and good night.",
    "The library is open from nine in the morning until six in the evening.",
    "Her brother plays the guitar and her sister plays the piano.",
    "The doctor said that I should rest and drink a lot of water.",
    "Our house has three bedrooms, a kitchen and a small garden.",
    "The teacher asked the students to write an essay about their town.",
    "Yesterday I met an old friend whom I had not seen for years.",
    "If you have any questions, please do not hesitate to ask.",
    "The price of the book is twelve dollars and fifty cents.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14",
    "The first president, the second chapter, the third floor.",
    "Birds fly south in the winter and return in the spring.",
    "The ocean is deep and full of fish, whales and other animals.",
    "He forgot his keys at home, so he called his wife.",
    "The company announced a new product at the conference.",
    "Scientists study the stars, the planets and the galaxies.",
    "The recipe needs two eggs, a cup of flour and some sugar.",
    "Turn left at the church and then go straight for two hundred metres.",
    "Which is better, tea or coffee? Many people like both.",
    "system user assistant",
)


@functools.cache
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train the BPE tokenizer once per process and return it serialised."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # Same normalizer and pre-tokenizer as transformers' Qwen2Tokenizer.  For
    # model_type "qwen2", transformers 5 ignores tokenizer_class and rebuilds
    # the tokenizer as Qwen2Tokenizer from vocab+merges with *its own*
    # pre-tokenizer; matching it keeps tokenizer.json, AutoTokenizer and
    # vLLM in agreement for every arch.  add_prefix_space=False so encoding
    # pieces separately equals encoding their concatenation at word starts.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols up front: any text (including emoji or
        # characters absent from the corpus) stays encodable, no <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so pair frequencies exceed 1 and merges are learnt in
    # a stable, frequency-driven order.
    tokenizer.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    return tokenizer.to_str()


def build_tokenizer(path: str | os.PathLike[str], *, vocab_size: int = VOCAB_TARGET) -> Any:
    """Train a small byte-level BPE tokenizer and save it into ``path``.

    The result is a ``transformers.PreTrainedTokenizerFast`` with
    bos=``<|endoftext|>``, eos=``<|im_end|>``, pad=``<|pad|>`` and a ChatML
    chat template.  No BOS is added automatically (as in Qwen2/SmolLM2), so
    ``encode(a + b) == encode(a) + encode(b)`` at clean boundaries, which KV
    reuse tests rely on.  The vocabulary may end up slightly below
    ``vocab_size`` if the corpus runs out of merges.

    Returns:
        The tokenizer object (already saved).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=TINY_DEFAULTS["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer


def _make_config(arch: Arch, vocab_size: int, token_ids: dict[str, int], dtype: str, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, PreTrainedConfig, Qwen2Config

    kwargs: dict[str, Any] = {
        **TINY_DEFAULTS,
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        **token_ids,
    }
    # transformers 5 spells rope settings `rope_parameters` (rope_theta lives
    # inside it); the legacy `rope_scaling`/`rope_theta` kwargs are still
    # accepted but `config.rope_theta` then reads None.  vLLM 0.32 reads
    # `config.rope_parameters`, so we write that form directly.
    cls: type[PreTrainedConfig]
    if arch == "llama":
        cls = LlamaConfig
        kwargs["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
    elif arch == "qwen2":
        # Qwen2's q/k/v bias is hard-wired in its modeling code (no flag).
        cls = Qwen2Config
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
        kwargs["use_sliding_window"] = False
    elif arch == "mistral":
        cls = MistralConfig
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        # MistralConfig defaults to a 4096 sliding window; later Mistral
        # releases dropped it and KV tests want plain full attention.
        kwargs["sliding_window"] = None
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    kwargs.update(overrides)
    kwargs["dtype"] = dtype
    return cls(**kwargs)


def build_tiny_model(
    path: str | os.PathLike[str],
    arch: Arch,
    dtype: str = "float32",
    *,
    seed: int = 0,
    init_std: float = 0.1,
    suppress_special_tokens: bool = True,
    **overrides: Any,
) -> Path:
    """Build, save and return a tiny random-weight model folder.

    Args:
        path: Output directory (created; existing files are overwritten).
        arch: ``"llama"`` (llama3 rope scaling), ``"qwen2"`` (attention bias)
            or ``"mistral"`` (plain rope).
        dtype: Weight/config dtype name, e.g. ``"float32"`` or ``"bfloat16"``.
        seed: Seed for the weights; same seed -> same checkpoint.
        init_std: Std of the normal weight init.  HF's 0.02 default makes a
            4-layer random model collapse into repeating one or two tokens
            under greedy decoding and 0.05 still loops after ~10 tokens;
            0.1 gives ~30 distinct tokens in 32 (top logits around +5).
        suppress_special_tokens: Make special tokens (including eos) never
            win greedy decoding, so generations always reach max_tokens.
            Pass False to test eos handling with sampling/stop settings.
        **overrides: Config fields overriding :data:`TINY_DEFAULTS` and the
            per-arch settings (e.g. ``num_hidden_layers=2``).

    Returns:
        ``Path(path)``, containing config.json, generation_config.json,
        model.safetensors and the tokenizer files.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    tokenizer = build_tokenizer(path)
    token_ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = _make_config(arch, len(tokenizer), token_ids, dtype, overrides)
    config.initializer_range = init_std
    torch_dtype = getattr(torch, dtype)

    # fork_rng keeps the caller's global RNG untouched by our seeding.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Build in float32 so the random draw is the same whatever `dtype`
        # is, then cast: bf16 and fp32 variants hold the "same" weights.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    # Biases (Qwen2 q/k/v) are random too, not zero, so a
                    # loader that drops them produces different outputs.
                    param.normal_(0.0, init_std)
        if suppress_special_tokens and not config.tie_word_embeddings:
            # Zero lm_head rows give special tokens logit 0 while ordinary
            # tokens' top logits are ~+5, so greedy decoding never emits
            # eos/bos/pad/im_start: outputs always run to max_tokens and
            # tests need no ignore_eos.  (Skipped when tied: the rows are
            # then the input embeddings too.)
            with torch.no_grad():
                for token_id in tokenizer.all_special_ids:
                    model.lm_head.weight[token_id].zero_()
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.generation_config = GenerationConfig(**token_ids)
    model.save_pretrained(path, safe_serialization=True)
    logger.debug("built tiny %s model at %s", arch, path)
    return path


def _describe(path: Path) -> str:
    cfg = json.loads((path / "config.json").read_text())
    keys = ("architectures", "vocab_size", "dtype", "rope_parameters", "tie_word_embeddings", "sliding_window")
    return ", ".join(f"{k}={cfg.get(k)}" for k in keys if k in cfg)


if __name__ == "__main__":
    # Smoke test: build every tiny model and generate with vLLM on CPU.
    import sys
    import tempfile

    for key, value in VLLM_CPU_TEST_ENV.items():
        os.environ.setdefault(key, value)
    logging.basicConfig(level=logging.INFO)

    out_root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="tiny-models-"))
    archs: list[Arch] = [a for a in ARCHS if len(sys.argv) <= 2 or a in sys.argv[2:]]  # type: ignore[misc]

    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    prompts = ["The capital of France is", "My dog is called Rex."]
    for arch in archs:
        t0 = time.monotonic()
        model_dir = build_tiny_model(out_root / f"tiny-{arch}", arch)
        t1 = time.monotonic()
        print(f"[{arch}] built in {t1 - t0:.1f}s: {_describe(model_dir)}", flush=True)
        llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=2048)
        t2 = time.monotonic()
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
        t3 = time.monotonic()
        # Cross-check against transformers: same greedy tokens means vLLM read
        # the config (rope, bias, GQA) the way transformers does.
        tok = AutoTokenizer.from_pretrained(model_dir)
        raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        sample = "It's 2024!\n\n  def f(x):  return x  # café ☃"
        same_tok = llm.get_tokenizer().encode(sample) == tok.encode(sample) == raw.encode(sample).ids
        print(f"[{arch}] tokenization vLLM == AutoTokenizer == tokenizer.json: {same_tok}")
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for o in out:
            ids = list(o.outputs[0].token_ids)
            prompt_ids = tok(o.prompt).input_ids
            # Teacher-forced argmax over prompt + vLLM's tokens: every vLLM
            # token must be HF's greedy choice at that position.
            with torch.no_grad():
                logits = hf(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
            ref = logits.argmax(-1).tolist()
            print(
                f"[{arch}] {o.prompt!r} -> {o.outputs[0].text!r} "
                f"({len(set(ids))} distinct of {len(ids)}; matches HF: {ids == ref})"
            )
        print(f"[{arch}] vLLM startup {t2 - t1:.1f}s, generate {t3 - t2:.2f}s", flush=True)
        del llm
