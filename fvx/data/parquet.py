"""FastVideo's preprocessed parquet, read and written: its schemas, a lazily read dataset of its files, and a writer.

Layout (FastVideo's ``pyarrow_schema_t2v`` / ``_text_only`` / ``_i2v`` / ``_t2va`` / ``_matrixgame2``, and t2v's with
one more tensor for kind "vace"): one row per
sample; each tensor is three columns ``<name>_bytes`` (raw float32 bytes), ``<name>_shape`` (list<int64>) and
``<name>_dtype`` (string). As FastVideo's collation does, the bytes are decoded as float32 whatever ``_dtype`` says; the
dtype only appears in errors.
A sample read here is a dict of float32 arrays keyed as batches name them (``fvx.data.datasets``' module docstring):
``latents``, ``text``, and per kind ``first_frame_latents``, ``image_embeds``, ``audio_latents``, ``keyboard``,
``mouse``. Kind "matrixgame2" (Matrix-Game 2.0's action data) has no text: its actions ``keyboard_cond`` ``[F, K]`` and
``mouse_cond`` ``[F, 2]`` hold one row per video frame of the clip (``F = (T - 1) r + 1`` for ``T`` latent frames and
the VAE's time stride ``r``; longer is kept as stored, the model slices). Kind "vace" (fvx's, for Wan VACE: no
FastVideo schema) adds ``vace_context`` ``[C', T, H, W]``, the control context as ``WanVACEPipeline`` builds it
(``fvx_models.wan_vace``), over the same latent frames as ``vae_latent`` (reference images' frames in front of both).
Kind "i2va" (fvx's, for image-to-video-and-audio models: Kandinsky 6's ``image=`` call with sound) is t2va's columns
with i2v's first frame (``first_frame_latent``, optional ``clip_feature``, the written ``pil_image``).
Kind "framepack" (fvx's, for FramePack: one row per section, ``fvx.data.sections``) holds a section's ``vae_latent``
``[C, window, H, W]``, its clean ``framepack_history`` ``[C, 20, H, W]``, their RoPE positions ``frame_indices``
``[window + 20]``, and the clip's first frame's image-encoder features ``clip_feature`` ``[N, D]``.
Kind "animate" (fvx's, for Wan-Animate: one row per segment, ``fvx_models.wan_animate``) holds ``vae_latent``
``[C, T + 1, H, W]`` (the reference image's latent, then the segment's), the reference's ``clip_feature`` ``[N, D]``,
``reference_latents`` ``[C + 4, T + 1, H, W]`` (the mask, the reference's and the previous segment's normalised
latents), ``pose_latents`` ``[C, T, H, W]`` and ``face_pixels`` ``[3, 4 (T - 1) + 1, S, S]``, the one tensor stored
as uint8 (face crops at the motion encoder's size; read as float32 in [-1, 1]).
"""
from __future__ import annotations

import bisect
import collections
import os
import pathlib
import tempfile
import threading
from typing import Any, Callable, Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

Kind = Literal["t2v", "text_only", "i2v", "t2va", "i2va", "matrixgame2", "vace", "framepack", "animate"]

