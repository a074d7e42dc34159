"""The RoPE schedule (SPEC §4): Hugging Face ``rope_scaling`` dicts in, the C++ schedule out.

The rules (types, required and accepted keys, value types, aliases, ``rope_theta``) and the
arithmetic live in C++ (``parse_rope_scaling`` and ``make_rope_schedule``), shared with C++
callers; this module only tells Python's value types apart (a bool from an int, a number
from a string), which only Python can, and hands the dict's items over.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from typing import Any, Mapping, Optional, Sequence, Tuple

from ropepool import _ropepool

# ScalingValue::Kind (include/ropepool/rope_scaling.hpp)
_NULL, _BOOL, _INT, _FLOAT, _STRING, _LIST, _OTHER = range(7)


@dataclasses.dataclass(frozen=True)
class RopeSchedule:
    """A RoPE schedule made once (e.g. at model load) and passed as ``schedule=``.

    ``inv_freq`` holds ``rotary_dim/2`` inverse frequencies in float64;
    ``attention_scaling`` multiplies cos and sin (YaRN's / LongRoPE's mscale);
    ``rope_base`` is the base it was made from: a call passing the schedule must pass the
    same ``rope_base`` (a disagreement is an error, SPEC §4). ``mrope_section`` (None, or
    ``(s_t, s_h, s_w)``) and ``mrope_interleaved`` are multimodal RoPE (SPEC §7): a call
    with such a schedule takes positions ``[3, T]``.
    """

    rotary_dim: int
    inv_freq: Tuple[float, ...]
    attention_scaling: float
    rope_base: float = 0.0
    mrope_section: Optional[Tuple[int, ...]] = None
    mrope_interleaved: bool = False


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not _is_bool(x)


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool) or type(x).__name__ == "bool_"  # numpy.bool_ too


def _entry(key: Any, value: Any) -> tuple:
    """(key, kind, bool, int, float, str, list): one normalised rope_scaling item."""
    if not isinstance(key, str):
        raise TypeError("rope_pool_fused: rope_scaling keys must be strings, got "
                        f"{type(key).__name__} {key!r}")
    e = [key, _NULL, False, 0, 0.0, "", []]
    if value is None:
        pass
    elif _is_bool(value):
        e[1], e[2] = _BOOL, bool(value)
    elif isinstance(value, numbers.Integral):
        i = int(value)
        if -2**63 <= i < 2**63:
            e[1], e[3] = _INT, i
        else:
            e[1], e[5] = _OTHER, "integer out of the int64 range"
    elif isinstance(value, numbers.Real):
        e[1], e[4] = _FLOAT, float(value)
    elif isinstance(value, str):
        e[1], e[5] = _STRING, value
    elif isinstance(value, (list, tuple)):
        bad = next((x for x in value if not _is_real(x)), None)
        if bad is None and all(_is_real(x) for x in value):
            e[1], e[6] = _LIST, [float(x) for x in value]
        else:
            e[1], e[5] = _OTHER, f"list containing a {type(bad).__name__}"
    else:
        e[1], e[5] = _OTHER, type(value).__name__
    return tuple(e)


def _real(name: str, x: Any) -> float:
    if _is_bool(x) or not isinstance(x, numbers.Real):
        raise TypeError(f"rope_pool_fused: {name} must be a real number, got "
                        f"{type(x).__name__}")
    return float(x)


def _int(name: str, x: Any) -> int:
    if _is_bool(x):
        raise TypeError(f"rope_pool_fused: {name} must be an integer, got bool")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"rope_pool_fused: {name} must be an integer, got "
                        f"{type(x).__name__}") from None


def _rotary_dim(rotary_dim: Any, head_dim: int) -> int:
    """None means the whole head (0 for the core); an explicit 0 is an error, not a default."""
    if rotary_dim is None:
        return 0
    rotary_dim = _int("rotary_dim", rotary_dim)
    if rotary_dim == 0:
        err = ValueError(f"rope_pool_fused: rotary_dim must be even and in (0, head_dim = "
                         f"{head_dim}], got 0")
        err.add_note("pass rotary_dim=None to rotate the whole head")
        raise err
    return rotary_dim


def rope_schedule(
    *,
    head_dim: int,
    rope_base: float,
    rotary_dim: Optional[int] = None,
    rope_scaling: Optional[Mapping[str, Any]] = None,
    max_position_embeddings: Optional[int] = None,
    original_max_position_embeddings: Optional[int] = None,
    seq_len: Optional[int] = None,
    inv_freq: Any = None,
    attention_scaling: Optional[float] = None,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: Optional[bool] = None,
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
    - ``longrope`` (``short_factor``, ``long_factor``; needs ``max_position_embeddings``,
      ``seq_len`` and ``original_max_position_embeddings``, which Phi-3 keeps at the top
      level of its config: pass ``original_max_position_embeddings=config.
      original_max_position_embeddings``; a ``factor`` in the dict must equal
      ``max_position_embeddings / original_max_position_embeddings``): ``long_factor`` once
      ``seq_len > original_max_position_embeddings``.

    A keyword the chosen type does not read (``seq_len`` for ``yarn``, ...) is an error.
    The sequence-length rule (dynamic, longrope): pass the length the batch has reached,
    as transformers does (``max(position) + 1`` over the sequences in the batch); make a
    new schedule when it crosses the threshold. ``inv_freq`` (a CPU float32 array of
    ``rotary_dim/2`` entries) replaces all of this; ``attention_scaling`` replaces the
    schedule's own factor. ``mrope_section`` (``[s_t, s_h, s_w]`` summing to
    ``rotary_dim/2``) and ``mrope_interleaved`` (Qwen3-VL) make it a multimodal schedule
    (SPEC §7); the same keys inside ``rope_scaling`` work too (given in both places they
    must agree). Raises ValueError for a malformed dict or values, TypeError for
    arguments of the wrong Python type.
    """
    head_dim = _int("head_dim", head_dim)
    rope_base = _real("rope_base", rope_base)
    entries = None
    if rope_scaling is not None:
        if not isinstance(rope_scaling, Mapping):
            raise TypeError("rope_pool_fused: rope_scaling must be a dict (config.rope_scaling), "
                            f"got {type(rope_scaling).__name__}")
        entries = [_entry(k, v) for k, v in rope_scaling.items()]
    if attention_scaling is not None:
        attention_scaling = _real("attention_scaling", attention_scaling)
    if mrope_section is not None:
        if isinstance(mrope_section, (str, bytes)) or not hasattr(mrope_section, "__iter__"):
            raise TypeError("rope_pool_fused: mrope_section must be a list of three integers, "
                            f"got {type(mrope_section).__name__}")
        mrope_section = [_int("mrope_section entries", x) for x in mrope_section]
    if mrope_interleaved is not None:
        if not _is_bool(mrope_interleaved):
            raise TypeError("rope_pool_fused: mrope_interleaved must be a bool, got "
                            f"{type(mrope_interleaved).__name__}")
        mrope_interleaved = bool(mrope_interleaved)
    rotary, freqs, scale, base, section, interleaved = _ropepool.rope_schedule(
        head_dim=head_dim, rope_base=rope_base, rotary_dim=_rotary_dim(rotary_dim, head_dim),
        rope_scaling=entries,
        max_position_embeddings=None if max_position_embeddings is None
        else _int("max_position_embeddings", max_position_embeddings),
        original_max_position_embeddings=None if original_max_position_embeddings is None
        else _int("original_max_position_embeddings", original_max_position_embeddings),
        seq_len=None if seq_len is None else _int("seq_len", seq_len),
        inv_freq=inv_freq, attention_scaling=attention_scaling,
        mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
    return RopeSchedule(rotary_dim=rotary, inv_freq=tuple(freqs), attention_scaling=scale,
                        rope_base=base,
                        mrope_section=None if section is None else tuple(section),
                        mrope_interleaved=interleaved)
