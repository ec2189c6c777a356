"""Tokenizers for L3GPT: train a byte-level BPE with the `tokenizers` library, wrap it for transformers with a BOS
token, ChatML specials and a ChatML chat template; `token_bytes` for bits-per-byte.

The split pattern is GPT-4's with digit groups of at most 2 (nanochat's `SPLIT_PATTERN`, nanochat/tokenizer.py).
"""

from collections.abc import Iterable

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

BOS_TOKEN = "<|bos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, IM_START, IM_END, PAD_TOKEN]
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
# ChatML as Qwen2.5 writes it, without a default system prompt; BOS first, as every pretraining document starts.
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 32768) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and wrap it as a `PreTrainedTokenizerFast`.

    The vocabulary holds the 256 byte tokens, the merges, and the specials `<|bos|>` (BOS), `<|im_start|>`,
    `<|im_end|>` (EOS: ends an assistant turn) and `<|pad|>`. Encoding adds no special token by itself; the data
    pipeline prepends BOS to each document and the chat template writes BOS and the ChatML markers.

    Args:
        texts: training documents (any iterable of str; consumed once).
        vocab_size: final vocabulary size including the specials (nanochat uses 32768).

    Raises:
        ValueError: if `vocab_size` cannot hold the 256 bytes and the specials.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    tokenizer = Tokenizer(models.BPE(byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        model_max_length=1 << 30,
    )


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """An existing tokenizer (local folder or Hub name). Raises `ValueError` if it has no BOS token, which the
    BOS-aligned packing needs."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.bos_token_id is None:
        raise ValueError(
            f"tokenizer {name_or_path!r} has no bos_token; packing starts every row with BOS. Set one, e.g. "
            "tokenizer.bos_token = '<|endoftext|>', save it, and pass that folder"
        )
    return tokenizer


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> torch.LongTensor:
    """UTF-8 byte length of every token id, computed from the token's raw bytes (special tokens count 0).

    Byte-level BPE tokens (GPT-2 alphabet) are mapped back through the byte↔unicode table; SentencePiece-style
    tokens map `▁` to one space byte and `<0xHH>` byte-fallback tokens to one byte. No decode round trip: decoding
    a lone token of a multi-byte character yields U+FFFD and miscounts (nanochat's bug that hit 193/32768 tokens).

    Returns:
        `torch.LongTensor` of shape `(len(tokenizer),)`, bytes per token id.
    """
    backend = tokenizer.backend_tokenizer
    byte_level = _uses_byte_level(backend)
    byte_decoder = {char: byte for byte, char in bytes_to_unicode().items()}  # GPT-2's byte alphabet
    special_ids = set(tokenizer.all_special_ids) | {
        index for index, added in tokenizer.added_tokens_decoder.items() if added.special
    }
    lengths = torch.zeros(len(tokenizer), dtype=torch.long)
    for token, index in tokenizer.get_vocab().items():
        if index in special_ids or index >= len(lengths):
            continue
        if byte_level:
            lengths[index] = sum(1 if char in byte_decoder else len(char.encode()) for char in token)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            lengths[index] = 1
        else:
            lengths[index] = len(token.replace("\u2581", " ").encode())
    return lengths


def _uses_byte_level(backend: Tokenizer) -> bool:
    def walk(component) -> bool:
        if component is None:
            return False
        if isinstance(component, (pre_tokenizers.ByteLevel, decoders.ByteLevel)):
            return True
        return any(walk(child) for child in getattr(component, "pretokenizers", None) or [])

    return walk(backend.pre_tokenizer) or walk(backend.decoder)