# Tensor columns per kind: (parquet tensor name, batch key). Metadata columns follow FastVideo's schemas.
_TENSORS: dict[str, tuple[tuple[str, str], ...]] = {
    "t2v": (("vae_latent", "latents"), ("text_embedding", "text")),
    "text_only": (("text_embedding", "text"),),
    "i2v": (("vae_latent", "latents"), ("text_embedding", "text"), ("first_frame_latent", "first_frame_latents")),
    "t2va": (("vae_latent", "latents"), ("audio_latent", "audio_latents"), ("text_embedding", "text")),
    "i2va": (("vae_latent", "latents"), ("audio_latent", "audio_latents"), ("text_embedding", "text"),
             ("first_frame_latent", "first_frame_latents")),
    "matrixgame2": (("vae_latent", "latents"), ("first_frame_latent", "first_frame_latents"),
                    ("keyboard_cond", "keyboard")),
    "vace": (("vae_latent", "latents"), ("text_embedding", "text"), ("vace_context", "vace_context")),
    "framepack": (("vae_latent", "latents"), ("text_embedding", "text"), ("clip_feature", "image_embeds"),
                  ("framepack_history", "framepack_history"), ("frame_indices", "frame_indices")),
    "animate": (("vae_latent", "latents"), ("text_embedding", "text"), ("clip_feature", "image_embeds"),
                ("reference_latents", "reference_latents"), ("pose_latents", "pose_latents"),
                ("face_pixels", "face_pixels")),
}
UINT8_TENSORS = ("face_pixels",)  # stored as uint8 pixels (4x smaller), read as float32 in [-1, 1]
# Tensor columns a kind reads when every file has them and a sample's are not empty (FastVideo's I2V preprocessing
# writes empty bytes for a model without an image encoder).
# Matrix-Game's preprocessing writes empty mouse_cond bytes for keyboard-only action files.
_OPTIONAL_TENSORS: dict[str, tuple[tuple[str, str], ...]] = {
    "i2v": (("clip_feature", "image_embeds"),),
    "i2va": (("clip_feature", "image_embeds"),),
    "matrixgame2": (("clip_feature", "image_embeds"), ("mouse_cond", "mouse")),
}
# Tensor columns written, never read: the I2V validation image FastVideo stores (the first frame, uint8 [3, H, W])
_WRITE_ONLY: dict[str, tuple[tuple[str, str], ...]] = {"i2v": (("pil_image", "pil_image"),),
                                                       "i2va": (("pil_image", "pil_image"),),
                                                       "matrixgame2": (("pil_image", "pil_image"),)}
_RANKS = {"latents": 4, "text": 2, "first_frame_latents": 4, "image_embeds": 2, "audio_latents": 3,
          "pil_image": 3, "keyboard": 2, "mouse": 2, "vace_context": 4,
          "framepack_history": 4, "frame_indices": 1, "reference_latents": 4, "pose_latents": 4,
          "face_pixels": 4}  # stored dims
ACTIONS = (("keyboard_cond", "keyboard"), ("mouse_cond", "mouse"))  # kind matrixgame2's (column, batch key)
# fvx's one column beyond FastVideo's schema: a family's second text stream (HunyuanVideo 1.5's ByT5 glyph text),
# [L2, D2] real tokens, written after FastVideo's columns when the encoders make it and read when data.text_2_len is set
SECOND_TEXT = ("text_embedding_2", "text_2")
# The tensor columns of each kind in the order of FastVideo's schema (dataset/dataloader/schema.py)
_ORDER = {"t2v": ("vae_latent", "text_embedding"), "text_only": ("text_embedding",),
          "i2v": ("vae_latent", "text_embedding", "clip_feature", "first_frame_latent", "pil_image"),
          "t2va": ("vae_latent", "audio_latent", "text_embedding"),
          "i2va": ("vae_latent", "audio_latent", "text_embedding", "clip_feature", "first_frame_latent", "pil_image"),
          "matrixgame2": ("vae_latent", "clip_feature", "first_frame_latent", "mouse_cond", "keyboard_cond",
                          "pil_image"),
          "vace": ("vae_latent", "text_embedding", "vace_context"),
          "framepack": ("vae_latent", "text_embedding", "clip_feature", "framepack_history", "frame_indices"),
          "animate": ("vae_latent", "text_embedding", "clip_feature", "reference_latents", "pose_latents",
                      "face_pixels")}
_METADATA: dict[str, tuple[tuple[str, pa.DataType], ...]] = {
    "t2v": (
        ("file_name", pa.string()), ("caption", pa.string()), ("media_type", pa.string()), ("width", pa.int64()),
        ("height", pa.int64()), ("num_frames", pa.int64()), ("duration_sec", pa.float64()), ("fps", pa.float64()),
    ),
    "text_only": (("caption", pa.string()),),
}
for _kind in ("i2v", "matrixgame2", "vace", "framepack", "animate"):
    _METADATA[_kind] = _METADATA["t2v"]
_METADATA["t2va"] = _METADATA["i2va"] = _METADATA["t2v"] + (("audio_sample_rate", pa.int64()),)
AUDIO_KINDS = ("t2va", "i2va")
"""The kinds whose samples hold the clip's sound: ``audio_latents`` and its ``audio_sample_rate``."""
FIRST_FRAME_KINDS = ("i2v", "i2va", "matrixgame2")
"""The kinds whose samples hold the clip's first frame, ``first_frame_latents`` (and optional ``image_embeds``)."""


