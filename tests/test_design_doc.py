"""docs/design.md cites only what exists: every file it names or links (backticked or in plain text) is in the clone,
every hfl3 name it puts in backticks occurs in the repository's Python files, every test it cites is defined in a test
folder, every `#anchor` it links is one of its headings, and every section of it cited from the repository
("docs/design.md, Known traps") is one of its headings. A design document that names code that is gone misleads more
than none (docs/design.md says the code wins; this keeps it so)."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN_DOC = REPO / "docs" / "design.md"
TEST_FOLDERS = ("tests/", "integrations/vllm/tests/")
TOP_LEVEL = ("src/", "tests/", "benchmarks/", "recipes/", "integrations/", "dev/", "docs/", "accelerate_configs/",
             ".ci/")

# Names the document cites from the libraries hfl3 builds on (transformers, torch, TRL, PEFT, accelerate, DeepSpeed,
# datasets, huggingface_hub, vLLM) or from nanochat, which hfl3's own code never spells out. Each is checked to be
# cited, so the list cannot outlive the text.
EXTERNAL = {
    "nanochat/gpt.py", "base_train.py", "scripts/chat_sft.py", "scripts/chat_eval.py",  # karpathy/nanochat's files
    "trl/scripts/sft.py", "CheckpointManager",  # TRL's SFT script, torchtitan's checkpointing component
    "ChildFailedError", "HFValidationError", "AutoPeftModelForCausalLM", "ModelCardData", "IterableDatasetShard",
    "OptimizerNames", "ShortConv", "MambaBase", "SHORT_CONV", "ReLUSquaredActivation",
    "StaticCache", "DynamicLayer", "LinearAttentionLayer", "LogitsProcessor", "main_process_first", "all_to_all",
    "deepspeed_shm_comm",
}

SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\((\.\./[^)#\s]+)\)")
CAMEL = re.compile(r"_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*[A-Z][A-Za-z0-9]*|_?[A-Z][a-z0-9]+[A-Z0-9]\w*")
CONSTANT = re.compile(r"_?[A-Z][A-Z0-9]*(_[A-Z0-9]+)+")
SNAKE = re.compile(r"_?[a-z][a-z0-9]*(_[a-z0-9]+)+")
CODE_NAME = re.compile(r"[A-Za-z_][\w.]*(\(.*\))?")
FILE_NAME = re.compile(r"(?<![\w/.*-])(\w[\w./*-]*\.(?:py|yaml|md|toml))(?![\w/])")  # in plain text too (not .json:
# the document names the files a run writes, config.json, metadata.json, ..., which are no files of the clone)
PLACEHOLDER = re.compile(r"(?<=/)[A-Z](?=\.)")  # accelerate_configs/X.yaml: any file there
ANCHOR = re.compile(r"\]\(#([^)\s]+)\)")
SECTION_END = re.compile(r"[,;.)\"]")
HEADING = re.compile(r"^#{2,4} (.+)$", re.MULTILINE)
SECTION_CITATION = re.compile(r"docs/design\.md(?:, | \(\"?)(?!decision \d|decision N)(\w[^\n]{0,60})")


def tracked_files() -> list[str]:
    """The clone's files, committed or not (but not ignored)."""
    return subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout.split()


def python_text() -> str:
    return "\n".join((REPO / name).read_text(encoding="utf-8") for name in tracked_files()
                     if name.endswith(".py") and name != "tests/test_design_doc.py" and (REPO / name).exists())


def cited(text: str) -> tuple[set[str], set[str], set[str], set[str]]:
    """The document's citations: (repository paths, bare file names, code names, test names)."""
    paths, file_names, names, tests = set(), set(), set(), set()
    for span in (" ".join(span.split()) for span in SPAN.findall(text)):
        if span.startswith(TOP_LEVEL) and re.fullmatch(r"[\w./*+-]+", span):
            paths.add(span.rstrip("/"))
        elif re.fullmatch(r"[\w/*-]+\.(py|yaml)", span):
            file_names.add(span)
        elif CODE_NAME.fullmatch(span):
            for name in span.split("(")[0].split("."):
                if name.startswith("test_"):
                    tests.add(name)
                elif any(pattern.fullmatch(name) for pattern in (CAMEL, CONSTANT, SNAKE)):
                    names.add(name)
    paths.update(str((DESIGN_DOC.parent / link).resolve().relative_to(REPO)) for link in LINK.findall(text))
    return paths, file_names, names, tests


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, backticks and punctuation but `-` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def is_file(name: str, files: list[str]) -> bool:
    """`name` is a tracked file: from the repository root, from `src/hfl3/`, or the trailing parts of a tracked
    path; `*` and a one-capital placeholder (`accelerate_configs/X.yaml`) match any name."""
    pattern = PLACEHOLDER.sub("*", name)
    return any(Path(file).match(pattern) or file == f"src/hfl3/{pattern}" for file in files)


