"""flaxlm: Gin-configured, t5x-style training of language models in JAX."""

import setuptools

# Versions that must move together are pinned together: tensorflow and tensorflow-text
# share a minor version (seqio needs tensorflow-text, which requires the `tensorflow`
# wheel); jax and jaxlib are one release; flax/optax/orbax are the releases tested with
# that jax. One TensorFlow only: `tensorflow-cpu` beside `tensorflow` would unpack into the
# same folder, each overwriting the other's files. TensorFlow is only the input pipeline
# and never sees an accelerator (data.configure_tensorflow).
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "gin-config==0.5.0",
    "seqio==0.0.20",
    "tensorflow==2.21.0",
    "tensorflow-text==2.21.1",
    "tensorflow-datasets==4.9.10",
    # tf.summary writes event files only when TensorBoard is installed; TF 2.21 no
    # longer depends on it.
    "tensorboard==2.21.0",
    "transformers==5.23.0",
    # transformers' apply_chat_template (chat SFT, preference pairs, serve's chat completions)
    # needs jinja2 and does not require it.
    "jinja2>=3.1",
    "safetensors==0.8.0",
    # Structured outputs in `serve` (response_format, tool_choice required): the grammar
    # engine vLLM also offers (its `guidance` backend); no dependencies of its own.
    "llguidance==1.9.1",
    # Text metrics of seqio tasks (tasks/metrics.py).
    "sacrebleu==2.6.0",
    "rouge-score==0.1.2",
    "etils[epath]",
    "absl-py",
    "numpy",
]

EXTRAS_REQUIRE = {
    # torch==2.13.0 is the CPU build; a looser pin pulls a multi-GB CUDA build.
    "test": [
        "pytest",
        "pytest-xdist==3.8.0",
        # tests/conftest.py: the pytest workers share one trained tiny checkpoint.
        "filelock",
        "ruff",
        "torch==2.13.0",
        "wandb",
        # [api]: tests/test_openai_api.py scores through lm-eval's local-completions client.
        "lm_eval[api]==0.4.13",
        "datasets==5.2.0",
        # TRL's tokenization and collators: what an HF checkpoint's rows must equal
        # (tests/test_trl_parity.py).
        "trl==1.16.0",
        # tests/test_openai_api.py: the official client drives the server.
        "openai==3.57.0",
        # tests/test_peft.py: PEFT itself loads flaxlm's adapter exports and makes its imports.
        "peft==0.21.2",
        # tests/test_hf_compressed.py: llm-compressor's format, written and decompressed by
        # compressed-tensors itself (and transformers through it).
        "compressed-tensors==0.20.1",
        # libtpu, for test_benchmarks' FSDP collectives compiled for a TPU slice (no TPU).
        "jax[tpu]==0.10.2",
        # XLA:GPU, for test_plan's plan of a GPU cluster compiled with no GPU (gpu-compile).
        "jax-cuda12-plugin==0.10.2",
        "jax-cuda12-pjrt==0.10.2",
    ],
    # libtpu of the pinned jax: TPU training, and ahead-of-time compiles for a TPU slice
    # on any host (benchmarks' --tpu-topology).
    "tpu": ["jax[tpu]==0.10.2"],
    # XLA:GPU of the pinned jax, to compile for an NVIDIA GPU on any host (no GPU, driver or
    # CUDA libraries: `flaxlm.plan.aot.gpu_devices`, benchmarks/decode_hlo.py).
    "gpu-compile": ["jax-cuda12-plugin==0.10.2", "jax-cuda12-pjrt==0.10.2"],
    "wandb": ["wandb"],
    # tasks/hf_datasets.py: local HuggingFace `datasets` (save_to_disk, json, parquet).
    "hf_datasets": ["datasets==5.2.0"],
    # `python -m flaxlm.runs.harness`: lm-evaluation-harness with the `flaxlm` model.
    "lm_eval": ["lm_eval==0.4.13"],
}

setuptools.setup(
    name="flaxlm",
    version="0.1.0",
    description="Gin-configured pre-training and fine-tuning of language models in JAX",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["flaxlm", "flaxlm.*", "tasks", "tasks.*"])
    + ["flaxlm.gin"],
    # The repository's gin/ tree ships inside the package as flaxlm/gin, so that
    # `--gin_file=gptj_pretrain.gin` resolves from any directory once installed.
    package_dir={"flaxlm.gin": "gin"},
    package_data={"flaxlm.gin": ["*.gin", "*/*.gin"], "flaxlm.runs.serve": ["page.html"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
)
