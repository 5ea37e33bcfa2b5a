"""A Hugging Face model's ``config.json`` as the keys of our ``config.model``, and back.

Three architectures: ``LlamaForCausalLM`` (Llama 2, 3, 3.1, 3.2 and their RoPE
scaling), ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` (biases on the query, key
and value projections). Every field of their ``config.json`` is one of:

* mapped onto a key of ``config.model`` (:data:`MAPPED`);
* refused, by name and value, where its value changes the computation in a way this
  decoder does not implement (an activation other than SiLU, biases on the output or
  MLP projections, RoPE scalings other than Llama 3's or linear, per-layer sliding
  windows, quantization, attention dropout);
* read elsewhere (the tokenizer's special ids) or of no effect on the computation
  (:data:`NO_EFFECT`: bookkeeping, generation defaults, the storage dtype);
* anything else is refused too: a field this importer does not know may change
  what the model computes.

This module reads JSON only (no JAX), so that a config file can build its model
config from a model directory (``configs/llama.py:hf=DIR``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainer.errors import ConfigError

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
FILE = "config.json"
GENERATION_FILE = "generation_config.json"

# config.json field -> config.model key (read by model_keys).
MAPPED = {
    "vocab_size": "vocab_size",
    "hidden_size": "emb_dim",
    "intermediate_size": "mlp_dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_len",
    "tie_word_embeddings": "tie_embeddings",
    "initializer_range": "init_std",
    "rope_theta": "rope_theta",
    "rope_parameters": "rope_theta",
    "rope_scaling": "rope_scaling_factor",
    "sliding_window": "sliding_window",
}
# Fields that say nothing about what the model computes (bookkeeping of transformers,
# the dtype the file stores, generation defaults older configs carry), or that the
# tokenizer reads (special ids).
NO_EFFECT = frozenset(
    (
        "architectures",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "dtype",
        "torch_dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "finetuning_task",
        "prefix",
        "task_specific_params",
        "torchscript",
        "tf_legacy_loss",
        "pruned_heads",
        "use_bfloat16",
        "tokenizer_class",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "pretraining_tp",
        "max_window_layers",
        "use_sliding_window",
        "layer_types",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
        "attention_dropout",
        "quantization_config",
    )
)


def read(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model directory.

    Raises:
      ConfigError: no ``config.json`` there, or one that is not a JSON object.
    """
    path = os.path.join(os.fspath(directory), FILE)
    if not os.path.isfile(path):
        raise ConfigError(
            f"{directory} is not a Hugging Face model directory: it has no {FILE} "
            "(a model saved with save_pretrained has config.json, *.safetensors and its "
            "tokenizer files)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path} is not JSON ({' '.join(str(e).split())})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def is_model_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model directory (a ``config.json`` naming
    ``architectures``), not a run's or an Orbax export's (whose ``config.json`` is ours)."""
    if "://" in os.fspath(path) or not os.path.isfile(os.path.join(os.fspath(path), FILE)):
        return False
    try:
        return "architectures" in read(path)
    except ConfigError:
        return False


def run_config(directory: str | os.PathLike):
    """The run config of a Hugging Face model directory: ``configs/llama.py:hf=DIR``
    (its ``config.json`` as ``config.model``, its weights, its tokenizer), for the
    commands that take one where they take a run (generate, evaluate, export).

    Raises:
      ConfigError: naming the first field of its ``config.json`` that cannot be mapped.
    """
    from configs import llama  # noqa: PLC0415  (configs import this module: not at its top)

    return llama.get_config(f"hf={os.fspath(directory)}")


def read_model_keys(directory: str | os.PathLike) -> dict[str, Any]:
    """:func:`model_keys` of the ``config.json`` in ``directory`` (errors name the file).

    Raises:
      ConfigError: no ``config.json``, or a field of it that cannot be mapped.
    """
    return model_keys(read(directory), os.path.join(os.fspath(directory), FILE))


def _refuse(path: str, field: str, value: Any, why: str) -> None:
    raise ConfigError(f"{path}: {field}={json.dumps(value)} is not supported: {why}")


def architecture(hf: dict[str, Any], path: str = FILE) -> str:
    """``llama``, ``mistral`` or ``qwen2``, from ``architectures``.

    Raises:
      ConfigError: another architecture (or none).
    """
    names = hf.get("architectures") or []
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        _refuse(
            path,
            "architectures",
            names,
            f"this importer takes {', '.join(ARCHITECTURES)} (decoder-only models of the "
            "Llama family)",
        )
    return ARCHITECTURES[names[0]]


def _number(hf: dict[str, Any], field: str, path: str, kind: type, low: float, default=None):
    """``hf[field]`` (``default`` where it is missing or null), checked: a number of
    ``kind`` (an int for ``int``) of at least ``low`` (above 0 for a float ``low`` of 0).

    Raises:
      ConfigError: naming the file, the field and its value.
    """
    value = hf.get(field)
    if value is None:
        if default is None:
            raise ConfigError(f"{path}: {field} is missing (a Llama-family config.json gives it)")
        return default
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int and not (isinstance(value, int) and not isinstance(value, bool)):
        numeric = isinstance(value, float) and value.is_integer()
    if not numeric or value < low or (kind is float and low == 0 and value <= 0):
        what = "a positive" if low > 0 or kind is float else "a non-negative"
        noun = "integer" if kind is int else "number"
        raise ConfigError(f"{path}: {field}={json.dumps(value)} must be {what} {noun}")
    return kind(value)


_LLAMA3_KEYS = {
    "factor": (float, 0.0),
    "low_freq_factor": (float, 0.0),
    "high_freq_factor": (float, 0.0),
    "original_max_position_embeddings": (int, 1),
}


def _rope(hf: dict[str, Any], path: str) -> dict[str, Any]:
    """The RoPE keys of ``config.model``: ``rope_parameters`` (transformers 5) or
    ``rope_theta`` with ``rope_scaling`` (earlier)."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(field) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{path}: {field}={json.dumps(params)} is not an object")
    theta = _number(
        params if "rope_theta" in params else hf, "rope_theta", path, float, 0.0, 10_000.0
    )
    kind = params.get("rope_type", params.get("type", "default"))
    keys: dict[str, Any] = {"rope_theta": theta, "rope_scaling_factor": 0.0}
    if kind == "default":
        return keys
    if kind != "llama3":
        _refuse(path, field, params, f"RoPE type {kind!r}: this decoder has llama3's only")
    missing = [key for key in _LLAMA3_KEYS if params.get(key) is None]
    if missing:
        raise ConfigError(
            f"{path}: {field} has no {', '.join(missing)}: llama3 RoPE scaling needs "
            f"{', '.join(_LLAMA3_KEYS)}"
        )
    where = f"{path}: {field}"
    scaling = {key: _number(params, key, where, *spec) for key, spec in _LLAMA3_KEYS.items()}
    return keys | {
        "rope_scaling_factor": scaling["factor"],
        "rope_low_freq_factor": scaling["low_freq_factor"],
        "rope_high_freq_factor": scaling["high_freq_factor"],
        "rope_original_context": scaling["original_max_position_embeddings"],
    }


