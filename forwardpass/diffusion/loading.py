"""Reading a diffusers-style pipeline folder.

    DIR/model_index.json              {"_class_name": "ImagePipeline",
                                       "vae": ["forwardpass", "TinyAutoencoderKL"], ...}
    DIR/text_encoder/config.json + model.safetensors
    DIR/tokenizer/tokenizer.json
    DIR/transformer/config.json + diffusion_pytorch_model.safetensors
    DIR/vae/config.json + diffusion_pytorch_model.safetensors
    DIR/scheduler/scheduler_config.json

Each component entry names ``[library, class]``; we look the class name up in our own registry (the
library name is informational, so a folder written by diffusers with a class we implement loads too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forwardpass.diffusion.dit import DiTTransformer2DModel
from forwardpass.diffusion.modeling import ConfigModule, read_json
from forwardpass.diffusion.schedulers import SCHEDULERS, Scheduler, scheduler_from_config
from forwardpass.diffusion.text_encoder import PromptTokenizer, TinyTextEncoder
from forwardpass.diffusion.vae import TinyAutoencoderKL
from forwardpass.errors import (
    MissingFileError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)

MODEL_CLASSES: dict[str, type[ConfigModule]] = {
    "TinyTextEncoder": TinyTextEncoder,
    "DiTTransformer2DModel": DiTTransformer2DModel,
    "TinyAutoencoderKL": TinyAutoencoderKL,
}
TOKENIZER_CLASSES = {"PromptTokenizer", "PreTrainedTokenizerFast", "BertTokenizerFast"}
REQUIRED = ("text_encoder", "tokenizer", "transformer", "vae", "scheduler")
# What kind of object each component slot must hold.
SLOT_KIND = {"text_encoder": "model", "transformer": "model", "vae": "model", "student_transformer": "model",
             "tokenizer": "tokenizer", "scheduler": "scheduler",
             "student_scheduler": "scheduler"}  # fmt: skip


def read_model_index(root: str | Path) -> tuple[Path, dict[str, Any]]:
    root = Path(root)
    if not root.exists():
        raise ModelNotFoundError(f"pipeline folder {str(root)!r} does not exist")
    if not (root / "model_index.json").is_file():
        raise MissingFileError(
            f"{root}/model_index.json is missing: a pipeline folder lists its components there"
        )
    index = read_json(root / "model_index.json")
    missing = [name for name in REQUIRED if name not in index]
    if missing:
        raise MissingFileError(f"{root}/model_index.json does not list the required component(s) {missing}")
    return root, index


def _class_name(index: dict[str, Any], slot: str, root: Path) -> str:
    entry = index.get(slot)
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
        raise ModelLoadError(
            f"{root}/model_index.json: {slot!r} must be [library, class_name], got {entry!r}"
        )
    return entry[1]


def load_component(root: Path, index: dict[str, Any], slot: str, *, max_length: int = 16) -> Any:
    """Load one component, with an error that names the slot, the folder and the fix."""
    cls_name = _class_name(index, slot, root)
    folder = root / slot
    if not folder.is_dir():
        raise MissingFileError(
            f"component {slot!r} is listed in model_index.json but {folder} does not exist"
        )
    kind = SLOT_KIND.get(slot, "model")
    if kind == "scheduler":
        if cls_name not in SCHEDULERS:
            raise UnsupportedArchitectureError(
                f"{slot}: unknown scheduler class {cls_name!r}; forwardpass implements {sorted(SCHEDULERS)}"
            )
        cfg = read_json(folder / "scheduler_config.json")
        cfg.setdefault("_class_name", cls_name)
        return scheduler_from_config(cfg)
    if kind == "tokenizer":
        if cls_name not in TOKENIZER_CLASSES:
            raise UnsupportedArchitectureError(f"{slot}: unknown tokenizer class {cls_name!r}")
        return PromptTokenizer.from_pretrained(folder, max_length=max_length)
    if cls_name not in MODEL_CLASSES:
        raise UnsupportedArchitectureError(
            f"{slot}: unknown component class {cls_name!r}; forwardpass implements {sorted(MODEL_CLASSES)}"
        )
    return MODEL_CLASSES[cls_name].from_pretrained(folder)


def save_scheduler(scheduler: Scheduler, folder: str | Path) -> None:
    import json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scheduler_config.json").write_text(json.dumps(scheduler.to_config(), indent=2) + "\n")
