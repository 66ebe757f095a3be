"""Checkpoints: per-rank sharded saves with a manifest, verified resume, resharding, merge, export.

A checkpoint is a folder ``<run>/checkpoints/step_<N>/`` (see :mod:`naohai.checkpoint.store`).
"""
