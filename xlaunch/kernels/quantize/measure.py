"""Measuring quantized variants: accuracy against fp32 and interleaved timing."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch

from xlaunch.kernels.optimize.compare import flat_tensors


def accuracy(reference: list[Any], candidate: list[Any]) -> tuple[float, Optional[float]]:
    """(max relative error, argmax agreement over the last dim of the first output). An integer or
    bool output (class indices, a mask) counts by the fraction of its elements that differ, and as
    its own agreement when it is the first: it was skipped, so a model returning predictions
    reported 0.0 with a quarter of them wrong."""
    worst, agree, total = 0.0, 0, 0
    for ref, cand in zip(reference, candidate):
        for r, c in zip(flat_tensors(ref), flat_tensors(cand)):
            if r.is_floating_point() or r.is_complex():
                wide = torch.complex64 if r.is_complex() else torch.float32
                r32, c32 = r.detach().to(wide), c.detach().to(wide)
                scale = max(r32.abs().max().item(), 1e-12)
                error = (r32 - c32).abs().max().item() / scale
            elif r.numel() == 0:
                continue
            else:
                error = 1.0 if r.shape != c.shape else (r != c).float().mean().item()
            worst = max(worst, error if error == error else float("inf"))
        first_r, first_c = flat_tensors(ref)[:1], flat_tensors(cand)[:1]
        if first_r and not first_r[0].is_floating_point() and first_r[0].shape == first_c[0].shape:
            agree += (first_r[0] == first_c[0]).sum().item()
            total += first_r[0].numel()
        elif first_r and first_r[0].dim() >= 1 and first_r[0].shape[-1] > 1:
            agree += (first_r[0].argmax(-1) == first_c[0].argmax(-1)).sum().item()
            total += first_r[0].argmax(-1).numel()
    return worst, (agree / total if total else None)


SETTLE_S = 0.02


def measure(variants: dict[str, Callable[..., Any]], example_inputs: tuple, rounds: int = 7,
            target_s: float = 0.01) -> dict[str, float]:
    """Median ms per call for each variant, timed in interleaved rounds (fair under shared load).
    Before each sample, a short sleep and one untimed call: the previous variant's threads (ONNX
    Runtime's, OpenMP's, OpenVINO's TBB workers spin-wait after a call) go idle first, or the
    sample pays for them (one ordering timed an INT8 model at 0.74x itself)."""
    calls: dict[str, int] = {}
    with torch.no_grad():
        for name, fn in variants.items():
            fn(*example_inputs)   # warm-up (compiles)
            start = time.perf_counter()
            fn(*example_inputs)
            once = time.perf_counter() - start
            calls[name] = max(1, min(50, int(target_s / max(once, 1e-6))))
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                time.sleep(SETTLE_S)
                fn(*example_inputs)
                start = time.perf_counter()
                for _ in range(calls[name]):
                    fn(*example_inputs)
                samples[name].append((time.perf_counter() - start) / calls[name] * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}
