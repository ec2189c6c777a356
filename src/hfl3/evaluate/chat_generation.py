"""The model side of ChatCORE: prompts through the chat template, batched letter scoring, batched greedy generation
with nanochat's calculator tool.

- Prompts: `apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)`, encoded without
  added special tokens (the template writes them). On a converted nanochat tokenizer this is `render_for_completion`.
- Letters (`letter_logits`): rows left-padded with an attention mask and their positions, one forward per batch, the
  logits of the last prompt position (`logits_to_keep=1` where the model takes it) at the letters' token ids; nanochat
  (scripts/chat_eval.py `run_categorical_eval`) right-pads and reads each row's last position: the same logits.
- Generation (`generate_completions`): `model.generate`, greedy, left-padded batches sorted by length, stopping at
  the generation config's and tokenizer's end tokens (a converted nanochat model: `<|assistant_end|>` and `<|bos|>`,
  nanochat's Engine's stops) or after `max_new_tokens` (forced tokens count, as in nanochat's Engine).
- The calculator (`CalculatorTool`), for tokenizers with nanochat's `<|python_start|>`, `<|python_end|>`,
  `<|output_start|>` and `<|output_end|>`: when the model closes `<|python_start|>EXPR<|python_end|>`, the next tokens
  are forced to `<|output_start|>` + the tokens of `str(value)` + `<|output_end|>`, as nanochat's Engine does
  (nanochat/engine.py `use_calculator`), where `value` is what Python evaluates EXPR to; evaluated here by walking its
  syntax tree (`calculate`), never with `eval`.

Under torch.distributed every process calls `model.generate` and the model the same number of times (a process with
fewer problems runs one-token fillers), since ZeRO-3 and FSDP gather the weights inside each forward; transformers
sets `synced_gpus` itself there.
"""

from __future__ import annotations

import ast
import copy
import inspect
import operator

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from hfl3.evaluate.core import _model_device as model_device

TOOL_TOKENS = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")
MATH_CHARACTERS = set("0123456789*+-/.() ")  # nanochat engine.py use_calculator: pure arithmetic
STRING_CHARACTERS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789'\"()._ ")
REFUSED_WORDS = ("__", "import", "exec", "eval", "compile", "open", "file", "input", "raw_input", "globals",
                 "locals", "vars", "dir", "getattr", "setattr", "delattr", "hasattr")  # nanochat's list
MAX_INT_ARGUMENT = 10**6  # a method argument this large (e.g. 'a'.center(10**9)) is refused: it would only eat memory
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str):
    """The calculator of nanochat's Engine (engine.py `use_calculator`): commas dropped; arithmetic (`+ - * / //`,
    parentheses, no `**`) or a string expression using `.count(`; None for anything else or anything that fails.
    Returns the value Python's `eval` gives such an expression, computed from its syntax tree: constants, the
    operators above, and calls of public methods on values built from constants (no names, no builtins)."""
    expression = expression.replace(",", "")
    if set(expression) <= MATH_CHARACTERS:
        if "**" in expression:
            return None
    elif not (set(expression) <= STRING_CHARACTERS and ".count(" in expression
              and not any(word in expression.lower() for word in REFUSED_WORDS)):
        return None
    try:
        return _value(ast.parse(expression.strip(), mode="eval").body)
    except Exception:  # noqa: BLE001 (a failing expression gives no result, as nanochat's)
        return None


def _value(node):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.Tuple):
        return tuple(_value(element) for element in node.elts)
    if isinstance(node, ast.Attribute) and not node.attr.startswith("_"):
        return getattr(_value(node.value), node.attr)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.keywords:
        arguments = [_value(argument) for argument in node.args]
        if any(isinstance(a, int) and abs(a) > MAX_INT_ARGUMENT for a in arguments):
            raise ValueError("argument too large")
        return _value(node.func)(*arguments)
    raise ValueError(f"not evaluated: {type(node).__name__}")


class CalculatorTool:
    """nanochat's tool-use state machine for one generation: per row, the expression tokens between
    `<|python_start|>` and `<|python_end|>`, and the tokens still to force after it."""

    def __init__(self, tokenizer, ids: dict[str, int]):
        self.tokenizer = tokenizer
        self.python_start, self.python_end = ids["<|python_start|>"], ids["<|python_end|>"]
        self.output_start, self.output_end = ids["<|output_start|>"], ids["<|output_end|>"]
        self.calls = 0

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "CalculatorTool | None":
        """The tool when the tokenizer has nanochat's four tool tokens (each one token of its vocabulary), else
        None."""
        vocabulary = tokenizer.get_vocab()
        if not all(token in vocabulary for token in TOOL_TOKENS):
            return None
        return cls(tokenizer, {token: vocabulary[token] for token in TOOL_TOKENS})

    def result_tokens(self, expression_ids: list[int]) -> list[int]:
        """The tokens forced after an expression: `<|output_start|>` value `<|output_end|>`, or none when the
        calculator gives no value."""
        self.calls += 1
        value = calculate(self.tokenizer.decode(expression_ids))
        if value is None:
            return []
        try:
            text = str(value)
        except ValueError:  # an integer longer than Python's str() allows
            return []
        return [self.output_start, *self.tokenizer(text, add_special_tokens=False)["input_ids"], self.output_end]

    def processor(self, prompt_length: int, batch_size: int) -> "CalculatorLogitsProcessor":
        return CalculatorLogitsProcessor(self, prompt_length, batch_size)