def parquet_schema(kind: Kind, second_text: bool = False) -> pa.Schema:
    """The arrow schema FastVideo writes for ``kind``: its ``pyarrow_schema_t2v``, ``_text_only``, ``_i2v``,
    ``_t2va`` or ``_matrixgame2``, column for column; ``second_text`` appends fvx's ``text_embedding_2`` triple
    (:data:`SECOND_TEXT`)."""
    check_kind(kind)
    fields = [pa.field("id", pa.string())]
    for name in _ORDER[kind] + ((SECOND_TEXT[0],) if second_text else ()):
        fields += [
            pa.field(f"{name}_bytes", pa.binary()),
            pa.field(f"{name}_shape", pa.list_(pa.int64())),
            pa.field(f"{name}_dtype", pa.string()),
        ]
    metadata = [pa.field(name, dtype) for name, dtype in _METADATA[kind]]
    if second_text:  # after FastVideo's columns, so its readers see their schema first
        fields, extra = fields[:-3], fields[-3:]
        return pa.schema(fields + metadata + extra)
    return pa.schema(fields + metadata)


def check_kind(kind: Any) -> None:
    if kind not in _TENSORS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, _TENSORS))}, got {kind!r}")



class DataError(ValueError):
    """A sample of the data cannot be used (found while reading it); the message names its file and row."""



# ----------------------------------------------------------------------------------------------------------- reading


