"""Show which tokens of SFT records are supervised (like axolotl's `preprocess --debug`), from the same data flags as
`recipes/sft_lora.py`.

```bash
python -m hfl3.data.inspect --tokenizer Qwen/Qwen3-0.6B --train_file chats.jsonl --n 3
python -m hfl3.data.inspect --tokenizer outputs/demo --train_file chats.jsonl --n 2 --plain --max_length 128
python -m hfl3.data.inspect --tokenizer Qwen/Qwen3-0.6B --dataset_name HuggingFaceTB/smoltalk --dataset_config all
python -m hfl3.data.inspect --tokenizer MODEL_DIR --gguf_file model.Q8_0.gguf --train_file chats.jsonl  # its tokenizer
```

On a terminal, supervised text is printed in green and the rest dimmed; elsewhere (a pipe, a file) and with `--plain`
it is marked `[[` ... `]]` without ANSI codes. The whole rendered record is shown: system prompt and tools, user and
tool messages, assistant text, tool calls and reasoning, so what the template drops is visibly absent. Each record
ends with its token counts; an invalid one is shown as `=== where: reason`. The masks are those `hfl3.data.masks`
trains with: the model's own chat template, assistant replies with their end-of-turn token, truncation to
`--max_length` shown with a `✂` mark. A dataset is streamed: only the records shown are read.

Exit status: 0 when a record was shown; 2, with one line, when no valid record was found (after `--max_records`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hfl3.data.chat import InvalidChatRecord, normalize_record
from hfl3.data.masks import AssistantMasker, EncodedChat
from hfl3.data.sft_sources import iter_source

GREEN, DIM, RESET = "\033[1;32m", "\033[2m", "\033[0m"


def highlight(encoded: EncodedChat, max_length: int | None = None, plain: bool = False) -> str:
    """The rendered conversation with supervised characters marked: ANSI green (dim elsewhere), or `[[...]]` when
    `plain`. A character is supervised when a token covering it has a label; with `max_length`, text after the
    last kept token is dropped and `✂` marks the cut."""
    ids = encoded.input_ids if max_length is None else encoded.input_ids[:max_length]
    end = max((stop for _, stop in encoded.offsets[: len(ids)]), default=0)
    supervised = [False] * end
    for (start, stop), label in zip(encoded.offsets[: len(ids)], encoded.labels):
        if label != -100:
            supervised[start:stop] = [True] * (stop - start)
    opening, closing = ("[[", "]]") if plain else (GREEN, RESET + DIM)
    pieces, inside = ["" if plain else DIM], False
    for char, marked in zip(encoded.text[:end], supervised):
        if marked != inside:
            pieces.append(opening if marked else closing)
            inside = marked
        pieces.append(char)
    if inside:
        pieces.append(closing)
    if len(ids) < len(encoded.input_ids):
        pieces.append(" ✂")
    pieces.append("" if plain else RESET)
    return "".join(pieces)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hfl3.data.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="tokenizer or model folder (with a chat template)")
    parser.add_argument("--gguf_file", default=None, help="GGUF file inside --tokenizer: use the tokenizer it holds")
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--train_file", "--data", dest="train_file", help="chat JSONL file")
    data.add_argument("--dataset_name", help="a datasets name: Hub id, local folder, or json/jsonl/parquet/arrow file")
    parser.add_argument("--dataset_config", default=None, help="configuration of --dataset_name")
    parser.add_argument("--dataset_train_split", default=None, help="split of --dataset_name (default: train)")
    parser.add_argument("--n", type=int, default=3, help="valid records to show")
    parser.add_argument("--max_records", type=int, default=1000, help="records to read at most while looking")
    parser.add_argument("--max_length", type=int, default=None, help="truncate like the recipe's max_length")
    parser.add_argument("--chat_template", default=None, help="a .jinja file to use instead of the tokenizer's")
    parser.add_argument(
        "--plain", action="store_true", help="mark supervised text with [[ ]], also on a terminal (colours there)"
    )
    args = parser.parse_args(argv)
    if args.dataset_name is None and (args.dataset_config or args.dataset_train_split):
        parser.error("--dataset_config and --dataset_train_split need --dataset_name")

    from transformers import AutoTokenizer

    gguf = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, **gguf)
    plain = args.plain or not sys.stdout.isatty()
    template = open(args.chat_template, encoding="utf-8").read() if args.chat_template else None
    masker = AssistantMasker(tokenizer, template)
    shown = read = 0
    try:
        records = iter_source(args.train_file, args.dataset_name, args.dataset_config, args.dataset_train_split)
        for where, obj in records:
            read += 1
            try:
                if isinstance(obj, InvalidChatRecord):
                    raise obj
                encoded = masker.encode(normalize_record(obj, where))
            except InvalidChatRecord as error:
                print(f"=== {error}\n")
            else:
                kept = encoded.labels if args.max_length is None else encoded.labels[: args.max_length]
                supervised = sum(label != -100 for label in kept[1:])
                print(f"=== {where}")
                print(highlight(encoded, args.max_length, plain))
                print(f"--- tokens {len(kept)} (of {len(encoded.input_ids)}), supervised {supervised}\n")
                shown += 1
            if shown == args.n or read == args.max_records:
                break
    except ValueError as error:  # the dataset has no such split, or no chat column
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if not shown:
        source = args.train_file or args.dataset_name
        parser.exit(2, f"{parser.prog}: error: {source}: no valid record in the {read} read (each reason above)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
