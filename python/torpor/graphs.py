"""CUDA graphs for a function's forward: its GPU work captured once in setup() and replayed by
each request as one launch (docs/sandboxes.md, "CUDA graphs").

    def setup(self):
        model = ...                                   # on the GPU, eval mode
        example = torch.zeros(1, 3, 224, 224, device="cuda")
        self.model = torpor.graphed(model, example, instances=4)

    def __call__(self, request):
        logits = self.model(x)    # x (1, 3, 224, 224) on the GPU: a replay; any other shape: eager

Why: a batch-1 request of an eager PyTorch model is CPU-bound. Launching ResNet-152's ~500
kernels takes 17.2 of its 17.3 ms on an H100, and a sandbox's request threads launch under one
GIL, so four requests at once took 45 ms each, against 5.4 ms when each replayed a CUDA graph
(bench/sandbox/gil_probe.py, bench/results/sandbox-gil-probe-h100.json). A function in a
process of its own gains the launch time too.

How:

- **Captured at construction**, in setup(), before the function snapshot, so restored instances
  start with their graphs. Not on a request's first call: a sandbox's request thread allocates
  through its function's memory pool (torpor.mempool), which is given back at idle, and a graph
  captured there would keep addresses in memory given back under it.
- **`instances` graphs per example**, each with static inputs, its own memory and outputs. A
  call whose tensors match an example's (shape, dtype, device; other arguments equal) takes a
  free instance, copies its inputs in, replays on the caller's current stream (a sandbox
  request's own stream) and returns copies of the outputs. One request at a time per instance:
  its next user's stream waits for the event recorded after the copies, so requests on other
  streams never overwrite inputs a replay still reads. With every instance busy a call waits
  for one (a replay takes milliseconds, where eager work under a shared GIL takes tens).
- **Anything else runs eager** (under no_grad, as a replay; with autograd where an input
  requires gradients): another shape (a new batch size, a sequence length), a CPU tensor.
  `stats()` counts replays and eager calls, so a function can see that its requests miss the
  graphs.
- **Without CUDA nothing is captured** (no torch, no GPU, examples on the CPU) and every call is
  eager: the same function runs on a CPU machine.
- **A capture that the sandbox's other threads cannot break**: capture mode `thread_local`, so
  their launches and allocations go on; and no function pool is emptied while it runs
  (torpor.mempool.GATE: PyTorch aborts the process if one is).
- **Inference only**: captured under torch.inference_mode(); the outputs carry no autograd.

A forward that cannot be captured (a host synchronisation such as `.item()` or a
data-dependent shape, CPU work on the inputs) raises DefinitionError at setup naming the cause
and the fix; the device is left usable.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torpor.errors import DefinitionError
from torpor.mempool import GATE, current_function, note_pool, routing

# Eager runs on the capture's stream before each capture: lazy initialisations (cuBLAS
# workspaces, cuDNN's algorithm choice) must happen outside the graph, as PyTorch's
# torch.cuda.make_graphed_callables does with 3.
WARMUP_RUNS = 3

# A flattened argument list or output: "T" for a tensor leaf, (type, children) for a tuple or
# list, (type, ((key, child), ...)) for a dict, ("V", value) for any other hashable value.
TreeDef = Any


@dataclass
class _Instance:
    """One captured graph: its static inputs (the tensor leaves of the example, in order), its
    outputs' tree and the event its last replay's copies recorded."""

    graph: Any
    inputs: list[Any]
    out_def: TreeDef
    outputs: list[Any]
    done: Any


@dataclass
class _Shape:
    """The instances of one example's shapes: those no call holds now, and a condition to wait
    on for one."""

    free: list[_Instance] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)


class Graphed:
    """`fn` with CUDA graphs for the examples' shapes (see the module doc); callable like `fn`."""

    def __init__(self, fn: Callable[..., Any], instances: int) -> None:
        self.fn = fn
        self.instances = instances
        self._shapes: dict[Any, _Shape] = {}
        self._counts = {"replays": 0, "eager": 0}
        self._lock = threading.Lock()

    def capture(self, *args: Any, **kwargs: Any) -> bool:
        """Captures `instances` graphs of fn(*args, **kwargs) (the example's values do not
        matter, only their shapes); returns False, capturing nothing, where CUDA is not in use
        (see the module doc). Raises DefinitionError if fn cannot be captured."""
        torch = _torch_with_cuda()
        leaves, tree = _flatten(_call_tree(args, kwargs))
        if torch is None or not leaves or not all(_on_cuda(t) for t in leaves):
            return False
        if routing():
            raise DefinitionError(
                "torpor.graphed: a capture in a sandboxed function's request would put the graph's "
                "memory in the request's pool, which is given back at idle; capture in setup()"
            )
        key = (tree, tuple(_describe(t) for t in leaves))
        captured = [_capture(torch, self.fn, tree, leaves) for _ in range(self.instances)]
        with self._lock:
            shape = self._shapes.setdefault(key, _Shape())
        with shape.cond:
            shape.free.extend(captured)
            shape.cond.notify_all()
        return True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        found = self._match(args, kwargs)
        if found is None:
            with self._lock:
                self._counts["eager"] += 1
            torch: Any = sys.modules.get("torch")
            if torch is None or _wants_grad(torch, args, kwargs):
                return self.fn(*args, **kwargs)
            # As a replay would: no autograd graph kept, plain tensors out.
            with torch.no_grad():
                return self.fn(*args, **kwargs)
        shape, leaves = found
        torch = sys.modules["torch"]
        with shape.cond:
            while not shape.free:
                shape.cond.wait()
            inst = shape.free.pop()
        try:
            stream = torch.cuda.current_stream()
            stream.wait_event(inst.done)
            with torch.no_grad():
                for static, given in zip(inst.inputs, leaves, strict=True):
                    static.copy_(given, non_blocking=True)
                inst.graph.replay()
                out = [t.clone() for t in inst.outputs]
            inst.done.record(stream)
        finally:
            with shape.cond:
                shape.free.append(inst)
                shape.cond.notify()
        with self._lock:
            self._counts["replays"] += 1
        return _unflatten(inst.out_def, iter(out))

    def stats(self) -> dict[str, int]:
        """Calls served by a replay and calls run eager, and the shapes captured."""
        with self._lock:
            return dict(self._counts, shapes=len(self._shapes))

    def _match(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Shape, list[Any]] | None:
        """The captured shape this call matches, and its tensors; None to run it eager."""
        if not self._shapes:
            return None
        try:
            leaves, tree = _flatten(_call_tree(args, kwargs))
        except TypeError:
            return None  # an argument that cannot be part of a key (unhashable)
        if sys.modules["torch"].is_grad_enabled() and any(t.requires_grad for t in leaves):
            return None  # gradients wanted: the graphs were captured without autograd
        key = (tree, tuple(_describe(t) for t in leaves))
        with self._lock:
            shape = self._shapes.get(key)
        return None if shape is None else (shape, leaves)


