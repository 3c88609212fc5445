"""Shared fixtures: the default core, and a real `flare run` server started as a user starts it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.servers import TEST_API_KEY, Server

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter. It must be on before any kernel module is imported,
    # whichever test module a worker collects first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]


def default_core() -> Path:
    return Path(os.environ.get("FLARE_CORE", ROOT / "cores" / "smollm2-135m"))


@pytest.fixture(scope="session")
def core_dir() -> Path:
    core = default_core()
    if not (core / "manifest.json").is_file():
        pytest.skip(f"no default core at {core} (make core builds it)")
    return core


@pytest.fixture(scope="session")
def fp32_core_dir(core_dir: Path) -> Path:
    """The default model with fp32 weights (transformers' parity and tensor parallelism need one): FLARE_FP32_CORE,
    else cores/smollm2-135m-fp32 (make core builds both), else the default core when it is itself dense."""
    from common.manifest import load_manifest

    core = Path(os.environ.get("FLARE_FP32_CORE", ROOT / "cores" / "smollm2-135m-fp32"))
    if (core / "manifest.json").is_file():
        return core
    if load_manifest(core_dir).quantization is None:
        return core_dir
    pytest.skip(f"no fp32 core at {core} (make core builds it)")


@pytest.fixture(scope="session")
def server(core_dir: Path):
    server = Server(core_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fp32_server(fp32_core_dir: Path):
    """A server of the fp32 core: for tests whose greedy tokens must not depend on what else runs in a step or what
    the prefix cache holds. A quantized core rounds activations to bfloat16 before every product, so the last-bit
    differences of CPU attention over other padding (torch's SDPA is not invariant to it) can flip a near tie;
    in fp32 they stay far below the margins (docs/cpu.md, "Batch invariance")."""
    server = Server(fp32_core_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def keyed_server(core_dir: Path):
    """A server started with --api-key TEST_API_KEY."""
    server = Server(core_dir, "--api-key", TEST_API_KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def thinking_stack(core_dir: Path, tmp_path_factory):
    """A real frontend with Qwen3's template (it reasons) before the scripted engine: a 135M model does not think."""
    from tests.support.chat_family_cores import QWEN_TOKENS, differential_template, family_core
    from tests.support.scripted_engine import ScriptedStack

    stack = ScriptedStack(family_core(core_dir, tmp_path_factory.mktemp("qwen3") / "core", "qwen3",
                                      differential_template("qwen3"), QWEN_TOKENS))
    yield stack
    stack.stop()
