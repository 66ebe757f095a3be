"""The Spark engine's Python daemon (``spark.python.daemon.module``).  With a local master, the driver's zygote
forks the daemon with everything below already loaded, and this process only stands in for it
(:mod:`naohai.data.spark_zygote`); otherwise, or when the zygote cannot be reached, PySpark's own daemon, started after the
per-document steps' modules are imported, jieba's dictionary is loaded (about 0.9 CPU-seconds a worker otherwise,
measured on this project's 2-core VM) and the run's models are loaded (:func:`naohai.data.spark_engine.preload`),
so that every Python worker it forks has them, and after those objects
are frozen out of the garbage collector's sight, as are the models each worker loads later
(:func:`naohai.data.spark_engine.freeze_loads`: PySpark's workers collect after every task).

Spark puts its ``pyspark.zip`` and ``py4j-*-src.zip`` first on the workers' ``PYTHONPATH``; Python compiles
modules imported from a zip on every start (no bytecode cache), which made this daemon's start 1.5 s instead of
1.0 s.  When the same versions are installed as packages (``pip install pyspark``, as on a local master), the
zips are dropped from ``sys.path`` before PySpark is imported; otherwise they stay.  PySpark's warning about
pandas 3 is hidden, as in the driver (:func:`naohai.data.spark_driver.quiet_pyspark`)."""
import os
import sys

from naohai.data.spark_zygote import ZYGOTE_ENV, stand_in  # standard library only: cheap before the stand-in

if __name__ == "__main__" and os.environ.get(ZYGOTE_ENV):
    _code = stand_in(os.environ[ZYGOTE_ENV])       # the driver's zygote forks the daemon with all loaded
    if _code is not None:
        sys.exit(_code)

import zipfile  # noqa: E402
from importlib.machinery import PathFinder  # noqa: E402
from typing import List  # noqa: E402

from naohai.data.spark_driver import quiet_pyspark  # noqa: E402


def without_spark_zips(path: List[str]) -> List[str]:
    """``path`` without Spark's pyspark / py4j zips when each package is found elsewhere on it with the same
    ``version.py``; else ``path`` unchanged."""
    zips = [p for p in path if p.endswith(".zip") and os.path.basename(p).startswith(("pyspark", "py4j"))]
    rest = [p for p in path if p not in zips]
    for z in zips:
        pkg = "pyspark" if os.path.basename(z).startswith("pyspark") else "py4j"
        spec = PathFinder.find_spec(pkg, rest)
        if spec is None or not spec.submodule_search_locations:
            return path
        try:
            with zipfile.ZipFile(z) as zf:
                zipped = zf.read(f"{pkg}/version.py")
            with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py"), "rb") as fh:
                installed = fh.read()
        except (OSError, KeyError, zipfile.BadZipFile):
            return path
        if zipped != installed:
            return path
    return rest


sys.path[:] = without_spark_zips(sys.path)
quiet_pyspark()

from pyspark import daemon  # noqa: E402

from naohai.data import quality, spark_engine  # noqa: E402,F401  (imported for the workers to inherit)

if __name__ == "__main__":
    quality.load_segmenter()
    spark_engine.preload(os.environ)
    spark_engine.freeze_loads()
    daemon.manager()
