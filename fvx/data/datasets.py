"""Training data: FastVideo's preprocessed parquet or a synthetic set, batches as a pure function of (key, step).

A dataset maps indices to a collated batch (``read``). ``batch_at(dataset, key, step, ...)`` picks the step's global
batch from a per-epoch permutation drawn from ``fold_in(key, epoch)`` (drop-last) and returns this rank's contiguous
slice, plus the global sample index of each row, which methods fold into the step key for per-sample draws. Nothing
is stateful, so resuming at step ``s`` needs only ``s``. :class:`Prefetcher` computes upcoming batches in a background
thread so loading overlaps the step.

Parquet layout (FastVideo's ``pyarrow_schema_t2v`` / ``_text_only`` / ``_i2v`` / ``_t2va``): one row per sample;
each tensor is three columns ``<name>_bytes`` (raw float32 bytes), ``<name>_shape`` (list<int64>) and ``<name>_dtype``
(string). As FastVideo's collation does, the bytes are decoded as float32 whatever ``_dtype`` says; the dtype only
appears in errors.

Batch dict (torch tensors except ``caption``)::

    latents      [B, C, T, H, W] float32   (kinds "t2v" and "i2v"; from vae_latent)
    first_frame_latents [B, C, T, H, W]    (kind "i2v": first_frame_latent, the VAE latents of the first frame
                                            followed by zero frames, normalised: FastVideo stores them so)
    image_embeds [B, N, D] float32         (kind "i2v" when the data has them: clip_feature, the CLIP image
                                            encoder's hidden states; FastVideo writes empty bytes for a model without)
    audio_latents [B, 2, 32, A] float32    (kind "t2va": audio_latent, the stereo audio VAE's latents [C, F, A] as
                                            FastVideo's t2va preprocessing stores them; a stored leading 1 is
                                            dropped; every sample of a batch must have the same length A)
    audio_sample_rate [B] int64            (kind "t2va", when every file has the column: the waveform's rate, Hz)
    text         [B, text_len, D] float32  (text_embedding, zero-padded or cropped; zeroed for CFG-dropped samples)
    text_mask    [B, text_len] float32     (1 = real token; not changed by CFG dropout)
    cfg_dropped  [B] bool                  (whether CFG dropout blanked the sample's text)
    index        [B] int64                 (dataset indices)
    caption      list[str]                 (when every file has a caption column)
    sample_index [B] int64                 (added by batch_at: global position in the run's sample stream)
"""
from __future__ import annotations

import bisect
import collections
import functools
import os
import pathlib
import queue
import tempfile
import threading
from typing import Annotated, Any, Callable, Iterable, Iterator, Literal, Mapping, Protocol, Sequence

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fvx.config import Config, validate
from fvx.core import random, tree
from fvx.data.toy_world import WorldConfig, WorldDataset, first_frame_only

Kind = Literal["t2v", "text_only", "i2v", "t2va"]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]

# Tensor columns per kind: (parquet tensor name, batch key). Metadata columns follow FastVideo's schemas.
_TENSORS: dict[str, tuple[tuple[str, str], ...]] = {
    "t2v": (("vae_latent", "latents"), ("text_embedding", "text")),
    "text_only": (("text_embedding", "text"),),
    "i2v": (("vae_latent", "latents"), ("text_embedding", "text"), ("first_frame_latent", "first_frame_latents")),
    "t2va": (("vae_latent", "latents"), ("audio_latent", "audio_latents"), ("text_embedding", "text")),
}
# Tensor columns a kind reads when every file has them and a sample's are not empty (FastVideo's I2V preprocessing
# writes empty bytes for a model without an image encoder).
_OPTIONAL_TENSORS: dict[str, tuple[tuple[str, str], ...]] = {"i2v": (("clip_feature", "image_embeds"),)}
_RANKS = {"latents": 4, "text": 2, "first_frame_latents": 4, "image_embeds": 2, "audio_latents": 3}  # stored dims
_METADATA: dict[str, tuple[tuple[str, pa.DataType], ...]] = {
    "t2v": (
        ("file_name", pa.string()), ("caption", pa.string()), ("media_type", pa.string()), ("width", pa.int64()),
        ("height", pa.int64()), ("num_frames", pa.int64()), ("duration_sec", pa.float64()), ("fps", pa.float64()),
    ),
    "text_only": (("caption", pa.string()),),
}
_METADATA["i2v"] = _METADATA["t2v"]
_METADATA["t2va"] = _METADATA["t2v"] + (("audio_sample_rate", pa.int64()),)


