"""Hugging Face model folders in and out: ``config.json``, ``*.safetensors`` shards, tokenizer files.

:mod:`.folder` reads and writes the folder (sharded safetensors with their index, half
precision upcast to float32 master weights, the tokenizer files copied); :mod:`.arch`
holds one :class:`~.arch.Architecture` per supported ``model_type`` (how its
``config.json`` maps to a :class:`~naohai.config.ModelConfig` and its tensors to naohai
parameters), registered by the modules of this package named after the families and looked up
through :mod:`.registry`;
:mod:`.convert` joins the two for ``naohai ckpt import --from hf`` / ``export --to hf``.

No torch and no transformers: the files are read with numpy and written with the
``safetensors`` package.
"""
