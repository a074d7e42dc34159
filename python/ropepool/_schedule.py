"""The RoPE schedule (SPEC §4): Hugging Face ``rope_scaling`` dicts in, the C++ schedule out.

The arithmetic lives in C++ (``make_rope_schedule``, shared by every backend); this module
only reads the dict the way transformers' config does and reports malformed ones.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Mapping, Optional, Tuple

from ropepool import _ropepool

# rope type -> keys it reads (beyond rope_type/type); the required ones are listed first.
_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor"),
}
_OPTIONAL = {
    "default": (),
    "linear": (),
    "dynamic": (),
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "truncate", "original_max_position_embeddings"),
    "llama3": (),
    "longrope": ("factor", "attention_factor", "original_max_position_embeddings"),
}
# Old names transformers still maps ("su" and "yarn"-era aliases of longrope).
_ALIASES = {"su": "longrope"}


@dataclasses.dataclass(frozen=True)
class RopeSchedule:
    """A RoPE schedule made once (e.g. at model load) and passed as ``schedule=``.

    ``inv_freq`` holds ``rotary_dim/2`` inverse frequencies in float64;
    ``attention_scaling`` multiplies cos and sin (YaRN's / LongRoPE's mscale).
    """

    rotary_dim: int
    inv_freq: Tuple[float, ...]
    attention_scaling: float


def _rope_type(rope_scaling: Mapping[str, Any]) -> str:
    name = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if not isinstance(name, str):
        raise ValueError(f"rope_pool_fused: rope_scaling type must be a string, got {name!r}")
    return _ALIASES.get(name, name)


def _scaling_kwargs(rope_scaling: Mapping[str, Any], rope_base: float) -> dict:
    if not isinstance(rope_scaling, Mapping):
        raise TypeError("rope_pool_fused: rope_scaling must be a dict (config.rope_scaling), "
                        f"got {type(rope_scaling).__name__}")
    rope_type = _rope_type(rope_scaling)
    if rope_type not in _REQUIRED:
        return {"rope_type": rope_type}  # the core names the known types (parse_rope_type)
    known = {"rope_type", "type", "rope_theta", *_REQUIRED[rope_type], *_OPTIONAL[rope_type]}
    unknown = sorted(set(rope_scaling) - known)
    if unknown:
        # A key we do not read would be silently ignored: a model that needs it (e.g.
        # multimodal "mrope_section") would get the wrong rotation.
        raise ValueError(
            f"rope_pool_fused: rope_scaling type '{rope_type}' does not use "
            + ", ".join(repr(k) for k in unknown) + "; accepted keys: "
            + ", ".join(sorted(known)))
    missing = [k for k in _REQUIRED[rope_type] if rope_scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_pool_fused: rope_scaling type '{rope_type}' needs "
                         + ", ".join(repr(k) for k in missing))
    theta = rope_scaling.get("rope_theta")
    if theta is not None and float(theta) != rope_base:
        raise ValueError(f"rope_pool_fused: rope_scaling['rope_theta'] = {theta} differs from "
                         f"rope_base = {rope_base}")
    kw: dict = {"rope_type": rope_type}
    for key in ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale",
                "mscale_all_dim", "low_freq_factor", "high_freq_factor"):
        if rope_scaling.get(key) is not None:
            kw[key] = float(rope_scaling[key])
    if rope_scaling.get("truncate") is not None:
        kw["truncate"] = bool(rope_scaling["truncate"])
    if rope_scaling.get("original_max_position_embeddings") is not None:
        kw["original_max_position_embeddings"] = operator.index(
            rope_scaling["original_max_position_embeddings"])
    for key in ("short_factor", "long_factor"):
        if rope_scaling.get(key) is not None:
            kw[key] = [float(x) for x in rope_scaling[key]]
    return kw


def rope_schedule(
    *,
    head_dim: int,
    rope_base: float,
    rotary_dim: Optional[int] = None,
    rope_scaling: Optional[Mapping[str, Any]] = None,
    max_position_embeddings: Optional[int] = None,
    seq_len: Optional[int] = None,
    inv_freq: Any = None,
    attention_scaling: Optional[float] = None,
) -> RopeSchedule:
    """The inverse frequencies and attention factor ropepool will use (SPEC §4).

    ``rope_scaling`` is a Hugging Face ``config.rope_scaling`` dict; the results equal
    transformers' ``ROPE_INIT_FUNCTIONS`` (computed here in float64, not float32):

    - ``default``; ``linear`` (``factor``);
    - ``dynamic`` (``factor``; needs ``max_position_embeddings`` and ``seq_len``): the base
      grows once ``seq_len > max_position_embeddings``;
    - ``yarn`` (``factor``, optional ``beta_fast``/``beta_slow``, ``mscale``/
      ``mscale_all_dim``, ``attention_factor``, ``truncate``,
      ``original_max_position_embeddings``, falling back to ``max_position_embeddings``);
    - ``llama3`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
      ``original_max_position_embeddings``);
    - ``longrope`` (``short_factor``, ``long_factor``; needs ``max_position_embeddings``
      and ``seq_len``; ``original_max_position_embeddings`` from the dict or, as Phi-3
      configs keep it, the model config): ``long_factor`` once
      ``seq_len > original_max_position_embeddings``.

    The sequence-length rule (dynamic, longrope): pass the length the batch has reached,
    as transformers does (``max(position) + 1`` over the sequences in the batch); make a
    new schedule when it crosses the threshold. ``inv_freq`` (a CPU float32 array of
    ``rotary_dim/2`` entries) replaces all of this; ``attention_scaling`` replaces the
    schedule's own factor. Raises ValueError for a malformed dict or values.
    """
    head_dim = operator.index(head_dim)
    rope_base = float(rope_base)
    kw = _scaling_kwargs(rope_scaling, rope_base) if rope_scaling is not None else {}
    if max_position_embeddings is not None:
        kw["max_position_embeddings"] = operator.index(max_position_embeddings)
    if seq_len is not None:
        kw["seq_len"] = operator.index(seq_len)
    if attention_scaling is not None:
        attention_scaling = float(attention_scaling)
        if not math.isfinite(attention_scaling):
            raise ValueError(f"rope_pool_fused: attention_scaling must be finite, got "
                             f"{attention_scaling}")
    rotary, freqs, scale = _ropepool.rope_schedule(
        head_dim=head_dim, rope_base=rope_base,
        rotary_dim=0 if rotary_dim is None else operator.index(rotary_dim),
        inv_freq=inv_freq, attention_scaling=attention_scaling, **kw)
    return RopeSchedule(rotary_dim=rotary, inv_freq=tuple(freqs), attention_scaling=scale)