def parquet_schema(kind: Kind) -> pa.Schema:
    """The arrow schema FastVideo writes for ``kind`` (its ``pyarrow_schema_t2v``, ``_text_only``, ``_i2v`` or
    ``_t2va``, less the I2V validation image ``pil_image``, which fvx does not read)."""
    _check_kind(kind)
    fields = [pa.field("id", pa.string())]
    for name, _ in _TENSORS[kind] + _OPTIONAL_TENSORS.get(kind, ()):
        fields += [
            pa.field(f"{name}_bytes", pa.binary()),
            pa.field(f"{name}_shape", pa.list_(pa.int64())),
            pa.field(f"{name}_dtype", pa.string()),
        ]
    fields += [pa.field(name, dtype) for name, dtype in _METADATA[kind]]
    return pa.schema(fields)


def _check_kind(kind: Any) -> None:
    if kind not in _TENSORS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, _TENSORS))}, got {kind!r}")


# ------------------------------------------------------------------------------------------------------------ config


class DataError(ValueError):
    """A sample of the data cannot be used (found while reading it); the message names its file and row."""


class SyntheticConfig(Config):
    """A synthetic dataset: ``num_samples`` standard-normal latents [C, T, H, W] and texts [text_len, text_dim]; for
    kind "i2v" the first-frame latents are the latents' first frame followed by zeros (as stored: the condition of a
    model whose latents have no statistics to normalise by), and ``image_embeds`` (tokens, width) adds normal image
    embeddings; kind "t2va" needs ``audio_shape`` (C, F, A), e.g. (2, 32, 8): normal audio latents."""

    num_samples: PositiveInt = 64
    latent_shape: tuple[PositiveInt, PositiveInt, PositiveInt, PositiveInt] = (16, 1, 8, 8)
    text_len: PositiveInt = 8
    text_dim: PositiveInt = 32
    image_embeds: tuple[PositiveInt, PositiveInt] | None = None
    audio_shape: tuple[PositiveInt, PositiveInt, PositiveInt] | None = None


class DataConfig(Config):
    """Where the data comes from and how it is batched.

    ``path``: a parquet file, or a folder searched recursively for ``*.parquet`` (in FastVideo's order: sorted by
    real-path string); None = the toy video world ``world`` when set (``fvx.data.toy_world``: shapes moving as the
    prompt says, latents a codec decodes exactly), else ``synthetic`` (Gaussian noise latents). ``batch_size`` is global
    (summed over ranks). ``text_len`` is the length text embeddings are padded or cropped to. ``cfg_rate``: the fraction
    of samples whose text embedding is zeroed (fixed per dataset index, as FastVideo). ``num_latent_t``: keep the first
    ``num_latent_t`` latent frames of every sample (FastVideo's ``data.num_latent_t``; None keeps them all; audio
    latents are kept whole). ``kind``: what a sample holds (the module docstring): "t2v" video latents and text,
    "text_only", "i2v" adds the first frame, "t2va" adds audio latents (parquet, ``synthetic.audio_shape`` or the
    world's tones).
    ``prefetch``: batches computed ahead in a background thread (0 = synchronous).
    """

    path: str | None = None
    kind: Kind = "t2v"
    batch_size: PositiveInt = 1
    text_len: PositiveInt = 512
    cfg_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    num_latent_t: PositiveInt | None = None
    prefetch: Annotated[int, msgspec.Meta(ge=0)] = 2
    synthetic: SyntheticConfig = SyntheticConfig()
    world: WorldConfig | None = None


# ----------------------------------------------------------------------------------------------------------- datasets


