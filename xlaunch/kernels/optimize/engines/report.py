"""What ``optimize(..., backend=...)`` did: every route, its time, error and build time, or why it
was skipped; which one was kept and why; whether the on-disk cache served it. No torch here.

Every speed is said against one baseline, eager, in plain words ("2.26x faster than eager",
"7.1x slower than eager"): the summary line, the reason and the report agree. ``str(report)``
and ``report.text`` are the text; str methods (``splitlines``, ``startswith``...) and ``in``
work on the report as on its text."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

# Every route, in the order auto builds them (cheapest and most often fastest first, so a time
# budget that runs out drops the ones least likely to win: inductor compiles for tens of seconds).
ROUTES = ("eager", "torch", "onnxruntime", "openvino", "inductor")
ENGINE_ROUTES = ("onnxruntime", "openvino", "inductor")
BASELINES = ("eager", "torch")
# What to install for each route that needs more than torch.
PIP_LINES = {
    "onnxruntime": 'pip install "xlaunch[onnxruntime]"',
    "openvino": 'pip install "xlaunch[openvino]"',
}


def versus(ratio: Optional[float], baseline: str = "eager") -> str:
    """``ratio`` (the baseline's time / the route's) in words: ``2.26x faster than eager``,
    ``7.1x slower than eager``, ``as fast as eager`` (within 0.5 %)."""
    if ratio is None or ratio <= 0:
        return f"not compared with {baseline}"
    if abs(ratio - 1.0) < 0.005:
        return f"as fast as {baseline}"
    times = ratio if ratio > 1 else 1 / ratio
    number = f"{times:.2f}" if times < 3 else f"{times:.1f}"
    return f"{number}x {'faster' if ratio > 1 else 'slower'} than {baseline}"


def versus_eager(ratio: Optional[float]) -> str:
    return versus(ratio, "eager")


@dataclass
class RouteResult:
    """One route: built and measured, or skipped with why."""

    build_s: Optional[float] = None      # seconds to build (or load from the cache)
    ms: Optional[float] = None           # median ms per call on the sample input
    rel_error: Optional[float] = None    # max |route - eager| / max |eager| on the sample (and another batch)
    skipped: Optional[str] = None        # why it was not built, not checked or not kept in the running

    def describe(self) -> str:
        if self.skipped:
            return f"skipped: {self.skipped}"
        parts = [f"{self.ms:.3f} ms" if self.ms is not None else "not timed"]
        if self.rel_error is not None:
            parts.append(f"rel error {self.rel_error:.1e}")
        if self.build_s is not None:
            parts.append(f"built in {self.build_s:.1f} s")
        return ", ".join(parts)


@dataclass
class EngineReport:
    """Attached to the returned model as ``.report`` (unless the model has its own attribute of
    that name) and always as ``._xlaunch_engine_report``."""

    backend: str                          # the route kept
    requested: str                        # "auto", one route, or "auto:route,route"
    reason: str = ""
    sample: str = ""                      # the input signature ("float32[N,3,224,224]")
    threads: Optional[int] = None
    dtype: str = "float32"                # the precision the routes compute in (optimize's dtype)
    max_rel_error: Optional[float] = None  # that precision's accuracy gate against fp32 eager
    cache: str = "off"                    # "off" | "miss" | "hit" | "rebuilt (...)"
    cache_path: Optional[str] = None
    routes: dict[str, RouteResult] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def speedup(self, route: str, baseline: str = "eager") -> Optional[float]:
        """How many times faster ``route`` measured than ``baseline`` (None when either is untimed)."""
        a, b = self.routes.get(route), self.routes.get(baseline)
        if a is None or b is None or not a.ms or not b.ms:
            return None
        return b.ms / a.ms

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineReport":
        data = dict(data)
        data["routes"] = {name: RouteResult(**value) for name, value in data.get("routes", {}).items()}
        return cls(**data)

    @property
    def text(self) -> str:
        """The report as text (what ``str(report)`` and ``print(report)`` give)."""
        lines = [f"backend: {self.backend} (asked: {self.requested}){': ' + self.reason if self.reason else ''}"]
        if self.sample:
            lines.append(f"sample: {self.sample}; threads: {self.threads}; precision: {self.dtype}"
                         + (f" (gate: max relative error {self.max_rel_error:g} vs fp32 eager)"
                            if self.max_rel_error is not None else ""))
        lines.append(f"cache: {self.cache}{' (' + self.cache_path + ')' if self.cache_path else ''}")
        for name, result in self.routes.items():
            ratio = self.speedup(name)
            tail = f" ({versus_eager(ratio)})" if ratio is not None and name != "eager" else ""
            lines.append(f"route {name}: {result.describe()}{tail}")
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text

    def __contains__(self, part: str) -> bool:
        return part in self.text

    def __getattr__(self, name: str) -> Any:
        """str's methods on the text: ``report.splitlines()``, ``report.startswith(...)``."""
        if not name.startswith("_") and hasattr(str, name):
            return getattr(self.text, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
