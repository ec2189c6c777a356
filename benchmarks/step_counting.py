"""What one training step does, counted on a CPU, for `benchmarks/step_proxies.py` (its docstring: method and
limits): `StepEventCounter`, `host_syncs.HostSyncCounter` that also records the step's copies, fills and device ops
by source; `RuntimeStepCounter`, the same for a compiled step (only what Inductor's generated code dispatches); the
compiled graph's summaries (device→host copies a graph keeps, the generated code, the profiler's kernel events); the
bytes of parameters, gradients and optimizer state by group, and of the tensors saved for backward (eager under
`FakeTensorMode`; compiled, Inductor's own partition); and the per-token scaling of counts to a GPU shape."""

import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

import host_syncs
from common import shown_path
from host_syncs import DEFERRED, NOT_SYNCS, HostSyncCounter

aten = torch.ops.aten
HARNESS_FILES = {__file__}  # frames of the counting itself: a benchmark adds its own (`StepEventCounter.where`)

COPY, FILL, SYNC, OP = "copy", "fill", "sync", "device op"
# Copy kinds (rows of the table); a blocking host→device copy is also a host sync on CUDA
H2D, H2D_NB, NUM_ITEMS = "host→device (blocking)", "host→device (non_blocking)", "num_items_in_batch → device"
D2H, D2H_NB = "device→host (blocking)", "device→host (non_blocking)"
D2D_MEMCPY, D2D_STRIDED, D2D_FOREACH, CAST = ("device→device, Memcpy DtoD on CUDA", "device→device, strided (a copy "
                                              "kernel)", "_foreach_copy_ (multi_tensor_apply on CUDA)",
                                              "dtype cast (a kernel)")
ZEROING, FILL_KERNEL = "zeroing (cudaMemsetAsync on CUDA)", "fill kernel"
BLOCKING_H2D_SYNC = "blocking copy to device"  # sync kind: CUDA waits for a blocking host→device copy
ZERO_OPS = {aten.zero_, aten.zeros, aten.zeros_like, aten.new_zeros}
FILL_OPS = {aten.fill_, aten.fill, aten.full, aten.full_like, aten.new_full, aten.ones, aten.ones_like, aten.new_ones,
            aten.masked_fill, aten.masked_fill_}
FACTORIES = {aten.zeros, aten.full, aten.ones}  # no tensor input: on the device where model code gives `device=`
# aten ops that launch no device work (views, metadata, allocation); left out of "ops outside any graph"
NO_KERNEL = {"aten::" + name for name in (
    "empty empty_strided empty_like new_empty new_empty_strided view reshape _unsafe_view as_strided t transpose "
    "permute expand expand_as detach detach_ alias slice select unsqueeze squeeze split unbind split_with_sizes chunk "
    "narrow lift_fresh resolve_conj resolve_neg to contiguous numpy_T mT matmul linear result_type size stride dim "
    "is_nonzero item _local_scalar_dense set_ _reshape_alias view_as flatten unflatten unfold diagonal "
    "_has_compatible_shallow_copy_type record_stream is_pinned").split()}

# ---- counting --------------------------------------------------------------------------------------------------


def _target_device(args, kwargs):
    """The device a `Tensor.to(...)` call moves to: a `torch.device`, a device string or a tensor's device; None for
    a dtype-only call."""
    for target in (kwargs.get("device"), *args):
        if isinstance(target, (torch.device, str)):
            return target
        if isinstance(target, torch.Tensor):
            return target.device
    return None