def model_keys(hf: dict[str, Any], path: str = FILE) -> dict[str, Any]:
    """The keys of ``config.model`` (``name="decoder"`` and the model's sizes) that
    compute what ``hf`` describes.

    Raises:
      ConfigError: naming the file and the first field (and its value) that cannot
        be mapped: refused, missing, of the wrong type or out of range.
    """
    arch = architecture(hf, path)
    unknown = sorted(set(hf) - set(MAPPED) - NO_EFFECT)
    if unknown:
        _refuse(
            path,
            unknown[0],
            hf[unknown[0]],
            "a field this importer does not know (it may change what the model computes)",
        )
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(path, "hidden_act", hf["hidden_act"], "the MLP here is SwiGLU (silu)")
    for field in ("mlp_bias", "attention_bias"):
        if hf.get(field):
            _refuse(path, field, hf[field], "biases on the MLP or the output projection")
    if hf.get("attention_dropout"):
        _refuse(path, "attention_dropout", hf["attention_dropout"], "this decoder has no dropout")
    if hf.get("quantization_config"):
        _refuse(path, "quantization_config", hf["quantization_config"], "quantized weights")
    if arch == "qwen2" and hf.get("use_sliding_window"):
        _refuse(path, "use_sliding_window", True, "sliding windows on some layers only")
    sizes = {
        key: _number(hf, field, path, int, 1)
        for field, key in (
            ("vocab_size", "vocab_size"),
            ("num_hidden_layers", "num_layers"),
            ("hidden_size", "emb_dim"),
            ("num_attention_heads", "num_heads"),
            ("intermediate_size", "mlp_dim"),
        )
    }
    heads = sizes["num_heads"]
    head_dim = _number(hf, "head_dim", path, int, 1, sizes["emb_dim"] // heads or None)
    kv_heads = _number(hf, "num_key_value_heads", path, int, 1, heads)
    if heads % kv_heads:
        _refuse(
            path, "num_key_value_heads", kv_heads, f"it must divide num_attention_heads={heads}"
        )
    window = _number(hf, "sliding_window", path, int, 0, 0) if arch == "mistral" else 0
    tie = hf.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{path}: tie_word_embeddings={json.dumps(tie)} must be true or false")
    return {
        "name": "decoder",
        **sizes,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _number(hf, "rms_norm_eps", path, float, 0.0, 1e-6),
        "qkv_bias": arch == "qwen2",
        "mlp_activation": "swiglu",
        "parallel_block": False,
        "tie_embeddings": tie,
        "max_len": _number(hf, "max_position_embeddings", path, int, 1, 2048),
        "init_std": _number(hf, "initializer_range", path, float, 0.0, 0.02),
        "sliding_window": window,
        **_rope(hf, path),
    }


def hf_config(
    model: Any,
    *,
    bos_id: int | None,
    eos_id: int | None,
    dtype: str,
    pad_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of our ``config.model`` (a decoder's): ``LlamaForCausalLM``,
    or ``Qwen2ForCausalLM`` where the query, key and value have biases, or
    ``MistralForCausalLM`` with a sliding window.

    RoPE is written twice: ``rope_parameters`` (transformers 5) and the older
    ``rope_theta`` with ``rope_scaling``, which earlier readers (transformers 4, vLLM,
    llama.cpp's converter) read instead.

    Raises:
      ConfigError: a model these architectures cannot hold (a parallel block, a ReLU
        MLP: MaxText's measured model is not a Llama).
    """
    if model.parallel_block or model.mlp_activation != "swiglu":
        raise ConfigError(
            "--format hf: a parallel block or a ReLU MLP is not a Llama, Mistral or Qwen2 "
            "model: no Hugging Face architecture of these holds it"
        )
    if model.qkv_bias and model.sliding_window:
        raise ConfigError("--format hf: q/k/v biases with a sliding window: no such model")
    arch = (
        "Qwen2ForCausalLM"
        if model.qkv_bias
        else ("MistralForCausalLM" if model.sliding_window else "LlamaForCausalLM")
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(model.rope_theta)}
    if model.rope_scaling_factor > 0:
        rope = {
            "rope_type": "llama3",
            "rope_theta": float(model.rope_theta),
            "factor": float(model.rope_scaling_factor),
            "low_freq_factor": float(model.rope_low_freq_factor),
            "high_freq_factor": float(model.rope_high_freq_factor),
            "original_max_position_embeddings": int(model.rope_original_context),
        }
    config = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        "vocab_size": int(model.vocab_size),
        "hidden_size": int(model.emb_dim),
        "intermediate_size": int(model.mlp_dim),
        "num_hidden_layers": int(model.num_layers),
        "num_attention_heads": int(model.num_heads),
        "num_key_value_heads": int(model.num_kv_heads),
        "head_dim": int(model.head_dim),
        "hidden_act": "silu",
        "max_position_embeddings": int(model.max_len),
        "initializer_range": float(model.init_std),
        "rms_norm_eps": float(model.rms_norm_eps),
        "tie_word_embeddings": bool(model.tie_embeddings),
        "rope_parameters": rope,
        "rope_theta": float(model.rope_theta),
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}
        if model.rope_scaling_factor > 0
        else None,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": dtype,
        "use_cache": True,
    }
    if arch == "LlamaForCausalLM":
        config |= {"attention_bias": False, "mlp_bias": False}
    if arch == "MistralForCausalLM":
        config["sliding_window"] = int(model.sliding_window)
    if arch == "Qwen2ForCausalLM":
        config |= {"use_sliding_window": False, "sliding_window": None}
    return config


def generation_config(
    *, bos_id: int | None, eos_id: int | list[int] | None, pad_id: int | None = None
) -> dict[str, Any]:
    """``generation_config.json``: the special ids ``generate`` starts at, stops at (one
    or a list) and pads with."""
    return {
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "do_sample": False,
    }
