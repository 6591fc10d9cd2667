"""Write a GGUF file (llama.cpp's format) from a Hugging Face Llama / Qwen2 / Qwen3 dense checkpoint.

    python scripts/to_gguf.py MODEL_DIR out.gguf --outtype q8_0     # f32, f16, q8_0 or q4_0

Our own small converter on the ``gguf`` package (tensor names, metadata keys and block quantizers all come
from it): hyperparameters, every weight under the name llama.cpp expects, and a byte-level BPE tokenizer
(vocabulary, merges, special tokens, chat template). Q8_0 / Q4_0 quantize the 2-D projection weights;
norms and biases stay F32, the embedding and LM head are Q8_0 in a q4_0 file (forwardpass's own int4
choice), and a matrix whose rows are not a multiple of 32 stays F32 (as llama.cpp's converter does).
Llama's q/k rows are permuted into GGML's rotary layout (the inverse of what GGUF readers undo).
"""

from __future__ import annotations

import sys
from pathlib import Path

# the repo's forwardpass, also when run as a file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json

import numpy as np
import torch

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
OUTTYPES = ("f32", "f16", "q8_0", "q4_0")


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows → GGML's interleaved pairs (llama only; Qwen uses the NeoX layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_names(num_layers: int) -> dict[str, str]:
    """HF name → GGUF name, for the Llama-family dense decoder."""
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(num_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    return names


def tensor_type(gguf_name: str, shape: tuple[int, ...], outtype: str):
    from gguf import GGMLQuantizationType as T

    if len(shape) != 2 or outtype == "f32":
        return T.F32
    if outtype == "f16":
        return T.F16
    if shape[1] % 32:
        return T.F32
    if outtype == "q4_0" and gguf_name in ("token_embd.weight", "output.weight"):
        return T.Q8_0
    return T.Q8_0 if outtype == "q8_0" else T.Q4_0


def _pre_tokenizer_name(pre: dict | None) -> str:
    """GGUF's ``tokenizer.ggml.pre`` for a tokenizer.json pre-tokenizer we can reproduce when reading."""
    from forwardpass.loader.gguf import PRE_TOKENIZER_REGEX

    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # llama.cpp's name for GPT-2's split regex
    if pre and pre.get("type") == "Sequence":
        for p in pre.get("pretokenizers", []):
            if p.get("type") == "Split":
                pattern = p.get("pattern", {}).get("Regex")
                for name, regex in PRE_TOKENIZER_REGEX.items():
                    if pattern == regex:
                        return name
    raise SystemExit(
        f"unsupported pre-tokenizer {json.dumps(pre)[:200]}: byte-level BPE (GPT-2, Qwen2, Llama 3) only"
    )


def add_tokenizer(writer, model_dir: Path, config: dict) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    if tok["model"]["type"] != "BPE":
        raise SystemExit(f"unsupported tokenizer model {tok['model']['type']}: byte-level BPE only")
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = set()
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["content"])
    size = max(config["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # UNUSED until filled
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = (
            3
            if text in special
            else (4 if any(a["content"] == text for a in tok.get("added_tokens", [])) else 1)
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(tok.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tcfg_path = model_dir / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.exists() else {}

    def token_id(value) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return vocab.get(value) if isinstance(value, str) else None

    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    eos = token_id(tcfg.get("eos_token")) if token_id(tcfg.get("eos_token")) is not None else eos
    if eos is not None:
        writer.add_eos_token_id(int(eos))
    bos = token_id(tcfg.get("bos_token"))
    if bos is not None:
        writer.add_bos_token_id(bos)
    writer.add_add_bos_token(bool(tcfg.get("add_bos_token", False)))
    pad = token_id(tcfg.get("pad_token"))
    if pad is not None:
        writer.add_pad_token_id(pad)
    if tcfg.get("chat_template"):
        writer.add_chat_template(tcfg["chat_template"])


def convert(model_dir: Path, out: Path, outtype: str) -> None:
    import gguf
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    arch_cls = (config.get("architectures") or [""])[0]
    if arch_cls not in ARCHS:
        raise SystemExit(f"unsupported architecture {arch_cls!r}; supported: {', '.join(ARCHS)}")
    arch = ARCHS[arch_cls]
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    if (config.get("rope_scaling") or {}).get("rope_type", "default") != "default" or rope.get(
        "rope_type", "default"
    ) != "default":
        raise SystemExit("rope scaling is not supported by this converter")

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])
    ftype = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[outtype]
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, model_dir, config)

    names = tensor_names(layers)
    tied = config.get("tie_word_embeddings", False)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no *.safetensors in {model_dir}")
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not iterable
                if name == "lm_head.weight" and tied:
                    continue
                if name not in names:
                    raise SystemExit(
                        f"tensor {name} has no GGUF name (an architecture variant this converter lacks)"
                    )
                w = st.get_tensor(name).to(torch.float32).numpy()
                if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                    w = permute_rotary(w, heads)
                elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                    w = permute_rotary(w, kv_heads)
                gname = names[name]
                qtype = tensor_type(gname, w.shape, outtype)
                if qtype == gguf.GGMLQuantizationType.F32:
                    writer.add_tensor(gname, w)
                elif qtype == gguf.GGMLQuantizationType.F16:
                    writer.add_tensor(gname, w.astype(np.float16))
                else:
                    writer.add_tensor(gname, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--outtype", choices=OUTTYPES, default="f32")
    args = p.parse_args(argv)
    convert(args.model_dir, args.out, args.outtype)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB, {args.outtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