class Dataset(Protocol):
    """``len(dataset)`` samples; ``read(indices)`` returns their collated batch (see the module docstring);
    ``where(index)`` names sample ``index`` for a person (a parquet file and row)."""

    def __len__(self) -> int: ...

    def read(self, indices: Sequence[int]) -> dict[str, Any]: ...

    def where(self, index: int) -> str: ...


def open_dataset(config: DataConfig, key: torch.Tensor) -> Dataset:
    """The dataset ``config`` describes: FastVideo parquet at ``config.path``, else synthetic samples from ``key``.

    ``key`` also fixes which samples CFG dropout blanks. Raises ConfigError for an invalid config and ValueError for
    a path without readable FastVideo-format parquet.
    """
    config = validate(config)
    samples_key, dropout_key = random.split(key, 2)
    collate = functools.partial(_collate, text_len=config.text_len, cfg_rate=config.cfg_rate, dropout_key=dropout_key,
                                num_latent_t=config.num_latent_t)
    if config.path is None and config.world is not None:
        return WorldDataset(config.world, samples_key, kind=config.kind, collate=collate)
    if config.path is None:
        return SyntheticDataset(config.synthetic, samples_key, kind=config.kind, collate=collate)
    return ParquetDataset(find_parquet_files(config.path), kind=config.kind, collate=collate)



class SyntheticDataset:
    """Sample i is a function of (key, i) alone: latents and text are normal draws from split(fold_in(key, i))."""

    def __init__(self, config: SyntheticConfig, key: torch.Tensor, *, kind: Kind, collate: Callable[..., dict]):
        _check_kind(kind)
        if kind == "t2va" and config.audio_shape is None:
            raise ValueError("data.synthetic.audio_shape must be set, e.g. [2, 32, 8], for data.kind='t2va' "
                             "(synthetic audio latents [C, F, A])")
        self.config, self.key, self.kind, self._collate = config, key, kind, collate

    def __len__(self) -> int:
        return self.config.num_samples

    def sample(self, index: int) -> dict[str, Any]:
        """Sample ``index`` uncollated: latents [C, T, H, W] (not text_only), text [text_len, text_dim], the I2V
        tensors (i2v) and audio latents ``audio_shape`` (t2va), float32."""
        latents_key, text_key = random.split(random.fold_in(self.key, index), 2)
        sample = {"text": random.normal(text_key, (self.config.text_len, self.config.text_dim)).numpy(),
                  "caption": f"synthetic sample {index}", "where": self.where(index)}
        if self.kind != "text_only":
            sample["latents"] = random.normal(latents_key, self.config.latent_shape).numpy()
        if self.kind == "i2v":
            sample["first_frame_latents"] = first_frame_only(sample["latents"])
            if self.config.image_embeds is not None:
                image_key = random.fold_in(latents_key, 1)
                sample["image_embeds"] = random.normal(image_key, self.config.image_embeds).numpy()
        if self.kind == "t2va":
            sample["audio_latents"] = random.normal(random.fold_in(latents_key, 2), self.config.audio_shape).numpy()
        return sample

    def read(self, indices: Sequence[int]) -> dict[str, Any]:
        indices = _check_indices(indices, len(self))
        return self._collate([self.sample(i) for i in indices], indices)

    def where(self, index: int) -> str:
        return f"synthetic sample {index}"