def missing_sections(citing: dict[str, str], document: str) -> list[str]:
    """Sections cited as `docs/design.md, <Section>` or `docs/design.md (<Section>)` in `citing` ({file: text})
    that are no heading of `document` (decisions are cited by number: test_references checks those)."""
    headings = [heading.strip().lower() for heading in HEADING.findall(document)]
    return [f"section {SECTION_END.split(cited_text)[0].strip()} ({name})" for name, text in sorted(citing.items())
            for cited_text in SECTION_CITATION.findall(text)
            if not any(cited_text.lower().startswith(heading) for heading in headings)]


def missing_citations(text: str) -> list[str]:
    files, code_words = tracked_files(), set(re.findall(r"\w+", python_text()))
    paths, file_names, names, tests = cited(text)
    file_names |= {name for name in FILE_NAME.findall(text) if not name.startswith(TOP_LEVEL)}
    paths |= {name for name in FILE_NAME.findall(text) if name.startswith(TOP_LEVEL)}
    defined_tests = set(re.findall(r"^\s*def (test_\w+)", "\n".join(
        (REPO / name).read_text(encoding="utf-8") for name in files
        if name.startswith(TEST_FOLDERS) and name.endswith(".py") and (REPO / name).exists()), re.MULTILINE))
    missing = [f"file {path}" for path in sorted(paths)
               if path not in EXTERNAL and not (list(REPO.glob(PLACEHOLDER.sub("*", path))) if "*" in path or
                                                PLACEHOLDER.search(path) else (REPO / path).exists())]
    missing += [f"file {name}" for name in sorted(file_names) if name not in EXTERNAL and not is_file(name, files)]
    headings = {slug(heading) for heading in HEADING.findall(text)}
    missing += [f"anchor #{anchor}" for anchor in sorted(set(ANCHOR.findall(text))) if anchor not in headings]
    missing += [f"name {name}" for name in sorted(names)
                if name not in EXTERNAL and name not in code_words]
    missing += [f"test {name}" for name in sorted(tests) if name not in defined_tests]
    return missing


def test_every_citation_in_the_design_document_exists():
    missing = missing_citations(DESIGN_DOC.read_text(encoding="utf-8"))
    assert not missing, "docs/design.md cites what the repository lacks (rewrite the passage):\n" + "\n".join(missing)


def test_every_section_cited_from_the_repository_exists():
    citing = {}
    for name in tracked_files():
        if name.endswith((".py", ".md", ".yaml", ".toml")) and name != "dev/LOG.md" and (REPO / name).exists() \
                and name != "tests/test_design_doc.py":
            citing[name] = (REPO / name).read_text(encoding="utf-8")
    assert len(missing_sections(citing, "")) >= 3  # the scan finds the citations ("docs/design.md, Known traps")
    missing = missing_sections(citing, DESIGN_DOC.read_text(encoding="utf-8"))
    assert not missing, "sections of docs/design.md cited but missing (cite an existing heading):\n" + "\n".join(
        missing)


def test_external_names_are_still_cited():
    paths, file_names, names, _ = cited(DESIGN_DOC.read_text(encoding="utf-8"))
    stale = EXTERNAL - paths - file_names - names
    assert not stale, f"EXTERNAL lists names docs/design.md no longer cites: {sorted(stale)}"


def test_the_check_tells_a_missing_name_apart():
    text = ("## Layers\n`L3GPTConfig`, `_NoSuchScores`, `no_such_function(x)`, `src/hfl3/no_such.py`, `no_such.yaml`, "
            "`test_no_such_thing`, [x](../benchmarks/no_such.py), [y](#layers), [z](#no-such-section), STYLE.md, "
            "trainers/no_such.py and trainers/cli/arguments.py in plain text, accelerate_configs/X.yaml")
    assert missing_citations(text) == ["file benchmarks/no_such.py", "file src/hfl3/no_such.py",
                                       "file STYLE.md", "file no_such.yaml", "file trainers/no_such.py",
                                       "anchor #no-such-section", "name _NoSuchScores", "name no_such_function",
                                       "test test_no_such_thing"]
    assert missing_sections({"a.py": "see docs/design.md, No such section, and docs/design.md, Known traps; "
                                     "docs/design.md (Layers), docs/design.md, decision 3"},
                            "## Layers\n## Known traps\n") == ["section No such section (a.py)"]


# ---- One step: the hop table, checked against a traced step of each recipe ----------------------------------------

TRAINER_LAYER = ("trainers/", "callbacks.py")