def graphed(fn: Callable[..., Any], *example_args: Any, instances: int = 2, **example_kwargs: Any) -> Graphed:
    """`fn` (an nn.Module or any callable of CUDA tensors) with CUDA graphs captured now for the
    example's shapes, `instances` of them (as many as requests of the function may run at once
    in its sandbox); call it where `fn` was called. `.capture(*args)` adds more shapes. Call it
    in setup() (see the module doc)."""
    if not callable(fn):
        raise DefinitionError(f"torpor.graphed: {type(fn).__name__} is not callable; pass the module or function to graph")
    if isinstance(instances, bool) or not isinstance(instances, int) or not 1 <= instances <= 64:
        raise DefinitionError(
            f"torpor.graphed: instances must be an integer from 1 to 64, got {instances!r}; "
            "give as many as requests of the function run at once"
        )
    g = Graphed(fn, instances)
    if example_args or example_kwargs:
        g.capture(*example_args, **example_kwargs)
    return g


# -- capture ---------------------------------------------------------------------------------


def _capture(torch: Any, fn: Callable[..., Any], tree: TreeDef, example: list[Any]) -> _Instance:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    caller = torch.cuda.current_stream()
    # A stream of its own per instance, not one for all: PyTorch gives each (cuBLAS handle,
    # stream) its own workspace and a captured matmul keeps that workspace's address, so two
    # instances captured on one stream would share a workspace and race when replayed at once
    # (32 MiB each on Hopper: the price of an instance, besides its activations).
    side = torch.cuda.Stream()
    side.wait_stream(caller)
    with GATE.scope(), torch.cuda.stream(side):
        # Made outside inference mode: a request copies its inputs into them under no_grad.
        inputs = [t.detach().clone() for t in example]
        args, kwargs = _unflatten(tree, iter(inputs))
        with torch.inference_mode():
            graph, out = _capture_on(torch, fn, name, args, kwargs)
    outputs, out_def = _flatten(out)
    for t in outputs:
        if not _on_cuda(t):
            raise DefinitionError(
                f"torpor.graphed: {name} returned a tensor on {t.device}; a graph's outputs "
                "must be on the GPU: move the copy to the host out of it"
            )
    done = torch.cuda.Event()
    done.record(side)
    caller.wait_stream(side)
    return _Instance(graph=graph, inputs=inputs, out_def=out_def, outputs=outputs, done=done)


