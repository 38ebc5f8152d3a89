"""Configuration of a DMS checkpoint: the delayed-eviction window, the sinks and the model shape of its gate.

Files (beside a model's ``config.json`` / ``model.safetensors``): ``dms_config.json`` and ``dms_gate.safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ...config import JsonConfig, check_int

CONFIG_NAME = "dms_config.json"
WEIGHTS_NAME = "dms_gate.safetensors"


@dataclass
class DMSConfig(JsonConfig):
    """sinks: first tokens never evicted; window: the delayed-eviction window ``w`` (a token marked for
    eviction is visible while it is one of the last ``w`` tokens). target_eviction: the eviction rate over
    tokens ``t >= sinks`` the gate was trained towards (informational); gate_temperature: the Gumbel-sigmoid temperature
    used in training. num_layers / num_kv_heads / head_dim: the model the gate belongs to."""

    _KIND = "DMS config"

    sinks: int = 4
    window: int = 32
    target_eviction: float | None = None
    gate_temperature: float = 0.3
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    base_model: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_int("sinks", self.sinks, 0)
        check_int("window", self.window, 1, "The delayed-eviction window holds at least the current token.")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if not (isinstance(self.gate_temperature, (int, float)) and self.gate_temperature > 0):
            raise ValueError(f"`gate_temperature` must be a positive number, got {self.gate_temperature!r}.")



def save(directory, config: DMSConfig, gate: torch.nn.Module) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).write_text(config.to_json_string() + "\n")
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in gate.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt", "kind": "dms_gate"})


def load(directory) -> tuple[DMSConfig, dict]:
    directory = Path(directory)
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise FileNotFoundError(f"{what}: {directory}; pass a DMS checkpoint directory (written by "
                                "training/train_dms.py).")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} not found: {directory} is not a DMS checkpoint "
                                    "(written by training/train_dms.py).")
    try:
        config = DMSConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
    except json.JSONDecodeError as err:
        raise ValueError(f"{directory / CONFIG_NAME} is not valid JSON ({err}).") from err
    try:
        state = load_file(str(directory / WEIGHTS_NAME))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"Could not read {directory / WEIGHTS_NAME}: {err}.") from err
    return config, state
