"""Training data: what a training rank reads, and in which order.

Two sources, one loader interface (`next_batch`: this data rank's micro-batches of the next global batch;
`state_dict`: a few integers that name no rank):
  text.py        a text file, folder or .jsonl (or the embedded default corpus: the standard library's
                 sources) read, tokenized and packed in memory at start-up; `BatchLoader`
  prepare.py     `meshlm data prepare`: text, .jsonl(.gz/.zst) and .parquet sources tokenized once, in worker
                 processes, into token shards (sources.py reads them, manifest.py is the format)
  dataset.py     prepared shards memory-mapped as samples; blends of several by weight (permutation.py: the
                 seeded shuffle computed per position, nothing the size of the corpus is built)
  loader.py      `PreparedLoader`: `BatchLoader`'s walk over prepared data, a step ahead in a thread
  chat.py        conversations rendered by a chat template, the loss on the assistant's turns
  show.py        `meshlm data show`: samples as training reads them, the counted targets marked
The command line is `meshlm.cli.data`.
"""