def _capture_on(torch: Any, fn: Callable[..., Any], name: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Warm-up runs, then fn's capture, on the current (side) stream: the graph and fn's
    outputs."""
    for _ in range(WARMUP_RUNS):
        fn(*args, **kwargs)
    torch.cuda.current_stream().synchronize()
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(capture_error_mode="thread_local")
    try:
        out = fn(*args, **kwargs)
    except Exception as e:
        _abandon(graph)
        raise DefinitionError(
            f"torpor.graphed: cannot capture {name} as a CUDA graph ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); its calls must launch GPU work "
            "only (no .item(), .cpu() or printing of GPU values, no data-dependent shapes): "
            "move that work out of it or call it without torpor.graphed"
        ) from e
    try:
        graph.capture_end()
    except Exception as e:
        raise DefinitionError(
            f"torpor.graphed: the CUDA graph of {name} was invalidated during its capture "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); another thread "
            "synchronised the device, or the call used the legacy default stream: keep "
            "device-wide synchronisation out of setup() while it captures"
        ) from e
    # Whose capture this is (PyTorch names its pool once the capture has ended): packing
    # another function of the sandbox may move weights this graph does not read (torpor.pack),
    # never this function's.
    note_pool(graph.pool(), current_function())
    return graph, out


def _abandon(graph: Any) -> None:
    """Ends a capture that failed, so that the stream leaves capture mode; its own error (the
    capture is invalidated) is the expected one."""
    try:
        graph.capture_end()
    except Exception:
        pass
    try:
        graph.reset()
    except Exception:
        pass


# -- arguments and outputs as trees of tensors -------------------------------------------------


def _call_tree(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call's arguments as one tree, keywords in name order (a call may order them otherwise
    than the example did)."""
    return (args, dict(sorted(kwargs.items())))


def _is_tensor(x: Any) -> bool:
    torch: Any = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _flatten(obj: Any) -> tuple[list[Any], TreeDef]:
    """The tensor leaves of `obj` (tuples, lists and dicts of tensors and plain values), in
    order, and a hashable description of the rest. Raises TypeError on a leaf that is neither
    a tensor nor hashable."""
    leaves: list[Any] = []

    def walk(x: Any) -> TreeDef:
        if _is_tensor(x):
            leaves.append(x)
            return "T"
        if isinstance(x, (tuple, list)):
            return (type(x), tuple(walk(v) for v in x))
        if isinstance(x, dict):
            return (type(x), tuple((k, walk(v)) for k, v in x.items()))
        hash(x)
        return ("V", x)

    return leaves, walk(obj)


def _unflatten(tree: TreeDef, leaves: Iterator[Any]) -> Any:
    if tree == "T":
        return next(leaves)
    kind, body = tree
    if kind == "V":
        return body
    if issubclass(kind, dict):
        items = {k: _unflatten(v, leaves) for k, v in body}
        # A dict subclass such as transformers' ModelOutput takes its fields as keywords.
        return items if kind is dict else kind(**items)
    values = [_unflatten(v, leaves) for v in body]
    return kind(values) if kind in (list, tuple) else kind(*values)


def _describe(t: Any) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.device)


def _on_cuda(t: Any) -> bool:
    return bool(getattr(t, "is_cuda", False))


def _wants_grad(torch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Gradients enabled and an input that requires them: the call runs eager, with autograd."""
    if not torch.is_grad_enabled():
        return False
    try:
        leaves, _ = _flatten(_call_tree(args, kwargs))
    except TypeError:
        return False
    return any(t.requires_grad for t in leaves)


def _torch_with_cuda() -> Any:
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch
