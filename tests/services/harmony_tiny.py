"""A small harmony tokenizer for tests: byte-level BPE (as o200k_harmony is; multi-byte characters
split across tokens), gpt-oss's control tokens as special added tokens, and a harmony chat
template written from the published format description (system message with the reasoning
effort and the valid channels; the first system/developer turn as the developer message's
instructions; earlier assistant answers on the final channel; the generation prompt
``<|start|>assistant``). The real o200k_harmony tokenizer cannot be downloaded here."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
            "<|return|>", "<|call|>"]

CORPUS = [
    "The capital of France is Paris. The user asks about the capital of France.",
    "Let me think about this question. We need to answer briefly and clearly.",
    "system developer user assistant analysis commentary final functions json",
    "Reasoning: low medium high. Valid channels: analysis, commentary, final.",
    "Channel must be included for every message. Instructions follow below.",
    "Café au lait, naïve résumé, 日本語のテキスト, emoji 🙂 and ümlauts.",
    "to=functions.get_weather {\"location\": \"Tokyo\"} hello world yes no maybe",
]

# Written from the harmony format description (openai/harmony docs), not copied from a model.
CHAT_TEMPLATE = (
    "{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort "
    "else 'medium' -%}"
    "<|start|>system<|message|>You are a tiny test model.\nReasoning: {{ effort }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "<|end|>"
    "{%- set ns = namespace(first=0) -%}"
    "{%- if messages and messages[0]['role'] in ('system', 'developer') -%}"
    "<|start|>developer<|message|># Instructions\n\n{{ messages[0]['content'] }}<|end|>"
    "{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    "{%- for m in messages[ns.first:] -%}"
    "{%- if m['role'] == 'user' -%}"
    "<|start|>user<|message|>{{ m['content'] }}<|end|>"
    "{%- elif m['role'] == 'assistant' -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{%- else -%}"
    "<|start|>developer<|message|>{{ m['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def byte_level_bpe(corpus: list[str], specials: list[str], vocab_size: int):
    """A byte-level BPE (every byte a token) trained on ``corpus`` x4, ``specials`` first."""
    from tokenizers import Tokenizer as TkTokenizer, decoders, models, pre_tokenizers, trainers

    tk = TkTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus * 4, trainer)
    return tk


def make_harmony_tokenizer(out: Path, vocab_size: int = 384) -> int:
    """Train and save_pretrained the tokenizer into ``out``; returns its size (ids < it)."""
    from transformers import PreTrainedTokenizerFast

    tk = byte_level_bpe(CORPUS, SPECIALS, vocab_size)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|return|>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return len(fast)
