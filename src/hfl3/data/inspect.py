"""Show which tokens of SFT records are supervised (like axolotl's `preprocess --debug`), from the same data flags as
`recipes/sft_lora.py`.

```bash
python -m hfl3.data.inspect --tokenizer Qwen/Qwen3-0.6B --train_file chats.jsonl --n 3
python -m hfl3.data.inspect --tokenizer outputs/demo --train_file chats.jsonl --n 2 --plain --max_length 128
python -m hfl3.data.inspect --tokenizer Qwen/Qwen3-0.6B --dataset_name HuggingFaceTB/smoltalk --dataset_config all
python -m hfl3.data.inspect --tokenizer MODEL_DIR --gguf_file model.Q8_0.gguf --train_file chats.jsonl  # its tokenizer
python -m hfl3.data.inspect --tokenizer Qwen/Qwen3-0.6B --train_file reasoning.jsonl --split_reasoning_turns
```

On a terminal, supervised text is printed in green and the rest dimmed; elsewhere (a pipe, a file) and with `--plain`
it is marked `[[` ... `]]` without ANSI codes. The whole rendered record is shown: system prompt and tools, user and
tool messages, assistant text, tool calls and reasoning, so what the template drops is visibly absent. Each record
ends with its token counts; an invalid one is shown as `=== where: reason`. The masks are those `hfl3.data.masks`
trains with: the model's own chat template, assistant replies with their end-of-turn token, truncation to
`--max_length` shown with a `✂` mark where text was cut (`--truncation_mode`), and the recipe's data flags
(`--assistant_only_loss false`, `--completion_only_loss false`, `--eos_token`, `--dataset_text_field`,
`--split_reasoning_turns`: each sample of a record shown as `=== where (sample k of n)`, `--ignore_empty_reasoning`).
A dataset is streamed: only the records shown are read.

Exit status: 0 when a record was shown; 2, with one line, when no valid record was found (after `--max_records`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hfl3.data.chat import ChatRecord, InvalidChatRecord, normalize_record, split_reasoning_turns
from hfl3.data.masks import AssistantMasker, EncodedChat
from hfl3.data.sft_sources import iter_source

GREEN, DIM, RESET = "\033[1;32m", "\033[2m", "\033[0m"


def kept_tokens(encoded: EncodedChat, max_length: int | None, truncation_mode: str = "keep_start") -> slice:
    """The tokens a row keeps of `encoded` when cut to `max_length` as `truncation_mode` says (TRL's)."""
    if max_length is None or len(encoded.input_ids) <= max_length:
        return slice(None)
    return slice(-max_length, None) if truncation_mode == "keep_end" else slice(None, max_length)


def highlight(encoded: EncodedChat, max_length: int | None = None, plain: bool = False,
              truncation_mode: str = "keep_start") -> str:
    """The rendered conversation with supervised characters marked: ANSI green (dim elsewhere), or `[[...]]` when
    `plain`. A character is supervised when a token covering it has a label; with `max_length`, the text of the
    tokens cut off (after the last kept one, or with `truncation_mode="keep_end"` before the first) is dropped and
    `✂` marks the cut."""
    kept = kept_tokens(encoded, max_length, truncation_mode)
    offsets, labels = encoded.offsets[kept], encoded.labels[kept]
    begin = min((start for start, _ in offsets), default=0) if kept.start else 0
    end = max((stop for _, stop in offsets), default=0)
    supervised = [False] * end
    for (start, stop), label in zip(offsets, labels):
        if label != -100:
            supervised[start:stop] = [True] * (stop - start)
    opening, closing = ("[[", "]]") if plain else (GREEN, RESET + DIM)
    pieces, inside = ["" if plain else DIM, "✂ " if kept.start else ""], False
    for char, marked in zip(encoded.text[begin:end], supervised[begin:]):
        if marked != inside:
            pieces.append(opening if marked else closing)
            inside = marked
        pieces.append(char)
    if inside:
        pieces.append(closing)
    if kept.stop:
        pieces.append(" ✂")
    pieces.append("" if plain else RESET)
    return "".join(pieces)


def _boolean(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() == "true"


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
    parser.add_argument("--truncation_mode", choices=("keep_start", "keep_end"), default="keep_start",
                        help="which end of a long record --max_length keeps")
    parser.add_argument("--chat_template", default=None, help="a .jinja file to use instead of the tokenizer's")
    parser.add_argument("--assistant_only_loss", type=_boolean, default=True,
                        help="true (hfl3's default): the assistant replies; false: the whole text, as TRL")
    parser.add_argument("--completion_only_loss", type=_boolean, default=None,
                        help="prompt-completion records: false trains the prompt too")
    parser.add_argument("--eos_token", default=None, help="instead of the tokenizer's EOS token")
    parser.add_argument("--dataset_text_field", default="text", help="key of a plain-text record's text")
    parser.add_argument("--split_reasoning_turns", action="store_true",
                        help="one sample per assistant turn with reasoning_content")
    parser.add_argument("--ignore_empty_reasoning", action="store_true",
                        help="leave the empty reasoning block the template inserts out of the loss")
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
    try:
        masker = AssistantMasker(tokenizer, template, assistant_only_loss=args.assistant_only_loss,
                                 eos_token=args.eos_token, ignore_empty_reasoning=args.ignore_empty_reasoning)
    except ValueError as error:  # an eos_token outside the vocabulary
        parser.error(str(error))
    shown = read = 0
    try:
        records = iter_source(args.train_file, args.dataset_name, args.dataset_config, args.dataset_train_split,
                              args.dataset_text_field)
        for where, obj in records:
            read += 1
            try:
                if isinstance(obj, InvalidChatRecord):
                    raise obj
                record = normalize_record(obj, where, completion_only_loss=args.completion_only_loss,
                                          dataset_text_field=args.dataset_text_field)
                samples = split_reasoning_turns(record) if args.split_reasoning_turns and \
                    isinstance(record, ChatRecord) else (record,)
                encoded = [masker.encode(sample) for sample in samples]
            except InvalidChatRecord as error:
                print(f"=== {error}\n")
            else:
                for number, chat in enumerate(encoded, 1):
                    kept = chat.labels[kept_tokens(chat, args.max_length, args.truncation_mode)]
                    supervised = sum(label != -100 for label in kept[1:])
                    print(f"=== {where}" + (f" (sample {number} of {len(encoded)})" if len(encoded) > 1 else ""))
                    print(highlight(chat, args.max_length, plain, args.truncation_mode))
                    print(f"--- tokens {len(kept)} (of {len(chat.input_ids)}), supervised {supervised}\n")
                shown += 1
            if shown == args.n or read == args.max_records:
                break
    except ValueError as error:  # not JSONL (SFTDataError), a dataset without such a split or a chat column
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if not shown:
        source = args.train_file or args.dataset_name
        parser.exit(2, f"{parser.prog}: error: {source}: no valid record in the {read} read (each reason above)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
