"""Hugging Face's tensor names and layouts of a Llama-family model, and ours.

A Hugging Face ``nn.Linear`` stores ``[out, in]``; ours store the contraction's input
dim first and keep heads as a dim: the query/key/value projections are ``[heads,
head_dim, embed]`` (Hugging Face's ``[heads * head_dim, embed]``, reshaped: no
transpose), the output projection ``[heads, head_dim, embed]`` (theirs ``[embed,
heads * head_dim]``, transposed), the MLP ``[embed, mlp]`` and ``[mlp, embed]``
(transposed). Both use the rotate-half form of RoPE (``models/rope.py``), so the
query and key rows need no permutation: Hugging Face's conversion from Meta's
interleaved checkpoints already permuted them for it.

Names are one module per layer here (``layers_3/attention/query``); a model whose
layers are stacked (``layers/attention/query``, ``[layers, ...]``) takes them through
:mod:`models.stacking`, which this mapping feeds.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

_LAYER = re.compile(r"^layers_(\d+)/(.+)$")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One of our parameters as Hugging Face stores it.

    Attributes:
      name: its Hugging Face name.
      shape: its shape there.
      to_ours: their array -> ours.
      to_theirs: ours -> theirs.
      ours: its shape here.
    """

    name: str
    shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_theirs: Callable[[np.ndarray], np.ndarray]
    ours: tuple[int, ...]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _transposed(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def _heads(heads: int, head_dim: int) -> tuple[Callable, Callable]:
    """[heads * head_dim, ...] <-> [heads, head_dim, ...]."""
    return (
        lambda x: x.reshape(heads, head_dim, *x.shape[1:]),
        lambda x: x.reshape(heads * head_dim, *x.shape[2:]),
    )


def _out(heads: int, head_dim: int) -> tuple[Callable, Callable]:
    """[embed, heads * head_dim] <-> [heads, head_dim, embed]."""
    return (
        lambda x: np.ascontiguousarray(x.T).reshape(heads, head_dim, x.shape[0]),
        lambda x: np.ascontiguousarray(x.reshape(heads * head_dim, x.shape[-1]).T),
    )


def per_layer(model) -> dict[str, Tensor]:
    """Our per-layer parameter names (``layers_i/...``, and the tables and final norm)
    of a decoder ``model`` (``config.model``), each with its Hugging Face tensor."""
    v, e, m = model.vocab_size, model.emb_dim, model.mlp_dim
    h, k, d = model.num_heads, model.num_kv_heads, model.head_dim
    query, key = _heads(h, d), _heads(k, d)
    same, transposed = (_same, _same), (_transposed, _transposed)
    # ours: (their name, their shape, (to ours, to theirs), our shape)
    tables = {
        "token_embedding/embedding": ("model.embed_tokens.weight", (v, e), same, (v, e)),
        "final_norm/scale": ("model.norm.weight", (e,), same, (e,)),
    }
    if not model.tie_embeddings:
        tables["output_embedding/embedding"] = ("lm_head.weight", (v, e), same, (v, e))
    names = {}
    for i in range(model.num_layers):
        hf = f"model.layers.{i}."
        layer = {
            "attention_norm/scale": (f"{hf}input_layernorm.weight", (e,), same, (e,)),
            "mlp_norm/scale": (f"{hf}post_attention_layernorm.weight", (e,), same, (e,)),
            "attention/query": (f"{hf}self_attn.q_proj.weight", (h * d, e), query, (h, d, e)),
            "attention/key": (f"{hf}self_attn.k_proj.weight", (k * d, e), key, (k, d, e)),
            "attention/value": (f"{hf}self_attn.v_proj.weight", (k * d, e), key, (k, d, e)),
            "attention/out": (f"{hf}self_attn.o_proj.weight", (e, h * d), _out(h, d), (h, d, e)),
            "mlp/gate": (f"{hf}mlp.gate_proj.weight", (m, e), transposed, (e, m)),
            "mlp/up": (f"{hf}mlp.up_proj.weight", (m, e), transposed, (e, m)),
            "mlp/down": (f"{hf}mlp.down_proj.weight", (e, m), transposed, (m, e)),
        }
        if model.qkv_bias:
            layer |= {
                "attention/query_bias": (f"{hf}self_attn.q_proj.bias", (h * d,), query, (h, d)),
                "attention/key_bias": (f"{hf}self_attn.k_proj.bias", (k * d,), key, (k, d)),
                "attention/value_bias": (f"{hf}self_attn.v_proj.bias", (k * d,), key, (k, d)),
            }
        tables |= {f"layers_{i}/{ours}": spec for ours, spec in layer.items()}
    for ours, (theirs, shape, (to_ours, to_theirs), mine) in tables.items():
        names[ours] = Tensor(theirs, shape, to_ours, to_theirs, mine)
    return names


def layer_of(name: str) -> tuple[int, str] | None:
    """``(i, rest)`` of a per-layer name ``layers_i/rest``; None for the others."""
    match = _LAYER.match(name)
    return (int(match[1]), match[2]) if match else None
