"""Timing helpers shared by the kernel benchmarks: eager-launch time vs CUDA-graph (GPU) time (CUDA only).

* `eager_us(fn)`: `triton.testing.do_bench` median, L2 flushed before every repetition, events around ONE
  call of the Python launcher. When the launcher's host work (checks, allocation, Triton's argument binding)
  takes longer than the kernels, this is host time.
* `graph_us(fn)`: the call captured in a `torch.cuda.CUDAGraph` after a warm-up on the capture stream and
  replayed; host work is gone, what remains is GPU time (kernels + the gaps between a graph's kernels).
  `cold`: each call preceded by an L2 flush (a zero-fill of 2x the L2 size) inside the graph; the time of a
  flush-only graph with the same count is subtracted, so cold = GPU time with a cold L2 (the bandwidth
  columns use it). `hot`: calls back to back on the same inputs (L2 warm, as in a decode step whose operands
  were just written). Medians of 7 interleaved replays of each graph.
"""

from __future__ import annotations

import statistics

import torch
from triton.testing import do_bench


def eager_us(fn) -> float:
    """Median µs of one eager call (do_bench: L2 flushed before each repetition)."""
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


class GraphTimer:
    """Owns the flush buffer and the capture stream; `time(fn, estimate_us)` -> (cold µs, hot µs)."""

    def __init__(self, device: int = 0):
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self.flush_buf = torch.empty(max(64 << 20, 2 * l2), dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()

    def _capture(self, body, n: int) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=self.stream):
            for _ in range(n):
                body()
        return g

    @staticmethod
    def _replay_ms(g: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def time(self, fn, estimate_us: float, max_calls: int = 50) -> tuple[float, float]:
        """GPU µs per call of `fn` (see the module docstring). `estimate_us` sizes the graphs (~10 ms each)."""
        flush = self.flush_buf.zero_
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(3):  # warm-up on the capture stream: compiles, fills that stream's kernel workspace
                fn()
        torch.cuda.synchronize()
        n = max(5, min(max_calls, int(10_000 / max(estimate_us, 1.0))))
        graphs = {"hot": self._capture(fn, n), "flush": self._capture(flush, n),
                  "both": self._capture(lambda: (flush(), fn()), n)}
        for g in graphs.values():
            self._replay_ms(g)
        times = {k: [] for k in graphs}
        for _ in range(7):
            for k, g in graphs.items():
                times[k].append(self._replay_ms(g))
        med = {k: statistics.median(v) * 1e3 / n for k, v in times.items()}
        del graphs
        return max(med["both"] - med["flush"], 0.0), med["hot"]


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted), do_bench median."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9
