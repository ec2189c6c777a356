"""L3 tables served from CPU memory at inference ("L³: Large Lookup Layers", Tseng & De Sa, arXiv 2601.21461: routing
is by token id, so the rows a forward needs are known before any layer runs and can be fetched while the decoder
layers before the L3 layer compute).

Two ways to hold a table, chosen by [`L3OffloadMixin.offload_l3_tables`] (a method of every L3GPT model):
- in RAM, page-locked (pinned) when CUDA is available: the GPU keeps none of the table; each forward copies only
  the routed tokens' rows to the GPU on a side stream, started before the first decoder layer, and the L3 layer waits
  on an event. For a GPU that cannot spare the tables' memory, on a host that can hold them.
- memory-mapped from the checkpoint's safetensors file: nothing is read until a token routes to its rows, so a
  process's RSS grows with the pages it touches, and processes serving the same file share one copy in the page
  cache. For CPU-only machines (or a host with less free RAM than the tables); on a GPU machine every fetch is a
  host gather from pageable memory first (slower than pinned).

Either way the L3 layer computes on exact copies of the rows the on-device model reads, so outputs are identical.
Inference only: the fetched rows are constants (`LargeLookupLayer` refuses to run with gradients for offloaded
tables; frozen tables — PEFT's base weights — are fine).

Self-contained (no `hfl3.` imports): this file ships with the modeling file as Hub remote code.
"""

import os
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn

# A forward routing at most this many distinct tokens (decoding: one per sequence) copies each token's contiguous
# rows straight from the pinned table (one DMA each, no host gather); more (prefill) gather on the host first.
DIRECT_COPY_MAX_TOKENS = 32


