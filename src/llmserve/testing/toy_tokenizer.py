"""A deterministic byte-level BPE tokenizer of any vocab size, for random-weight checkpoints.

Ids 0..2 are the special tokens, then the 256 byte tokens, then BPE merges learnt from a small
built-in corpus, then filler tokens (printable ASCII pairs, then triples) until the vocab is full,
so every id of the model decodes to a string. Written as tokenizer.json + tokenizer_config.json
with a ChatML chat template.
"""

from __future__ import annotations

import itertools
import json
import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# ChatML, with tools as Qwen2.5 / Hermes render them: listed in the system turn inside <tools></tools>, calls as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> in the assistant turn, tool results as a user turn of
# <tool_response> blocks. Without tools and tool messages it renders plain ChatML.
_TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_INSTRUCTIONS = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>"
)
CHATML_TEMPLATE = (
    "{% set ns = namespace(first=0) %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% set ns.first = 1 %}{% endif %}"
    "{{ '" + _TOOLS_PREAMBLE + "' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + _TOOLS_INSTRUCTIONS + "<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages[ns.first:] %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}{% else %}{{ function['arguments'] | tojson }}"
    "{% endif %}{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    # Qwen3's switch (chat_template_kwargs {"enable_thinking": false}): an empty thought, so the answer comes next
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system schedules requests, batches their
tokens, and streams the generated text back to each client as soon as it is ready.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital
of France, and Berlin is the capital of Germany. Tell me a story about a dragon who learned to code.
Once upon a time, in a small village near the mountains, there lived a curious young girl.
The weather today is sunny with a chance of rain in the afternoon; temperatures reach 21 degrees.
Large language models predict the next token given the previous ones. Attention lets every token
look at the tokens before it; the key and value cache keeps them so they are computed only once.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

for i in range(10):
    print(i, fibonacci(i))
{"role": "user", "content": "Summarise this article in three sentences."}
1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 0.5 -1 +42 = 7 * 6
Numbers, names and places: Alice, Bob, Carol, London, Tokyo, New York, Monday, January, 12:30.
Please answer the question below. Explain why the sky is blue in simple words for a child.
The system should be fast, simple, and correct. Tests check every part of it.
"""


def _train_bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = _CORPUS.splitlines(keepends=True)
    tok.train_from_iterator([line for _ in range(4) for line in lines], trainer)
    return tok


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable char map, as a list indexed by byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _fillers(existing: dict[str, int], count: int) -> list[str]:
    """`count` new byte-level token strings: printable ASCII pairs, then triples."""
    chars = _byte_chars()
    ascii_chars = [chars[b] for b in range(32, 127)]
    out: list[str] = []
    if count <= 0:
        return out
    for n in (2, 3):
        for combo in itertools.product(ascii_chars, repeat=n):
            text = "".join(combo)
            if text not in existing:
                out.append(text)
                if len(out) == count:
                    return out
    raise ValueError(f"vocab too large for the toy tokenizer: {len(existing) + count}")


def build_tokenizer(vocab_size: int):
    """A tokenizers.Tokenizer whose vocab has exactly vocab_size ids."""
    from tokenizers import Tokenizer
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")
    spec = json.loads(_train_bpe(vocab_size).to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    for text in _fillers(vocab, vocab_size - len(vocab)):
        vocab[text] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(spec))
    assert tok.get_vocab_size() == vocab_size
    return tok


def save_tokenizer(out_dir: str, vocab_size: int, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the ChatML template) into out_dir."""
    build_tokenizer(vocab_size).save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
