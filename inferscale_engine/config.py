"""The configuration objects of an InferScale engine and of its memory store."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Device = Literal["cpu", "cuda"]


def default_store_path() -> Path:
    """Where the embedded store lives unless told otherwise (``$INFERSCALE_HOME`` overrides)."""
    home = os.environ.get("INFERSCALE_HOME")
    if not home:
        import platformdirs

        home = platformdirs.user_data_dir("inferscale")
    return Path(home) / "store"


def is_database_url(location: object) -> bool:
    """Whether a store location names a PostgreSQL database (shared by replicas) rather than a folder."""
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def store_location(location: str | os.PathLike | None) -> Path | str:
    """A store folder (``~`` expanded; default :func:`default_store_path`), or a database URL as given."""
    if is_database_url(location):
        return location  # type: ignore[return-value]
    return Path(location).expanduser() if location else default_store_path()


def default_replica_path(url: str) -> Path:
    """Where the replicas of the store at ``url`` on this machine keep their KV (a slot each)."""
    import hashlib
    from urllib.parse import urlsplit

    parts = urlsplit(url)  # the password is no part of which database it is
    ident = f"{parts.hostname}:{parts.port}/{parts.path}?{parts.query}@{parts.username}"
    return default_store_path().parent / "replicas" / hashlib.sha256(ident.encode()).hexdigest()[:16]


def detect_device() -> Device:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """Everything an :class:`~inferscale_engine.engine.InferScaleEngine` is built from.

    ``vllm_options`` passes straight through to vLLM's ``EngineArgs`` for anything not named here,
    overriding the engine's own defaults for vLLM (prefix caching on, no periodic stats lines, full
    CUDA graphs where they check out); ``kv_transfer_config`` is InferScale's and refused.
    """

    model: str = "smollm2"
    device: Device | None = None
    #: A store folder, or a ``postgresql://`` URL for a store that replicas share.
    store_path: Path | str | None = None
    #: ``"auto"``: the model's own, except float32 on an x86 CPU without AVX-512 BF16, where
    #: bfloat16 is emulated and ~4.5× slower (:func:`~inferscale_engine.vllm_compat.engine_dtype`).
    dtype: str = "auto"
    #: Context length; None takes the model's own.
    max_model_len: int | None = None
    #: Conversation turns a fact is encoded after (context-window encoding); 0 = independent.
    window: int = 5
    #: A store that replicas share: see :attr:`MemoryConfig.follow_interval`.
    follow_interval: float | None = None
    #: The store writes absolute dates after relative ones: see :attr:`MemoryConfig.resolve_dates`.
    resolve_dates: bool = False
    #: CPU only: GiB of host memory for vLLM's paged KV cache.
    cpu_kv_cache_gib: float = 1.0
    #: CUDA only: fraction of GPU memory vLLM may take (weights + paged KV cache).
    gpu_memory_utilization: float = 0.80
    enforce_eager: bool | None = None
    max_num_seqs: int = 128
    seed: int = 0
    #: Encoded heads / separators kept for reuse (per user unless ``shared_prefix_cache``).
    static_cache_entries: int = 256
    #: Let users share vLLM's prefix cache and the encoded heads / separators. Off (the default),
    #: every request's cache is salted by its user: a prompt hits only blocks its own user's
    #: requests left, so neither ``cached_tokens`` nor time to first token tells one user whether
    #: another sent the same text (a prefix-cache oracle). Turn it on only when every user's
    #: prompt prefixes are public (one fixed system prompt, no private text before the question).
    shared_prefix_cache: bool = False
    #: CUDA only: rotate and scatter injected KV in one Triton kernel (else torch + backend write).
    fused_rope: bool = True
    #: Let vLLM's prefix cache keep injected prompts, so a request with the same memories in the
    #: same order (same user) skips their injection. Off: injected prompts bypass the prefix cache,
    #: which saves hashing, evicting and caching every block of every request (1–2 ms at k=200)
    #: and leaves the cache to prompts it can serve again. Read per request.
    prefix_cache_injected: bool = False
    #: The quality knob: how many of a prompt's memories, counted back from its last one, are
    #: prefilled as text after the injected ones instead of injected. Those see every memory
    #: before them, as in prompt injection; at least as many as a prompt holds reproduces prompt
    #: injection exactly. Each costs its tokens of prefill. Per-request override: ``recompute=``.
    #: 4: on LoCoMo (Qwen2.5-Coder-0.5B, H200) 98-105% of prompt injection's F1 at k = 5-30 per
    #: speaker for 1.07x the all-injected TTFT at k=50 (docs/benchmarks-locomo.md).
    recompute: int = 4
    #: Token-level recompute inside the injected region: ``"header"`` (each injected memory's
    #: tokens up to its first ``": "``, e.g. LoCoMo's ``[date] Speaker:``; ``"header:M"``: of the
    #: last M memories only, the most relevant where they are listed last), ``"first:N"`` (each
    #: injected memory's first N tokens) or ``"deviating:P"`` (CacheBlend's: the P % of memory
    #: rows whose second-layer K/V deviate most, after a first layer over them all). Those rows' KV is computed again at serving time, layer
    #: by layer, attending over the whole served prefix, and replaces the injected rows
    #: (:mod:`inferscale_engine.connector.blend`, :mod:`inferscale_engine.token_recompute`).
    #: None (the default): off, injection unchanged. Llama, Mistral, Qwen2 and Qwen3 models only;
    #: read per request, like ``recompute``. Cost: ``"header:5"`` took 1.04x / 1.13x the injected
    #: request at k = 5 / 50 inside the engine's full CUDA graphs (H100, Llama-3.1-8B shape);
    #: rows past the largest graph take a pass of their own, ~2x and more.
    recompute_tokens: str | None = None
    #: Where ``recompute_tokens`` computes its rows: in the padding tail of vLLM's own forward
    #: pass, in its weight reads (:mod:`inferscale_engine.connector.forward_recompute`), where a
    #: step can carry them; else, or with False, in a pass of its own ahead of vLLM's
    #: (:mod:`inferscale_engine.connector.blend`).
    recompute_in_forward: bool = True
    #: Run vLLM as ``vllm serve`` does: its engine core and model workers in processes of their
    #: own, fed fact KV through shared memory. ``None``: only where it is needed, i.e. with
    #: ``tensor_parallel_size`` or ``pipeline_parallel_size`` above 1 or a ``vllm_url``; else all
    #: in this process (one engine per process), which measured faster: k=50 TTFT 11.9 against
    #: 13.7 ms on one H200, 200 against 169 req/s for 100 users, 134.5 against 140.7 ms on the
    #: CPU (docs/scaling.md).
    multiprocess: bool | None = None
    #: Serve through a running ``vllm serve`` of this model with InferScale's connector, on this
    #: host (docs/server.md), instead of starting vLLM: this process keeps the memory store and
    #: stages fact KV in shared memory for the server's workers.
    vllm_url: str | None = None
    #: Multiprocess or ``vllm_url``: GiB of memory that fact KV staged for vLLM's workers keeps
    #: after its requests end, so a memory served again is neither copied nor waited for (the
    #: workers' view of hot memories, least recently used out first). A copy costs the owner GPU
    #: work in a CUDA context of its own, which measured ~1.7 ms a request on an H200
    #: (docs/scaling.md). None: a quarter of the GPU memory free once vLLM has started (on
    #: CUDA), 1 GiB of ``/dev/shm`` on the CPU.
    staged_kv_gib: float | None = None
    vllm_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device is None:
            self.device = detect_device()
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        self.store_path = store_location(self.store_path)
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        check_recompute(self.recompute)
        check_recompute_tokens(self.recompute_tokens)
        if self.max_model_len is not None and self.max_model_len < 32:
            raise ValueError(f"max_model_len too small: {self.max_model_len}")
        if self.staged_kv_gib is not None and not self.staged_kv_gib >= 0:
            raise ValueError(f"staged_kv_gib must be >= 0, got {self.staged_kv_gib!r}")
        if self.multiprocess is None:
            parallel = (int(self.vllm_options.get(k) or 1) for k in ("tensor_parallel_size", "pipeline_parallel_size"))
            self.multiprocess = bool(self.vllm_url) or any(n > 1 for n in parallel)
        if self.enforce_eager is None:
            # CPU: eager is faster to start and these small models gain nothing from compiling.
            self.enforce_eager = self.device == "cpu"

    def staged_kv_bytes(self) -> int:
        """Bytes of staged fact KV kept for reuse (:attr:`staged_kv_gib`, or its default)."""
        if self.staged_kv_gib is not None:
            return int(self.staged_kv_gib * (1 << 30))
        if self.device == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info()
            return free // 4
        return 1 << 30

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from keyword options; unknown ones go to ``vllm_options``."""
        names = set(cls.__dataclass_fields__)
        ours = {k: v for k, v in options.items() if k in names}
        extra = {k: v for k, v in options.items() if k not in names}
        ours.setdefault("vllm_options", {}).update(extra)
        return cls(**ours)


