"""Hub I/O for KVpop scorers: ``kvpop_config.json`` + ``kvpop_scorer.safetensors`` (no pickle).

The file names differ from a model's ``config.json`` / ``model.safetensors`` so one Hub repo can
hold both the (distilled) language model and its KVpop scorer.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from pathlib import Path

import torch
from huggingface_hub import HfApi, constants, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import KVpopConfig

CONFIG_NAME = "kvpop_config.json"
WEIGHTS_NAME = "kvpop_scorer.safetensors"
LOG_GAMMA_KEY = "log_gamma"


def save(directory, config: KVpopConfig, scorer: torch.nn.Module, log_gamma: torch.Tensor | None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(config.to_json_string() + "\n")
    tensors = {name: p.detach().float().cpu().contiguous() for name, p in scorer.state_dict().items()}
    if log_gamma is not None:
        tensors[LOG_GAMMA_KEY] = log_gamma.detach().float().cpu().contiguous()
    weights = directory / WEIGHTS_NAME
    if tensors:
        save_file(tensors, str(weights), metadata={"format": "pt", "scorer": config.scorer})
    elif weights.exists():
        weights.unlink()


def local_dir(repo_id_or_path) -> Path | None:
    """The local checkpoint directory ``repo_id_or_path`` names, or None when it is a Hub repo id.

    Read as a local path: an ``os.PathLike``; anything that exists on disk; a string starting with ``/``, ``./``,
    ``../`` or ``~`` (or exactly ``.``/``..``), holding the platform's own separator where that is not ``/``, or
    holding more than one ``/``; a string without ``/`` (its parent folder is the working directory, and a KVpop
    checkpoint on the Hub always lives under a namespace); and a ``first/rest`` string whose ``first`` is a local
    directory (``checkpoints/kvpop_mlp`` beside a ``checkpoints/`` folder is a mistyped path, not a Hub repo). Any
    other string (``namespace/name``) is a Hub repo id, checked by huggingface_hub's own validator.

    Raises, before any network call: FileNotFoundError for a path that is not an existing directory,
    ValueError for a string that is neither a path nor a valid repo id."""
    if isinstance(repo_id_or_path, os.PathLike):
        return _existing_dir(Path(repo_id_or_path), str(os.fspath(repo_id_or_path)))
    if not isinstance(repo_id_or_path, str):
        raise TypeError(f"Pass a checkpoint directory or a Hub repo id as a str or path, got {repo_id_or_path!r}.")
    if not repo_id_or_path:
        raise ValueError("Empty checkpoint name: pass a checkpoint directory or a Hub repo id 'namespace/name'.")
    text = repo_id_or_path
    path = Path(text).expanduser()
    first = text.split("/", 1)[0]
    if path.exists() or path.is_absolute() or text in (".", "..") or text.startswith(("./", "../", "~")) \
            or (os.sep != "/" and os.sep in text) or text.count("/") > 1:
        return _existing_dir(path, text)
    if "/" not in text:
        try:
            validate_repo_id(text)
            note = (" (a Hub repo id names its namespace, 'namespace/name'; a string without '/' is read as a "
                    "local directory)")
        except HFValidationError:
            note = ""
        return _existing_dir(path, text, note=note)
    if Path(first).is_dir():
        return _existing_dir(path, text, note=f" ({first}/ is a local directory, so {text!r} is read as a local "
                                              f"path, not as a Hub repo id)")
    try:
        validate_repo_id(text)
    except HFValidationError as err:
        raise ValueError(f"{text!r} is neither an existing directory nor a valid Hub repo id ({err}). Pass a KVpop "
                         "checkpoint directory or a repo id 'namespace/name'.") from None
    return None


def _existing_dir(path: Path, text: str, note: str = "") -> Path:
    if path.is_dir():
        return path
    if path.exists():
        raise FileNotFoundError(f"not a directory: {text} is a file; pass the checkpoint directory that holds "
                                f"{CONFIG_NAME}.")
    raise FileNotFoundError(f"no such directory: {text}{note}. Pass an existing checkpoint directory (one holding "
                            f"{CONFIG_NAME}) or a Hub repo id 'namespace/name'.")


def _resolve(repo_id_or_path, directory: Path | None, filename, required, **kwargs) -> str | None:
    if directory is not None:
        file = directory / filename
        if file.is_file():
            return str(file)
        if required:
            raise FileNotFoundError(f"{file} not found: {repo_id_or_path} is not a KVpop checkpoint directory.")
        return None
    try:
        return hf_hub_download(repo_id_or_path, filename, **kwargs)
    except LocalEntryNotFoundError as err:  # (a subclass of EntryNotFoundError: test it first)
        # not in the local cache, and either downloads are off or the Hub could not be reached
        if not required and _in_local_cache(repo_id_or_path, CONFIG_NAME, kwargs):
            return None  # the checkpoint is cached without this optional file
        if kwargs.get("local_files_only") or constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(
                f"{repo_id_or_path} is not in the local Hugging Face cache and downloads are off (local_files_only="
                f"True or HF_HUB_OFFLINE=1): download it once with network access, or pass a local checkpoint "
                "directory.") from err
        raise FileNotFoundError(
            f"{filename} of the Hub repo {repo_id_or_path} could not be downloaded and is not in the local Hugging "
            f"Face cache ({err}). Check the network connection and the repo id; a local checkpoint directory must "
            f"exist (a relative path is read from the working directory).{_similar_local_dir(repo_id_or_path)}"
        ) from err
    except EntryNotFoundError:
        if required:
            raise FileNotFoundError(f"{filename} not found in repo {repo_id_or_path}.") from None
        return None


def _similar_local_dir(repo_id: str) -> str:
    """A hint naming a local directory whose name is close to the repo id's namespace (a mistyped path), or ''."""
    first, _, rest = str(repo_id).partition("/")
    try:
        local = [p.name for p in Path(".").iterdir() if p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(first, local, n=1, cutoff=0.75)
    return f" Did you mean the local path {close[0]}/{rest}?" if close else ""


def _in_local_cache(repo_id, filename, kwargs) -> bool:
    found = try_to_load_from_cache(str(repo_id), filename, cache_dir=kwargs.get("cache_dir"),
                                   revision=kwargs.get("revision"))
    return isinstance(found, str)


def load(repo_id_or_path, revision=None, cache_dir=None, token=None, local_files_only=False):
    """Returns (config, scorer state dict or None, log_gamma or None)."""
    directory = local_dir(repo_id_or_path)  # before any network call: a missing path fails here
    kwargs = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    config_file = _resolve(repo_id_or_path, directory, CONFIG_NAME, True, **kwargs)
    try:
        data = json.loads(Path(config_file).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}); the checkpoint is corrupt.") from err
    config = KVpopConfig.from_dict(data)
    weights = _resolve(repo_id_or_path, directory, WEIGHTS_NAME, False, **kwargs)
    state = None
    if weights is not None:
        try:
            state = load_file(weights)
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"Could not read scorer weights {weights}: {err}. The file is corrupt; re-download "
                             "or re-save the checkpoint.") from err
    log_gamma = state.pop(LOG_GAMMA_KEY) if state is not None and LOG_GAMMA_KEY in state else None
    return config, state, log_gamma