class ParquetDataset:
    """FastVideo-format parquet files read lazily: an index of (file, row group) built from parquet metadata alone,
    row groups read on demand (only the needed columns) and kept in a small LRU cache. Thread-safe."""

    def __init__(self, files: Sequence[str | os.PathLike], *, kind: Kind, collate: Callable[..., dict],
                 cache_groups: int = 4):
        _check_kind(kind)
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
        self.has_sample_rates = kind == "t2va" and all("audio_sample_rate" in names for names in schemas)
        self._columns = _columns_to_read(kind, schemas)
        self._optional = [(name, key) for name, key in _OPTIONAL_TENSORS.get(kind, ())
                          if all(f"{name}_bytes" in names for names in schemas)]
        self._cache: collections.OrderedDict[tuple[int, int], pa.Table] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._length

    def read(self, indices: Sequence[int]) -> dict[str, Any]:
        indices = _check_indices(indices, len(self))
        with self._lock:
            return self._collate([self._sample(i) for i in indices], indices)

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
        for name, key in self._optional:
            if table.column(f"{name}_shape")[row].as_py():  # empty when the preprocessing had no such encoder
                sample[key] = _decode(table, name, row, where)
        if self.has_captions:
            sample["caption"] = table.column("caption")[row].as_py() or ""
        return {**sample, "where": where}

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
                    raise DataError(f"{str(path)!r} has no column {column!r}: kind='t2va' needs audio latents, and "
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
    optional += ["audio_sample_rate"] if kind == "t2va" else []
    optional += [f"{name}_{part}" for name, _ in _OPTIONAL_TENSORS.get(kind, ())
                 for part in ("bytes", "shape", "dtype")]
    return columns + [c for c in optional if all(c in names for names in schemas)]


def _is_binary(dtype: pa.DataType) -> bool:
    return pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype)


def _is_int_list(dtype: pa.DataType) -> bool:
    return (pa.types.is_list(dtype) or pa.types.is_large_list(dtype)) and pa.types.is_integer(dtype.value_type)


def _decode(table: pa.Table, name: str, row: int, where: str) -> np.ndarray:
    """Tensor ``name`` of ``row`` as a read-only float32 array of its stored shape (a view of the arrow buffer)."""
    data, shape = table.column(name + "_bytes")[row], table.column(name + "_shape")[row].as_py()
    if not data.is_valid or shape is None:
        raise DataError(f"{where}: {name}_bytes or {name}_shape is null")
    buffer = data.as_buffer()
    count = int(np.prod(shape, dtype=np.int64))
    if buffer.size == 0 and count != 0:
        raise DataError(f"{where}: {name}_bytes is empty (shape {shape}): the sample has no {name}")
    if buffer.size != 4 * count or any(d < 0 for d in shape):
        stored = table.column(name + "_dtype")[row].as_py() if name + "_dtype" in table.column_names else None
        raise DataError(f"{where}: {name}_bytes holds {buffer.size} bytes but {name}_shape {shape} needs "
                         f"{4 * count} (float32" + (f"; stored dtype {stored!r}" if stored else "") + ")")
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


def _check_indices(indices: Sequence[int], length: int) -> list[int]:
    indices = [int(i) for i in indices]
    bad = [i for i in indices if not 0 <= i < length]
    if bad:
        raise IndexError(f"dataset index {bad[0]} out of range for a dataset of {length} samples")
    return indices


# ---------------------------------------------------------------------------------------------------------- collation


