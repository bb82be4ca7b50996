"""A small Qwen3-style tokenizer and store for the agent tests: byte-level BPE (every byte is a
token, so any JSON can be written), ``<|im_start|>``/``<|im_end|>`` special (``<|im_end|>`` is
end-of-sequence), ``<think>``/``</think>``/``<tool_call>``/``</tool_call>`` added as plain
tokens (as in Qwen3's vocabulary), and a chat template written here from Qwen3's published
chat format: tools listed in the system turn, earlier calls as ``<tool_call>`` JSON, tool
results as ``<tool_response>`` user turns, and a generation prompt that opens ``<think>``
unless ``enable_thinking`` is false (then it writes an empty, closed reasoning block)."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

CORPUS = [
    "The capital of France is Paris. What is the weather in Paris today?",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"temperature": 21, "sky": "clear", "ok": true, "tags": ["a", "b"], "n": null}',
    "Let me think about the question. The user wants the weather, so I call the tool.",
    "system user assistant tool tools function arguments parameters properties type object",
    "It is 21 degrees and clear in Paris. 0123456789 [] {} : , \" yes no",
]

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\n<tools>\n{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "Call a function with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}"
    "<|im_start|>assistant\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}"
    "<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m['role'] != 'system' %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def make_agent_tokenizer(out: Path, vocab_size: int = 400) -> int:
    """Train and save_pretrained the tokenizer into ``out``; returns its size (ids < it)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from tests.services.harmony_tiny import byte_level_bpe

    tk = byte_level_bpe(CORPUS, SPECIALS, vocab_size)
    tk.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return len(fast)


def make_agent_store(root: Path, seed: int = 5) -> Path:
    """A tiny random qwen3_moe with that tokenizer, converted to an int4 store; returns its path."""
    from engine.quant.formats import QuantFormat
    from engine.store import convert
    from tests.engine.models.hf_tiny import make_checkpoint

    n = make_agent_tokenizer(root / "hf")
    make_checkpoint("qwen3_moe", root / "hf", seed=seed, vocab=n, hidden_size=64, num_hidden_layers=2,
                    head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                    norm_topk_prob=True, bos_token_id=None, eos_token_id=SPECIALS.index("<|im_end|>"), pad_token_id=0,
                    max_position_embeddings=2048)
    convert(root / "hf", root / "store", fmt=QuantFormat("int4", 32), progress=False)
    return root / "store"
