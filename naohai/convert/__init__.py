"""Published PanGu-alpha / PengCheng-Mind checkpoints in and out: names and layouts (``names``),
their files (``files``), and copying weights into and out of a built model (``weights``)."""

# The published formats (``naohai ckpt import --from``, ``ckpt export --format``); here, without the
# modules' numpy and MindSpore imports, so the command line can list them cheaply.
FORMATS = ("pangu-alpha", "pengcheng-mind")
