"""Real corpora for training: `prepare` tokenizes text sources once into memory-mapped token shards
(prepare.py, sources.py, manifest.py); `PreparedDataset`, `BlendedDataset` and `PreparedLoader` read them
back during training (dataset.py, permutation.py, loader.py); `meshlm data prepare` is cli.py.

Not responsible for: the in-memory corpora of `meshlm train`'s defaults (meshlm.train.data).
"""
