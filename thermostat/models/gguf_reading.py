"""Reading a GGUF file's header fast, and keeping what transformers converts from it.

gguf's `GGUFReader` walks the header through numpy memmap slices, one per string: SmolLM2's
49,152-token vocabulary and its merges are ~300k slices, 2.5-3 s; `read_header` takes plain
array views of the same map, an array's in one pass (0.1 s), and parses a file once per process.
transformers reads the file again for the config and again for the tokenizer (3-4 s each with
gguf's reader; on this module's reader, which it is handed, 0.5-1 s): `cached_config` and
`cached_tokenizer` keep both as save_pretrained writes them, under
$THERMOSTAT_GGUF_CACHE (else ~/.cache/thermostat/gguf) in a folder per file named by its path,
size, modification time and transformers' version, so a later start reads them back in 0.1 s.
A cache that cannot be written is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import gguf
import numpy as np
import transformers
from gguf import GGUFReader, GGUFValueType, ReaderTensor
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

log = logging.getLogger("thermostat")
GGUF_VERSION = importlib.metadata.version("gguf")
Saved = TypeVar("Saved", PretrainedConfig, PreTrainedTokenizerBase)


class _ArrayViewReader(GGUFReader):
    """GGUFReader whose slices of the file are plain ndarray views of its memmap (a memmap
    slice runs numpy's memmap bookkeeping each time), an array of strings read in one pass over
    its lengths; the same fields and tensors."""

    def _bytes(self) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        kind = np.dtype(dtype)
        count = int(count)
        values: np.ndarray = self._bytes()[offset : offset + kind.itemsize * count].view(kind)
        values = values[:count]
        order = self.byte_order if override_order is None else override_order
        return values if order == "I" else values.view(values.dtype.newbyteorder(order))

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        """An array (a vocabulary, its scores, its merges: ~150k items) in one pass: a part per
        string (its bytes, where GGUFReader makes its length and its bytes) or per number (views
        of one array, where GGUFReader reads each alone): 0.8 s -> 0.1 s on SmolLM2's. The rest,
        and a big-endian file, as GGUFReader reads it."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        kind = GGUFValueType(item_type[0])
        number = self.gguf_scalar_to_np.get(kind)
        if not count[0] or (number is None and kind != GGUFValueType.STRING):
            return super()._get_field_parts(orig_offs, raw_type)
        parts: list[np.ndarray] = [item_type, count]
        offs = orig_offs + 12
        if number is not None:
            values = self._get(offs, number, int(count[0]))
            parts += list(values.reshape(-1, 1))
            offs += values.nbytes
        else:
            plain = self._bytes()
            view = plain.data  # a memoryview of the bytes
            for _ in range(int(count[0])):
                length = int.from_bytes(view[offs : offs + 8], sys.byteorder)
                parts.append(plain[offs + 8 : offs + 8 + length])
                offs += 8 + length
        return offs - orig_offs, parts, list(range(2, len(parts))), [GGUFValueType.ARRAY, kind]


def release_pages(reader: GGUFReader, tensor: ReaderTensor) -> None:
    """The file's pages of `tensor` out of this process's resident memory once it is read (into
    the model's own copy): they stay in the page cache, and a later read maps them again, the
    same bytes (the map is read-only). A load then holds one tensor of the file, not all of it
    (a 7B file's 4 GB counted in its peak RSS on top of the weights as served)."""
    mapped = getattr(reader.data, "_mmap", None)  # np.memmap's mmap
    if not isinstance(mapped, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(len(mapped), tensor.data_offset + tensor.n_bytes)
    if end > start:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def read_header(path: Path) -> GGUFReader:
    """The file's parsed header and its memory-mapped tensors, parsed once per file version."""
    stat = path.stat()
    return _read(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    return _ArrayViewReader(path)


def cache_root() -> Path:
    custom = os.environ.get("THERMOSTAT_GGUF_CACHE")
    return Path(custom) if custom else Path.home() / ".cache" / "thermostat" / "gguf"


def _folder(path: Path) -> Path:
    stat = path.stat()
    key = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    return cache_root() / hashlib.sha256(key.encode()).hexdigest()[:20]


@contextlib.contextmanager
def _array_view_reader() -> Iterator[None]:
    """transformers' GGUF conversion (which imports `gguf.GGUFReader` as it runs) reading the
    file through _ArrayViewReader: the same fields, 0.1 s where gguf's reader takes 2.5-3 s, for
    each of the config and the tokenizer on a file's first start."""
    with mock.patch.object(gguf, "GGUFReader", _ArrayViewReader):
        yield


def cached_config(path: Path) -> PretrainedConfig:
    """transformers' config for the file (AutoConfig with gguf_file), from the cache when there;
    `_name_or_path` is the file's folder either way."""

    def convert() -> PretrainedConfig:
        with _array_view_reader():
            converted: PretrainedConfig = AutoConfig.from_pretrained(
                path.parent, gguf_file=path.name
            )
        return converted

    config: PretrainedConfig = _cached(path, "config", convert, AutoConfig.from_pretrained)
    config._name_or_path = str(path.parent)
    return config


def cached_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer from the file's metadata (AutoTokenizer with gguf_file), from the
    cache when there."""

    def convert() -> PreTrainedTokenizerBase:
        with _array_view_reader():
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    return _cached(path, "tokenizer", convert, AutoTokenizer.from_pretrained)


def cached_names(path: Path, compute: Callable[[], dict[str, str]]) -> dict[str, str]:
    """The file's GGUF -> Hugging Face tensor names (`compute`: through transformers' model for
    its config, which imports its modeling code: 1.5-2 s), kept as JSON in the file's entry with
    gguf's version (its name map made them)."""
    folder = _folder(path)
    saved = folder / "tensor_names.json"
    try:
        entry = json.loads(saved.read_text())
        if entry.get("gguf") == GGUF_VERSION:
            return dict(entry["names"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or damaged: made again below
    names = compute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".json", delete=False) as out:
            json.dump({"gguf": GGUF_VERSION, "names": names}, out)
        os.replace(out.name, saved)
    except OSError as exc:
        log.warning("%s: cannot cache its tensor names under %s (%s)", path, folder, exc)
    return names


def _cached(
    path: Path, part: str, convert: Callable[[], Saved], load: Callable[[Path], Saved]
) -> Saved:
    """`load` of the cached folder `part` of the file's entry; else `convert`, then saved there
    (written aside and renamed, so a reader never sees half an entry)."""
    folder = _folder(path) / part
    if folder.is_dir():
        try:
            return load(folder)
        except Exception as exc:  # a damaged entry: converted again below
            log.warning("%s: unreadable cache entry %s (%s); converting again", path, folder, exc)
            shutil.rmtree(folder, ignore_errors=True)
    value = convert()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        aside = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{part}-"))
        value.save_pretrained(aside)
        try:
            aside.rename(folder)
        except OSError:  # another process wrote it first
            shutil.rmtree(aside, ignore_errors=True)
    except OSError as exc:
        log.warning("%s: cannot cache its %s under %s (%s)", path, part, folder.parent, exc)
    return value
