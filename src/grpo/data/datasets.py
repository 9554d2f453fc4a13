"""Datasets as rows: a local data file or `save_to_disk` directory loaded (`load_local`), a streaming dataset read
by position (`StreamRows`), and a dataset's size where it has one."""

from __future__ import annotations

import os
from typing import Any


class StreamRows:
    """A streaming dataset (`datasets.IterableDataset`, or any iterable of rows) read as rows by position: row i is
    the i-th row of the stream repeated end to end (a new pass when it runs out, as another epoch). Positions only
    grow while training, so a small window of recent rows is kept; an earlier position (a resumed run) reads the
    stream again from its start and skips to it, which is exact for a deterministic stream (a shuffled stream:
    `IterableDataset.shuffle(seed=...)` with a fixed seed). grpo does not shuffle a stream itself."""

    streaming = True

    def __init__(self, dataset: Any, window: int) -> None:
        self.dataset = dataset
        self.window = max(window, 1)
        self.rows: dict[int, dict] = {}
        self._start()

    def _start(self) -> None:
        self.passes = 0
        self._set_epoch(0)
        self.iterator = iter(self.dataset)
        self.next_index = 0
        self.rows.clear()

    def _set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):  # a shuffled IterableDataset reshuffles per pass
            self.dataset.set_epoch(epoch)

    def _next(self) -> dict:
        try:
            return next(self.iterator)
        except StopIteration:
            if self.next_index == 0:
                raise ValueError("train_dataset is an empty stream: it yields no rows.") from None
        self.passes += 1  # the stream ran out: the next pass
        self._set_epoch(self.passes)
        self.iterator = iter(self.dataset)
        try:
            return next(self.iterator)
        except StopIteration:
            raise ValueError(f"train_dataset's stream yields no rows on its pass {self.passes + 1}.") from None

    def __getitem__(self, index: int) -> dict:
        if index in self.rows:
            return self.rows[index]
        if index < self.next_index:  # behind the window: read the stream again from its start
            self._start()
        while self.next_index <= index:
            row = self._next()
            if self.next_index > index - self.window:
                self.rows[self.next_index] = row
            self.next_index += 1
        for old in [i for i in self.rows if i <= index - self.window]:
            del self.rows[old]
        return self.rows[index]

    def __len__(self) -> int:
        raise TypeError(
            "train_dataset is a streaming dataset: it has no length. Set max_steps (as TRL requires for an "
            "IterableDataset)."
        )


def is_stream(dataset: Any) -> bool:
    """A dataset without random access: a `datasets.IterableDataset` (or `StreamRows` over one)."""
    if getattr(dataset, "streaming", False):
        return True
    try:
        from datasets import IterableDataset
    except ImportError:  # pragma: no cover (datasets is a dependency)
        return False
    return isinstance(dataset, IterableDataset)


def dataset_size(dataset: Any) -> int | None:
    """Rows of a map-style dataset; None for a stream."""
    return None if is_stream(dataset) else len(dataset)


DATA_FILES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_local(dataset: Any, split: str = "train", streaming: bool = False) -> Any:
    """A dataset given by path: a .json/.jsonl/.parquet/.csv file (its rows as split `split`), or a directory
    written by `save_to_disk`; anything else as it is."""
    if not isinstance(dataset, (str, os.PathLike)):
        return dataset
    from datasets import load_dataset, load_from_disk

    path = os.fspath(dataset)
    if os.path.isfile(path):
        builder = DATA_FILES.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise ValueError(f"{path}: a dataset file is .json, .jsonl, .parquet or .csv.")
        return load_dataset(builder, data_files={split: path}, streaming=streaming)[split]
    if os.path.isdir(path):
        loaded = load_from_disk(path)
        return loaded[split] if hasattr(loaded, "keys") and split in loaded else loaded
    raise ValueError(f"The dataset path {path} does not exist (a data file or a save_to_disk directory).")
