"""Show which tokens of chat conversations are supervised (like axolotl's `preprocess --debug`).

```bash
python -m hfl3.data.inspect --tokenizer Qwen/Qwen3-0.6B \
    --data chats.jsonl --n 3
python -m hfl3.data.inspect --tokenizer outputs/demo --data chats.jsonl --n 2 --plain --max_length 128
python -m hfl3.data.inspect --tokenizer MODEL_DIR --gguf_file model.Q8_0.gguf --data chats.jsonl  # GGUF's tokenizer
```

On a terminal, supervised text is printed in green and the rest dimmed; elsewhere (a pipe, a file) and with `--plain`
it is marked `[[` ... `]]` without ANSI codes. Each conversation ends with its token counts. The masks are those
`hfl3.data.masks` trains with: the model's own chat template, assistant replies with their end-of-turn token,
truncation to `--max_length` shown with a `✂` mark.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hfl3.data.chat import InvalidChatRecord, read_chat_jsonl
from hfl3.data.masks import AssistantMasker, EncodedChat

GREEN, DIM, RESET = "\033[1;32m", "\033[2m", "\033[0m"


def highlight(encoded: EncodedChat, max_length: int | None = None, plain: bool = False) -> str:
    """The rendered conversation with supervised characters marked: ANSI green (dim elsewhere), or `[[...]]` when
    `plain`. A character is supervised when a token covering it has a label; with `max_length`, text after the
    last kept token is dropped and `✂` marks the cut."""
    ids = encoded.input_ids if max_length is None else encoded.input_ids[:max_length]
    end = encoded.offsets[len(ids) - 1][1] if ids else 0
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
    parser.add_argument("--data", required=True, help="chat JSONL file")
    parser.add_argument("--n", type=int, default=3, help="conversations to show")
    parser.add_argument("--max_length", type=int, default=None, help="truncate like the recipe's max_length")
    parser.add_argument("--chat_template", default=None, help="a .jinja file to use instead of the tokenizer's")
    parser.add_argument(
        "--plain", action="store_true", help="mark supervised text with [[ ]], also on a terminal (colours there)"
    )
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    gguf = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, **gguf)
    plain = args.plain or not sys.stdout.isatty()
    template = open(args.chat_template, encoding="utf-8").read() if args.chat_template else None
    masker = AssistantMasker(tokenizer, template)
    shown = 0
    for record in read_chat_jsonl(args.data, skip_invalid_records=True)[: args.n]:
        try:
            encoded = masker.encode(record.messages, record.where)
        except InvalidChatRecord as error:
            print(f"=== {error}\n")
            continue
        kept = encoded.labels if args.max_length is None else encoded.labels[: args.max_length]
        supervised = sum(label != -100 for label in kept[1:])
        print(f"=== {record.where}")
        print(highlight(encoded, args.max_length, plain))
        print(f"--- tokens {len(kept)} (of {len(encoded.input_ids)}), supervised {supervised}\n")
        shown += 1
    return 0 if shown else 1


if __name__ == "__main__":
    sys.exit(main())
