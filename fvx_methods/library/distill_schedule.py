"""The multi-phase distillation schedule of streaming long tuning (FastVideo's StreamingLongTuningMethod, in
LongLive's style): non-streaming Self-Forcing stages on a short horizon, then streaming stages that roll a long video
out chunk by chunk.

``method.multi_phased_distill_schedule`` takes one of three forms (spec §2.8, "Schedule parsing"):

- empty (None, ``""`` or ``[]``): one open-ended streaming stage ``streaming_long`` from step 0, whose horizon and max
  length are ``default_max_length or default_num_latent_t``.
- a string ``"end:num_latent_t,..."`` or ``"start:end:num_latent_t,..."`` (commas between entries, colons between
  fields, whitespace and empty entries ignored; two fields start where the previous entry ended, 0 for the first): the
  first entry is the non-streaming ``self_forcing`` stage, every later one a streaming ``streaming_long`` stage of max
  length ``num_latent_t`` and the method's chunk size.
- a list of dicts with keys ``stage`` (or ``name``), ``streaming_training`` (default: the name is one of
  ``streaming_long``, ``long``, ``streaming``), ``start_step`` (default: the last end_step given before, 0 first),
  ``end_step`` (default: open-ended), ``num_latent_t`` (fallbacks ``streaming_max_length``, ``max_length``, the data's
  ``num_latent_t``) and the streaming knobs ``streaming_chunk_size``, ``streaming_max_length``,
  ``streaming_min_new_frame``, ``streaming_fixed_overlap_latents``. Integers may be written as strings, booleans as
  ``"true"``/``"false"``. FastVideo ignores keys it does not know; fvx refuses them, so a typo cannot go unnoticed.

The parsed stages are checked, each refusal a ValueError naming the field (``where[i].start_step``) and its values:
start steps >= 0, stages ordered without overlap (none after an open-ended stage), ``end_step > start_step``,
``num_latent_t > 0``; a streaming stage needs a max length > 0, a chunk size > 0 (its own or the method's),
``0 <= streaming_fixed_overlap_latents < chunk size`` and ``streaming_min_new_frame >= 1`` where they are set.
:func:`select` gives the stage a step trains in.
"""
from __future__ import annotations

import difflib
import re
from typing import Any, Mapping, NamedTuple, Sequence

STREAMING_NAMES = frozenset({"streaming_long", "long", "streaming"})
"""Stage names that stream unless ``streaming_training`` says otherwise."""

KNOWN_KEYS = ("stage", "name", "streaming_training", "start_step", "end_step", "num_latent_t", "max_length",
              "streaming_chunk_size", "streaming_max_length", "streaming_min_new_frame",
              "streaming_fixed_overlap_latents")
"""The keys a stage's dict may have."""

INTEGER = re.compile(r"[+-]?\d+")
STRING_FORM = "'end:num_latent_t' or 'start:end:num_latent_t' (integers)"


class Stage(NamedTuple):
    """One phase of the schedule: steps ``[start_step, end_step)`` (``end_step`` None: open-ended) trained on
    ``num_latent_t`` latent frames, streaming or not; the streaming knobs are None where the method's default holds."""

    name: str
    start_step: int
    end_step: int | None
    num_latent_t: int
    streaming: bool
    chunk_size: int | None = None
    max_length: int | None = None
    min_new_frame: int | None = None
    fixed_overlap: int | None = None


def parse(raw: Any, *, default_num_latent_t: int, default_chunk_size: int | None = None,
          default_max_length: int | None = None,
          where: str = "method.multi_phased_distill_schedule") -> tuple[Stage, ...]:
    """The checked stages of ``raw`` in any of the three forms; ``where`` names it in messages."""
    if isinstance(raw, str):
        stages = from_string(raw, default_chunk_size=default_chunk_size, where=where)
    elif isinstance(raw, (list, tuple)):
        stages = from_list(raw, default_num_latent_t=default_num_latent_t, where=where)
    elif raw is None:
        stages = ()
    else:
        raise ValueError(f"{where} must be a list of stages, a string 'end:num_latent_t,...' or empty, "
                         f"got {type(raw).__name__} {raw!r}")
    stages = stages or (default_stage(default_num_latent_t, default_chunk_size, default_max_length),)
    check(stages, default_chunk_size=default_chunk_size, where=where)
    return stages