class ParquetDataset:
    """FastVideo-format parquet files read lazily: an index of (file, row group) built from parquet metadata alone,
    row groups read on demand (only the needed columns) and kept in a small LRU cache. Thread-safe."""

    def __init__(self, files: Sequence[str | os.PathLike], *, kind: Kind, collate: Callable[..., dict],
                 cache_groups: int = 4, second_text: bool = False, by_shape: bool = False):
        check_kind(kind)
        self.files = [pathlib.Path(f) for f in files]
        self.kind, self._collate, self._cache_groups = kind, collate, cache_groups
        self._groups: list[tuple[int, int, int]] = []  # (file number, row group, its first row within the file)
        self._group_starts: list[int] = []  # the dataset index of each group's first row
        schemas, total = [], 0
        for file_number, path in enumerate(self.files):
            parquet = _parquet_file(path)
            schemas.append(_checked_schema(path, parquet.schema_arrow, kind))
            row_in_file = 0
            for group in range(parquet.metadata.num_row_groups):
                rows = parquet.metadata.row_group(group).num_rows
                if rows:
                    self._groups.append((file_number, group, row_in_file))
                    self._group_starts.append(total)
                row_in_file, total = row_in_file + rows, total + rows
        self._length = total
        self.has_captions = all("caption" in names for names in schemas)
        self.has_sample_rates = kind in AUDIO_KINDS and all("audio_sample_rate" in names for names in schemas)
        self._columns = _columns_to_read(kind, schemas)
        self.second_text, self.by_shape = second_text, by_shape
        if second_text:
            lacking = [str(f) for f, names in zip(self.files, schemas) if f"{SECOND_TEXT[0]}_bytes" not in names]
            if lacking:
                raise ValueError(f"{lacking[0]!r} has no column '{SECOND_TEXT[0]}_bytes' (a second text stream, "
                                 "which data.text_2_len asks for): preprocess it with a family whose encoders make "
                                 "one, or unset data.text_2_len")
            self._columns += [f"{SECOND_TEXT[0]}_{part}" for part in ("bytes", "shape")]
        self._optional = [(name, key) for name, key in _OPTIONAL_TENSORS.get(kind, ())
                          if all(f"{name}_bytes" in names for names in schemas)]
        self._cache: collections.OrderedDict[tuple[int, int], pa.Table] = collections.OrderedDict()
        self._shape_groups: list[list[int]] | None = None
        self._action_widths: dict[int, dict[str, int | None]] = {}  # per file: its first row's action widths
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._length

    def read(self, indices: Sequence[int]) -> dict[str, Any]:
        indices = check_indices(indices, len(self))
        with self._lock:
            return self._collate([self._sample(i) for i in indices], indices)

    def shape_groups(self) -> list[list[int]] | None:
        """With ``by_shape``: the dataset's indices grouped by latent shape, groups in order of their first sample
        (one group when every sample has one shape), read from the ``vae_latent_shape`` column alone, once; else None."""
        if not self.by_shape:
            return None
        if self._shape_groups is None:
            groups: dict[tuple, list[int]] = {}
            if self.kind == "text_only":
                groups[()] = list(range(self._length))
            else:
                index = 0
                for path in self.files:
                    shapes = pq.read_table(path, columns=["vae_latent_shape"]).column(0).to_pylist()
                    for shape in shapes:
                        groups.setdefault(tuple(shape or ()), []).append(index)
                        index += 1
            self._shape_groups = list(groups.values())
        return self._shape_groups

    def where(self, index: int) -> str:
        file_number, _, _, row_in_file = self._locate(index)
        return f"{str(self.files[file_number])!r} row {row_in_file}"

    def _locate(self, index: int) -> tuple[int, int, int, int]:
        """Sample ``index``'s (file number, row group, row within the group, row within the file)."""
        group_number = bisect.bisect_right(self._group_starts, index) - 1
        file_number, group, first_row = self._groups[group_number]
        row = index - self._group_starts[group_number]
        return file_number, group, row, first_row + row

    def _sample(self, index: int) -> dict[str, Any]:
        file_number, group, row, _ = self._locate(index)
        table = self._row_group(file_number, group)
        where = self.where(index)
        sample = {key: _decode(table, name, row, where) for name, key in _TENSORS[self.kind]}
        if "audio_latents" in sample:
            sample["audio_latents"] = _audio(sample["audio_latents"], where)
        if self.has_sample_rates:
            sample["audio_sample_rate"] = int(table.column("audio_sample_rate")[row].as_py() or 0)
        if self.second_text:
            sample[SECOND_TEXT[1]] = _decode(table, SECOND_TEXT[0], row, where)
        for name, key in self._optional:
            if table.column(f"{name}_shape")[row].as_py():  # empty when the preprocessing had no such encoder
                sample[key] = _decode(table, name, row, where)
        if self.kind == "matrixgame2":
            self._check_actions(sample, file_number, where)
        if self.has_captions:
            sample["caption"] = table.column("caption")[row].as_py() or ""
        return {**sample, "where": where}

    def _check_actions(self, sample: dict[str, Any], file_number: int, where: str) -> None:
        """A DataError naming the sample and column unless its actions are ``[F, width]`` with at least one row per
        latent frame and the width of its file's first row (the stride-exact length is the collation's check)."""
        frames = sample["latents"].shape[1] if sample["latents"].ndim == 4 else 0
        widths = self._first_widths(file_number)
        for column, key in ACTIONS:
            if key not in sample:
                if widths.get(column) is not None:
                    raise DataError(f"{where}: {column} is empty, but the file's first row has one")
                continue
            action = sample[key]
            if action.ndim != 2:
                raise DataError(f"{where}: {column} must be [F, K] (one row per video frame), got shape "
                                f"{list(action.shape)}")
            if action.shape[0] < frames:
                raise DataError(f"{where}: {column} has {action.shape[0]} rows (video frames), fewer than the "
                                f"{frames} latent frames of vae_latent {list(sample['latents'].shape)}")
            if widths.get(column) is not None and action.shape[1] != widths[column]:
                raise DataError(f"{where}: {column} is {list(action.shape)}, {action.shape[1]} wide, but the "
                                f"file's first row's is {widths[column]} wide")

    def _first_widths(self, file_number: int) -> dict[str, int | None]:
        """The widths of the actions of file ``file_number``'s first row (None: it has none), read once."""
        if file_number not in self._action_widths:
            columns = [f"{column}_shape" for column, _ in ACTIONS]
            first = _parquet_file(self.files[file_number]).read_row_group(0, columns=columns).slice(0, 1).to_pylist()
            shapes = first[0] if first else {}
            self._action_widths[file_number] = {
                column: (shape[-1] if (shape := shapes.get(f"{column}_shape")) else None) for column, _ in ACTIONS}
        return self._action_widths[file_number]

    def _row_group(self, file_number: int, group: int) -> pa.Table:
        """Row group ``group`` of file ``file_number`` (only the needed columns), through the LRU cache."""
        cache_key = (file_number, group)
        if cache_key in self._cache:
            self._cache.move_to_end(cache_key)
            return self._cache[cache_key]
        try:
            table = _parquet_file(self.files[file_number]).read_row_group(group, columns=self._columns)
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"{str(self.files[file_number])!r} row group {group} cannot be read: {error}") from None
        self._cache[cache_key] = table
        while len(self._cache) > self._cache_groups:
            self._cache.popitem(last=False)
        return table


