"""Decoder-only language models of the Llama family, trained on your own text.

The published sizes, by name (Meta's model cards; parameter counts checked against
Hugging Face's LlamaConfig by tests/models/test_decoder.py):

  python -m trainer --config configs/llama.py:llama3-8b --workdir gs://bucket/run \\
      --config.data.train_files=gs://bucket/corpus/*.jsonl.gz \\
      --config.data.eval_files=gs://bucket/corpus/eval.jsonl.gz \\
      --config.data.tokenizer=gs://bucket/llama3/tokenizer.json

A laptop-sized variant that learns on the embedded corpus (generated locally):

  python -m trainer --config configs/llama.py:tiny --workdir /tmp/lm --cpu_devices 8

The same small model on a folder of your own text (the sample files of
examples/text/ by default; .txt, .jsonl or .parquet, gzip allowed), with a
SentencePiece vocabulary trained on it, evaluated on 1% of the documents held out
(``data.eval_holdout``) unless eval files are named:

  python -m trainer --config configs/llama.py:text --workdir /tmp/mylm --cpu_devices 8 \\
      [--config.data.train_files=/my/texts/*.txt --config.data.eval_files=/my/eval.txt]

A Hugging Face model you have on disk (Llama, Mistral or Qwen2: config.json,
*.safetensors and the tokenizer files), fine-tuned on your own text: the model is
built from its config.json, starts from its weights and tokenizes with its tokenizer,
with fine-tuning settings (Alpaca's: learning rate 2e-5, cosine, 3% warm-up, no weight
decay; 1,000 steps of 64 rows of at most 2,048 tokens):

  python -m trainer --config configs/llama.py:hf=/models/Llama-3.2-1B --workdir /tmp/ft \
      --config.data.train_files=/my/texts/*.jsonl --config.data.eval_files=/my/eval.jsonl

Instruction fine-tuning of a model you have on your conversations (.jsonl or .parquet
rows of {"messages": [...]} or {"prompt": ..., "completion": ...}), rendered with its
own chat template, the loss on the answers, three epochs (docs/chat.md):

  python -m trainer --config configs/llama.py:hf=/models/Llama-3.2-1B,chat \\
      --workdir /tmp/sft --config.data.train_files=/my/chats/*.jsonl

Variants, combinable with commas (``:llama3-8b,synthetic``): ``tiny``, ``text``,
``chat``, ``llama3.2-1b``, ``llama3-8b``, ``llama3-70b``, ``synthetic`` (random tokens:
no data, for trainer.bench and trainer.aot), and ``hf=DIR`` (a Hugging Face model
directory).
"""

import os

import ml_collections

from configs import common
from trainer.hf import config as hf_config

VARIANTS = {
    "tiny": "a 2-layer decoder on the embedded tiny_text corpus (~2 min on 2 CPU cores)",
    "text": "a small decoder on files of your own text: examples/text/ (or yours)",
    "llama3.2-1b": "Llama 3.2 1B: 16 layers, d 2048, 32/8 heads, 1,235,814,400 parameters",
    "llama3-8b": "Llama 3 8B: 32 layers, d 4096, 32/8 heads, 8,030,261,248 parameters",
    "llama3-70b": "Llama 3 70B: 80 layers, d 8192, 64/8 heads, 70,553,706,496 parameters",
    "synthetic": "random tokens: no dataset needed (for bench and aot)",
    "chat": "instruction fine-tuning on your conversations (with hf=DIR: the model's template)",
}
# Variants that take a value (``:hf=DIR``), for --list_configs.
OPTIONS = {
    "hf=DIR": "a Hugging Face model directory (config.json, weights, tokenizer), fine-tuned",
}
# The sample documents of the ``text`` variant (scripts/make_sample_text.py).
SAMPLE_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "text")

# Llama 3's tokenizer has 128,256 ids; its models share one RoPE and norm epsilon.
_LLAMA3 = dict(vocab_size=128_256, rope_theta=500_000.0, rms_norm_eps=1e-5)
# model.* of each published size: Meta's params.json / Hugging Face's config.json.
SIZES = {
    "llama3.2-1b": dict(
        **_LLAMA3,
        num_layers=16,
        emb_dim=2048,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        mlp_dim=8192,
        tie_embeddings=True,
        max_len=131_072,
        # Llama 3.2 extends Llama 3's 8k context with 3.1's frequency scaling (factor 32).
        rope_scaling_factor=32.0,
    ),
    "llama3-8b": dict(
        **_LLAMA3,
        num_layers=32,
        emb_dim=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=14_336,
        tie_embeddings=False,
        max_len=8192,
    ),
    "llama3-70b": dict(
        **_LLAMA3,
        num_layers=80,
        emb_dim=8192,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=28_672,
        tie_embeddings=False,
        max_len=8192,
    ),
}