class CalculatorLogitsProcessor(LogitsProcessor):
    """Forces the calculator's tokens during `generate` (scores -inf but the forced token's). Reads the token each row
    chose last step, so it follows the rows across steps; one instance per `generate` call."""

    def __init__(self, tool: CalculatorTool, prompt_length: int, batch_size: int):
        self.tool, self.prompt_length = tool, prompt_length
        self.in_python = [False] * batch_size
        self.expression: list[list[int]] = [[] for _ in range(batch_size)]
        self.forced: list[list[int]] = [[] for _ in range(batch_size)]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_length:
            for row, token in enumerate(input_ids[:, -1].tolist()):
                self._advance(row, token)
        for row, forced in enumerate(self.forced):
            if forced:
                token = forced.pop(0)
                scores[row] = torch.finfo(scores.dtype).min
                scores[row, token] = 0.0
        return scores

    def _advance(self, row: int, token: int) -> None:
        tool = self.tool
        if token == tool.python_start:
            self.in_python[row], self.expression[row] = True, []
        elif token == tool.python_end and self.in_python[row]:
            self.in_python[row] = False
            if self.expression[row]:
                self.forced[row].extend(tool.result_tokens(self.expression[row]))
            self.expression[row] = []
        elif self.in_python[row]:
            self.expression[row].append(token)


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """The token ids of each user prompt as the chat template renders it for the assistant's reply.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    if not tokenizer.chat_template:
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')} has no chat template; ChatCORE "
                         "renders every prompt through the model's own template")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True) for prompt in prompts]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def letter_token_ids(tokenizer, letters) -> list[int]:
    """The token id of each answer letter, encoded alone as nanochat does.

    Raises:
        ValueError: a letter is not one token of this tokenizer."""
    ids = []
    for letter in letters:
        encoded = tokenizer(letter, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise ValueError(f"answer letter {letter!r} is {len(encoded)} tokens for this tokenizer; ChatCORE's "
                             "categorical tasks read the logit of a one-token letter")
        ids.append(encoded[0])
    return ids


def stop_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end a reply: the generation config's `eos_token_id` (one or several) and the tokenizer's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, (list, tuple)) else [configured]
    return sorted({token for token in (*configured, tokenizer.eos_token_id) if token is not None})


def left_padded(rows: list[list[int]], pad_token_id: int, device) -> dict[str, torch.Tensor]:
    """`input_ids`, `attention_mask` and `position_ids` `(batch_size, longest)` of left-padded rows (positions count
    from each row's first token; padding gets 1, as `generate` gives it)."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        input_ids[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
        attention_mask[r, width - len(row):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
            "position_ids": position_ids.to(device)}


def _forward_arguments(model) -> set[str]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return set(inspect.signature(base.forward).parameters)


@torch.no_grad()
def letter_logits(model, rows: list[list[int]], letter_ids: list[list[int]], pad_token_id: int) -> list[list[float]]:
    """For each prompt row, the float32 logits of the next token at `letter_ids[row]` (one forward for the batch)."""
    accepted = _forward_arguments(model)
    inputs = left_padded(rows, pad_token_id, model_device(model))
    if "position_ids" not in accepted:
        inputs.pop("position_ids")
    options = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
    logits = model(**inputs, use_cache=False, **options).logits[:, -1].float()  # (B, V)
    return [logits[r, ids].tolist() for r, ids in enumerate(letter_ids)]


def batches_by_length(rows: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of `rows`, longest first, in groups of `batch_size` (similar lengths pad little)."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def greedy_config(model, **settings) -> GenerationConfig:
    """The model's generation config (its `suppress_tokens`, e.g. a converted nanochat model's padded vocabulary
    rows, kept) made greedy, one sequence, with `settings` on top."""
    config = copy.deepcopy(getattr(model, "generation_config", None) or GenerationConfig())
    config.update(do_sample=False, num_beams=1, num_return_sequences=1, temperature=None, top_p=None, top_k=None,
                  min_p=None, typical_p=None, max_length=None, **settings)
    return config


@torch.no_grad()
def generate_completions(model, tokenizer, rows: list[list[int]], *, max_new_tokens: int, batch_size: int,
                         stop_ids: list[int], tool: CalculatorTool | None, pad_token_id: int,
                         calls: int | None = None) -> list[tuple[list[int], bool]]:
    """Greedy replies to prompt `rows` (token ids), in `batch_size` groups: per row the reply's tokens (without the
    stop token) and whether it was cut at `max_new_tokens`. `calls`: the number of `generate` calls to make (every
    process the same, see the module docstring); at least the batches needed."""
    device = model_device(model)
    config = greedy_config(model, max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_token_id)
    groups = batches_by_length(rows, batch_size)
    replies: list[tuple[list[int], bool] | None] = [None] * len(rows)
    for number in range(max(calls or 0, len(groups))):
        if number >= len(groups):  # a filler: one token from a one-token prompt
            filler = left_padded([[pad_token_id]], pad_token_id, device)
            filler.pop("position_ids")
            model.generate(**filler, generation_config=greedy_config(model, max_new_tokens=1, eos_token_id=stop_ids,
                                                                     pad_token_id=pad_token_id))
            continue
        batch = [rows[i] for i in groups[number]]
        inputs = left_padded(batch, pad_token_id, device)
        inputs.pop("position_ids")  # generate derives them from the mask
        width = inputs["input_ids"].shape[1]
        processors = LogitsProcessorList([tool.processor(width, len(batch))] if tool is not None else [])
        output = model.generate(**inputs, generation_config=config, logits_processor=processors)
        for index, generated in zip(groups[number], output[:, width:].tolist()):
            stop = next((k for k, token in enumerate(generated) if token in stop_ids), None)
            reply = generated if stop is None else generated[:stop]
            replies[index] = (reply, stop is None and len(generated) >= max_new_tokens)
    return replies
