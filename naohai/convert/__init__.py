"""Published PanGu-alpha / PengCheng-Mind checkpoints in and out: names and layouts (``names``),
their files (``files``), and copying weights into and out of a built model (``weights``)."""