def find_parquet_files(path: str | os.PathLike) -> list[pathlib.Path]:
    """``path`` itself if it is a file, else every ``*.parquet`` below the folder in FastVideo's order.

    FastVideo (``get_parquet_files_and_length`` in ``fastvideo/dataset/parquet_dataset_map_style.py``) walks the
    folder with ``os.walk`` (symlinked folders not followed), takes every name ending in ``.parquet``, and sorts the
    files by their ``os.path.realpath`` *strings*, not folder by folder: ``a-b/x.parquet < a.parquet < a/y.parquet``
    ('-' < '.' < '/'). Sample indices count rows in that order, so fvx sorts by the same key.
    """
    root = pathlib.Path(path)
    if root.is_file():
        return [root]
    if not root.exists():
        raise ValueError(f"data path {str(root)!r} does not exist")
    found = [pathlib.Path(folder, name) for folder, _, names in os.walk(root) for name in names
             if name.endswith(".parquet")]
    files = sorted(found, key=lambda file: os.path.realpath(file))
    if not files:
        raise ValueError(f"data path {str(root)!r} holds no *.parquet files")
    return files


def _parquet_file(path: pathlib.Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{str(path)!r} is not a readable parquet file: {error}") from None


def _checked_schema(path: pathlib.Path, schema: pa.Schema, kind: Kind) -> set[str]:
    """The column names of ``schema`` after checking it has the tensor columns ``kind`` needs, with usable types."""
    names = set(schema.names)
    for name, _ in _TENSORS[kind]:
        for column, usable, expected in ((f"{name}_bytes", _is_binary, "binary"),
                                         (f"{name}_shape", _is_int_list, "list<int64>")):
            if column not in names:
                hint = ""
                if name == "vae_latent" and "text_embedding_bytes" in names:
                    hint = "; the file holds text-only data (no latents), so use kind='text_only'"
                if name == "audio_latent":  # a DataError: the data, not the config, lacks the sound
                    raise DataError(f"{str(path)!r} has no column {column!r}: kind={kind!r} needs audio latents, and "
                                    "this file has none (video-only data? use kind='t2v')")
                raise ValueError(f"{str(path)!r} has no column {column!r}, which kind={kind!r} needs{hint}")
            if not usable(schema.field(column).type):
                raise ValueError(f"{str(path)!r}: column {column!r} is {schema.field(column).type}, "
                                 f"expected {expected}")
    return names


def _columns_to_read(kind: Kind, schemas: list[set[str]]) -> list[str]:
    """Bytes and shape of each tensor; its dtype (for error messages) and the caption where every file has them."""
    columns = [f"{name}_{part}" for name, _ in _TENSORS[kind] for part in ("bytes", "shape")]
    optional = [f"{name}_dtype" for name, _ in _TENSORS[kind]] + ["caption"]
    optional += ["audio_sample_rate"] if kind in AUDIO_KINDS else []
    optional += [f"{name}_{part}" for name, _ in _OPTIONAL_TENSORS.get(kind, ())
                 for part in ("bytes", "shape", "dtype")]
    return columns + [c for c in optional if all(c in names for names in schemas)]


def _is_binary(dtype: pa.DataType) -> bool:
    return pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype)


def _is_int_list(dtype: pa.DataType) -> bool:
    return (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) and pa.types.is_integer(dtype.value_type)


