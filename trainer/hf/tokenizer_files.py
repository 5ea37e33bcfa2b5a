"""A run's tokenizer as Hugging Face's files: ``tokenizer.json`` and ``tokenizer_config.json``.

A run that tokenized with a Hugging Face ``tokenizer.json`` keeps it, and its files go
out as they came. A SentencePiece model (the one a run trains on its corpus, or one
given by path) is written as the ``tokenizers`` library's equivalent: its unigram
pieces and scores, its normalization (the precompiled character map, runs of spaces
made one, the ends stripped) and its word boundaries (``▁`` before every word), so
that ``AutoTokenizer`` gives the same ids as SentencePiece does (tested on the run's
text). Its special pieces (pad, EOS, UNK, BOS, and ``<mask>``) become special tokens,
and encoding with special tokens adds BOS, as Llama's tokenizer does.
"""

from __future__ import annotations

import json

from trainer.errors import ConfigError
from trainer.input import tokenizer as tokenizer_lib


def files(tokenizer: tokenizer_lib.TextTokenizer) -> dict[str, bytes]:
    """The Hugging Face tokenizer files of a run's ``tokenizer`` (name -> bytes; not
    ``generation_config.json``, which the export writes itself).

    Raises:
      ConfigError: no tokenizer, or one this module cannot write (a SentencePiece
        BPE model): before anything is written.
    """
    if "tokenizer.json" in tokenizer.files:
        return {
            name: tokenizer.files[name]
            for name in tokenizer_lib.HF_FILES
            if name in tokenizer.files and name != tokenizer_lib.GENERATION_FILE
        }
    if tokenizer_lib.SPM_FILE in tokenizer.files:
        return from_sentencepiece(tokenizer.files[tokenizer_lib.SPM_FILE], tokenizer.source)
    raise ConfigError("--format hf: the run kept no tokenizer to export")


def from_sentencepiece(model_proto: bytes, source: str = "the run") -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of a unigram SentencePiece model.

    Raises:
      ConfigError: a SentencePiece model of another kind (Llama 2's BPE): give the
        run the ``tokenizer.json`` that transformers' converter writes for it.
    """
    import tokenizers  # noqa: PLC0415  (only for exports)
    from sentencepiece import sentencepiece_model_pb2  # noqa: PLC0415
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors  # noqa: PLC0415

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    if proto.trainer_spec.model_type != proto.trainer_spec.UNIGRAM:
        kind = proto.trainer_spec.ModelType.Name(proto.trainer_spec.model_type)
        raise ConfigError(
            f"--format hf: the tokenizer.model of {source} is a SentencePiece {kind} model, "
            "which this export writes no tokenizer.json for (unigram only); nothing was "
            "written. Train the run with the model's tokenizer.json (data.tokenizer: "
            "AutoTokenizer.from_pretrained(...).save_pretrained(DIR) writes one)"
        )
    vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    tokenizer = tokenizers.Tokenizer(
        models.Unigram(vocab, unk_id=proto.trainer_spec.unk_id, byte_fallback=False)
    )
    spec = proto.normalizer_spec
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)]
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip()]
    tokenizer.normalizer = normalizers.Sequence(steps)
    scheme = "always" if spec.add_dummy_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    kinds = {
        "pad_token": proto.trainer_spec.pad_id,
        "eos_token": proto.trainer_spec.eos_id,
        "unk_token": proto.trainer_spec.unk_id,
        "bos_token": proto.trainer_spec.bos_id,
    }
    specials = {kind: proto.pieces[i].piece for kind, i in kinds.items() if i >= 0}
    if tokenizer_lib.MASK_PIECE in {p.piece for p in proto.pieces}:
        specials["mask_token"] = tokenizer_lib.MASK_PIECE
    tokenizer.add_special_tokens(list(specials.values()))
    if "bos_token" in specials:
        bos = specials["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, proto.trainer_spec.bos_id)],
        )
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
    return {
        "tokenizer.json": tokenizer.to_str().encode(),
        "tokenizer_config.json": json.dumps(settings, indent=2).encode(),
    }