def select(stages: Sequence[Stage], iteration: int) -> int:
    """The index of the first stage with ``start_step <= iteration < end_step`` (open-ended: ``iteration >=
    start_step``), else of the last stage. FastVideo counts iterations from 1: fvx callers pass ``step + 1``."""
    if not stages:
        raise ValueError("select needs at least one stage")
    for index, stage in enumerate(stages):
        if stage.start_step <= iteration and (stage.end_step is None or iteration < stage.end_step):
            return index
    return len(stages) - 1


def max_length(stage: Stage) -> int:
    """How many latent frames a streaming stage rolls out before it starts a new video."""
    return stage.max_length or stage.num_latent_t


def chunk_size(stage: Stage, default: int) -> int:
    """The latent frames a streaming stage generates per step: its own chunk size, else the method's ``default``."""
    return stage.chunk_size or default


def default_stage(default_num_latent_t: int, default_chunk_size: int | None,
                  default_max_length: int | None) -> Stage:
    """The stage of an empty schedule: streaming from step 0 on, over the whole max length."""
    length = default_max_length or default_num_latent_t
    return Stage("streaming_long", 0, None, length, True, chunk_size=default_chunk_size, max_length=length)


def from_string(text: str, *, default_chunk_size: int | None, where: str) -> tuple[Stage, ...]:
    """The string form: the first entry Self-Forcing, the later ones streaming with max length ``num_latent_t``."""
    stages: list[Stage] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        start, end, num_latent_t = string_fields(entry, stages[-1].end_step if stages else 0, where)
        if stages:
            stages.append(Stage("streaming_long", start, end, num_latent_t, True, chunk_size=default_chunk_size,
                                max_length=num_latent_t))
        else:
            stages.append(Stage("self_forcing", start, end, num_latent_t, False))
    return tuple(stages)


def string_fields(entry: str, previous_end: int, where: str) -> tuple[int, int, int]:
    """``(start, end, num_latent_t)`` of one entry of the string form; two fields start at ``previous_end``."""
    fields = [field.strip() for field in entry.split(":")]
    if len(fields) not in (2, 3) or not all(INTEGER.fullmatch(field) for field in fields):
        raise ValueError(f"{where}: entry {entry!r} must be {STRING_FORM}")
    numbers = [int(field) for field in fields]
    return (numbers[0], numbers[1], numbers[2]) if len(numbers) == 3 else (previous_end, numbers[0], numbers[1])


def from_list(entries: Sequence[Any], *, default_num_latent_t: int, where: str) -> tuple[Stage, ...]:
    """The list form: each stage starts, unless it says otherwise, where the last stage with an end_step ended."""
    stages: list[Stage] = []
    previous_end = 0
    for index, entry in enumerate(entries):
        stage = from_dict(entry, previous_end=previous_end, default_num_latent_t=default_num_latent_t,
                          where=f"{where}[{index}]")
        stages.append(stage)
        previous_end = previous_end if stage.end_step is None else stage.end_step
    return tuple(stages)


def from_dict(entry: Any, *, previous_end: int, default_num_latent_t: int, where: str) -> Stage:
    """One stage of the list form, its defaults filled in (the module docstring lists them)."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a dict of stage keys ({', '.join(KNOWN_KEYS)}), got {entry!r}")
    check_keys(entry, where)
    name = stage_name(entry, where)
    streaming = boolean(entry, "streaming_training", where, default=name in STREAMING_NAMES)
    start = integer(entry, "start_step", where)
    lengths = (integer(entry, key, where) for key in ("num_latent_t", "streaming_max_length", "max_length"))
    num_latent_t = next((length for length in lengths if length is not None), default_num_latent_t)
    return Stage(name or ("streaming_long" if streaming else "self_forcing"),
                 previous_end if start is None else start, integer(entry, "end_step", where), num_latent_t, streaming,
                 chunk_size=integer(entry, "streaming_chunk_size", where),
                 max_length=integer(entry, "streaming_max_length", where),
                 min_new_frame=integer(entry, "streaming_min_new_frame", where),
                 fixed_overlap=integer(entry, "streaming_fixed_overlap_latents", where))


def check_keys(entry: Mapping[str, Any], where: str) -> None:
    """A ValueError naming the first key of ``entry`` that is not a stage key, the nearest one and all of them."""
    for key in entry:
        if key not in KNOWN_KEYS:
            near = difflib.get_close_matches(str(key), KNOWN_KEYS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{where} has the unknown key {key!r}{hint}; the known keys are {', '.join(KNOWN_KEYS)}")


def stage_name(entry: Mapping[str, Any], where: str) -> str:
    """The stage's name: ``stage``, else ``name``, stripped; "" when neither is given."""
    key = "stage" if entry.get("stage") is not None else "name"
    value = entry.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string, got {value!r}")
    return value.strip()