def model_section(**overrides) -> ml_collections.ConfigDict:
    """``config.model`` of a decoder: every key of models/decoder.py's DecoderConfig."""
    model = ml_collections.ConfigDict(
        dict(
            name="decoder",  # the model family (models/decoder.py)
            vocab_size=128_256,  # token ids; the tokenizer's must fit
            num_layers=16,  # decoder layers
            emb_dim=2048,  # the residual stream's width (hidden_size)
            num_heads=32,  # query heads
            num_kv_heads=8,  # key/value heads (grouped-query attention; a divisor of num_heads)
            head_dim=64,  # channels per head
            mlp_dim=8192,  # the MLP's inner width (intermediate_size)
            rope_theta=500_000.0,  # RoPE's base
            # Llama 3.1's RoPE frequency scaling for long contexts; 0 = none.
            rope_scaling_factor=0.0,
            rope_low_freq_factor=1.0,  # wavelengths above original_context / this: scaled
            rope_high_freq_factor=4.0,  # wavelengths below original_context / this: kept
            rope_original_context=8192,  # the context RoPE was trained at
            rms_norm_eps=1e-5,  # the RMSNorms' epsilon
            qkv_bias=False,  # biases on the query, key and value projections (Qwen2)
            sliding_window=0,  # attend to this many tokens up to each (Mistral); 0 = all
            mlp_activation="swiglu",  # swiglu (Llama) | relu (one matrix in, one out)
            parallel_block=False,  # attention and MLP side by side on one norm (PaLM)
            tie_embeddings=True,  # the output table is the input table
            # dot (XLA) | flash (the Pallas TPU kernel: scores never in memory; TPU only)
            attention="dot",
            # The output projection's product: float32, or bfloat16 cast to float32 after
            # (half the bytes of the logits, rounded; MaxText's logits_dot_in_fp32=false).
            logits_dtype="float32",
            max_len=8192,  # the longest sequence the model takes
            init_std=0.02,  # standard deviation of every initial weight (Llama's)
            dtype="bfloat16",  # activations and matmuls
            param_dtype="float32",  # the master weights
            # Activation rematerialisation per layer: none | full | dots | dots_no_batch.
            remat="none",
            scan_layers=True,  # one nn.scan over the layers, parameters [layers, ...]
            scan_unroll=1,  # layers per iteration of that scan
        )
    )
    model.update(overrides)
    return model


