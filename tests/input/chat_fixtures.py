"""Tokenizers with the chat templates of three model families, made here with the
``tokenizers`` library and saved by ``transformers`` (the reference), and copies of the
templates that mark the answers with ``{% generation %}`` (transformers' own mask).

The templates are written in each family's style: Llama 3's header ids and
``<|eot_id|>``; Mistral's ``[INST] ... [/INST]`` with v0.3's system message moved into
the last user turn and its role check; Qwen2's ``<|im_start|> ... <|im_end|>`` with a
default system prompt.
"""

import os

from trainer.input import chat_template
from trainer.input import tokenizer as tokenizer_lib

SAMPLE = os.path.join(
    os.path.dirname(__file__), "..", "..", "examples", "text", "train", "part-0.txt"
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
LLAMA3_MARKED = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported!') }}
    {%- endif %}
{%- endfor %}
"""
MISTRAL_MARKED = MISTRAL.replace(
    "{{- ' ' + message['content'] + eos_token }}",
    "{%- generation %}{{- ' ' + message['content'] + eos_token }}{%- endgeneration %}",
)

QWEN2 = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN2_MARKED = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

FALLBACK_MARKED = chat_template.FALLBACK.replace(
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}",
    "{{ '<|' + message['role'] + '|>\\n' }}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{{ '\\n' }}",
)

# family: (template, its marked copy, special tokens, tokenizer_config's names, Metaspace)
FAMILIES = {
    "llama3": (
        LLAMA3,
        LLAMA3_MARKED,
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        False,
    ),
    "mistral": (
        MISTRAL,
        MISTRAL_MARKED,
        ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        True,
    ),
    "qwen2": (
        QWEN2,
        QWEN2_MARKED,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        False,
    ),
    "fallback": (
        None,
        FALLBACK_MARKED,
        ["<|begin_of_text|>", "<|end_of_text|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        False,
    ),
}


def make_family(out: str, family: str, vocab_size: int = 400):
    """Writes ``family``'s tokenizer (and template) to ``out`` with ``save_pretrained``;
    returns transformers' tokenizer loaded back from it."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    template, _, specials, names, metaspace = FAMILIES[family]
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>" if metaspace else None))
    if metaspace:  # SentencePiece's way of spaces (Mistral's, Llama 2's)
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = []
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    with open(SAMPLE, encoding="utf-8") as f:
        lines = f.read().splitlines()[:1500]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template, **names)
    fast.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def ours(directory: str):
    """The project's tokenizer of ``directory`` (offsets included: ``encode_offsets``)."""
    return tokenizer_lib.load_text_tokenizer(directory)
