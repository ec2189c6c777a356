"""`python -m hfl3.evaluate chatcore`: ChatCORE of a chat model (or a PEFT adapter on one), per-task table and JSON.

    # any causal LM with a chat template, the data from the Hub (cached by datasets)
    python -m hfl3.evaluate chatcore --model_name_or_path Qwen/Qwen3-0.6B --dtype bfloat16 --output_json chat.json
    # an adapter from recipes/sft_lora.py, nanochat chat_sft's subset sizes, a local copy of the data
    python -m hfl3.evaluate chatcore --model_name_or_path outputs/demo --adapter outputs/demo_sft \\
        --max_cat -1 --max_sample 24 --data_dir ~/chatcore_data
    # 8 GPUs: each process takes its share of every task's problems
    torchrun --nproc_per_node 8 -m hfl3.evaluate chatcore --model_name_or_path nanochat-d20-hf --dtype bfloat16

Prints one line per task and ChatCORE (when all five tasks ran); `--output_json` gets the same numbers and the
settings, with no local absolute path. For an hfl3 output folder (the adapter's, else the model's: a folder with
`metadata.json`), the results also go into its `metadata.json` (`evaluation.chatcore`) and its model card's
`model-index`.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hfl3.evaluate.chat_tasks import TASKS

USAGE = ("usage: python -m hfl3.evaluate chatcore --model_name_or_path M [--adapter A] [--tasks T,...] "
         "[--max_problems N] [--data_dir D] [options] (--help lists them)")


@dataclass
class ChatCoreEvaluationArguments:
    """Arguments of `python -m hfl3.evaluate chatcore`."""

    model_name_or_path: str = field(metadata={"help": "a local folder or Hub id of any AutoModelForCausalLM with a "
                                                      "chat template (Qwen3, Gemma 3, Llama/SmolLM2, L3GPT)"})
    adapter: str | None = field(default=None, metadata={"help": "a PEFT adapter (folder or Hub id) on the model"})
    tasks: str = field(default=",".join(TASKS), metadata={"help": "comma-separated, of " + ", ".join(TASKS)})
    max_problems: int = field(default=-1, metadata={"help": "problems per task after nanochat's shuffle (seed 42); "
                                                            "-1: all (nanochat's --max-problems)"})
    max_cat: int | None = field(default=None, metadata={"help": "problems per categorical task (over "
                                                                "--max_problems); -1: all"})
    max_sample: int | None = field(default=None, metadata={"help": "problems per generative task (over "
                                                                   "--max_problems); -1: all"})
    data_dir: str | None = field(default=None, metadata={
        "help": "a local copy of the data: DIR/<hub id>/<config>/<split>-*.parquet (or .jsonl), as `hf download` "
                "writes it; default: the Hub through datasets"})
    max_new_tokens: int = field(default=512, metadata={"help": "longest generated reply (nanochat's 512)"})
    batch_size: int = field(default=8, metadata={"help": "prompts per forward or generate call"})
    output_json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={
        "help": "default: the adapter's folder when it has a tokenizer, else model_name_or_path"})
    dtype: str = field(default="auto", metadata={"help": "auto (the checkpoint's), float32, bfloat16 or float16"})
    use_cpu: bool = field(default=False, metadata={"help": "evaluate on the CPU even when a GPU is present"})
    trust_remote_code: bool = field(default=False, metadata={"help": "allow the model's own code from the Hub"})

    def limit(self, name: str) -> int:
        """Problems to keep of task `name` (-1: all)."""
        own = self.max_cat if TASKS[name].kind == "categorical" else self.max_sample
        return own if own is not None else self.max_problems


def parse(argv: list[str]) -> ChatCoreEvaluationArguments:
    """The arguments after `chatcore`; a bad one ends the program with the usage line and one error line (exit 2)."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(ChatCoreEvaluationArguments, prog="python -m hfl3.evaluate chatcore")
    (args,) = parser.parse_args_into_dataclasses(argv)
    unknown = [name for name in args.tasks.split(",") if name not in TASKS]
    if unknown or not args.tasks:
        parser.error(f"--tasks {args.tasks}: expected a comma-separated list of {', '.join(TASKS)}")
    for name in ("max_problems", "max_cat", "max_sample"):
        value = getattr(args, name)
        if value is not None and (value == 0 or value < -1):
            parser.error(f"--{name} {value}: expected a positive number of problems, or -1 (all)")
    for name in ("max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected a positive number")
    if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
        parser.error(f"--dtype {args.dtype}: expected auto, float32, bfloat16 or float16")
    return args


