"""Where retrofit data comes from: a Hub dataset, a local dataset folder or data files, read with ``datasets``.

A name that exists as a file or folder (relative to the current directory, ``data_msg`` as ``./data_msg``) is that
local source, never a Hub name. A name that does not is a Hub dataset; a ValueError before the Hub is asked where
that cannot work: with ``HF_HUB_OFFLINE`` set, a name of no cached Hub dataset; and a bare name whose only cached
copy is ``datasets``' cache of an earlier load of a local folder so named (which ``datasets`` would load instead).

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
    if path.is_dir():  # a folder of data files; a bare name (data_msg) that exists here is this folder too
        # by its absolute path: datasets would read a bare "json" or "text" as its packaged builder of that name
        return datasets.load_dataset(str(path.resolve()), config, split=split, streaming=streaming)
    if source.startswith((".", "/", "~")) or path.suffix.lower() in FILE_BUILDERS or path.parent.is_dir() and \
            str(path.parent) not in ("", ".") or source.count("/") > 1:
        raise ValueError(f"--dataset {source!r} is not an existing file or folder (and not a Hub dataset name "
                         "owner/name): check the path.")
    return _load_hub(datasets, source, config, split, streaming)


def _load_hub(datasets, source: str, config, split: str, streaming: bool):
    """``source``, no local file or folder, as a Hub dataset; what would go wrong is a ValueError before the Hub is
    asked, where it can be known: a bare name whose only cached copy is an earlier load of a local folder of that
    name, or (with ``HF_HUB_OFFLINE``) a name with no cached copy at all."""
    here = f"no file or folder in {Path.cwd()}"
    in_data_cache, in_hub_cache = _in_datasets_cache(datasets, source), _in_hub_cache(source)
    if "/" not in source and in_data_cache and not in_hub_cache:
        # datasets caches a local folder under its bare name and, when the Hub has no such dataset (or is not
        # reached), silently loads that copy: the folder as it was then, wherever it was
        raise ValueError(f"--dataset {source!r} is {here}, and the datasets cache holds an earlier load of a local "
                         f"folder named {source!r} (not a Hub download), which datasets would load in its place: "
                         "pass the folder's path (relative to the current directory, or absolute), or a Hub "
                         "dataset as owner/name.")
    offline = hub_offline()
    if offline and not (in_data_cache or in_hub_cache):
        raise ValueError(f"--dataset {source!r} is {here} and no Hub dataset in the local cache, and "
                         "HF_HUB_OFFLINE is set, so the Hub is not asked: check the path (relative to the current "
                         "directory), or unset HF_HUB_OFFLINE to download a Hub dataset (owner/name).")
    if offline and not datasets.config.HF_HUB_OFFLINE:
        raise ValueError(f"--dataset {source!r}: HF_HUB_OFFLINE was set after `datasets` was imported, which still "
                         "asks the Hub: set it before Python starts (HF_HUB_OFFLINE=1 kvpop-retrofit ...).")
    try:
        return datasets.load_dataset(source, config, split=split, streaming=streaming)
    except (ConnectionError, datasets.exceptions.DatasetNotFoundError) as err:
        off = "" if offline else " (HF_HUB_OFFLINE=1 stops at once, without asking the Hub)"
        raise ValueError(f"--dataset {source!r} is {here} and not a Hub dataset that could be loaded{off}: check "
                         f"the path (relative to the current directory) or the Hub name (owner/name). "
                         f"datasets said: {err}") from err


def _in_datasets_cache(datasets, name: str) -> bool:
    """Whether ``datasets``' cache holds a prepared dataset under ``name`` (where its offline fallback looks: a
    Hub dataset owner/name as owner___name, a local folder by its bare name)."""
    import glob
    import os

    from datasets.naming import camelcase_to_snakecase

    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = os.path.join(os.path.expanduser(str(datasets.config.HF_DATASETS_CACHE)), "___".join(parts))
    return any(os.path.isdir(p) for p in glob.glob(os.path.join(root, "*", "*", "*")))


def _in_hub_cache(name: str) -> bool:
    """Whether the Hub cache holds files of the dataset repo ``name`` (it was downloaded from the Hub once)."""
    from huggingface_hub import constants

    return (Path(constants.HF_HUB_CACHE) / ("datasets--" + name.replace("/", "--"))).is_dir()


def hub_offline() -> bool:
    """Whether the Hub is off: ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` set (1/true/yes/on), or ``datasets``
    imported offline."""
    import os

    import datasets

    on = {"1", "true", "yes", "on"}
    return any(os.environ.get(k, "").strip().lower() in on for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")) \
        or bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))
