"""Chat data against transformers: templates of the Llama 3, Mistral and Qwen2 kinds
(and the fallback) give apply_chat_template's ids, id for id, and the loss counts
exactly the tokens transformers marks as the assistant's; bad chat input is one
counted warning or one ConfigError line."""

import gzip
import json
import pickle

import numpy as np
import pytest
from chat_fixtures import FAMILIES, make_family, ours

from trainer.errors import ConfigError
from trainer.input import chat_template as template_lib
from trainer.input.language import chat

SYSTEM = {"role": "system", "content": "You answer briefly."}
CONVERSATIONS = {
    "one turn": [
        {"role": "user", "content": "What is the river called?"},
        {"role": "assistant", "content": "The river is old."},
    ],
    "system, two turns": [
        SYSTEM,
        {"role": "user", "content": "Where is the dog?"},
        {"role": "assistant", "content": "  In the green house.  "},
        {"role": "user", "content": "And the cat, é?"},
        {"role": "assistant", "content": "The cat sees a tree, 日本."},
    ],
    "empty answer": [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
    ],
}
PROMPT_COMPLETION = {"prompt": "Where is the cat?", "completion": "Under the red tree."}
# TRL's conversational prompt/completion: a few-shot answer in the prompt is not learnt.
FEW_SHOT = {
    "prompt": [
        SYSTEM,
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another one."},
    ],
    "completion": [{"role": "assistant", "content": "Green."}],
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (directory, transformers' tokenizer, our encoder)."""
    out = {}
    for family in FAMILIES:
        directory = str(tmp_path_factory.mktemp(family))
        reference = make_family(directory, family)
        template = template_lib.load_chat_template(directory)
        out[family] = directory, reference, chat.ChatEncoder(template, ours(directory))
    return out


def _conversations():
    cases = [chat.Conversation(tuple(m)) for m in CONVERSATIONS.values()]
    return cases + [chat.parse_record(PROMPT_COMPLETION), chat.parse_record(FEW_SHOT)]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ids_and_answer_masks_equal_transformers(families, family):
    _, reference, encoder = families[family]
    marked = FAMILIES[family][1]
    assert encoder.template.fallback == (family == "fallback")
    template = template_lib.FALLBACK if family == "fallback" else None  # transformers has none
    for conversation in _conversations():
        messages = list(conversation.messages)
        ids, mask = encoder.encode(conversation)
        expected = reference.apply_chat_template(messages, chat_template=template)["input_ids"]
        assert ids.dtype == np.int32 and ids.tolist() == expected
        text = reference.apply_chat_template(messages, chat_template=template, tokenize=False)
        assert encoder.template.render(messages) == text
        for head in (messages, messages[:-1]):  # the generator's input, after a whole turn
            prompt = reference.apply_chat_template(
                head, chat_template=template, add_generation_prompt=True
            )["input_ids"]
            assert encoder.prompt_ids(head).tolist() == prompt
        # transformers' own mask, from a copy of the template marking the answers.
        out = reference.apply_chat_template(
            messages, chat_template=marked, return_assistant_tokens_mask=True
        )
        assert out["input_ids"] == expected  # the marked copy writes the same text
        runs = _runs(np.asarray(out["assistant_masks"], bool))
        assert runs
        if conversation.train_from:  # only the completion's (last) answer is learnt
            runs = runs[-1:]
        assert _runs(mask) == runs, (family, messages)


def test_the_mask_is_each_answer_and_its_end_of_turn(families):
    _, reference, encoder = families["qwen2"]
    ids, mask = encoder.encode(chat.Conversation(tuple(CONVERSATIONS["system, two turns"])))
    learnt = [reference.decode(ids[a:b]) for a, b in _runs(mask)]
    assert learnt == ["  In the green house.  <|im_end|>", "The cat sees a tree, 日本.<|im_end|>"]
    # Every token when the prompts are learnt too; the same ids.
    one = chat.Conversation(tuple(CONVERSATIONS["one turn"]))
    everything = chat.ChatEncoder(encoder.template, encoder.tokenizer, train_on_prompts=True)
    all_ids, all_mask = everything.encode(one)
    assert all_mask.all() and all_ids.tolist() == encoder.encode(one)[0].tolist()


def test_mistral_writes_the_prompt_otherwise_once_an_answer_follows(families):
    # So its spans are not where the generation prompt ends (the second way is tested).
    template = families["mistral"][2].template
    messages = CONVERSATIONS["system, two turns"]
    prompt = template.render(messages[:2], add_generation_prompt=True)
    assert not template.render(messages[:3]).startswith(prompt)
    assert template.answer_affixes == (" ", "</s>")


@pytest.mark.parametrize(
    "family, end",
    [("llama3", "<|eot_id|>"), ("mistral", "</s>"), ("qwen2", "<|im_end|>"), ("fallback", None)],
)
def test_end_of_turn_is_where_a_generator_stops(families, family, end):
    template = families[family][2].template
    assert template.end_of_turn() == (end or template.variables["eos_token"])


def test_templates_are_found_where_transformers_looks(families, tmp_path):
    directory, reference, _ = families["qwen2"]
    with open(f"{directory}/tokenizer_config.json") as f:
        settings = json.load(f)
    with open(f"{directory}/tokenizer.json", "rb") as f:
        tokenizer_json = f.read()
    # tokenizer_config.json's list of named templates: the one named "default".
    settings["chat_template"] = [
        {"name": "tool_use", "template": "{{ 'tools' }}"},
        {"name": "default", "template": FAMILIES["qwen2"][0]},
    ]
    settings["image_token"] = "<|endoftext|>"  # any *_token is a variable too
    settings["extra_special_tokens"] = ["<|im_start|>"]  # a list names no variable
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json)
    template = template_lib.load_chat_template(str(tmp_path / "tokenizer.json"))
    assert template.text == FAMILIES["qwen2"][0] and not template.fallback
    assert template.variables == {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "image_token": "<|endoftext|>",
    }
    assert template.files == {"chat_template.jinja": FAMILIES["qwen2"][0].encode()}
    # chat_template.jinja wins over the config, as in transformers.
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")
    assert template_lib.load_chat_template(str(tmp_path)).render([]) == "<|im_end|>"
    settings["chat_template"] = [{"name": "tool_use", "template": "x"}]
    with pytest.raises(ConfigError, match=r"chat templates \['tool_use'\] and none named"):
        template_lib.template_from_files(
            {"tokenizer_config.json": json.dumps(settings).encode()}, "m"
        )


def test_template_failures_are_one_config_error(families, tmp_path):
    with pytest.raises(ConfigError, match=r"^the chat template of m does not compile \(line 1"):
        template_lib.ChatTemplate("{% for m in messages %}", {}, "m")
    with pytest.raises(ConfigError, match="the fallback one ends each turn with the tokenizer"):
        template_lib.template_from_files({}, "m")
    # Damaged tokenizer files: one line naming the file, not a traceback.
    with pytest.raises(ConfigError, match=r"^m: tokenizer_config.json holds a JSON list, not an"):
        template_lib.template_from_files({"tokenizer_config.json": b"[1]"}, "m")
    with pytest.raises(ConfigError, match=r"^m: chat_template.jinja is not UTF-8"):
        template_lib.template_from_files({"chat_template.jinja": b"{{ \xff }}"}, "m")
    # Mistral's role check, on the second conversation of a file.
    rows = [{"messages": CONVERSATIONS["one turn"]}, {"messages": [*CONVERSATIONS["one turn"]] * 2}]
    rows[1]["messages"][1] = {"role": "user", "content": "again"}
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations = chat.read_conversations(str(path))
    encoder = families["mistral"][2]
    with pytest.raises(ConfigError) as error:
        chat.conversation_lengths(str(tmp_path / "cache"), conversations, encoder)
    assert str(error.value) == (
        f"the chat template of {families['mistral'][0]} fails on conversation 1 (bad.jsonl:2): "
        "Roles must alternate user/assistant/user/assistant/..."
    )
    # A template that writes earlier answers differently once more turns follow.
    forgetful = template_lib.ChatTemplate(
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[...]"
        "{% else %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
        {"eos_token": "<|im_end|>"},
        "m",
    )
    conversation = chat.Conversation(tuple(CONVERSATIONS["system, two turns"]))
    with pytest.raises(ConfigError, match="writes message 2 of a conversation differently"):
        chat.ChatEncoder(forgetful, encoder.tokenizer).encode(conversation)


# Jinja as transformers sets it up: trim_blocks and lstrip_blocks, loop controls,
# namespace, dict, a tojson keeping non-ASCII and HTML, tools and documents None, the
# generation tag, and messages without None values, reasoning under three names.
SEMANTICS = """{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
    {%- if m.role == 'system' %}{% continue %}{% endif -%}
    {%- set ns.count = ns.count + 1 -%}
[{{ ns.count }}:{{ m.role }}]{{ m | tojson }}
    {% if ns.count > 2 %}{% break %}{% endif %}
{% endfor -%}
{{ dict(a='é') | tojson }}{{ tools is none }}{{ documents is none }}{{ bos_token is defined }}
{%- generation %}<{{ eos_token }}>{% endgeneration %}
  {% if add_generation_prompt %}GO{% endif %}
"""


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_jinja_semantics_equal_transformers(families, add_generation_prompt):
    _, reference, encoder = families["qwen2"]
    messages = [
        SYSTEM,
        {"role": "user", "content": 'é <b> & "x"', "name": None},
        {"role": "assistant", "content": "ok", "reasoning_content": "hm", "tool_calls": None},
        {"role": "tool", "content": "42"},
        {"role": "user", "content": "never reached"},
    ]
    ours = template_lib.ChatTemplate(SEMANTICS, encoder.template.variables, "t")
    expected = reference.apply_chat_template(
        messages,
        chat_template=SEMANTICS,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )
    assert ours.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_strftime_now_formats_a_fixed_date():
    template = template_lib.ChatTemplate("{{ strftime_now('%d %b %Y') }}", {}, "m")
    assert template.render([]) == "26 Jul 2024"


def test_every_format_reads_and_damage_is_counted_once(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = {"messages": CONVERSATIONS["one turn"]}
    lines = [
        json.dumps(good),
        json.dumps(PROMPT_COMPLETION),
        "not json",
        json.dumps({"text": "a document"}),
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"content": "hi"}, CONVERSATIONS["one turn"][1]]}),
        json.dumps({"messages": [{"role": "robot", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "user", "content": ["hi"]}]}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"messages": CONVERSATIONS["one turn"][::-1]}),
        json.dumps(FEW_SHOT),
    ]
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress("\n".join(lines).encode() + b"\n\xff\n"))
    pq.write_table(
        pa.table({"messages": [CONVERSATIONS["system, two turns"], None]}), tmp_path / "b.parquet"
    )
    pq.write_table(pa.table({"prompt": ["p"], "completion": ["c"]}), tmp_path / "c.parquet")
    conversations = chat.read_conversations(f"{tmp_path}/*.gz,{tmp_path}/*.parquet")
    assert [c.where for c in conversations] == [
        "a.jsonl.gz:1",
        "a.jsonl.gz:2",
        "a.jsonl.gz:11",
        "b.parquet:row 1",
        "c.parquet:row 1",
    ]
    assert conversations[1].messages == (
        {"role": "user", "content": "Where is the cat?"},
        {"role": "assistant", "content": "Under the red tree."},
    )
    assert conversations[2].train_from == 4
    assert conversations[3].messages == tuple(CONVERSATIONS["system, two turns"])
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning == (
        f"warning: data.train_files: skipped 10 of 15 conversations of {tmp_path}/a.jsonl.gz, "
        f"{tmp_path}/b.parquet, {tmp_path}/c.parquet: 1 not UTF-8 (first at a.jsonl.gz:12), "
        "1 not a JSON object (first at a.jsonl.gz:3), 2 neither messages nor prompt and "
        "completion (first at a.jsonl.gz:4), 1 empty conversation (first at a.jsonl.gz:5), "
        "1 message without a role (first at a.jsonl.gz:6), 1 unknown role (first at "
        "a.jsonl.gz:7), 1 content not a string (first at a.jsonl.gz:8), 1 no assistant "
        "message (first at a.jsonl.gz:9), 1 assistant message first (first at a.jsonl.gz:10)"
    )
    # The same files, the same digest; another file, another.
    again = chat.read_conversations(f"{tmp_path}/*.gz,{tmp_path}/*.parquet")
    assert again.digest == conversations.digest
    assert chat.read_conversations(f"{tmp_path}/*.parquet").digest != conversations.digest


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"text": "a"}\n', r"no usable conversation in {f}: 1 neither messages nor prompt"),
        (b"", r"no usable conversation in {f} \(it is empty\)"),
    ],
)
def test_a_file_without_a_conversation_is_an_error(tmp_path, content, message):
    (tmp_path / "ok.jsonl").write_text(json.dumps({"messages": CONVERSATIONS["one turn"]}))
    (tmp_path / "z.jsonl").write_bytes(content)
    with pytest.raises(
        ConfigError, match="^data.train_files: " + message.format(f=tmp_path / "z.jsonl")
    ):
        chat.read_conversations(f"{tmp_path}/*.jsonl")


