"""`python -m hfl3.serve [OPTIONS] [FOLDER]`: transformers' own OpenAI-compatible server (`transformers serve`, every
option its own; `--help` lists them) able to load an L3GPT folder; chat with it the transformers way.

    pip install 'hfl3[serve]'                                   # transformers[serving]: FastAPI, uvicorn, openai
    python -m hfl3.serve outputs/demo_chat --device cpu         # serves http://localhost:8000/v1
    transformers chat outputs/demo_chat http://localhost:8000   # a client of that server: nothing to register
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "outputs/demo_chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

Why an entry point of its own: transformers 5.23's server loads a model by the class its `config.json` names,
`getattr(transformers, config.architectures[0])` (`transformers/cli/serving/model_manager.py`), and the transformers
module has no attribute for a model registered with the Auto classes or shipped as remote code, so `transformers
serve` answers "module transformers has no attribute L3GPTForCausalLM", with `--trust-remote-code` too. This module
imports hfl3 (the Auto classes) and sets the L3GPT classes on the transformers module (`register_in_transformers`),
then runs transformers' own command line. For throughput, batching and the L3 tables in CPU memory, serve with vLLM
(`integrations/vllm`: `hfl3-vllm`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hfl3 import L3GPTConfig, L3GPTForCausalLM, L3GPTModel


def register_in_transformers() -> None:
    """Set `L3GPTConfig`, `L3GPTModel` and `L3GPTForCausalLM` on the transformers module, where `getattr(transformers,
    "L3GPTForCausalLM")` in transformers' server finds them: the one in `sys.modules` and the one its model manager
    imported (transformers 5.23 can put a new module object into `sys.modules` while it imports its own submodules,
    after the model manager took the first). Idempotent."""
    from transformers.cli.serving import model_manager

    modules = {id(module): module for module in (sys.modules["transformers"], model_manager.transformers)}
    for module in modules.values():
        for cls in (L3GPTConfig, L3GPTModel, L3GPTForCausalLM):
            setattr(module, cls.__name__, cls)


def main(argv: Sequence[str] | None = None) -> None:
    """`transformers serve ARGV` with L3GPT registered (module docstring): transformers' `Serve` command, run by its
    own command-line library (typer), so that its options, help and errors are transformers'. Ends the program as that
    command line does (`SystemExit`; status 2 for a bad option)."""
    import typer
    from transformers.cli.serve import Serve

    register_in_transformers()
    app = typer.Typer(add_completion=False)
    app.command(name="serve")(Serve)  # the one command: `python -m hfl3.serve [OPTIONS] [FOLDER]`
    app(args=list(sys.argv[1:] if argv is None else argv), prog_name="python -m hfl3.serve")


if __name__ == "__main__":
    main()