def _decode(table: pa.Table, name: str, row: int, where: str) -> np.ndarray:
    """Tensor ``name`` of ``row`` as a read-only float32 array of its stored shape (a view of the arrow buffer; a
    :data:`UINT8_TENSORS` one as float32 in [-1, 1])."""
    data, shape = table.column(name + "_bytes")[row], table.column(name + "_shape")[row].as_py()
    if not data.is_valid or shape is None:
        raise DataError(f"{where}: {name}_bytes or {name}_shape is null")
    buffer = data.as_buffer()
    count = int(np.prod(shape, dtype=np.int64))
    width, dtype = (1, "uint8") if name in UINT8_TENSORS else (4, "float32")
    if buffer.size == 0 and count != 0:
        raise DataError(f"{where}: {name}_bytes is empty (shape {shape}): the sample has no {name}")
    if buffer.size != width * count or any(d < 0 for d in shape):
        stored = table.column(name + "_dtype")[row].as_py() if name + "_dtype" in table.column_names else None
        raise DataError(f"{where}: {name}_bytes holds {buffer.size} bytes but {name}_shape {shape} needs "
                         f"{width * count} ({dtype}" + (f"; stored dtype {stored!r}" if stored else "") + ")")
    if width == 1:
        return np.frombuffer(buffer, dtype=np.uint8).reshape(shape).astype(np.float32) / 127.5 - 1.0
    return np.frombuffer(buffer, dtype=np.float32).reshape(shape)


def _audio(latents: np.ndarray, where: str) -> np.ndarray:
    """Stored audio latents as ``[C, F, A]``: FastVideo's t2va preprocessing stores ``[2, 32, A]``; a leading
    batch dim of 1 (``[1, 2, 32, A]``) is dropped."""
    if latents.ndim == 4 and latents.shape[0] == 1:
        latents = latents[0]
    if latents.ndim != 3 or latents.shape[-1] == 0:
        raise DataError(f"{where}: audio_latent must be [C, F, A] with A >= 1 (e.g. [2, 32, A]), "
                         f"got shape {list(latents.shape)}")
    return latents


def check_indices(indices: Sequence[int], length: int) -> list[int]:
    indices = [int(i) for i in indices]
    bad = [i for i in indices if not 0 <= i < length]
    if bad:
        raise IndexError(f"dataset index {bad[0]} out of range for a dataset of {length} samples")
    return indices


# ------------------------------------------------------------------------------------------------------------ writing


def write_parquet(path: str | os.PathLike, samples: Sequence[dict[str, Any]], *, kind: Kind = "t2v",
                  rows_per_group: int = 32) -> pathlib.Path:
    """Write ``samples`` as one FastVideo-format parquet file at ``path`` (atomically: temp file, then rename).

    Each sample: ``latents`` [C, T, H, W] (not text_only) and ``text`` [L, D] tensors, optional ``id`` and metadata
    (``caption``, and except for text_only ``file_name, media_type, width, height, num_frames, duration_sec, fps``);
    i2v adds ``first_frame_latents`` [C, T, H, W] (and optional ``image_embeds`` [N, D] and ``pil_image``, uint8
    [3, H, W]); t2va adds ``audio_latents`` [C, F, A] (e.g. [2, 32, A]) and ``audio_sample_rate`` (a positive int,
    Hz); i2va adds both; any kind may add ``text_2`` [L2, D2] (:data:`SECOND_TEXT`). Tensors are stored as float32
    (``pil_image`` and animate's ``face_pixels`` as uint8).
    Everything is checked before anything is written.
    """
    check_kind(kind)
    if isinstance(rows_per_group, bool) or not isinstance(rows_per_group, int) or rows_per_group <= 0:
        raise ValueError(f"rows_per_group must be a positive int, got {rows_per_group!r}")
    path = pathlib.Path(path)
    second = [SECOND_TEXT[1] in s for s in samples if isinstance(s, dict)]
    if any(second) and not all(second):
        raise ValueError(f"sample {second.index(False)} has no {SECOND_TEXT[1]!r} but sample {second.index(True)} has: "
                         "every sample of a file has the second text stream or none does")
    table = pa.Table.from_pylist([_record(s, i, kind) for i, s in enumerate(samples)],
                                 schema=parquet_schema(kind, second_text=any(second)))
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        pq.write_table(table, temp, row_group_size=rows_per_group, compression="zstd")
        os.replace(temp, path)
    except BaseException:
        pathlib.Path(temp).unlink(missing_ok=True)
        raise
    return path