def test_parquet_without_the_columns_is_an_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match="has neither a 'messages' column nor 'prompt' and"):
        chat.read_conversations(str(tmp_path / "t.parquet"))


def test_documents_skip_long_conversations_and_cache_their_counts(
    families, tmp_path, capsys, monkeypatch
):
    rows = [{"messages": m} for m in CONVERSATIONS.values()] + [PROMPT_COMPLETION]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations = chat.read_conversations(str(tmp_path / "c.jsonl"))
    encoder = families["llama3"][2]
    counts = chat.conversation_lengths(str(tmp_path / "cache"), conversations, encoder)
    encoded = [encoder.encode(c) for c in conversations]
    assert counts.tolist() == [[len(ids), int(mask.sum())] for ids, mask in encoded]
    # Cached: the counts come back without rendering a conversation.
    monkeypatch.setattr(chat.ChatEncoder, "encode", None)
    again = chat.conversation_lengths(str(tmp_path / "cache"), conversations, encoder)
    np.testing.assert_array_equal(again, counts)
    monkeypatch.undo()

    long = int(counts[1, 0])  # the two-turn conversation is the longest
    documents = chat.ChatDocuments(conversations, encoder, counts, long - 1)
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning == (
        f"warning: data.train_files: skipped 1 of 4 conversations of {tmp_path}/c.jsonl: "
        f"1 longer than data.max_length={long - 1} (first at c.jsonl:2: {long} tokens)"
    )
    assert documents.index.tolist() == [0, 2, 3]
    assert documents.lengths.tolist() == counts[[0, 2, 3], 0].tolist()
    (ids, mask), (ids3, _) = documents.tokens_and_masks([0, 2])
    assert ids.tolist() == encoded[0][0].tolist() and mask.tolist() == encoded[0][1].tolist()
    assert ids3.tolist() == encoded[3][0].tolist()
    assert [t.tolist() for t in documents.tokens([1])] == [encoded[2][0].tolist()]
    # Picklable, for input workers: the same tokens after a round trip.
    copied = pickle.loads(pickle.dumps(documents))
    assert copied.tokens([0])[0].tolist() == ids.tolist()
    shortest = int(counts[:, 0].min())
    with pytest.raises(ConfigError, match=f"shortest has {shortest} tokens"):
        chat.ChatDocuments(conversations, encoder, counts, shortest - 1)