def hop_table(text: str) -> dict[str, dict[str, set[str]]]:
    """docs/design.md's One step table: `{recipe: {"enters", "logging", "beneath": {file under src/hfl3}}}`."""
    section = text[text.index("## One step"):]
    section = section[:section.index("\n## ", 4)]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in ("pretraining", "SFT"):
            rows[cells[0]] = {key: set(SPAN.findall(cell)) for key, cell in zip(("enters", "logging", "beneath"),
                                                                                  cells[1:])}
    return rows


def traced_windows(recipe: str, assets, tmp_path) -> dict[int, set[str]]:
    """Steps 2 (a logging step) and 3 (a steady one) of a tiny run of `recipe`'s trainer, traced: pretraining with
    Muon on the recipe's stream (read in the main process: its batch state consumed each step), SFT with LoRA on
    stdlib chats (the compact CPU loss)."""
    import torch
    from peft import LoraConfig
    from step_trace import StepTracer

    from hfl3 import L3GPTConfig, L3GPTForCausalLM
    from hfl3.data.chat import write_chat_jsonl
    from hfl3.data.sft import load_sft_data
    from hfl3.data.sources import open_corpus
    from hfl3.data.streaming import DocumentSource, PackedStream
    from hfl3.data.stdlib import stdlib_docstring_chats
    from hfl3.tokenization import train_tokenizer
    from hfl3.trainers.pretraining.trainer import PackedCollator, PretrainTrainer
    from hfl3.trainers.pretraining.config import PretrainConfig
    from hfl3.trainers.sft.trainer import ChatSFTTrainer
    from hfl3.trainers.sft.config import ChatSFTConfig

    torch.manual_seed(0)
    common = dict(output_dir=str(tmp_path / "out"), max_steps=4, logging_steps=2, save_strategy="no",
                  eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                  per_device_train_batch_size=4)
    tokenizer = train_tokenizer([(assets / "text" / "tinyshakespeare.txt").read_text()[:60_000]], 512)
    config = L3GPTConfig.from_depth(1, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id)
    if recipe == "pretraining":
        source = DocumentSource(open_corpus(str(assets / "text" / "tinyshakespeare.txt")), None, seed=0)
        stream = PackedStream(source, tokenizer, max_seq_len=32, document_max_chars=128, packing_buffer=16,
                              shuffle_buffer=16)
        trainer = PretrainTrainer(model=L3GPTForCausalLM(config), train_dataset=stream,
                                  data_collator=PackedCollator(tokenizer.bos_token_id),
                                  args=PretrainConfig(optim="muon", max_length=32, use_cpu=True, **common))
    else:
        data = load_sft_data(tokenizer, write_chat_jsonl(stdlib_docstring_chats(24, seed=0), tmp_path / "d.jsonl"),
                             max_length=48)
        trainer = ChatSFTTrainer(model=L3GPTForCausalLM(config), train_dataset=data.train, processing_class=tokenizer,
                                 args=ChatSFTConfig(max_length=48, load_best_model_at_end=False, **common),
                                 peft_config=LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                        task_type="CAUSAL_LM"))
    tracer = StepTracer()
    tracer.run(trainer.train)
    return {step: tracer.windows[step] for step in (2, 3)}


@pytest.mark.parametrize("recipe", ["pretraining", "SFT"])
def test_one_step_enters_the_files_the_hop_table_names(recipe, assets, tmp_path):
    row = hop_table(DESIGN_DOC.read_text(encoding="utf-8"))[recipe]
    assert len(row["enters"]) <= 3 and all(name.startswith(TRAINER_LAYER) for name in row["enters"])
    windows = traced_windows(recipe, assets, tmp_path)
    steady, logging_step = windows[3], windows[2]
    assert "models/l3gpt/modeling_l3gpt.py" in steady  # the guard: the tracer sees the layers below
    if recipe == "pretraining":  # and the stream, read and its state consumed within the step
        assert "data/streaming.py" in steady
    assert {name for name in steady if name.startswith(TRAINER_LAYER)} == row["enters"]
    assert {name for name in logging_step if name.startswith(TRAINER_LAYER)} <= row["enters"] | row["logging"]
    unnamed = {name for name in steady | logging_step if not name.startswith(TRAINER_LAYER)} - row["beneath"]
    assert not unnamed, f"docs/design.md, One step: the {recipe} row does not name {sorted(unnamed)}"


def test_the_hop_table_is_read():
    rows = hop_table("## One step\n| recipe | a | b | c |\n|---|---|---|---|\n| SFT | `trainers/x.py` | | "
                     "`models/y.py` |\n\n## Next\n")
    assert rows == {"SFT": {"enters": {"trainers/x.py"}, "logging": set(), "beneath": {"models/y.py"}}}