def data_section(name: str = "text_files", **overrides) -> ml_collections.ConfigDict:
    """``config.data`` of a language model (trainer/input/language.py)."""
    data = common.data_config(
        name,
        worker_count=4,  # tokenizing a host's rows: a few workers keep up
        # Your documents: comma-separated globs (local or gs://) of .txt, .jsonl or .parquet
        # files, gzip allowed (trainer/input/text_files.py).
        train_files="",
        # Documents for eval loss and perplexity, the same forms; "" = hold out
        # eval_holdout of the training documents (seeded: the same on any process count).
        eval_files="",
        eval_holdout=0.01,  # the share of train_files held out when eval_files is ""
        # data.name="chat" (your conversations: trainer/input/language/chat.py): the loss
        # counts every token, not only the answers'.
        train_on_prompts=False,
        document="line",  # a .txt file holds a document a line | a blank_line between them
        text_field="text",  # the JSON key / Parquet column holding a document's text
        # A SentencePiece .model, a Hugging Face tokenizer.json, or a directory holding
        # one; "" = train a SentencePiece model of vocab_size pieces on the documents.
        tokenizer="",
        vocab_size=32_000,  # pieces of that trained model
        max_length=8192,  # tokens per row (documents joined, then cut)
        num_eval_rows=-1,  # eval rows (the first N of the eval documents); -1 = all
        # A token store written by python -m trainer.data.prepare (corpora larger than
        # memory, memory-mapped); "" = tokenize the training documents as rows need them.
        tokenized_dir="",
    )
    data.update(overrides)
    return data


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    """Returns the run config; ``variant`` is the text after ``:`` on the CLI."""
    parts, options = common.variant_options(variant, VARIANTS, ("hf",))
    config = common.base_config()
    # A Llama run's batch (Touvron et al. 2023, Llama 2, section 2.2: 4M tokens a step):
    # 512 rows of 8,192 tokens (Llama 3's context).
    config.global_batch_size = 512
    config.num_train_steps = 100_000
    config.steps_per_loop = 50
    config.log_every_steps = 50
    config.eval_every_steps = 2_000
    config.checkpoint_every_steps = 2_000
    config.model = model_section(**SIZES["llama3-8b"])
    config.data = data_section()
    # Llama 2's optimizer (section 2.2): AdamW, beta2 0.95, eps 1e-5, weight decay 0.1,
    # gradients clipped at 1.0, a cosine schedule to a tenth of the peak after 2,000
    # warm-up steps; the peak 3e-4 of its 7B and 13B (1.5e-4 for 70B, below).
    config.optimizer.update(
        name="adamw",
        learning_rate=3e-4,
        schedule="cosine",
        warmup_steps=2_000,
        end_learning_rate=3e-5,
        b1=0.9,
        b2=0.95,
        eps=1e-5,
        weight_decay=0.1,
        clip_norm=1.0,
    )
    config.mesh.rules = (
        ("batch", "data"),
        ("vocab", "model"),
        ("embed", None),
        ("activation_embed", None),  # the residual stream's features (models/decoder.py)
        ("mlp", "model"),
        ("heads", "model"),
        ("kv_heads", "model"),
        ("kv", None),
        ("length", None),
        ("layers", None),  # the stacked layers of model.scan_layers: never split
    )
    for size in ("llama3.2-1b", "llama3-70b"):
        if size in parts:
            config.model.update(SIZES[size])
    if "llama3-70b" in parts:
        config.optimizer.update(learning_rate=1.5e-4, end_learning_rate=1.5e-5)
    if "tiny" in parts or "text" in parts:
        config.global_batch_size = 32
        config.num_train_steps = 400
        config.steps_per_loop = 20
        config.log_every_steps = 100
        config.eval_every_steps = 200
        config.checkpoint_every_steps = 200
        config.eval_at_start = True
        config.model.update(
            vocab_size=384,
            num_layers=2,
            emb_dim=64,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            mlp_dim=192,
            rope_theta=10_000.0,
            rope_scaling_factor=0.0,
            tie_embeddings=True,
            max_len=128,
        )
        config.data.update(
            name="tiny_text", vocab_size=384, max_length=64, num_eval_rows=128, worker_count=0
        )
        config.optimizer.update(
            learning_rate=3e-3, warmup_steps=40, end_learning_rate=3e-4, weight_decay=0.01
        )
        config.optimizer.min_shard_bytes = 4096
    if "text" in parts:
        # Evaluated on a held-out 1% of the training documents, yours once you name them.
        config.data.update(
            name="text_files", train_files=os.path.normpath(os.path.join(SAMPLE_TEXT, "train", "*"))
        )
        # Twice as deep and wide, and longer, than tiny: enough to learn the sample's
        # translations word for word (a greedy continuation then gives them; tiny's
        # gets their grammar), in about 4 minutes on 2 CPU cores.
        config.global_batch_size = 64
        config.num_train_steps = 800
        config.eval_every_steps = 400
        config.checkpoint_every_steps = 400
        config.model.update(num_layers=4, emb_dim=128, head_dim=32, mlp_dim=384)
    if "hf" in options:
        # The model's own sizes (config.json, mapped or refused field by field), weights
        # and tokenizer (tokenizer.json through the tokenizers library, or tokenizer.model).
        directory = options["hf"]
        config.model.update(hf_config.read_model_keys(directory))
        config.init_from = directory
        config.data.tokenizer = directory
        config.data.max_length = min(config.data.max_length, 2048, config.model.max_len)
        # Full fine-tuning of a trained model, not pre-training: Stanford Alpaca's recipe
        # (tatsu-lab/stanford_alpaca, train.py's command: learning rate 2e-5, cosine to 0,
        # warm-up 3% of the steps, no weight decay, Hugging Face Trainer's AdamW defaults:
        # betas 0.9/0.999, eps 1e-8, gradients clipped at 1.0), 64 rows a step, 1,000 steps.
        config.global_batch_size = 64
        config.num_train_steps = 1_000
        config.steps_per_loop = 10
        config.log_every_steps = 50
        config.eval_every_steps = 200
        config.checkpoint_every_steps = 500
        config.optimizer.update(
            name="adamw",
            learning_rate=2e-5,
            schedule="cosine",
            warmup_steps=0,  # a --config.optimizer.warmup_steps of the user's wins
            warmup_ratio=0.03,
            end_learning_rate=0.0,
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            clip_norm=1.0,
        )
    if "chat" in parts:
        # Full-parameter instruction fine-tuning (supervised, on the answers): Alpaca's
        # three epochs over the conversations (tatsu-lab/stanford_alpaca; with hf=DIR its
        # optimizer settings above), whole conversations packed into the rows.
        config.data.update(name="chat", train_files="")
        config.num_train_epochs = 3.0
        config.eval_every_steps = 100
        config.checkpoint_every_steps = 500
    if "synthetic" in parts:
        config.data.name = "synthetic"
        config.data.worker_count = 0  # Random ids cost nothing to make.
        config.data.vocab_size = config.model.vocab_size
    return config