def test_the_pipeline_packs_whole_conversations_and_learns_their_answers_only(families, tmp_path):
    # The chat pipeline as a run opens it: rows of whole conversations, a target weighed
    # only where it is an answer's token (its content and end of turn) of its own
    # conversation; the same rows on 2 processes as on 1.
    from conftest import data_section, open_pipeline

    from trainer.input.language import pipeline

    directory, reference, _ = families["llama3"]
    rows = [{"messages": list(m)} for m in CONVERSATIONS.values()] * 20
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = data_section(
        "chat",
        tmp_path / "tfds",
        train_files=str(tmp_path / "chats.jsonl"),
        eval_files="",
        eval_holdout=0.1,
        document="line",
        text_field="text",
        tokenizer=directory,
        vocab_size=0,
        max_length=96,
        num_eval_rows=-1,
        tokenized_dir="",
        train_on_prompts=False,
    )
    data = open_pipeline(pipeline.make_language_data, config, 8)
    batch = next(data.train)
    data.train.close()
    weighed = 0
    for inputs, targets, segments, weights in zip(
        batch["inputs"], batch["targets"], batch["segmentation"], batch["weights"], strict=True
    ):
        for s in np.unique(segments[segments > 0]):
            at = segments == s
            ids = inputs[at].tolist()
            assert ids[0] == reference.bos_token_id  # a whole conversation: from its start
            learnt = targets[at][weights[at] == 1].tolist()
            text = reference.decode(learnt)
            weighed += len(learnt)
            # Every learnt target is an answer's token, and the ends of turns are learnt.
            assert "<|start_header_id|>" not in text and "user" not in text.split()
            assert text.count("<|eot_id|>") >= 1
    assert weighed > 0
    shares = [
        next(
            open_pipeline(
                pipeline.make_language_data, config, 8, process_index=p, process_count=2
            ).train
        )
        for p in range(2)
    ]
    for key in batch:
        np.testing.assert_array_equal(np.concatenate([s[key] for s in shares]), batch[key])
