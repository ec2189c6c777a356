"""Serving tests: hfl3's L3GPT folders, and the SFT recipe's LoRA adapters, in vLLM against transformers.

They run in the serving environment (`make test-serving`: vLLM's CPU build and this plugin, no hfl3 and vLLM's own
transformers). What vLLM must reproduce comes from hfl3's environment: `make_reference.py` runs there in a
subprocess (`HFL3_PYTHON`, default the repository's `.venv/bin/python`), once per session and part, and writes the
folders and transformers' generations as JSON; the tests only read them. So each side runs with the transformers it
is built for, and the comparison is of token ids and numbers, never of objects across environments.

Engines run in the test process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor: seconds to start instead of
a minute of process spawning on 2 cores) with a 64 MiB KV cache, float32, eager (no torch.compile), and 32-token
blocks: the smallest the CPU attention takes; for models with the smear's state vLLM would otherwise align blocks to
128 tokens, which none of these prompts fills, and prefix caching would never hit.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
MAKE_REFERENCE = Path(__file__).with_name("make_reference.py")
HFL3_PYTHON = Path(os.environ.get("HFL3_PYTHON", REPO / ".venv" / "bin" / "python"))
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=256, block_size=32, kv_cache_memory_bytes=64 << 20,
              distributed_executor_backend="uni", max_num_seqs=8, seed=0)
# float32 log-probabilities of the same model through other kernels (matmul blocking, attention, norms): each of the
# ~20 sequential reductions of these 2–4-layer stacks rounds at eps32 = 1.2e-7 relative to values of the logits'
# size (≤ 15, the softcap): a bound of 15 · 20 · eps32 = 3.6e-5, and 1e-4 is about 3 times it (measured: ≤ 4.9e-6).
LOGPROB_TOLERANCE = 1e-4


def make_part(out: Path, part: str) -> Path:
    """Run `make_reference.py out part` with hfl3's Python; fail with its output tail when it fails."""
    if not HFL3_PYTHON.exists():
        pytest.fail(f"{HFL3_PYTHON} not found: the references come from hfl3's environment (`make install`, or set "
                    "HFL3_PYTHON to a Python with hfl3 installed)", pytrace=False)
    result = subprocess.run([str(HFL3_PYTHON), str(MAKE_REFERENCE), str(out), part], capture_output=True, text=True,
                            timeout=900, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode:
        pytest.fail(f"make_reference.py {part} failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}",
                    pytrace=False)
    return out


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """`references(part)` → the folder holding that part's outputs (made on first use, once per session)."""
    out, made = tmp_path_factory.mktemp("references"), set()

    def get(part: str) -> Path:
        if part not in made:
            make_part(out, part)
            made.add(part)
        return out

    return get


def read_reference(path: Path) -> dict:
    return json.loads(path.read_text())


@contextmanager
def engine(model: Path, **kwargs):
    """A vLLM `LLM` for `model` with `ENGINE`'s settings (overridden by `kwargs`), shut down on exit."""
    from vllm import LLM

    llm = LLM(model=str(model), **{**ENGINE, **kwargs})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def assert_first_logprobs(output, reference: list[list]) -> None:
    """vLLM's log-probabilities of the first new token equal transformers' top ones within `LOGPROB_TOLERANCE`."""
    logprobs = output.outputs[0].logprobs[0]
    for token, value in reference:
        assert token in logprobs, f"token {token} (transformers' top {len(reference)}) not in vLLM's top log-probs"
        assert abs(logprobs[token].logprob - value) <= LOGPROB_TOLERANCE, (token, logprobs[token].logprob, value)


def first_difference(got: list[int], want: list[int], margins: list[float]) -> str:
    """Where two token lists part, with transformers' top-2 logit margin there (a near tie says round-off)."""
    step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    margin = f"{margins[step]:.2e}" if step < len(margins) else "n/a"
    return f"tokens differ from step {step} (transformers' top-2 margin there {margin}): {got[step:step + 5]} vs " \
           f"{want[step:step + 5]}"
