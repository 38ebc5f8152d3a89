"""Where retrofit data comes from: a Hub dataset, a local dataset folder or data files, read with ``datasets``.

``load_source("nvidia/Nemotron-Math-v2", split="high_part00")``, ``load_source("traces/")`` (a ``save_to_disk``
folder or a folder of data files), ``load_source("data.jsonl")`` all return a ``datasets.Dataset`` (or an
``IterableDataset`` with ``streaming=True``), the split chosen.
"""

from __future__ import annotations

from pathlib import Path

# data-file extension -> the ``datasets`` packaged builder that reads it
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def require_datasets():
    """The ``datasets`` module, or an ImportError naming the extra that installs it."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError("Retrofit data from Hugging Face `datasets` needs the `datasets` package: "
                          "pip install -e \".[train]\" (or pip install datasets).") from err
    return datasets


def is_hf_dataset(obj) -> bool:
    """True for a ``datasets.Dataset`` / ``IterableDataset`` (checked without importing ``datasets``)."""
    return type(obj).__module__.startswith("datasets.") and hasattr(obj, "map")


def _is_saved_dataset(folder: Path) -> bool:
    """A ``save_to_disk`` folder: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _check_saved_not_empty(folder: Path) -> None:
    """A saved Dataset of zero rows has no data file, which ``load_from_disk`` cannot read: say so."""
    import json

    state = folder / "state.json"
    if state.is_file() and not json.loads(state.read_text()).get("_data_files"):
        raise ValueError(f"--dataset {str(folder)!r} is a saved dataset with no rows: the split is empty.")


def _pick_split(data, split: str, source: str):
    if hasattr(data, "keys"):  # a DatasetDict
        if split not in data:
            raise ValueError(f"--split {split!r} is not in {source!r}: its splits are {sorted(data)}.")
        return data[split]
    return data


def load_source(source: str, config: str | None = None, split: str = "train", streaming: bool = False):
    """One split of ``source``: a local ``save_to_disk`` folder, a local folder of data files, a data file
    (``.jsonl .json .parquet .arrow .csv``) or a Hub dataset name (``config`` its configuration)."""
    datasets = require_datasets()
    path = Path(source)
    if path.is_dir() and _is_saved_dataset(path):
        _check_saved_not_empty(path)
        if config:
            raise ValueError(f"--dataset_config {config!r} names a Hub configuration; {source!r} is a saved dataset "
                             "folder, which has none: drop --dataset_config.")
        data = _pick_split(datasets.load_from_disk(str(path)), split, source)
        return data.to_iterable_dataset() if streaming else data
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"--dataset {source!r}: unknown data file type {path.suffix!r}; use one of "
                             f"{sorted(FILE_BUILDERS)} or a dataset folder.")
        if config:
            raise ValueError(f"--dataset_config {config!r} names a Hub configuration; {source!r} is a data file, which "
                             "has none: drop --dataset_config.")
        if path.stat().st_size == 0:
            raise ValueError(f"--dataset {source!r} is an empty file: the split is empty.")
        return datasets.load_dataset(builder, data_files={split: str(path)}, split=split, streaming=streaming)
    if path.is_dir():
        return datasets.load_dataset(str(path), config, split=split, streaming=streaming)
    if source.startswith((".", "/", "~")) or path.suffix.lower() in FILE_BUILDERS or path.parent.is_dir() and \
            str(path.parent) not in ("", ".") or source.count("/") > 1:
        raise ValueError(f"--dataset {source!r} is not an existing file or folder (and not a Hub dataset name "
                         "owner/name): check the path.")
    return datasets.load_dataset(source, config, split=split, streaming=streaming)
