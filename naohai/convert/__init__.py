"""Published checkpoints in and out: PanGu-alpha / PengCheng-Mind names and layouts (``names``),
their files (``files``), copying weights into and out of a built model (``weights``), and Hugging
Face folders of the families transformers implements (the ``hf`` package)."""

from naohai.model import families as _families

# The published formats (``naohai ckpt import --from``, ``ckpt export --format``) the model families
# name (pangu-alpha, pengcheng-mind); here, without the modules' numpy and MindSpore imports, so the
# command line can list them cheaply.
FORMATS = tuple(fmt for name in _families.names() for fmt in _families.get(name).checkpoint_formats)
