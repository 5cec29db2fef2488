"""Shared fixtures: a tiny random Llama target (tokenizer + model + saved HF dir), built once per session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# `auto` dtypes pick bf16 on CPUs with native bf16 and fp32 elsewhere; the suite pins fp32 so that what it asserts
# does not depend on which CPU runs it (tests/pipeline/test_precision.py covers the choice itself).
os.environ["DRAFTSMITH_CPU_BF16"] = "0"
# The device of the numerical tests is one switch, DRAFTSMITH_TEST_DEVICE (the `test_device` fixture). The pipeline's
# stages take CUDA whenever they see it (model.device=auto, the trainer's Accelerator), so without the switch the GPU
# is hidden from the session and they run on the CPU like the rest; with it, cuBLAS is made deterministic (the
# trainer's exact-resume test compares losses bit for bit).
if os.environ.get("DRAFTSMITH_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))


@pytest.fixture(scope="session")
def tiny_tok():
    from tests.tiny import tiny_tokenizer

    return tiny_tokenizer(seed=0)


@pytest.fixture(scope="module")
def tiny64(tiny_tok, test_device):
    """The decoding tests' real model: a tiny random Llama in float64 (greedy ties cannot flip), on the test device."""
    from tests.tiny import tiny_llama

    return tiny_llama(tiny_tok, seed=0, num_layers=4, dtype=torch.float64).to(test_device)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A saved tiny target directory, usable as `model.target`."""
    from tests.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"), seed=0, num_layers=2, hidden_size=64)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    # hash cache and HF caches stay inside the test's tmp dir
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _arithmetic_chats(n: int) -> list[dict]:
    return [
        {
            "id": f"q{i}",
            "messages": [
                {"role": "user", "content": f"Question {i}: what is {i} plus one?"},
                {
                    "role": "assistant",
                    "content": f"The answer is {i + 1}. Because math is the sum of numbers and time.",
                },
            ],
        }
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def write_chats():
    """`write_chats(path, n)`: n one-turn arithmetic chats as a JSONL data source (the training tests' data)."""
    import json

    def write(path, n: int):
        path.write_text("".join(json.dumps(r) + "\n" for r in _arithmetic_chats(n)))
        return path

    return write


@pytest.fixture(scope="session")
def test_device():
    """The device numerical tests run on: `DRAFTSMITH_TEST_DEVICE=cuda` runs them on a GPU (default cpu)."""
    name = os.environ.get("DRAFTSMITH_TEST_DEVICE", "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("DRAFTSMITH_TEST_DEVICE asks for CUDA, and this machine has none")
    return torch.device(name)