def load_scorer_state(scorer: torch.nn.Module, state: dict | None, source) -> None:
    expected = scorer.state_dict()
    if not expected:
        if state:
            raise ValueError(
                f"{source} holds scorer weights ({', '.join(sorted(state)[:4])}, ...), but its config names the "
                f"weightless scorer {type(scorer).__name__}: the config and the weights do not belong together. "
                "Fix `scorer` in kvpop_config.json or remove kvpop_scorer.safetensors."
            )
        return
    if state is None:
        raise FileNotFoundError(f"{source} has no {WEIGHTS_NAME}, but the scorer {type(scorer).__name__} has weights.")
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        hint = ""
        if getattr(scorer, "token_readout", None) is not None and {"at", "bt", "wt"} & set(missing + unexpected):
            flag = "false" if missing else "true"
            hint = (f" The weights are those of an mLSTM scorer with token_readout={flag}: add \"token_readout\": "
                    f"{flag} to scorer_kwargs in kvpop_config.json (a config without it means true).")
        raise ValueError(f"Scorer weights in {source} do not fit {type(scorer).__name__}: missing {missing}, "
                         f"unexpected {unexpected}.{hint}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"Scorer weight {name!r} in {source} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(expected[name].shape)}.")
    scorer.load_state_dict(state, strict=True)


def push(cache, repo_id: str, private=None, token=None, commit_message="Upload KVpop scorer") -> str:
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache.save_pretrained(tmp)
        info = api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message)
    return str(getattr(info, "commit_url", info))