def memcpy_like(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether CUDA copies `src` into `dst` with one `cudaMemcpyAsync` (same dtype, both contiguous)."""
    return dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()


class StepEventCounter(HostSyncCounter):
    """`HostSyncCounter` (the syncs, and how device tensors are told apart) that also records copies and fills as
    `events` (dicts with `step`, `category`, `kind`, `op`, `bytes` and `HostSyncCounter.where`'s site)."""

    def __init__(self, nanochat_dir: str | None = None):
        super().__init__(nanochat_dir)
        self.events: list[dict] = []
        self.harness_files.update(HARNESS_FILES)

    op_sources = False  # name the source of every device op (the eager step runs thousands: not there)

    def source(self) -> str:
        """`library: function` of the op being recorded, for torch's own functions their caller's."""
        found = self.where()
        library, site = (found["caller_library"], found["caller"]) if found["library"] == "torch" and found["caller"] \
            else (found["library"], found["site"])
        return f"{library}: {site.rsplit(' (', 1)[-1].rstrip(')')}"

    def record_event(self, category: str, kind: str, op: str, nbytes: int = 0) -> None:
        self.events.append(dict(step=self.step, category=category, kind=kind, op=op, bytes=nbytes, **self.where()))

    def is_device(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor in self.device_tensors

    def observe_call(self, name: str, args, kwargs) -> None:
        if name != "to" or not args or not isinstance(args[0], torch.Tensor) or self.is_device(args[0]):
            return
        target = _target_device(args[1:], kwargs)
        if target is None or (isinstance(target, str) and target.split(":")[0] == "cpu"):
            return  # a cast, or a copy that stays on the host
        non_blocking = bool(kwargs.get("non_blocking") or any(arg is True for arg in args[1:]))
        self._host_to_device(args[0], non_blocking, "Tensor.to")
        self.mark_device(args[0])  # the batch now on the device (on a CPU `.to` returns the same tensor)

    def _host_to_device(self, tensor: torch.Tensor, non_blocking: bool, op: str) -> None:
        kind = H2D_NB if non_blocking else H2D
        where = self.where()
        if "num_items_in_batch" in where["site"]:
            kind = NUM_ITEMS + (" (non_blocking)" if non_blocking else "")
        self.events.append(dict(step=self.step, category=COPY, kind=kind, op=op, bytes=tensor.nbytes, **where))
        if not non_blocking:  # CUDA waits for it: cudaMemcpyAsync + cudaStreamSynchronize
            self.syncs.append(dict(step=self.step, kind=BLOCKING_H2D_SYNC, op=op, **where))

    def observe_op(self, func, args, kwargs, on_device: bool) -> None:
        packet = func.overloadpacket
        in_graph = self.in_compiled_code()
        device = on_device or in_graph
        name = str(packet).removeprefix("aten.")
        if on_device and not in_graph and f"aten::{name}" not in NO_KERNEL:
            source = self.source() if self.op_sources else ""
            self.events.append(dict(step=self.step, category=OP, kind=name, op=name, bytes=0, source=source))
        if packet is aten.copy_:
            dst, src = args[0], args[1]
            to_device, from_device = self.is_device(dst) or in_graph, self.is_device(src) or in_graph
            non_blocking = bool(kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
            if to_device and from_device:
                kind = D2D_MEMCPY if memcpy_like(dst, src) else CAST if dst.dtype != src.dtype else D2D_STRIDED
                self.record_event(COPY, kind, name, dst.nbytes)
            elif to_device:
                self._host_to_device(src, non_blocking, name)
            elif from_device:
                self.record_event(COPY, D2H_NB if non_blocking else D2H, name, src.nbytes)
        elif packet is aten._foreach_copy_ and device:
            self.record_event(COPY, D2D_FOREACH, name, sum(t.nbytes for t in args[0]))
        elif packet is aten.clone and device:
            self.record_event(COPY, D2D_MEMCPY if args[0].is_contiguous() else D2D_STRIDED, name, args[0].nbytes)
        elif packet is aten._to_copy and device:
            dtype = kwargs.get("dtype")
            self.record_event(COPY, CAST if dtype not in (None, args[0].dtype) else D2D_MEMCPY, name, args[0].nbytes)
        elif packet in (aten._local_scalar_dense, aten.item) and device:
            self.record_event(COPY, D2H, name, args[0].element_size())
        elif packet in ZERO_OPS or packet in FILL_OPS:
            if packet in FACTORIES:
                device = in_graph or (kwargs.get("device") is not None and self.in_model_code())
            if device:
                self.record_event(FILL, ZEROING if packet in ZERO_OPS else FILL_KERNEL, name)

    def in_compiled_code(self) -> bool:
        """Whether the op is called by Inductor's generated code (every tensor there is on the graph's device)."""
        return False

    def summarize_events(self, steps: list[int]) -> dict:
        """Per step (mean over `steps`): syncs, copies and fills by kind, by library and by site."""
        n = max(1, len(steps))
        syncs = [s for s in self.syncs if s["step"] in steps and s["kind"] not in NOT_SYNCS]
        events = [e for e in self.events if e["step"] in steps]
        out = {"steps": steps, SYNC: _by(syncs, n)}
        for category in (COPY, FILL):
            out[category] = _by([e for e in events if e["category"] == category], n)
        ops = [e for e in events if e["category"] == OP]
        out[OP] = dict(total=len(ops) / n, **{key: {k: v / n for k, v in Counter(e[field] for e in ops).most_common()}
                                              for key, field in (("by_kind", "kind"), ("by_source", "source"))})
        out["deferred"] = _by([s for s in self.syncs if s["step"] in steps and s["kind"] == DEFERRED], n)
        return out


def _by(records: list[dict], steps: int) -> dict:
    """Counts per step: total, by kind, by library, and by `kind | library: site` (with the caller for torch sites)."""
    def site(r):
        via = f" via {r['caller']}" if r["library"] == "torch" and r.get("caller") else ""
        return f"{r['kind']} | {r['library']}: {r['site']}{via}"

    per = lambda counter: {key: count / steps for key, count in counter.most_common()}  # noqa: E731
    return dict(total=len(records) / steps, bytes=sum(r.get("bytes", 0) for r in records) / steps,
                by_kind=per(Counter(r["kind"] for r in records)),
                by_library=per(Counter(r["library"] for r in records)),
                by_site=per(Counter(site(r) for r in records)))


class RuntimeStepCounter(StepEventCounter):
    """The counter of the compiled steps: a dispatch mode that ignores compile internals (Inductor's fused kernels
    are not seen, only what its generated code dispatches) and `Tensor.to/cpu/tolist/numpy` wrapped (a function mode
    would make dynamo recompile). No module hooks (dynamo would trace them): device tensors are marked by the arm
    (`mark_device`: parameters, buffers, gradients, optimizer state, the batch) and by ops on them."""

    module_hooks = False
    op_sources = True

    def __init__(self, nanochat_dir: str | None = None):
        super().__init__(nanochat_dir)
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        self.generated_code = str(Path(cache_dir()).resolve())

    def recorders(self) -> tuple:
        return _WrappedMethods(self), _RuntimeDispatchRecorder(self)

    def nested_recorders(self) -> tuple:
        """A custom op's body runs eagerly even when a compiled graph calls it: `HostSyncCounter`'s own modes."""
        return host_syncs._FunctionRecorder(self), host_syncs._DispatchRecorder(self)

    def treat_as_device(self, args, kwargs) -> bool:
        """Inside Inductor's generated code every tensor is on the graph's device (a custom op's body then sees its
        inputs as device tensors), but a 0-D integer tensor, taken for a host scalar that the graph copied to the
        host (L3's pair count: `.cpu()` in the graph, which a CPU's generated code leaves out)."""
        if not self.in_compiled_code():
            return False
        self.mark_device([leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)
                          and not (leaf.ndim == 0 and not leaf.is_floating_point())])
        return True

    def in_compiled_code(self) -> bool:
        """Whether Inductor's generated code itself called the op (its first caller outside torch and this harness;
        not an op inside a custom op's body that generated code called)."""
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename in self.harness_files
                                     or frame.f_code.co_filename == host_syncs.__file__
                                     or f"{os.sep}torch{os.sep}" in frame.f_code.co_filename):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename.startswith(self.generated_code)

    def library(self, filename: str) -> str:
        return "compiled graph" if filename.startswith(self.generated_code) else super().library(filename)

    def where(self) -> dict:
        found = super().where()
        for key, library in (("site", "library"), ("caller", "caller_library")):
            if found[library] == "compiled graph":
                found[key] = "Inductor's generated code"
        return found


class _RuntimeDispatchRecorder(host_syncs._DispatchRecorder):
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class _WrappedMethods:
    """Context that wraps `Tensor.to/cpu/tolist/numpy` with `host_syncs`' function recorder's logic (re-entrant)."""

    NAMES = ("to", "cpu", "tolist", "numpy")
    active = 0

    def __init__(self, counter: HostSyncCounter):
        self.counter = counter
        self.saved = {}

    def __enter__(self):
        type(self).active += 1
        if type(self).active == 1:
            recorder = host_syncs._FunctionRecorder(self.counter)
            for name in self.NAMES:
                original = getattr(torch.Tensor, name)
                self.saved[name] = original
                setattr(torch.Tensor, name, _wrapped(recorder, original))
        return self

    def __exit__(self, *exc):
        type(self).active -= 1
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def _wrapped(recorder, original):
    def method(*args, **kwargs):
        return recorder.__torch_function__(original, (), args, kwargs)

    method.__name__ = original.__name__
    return method


def copies_to_host(gm: torch.fx.GraphModule) -> list[str]:
    """The sites of the device→host copies a dynamo graph keeps (`.cpu()`, `.tolist()`, `.numpy()`, `.item()`,
    `.to("cpu")`): on a CPU its generated code leaves them out (the tensor is already there), on CUDA each is a
    blocking copy, a host sync inside the compiled step."""
    sites = []
    for node in gm.graph.nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        to_cpu = name == "to" and any(isinstance(arg, str) and arg.startswith("cpu")
                                      for arg in (*node.args[1:], node.kwargs.get("device")))
        if node.op in ("call_method", "call_function") and (name in ("cpu", "tolist", "numpy", "item") or to_cpu):
            frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', node.meta.get("stack_trace") or "")
            file, line, function = frames[-1] if frames else ("?", "?", "?")
            sites.append(f"{name}: {shown_path(file)}:{line} ({function})")
    return sites


def generated_code_summary(modules) -> dict:
    """What Inductor generated (its Python wrapper modules): per module, the kernels it defines and, in its `call`,
    the kernel launches and the extern/fallback ops it calls, and `.zero_()`/`fill_` calls."""
    per_module = []
    for module in modules:
        path = getattr(module, "__file__", None)
        if not path or not Path(path).is_file():
            continue
        source = Path(path).read_text()
        defined = re.findall(r"^(\w+) = async_compile\.(?:cpp_pybinding|cpp|triton)\(", source, re.M)
        body = source.split("def call(", 1)[1] if "def call(" in source else ""
        body = body.split("\ndef ", 1)[0].split("\nclass ", 1)[0]
        launches = sum(len(re.findall(rf"\b{re.escape(name)}(?:\.run)?\(", body)) for name in defined)
        extern = re.findall(r"\b(extern_kernels\.\w+|torch\.ops\.[\w.]+|aten\.[\w.]+)\(", body)
        per_module.append(dict(module=Path(path).stem[:12], kernels_defined=len(defined), kernel_launches=launches,
                               extern_calls=dict(Counter(extern)),
                               zeroings=len(re.findall(r"\.zero_\(\)", body)),
                               fills=len(re.findall(r"\.fill_\(", body))))
    return dict(modules=len(per_module), kernels_defined=sum(m["kernels_defined"] for m in per_module),
                kernel_launches_per_call=sum(m["kernel_launches"] for m in per_module), per_module=per_module)


def profile_summary(profiler, steps: int) -> dict:
    """Per step, from torch.profiler's CPU events of the counted compiled steps: compiled graph calls, the kernels
    Inductor generated that they launched (C++ kernel events, `cpp.enable_kernel_profile`) and the aten ops they
    called (extern kernels, fallbacks, custom ops), by name."""
    graph_calls, kernels, extern = Counter(), Counter(), Counter()
    for event in profiler.events():
        if event.name.startswith("## Call CompiledFxGraph"):
            graph_calls[event.name] += 1
        elif event.cpu_parent is not None and event.cpu_parent.name.startswith("## Call CompiledFxGraph"):
            (extern if "::" in event.name else kernels)[event.name] += 1
    per = lambda counter: {k: v / steps for k, v in counter.most_common()}  # noqa: E731
    return dict(graph_calls=sum(graph_calls.values()) / steps, kernels=sum(kernels.values()) / steps,
                extern_ops=sum(extern.values()) / steps, kernels_by_name=per(kernels), extern_by_name=per(extern))


# ---- bytes -------------------------------------------------------------------------------------------------------


def role_of(name: str, param: torch.Tensor, l3_tables: set[int]) -> str:
    """A parameter's group, by the same rules for both models (hfl3's names / nanochat's names): L3 tables (hfl3's
    `l3_table` optimizer group), lm_head, embeddings (`embed_tokens` / `wte`), value embeddings, scalars (< 2-D),
    matrices (the rest: projections, MLPs, gates)."""
    if id(param) in l3_tables:
        return "L3 tables"
    if "lm_head" in name:
        return "lm_head"
    if re.search(r"(^|\.)value_embed(ding)?s\.", name):  # the tables, not hfl3's value-embedding gates
        return "value embeddings"
    if "embed_tokens" in name or "wte" in name:
        return "embeddings"
    return "scalars" if param.ndim < 2 else "matrices"


def _storage_key(tensor: torch.Tensor) -> int:
    return StorageWeakRef(tensor.untyped_storage()).cdata


def _record(tensor: torch.Tensor) -> tuple[str, int, int]:
    """(dtype, storage key, storage bytes) of a tensor: what the byte counts need, without holding the tensor."""
    return str(tensor.dtype).removeprefix("torch."), _storage_key(tensor), tensor.untyped_storage().nbytes()


def tensor_bytes(records_by_group: dict[str, list[tuple[str, int, int]]]) -> dict:
    """`{"total", "by_dtype", "by_group"}` bytes of `_record`s, each storage counted once (in the first group that
    holds it)."""
    seen, by_dtype, by_group = set(), Counter(), Counter()
    for group, records in records_by_group.items():
        for dtype, key, nbytes in records:
            if key not in seen:
                seen.add(key)
                by_dtype[dtype] += nbytes
                by_group[group] += nbytes
    return dict(total=sum(by_group.values()), by_dtype=dict(by_dtype), by_group=dict(by_group))


def state_bytes(named_parameters, optimizer, grads: dict[int, tuple], l3_tables: set[int]) -> dict:
    """Bytes of the parameters, their gradients (`grads`: `_record`s by parameter id, taken at an optimizer step)
    and the optimizer state (tensors in `optimizer.state`; a state keyed by a group's first parameter, as nanochat's
    Muon stack, goes to that parameter's group) by dtype and group."""
    params, gradients, state = defaultdict(list), defaultdict(list), defaultdict(list)
    roles, counts = {}, Counter()
    for name, param in named_parameters:
        role = roles[id(param)] = role_of(name, param, l3_tables)
        params[role].append(_record(param))
        counts[role] += param.numel()
        if id(param) in grads:
            gradients[role].append(grads[id(param)])
    for param, values in optimizer.state.items():
        for value in values.values():
            if isinstance(value, torch.Tensor):
                state[roles.get(id(param), "other")].append(_record(value))
    return dict(parameters=tensor_bytes(params), gradients=tensor_bytes(gradients), optimizer_state=tensor_bytes(state),
                parameter_counts=dict(counts))


class GradientCapture:
    """An optimizer step pre-hook that records the gradients (`_record`s by parameter id) at optimizer step `at`."""

    def __init__(self, optimizer, parameters, step_of, at: int):
        self.grads, self.parameters, self.step_of, self.at = {}, list(parameters), step_of, at
        getattr(optimizer, "optimizer", optimizer).register_step_pre_hook(self)  # accelerate's wrapper: the inner one

    def __call__(self, optimizer, args, kwargs):
        if self.step_of() == self.at:
            self.grads = {id(p): _record(p.grad) for p in self.parameters if p.grad is not None}


# ---- tensors saved for backward ------------------------------------------------------------------------------------


def saved_eager(forward, parameters) -> dict:
    """Bytes of the tensors that autograd saves for backward in `forward()` (a training forward returning the loss),
    run under `FakeTensorMode` (no compute, no memory: the GPU shape is counted exactly): each storage once,
    parameters (held anyway) apart; by dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        param_keys = {_storage_key(mode.from_tensor(p)) for p in parameters}
        seen, by_dtype, held = set(), Counter(), 0

        def pack(tensor):
            nonlocal held
            key = _storage_key(tensor)
            if key not in seen:
                seen.add(key)
                if key in param_keys:
                    held += tensor.untyped_storage().nbytes()
                else:
                    by_dtype[str(tensor.dtype).removeprefix("torch.")] += tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            forward(mode)
    return dict(total=sum(by_dtype.values()), by_dtype=dict(by_dtype), parameters_saved=held)


def saved_compiled(module, call) -> dict:
    """Bytes of what the compiled training forward keeps for backward at the shape `call(compiled)` runs: the
    forward graphs that Inductor's `compile_fx` partitions (its own joint-graph passes and min-cut
    rematerialisation), captured before code generation and never run (each returns zero/empty tensors of its
    outputs' shapes); their outputs other than the user outputs (the loss), each base tensor once, graph inputs
    (parameters) apart. `call(compiled_module)` runs one training forward."""
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def inner_compile(gm, example_inputs, **kwargs):
        outputs = next(node for node in gm.graph.nodes if node.op == "output").args[0]
        graphs.append((gm, outputs, kwargs.get("is_backward", False)))
        metas = [node.meta.get("val") if isinstance(node, torch.fx.Node) else node for node in outputs]

        def run(*args):
            return [(torch.zeros if meta.numel() < 2**20 else torch.empty)(meta.shape, dtype=meta.dtype)
                    if isinstance(meta, torch.Tensor) else meta for meta in metas]
        return run

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=lambda gm, inputs: compile_fx(gm, inputs, inner_compile=inner_compile))
    call(compiled)
    torch._dynamo.reset()
    views = {aten.view.default, aten.permute.default, aten.t.default, aten.transpose.int, aten.expand.default,
             aten.reshape.default, aten._unsafe_view.default, aten.slice.Tensor, aten.select.int,
             aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default}
    seen, by_dtype, held, forward_graphs = set(), Counter(), 0, 0
    for gm, outputs, backward in graphs:
        if backward:
            continue
        forward_graphs += 1
        for node in outputs:
            if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            value = node.meta["val"]
            base = node
            while base.op == "call_function" and base.target in views:
                base = base.args[0]
            if base in seen or value.ndim == 0:  # the loss and other scalars
                continue
            seen.add(base)
            base_value = base.meta["val"]
            nbytes = base_value.untyped_storage().nbytes() if base_value.ndim else base_value.element_size()
            if base.op == "placeholder":
                held += nbytes
            else:
                by_dtype[str(base_value.dtype).removeprefix("torch.")] += nbytes
    return dict(total=sum(by_dtype.values()), by_dtype=dict(by_dtype), graph_inputs_saved=held,
                forward_graphs=forward_graphs)


# ---- per-token scaling --------------------------------------------------------------------------------------------


def token_fit(pass_at, tokens: int, nanochat_dir: str | None) -> dict:
    """Per site, the eager forward + backward's counts at `tokens` and `2 × tokens` (`pass_at(rows_factor)` runs one
    training forward + backward with the rows multiplied): `{site key: (a, b)}` of `count = a + b·N` for the sites
    whose count differs."""
    counts = []
    for factor in (1, 2):
        counter = StepEventCounter(nanochat_dir)
        with counter:
            counter.begin_step(1)
            pass_at(factor, counter)
        keys = Counter(_event_key(record) for record in [*counter.events, *counter.syncs] if "site" in record)
        counts.append(keys)
    fits = {}
    for key in set(counts[0]) | set(counts[1]):
        one, two = counts[0][key], counts[1][key]
        if one != two:
            slope = (two - one) / tokens
            fits[key] = (one - slope * tokens, slope)
    return fits


def _event_key(record: dict) -> str:
    return f"{record.get('category', SYNC)} | {record['kind']} | {record['library']}: {record['site']}"


def scaled_total(summary: dict, category: str, fits: dict, tokens: int, gpu_tokens: int, hidden_size: int,
                 kinds=None) -> float:
    """A phase summary's count of `category` (kinds `kinds`, default all) per step, each site scaled from `tokens`
    to `gpu_tokens` by its fit (sites without a fit do not scale) and by `cuda_chunk_ratio`."""
    total = 0.0
    for key, count in summary[category]["by_site"].items():
        kind = key.split(" | ", 1)[0]
        if kinds is not None and kind not in kinds:
            continue
        site = key.split(" via ", 1)[0]
        fit = fits.get(f"{category} | {site}")
        if fit:
            count *= (fit[0] + fit[1] * gpu_tokens) / (fit[0] + fit[1] * tokens) * cuda_chunk_ratio(site, hidden_size)
        total += count
    return total


def cuda_chunk_ratio(site: str, hidden_size: int) -> float:
    """For a site in a loop over chunks that are larger on CUDA, the CPU's chunk over CUDA's: the L3 lookup's
    `pair_scores` gathers `default_chunk_size` pairs at a time (65,536 on CUDA, 8 MiB of rows on a CPU); else 1."""
    if "(pair_scores)" not in site:
        return 1.0
    from types import SimpleNamespace

    from hfl3.models.l3gpt.lookup import default_chunk_size

    rows = lambda device: SimpleNamespace(device=torch.device(device), shape=(0, hidden_size))  # noqa: E731
    return default_chunk_size(rows("cpu")) / default_chunk_size(rows("cuda"))
