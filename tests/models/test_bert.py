"""BERT: BERT-large to the parameter, and the same logits as Hugging Face's
BertForMaskedLM (the original's post-LayerNorm encoder) on the same weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from configs import bert_large
from models import bert
from trainer.tasks import masked_lm

BERT_LARGE = 335_174_458  # Hugging Face's BertForMaskedLM of bert-large-uncased's config


def test_bert_large_has_its_parameter_count():
    cfg = masked_lm.model_config(bert_large.get_config())
    assert bert.param_count(cfg) == BERT_LARGE
    shapes = jax.eval_shape(
        lambda: bert.Bert(cfg).init(jax.random.PRNGKey(0), *[jnp.ones((1, 8), jnp.int32)] * 4)
    )
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)) == BERT_LARGE


def _hf(cfg):
    transformers = pytest.importorskip("transformers")
    return transformers.BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.emb_dim,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.mlp_dim,
        max_position_embeddings=cfg.max_len,
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def test_bert_large_matches_hugging_face_count():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(_hf(bert.BertConfig()))
    assert sum(p.numel() for p in model.parameters()) == BERT_LARGE


def _ours_from_hugging_face(state: dict, cfg: bert.BertConfig) -> dict:
    e, h = cfg.emb_dim, cfg.num_heads
    d = e // h

    def t(name):
        return state[name].detach().float().numpy()

    out = {
        "token_embedding/embedding": t("bert.embeddings.word_embeddings.weight"),
        "position_embedding/embedding": t("bert.embeddings.position_embeddings.weight"),
        "type_embedding/embedding": t("bert.embeddings.token_type_embeddings.weight"),
        "embedding_norm/scale": t("bert.embeddings.LayerNorm.weight"),
        "embedding_norm/bias": t("bert.embeddings.LayerNorm.bias"),
        "head_transform/kernel": t("cls.predictions.transform.dense.weight").T,
        "head_transform/bias": t("cls.predictions.transform.dense.bias"),
        "head_norm/scale": t("cls.predictions.transform.LayerNorm.weight"),
        "head_norm/bias": t("cls.predictions.transform.LayerNorm.bias"),
        "head_bias": t("cls.predictions.bias"),
    }
    for i in range(cfg.num_layers):
        hf, us = f"bert.encoder.layer.{i}.", f"layers_{i}/"
        for ours, theirs in (("query", "query"), ("key", "key"), ("value", "value")):
            out[us + ours] = t(hf + f"attention.self.{theirs}.weight").reshape(h, d, e)
            out[us + ours + "_bias"] = t(hf + f"attention.self.{theirs}.bias").reshape(h, d)
        out[us + "out"] = t(hf + "attention.output.dense.weight").T.reshape(h, d, e)
        out[us + "out_bias"] = t(hf + "attention.output.dense.bias")
        out[us + "attention_norm/scale"] = t(hf + "attention.output.LayerNorm.weight")
        out[us + "attention_norm/bias"] = t(hf + "attention.output.LayerNorm.bias")
        out[us + "intermediate/kernel"] = t(hf + "intermediate.dense.weight").T
        out[us + "intermediate/bias"] = t(hf + "intermediate.dense.bias")
        out[us + "output/kernel"] = t(hf + "output.dense.weight").T
        out[us + "output/bias"] = t(hf + "output.dense.bias")
        out[us + "output_norm/scale"] = t(hf + "output.LayerNorm.weight")
        out[us + "output_norm/bias"] = t(hf + "output.LayerNorm.bias")
    return traverse_util.unflatten_dict(out, sep="/")


def test_logits_equal_hugging_face_bert_for_masked_lm():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = dataclasses.replace(
        bert.BertConfig(
            vocab_size=101,
            num_layers=2,
            emb_dim=32,
            num_heads=4,
            mlp_dim=64,
            max_len=32,
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
        ),
        dtype=jnp.float32,
        scan_layers=False,
    )
    torch.manual_seed(0)
    reference = transformers.BertForMaskedLM(_hf(cfg)).eval()
    ids = np.random.default_rng(0).integers(0, 101, (2, 16))
    with torch.no_grad():
        want = reference(input_ids=torch.tensor(ids)).logits.numpy()
    params = _ours_from_hugging_face(reference.state_dict(), cfg)
    positions = np.broadcast_to(np.arange(16), (2, 16))
    everywhere = np.broadcast_to(np.arange(16), (2, 16))  # predict at every position
    got = bert.Bert(cfg).apply({"params": params}, ids, positions, np.ones_like(ids), everywhere)
    assert np.abs(np.asarray(got) - want).max() < 1e-4