def integer(entry: Mapping[str, Any], key: str, where: str) -> int | None:
    """``entry[key]`` as an int (an int or a string of one; not a bool), None when absent or None."""
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and INTEGER.fullmatch(value.strip()):
        return int(value)
    raise ValueError(f"{where}.{key} must be an integer, got {value!r}")


def boolean(entry: Mapping[str, Any], key: str, where: str, *, default: bool) -> bool:
    """``entry[key]`` as a bool (a bool or "true"/"false"), ``default`` when absent or None."""
    value = entry.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"{where}.{key} must be true or false, got {value!r}")


def check(stages: Sequence[Stage], *, default_chunk_size: int | None, where: str) -> None:
    """A ValueError naming the field of the first stage that is invalid or out of order."""
    for index, stage in enumerate(stages):
        at = f"{where}[{index}]"
        check_stage(stage, default_chunk_size, at)
        if index:
            check_order(stages[index - 1], stage, at)


def check_stage(stage: Stage, default_chunk_size: int | None, at: str) -> None:
    """A ValueError when one stage's steps or horizon are invalid, or its streaming knobs when it streams."""
    if stage.start_step < 0:
        raise ValueError(f"{at}.start_step must be >= 0, got {stage.start_step}")
    if stage.end_step is not None and stage.end_step <= stage.start_step:
        raise ValueError(f"{at}.end_step = {stage.end_step} must be > start_step = {stage.start_step}")
    if stage.num_latent_t <= 0:
        raise ValueError(f"{at}.num_latent_t must be > 0, got {stage.num_latent_t}")
    if stage.streaming:
        check_streaming(stage, default_chunk_size, at)


def check_streaming(stage: Stage, default_chunk_size: int | None, at: str) -> None:
    """A ValueError when a streaming stage's max length, chunk size, fixed overlap or min new frames are invalid."""
    if max_length(stage) <= 0:
        raise ValueError(f"{at}.streaming_max_length must be > 0, got {max_length(stage)}")
    size = stage.chunk_size or default_chunk_size
    if size is None or size <= 0:
        raise ValueError(f"{at}.streaming_chunk_size must be > 0 (or the method's chunk size set), got "
                         f"{stage.chunk_size} (the method's: {default_chunk_size})")
    if stage.fixed_overlap is not None and not 0 <= stage.fixed_overlap < size:
        raise ValueError(f"{at}.streaming_fixed_overlap_latents = {stage.fixed_overlap} must be in [0, {size}), "
                         f"below the chunk size {size}")
    if stage.min_new_frame is not None and stage.min_new_frame < 1:
        raise ValueError(f"{at}.streaming_min_new_frame must be >= 1, got {stage.min_new_frame}")


def check_order(previous: Stage, stage: Stage, at: str) -> None:
    """A ValueError when ``stage`` starts before ``previous`` ends, or ``previous`` never ends."""
    if previous.end_step is None:
        raise ValueError(f"{at}.start_step: stage {stage.name!r} follows the open-ended stage {previous.name!r} "
                         f"(no end_step), so it would never run")
    if stage.start_step < previous.end_step:
        raise ValueError(f"{at}.start_step = {stage.start_step} overlaps the previous stage {previous.name!r}, which "
                         f"ends at {previous.end_step}; stages must be ordered and must not overlap")
