"""naohai: declarative parallel strategies and a small exact trainer for PanGu-alpha /
PengCheng-Mind style decoder-only LLMs on MindSpore."""

__version__ = "0.1.0"
