"""A training step captured once in a CUDA graph and replayed (PyTorch's "whole-network capture").

:class:`CapturedStep` runs a step function of static-shaped input tensors: eagerly for its first calls of each
``key`` (the batch shape and anything else that changes which kernels run), on a side stream, so that lazy
initialisation (cuBLAS handles, Triton's compilation, the allocator) happens outside a capture; then it captures
one call and replays the graph from then on, with the inputs copied into the captured call's static buffers.
Every call, eager, captured or replayed, is a real step: capturing records the kernels without running them, so the
captured call is replayed at once. The graphs of one step share a memory pool (they never run concurrently), and
steps that never run concurrently may share one (``pool``): no step reads, after its call, a tensor it allocated.
Python's cyclic garbage collector is paused during a capture (:func:`collector_paused`).
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

EAGER_CALLS = 3  # per key, before capture (PyTorch's documented warm-up)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's automatic cyclic garbage collection off inside, as it was after (``gc.disable``). A collection during
    a capture, in this thread or another, can finalise a dead engine's CUDA graph (an engine and its
    :class:`CapturedStep` form a reference cycle), and destroying a graph is a call a capturing stream forbids: the
    capture fails ("operation not permitted when stream is capturing"). torch no longer collects before a capture
    (``torch.compiler.config.force_cudagraph_gc``); the garbage waits for the next collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CapturedStep:
    """``step(inputs)`` for dicts of CUDA tensors, captured per ``key`` after :data:`EAGER_CALLS` eager calls."""

    def __init__(self, step: Callable[[dict[str, Tensor]], None], pool: tuple | None = None) -> None:
        self.step = step
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]] = {}
        self.calls: dict[Hashable, int] = {}
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool

    def drop_graphs(self) -> None:
        """Forget every captured graph (a tensor they write, outside their inputs, was replaced): each key is captured
        again at its next call, without more eager calls."""
        self.graphs.clear()

    def __call__(self, key: Hashable, inputs: dict[str, Tensor]) -> None:
        if key in self.graphs:
            graph, static = self.graphs[key]
            for name, tensor in inputs.items():
                static[name].copy_(tensor)
            graph.replay()
            return
        calls = self.calls.get(key, 0)
        self.calls[key] = calls + 1
        if calls < EAGER_CALLS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step(inputs)
            torch.cuda.current_stream().wait_stream(side)
            return
        static = {name: tensor.clone() for name, tensor in inputs.items()}
        graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call of another thread (a tune worker's heartbeats, Python's collector freeing a
        # tensor) does not invalidate the capture; this thread's own unsafe calls still fail it
        with collector_paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.step(static)
        self.graphs[key] = (graph, static)
        graph.replay()
