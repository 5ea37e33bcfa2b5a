"""A model's chat template: the Jinja text shipped with its tokenizer, rendered exactly as
``transformers``' ``apply_chat_template`` renders it, without importing transformers.

Where the template comes from, as transformers loads it: the directory's
``chat_template.jinja``; else ``tokenizer_config.json``'s ``chat_template`` (a string, or
a list of named templates, of which the one named ``default``); else, for a model
trained here that has none, :data:`FALLBACK`.

How it renders, as transformers' ``utils/chat_template_utils.py`` does (3.1.6's Jinja):
a sandboxed, immutable environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and a ``{% generation %}`` tag that writes its body; the
globals ``raise_exception`` (the template refuses the conversation), ``strftime_now``,
``dict`` and ``namespace`` (both without a way to Python's internals); a ``tojson``
that leaves non-ASCII and HTML characters as they are; and the variables ``messages``
(messages without their None-valued keys, reasoning also under ``thinking`` and
``reasoning_content``), ``tools`` and ``documents`` (None), ``add_generation_prompt``
and the tokenizer's special tokens as strings (``bos_token``, ``eos_token``, ... and any
other ``*_token`` of ``tokenizer_config.json``).

One difference, by design: ``strftime_now`` formats a fixed instant (:data:`DATE`
unless given), not the clock. A template that writes today's date (Llama 3.1's system
header) would otherwise give other tokens on another day, and the batches must be a
function of the seed and the step alone (an exact resume, the same rows on every host).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from trainer.errors import ConfigError
from trainer.input import tokenizer as tokenizer_lib
from trainer.workdir import storage

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# The instant strftime_now formats: the date Llama 3.1's own template falls back to.
DATE = datetime.datetime(2024, 7, 26)
_REASONING = ("reasoning_content", "thinking", "reasoning")
# Stands for an answer's content where its place in a rendering is looked for: a
# private-use character, which no template trims or escapes.
SENTINEL = "\ue000"

# For a model trained here without a template: Zephyr's layout. Its end of turn is the
# tokenizer's EOS, the one special token every tokenizer of ours has (check_tokenizer),
# so the generator stops at the id it already stops at and no token is added to the
# vocabulary (a new ``<|im_end|>`` would need an untrained embedding row). The role
# markers are plain text; BOS begins the conversation as it begins a pre-training
# document, where the tokenizer has one.
FALLBACK = (
    "{% if bos_token is defined and bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, transformers' marker of assistant text
    (TRL's training templates use it): it writes its body. Answers are found without it
    (:mod:`trainer.input.language.chat`), so any template works."""

    tags = {"generation"}

    def parse(self, parser):
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

    def _body(self, caller):
        return caller()


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, without the class itself
    (its attributes would lead a template to Python's internals)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing names that begin with ``_`` (a way to internals)."""

    def __init__(*args, **kwargs):  # Jinja's own signature: ``self`` may be a key
        self, args = args[0], args[1:]
        values = dict(*args, **kwargs)
        for name in values:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold {name!r}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The messages as transformers hands them to a template: keys whose value is None
    dropped, and a message's reasoning under each name templates read it by."""
    out = []
    for message in messages:
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def special_tokens(settings: Mapping[str, Any]) -> dict[str, str]:
    """The template variables a ``tokenizer_config.json`` names: each special token's
    string (``{"content": ...}``, as older configs write them, included)."""
    named = {}
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        if isinstance(settings.get(key), dict):  # a list names no variable
            named |= settings[key]
    named |= {key: value for key, value in settings.items() if key.endswith("_token")}
    out = {}
    for key, value in named.items():
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template with the variables it is rendered with (picklable).

    Attributes:
      text: the Jinja source.
      variables: the special tokens' strings, by name (``bos_token``, ``eos_token``...).
      source: where it was read from, for messages.
      fallback: whether ``text`` is :data:`FALLBACK` (the model shipped none).
      date: the instant ``strftime_now`` formats.
    """

    text: str
    variables: dict[str, str]
    source: str
    fallback: bool = False
    date: datetime.datetime = DATE

    def __post_init__(self):
        self._compiled()  # a template that does not compile fails at once, not at step 1
        if self.fallback and not self.variables.get("eos_token"):
            raise ConfigError(
                f"{self.source} has no chat template, and the fallback one ends each turn "
                "with the tokenizer's eos_token, which it does not name"
            )

    def _compiled(self) -> jinja2.Template:
        compiled = self.__dict__.get("_template")
        if compiled is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[_Generation, jinja2.ext.loopcontrols],
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = self.date.strftime
            env.globals["dict"] = _Dict()
            env.globals["namespace"] = _Namespace
            try:
                compiled = env.from_string(self.text)
            except jinja2.TemplateSyntaxError as e:
                raise ConfigError(
                    f"the chat template of {self.source} does not compile (line {e.lineno}: "
                    f"{e.message})"
                ) from None
            object.__setattr__(self, "_template", compiled)  # a cache, not state
        return compiled

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_template"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def digest(self) -> str:
        """Of everything that decides the rendered text (names caches of token counts)."""
        key = json.dumps([self.text, self.variables, self.date.isoformat()], sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    @property
    def files(self) -> dict[str, bytes]:
        """What a run keeps and an export writes beside the tokenizer: the template."""
        return {TEMPLATE_FILE: self.text.encode()}

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        what: str = "a conversation",
    ) -> str:
        """The text of ``messages``, as ``apply_chat_template(messages, tokenize=False,
        add_generation_prompt=...)`` writes it.

        Raises:
          ConfigError: naming ``what``, with the template's message, if the template
            refuses the conversation (``raise_exception``) or fails on it.
        """
        try:
            return self._compiled().render(
                messages=_template_messages(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            raise ConfigError(f"the chat template of {self.source} fails on {what}: {e}") from None

    @functools.cached_property
    def answer_affixes(self) -> tuple[str, str]:
        """``(before, after)``: the text the template writes around an answer's content,
        between the generation prompt and it (Mistral's space), and after it up to
        trailing whitespace: the end of turn (``<|eot_id|>``, ``<|im_end|>``, ``</s>``),
        where a generator stops. Found by rendering a one-question conversation.

        Raises:
          ConfigError: the template fails on that conversation or leaves its answer out.
        """
        what = "a probe conversation"
        question = [{"role": "user", "content": "?"}]
        asked = self.render(question, add_generation_prompt=True, what=what)
        answer = {"role": "assistant", "content": SENTINEL}
        answered = self.render([*question, answer], what=what).rstrip()
        at = answered.find(SENTINEL, len(asked) if answered.startswith(asked) else 0)
        if at < 0:
            raise ConfigError(f"the chat template of {self.source} leaves an answer out")
        before = answered[len(asked) : at] if answered.startswith(asked) else ""
        return before, answered[at + len(SENTINEL) :]

    def end_of_turn(self) -> str:
        """The text the template writes after an answer's content: where a generator
        stops (see :attr:`answer_affixes`)."""
        return self.answer_affixes[1]


def tokenizer_specials(tokenizer) -> dict[str, str]:
    """``bos_token`` and ``eos_token`` as ``tokenizer`` writes them: the template
    variables of a tokenizer without a ``tokenizer_config.json`` (a SentencePiece model)."""
    return {
        f"{name}_token": tokenizer.piece(i)
        for name, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id))
        if i is not None
    }


def stop_ids(template: ChatTemplate, tokenizer) -> tuple[int, ...]:
    """Where an answer ends: ``tokenizer``'s stop ids (EOS), and the template's end of
    turn where it is one token (``<|eot_id|>``, ``<|im_end|>``)."""
    end_of_turn = tokenizer.token_id(template.end_of_turn())
    extra = [end_of_turn] if end_of_turn is not None else []
    return tuple(dict.fromkeys([*tokenizer.stop_ids, *extra]))


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def template_from_files(
    files: Mapping[str, bytes], source: str, specials: Mapping[str, str] | None = None
) -> ChatTemplate:
    """The chat template among a tokenizer's files (``chat_template.jinja``,
    ``tokenizer_config.json``: a model directory's, or a run's kept files), or the
    fallback.

    Args:
      files: file name -> bytes.
      source: where they came from, for messages.
      specials: variables for a tokenizer without a ``tokenizer_config.json`` (a
        SentencePiece model's ``<s>``, ``</s>``); the config's win.

    Raises:
      ConfigError: a config that is not a JSON object, a template file that is not
        UTF-8, several templates none named
        ``default``, or a template that does not compile.
    """
    settings = tokenizer_lib.json_object(files, CONFIG_FILE, source)
    variables = {**(specials or {}), **special_tokens(settings)}
    if TEMPLATE_FILE in files:
        try:
            text = files[TEMPLATE_FILE].decode()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{source}: {TEMPLATE_FILE} is not UTF-8 ({e})") from None
        return ChatTemplate(text, variables, source)
    text = settings.get("chat_template")
    if isinstance(text, list):  # [{"name": ..., "template": ...}], as transformers saves several
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(
                f"{source}: {CONFIG_FILE} has chat templates {sorted(map(str, named))} and "
                "none named 'default'"
            )
        text = named["default"]
    if isinstance(text, str):
        return ChatTemplate(text, variables, source)
    return ChatTemplate(FALLBACK, variables, source, fallback=True)


def load_chat_template(location: str, specials: Mapping[str, str] | None = None) -> ChatTemplate:
    """The chat template of the tokenizer at ``location`` (a model directory, or a file
    in one: ``data.tokenizer``), local or ``gs://``; the fallback where it has none.

    Raises:
      ConfigError: as :func:`template_from_files`.
    """
    path = storage.path(location)
    directory = path if path.is_dir() else path.parent
    files = {
        name: (directory / name).read_bytes()
        for name in (TEMPLATE_FILE, CONFIG_FILE)
        if (directory / name).exists()
    }
    return template_from_files(files, str(directory), specials)
