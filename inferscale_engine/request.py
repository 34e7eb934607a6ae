"""``GenerationOptions``: one request's generation options, validated once where it enters.

The engine's public methods (``generate``, ``stream``, ``agenerate``, ``*_segments``) take
options as keywords and build this object once at their entry; everything after (handle
resolution's room check, the planner, the layout, vLLM's ``SamplingParams``) reads its fields.
The server builds it itself, before it resolves a request's handles, and passes ``options=``.

Kept apart from :mod:`inferscale_engine.engine` so the server can build and check options
without the engine's internals; vLLM is imported only to learn ``SamplingParams``' field names
(from :mod:`inferscale_engine.vllm_compat`, which knows how they are declared).
"""

from __future__ import annotations

import difflib
import functools
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from inferscale_engine.config import check_recompute
from inferscale_engine.errors import InvalidOptionError
from inferscale_engine.types import Mode

__all__ = ["GenerationOptions"]

#: ``SamplingParams`` fields the engine sets itself, each with what to send instead.
_RESERVED = {
    "logprobs": "use first_logprobs=N (the first generated token's top N log-probabilities)",
    "structured_outputs": "use structured={...} (json, json_object, regex, choice or grammar)",
    "guided_decoding": "use structured={...} (json, json_object, regex, choice or grammar)",
    "extra_args": "InferScale's own: it carries the request's injection plan",
    "skip_clone": "InferScale's own: each request gets its own SamplingParams",
}

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """What to generate for one request, checked when built (``InvalidOptionError``, a
    ``ValueError``), so a bad value is refused before any memory is read or vLLM sees it.

    ``recompute``: the quality knob (None: the engine's ``config.recompute``, read per request).
    ``first_logprobs``: the first generated token's top log-probabilities
    (``GenerationResult.first_logprobs``). ``structured``: an output constraint
    (``{"json": schema}``, ``{"regex": ...}``...). ``sampling``: any other vLLM
    ``SamplingParams`` field (``top_p``, ``seed``, ``stop``...), by name.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    mode: Mode = "inject"
    recompute: int | None = None
    first_logprobs: int | None = None
    structured: Mapping[str, Any] | None = None
    sampling: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    def __post_init__(self) -> None:
        if self.mode not in ("inject", "prompt"):
            raise InvalidOptionError(f"mode must be 'inject' or 'prompt', got {self.mode!r}", option="mode")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidOptionError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", option="max_tokens")
        if self.recompute is not None:
            try:
                check_recompute(self.recompute)
            except ValueError as exc:
                raise InvalidOptionError(str(exc), option="recompute") from None
        if self.first_logprobs is not None and (not isinstance(self.first_logprobs, int) or self.first_logprobs < 0):
            raise InvalidOptionError(f"first_logprobs must be an integer >= 0, got {self.first_logprobs!r}", option="first_logprobs")
        if self.structured is not None and not isinstance(self.structured, Mapping):
            raise InvalidOptionError(f"structured must be a dict of output constraints, got {self.structured!r}", option="structured")
        if self.sampling.get("seed") is not None:
            # vLLM does not check the range; torch would raise inside the engine step and fail
            # every request in flight, not just this one.
            _check_seed(self.sampling["seed"])
        # Frozen all the way down: an options object may serve many requests.
        object.__setattr__(self, "sampling", MappingProxyType(dict(self.sampling)) if self.sampling else _EMPTY)

    @classmethod
    def from_kwargs(cls, **options: Any) -> GenerationOptions:
        """The options of keyword arguments as the engine's methods take them: this class's
        fields by name, and any other vLLM ``SamplingParams`` field. An unknown name is refused
        (``InvalidOptionError``) with the closest known one, never passed on for vLLM to fail on."""
        own = {name: options.pop(name) for name in _OWN if name in options}
        known = _sampling_fields()
        for name in options:
            if name in _RESERVED:
                raise InvalidOptionError(f"{name} is not a generation option: {_RESERVED[name]}", option=name)
            if name not in known:
                close = difflib.get_close_matches(name, [*_OWN, *sorted(known)], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InvalidOptionError(f"unknown generation option {name!r}{hint}; options are {', '.join(_OWN)} "
                                         "and the fields of vLLM's SamplingParams", option=name)
        return cls(**own, sampling=options)


_OWN = ("max_tokens", "temperature", "mode", "recompute", "first_logprobs", "structured")


@functools.cache
def _sampling_fields() -> frozenset[str]:
    """``SamplingParams``' public fields that are not InferScale's own."""
    from inferscale_engine import vllm_compat as compat

    names = compat.sampling_params_fields()
    return frozenset(n for n in names if not n.startswith("_") and n not in _RESERVED and n not in _OWN)


def _check_seed(seed: Any) -> None:
    try:
        ok = not isinstance(seed, bool) and -(2**63) <= operator.index(seed) < 2**64
    except TypeError:
        ok = False
    if not ok:
        raise InvalidOptionError(f"seed must be an integer in [-2**63, 2**64), got {seed!r}", option="seed")
