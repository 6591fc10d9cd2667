"""Shared plumbing for the diffusion components: a config-carrying ``nn.Module`` that saves and loads
itself in the diffusers folder convention (``config.json`` + ``*.safetensors``).

Each component (text encoder, DiT, VAE) declares its defaults once in ``DEFAULTS``; ``config.json`` may
omit any of them, and unknown keys starting with ``_`` (diffusers' ``_class_name``, ``_diffusers_version``)
are ignored. Weights load strictly: a missing or misshapen tensor is a ``ModelLoadError`` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from forwardpass.errors import (
    ConfigError,
    CorruptWeightsError,
    MissingFileError,
    MissingTensorError,
    ModelLoadError,
    WeightShapeError,
)
from forwardpass.loader.jsonfile import read_json_object


class ConfigModule(nn.Module):
    """An ``nn.Module`` built from a plain-dict config that round-trips through ``config.json``."""

    DEFAULTS: ClassVar[dict[str, Any]] = {}
    WEIGHTS_NAME: ClassVar[str] = "diffusion_pytorch_model.safetensors"

    def __init__(self, **config: Any):
        super().__init__()
        unknown = [k for k in config if k not in self.DEFAULTS and not k.startswith("_")]
        if unknown:
            raise ConfigError(f"{type(self).__name__} does not understand config keys {unknown}")
        self.config = {**self.DEFAULTS, **{k: v for k, v in config.items() if not k.startswith("_")}}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ConfigModule:
        return cls(**config)

    def save_pretrained(self, directory: str | Path, *, half: bool = False) -> None:
        """Write ``config.json`` and weights; ``half=True`` stores fp16 (loaded back as fp32)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        cfg = {"_class_name": type(self).__name__, **self.config}
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        dtype = torch.float16 if half else torch.float32
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / self.WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> ConfigModule:
        directory = Path(directory)
        config = read_json(directory / "config.json")
        model = cls.from_config(config)
        model.load_weights(find_weights(directory))
        return model.eval()

    def load_weights(self, path: Path) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise CorruptWeightsError(f"cannot read {path}: {exc}") from exc
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        if missing:
            raise MissingTensorError(
                f"{path} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        for name, tensor in own.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise WeightShapeError(
                    f"{path}: tensor {name} has shape {tuple(state[name].shape)}, config expects "
                    f"{tuple(tensor.shape)}"
                )
        # Stored weights may be fp16 to keep the repository small; compute is always fp32 here.
        self.load_state_dict({k: state[k].float() for k in own}, strict=True)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise MissingFileError(f"{path} is missing")
    return read_json_object(path)


def find_weights(directory: Path) -> Path:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(
            p.name for p in directory.glob("*.pt")
        )
        hint = (
            f" (found {pickles}; pickle checkpoints are never loaded, convert to safetensors)"
            if pickles
            else ""
        )
        raise MissingFileError(f"{directory} has no *.safetensors weights{hint}")
    if len(files) > 1:
        raise ModelLoadError(
            f"{directory} holds several safetensors files {[f.name for f in files]}; expected one"
        )
    return files[0]
