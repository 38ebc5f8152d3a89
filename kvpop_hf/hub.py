"""Hub I/O for KVpop scorers: ``kvpop_config.json`` + ``kvpop_scorer.safetensors`` (no pickle).

The file names differ from a model's ``config.json`` / ``model.safetensors`` so one Hub repo can
hold both the (distilled) language model and its KVpop scorer.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
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


def _looks_local(path: Path) -> bool:
    text = str(path)
    return path.exists() or path.is_absolute() or text.startswith(".") or text.count("/") > 1 or os.sep != "/" and os.sep in text


def _resolve(repo_id_or_path, filename, required, **kwargs) -> str | None:
    path = Path(repo_id_or_path)
    if _looks_local(path) and not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory; pass a KVpop checkpoint directory or a Hub repo id.")
    if path.is_dir():
        file = path / filename
        if file.is_file():
            return str(file)
        if required:
            raise FileNotFoundError(f"{file} not found: {repo_id_or_path} is not a KVpop checkpoint directory.")
        return None
    try:
        return hf_hub_download(str(repo_id_or_path), filename, **kwargs)
    except LocalEntryNotFoundError as err:  # (a subclass of EntryNotFoundError: test it first)
        # offline (local_files_only=True or HF_HUB_OFFLINE=1) and not in the local cache
        if not required and _in_local_cache(repo_id_or_path, CONFIG_NAME, kwargs):
            return None  # the checkpoint is cached without this optional file
        raise FileNotFoundError(
            f"{repo_id_or_path} is not in the local Hugging Face cache and downloads are off (local_files_only=True "
            f"or HF_HUB_OFFLINE=1): download it once with network access, or pass a local checkpoint directory."
        ) from err
    except EntryNotFoundError:
        if required:
            raise FileNotFoundError(f"{filename} not found in repo {repo_id_or_path}.") from None
        return None


def _in_local_cache(repo_id, filename, kwargs) -> bool:
    found = try_to_load_from_cache(str(repo_id), filename, cache_dir=kwargs.get("cache_dir"),
                                   revision=kwargs.get("revision"))
    return isinstance(found, str)


def load(repo_id_or_path, revision=None, cache_dir=None, token=None, local_files_only=False):
    """Returns (config, scorer state dict or None, log_gamma or None)."""
    kwargs = dict(revision=revision, cache_dir=cache_dir, token=token, local_files_only=local_files_only)
    config_file = _resolve(repo_id_or_path, CONFIG_NAME, True, **kwargs)
    try:
        data = json.loads(Path(config_file).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}); the checkpoint is corrupt.") from err
    config = KVpopConfig.from_dict(data)
    weights = _resolve(repo_id_or_path, WEIGHTS_NAME, False, **kwargs)
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
        raise ValueError(f"Scorer weights in {source} do not fit {type(scorer).__name__}: missing {missing}, "
                         f"unexpected {unexpected}.")
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