def _collate(samples: list[dict], indices: list[int], *, text_len: int, cfg_rate: float,
             dropout_key: torch.Tensor, num_latent_t: int | None = None) -> dict[str, Any]:
    """Stack samples (dicts of float32 arrays: latents [C,T,H,W], text [L,D]) into a batch; pad/crop text to
    ``text_len`` with its mask; zero the text of CFG-dropped samples (the mask is kept, as FastVideo)."""
    batch: dict[str, Any] = {}
    for key in ("latents", "first_frame_latents"):
        if samples and key in samples[0]:
            _check_same(samples, key, lambda a: a.shape, "shape")
            latents = np.stack([s[key] for s in samples])
            if num_latent_t is not None:
                if latents.shape[2] < num_latent_t:
                    raise DataError(f"{samples[0]['where']}: {key} of {latents.shape[2]} frames "
                                     f"({list(latents.shape[1:])}) are fewer than data.num_latent_t={num_latent_t}")
                latents = latents[:, :, :num_latent_t]
            batch[key] = torch.from_numpy(np.ascontiguousarray(latents))
    if samples and "audio_latents" in samples[0]:
        first = samples[0]
        for sample in samples[1:]:
            if sample["audio_latents"].shape != first["audio_latents"].shape:
                what = "length" if sample["audio_latents"].shape[:-1] == first["audio_latents"].shape[:-1] else "shape"
                raise DataError(f"samples in one batch differ in audio latent {what}: {first['where']} has "
                                 f"{list(first['audio_latents'].shape)}, {sample['where']} has "
                                 f"{list(sample['audio_latents'].shape)}")
        batch["audio_latents"] = torch.from_numpy(np.stack([s["audio_latents"] for s in samples]))
    if samples and "audio_sample_rate" in samples[0]:
        batch["audio_sample_rate"] = torch.tensor([s["audio_sample_rate"] for s in samples], dtype=torch.int64)
    having = [s for s in samples if "image_embeds" in s]
    if having and len(having) != len(samples):
        lacking = next(s for s in samples if "image_embeds" not in s)
        raise DataError(f"{lacking['where']} has no clip_feature (image embeddings) but {having[0]['where']} has: "
                         "the data mixes preprocessings")
    if having:
        _check_same(samples, "image_embeds", lambda a: a.shape, "shape")
        batch["image_embeds"] = torch.from_numpy(np.stack([s["image_embeds"] for s in samples]))
    _check_same(samples, "text", lambda a: a.shape[1:], "embedding width")
    for sample in samples:
        if sample["text"].ndim != 2:
            raise DataError(f"{sample['where']}: text embedding must be [L, D], "
                             f"got shape {list(sample['text'].shape)}")
    width = samples[0]["text"].shape[1] if samples else 0
    text = np.zeros((len(samples), text_len, width), dtype=np.float32)
    mask = np.zeros((len(samples), text_len), dtype=np.float32)
    dropped = cfg_dropped(dropout_key, indices, cfg_rate)
    for row, (sample, blank) in enumerate(zip(samples, dropped)):
        length = min(sample["text"].shape[0], text_len)
        mask[row, :length] = 1.0
        if not blank:
            text[row, :length] = sample["text"][:length]
    batch.update(text=torch.from_numpy(text), text_mask=torch.from_numpy(mask),
                 cfg_dropped=torch.tensor(dropped, dtype=torch.bool), index=torch.tensor(indices, dtype=torch.int64))
    if samples and "caption" in samples[0]:
        batch["caption"] = [s["caption"] for s in samples]
    return batch


def _check_same(samples: list[dict], key: str, part: Callable[[np.ndarray], tuple], what: str) -> None:
    first = samples[0] if samples else None
    for sample in samples[1:]:
        if part(sample[key]) != part(first[key]):
            raise DataError(f"samples in one batch differ in {key} {what}: {first['where']} has "
                             f"{list(first[key].shape)}, {sample['where']} has {list(sample[key].shape)}")


def suspects(batch: Mapping[str, Any], dataset: Any) -> tuple[list[str], bool]:
    """The samples of ``batch`` (its dataset ``index``) named by ``dataset.where``: those whose tensors hold a NaN or
    Inf, and True; or every one of them, and False, when the batch's data is finite."""
    index = batch.get("index")
    if not isinstance(index, torch.Tensor) or index.dim() != 1:
        return [], False
    rows = len(index)
    bad = torch.zeros(rows, dtype=torch.bool)
    for leaf in tree.tensor_leaves(dict(batch)):
        if leaf.is_floating_point() and leaf.dim() >= 1 and leaf.shape[0] == rows:
            bad |= ~torch.isfinite(leaf.detach().reshape(rows, -1).float()).all(dim=1)
    where = getattr(dataset, "where", lambda i: f"dataset sample {i}")
    chosen = bad if bool(bad.any()) else torch.ones(rows, dtype=torch.bool)
    return [where(int(i)) for i in index[chosen]], bool(bad.any())


def cfg_dropped(dropout_key: torch.Tensor, indices: Sequence[int], cfg_rate: float) -> list[bool]:
    """Whether each dataset index has its text dropped: ``uniform(fold_in(dropout_key, i)) < cfg_rate``."""
    if cfg_rate <= 0.0:
        return [False] * len(indices)
    return [bool(random.uniform(random.fold_in(dropout_key, i), ()) < cfg_rate) for i in indices]


# ------------------------------------------------------------------------------------------------------------ writing