def _record(sample: dict[str, Any], number: int, kind: Kind) -> dict[str, Any]:
    """One row of ``parquet_schema(kind)`` for sample ``number``; ValueError naming the sample on bad input."""
    if not isinstance(sample, dict):
        raise TypeError(f"sample {number} must be a dict, got {type(sample).__name__}")
    tensors = {key: _RANKS[key] for _, key in _TENSORS[kind]}
    optional = {key: _RANKS[key] for _, key in _OPTIONAL_TENSORS.get(kind, ()) + _WRITE_ONLY.get(kind, ())}
    allowed = set(tensors) | set(optional) | {"id", SECOND_TEXT[1]} | {name for name, _ in _METADATA[kind]}
    if kind == "text_only" and "latents" in sample:
        raise ValueError(f"sample {number} has latents, but kind='text_only' stores none; use kind='t2v'")
    if kind in AUDIO_KINDS:
        rate = sample.get("audio_sample_rate")
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise ValueError(f"sample {number}: audio_sample_rate must be a positive int (Hz) for kind={kind!r}, "
                             f"got {rate!r}")
    unknown = sorted(set(sample) - allowed)
    if unknown:
        raise ValueError(f"sample {number} has unknown field(s) {unknown}; kind={kind!r} takes {sorted(allowed)}")
    record = {"id": str(sample.get("id", f"sample_{number:06d}"))}
    for (column, key), ndim in zip(_TENSORS[kind], tensors.values()):
        record.update(_tensor_columns(column, _as_array(sample, key, ndim, number)))
    if SECOND_TEXT[1] in sample:
        record.update(_tensor_columns(SECOND_TEXT[0], _as_array(sample, SECOND_TEXT[1], 2, number)))
    for column, key in _OPTIONAL_TENSORS.get(kind, ()) + _WRITE_ONLY.get(kind, ()):
        record.update(_tensor_columns(column, _as_array(sample, key, optional[key], number)) if key in sample
                      else {f"{column}_bytes": b"", f"{column}_shape": [], f"{column}_dtype": ""})
    metadata = {"caption": str(sample.get("caption", ""))}
    if kind != "text_only":
        latents_shape = record["vae_latent_shape"]
        media = "video_with_audio" if kind in AUDIO_KINDS else "video"  # what FastVideo's T2VA preprocessing writes
        metadata.update(file_name=str(sample.get("file_name", record["id"])),
                        media_type=str(sample.get("media_type", media)), width=int(sample.get("width", 0)),
                        height=int(sample.get("height", 0)),
                        num_frames=int(sample.get("num_frames", latents_shape[1])),
                        duration_sec=float(sample.get("duration_sec", 0.0)), fps=float(sample.get("fps", 0.0)))
    if kind in AUDIO_KINDS:
        metadata["audio_sample_rate"] = int(sample["audio_sample_rate"])
    return {**record, **metadata}


def _as_array(sample: dict, key: str, ndim: int, number: int) -> np.ndarray:
    if key not in sample:
        raise ValueError(f"sample {number} has no {key!r} tensor")
    value = sample[key]
    if key in ("pil_image", *UINT8_TENSORS):
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != ndim:
            shape = "[3, H, W]" if key == "pil_image" else "[3, F, S, S]"
            raise TypeError(f"sample {number}: {key!r} must be a uint8 tensor {shape}")
        return value.detach().cpu().contiguous().numpy()
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"sample {number}: {key!r} must be a floating-point torch tensor, got {type(value).__name__}"
                        + (f" of {value.dtype}" if isinstance(value, torch.Tensor) else ""))
    if value.dim() != ndim:
        raise ValueError(f"sample {number}: {key!r} must have {ndim} dims, got shape {list(value.shape)}")
    return value.detach().to("cpu", torch.float32).contiguous().numpy()


def _tensor_columns(name: str, array: np.ndarray) -> dict[str, Any]:
    return {f"{name}_bytes": array.tobytes(), f"{name}_shape": list(array.shape), f"{name}_dtype": str(array.dtype)}