def hfl3_folder(args: ChatCoreEvaluationArguments) -> Path | None:
    """The hfl3 output folder evaluated (the adapter's, else the model's), when it is one: a local folder whose
    `metadata.json` hfl3 wrote (it has `format_version`)."""
    folder = Path(args.adapter or args.model_name_or_path)
    try:
        metadata = json.loads((folder / "metadata.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return folder if isinstance(metadata, dict) and "format_version" in metadata else None


def record_in_folder(folder: Path, summary: dict) -> None:
    """`summary` into `folder`'s `metadata.json` (`evaluation.chatcore`) and its model card's `model-index` (the
    card's other entries, CORE's among them, kept); written atomically."""
    from huggingface_hub import ModelCard

    from hfl3.atomic import atomic_path, write_json_atomic
    from hfl3.evaluate.chatcore import chatcore_eval_results

    metadata = json.loads((folder / "metadata.json").read_text(encoding="utf-8"))
    metadata.setdefault("evaluation", {})["chatcore"] = summary
    write_json_atomic(folder / "metadata.json", metadata)
    card_path = folder / "README.md"
    if not card_path.is_file():
        return
    card = ModelCard.load(card_path)
    kept = [result for result in (card.data.eval_results or []) if "ChatCORE" not in (result.task_name or "")]
    card.data.eval_results = kept + chatcore_eval_results(summary)
    card.data.model_name = card.data.model_name or folder.resolve().name
    with atomic_path(card_path) as tmp:
        card.save(tmp)


def load_model_and_tokenizer(args: ChatCoreEvaluationArguments, device):
    """The model (with the adapter when given) on `device`, in eval mode, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=args.dtype,
                                                 trust_remote_code=args.trust_remote_code)
    source = args.tokenizer_name_or_path or args.model_name_or_path
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
        if args.tokenizer_name_or_path is None and any(
                (Path(args.adapter) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            source = args.adapter
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=args.trust_remote_code)
    return model.to(device).eval(), tokenizer


def main(argv: list[str]) -> dict:
    """Run the evaluation; returns the JSON-safe results (also on processes other than the main one)."""
    args = parse(argv)
    import hfl3  # noqa: F401  (registers L3GPT with the Auto classes)
    import torch
    from accelerate import PartialState

    from hfl3.atomic import write_json_atomic
    from hfl3.distributed import from_main
    from hfl3.evaluate.chat_tasks import data_problem, load_problems
    from hfl3.evaluate.chatcore import evaluate_chatcore
    from hfl3.provenance import build_metadata, portable

    state = PartialState(cpu=args.use_cpu or not torch.cuda.is_available())
    logging.basicConfig(level=logging.INFO if state.is_main_process else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    names = args.tasks.split(",")
    try:  # the data first: what is missing stops every process, in one line, before the model loads
        problem = from_main(lambda: data_problem(names, args.data_dir))
        if problem:
            raise ValueError(problem)
        problems = from_main(lambda: {name: load_problems(name, args.data_dir, args.limit(name)) for name in names})
        model, tokenizer = load_model_and_tokenizer(args, state.device)
        if not tokenizer.chat_template:
            raise ValueError(f"--model_name_or_path {args.model_name_or_path}: its tokenizer has no chat template; "
                             "pass --tokenizer_name_or_path with one")
    except ValueError as error:
        print(f"{USAGE}\npython -m hfl3.evaluate chatcore: error: {error}", file=sys.stderr)
        sys.exit(2)
    results = evaluate_chatcore(model, tokenizer, problems, max_new_tokens=args.max_new_tokens,
                                batch_size=args.batch_size)
    summary = portable(results.summary())
    output = portable(build_metadata(**summary, arguments={**asdict(args), "dtype": str(model.dtype).removeprefix(
        "torch.")}))
    if state.is_main_process:
        print(results.table())
        if args.output_json:
            write_json_atomic(args.output_json, output)
            print(f"results written to {args.output_json}")
        if folder := hfl3_folder(args):
            record_in_folder(folder, summary)
            print(f"results recorded in {folder / 'metadata.json'} and its model card")
    return output