def write_parquet(path: str | os.PathLike, samples: Sequence[dict[str, Any]], *, kind: Kind = "t2v",
                  rows_per_group: int = 32) -> pathlib.Path:
    """Write ``samples`` as one FastVideo-format parquet file at ``path`` (atomically: temp file, then rename).

    Each sample: ``latents`` [C, T, H, W] (not text_only) and ``text`` [L, D] tensors, optional ``id`` and metadata
    (``caption``, and except for text_only ``file_name, media_type, width, height, num_frames, duration_sec, fps``);
    i2v adds ``first_frame_latents`` [C, T, H, W] (and optional ``image_embeds`` [N, D]); t2va adds ``audio_latents``
    [C, F, A] (e.g. [2, 32, A]) and ``audio_sample_rate`` (a positive int, Hz). Tensors are stored as float32.
    Everything is checked before anything is written.
    """
    _check_kind(kind)
    if isinstance(rows_per_group, bool) or not isinstance(rows_per_group, int) or rows_per_group <= 0:
        raise ValueError(f"rows_per_group must be a positive int, got {rows_per_group!r}")
    path = pathlib.Path(path)
    table = pa.Table.from_pylist([_record(s, i, kind) for i, s in enumerate(samples)], schema=parquet_schema(kind))
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        pq.write_table(table, temp, row_group_size=rows_per_group)
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
    optional = {key: _RANKS[key] for _, key in _OPTIONAL_TENSORS.get(kind, ())}
    allowed = set(tensors) | set(optional) | {"id"} | {name for name, _ in _METADATA[kind]}
    if kind == "text_only" and "latents" in sample:
        raise ValueError(f"sample {number} has latents, but kind='text_only' stores none; use kind='t2v'")
    if kind == "t2va":
        rate = sample.get("audio_sample_rate")
        if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
            raise ValueError(f"sample {number}: audio_sample_rate must be a positive int (Hz) for kind='t2va', "
                             f"got {rate!r}")
    unknown = sorted(set(sample) - allowed)
    if unknown:
        raise ValueError(f"sample {number} has unknown field(s) {unknown}; kind={kind!r} takes {sorted(allowed)}")
    record = {"id": str(sample.get("id", f"sample_{number:06d}"))}
    for (column, key), ndim in zip(_TENSORS[kind], tensors.values()):
        record.update(_tensor_columns(column, _as_array(sample, key, ndim, number)))
    for column, key in _OPTIONAL_TENSORS.get(kind, ()):
        record.update(_tensor_columns(column, _as_array(sample, key, optional[key], number)) if key in sample
                      else {f"{column}_bytes": b"", f"{column}_shape": [], f"{column}_dtype": ""})
    metadata = {"caption": str(sample.get("caption", ""))}
    if kind != "text_only":
        latents_shape = record["vae_latent_shape"]
        media = "video_with_audio" if kind == "t2va" else "video"  # what FastVideo's T2VA preprocessing writes
        metadata.update(file_name=str(sample.get("file_name", record["id"])),
                        media_type=str(sample.get("media_type", media)), width=int(sample.get("width", 0)),
                        height=int(sample.get("height", 0)),
                        num_frames=int(sample.get("num_frames", latents_shape[1])),
                        duration_sec=float(sample.get("duration_sec", 0.0)), fps=float(sample.get("fps", 0.0)))
    if kind == "t2va":
        metadata["audio_sample_rate"] = int(sample["audio_sample_rate"])
    return {**record, **metadata}


def _as_array(sample: dict, key: str, ndim: int, number: int) -> np.ndarray:
    if key not in sample:
        raise ValueError(f"sample {number} has no {key!r} tensor")
    value = sample[key]
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"sample {number}: {key!r} must be a floating-point torch tensor, got {type(value).__name__}"
                        + (f" of {value.dtype}" if isinstance(value, torch.Tensor) else ""))
    if value.dim() != ndim:
        raise ValueError(f"sample {number}: {key!r} must have {ndim} dims, got shape {list(value.shape)}")
    return value.detach().to("cpu", torch.float32).contiguous().numpy()


