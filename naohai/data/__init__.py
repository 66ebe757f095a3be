"""Data: corpus sources, the sentencepiece tokenizer, packed token shards and the loader.

- :mod:`naohai.data.corpus`    sources -> documents
- :mod:`naohai.data.tokenizer` train / load a tokenizer with exact round trips
- :mod:`naohai.data.prepare`   documents -> packed train/valid shards + meta.json
- :mod:`naohai.data.loader`    deterministic, rank-aware, resumable window batches
- :mod:`naohai.data.pipeline`  recipe -> (prepared_dir, tokenizer), as the trainer needs
"""
