"""Deterministic tiny tokenizers, trained offline, to sit next to random-weight test checkpoints.

``make_test_tokenizer(dir, kind, vocab_size)`` writes ``tokenizer.json`` and ``tokenizer_config.json``
(with a ChatML chat template) into ``dir``. The total vocabulary (specials included) is exactly
``vocab_size``, so a checkpoint made with the same ``vocab_size`` covers every id.

* ``"bytelevel"`` — GPT-2 / Qwen2 style: byte-level BPE, no BOS, ChatML specials at the end
  (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``); eos = ``<|im_end|>``. vocab_size 259..1230.
* ``"llama"`` — Llama 2 / Mistral style: Metaspace "▁" BPE with byte fallback (``<0x00>``..``<0xFF>``),
  ``<unk>``=0 ``<s>``=1 ``</s>``=2 and a TemplateProcessing post-processor that prepends ``<s>``;
  ChatML specials are appended. vocab_size 262..1179.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- 'You may call these tools:\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' + tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- elif messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('unknown role: ' + message['role']) }}\n"
    "    {%- elif not (message['role'] == 'system' and loop.first) %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>"]

# Fixed training text: a few paragraphs of English, French, German, Japanese, Chinese, emoji, code and
# numbers, so merges exist for common words and multi-byte characters. Changing it changes every id.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A forward pass reads every weight of the model once,
so decoding one token at a time is limited by memory bandwidth, while a long prefill is limited by
compute. The scheduler mixes both kinds of work under one token budget: running requests decode
first, and waiting prompts fill whatever budget is left, chunk by chunk. When the cache runs out of
blocks, the newest request is preempted and its tokens are recomputed later.

Once upon a time there was a small language model that lived on a laptop. Every morning it woke up,
read its configuration, loaded its tensors from memory-mapped files and waited for prompts. People
asked it about the weather, about recipes for bread and soup, about the history of mathematics, and
about why the sky is blue. It answered as well as it could, one token after another, and it never
complained, even when the questions were strange or the context window was almost full.

Le café est très chaud ce matin. Nous étions à la plage, où l'été dure longtemps et où les enfants
jouent près de la mer. Ça va très bien, merci ! Les élèves préfèrent les crêpes et le pain français.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Die Straße ist schön und der Bär schläft.
El niño comió una manzana mientras la señora leía el periódico en el jardín.

日本語の文章も少し入れておきます。東京は日本の首都で、人口がとても多い都市です。今日は天気が良いので、
公園を散歩しましょう。機械学習のモデルは文字をトークンに分けて処理します。中文也很重要：我们今天去北京，
学习人工智能和自然语言处理。你好，世界！한국어도 조금 있습니다: 안녕하세요, 만나서 반갑습니다.

Emoji appear in chats all the time 😀 😂 👍 🎉 ❤️ 🚀 🌍 🤖 🍕 and sometimes in long runs like 🎉🎉🎉 or 😀😀.

def attention(q, k, v, scale):
    scores = (q @ k.transpose(-2, -1)) * scale
    return torch.softmax(scores, dim=-1) @ v

for i in range(10):
    print(f"step {i}: loss = {0.5 / (i + 1):.4f}")

Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 4096 3.14159 2.71828 1e-6 2025-01-31
12:30:45 $19.99 50% #hashtag @user https://example.com/path?query=value&key=42 user@example.com
"""

_BYTELEVEL_SPECIALS = ["<|endoftext|>", *CHATML_SPECIALS]
_LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]
_BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]


def _train(tokenizer: Tokenizer, vocab_size: int, **trainer_kwargs) -> tuple[dict[str, int], list]:
    """Train BPE on the corpus; return (vocab, merges) as tokenizer.json stores them."""
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, **trainer_kwargs)
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    return model["vocab"], [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def _bytelevel(vocab_size: int) -> tuple[Tokenizer, dict]:
    base = vocab_size - len(_BYTELEVEL_SPECIALS)
    probe = Tokenizer(models.BPE())
    probe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab, merges = _train(probe, base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(_BYTELEVEL_SPECIALS)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return tok, config


def _frequent_chars(n: int) -> list[str]:
    """The ``n`` most frequent corpus characters, ties broken by character (so the result is stable)."""
    counts = Counter(CORPUS.replace(" ", "▁"))
    return sorted(counts, key=lambda c: (-counts[c], c))[:n]


def _llama(vocab_size: int) -> tuple[Tokenizer, dict]:
    base = vocab_size - len(_LLAMA_SPECIALS) - len(_BYTE_TOKENS) - len(CHATML_SPECIALS)
    probe = Tokenizer(models.BPE())
    # Trained per word (so no token has "▁" inside); encoding the whole string (split=False, as HF's
    # Llama tokenizer does) then gives the same pieces.
    probe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    # Byte fallback covers any character, so the alphabet is cut to the most frequent ones (chosen here,
    # not by the trainer, whose tie-breaking is not deterministic); that keeps small vocabularies possible.
    alphabet = _frequent_chars(max(1, min(base, 100)))
    trained, merges = _train(probe, max(base, 1), initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    vocab = {t: i for i, t in enumerate(_LLAMA_SPECIALS + _BYTE_TOKENS)}
    for token in sorted(trained, key=trained.__getitem__):
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens(_LLAMA_SPECIALS + CHATML_SPECIALS)
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None}
    return tok, config


def make_test_tokenizer(directory: str | Path, kind: str = "bytelevel", vocab_size: int = 512) -> Path:
    """Write a deterministic tokenizer of exactly ``vocab_size`` ids into ``directory``; return it."""
    builders = {"bytelevel": _bytelevel, "llama": _llama}
    if kind not in builders:
        raise ValueError(f"kind must be one of {sorted(builders)}, got {kind!r}")
    tok, special = builders[kind](vocab_size)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(
            f"cannot build a {kind!r} tokenizer with vocab_size={vocab_size}: the built-in corpus gives "
            f"{tok.get_vocab_size(with_added_tokens=True)} (supported: bytelevel 259..1230, llama 262..1179)"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": CHATML_SPECIALS,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return directory