def _tensor_columns(name: str, array: np.ndarray) -> dict[str, Any]:
    return {f"{name}_bytes": array.tobytes(), f"{name}_shape": list(array.shape), f"{name}_dtype": "float32"}


# ---------------------------------------------------------------------------------------------------------- batching


def batch_at(dataset: Dataset, key: torch.Tensor, step: int, *, batch_size: int, rank: int = 0,
             world: int = 1) -> dict[str, Any]:
    """This rank's part of global batch ``step``: a pure function of (dataset, key, step).

    Epoch e = step // (len // batch_size) visits ``permutation(fold_in(key, e), len)`` in slices of ``batch_size``
    (the remainder is dropped); rank r takes rows [r*b, (r+1)*b) of the slice, b = batch_size // world. Adds
    ``sample_index`` [b] int64 = step * batch_size + r * b + arange(b), the same whatever the world size.
    """
    for name, value, low in (("step", step, 0), ("batch_size", batch_size, 1), ("world", world, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"batch_at: {name} must be an int >= {low}, got {value!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"batch_at: rank must be an int in [0, {world}), got {rank!r}")
    if batch_size % world:
        raise ValueError(f"batch_at: batch_size {batch_size} is not divisible by world size {world}")
    steps_per_epoch = len(dataset) // batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"batch_at: the dataset has {len(dataset)} samples, fewer than one batch of {batch_size}")
    epoch, position = divmod(step, steps_per_epoch)
    local = batch_size // world
    start = position * batch_size + rank * local
    order = _epoch_order(tuple(key.tolist()), epoch, len(dataset))
    batch = dataset.read(order[start:start + local].tolist())
    first = step * batch_size + rank * local
    batch["sample_index"] = torch.arange(first, first + local, dtype=torch.int64)
    return batch


@functools.lru_cache(maxsize=2)
def _epoch_order(key_words: tuple[int, int], epoch: int, length: int) -> torch.Tensor:
    """The epoch's sample order, int64 [length] (memoised: every step of an epoch uses it; do not modify)."""
    return random.permutation(random.fold_in(torch.tensor(key_words, dtype=torch.int64), epoch), length)


# ------------------------------------------------------------------------------------------------------ prefetching


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()
_POLL_S = 0.05  # how often a blocked worker checks for close()


class Prefetcher:
    """Iterate ``(step, fn(step))`` for ``step`` in ``steps``, computing up to ``depth`` results ahead in a background
    thread (``depth=0``: computed on demand in the caller's thread).

    An exception in ``fn`` is raised to the consumer, with its original traceback, when it reaches that step.
    ``close()`` (or leaving a ``with`` block, or dropping the last reference) stops the worker and joins it.
    """

    def __init__(self, fn: Callable[[int], Any], steps: Iterable[int], depth: int = 2):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"Prefetcher: depth must be an int >= 0, got {depth!r}")
        self._fn, self._steps, self._closed = fn, iter(steps), False
        self._thread: threading.Thread | None = None
        if depth:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=_produce, args=(fn, self._steps, self._queue, self._stop),
                                            name="fvx-prefetch", daemon=True)
            self._thread.start()

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._closed:
            raise StopIteration
        if self._thread is None:
            try:
                step = next(self._steps)
                return step, self._fn(step)
            except BaseException:
                self.close()
                raise
        item = self._queue.get()
        if item is _DONE:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stop the worker, drop computed results and wait for the worker to finish its current step."""
        self._closed = True
        if self._thread is None:
            return
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None:
            self.close()


def _produce(fn: Callable[[int], Any], steps: Iterator[int], out: queue.Queue, stop: threading.Event) -> None:
    """The worker: put (step, fn(step)) for each step, then _DONE, or a _Failure; return early once ``stop`` is set."""
    try:
        for step in steps:
            if stop.is_set() or not _put(out, (step, fn(step)), stop):
                return
    except BaseException as error:  # handed to the consumer, who re-raises it
        _put(out, _Failure(error), stop)
        return
    _put(out, _DONE, stop)


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put ``item``, waiting for room; False if ``stop`` was set first."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False
