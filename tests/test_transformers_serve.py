"""`python -m hfl3.serve` (`hfl3.serve`): transformers' own server (`transformers serve`) answers a chat completion
from an L3GPT folder, greedy text equal to `generate`'s; without the registration it cannot load the model."""

import socket
import time

import pytest
import torch
from huggingface_hub.utils import httpx
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cli.serve import Serve

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.serve import main, register_in_transformers

MESSAGES = [{"role": "user", "content": "What does len(obj) do?"}]


@pytest.fixture(scope="module")
def l3gpt_folder(tmp_path_factory, assets):
    """A tiny L3GPT with an L3 layer, saved with Qwen3's tokenizer (and its chat template)."""
    folder = tmp_path_factory.mktemp("l3gpt")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    torch.manual_seed(0)
    L3GPTForCausalLM(L3GPTConfig.from_depth(2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                            max_position_embeddings=256, l3_after_layers=[0], l3_k_max=4,
                                            l3_d_up=32)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def chat(port: int, folder, max_tokens: int = 6) -> httpx.Response:
    url = f"http://localhost:{port}"
    deadline = time.monotonic() + 60
    while True:  # the server starts in a thread
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": str(folder), "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0})


@pytest.mark.timeout(180)
def test_transformers_serve_answers_a_chat_completion_from_an_l3gpt_folder(l3gpt_folder):
    register_in_transformers()  # what python -m hfl3.serve does before it runs transformers' Serve command
    port = free_port()
    server = Serve(force_model=str(l3gpt_folder), device="cpu", port=port, non_blocking=True)
    try:
        response = chat(port, l3gpt_folder)
    finally:
        server.kill_server()
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]
    tokenizer = AutoTokenizer.from_pretrained(l3gpt_folder)
    model = AutoModelForCausalLM.from_pretrained(l3gpt_folder)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    greedy = model.generate(**prompt, max_new_tokens=6, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert answer["message"]["content"] == tokenizer.decode(greedy, skip_special_tokens=True)
    assert answer["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 6


def test_the_command_is_transformers_serve(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "Usage: python -m hfl3.serve [OPTIONS] [force_model]" in text and "OpenAI compatible API" in text
    with pytest.raises(SystemExit) as exit_info:
        main(["--no-such-option"])
    assert exit_info.value.code == 2