@dataclass
class MemoryConfig:
    """Everything a :class:`~inferscale_engine.memory.MemoryStore` is built from besides its
    model, and what each setting does. :meth:`for_engine` derives the defaults of an engine's
    own store from the engine's config."""

    #: Folder of the store (``memory.sqlite3``, ``secret.key``, ``kv/``; created), or the
    #: ``postgresql://`` URL of a database that several replicas share (its facts, history,
    #: embeddings and handle secret; each replica keeps the KV it encodes in ``kv_path``).
    path: Path | str | None = None
    #: With a database ``path``: this process's KV folder. ``None``: the first free slot under
    #: :func:`default_replica_path`, so several replicas on one machine need no flag.
    kv_path: Path | None = None
    #: Facts of the same user a new fact is encoded after (0 = independent).
    window: int = 5
    #: Text every window context starts with: the opening of the prompts the facts will be
    #: served in (chat template, system text), so a fact is encoded after the same first tokens
    #: (attention sink, instructions) it is later served after.
    context_prefix: str = ""
    #: ``None`` (all-MiniLM-L6-v2), a sentence-transformers path/name, or an ``Embedder``.
    embedder: Any = None
    #: ``"exact"`` (torch matmul + topk), ``"faiss"``, or ``"auto"`` (faiss past 20k facts of one user).
    index: Literal["auto", "exact", "faiss"] = "auto"
    #: Where the device KV tier and the search index live; ``None``: the encoder's device.
    device: Device | None = None
    #: Capacity of the device slab and of the host tier.
    device_kv_bytes: int = 512 << 20
    host_kv_bytes: int = 2 << 30
    #: Tokens per device page.
    page_tokens: int = 16
    #: Bound of the background encode queue (``add`` waits when it is full).
    encode_queue: int = 1024
    #: Most facts / prefill tokens per background ``encoder.encode`` call. vLLM serves requests
    #: first come first served, so a chat request arriving while the encoder works waits behind
    #: at most one such batch. ``None``: 256 tokens on CPU (where batching buys nothing and chat
    #: latency stays within ~20% of idle), 4096 on CUDA.
    encode_batch: int = 32
    encode_batch_tokens: int | None = None
    #: Seconds ``resolve`` waits for a fact that is being encoded.
    resolve_timeout: float = 60.0
    #: Threads reading KV files at once (a request's cold facts, prefetches): NVMe drives need a
    #: deep queue to reach their bandwidth.
    disk_read_threads: int = 16
    #: Cap on disk reads, bytes a second for all readers together: a store on a slower volume
    #: than the one it sits on (a network disk), or a test of the cost model. ``None``: no cap.
    disk_read_bps: float | None = None
    #: Tokens the extraction model may answer with (``add(..., infer=True)``).
    extraction_max_tokens: int = 512
    #: A store that replicas share: seconds between this replica's looks at what the others
    #: wrote (1.0 is a good value). Facts they add or update are then encoded here in the
    #: background, so the first ask for one on this replica, seconds later, injects its KV instead
    #: of encoding it on the miss; every replica then encodes every fact once. ``None`` (the
    #: default; or 0): look only when a call needs to, and encode a fact on its first ask here, in
    #: the request. Off by default because on the CPU an ask that lands while the background
    #: encoder is busy with the fact is served as text (``serve_as_text_after``), which a fact
    #: encoded in the request never is (docs/scaling.md has the measurements).
    follow_interval: float | None = None
    #: Write the absolute date after each relative one in a fact's text as it is stored
    #: ("yesterday" -> "yesterday (7 May 2023)"), resolved against the UTC day it is written
    #: (``created_at``, or ``updated_at`` for a new text); expressions with more than one reading
    #: are left as they are (:func:`~inferscale_engine.memory.text.dates.resolve_relative_dates`).
    #: A small model reads such a date back from injected KV more reliably than it works it out
    #: from the memory's own date. Off by default: stored text never changes unasked.
    resolve_dates: bool = False

    def __post_init__(self) -> None:
        self.path = store_location(self.path)
        self.kv_path = Path(self.kv_path).expanduser() if self.kv_path else None

    @classmethod
    def for_engine(cls, engine_config: EngineConfig, **overrides: Any) -> MemoryConfig:
        """The store of an engine: its ``store_path``, ``window`` and ``device``, unless overridden."""
        base = {"path": engine_config.store_path, "window": engine_config.window, "device": engine_config.device,
                "follow_interval": engine_config.follow_interval, "resolve_dates": engine_config.resolve_dates}
        return cls(**{**base, **overrides})


def check_recompute(value: Any) -> int:
    """``value`` as a ``recompute`` setting: a count of memories, ``>= 0``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"recompute must be an integer >= 0 (memories prefilled as text), got {value!r}")
    return value


def check_recompute_tokens(value: Any) -> str | None:
    """``value`` as a ``recompute_tokens`` setting: None, ``"header"``, ``"header:M"``, ``"first:N"`` or
    ``"deviating:P"``."""
    if value is not None:
        from inferscale_engine.token_recompute import TokenSet

        TokenSet.parse(value)
    return value


def engine_option(text: str) -> tuple[str, Any]:
    """One engine option from the command line, ``KEY=VALUE``: the value read as JSON where it
    parses (``64``, ``true``, ``{"cudagraph_mode": "FULL"}``), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value
