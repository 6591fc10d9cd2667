"""Tiny DeepSeek-V3 checkpoints with a multi-token-prediction (MTP) layer, for ``method: mtp``.

transformers' DeepSeek-V3 ignores the MTP layer (``model.layers.{num_hidden_layers}.*``), so
``save_pretrained`` writes none: the main model is saved as ``attention_checkpoints`` saves it, and the MTP
tensors are added to its safetensors by hand. The MTP block is layer ``N`` of a second random model with
``N + 1`` layers (the ``donor``, kept for the oracle: its layer is transformers' own decoder layer), plus
random ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head`` tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.attention_checkpoints import ATTENTION_VARIANTS, make_attention_checkpoint
from tests.helpers.checkpoints import BASE


def _config(**overrides) -> dict:
    return {**BASE, **ATTENTION_VARIANTS["deepseek_v3"][2], **overrides}


def make_donor(num_layers: int, seed: int = 7, **overrides):
    """A random transformers DeepSeek-V3 with ``num_layers + 1`` layers (sdpa: causal without a mask)."""
    import transformers

    config = transformers.DeepseekV3Config(**{**_config(**overrides), "num_hidden_layers": num_layers + 1})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    donor = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, buf in donor.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape) * 0.5)
    return donor


def make_mtp_checkpoint(directory: Path, *, own_head: bool = True, live_rows: int | None = None,
                        seed: int = 0, **overrides) -> Path:
    """A DeepSeek-V3 checkpoint with one MTP layer. ``own_head``: the layer gets its own
    ``shared_head.head`` (else it uses the main ``lm_head``). ``live_rows``: every LM-head row past the first
    ``live_rows`` is zero, so the model only ever emits those tokens and the MTP layer (sharing the head)
    often agrees with it: drafts are accepted, not only rejected."""
    make_attention_checkpoint(directory, "deepseek_v3", seed=seed, **overrides)
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    n, h, v = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(files[0])
    donor = make_donor(n, **overrides)
    prefix = f"model.layers.{n}."
    for name, t in donor.state_dict().items():
        if name.startswith(prefix):
            tensors[name] = t.clone().contiguous()
    g = torch.Generator().manual_seed(seed + 11)
    tensors[prefix + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[prefix + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors[prefix + "eh_proj.weight"] = 0.15 * torch.randn(h, 2 * h, generator=g)
    tensors[prefix + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    if own_head:
        tensors[prefix + "shared_head.head.weight"] = 0.15 * torch.randn(v, h, generator=g)
    else:  # as V3 checkpoints store it: a copy of the main head, which the engine does not load twice
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    if live_rows is not None:
        tensors["lm_head.weight"][live_rows:] = 0
        tensors[prefix + "shared_head.head.weight"][live_rows:] = 0
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return directory
