"""The decoder: published sizes to the parameter, documents that never see each other,
layer stacks, the key/value cache, and its FLOP count against XLA's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import llama
from models import decoder, generate, losses, rope
from trainer.tasks import language_model

TINY = decoder.DecoderConfig(
    vocab_size=97,
    num_layers=2,
    emb_dim=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=48,
    rope_theta=10_000.0,
    max_len=64,
    dtype=jnp.float32,
    scan_layers=False,
)
PUBLISHED = {  # Meta's model cards, as Hugging Face's models count them
    "llama3.2-1b": 1_235_814_400,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_named_sizes_have_their_published_parameter_counts(size):
    cfg = language_model.model_config(llama.get_config(size))
    assert decoder.param_count(cfg) == PUBLISHED[size]
    # The model itself, its shapes only, agrees with the formula.
    shapes = jax.eval_shape(
        lambda: decoder.Decoder(cfg).init(jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32))
    )
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)) == PUBLISHED[size]


@pytest.mark.parametrize("size", list(PUBLISHED))
def test_named_sizes_match_hugging_face_counts(size):
    # An independent count: transformers' LlamaConfig of the same size, built on the
    # meta device (shapes only, no memory).
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = language_model.model_config(llama.get_config(size))
    hf = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.emb_dim,
        intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[size]


def params_of(cfg, seed=0):
    ids = jnp.ones((1, 8), jnp.int32)
    return decoder.Decoder(cfg).init(jax.random.PRNGKey(seed), ids)["params"]


def test_a_document_never_sees_another_in_its_row():
    # Three documents packed in one row; a token of the middle one changes.
    model, params = decoder.Decoder(TINY), params_of(TINY)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 97, (1, 24)).astype(np.int32)
    segments = np.repeat(np.array([[1, 2, 3]]), 8, axis=1).astype(np.int32)
    positions = np.tile(np.arange(8), 3)[None].astype(np.int32)
    changed = ids.copy()
    changed[0, 11] = (ids[0, 11] + 1) % 97
    args = dict(positions=positions, segment_ids=segments)
    before = np.asarray(model.apply({"params": params}, ids, **args))
    after = np.asarray(model.apply({"params": params}, changed, **args))
    np.testing.assert_array_equal(before[:, :8], after[:, :8])  # document 1: exactly
    np.testing.assert_array_equal(before[:, 16:], after[:, 16:])  # document 3: exactly
    assert not np.array_equal(before[:, 11:16], after[:, 11:16])  # its own later tokens see it
    np.testing.assert_array_equal(before[:, 8:11], after[:, 8:11])  # and the earlier do not
    # Each document computes what it does alone, at its positions.
    alone = np.asarray(model.apply({"params": params}, ids[:, 16:]))
    np.testing.assert_allclose(before[:, 16:], alone, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_layer_stacks_compute_what_the_layers_do(kv_heads):
    per_layer = dataclasses.replace(TINY, num_kv_heads=kv_heads)
    stacked = dataclasses.replace(per_layer, scan_layers=True)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 16)), jnp.int32)
    from models import stacking

    variables = stacking.init_like_unscanned(
        decoder.Decoder(stacked), decoder.Decoder(per_layer), {"params": jax.random.PRNGKey(3)}, ids
    )
    want = decoder.Decoder(per_layer).apply(
        decoder.Decoder(per_layer).init(jax.random.PRNGKey(3), ids), ids
    )
    got = decoder.Decoder(stacked).apply(jax.tree.map(lambda x: x, variables), ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_heads_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        dataclasses.replace(TINY, num_kv_heads=3)


def test_llama3_scaling_leaves_short_wavelengths_and_stretches_long_ones():
    base = rope.inverse_frequencies(64, 500_000.0)
    scaled = rope.inverse_frequencies(64, 500_000.0, rope.Llama3Scaling(8.0, 1.0, 4.0, 8192))
    wavelength = 2 * np.pi / base
    np.testing.assert_array_equal(scaled[wavelength < 8192 / 4], base[wavelength < 8192 / 4])
    np.testing.assert_allclose(scaled[wavelength > 8192], base[wavelength > 8192] / 8, rtol=1e-6)
    middle = (wavelength >= 2048) & (wavelength <= 8192)
    assert middle.any() and np.all(scaled[middle] < base[middle])
    assert np.all(scaled[middle] > base[middle] / 8)


def generated(cfg, params, prompts, pad, **kw):
    model = decoder.Decoder(dataclasses.replace(cfg, decode=True))
    return np.asarray(
        generate.generate(
            model,
            params,
            jnp.asarray(prompts),
            jnp.asarray(pad),
            eos_id=kw.pop("eos_id", 1),
            seed=jax.random.PRNGKey(kw.pop("seed", 0)),
            rows=jnp.arange(len(prompts)),
            **kw,
        )
    )


def test_the_cache_gives_what_recomputing_the_sequence_gives():
    # Greedy with the cache, prompts of different lengths left-padded in one batch,
    # against a loop that runs the whole sequence again for every token.
    cfg = dataclasses.replace(TINY, scan_layers=True)
    params = params_of(cfg, seed=5)
    rng = np.random.default_rng(2)
    lengths = [5, 9, 2]
    width = 12
    prompts = np.zeros((3, width), np.int32)
    texts = [rng.integers(2, 97, n).astype(np.int32) for n in lengths]
    for r, text in enumerate(texts):
        prompts[r, width - len(text) :] = text
    pad = np.array([width - n for n in lengths], np.int32)
    new = 10
    got = generated(
        cfg,
        params,
        prompts,
        pad,
        max_new_tokens=new,
        eos_id=0,
        sampling=generate.Sampling(),
    )
    # The whole sequence at a fixed width: causal attention leaves the zeros after it unseen.
    forward = jax.jit(lambda ids: decoder.Decoder(cfg).apply({"params": params}, ids))
    for r, text in enumerate(texts):
        sequence = list(text)
        for _ in range(new):
            ids = np.zeros((1, width + new), np.int32)
            ids[0, : len(sequence)] = sequence
            logits = forward(jnp.asarray(ids))
            token = int(np.argmax(np.asarray(logits)[0, len(sequence) - 1]))
            sequence.append(token)
            if token == 0:
                break
        want = sequence[len(text) :]
        assert got[r, : len(want)].tolist() == want, r


def test_greedy_is_the_argmax_of_teacher_forcing_and_samples_follow_the_seed():
    cfg = dataclasses.replace(TINY, scan_layers=True)
    params = params_of(cfg, seed=7)
    prompts = np.random.default_rng(3).integers(2, 97, (4, 8)).astype(np.int32)
    pad = np.zeros(4, np.int32)
    out = generated(
        cfg, params, prompts, pad, max_new_tokens=6, eos_id=0, sampling=generate.Sampling()
    )
    full = np.concatenate([prompts, out], axis=1)
    logits = np.asarray(decoder.Decoder(cfg).apply({"params": params}, jnp.asarray(full)))
    np.testing.assert_array_equal(out, logits[:, 7:13].argmax(-1))
    sampling = generate.Sampling(temperature=1.0, top_k=20, top_p=0.9)
    one = generated(cfg, params, prompts, pad, max_new_tokens=6, eos_id=0, sampling=sampling)
    again = generated(cfg, params, prompts, pad, max_new_tokens=6, eos_id=0, sampling=sampling)
    other = generated(
        cfg, params, prompts, pad, max_new_tokens=6, eos_id=0, sampling=sampling, seed=1
    )
    np.testing.assert_array_equal(one, again)
    assert not np.array_equal(one, other)


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.split(jax.random.PRNGKey(0), 2000)
    picks = np.asarray(generate.choose(logits, keys, generate.Sampling(1.0, top_k=2)))
    assert set(picks.tolist()) == {0, 1} and 0.55 < np.mean(picks == 0) < 0.70  # 0.5 / 0.8
    picks = np.asarray(generate.choose(logits, keys, generate.Sampling(1.0, top_p=0.9)))
    assert set(picks.tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.9: the third is needed
    assert np.asarray(generate.choose(logits[:1], keys[:1], generate.Sampling())).tolist() == [0]


def test_the_flop_count_is_what_xla_counts_for_the_step():
    # The model FLOPs of MFU (MaxText's convention, causal attention halved) against
    # XLA's count of the compiled forward and backward pass of one row: XLA counts
    # the full attention square, elementwise work and the softmax as well.
    cfg = dataclasses.replace(
        TINY,
        num_layers=2,
        emb_dim=64,
        mlp_dim=256,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        vocab_size=512,
    )
    length = 32
    model = decoder.Decoder(cfg)
    ids = jnp.ones((1, length), jnp.int32)
    params = params_of(cfg)

    def loss(params):
        # A real loss: with sum(logits), XLA turns the output matmul's backward into sums.
        targets = (ids * 7 + 3) % cfg.vocab_size
        logits = model.apply({"params": params}, ids)
        return losses.cross_entropy_and_metrics(logits, targets, jnp.ones(ids.shape))[0]

    cost = jax.jit(jax.grad(loss)).lower(params).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    ours = decoder.train_flops_per_token(cfg, length) * length
    full_attention = decoder.train_flops_per_token(cfg, length, causal_half=False) * length
    # XLA's is ours with the whole square, plus elementwise work (softmax, norms: 3%).
    assert ours < full_attention <= cost["flops"] < 1.05 * full_attention, cost["flops"]


def test_bf16_logits_are_the_float32_logits_rounded_and_come_back_in_float32():
    # model.logits_dtype=bfloat16 (MaxText's logits_dot_in_fp32: false): the output
    # projection's product is rounded to bf16, then cast to float32 for the loss.
    config = llama.get_config("synthetic")
    config.model.update(vocab_size=97, logits_dtype="bfloat16")
    assert language_model.model_config(config).logits_dtype == jnp.bfloat16
    wide = dataclasses.replace(TINY, dtype=jnp.bfloat16)
    narrow = dataclasses.replace(wide, logits_dtype=jnp.bfloat16)
    params = params_of(wide)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 16)), jnp.int32)
    exact = np.asarray(decoder.Decoder(wide).apply({"params": params}, ids))
    rounded = decoder.Decoder(narrow).apply({"params": params}, ids)
    assert exact.dtype == rounded.dtype == np.float32
    rounded = np.asarray(rounded)
    assert not np.array_equal(rounded, exact)
    np.testing.assert_array_equal(rounded, rounded.astype(jnp.bfloat16).astype(np.float32))
    # One rounding of the float32 product: at most half a bf16 step (2^-8 relative) away.
    np.testing.assert_allclose(rounded, exact, rtol=2**-8, atol=1e-6)