def host_memory(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in CPU memory, page-locked when CUDA is available (host→device copies from it run asynchronously);
    without CUDA a tensor already in CPU memory is returned as is (memory-mapped storage stays mapped)."""
    tensor = tensor.detach()
    if not torch.cuda.is_available():
        return tensor.cpu()
    if tensor.device.type == "cpu" and tensor.is_pinned():
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)


class HostTable(nn.Embedding):
    """An L3 table whose weight stays in CPU memory while the rest of the model moves: `.to(device)` and `.cuda()`
    leave it where it is; a dtype change (`.to(torch.bfloat16)`, `.half()`) still applies, in CPU memory. Its
    `weight` is still the `(rows, hidden_size)` parameter that `state_dict` and `save_pretrained` see."""

    @classmethod
    def holding(cls, table: nn.Embedding, weight: torch.Tensor | None = None) -> "HostTable":
        """A `HostTable` with `table`'s rows: `weight` if given (e.g. memory-mapped), else `table.weight` in host
        memory. `table`'s `requires_grad` and init tag are kept."""
        weight = host_memory(table.weight) if weight is None else weight
        host = cls(*weight.shape, _weight=weight, _freeze=not table.weight.requires_grad)
        if hasattr(table, "hfl3_init"):
            host.hfl3_init = table.hfl3_init
        return host

    def _apply(self, fn, recurse=True):
        # `fn` is opaque (a device move, a cast, or both): probe it on an empty tensor and keep only the cast
        dtype = fn(torch.empty(0, dtype=self.weight.dtype)).dtype
        if dtype != self.weight.dtype:
            requires_grad = self.weight.requires_grad
            self.weight = nn.Parameter(host_memory(self.weight.to(dtype)), requires_grad=requires_grad)
        return self


class FetchedRows(NamedTuple):
    """Rows of one table for one forward: `rows` `(R, hidden_size)` on the compute device, the routed tokens' rows
    token after token (tokens by increasing id); `ready`: CUDA event recorded after the copy (None off CUDA)."""

    rows: torch.Tensor
    ready: torch.cuda.Event | None


class L3Prefetch(NamedTuple):
    """The offloaded tables' rows routed in one forward. `starts`: `(N,)` first row of each routed token in the
    fetched rows (a token's rows stay consecutive); `fetched`: one [`FetchedRows`] per `HostTable`."""

    starts: torch.LongTensor
    fetched: dict

    def rows(self, table: HostTable) -> torch.Tensor:
        """`table`'s fetched rows; on CUDA the current stream waits (on the device, not the host) for their copy."""
        fetched = self.fetched[table]
        if fetched.ready is not None:
            stream = torch.cuda.current_stream(fetched.rows.device)
            stream.wait_event(fetched.ready)
            fetched.rows.record_stream(stream)  # allocated on the side stream, read on this one
        return fetched.rows


def host_row_index(starts: torch.LongTensor, sizes: torch.LongTensor) -> torch.LongTensor:
    """Rows `starts[u] : starts[u] + sizes[u]` for every u, concatenated: `(sizes.sum(),)`."""
    offsets = torch.cumsum(sizes, 0) - sizes
    return torch.repeat_interleave(starts - offsets, sizes) + torch.arange(int(sizes.sum()))


def copy_rows(weight: torch.Tensor, starts: torch.LongTensor, sizes: torch.LongTensor, out: torch.Tensor) -> None:
    """Copy rows `starts[u] : starts[u] + sizes[u]` of the host `weight`, for every u in order, into `out`."""
    if len(starts) <= DIRECT_COPY_MAX_TOKENS and (out.device.type == "cpu" or weight.is_pinned()):
        offset = 0
        for start, size in zip(starts.tolist(), sizes.tolist()):
            out[offset : offset + size].copy_(weight[start : start + size], non_blocking=True)
            offset += size
        return
    index = host_row_index(starts, sizes)
    if out.device.type == "cpu":
        torch.index_select(weight, 0, index, out=out)
        return
    staging = torch.empty(out.shape, dtype=out.dtype, pin_memory=out.device.type == "cuda")
    torch.index_select(weight, 0, index, out=staging)
    out.copy_(staging, non_blocking=True)  # the caching host allocator keeps `staging` until the copy is done


@torch.compiler.disable
@torch.no_grad()
def prefetch_routed_rows(input_ids: torch.LongTensor, l3_bounds: torch.LongTensor, routing,
                         tables: list[HostTable]) -> L3Prefetch:
    """Start copying the rows that `input_ids` route to, of every table in `tables`, to `input_ids`' device.

    On CUDA the copies run on a side stream and this returns once they are queued (one small device→host read of the
    ids first), so they overlap with whatever the current stream runs next; [`L3Prefetch.rows`] makes the L3 layer
    wait for them. Each distinct token's rows are fetched once.

    Args:
        input_ids: `(batch_size, seq_len)` token ids.
        l3_bounds: `(vocab_size + 1,)` CSR bounds of the allocation (token t owns rows `l3_bounds[t]:l3_bounds[t+1]`).
        routing: the `L3Routing` of `input_ids` (`l3_routing`).
        tables: the offloaded tables (a tied key/value table once).
    """
    device = input_ids.device
    ids = input_ids.reshape(-1)
    starts = l3_bounds[ids]
    ids, starts, sizes = torch.stack([ids, starts, l3_bounds[ids + 1] - starts]).cpu()  # (N,) each, on the host
    unique_ids, inverse = torch.unique(ids, return_inverse=True)
    unique_starts = starts.new_empty(len(unique_ids)).scatter_(0, inverse, starts)
    unique_sizes = sizes.new_empty(len(unique_ids)).scatter_(0, inverse, sizes)
    fetched_starts = torch.cumsum(unique_sizes, 0) - unique_sizes  # first fetched row of each distinct token
    row_shift = (fetched_starts - unique_starts)[inverse]  # (N,) fetched row = table row + shift
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    fetched = {}
    for table in tables:
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            rows = torch.empty((int(unique_sizes.sum()), table.embedding_dim), dtype=table.weight.dtype, device=device)
            copy_rows(table.weight, unique_starts, unique_sizes, rows)
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
        fetched[table] = FetchedRows(rows, ready)
    row_shift = row_shift.to(device, non_blocking=True)  # after the copies are queued: no wait for this stream
    return L3Prefetch(routing.starts + row_shift, fetched)


def host_tables(l3_layers: nn.ModuleDict) -> list[HostTable]:
    """The offloaded tables of `l3_layers` (a tied key/value table once); empty when none is offloaded."""
    return [table for layer in l3_layers.values() for table in (layer.key_table, layer.value_table)
            if isinstance(table, HostTable)]


def fetched_tables(prefetch: L3Prefetch | None, key_table: HostTable, value_table: HostTable):
    """(key rows, value rows, starts) that an L3 layer with offloaded tables reads in this forward (`starts`: `(N,)`
    first fetched row of each token).

    Raises:
        RuntimeError: if the tables would need gradients (training them needs the whole tables where the optimizer
            is), or if the forward did not fetch them (the layer was called outside `L3GPTModel.forward`).
    """
    if torch.is_grad_enabled() and (key_table.weight.requires_grad or value_table.weight.requires_grad):
        raise RuntimeError(
            "the L3 tables are offloaded to CPU memory (offload_l3_tables / l3_offload), which serves inference: run "
            "under torch.no_grad() or torch.inference_mode() (generate() does), or freeze the tables "
            "(requires_grad_(False), as PEFT does with base weights) to train the other parameters; to train the "
            "tables, load the model without offloading"
        )
    if prefetch is None:
        raise RuntimeError(
            "offloaded L3 tables are fetched by L3GPTModel.forward (route_l3); call the model, not the L3 layer alone"
        )
    return prefetch.rows(key_table), prefetch.rows(value_table), prefetch.starts


def mapped_tables(checkpoint: str | os.PathLike, names: list[str]) -> dict[str, torch.Tensor]:
    """Tensors `names` (state-dict names up to a prefix, e.g. `l3_layers.0.key_table.weight`) memory-mapped from a
    safetensors checkpoint: a folder with `model.safetensors` or `model.safetensors.index.json` + shards, or one
    `.safetensors` file. Nothing is read until a row is used.

    Raises:
        FileNotFoundError: if `checkpoint` holds no safetensors weights.
        KeyError: if a name is not in the checkpoint.
    """
    path = Path(checkpoint)
    files = [path] if path.is_file() else sorted(path.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{checkpoint}: no model*.safetensors file; memory-mapping the L3 tables needs a local safetensors "
            "checkpoint (what save_pretrained writes)"
        )
    found = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as weights:
            for key in weights.keys():
                name = next((n for n in names if key == n or key.endswith("." + n)), None)
                if name is not None:
                    found[name] = weights.get_tensor(key)  # a view of the file's mapping, not a copy
    missing = [name for name in names if name not in found]
    if missing:
        raise KeyError(f"{checkpoint}: no tensor named {missing[0]} (or ending in it) in {[f.name for f in files]}")
    return found


def offload_tables(l3_layers: nn.ModuleDict, mmap_checkpoint: str | os.PathLike | None = None) -> None:
    """Replace every L3 layer's tables by [`HostTable`]s: in host memory, or mapped from `mmap_checkpoint`.

    Raises:
        ValueError: if a mapped tensor's shape or dtype differs from the model's table.
    """
    slots = [(index, name) for index, layer in l3_layers.items() for name in ("key_table", "value_table")
             if getattr(layer, name) is not None]
    names = [f"l3_layers.{index}.{name}.weight" for index, name in slots]
    mapped = mapped_tables(mmap_checkpoint, names) if mmap_checkpoint is not None else {}
    for (index, name), full_name in zip(slots, names):
        table, weight = getattr(l3_layers[index], name), mapped.get(full_name)
        if weight is not None and (weight.shape, weight.dtype) != (table.weight.shape, table.weight.dtype):
            raise ValueError(
                f"{mmap_checkpoint}: {full_name} is {tuple(weight.shape)} {weight.dtype}, the model's table is "
                f"{tuple(table.weight.shape)} {table.weight.dtype}; load the model with dtype={weight.dtype} from "
                "this checkpoint"
            )
        setattr(l3_layers[index], name, HostTable.holding(table, weight))


def single_device(device_map) -> torch.device | None:
    """The one device of a `device_map` (`"cuda"`, `0`, `torch.device`, or `{"": device}`); None for None.

    Raises:
        ValueError: for a map over several devices or a strategy name such as "auto".
    """
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if device_map is None:
        return None
    try:
        return torch.device(device_map)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device_map={device_map!r} with l3_offload: give one device (e.g. 'cuda'); the L3 tables stay in CPU "
            "memory and the rest of the model goes to that device"
        ) from None


