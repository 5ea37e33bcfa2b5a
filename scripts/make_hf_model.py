"""Makes a small random Hugging Face model directory with ``transformers`` itself: what
the README's fine-tuning recipe starts from where no real checkpoint is at hand, and
what the parity tests (tests/hf/) import and compare against.

The directory is what ``save_pretrained`` writes for a real model: ``config.json``,
``model.safetensors`` (sharded with its index when ``--max_shard_size`` is small),
``generation_config.json``, and a byte-level BPE tokenizer (``tokenizer.json``,
``tokenizer_config.json``, Llama 3's kind) trained on the sample text. Every weight is
random, the norms' scales and Qwen2's biases included (their defaults, ones and zeros,
would hide a mapping that mixes them up).

    python scripts/make_hf_model.py --out /tmp/tiny_llama [--architecture llama|mistral|qwen2]
"""

from __future__ import annotations

import argparse
import glob
import os

SAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "text", "train", "part-0.txt")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Llama 3 Instruct's chat format (its turn markers, special tokens of their own): what
# --chat_template llama3 gives the tokenizer, as a model you would fine-tune ships it.
CHAT_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def make_tokenizer(out: str, vocab_size: int, text_files: str = SAMPLE, chat: bool = False):
    """A byte-level BPE tokenizer of ``vocab_size`` ids trained on the lines of
    ``text_files`` (a glob of .txt files), saved in ``out``; returns it (transformers').
    With ``chat``, Llama 3's turn markers are special tokens and its chat template is
    saved with it."""
    import tokenizers  # noqa: PLC0415  (the script's own dependencies, the hf extra)
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, *(CHAT_TOKENS if chat else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = sorted(glob.glob(text_files))
    if not files:
        raise SystemExit(f"error: no text files match {text_files}")
    tokenizer.train(files, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS)
    if chat:
        fast.chat_template = LLAMA3_CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(
    out: str,
    architecture: str = "llama",
    *,
    vocab_size: int = 512,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 160,
    tie: bool = False,
    llama3_scaling: bool = False,
    sliding_window: int | None = None,
    max_positions: int = 128,
    dtype: str = "float32",
    max_shard_size: str = "5GB",
    seed: int = 0,
    text_files: str = SAMPLE,
    chat: bool = False,
):
    """Writes a random ``architecture`` model and its tokenizer to ``out``; returns
    the model (in float32, for a reference forward pass)."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    tokenizer = make_tokenizer(out, min(vocab_size, 512), text_files, chat=chat)
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rms_norm_eps=1e-5,
    )
    if head_dim is not None:
        settings["head_dim"] = head_dim
    if llama3_scaling:
        settings["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": max_positions // 4,
        }
    kinds = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_class, model_class = kinds[architecture]
    if architecture == "mistral":
        settings["sliding_window"] = sliding_window
    torch.manual_seed(seed)
    model = model_class(config_class(**settings))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif name.endswith(".bias"):
                parameter.normal_(0.0, 0.2)
    model.eval()
    model.generation_config.do_sample = False
    if chat:  # Llama 3 Instruct stops at the end of a turn as well as at EOS
        end_of_turn = tokenizer.convert_tokens_to_ids(CHAT_TOKENS[-1])
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    model.to(getattr(torch, dtype)).save_pretrained(out, max_shard_size=max_shard_size)
    return model.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--architecture", default="llama", choices=["llama", "mistral", "qwen2"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=160)
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--tie", action="store_true", help="tie the output table to the input")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chat_template",
        choices=["none", "llama3"],
        default="none",
        help="give the tokenizer Llama 3 Instruct's chat format (its turn markers and template)",
    )
    parser.add_argument("--max_positions", type=int, default=128)
    args = parser.parse_args()
    if os.path.exists(args.out) and os.listdir(args.out):
        raise SystemExit(f"error: {args.out} exists and is not empty")
    make_model(
        args.out,
        args.architecture,
        vocab_size=args.vocab_size,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        tie=args.tie,
        dtype=args.dtype,
        seed=args.seed,
        max_positions=args.max_positions,
        chat=args.chat_template == "llama3",
    )
    print(f"wrote a random {args.architecture} model and its tokenizer to {args.out}")


if __name__ == "__main__":
    main()
