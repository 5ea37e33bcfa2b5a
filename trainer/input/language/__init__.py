"""A language model's input: documents joined into one token stream, cut into rows.

By concern: ``options`` (the data config's keys), ``documents`` (tokenizer, tokens and
lengths), ``stream`` (which pieces of which documents a row holds), ``features`` (a
decoder's or BERT's batch from rows) and ``pipeline`` (this process's batches).

Training, per process, for global row ``r`` of the one seeded order:

* every document is ``BOS, its tokens, EOS`` (either left out where the tokenizer has
  none); epoch ``e`` shuffles the documents with a generator seeded by ``(seed, e)``
  and joins them into one stream;
* row ``r`` of an epoch is the stream's tokens ``[r L, r L + L + 1)`` for rows of
  ``L = data.max_length`` tokens (one more: the last token's target), a decoder's; or
  ``[r L, r L + L)`` for a masked language model's. Rows do not cross epochs (an
  epoch's last partial row is dropped);
* a row holds pieces of one or more documents, told apart by segment ids (1, 2, ...
  in the row; 0 = padding), with positions restarting at 0 in each piece: attention
  never crosses a document (``models/decoder.py``), and a target is counted only
  where it continues its own document (EOS -> the next BOS is not learnt);
* each process computes only the rows of its block of each global batch
  (:mod:`trainer.input.order`), and tokenizes only their documents.

The rows need each document's token count: computed once per corpus and tokenizer
and cached beside the tokenizer (as the translation pipeline caches its pairs'), or
read from a prepared token store (:mod:`trainer.input.token_store`, ``python -m
trainer.data.prepare``: corpora larger than memory, memory-mapped). So the batches
are a function of the seed and the global batch index alone: the same on any number
of processes and workers, and the input position (a checkpoint's) is that index.

Eval: the eval documents in file order, joined and cut the same way, the first
``data.num_eval_rows`` rows (-1: all), process ``p`` of ``n`` owning rows ``p, p+n,
...`` in padded batches.

A masked language model's rows (BERT) mask 15% of their tokens (at most
``max_predictions``): 80% become the mask token, 10% a random token, 10% stay, all
drawn from a generator seeded by the global row, so they too are the same anywhere.

Batches are dicts of int32 arrays: ``inputs``, ``targets``, ``segmentation``,
``positions`` ([rows, L]) and ``weights`` (1 where a target counts); a masked model's
``inputs``, ``segmentation``, ``positions`` and ``masked_positions``, ``masked_ids``,
``masked_weights`` ([rows, max_predictions]).
"""
