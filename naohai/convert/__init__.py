"""Published PanGu-alpha / PengCheng-Mind checkpoints in and out: names and layouts (``names``),
their files (``files``), and copying weights into and out of a built model (``weights``)."""

from naohai.model import families as _families

# The published formats (``naohai ckpt import --from``, ``ckpt export --format``) the model families
# name (pangu-alpha, pengcheng-mind); here, without the modules' numpy and MindSpore imports, so the
# command line can list them cheaply.
FORMATS = tuple(fmt for name in _families.names() for fmt in _families.get(name).checkpoint_formats)
