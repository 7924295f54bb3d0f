"""Install mpzero: `pip install -e .` (add `[test]` for the test suite, `[hf]` for the Hugging Face tools, `[wandb]`
for --wandb-project, `[parquet]` for parquet input to tools/preprocess_data.py, `[fp8]` for --fp8-format)."""
from setuptools import find_packages, setup

setup(
    name="mpzero",
    version="0.1.0",
    description="GPT pretraining with Megatron-style tensor parallelism and ZeRO data parallelism",
    python_requires=">=3.10",
    packages=find_packages(include=["mpzero", "mpzero.*"]),
    # torch: any release from 2.10 on (mpzero reads users' files with torch.load(weights_only=True), which runs code
    # from a crafted file before 2.6, CVE-2025-32434, and corrupts memory before 2.10, CVE-2026-24747); the CPU
    # wheel on disk (2.13) satisfies it, users keep their CUDA build.
    # sentencepiece (0.2.3: the pybind11 build whose batch encode returns numpy arrays), tokenizers (GPT-2
    # BPE from local files only), tqdm: mpzero.data and tools/;
    # pyyaml: --config files; tensorboard: --tensorboard-dir; crc32c: checkpoint checksums (hardware CRC-32C,
    # ~5x zlib's CRC-32; without it mpzero falls back to zlib). Every floor admits no release with a known advisory
    # (checked once against the PyPA/GitHub advisory databases, 2026-11): tqdm 4.66.3 (CVE-2024-34062), sentencepiece
    # 0.2.1 (CVE-2026-1260: 0.2.3 is above it), pyyaml 5.4 (CVE-2020-14343), numpy 1.22 (CVE-2021-41495/41496: 1.24
    # is above), none known for tokenizers, tensorboard, crc32c, safetensors, wandb.
    install_requires=["torch>=2.10,<3", "numpy>=1.24", "sentencepiece>=0.2.3", "tokenizers>=0.15", "tqdm>=4.66.3",
                      "pyyaml>=5.4", "tensorboard>=2.10", "crc32c>=2.2"],
    # triton: the fused kernels (mpzero.fused); pinned to the release torch 2.13's CUDA wheel pins.
    # hf: tools/export_hf.py, tools/import_hf.py (safetensors) and the tests that compare with transformers'
    # GPT2LMHeadModel; never needed for training. wandb: --wandb-project; pyarrow: parquet corpora in
    # tools/preprocess_data.py (never needed for training); torchao: --fp8-format's float8 casts and GEMMs (0.18: the
    # release tested, pure Python for float8 training, its casts run on CPUs too). The test extra has them all: their
    # tests run in `make test`.
    # megatron-core (and psutil, which its checkpoint writer needs without declaring it): the tests of
    # tools/import_megatron.py save real megatron-core checkpoints on the CPU; the tool itself never imports it.
    # Floors past the advisories: pyarrow 14.0.1 (CVE-2023-47248: 14.0.0 unpickles a parquet file's extension-type
    # metadata), transformers 4.53.0 (CVE-2023-6730/7018, CVE-2024-11392..11394 deserialization, and the ReDoS series
    # fixed through 4.53.0), pytest 9.0.3 (CVE-2025-71176: predictable /tmp/pytest-of-USER), psutil 5.9 (past
    # CVE-2019-18874). megatron-core is the exception: Megatron-LM's checkpoint loading runs code from a crafted file
    # before 0.17.1 (CVE-2026-65110/65180), and the index this project installs from has no release past 0.16.1; the
    # tests only save checkpoints of their own models with it and never load one: raise it to 0.17.1 once there is.
    extras_require={"test": ["pytest>=9.0.3", "pytest-timeout>=2", "transformers>=4.53.0", "safetensors>=0.4",
                             "wandb>=0.17", "pyarrow>=14.0.1", "megatron-core>=0.16", "psutil>=5.9", "torchao>=0.18"],
                    "fp8": ["torchao>=0.18"],
                    "triton": ["triton==3.7.1"], "hf": ["transformers>=4.53.0", "safetensors>=0.4"],
                    "wandb": ["wandb>=0.17"], "parquet": ["pyarrow>=14.0.1"]},
)