def local_checkpoint_folder(pretrained_model_name_or_path, kwargs: dict) -> Path:
    """Local folder of the checkpoint's safetensors files (a Hub id resolves to its cached snapshot, which
    `from_pretrained` has just filled).

    Raises:
        FileNotFoundError: if the checkpoint has no safetensors weights.
    """
    from transformers.utils import cached_file

    hub = {key: kwargs[key] for key in ("cache_dir", "token", "revision", "local_files_only", "subfolder", "proxies")
           if key in kwargs}
    for filename in ("model.safetensors", "model.safetensors.index.json"):
        found = cached_file(pretrained_model_name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                            **hub)
        if found:
            return Path(found).parent
    raise FileNotFoundError(
        f"{pretrained_model_name_or_path}: no model.safetensors or model.safetensors.index.json; l3_offload='mmap' "
        "needs safetensors weights"
    )


class L3OffloadMixin:
    """`L3GPTPreTrainedModel`'s offloading: `offload_l3_tables` on a loaded model, `l3_offload` in `from_pretrained`."""

    def offload_l3_tables(self, mmap_checkpoint: str | os.PathLike | None = None):
        """Keep the L3 tables in CPU memory for inference; returns the model. Each forward fetches only the routed
        tokens' rows, on CUDA on a side stream overlapped with the decoder layers before the L3 layer; outputs equal
        the on-device model's. `mmap_checkpoint`: None = tables in RAM (pinned when CUDA is available); a folder or
        `.safetensors` file `save_pretrained` wrote for these weights = tables memory-mapped from it. Later `.to()`
        calls leave the tables in CPU memory. Inference only. When to use which: this module's docstring.

        Raises:
            FileNotFoundError, KeyError, ValueError: `mmap_checkpoint` lacks the tables or they do not fit the model.
        """
        offload_tables(self.base_model.l3_layers, mmap_checkpoint)
        return self

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, l3_offload: bool | str = False, **kwargs):
        """transformers' `from_pretrained`, plus `l3_offload`: `True` or `"mmap"` loads on the CPU, offloads the L3
        tables (`offload_l3_tables`; `"mmap"` maps them from the checkpoint's files) and moves the rest to
        `device_map`'s one device, so the tables never occupy the accelerator.

        Raises:
            ValueError: if `l3_offload` is not False, True or "mmap", or `device_map` spans several devices.
        """
        if not l3_offload:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        if l3_offload is not True and l3_offload != "mmap":
            raise ValueError(
                f"l3_offload={l3_offload!r}: expected True (tables in CPU memory, pinned when CUDA is available) or "
                "'mmap' (tables memory-mapped from the checkpoint's safetensors files)"
            )
        device = single_device(kwargs.pop("device_map", None))
        model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        checkpoint = None
        if l3_offload == "mmap":
            checkpoint = local_checkpoint_folder(pretrained_model_name_or_path, kwargs)
        model.offload_l3_tables(mmap_checkpoint=checkpoint)
        return model if device is None else model.to(device)
