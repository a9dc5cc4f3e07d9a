"""Test configuration shared by every test.

* TRITON_INTERPRET=1 is set before anything imports triton, when no CUDA device is present,
  so every Triton kernel runs (slowly, exactly) on the CPU.
* No model hub (HF_HUB_OFFLINE=1, with TOKENIZERS_PARALLELISM=false: the repository's
  conftest.py sets both for the tests and the notebooks alike). Models are the bundled SmolLM2 or
  tiny random-weight checkpoints written here with transformers.
* ``@pytest.mark.gpu`` tests are skipped cleanly without CUDA.
"""

import os

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from minivllm.model_hub import bundled_model_path  # noqa: E402
from minivllm.testing import TINY_PRESETS, make_checkpoint  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def bundled_path() -> str:
    """The bundled SmolLM2-135M-Instruct as a Hugging Face folder (converted once)."""
    return bundled_model_path()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, bundled_path) -> dict[str, str]:
    """Tiny random-weight checkpoints of every supported family, with a real tokenizer."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        name: make_checkpoint(str(root / name), name, tokenizer_from=bundled_path, seed=i)
        for i, name in enumerate(TINY_PRESETS)
    }


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def bundled_llm(bundled_path):
    """One engine on the bundled model, shared by the tests that only read from it."""
    from minivllm import LLM

    return LLM(bundled_path, show_progress=False)
