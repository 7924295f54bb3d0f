"""Install mpzero: `pip install -e .` (add `[test]` for the test suite, `[hf]` for the Hugging Face tools, `[wandb]`
for --wandb-project, `[parquet]` for parquet input to tools/preprocess_data.py, `[fp8]` for --fp8-format)."""
from setuptools import find_packages, setup

setup(
    name="mpzero",
    version="0.1.0",
    description="GPT pretraining with Megatron-style tensor parallelism and ZeRO data parallelism",
    python_requires=">=3.10",
    packages=find_packages(include=["mpzero", "mpzero.*"]),
    # torch: any release from 2.4 on; the CPU wheel on disk (2.13) satisfies it, users keep their CUDA build.
    # sentencepiece (0.2.3: the pybind11 build whose batch encode returns numpy arrays), tokenizers (GPT-2
    # BPE from local files only), tqdm: mpzero.data and tools/;
    # pyyaml: --config files; tensorboard: --tensorboard-dir; crc32c: checkpoint checksums (hardware CRC-32C,
    # ~5x zlib's CRC-32; without it mpzero falls back to zlib).
    install_requires=["torch>=2.4,<3", "numpy>=1.24", "sentencepiece>=0.2.3", "tokenizers>=0.15", "tqdm>=4.60",
                      "pyyaml>=5.4", "tensorboard>=2.10", "crc32c>=2.2"],
    # triton: the fused kernels (mpzero.fused); pinned to the release torch 2.13's CUDA wheel pins.
    # hf: tools/export_hf.py, tools/import_hf.py (safetensors) and the tests that compare with transformers'
    # GPT2LMHeadModel; never needed for training. wandb: --wandb-project; pyarrow: parquet corpora in
    # tools/preprocess_data.py (never needed for training); torchao: --fp8-format's float8 casts and GEMMs (0.18: the
    # release tested, pure Python for float8 training, its casts run on CPUs too). The test extra has them all: their
    # tests run in `make test`.
    extras_require={"test": ["pytest>=7", "pytest-timeout>=2", "transformers>=4.40", "safetensors>=0.4",
                             "wandb>=0.17", "pyarrow>=14", "torchao>=0.18"],
                    "fp8": ["torchao>=0.18"],
                    "triton": ["triton==3.7.1"], "hf": ["transformers>=4.40", "safetensors>=0.4"],
                    "wandb": ["wandb>=0.17"], "parquet": ["pyarrow>=14"]},
)
