"""`python -m hfl3.evaluate core`: the CORE metric of a saved causal LM, per-task table and JSON
(`python -m hfl3.evaluate chatcore`, a chat model's ChatCORE, is `hfl3.evaluate.chatcore_cli`).

    # an hfl3 output folder, nanochat's bundle (downloaded once into the Hugging Face cache when online)
    python -m hfl3.evaluate core --model_name_or_path outputs/demo --max_per_task 500 --output_json core.json
    # any AutoModelForCausalLM, a local bundle, 8 GPUs (each scores its share of the items)
    torchrun --nproc_per_node 8 -m hfl3.evaluate core --model_name_or_path openai-community/gpt2 \\
        --core_bundle_dir ~/.cache/nanochat/eval_bundle --dtype bfloat16
    # 2 machines (this command on each, --machine_rank 0 and 1; the bundle is read on machine 0 and sent to the other)
    accelerate launch --config_file accelerate_configs/multi_cpu_ddp.yaml --num_machines 2 --num_processes 2 \\
        --machine_rank 0 --main_process_ip 10.0.0.1 --main_process_port 29500 -m hfl3.evaluate core \\
        --model_name_or_path outputs/demo --core_bundle_dir eval_bundle --use_cpu

Prints one line per task (accuracy, centered accuracy) and the CORE score; `--output_json` gets the same numbers,
the bundle's sha256 and the settings, with no local absolute path in it.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict, dataclass, field

USAGE = ("usage: python -m hfl3.evaluate core --model_name_or_path M [--core_bundle_dir D] [options] (--help lists "
         "them)\n       python -m hfl3.evaluate chatcore --model_name_or_path M [options]")


@dataclass
class CoreEvaluationArguments:
    """Arguments of `python -m hfl3.evaluate core`."""

    model_name_or_path: str = field(metadata={"help": "an hfl3 output folder, or a local folder or Hub id of any "
                                                      "AutoModelForCausalLM (e.g. openai-community/gpt2)"})
    core_bundle_dir: str | None = field(default=None, metadata={
        "help": "nanochat's eval_bundle folder (core.yaml, eval_data/, eval_meta_data.csv); default: the copy in the "
                "Hugging Face cache, downloaded from nanochat's address when online"})
    max_per_task: int = field(default=-1, metadata={"help": "items per task after nanochat's seeded shuffle (-1: "
                                                            "all)"})
    output_json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "default: model_name_or_path"})
    batch_tokens: int = field(default=8192, metadata={"help": "padded tokens per forward (rows x longest row)"})
    max_length: int | None = field(default=None, metadata={
        "help": "prompts keep their last max_length tokens (default: the model's max_position_embeddings; none for "
                "L3GPT, as nanochat for its GPT)"})
    prepend_bos: bool | None = field(default=None, metadata={"help": "put the tokenizer's BOS first (default: when "
                                                                     "it has one, as nanochat)"})
    dtype: str = field(default="auto", metadata={"help": "auto (the checkpoint's), float32, bfloat16 or float16"})
    use_cpu: bool = field(default=False, metadata={"help": "evaluate on the CPU even when a GPU is present"})
    trust_remote_code: bool = field(default=False, metadata={"help": "allow the model's own code from the Hub"})


def parse(argv: list[str]) -> CoreEvaluationArguments:
    """The arguments after `core`; a bad one ends the program with the usage line and one error line (exit 2)."""
    from transformers import HfArgumentParser

    if not argv or argv[0] != "core":
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    parser = HfArgumentParser(CoreEvaluationArguments, prog="python -m hfl3.evaluate core")
    (args,) = parser.parse_args_into_dataclasses(argv[1:])
    if args.batch_tokens < 1:
        parser.error(f"--batch_tokens {args.batch_tokens}: expected a positive number of tokens")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        parser.error(f"--dtype {args.dtype}: expected auto, float32, bfloat16 or float16")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the evaluation; returns the JSON-safe results (also on processes other than the main one)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "chatcore":
        from hfl3.evaluate.chatcore_cli import main as chatcore_main

        return chatcore_main(argv[1:])
    args = parse(argv)
    import hfl3  # noqa: F401  (registers L3GPT with the Auto classes)
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfl3.distributed import from_main
    from hfl3.evaluate import evaluate_core, load_core_bundle, resolve_bundle_dir
    from hfl3.evaluate.core import default_max_length
    from hfl3.atomic import write_json_atomic
    from hfl3.provenance import build_metadata, portable

    import torch

    # cpu=True on a machine without CUDA: accelerate then joins torchrun's processes over gloo; without it each
    # process would evaluate alone (world size 1)
    state = PartialState(cpu=args.use_cpu or not torch.cuda.is_available())
    logging.basicConfig(level=logging.INFO if state.is_main_process else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    try:  # the bundle first: a bad one stops every process before the model loads; only machine 0 needs it
        bundle = from_main(lambda: load_core_bundle(resolve_bundle_dir(args.core_bundle_dir), args.max_per_task))
    except ValueError as error:
        print(f"{USAGE}\npython -m hfl3.evaluate core: error: {error}", file=sys.stderr)
        sys.exit(2)
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=args.dtype,
                                                 trust_remote_code=args.trust_remote_code).to(state.device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path or args.model_name_or_path,
                                              trust_remote_code=args.trust_remote_code)
    max_length = args.max_length if args.max_length is not None else default_max_length(model)
    results = evaluate_core(model, tokenizer, bundle, batch_tokens=args.batch_tokens, max_length=max_length,
                            prepend_bos=args.prepend_bos)
    settings = {**asdict(args), "max_length": max_length, "dtype": str(model.dtype).removeprefix("torch."),
                "bos_token": tokenizer.bos_token if args.prepend_bos is not False else None,
                "num_processes": state.num_processes}
    output = portable(build_metadata(**results.summary(), settings=settings,
                                     tasks={task.label: {"accuracy": task.accuracy, "centered": task.centered,
                                                         "correct": sum(task.correct), "items": len(task.correct),
                                                         "seconds": round(task.seconds, 2),
                                                         "boundary_moved": task.boundary_moved}
                                            for task in results.tasks}))
    if state.is_main_process:
        print(results.table())
        if args.output_json:
            write_json_atomic(args.output_json, output)
            print(f"results written to {args.output_json}")
    return output


if __name__ == "__main__":
    from hfl3.distributed import end_distributed_run

    main()
    end_distributed_run()  # every process: the others done, the process group destroyed, output flushed, exit 0
