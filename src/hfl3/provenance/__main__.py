"""`python -m hfl3.provenance show FOLDER [--json]`: the chain of an hfl3 output back to its data, newest first.

    python -m hfl3.provenance show outputs/sft/merged         # merged model -> adapter -> pretrained base
    python -m hfl3.provenance show outputs/sft --json         # the links as a JSON list, for machines

Each link says what it is (merged model, adapter, full SFT model, pretrained base, converted nanochat checkpoint, Hub
model), when and from which git commit it was made, its data (record, token or corpus sha256, sources, counts) and
its plan or LoRA settings, and what trained it (MuonAdamW and its group LRs, or the Trainer's optimizer and its
learning rate; `hfl3.provenance.lineage`). It reads `FOLDER/metadata.json` only: the bases' provenance is copied into
it when the output is written, so the chain shows even when a base folder is gone. The first link is named FOLDER as
given; the others as their outputs recorded them (without local paths). Exit status 2, with one line, for a folder
without `metadata.json` or with one that is not JSON.
"""

from __future__ import annotations

import argparse
import json

from hfl3.provenance.lineage import format_chain, read_chain


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hfl3.provenance", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print the chain of an output folder, newest first")
    show.add_argument("folder", help="an output folder with metadata.json (a model, adapter or merged model)")
    show.add_argument("--json", action="store_true", help="print the links as a JSON list instead of text")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run the command line: print the chain, or exit with status 2 and one line for a folder that is not an hfl3
    output (as for a bad argument)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        chain = read_chain(args.folder)
    except (FileNotFoundError, ValueError) as error:
        parser.exit(2, f"{parser.prog} show: error: {error}\n")
    chain[0]["name"] = args.folder  # as written on the command line (read_chain's links hold no local path)
    print(json.dumps(chain, indent=2, ensure_ascii=False) if args.json else format_chain(chain))


if __name__ == "__main__":
    main()
