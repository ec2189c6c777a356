"""Demo chats from the Python standard library (DESIGN decision 11): the user asks what `module.function(signature)`
does, the assistant answers with the first paragraph of its docstring. Real text on every machine, no download.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re

# Pure-Python, side-effect-free stdlib modules whose public functions carry docstrings (DESIGN decision 11)
STDLIB_DOC_MODULES = (
    "base64", "bisect", "calendar", "cmath", "colorsys", "copy", "csv", "dataclasses", "datetime", "difflib",
    "email.utils", "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html", "inspect",
    "ipaddress", "itertools", "json", "keyword", "math", "mimetypes", "operator", "os", "os.path", "pathlib",
    "platform", "pprint", "quopri", "random", "re", "secrets", "shlex", "shutil", "statistics", "string",
    "struct", "tempfile", "textwrap", "time", "types", "typing", "unicodedata", "urllib.parse", "uuid", "zlib",
)  # fmt: skip
STDLIB_QUESTIONS = (
    "What does `{name}{signature}` do?",
    "Explain the Python function `{name}{signature}`.",
    "In Python's standard library, what is `{name}{signature}` for?",
)
STDLIB_SYSTEM = "You are a concise assistant that explains the Python standard library."
_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")


def _first_paragraph(doc: str) -> str | None:
    for paragraph in doc.split("\n\n"):
        text = " ".join(line.strip() for line in paragraph.splitlines()).strip()
        if text and not _SIGNATURE_LINE.match(text):
            return text
    return None


def stdlib_docstring_functions(max_answer_chars: int = 400) -> list[tuple[str, str, str]]:
    """`(qualified name, signature, first docstring paragraph)` for the public functions of `STDLIB_DOC_MODULES`
    that have an `inspect.signature` and a first paragraph of 20 to `max_answer_chars` characters, sorted by name
    and without duplicates (one object reached from two modules is kept under the first name). Memory addresses in
    signatures (`<object object at 0x...>`) are removed, so every process builds the same list."""
    found, seen = [], set()
    for module_name in STDLIB_DOC_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)) or id(obj) in seen:
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            # Default values such as `<object object at 0x7f...>` differ between processes
            signature = re.sub(r" at 0x[0-9a-fA-F]+", "", signature)
            answer = _first_paragraph(inspect.getdoc(obj) or "")
            if answer is None or not 20 <= len(answer) <= max_answer_chars:
                continue
            seen.add(id(obj))
            found.append((f"{module_name}.{attr}", signature, answer))
    return sorted(found)


def stdlib_docstring_chats(n: int, seed: int = 0) -> list[dict]:
    """`n` chats about real stdlib functions: the user asks what `module.function(signature)` does, the assistant
    answers with the first paragraph of its docstring; about half carry a system prompt. Deterministic for one
    Python installation (docstrings differ across Python versions, so hash the result for provenance).

    Returns:
        `[{"messages": [...], "source": "stdlib:module.function"}, ...]`, in the order drawn.

    Raises:
        ValueError: if `n` exceeds the number of usable functions.
    """
    functions = stdlib_docstring_functions()
    if not 0 < n <= len(functions):
        raise ValueError(f"n={n}; this Python's stdlib offers {len(functions)} documented functions")
    rng = random.Random(seed)
    chats = []
    for name, signature, answer in rng.sample(functions, n):
        question = rng.choice(STDLIB_QUESTIONS).format(name=name, signature=signature)
        system = [{"role": "system", "content": STDLIB_SYSTEM}] if rng.random() < 0.5 else []
        messages = [*system, {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append({"messages": messages, "source": f"stdlib:{name}"})
    return chats
