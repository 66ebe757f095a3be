"""Data: corpus sources, the sentencepiece tokenizer, packed token shards and the loader.

- :mod:`naohai.data.clean`     raw .jsonl/.txt(.gz) -> cleaned .jsonl shards + report (steps in
  ``clean_config``, ``reader``, ``normalize``, ``quality``, ``pii``, ``fasttext_models``, ``dedup``)
- :mod:`naohai.data.spark_engine` the same clean on Apache Spark (``spark_driver`` starts and stops Spark,
  ``spark_daemon`` is its Python workers' daemon, ``hadoop_inputs`` reads Hadoop paths)
- :mod:`naohai.data.mix`       cleaned sources + weights -> a deterministic mixture file
- :mod:`naohai.data.corpus`    sources (including mixture files) -> documents
- :mod:`naohai.data.tokenizer` train / load a tokenizer with exact round trips
- :mod:`naohai.data.prepare`   documents -> packed train/valid shards + meta.json
- :mod:`naohai.data.loader`    deterministic, rank-aware, resumable window batches
- :mod:`naohai.data.sft`       conversations (.jsonl) -> packed windows with a loss mask, and their loader
- :mod:`naohai.data.pipeline`  recipe -> (prepared_dir, tokenizer), as the trainer needs
"""
