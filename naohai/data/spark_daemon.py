"""The Spark engine's Python daemon (``spark.python.daemon.module``): PySpark's own daemon, started after the
per-document steps' modules are imported and jieba's dictionary is loaded, so that every Python worker it forks
has them (about 0.9 CPU-seconds a worker otherwise, measured on this project's 2-core VM)."""
from pyspark import daemon

from naohai.data import quality, spark_engine  # noqa: F401  (imported for the workers to inherit)

if __name__ == "__main__":
    quality.load_segmenter()
    daemon.manager()
