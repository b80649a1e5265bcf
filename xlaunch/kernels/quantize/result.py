"""What ``quantize`` returns: the report (:class:`QuantizeReport`, one :class:`RouteResult` per
variant) and the model (:class:`QuantizedModule`: callable, ``.mode``, ``.report``, ``.save``),
and :func:`load_quantized`, which reads a saved one back (:mod:`.saved`)."""
from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from xlaunch._torch import needs_torch

with needs_torch(__name__):
    import torch
    from torch import nn

from xlaunch.kernels.quantize import saved

__all__ = ["QuantizeReport", "QuantizedModule", "RouteResult", "load_quantized"]


@dataclass
class RouteResult:
    """One measured variant."""

    ms: Optional[float] = None            # median time per call on example_inputs
    rel_error: Optional[float] = None     # vs fp32 eager on the calibration and example inputs
    argmax_agreement: Optional[float] = None
    skipped: Optional[str] = None         # why it was not built or not measured
    int8_range: Optional[str] = None      # the route's own setting against u8 x s8 saturation


@dataclass
class QuantizeReport:
    """What ``quantize`` did. ``routes`` holds every variant measured or skipped (auto)."""

    mode: str
    requested: str
    reason: str = ""
    isa_int8_dot: Optional[str] = None
    # The CPU sums u8 x s8 products in saturating 16-bit lanes, so the INT8 routes use 7-bit
    # operands, each through its own setting (``routes[name].int8_range`` says which).
    reduce_range: bool = False
    quantized: list[str] = field(default_factory=list)
    kept_fp32: dict[str, str] = field(default_factory=dict)
    rel_error: Optional[float] = None
    argmax_agreement: Optional[float] = None
    routes: dict[str, RouteResult] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "QuantizeReport":
        data = dict(data)
        data["routes"] = {k: RouteResult(**v) for k, v in data.get("routes", {}).items()}
        return cls(**data)

    def __str__(self) -> str:
        lines = [f"mode: {self.mode} (asked: {self.requested}){': ' + self.reason if self.reason else ''}",
                 f"int8 dot products: {self.isa_int8_dot or 'none (AVX2 multiply-add)'}; "
                 + ("7-bit operands (u8 x s8 sums saturate in 16 bits)" if self.reduce_range else "full 8-bit operands")]
        chosen = self.routes.get(self.mode)
        if chosen is not None and chosen.int8_range:
            lines.append(f"int8 range: {chosen.int8_range}")
        if self.rel_error is not None:
            lines.append(f"relative error vs fp32: {self.rel_error:.4f}; argmax agreement: "
                         f"{'-' if self.argmax_agreement is None else f'{self.argmax_agreement:.3f}'}")
        lines.append(f"quantized ({len(self.quantized)}): {', '.join(self.quantized) or '-'}")
        for name, why in self.kept_fp32.items():
            lines.append(f"fp32: {name}: {why}")
        for name, r in self.routes.items():
            what = r.skipped or (f"{r.ms:.3f} ms" if r.ms is not None else "not timed")
            if r.rel_error is not None:
                what += f", rel error {r.rel_error:.4f}"
            if r.int8_range and not r.skipped:
                what += f", {r.int8_range}"
            lines.append(f"route {name}: {what}")
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


class QuantizedModule(nn.Module):
    """A quantized (or fp32 fallback) model: callable, with ``.mode``, ``.report``, ``.save``."""

    def __init__(self, runner: Callable[..., Any],
                 program: "torch.export.ExportedProgram | Callable[[], torch.export.ExportedProgram]",
                 mode: str, report: QuantizeReport, keep: Optional[nn.Module] = None,
                 check: Optional[Callable[[tuple], None]] = None) -> None:
        super().__init__()
        self._runner = runner
        self._check = check   # a loaded program: each call checked against its saved inputs
        self._program = program   # or a function exporting it on first use (export takes a while)
        self.mode = mode
        self.report = report
        self.inner = keep   # the module the runner runs (registered so .to()/state_dict see it)

    @property
    def program(self) -> torch.export.ExportedProgram:
        """The model in torch.export's format (what :meth:`save` writes)."""
        if not isinstance(self._program, torch.export.ExportedProgram):
            self._program = self._program()
        return self._program

    def forward(self, *args: Any) -> Any:
        if self._check is not None:
            self._check(args)
        return self._runner(*args)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"a quantized model ({self.mode}) is not pickled (torch.save(model), pickle): save it "
                        "with model.save(path) and load it with xlaunch.load_quantized(path)")

    def __deepcopy__(self, memo: dict) -> "QuantizedModule":
        """A copy; where the runner cannot be copied (an engine session, a compiled graph: pickle
        refuses them) the copy shares it and the module it runs, which inference never changes."""
        new = type(self).__new__(type(self))
        trial = {**memo, id(self): new}
        try:
            state = copy.deepcopy(self.__getstate__(), trial)
        except (TypeError, RuntimeError):   # pickle's "cannot pickle ...", a tensor that refuses deepcopy
            shared = {id(self._runner): self._runner, id(self.inner): self.inner}
            trial = {**memo, id(self): new, **shared}
            state = copy.deepcopy(self.__getstate__(), trial)
        memo.update(trial)
        new.__setstate__(state)
        return new

    def save(self, path: str) -> None:
        """Write the model with its mode, report, input signature and library versions: the torch
        routes in torch.export's format, ``onnxruntime_static``/``openvino_static`` as their
        engine's files in one archive (:mod:`.saved`); ``fp32``/``bf16`` results as the float model's
        program (bf16: under bf16 autocast), run eager when loaded. ``path`` is replaced, never
        written through."""
        saved.save(path, self.mode, self.report.to_dict(), self._runner, lambda: self.program)


def load_quantized(path: "str | bytes | os.PathLike[str]") -> QuantizedModule:
    """Load what :meth:`QuantizedModule.save` wrote; needs neither the model's class nor the
    calibration data. INT8 PT2E programs are compiled again (freezing) on the first call;
    ``onnxruntime_static``/``openvino_static`` run on their engine again (one ``ImportError``
    naming the extra when it is not installed). A missing file is a ``FileNotFoundError``; a file
    that is not a regular file, not written by :meth:`QuantizedModule.save`, damaged or hostile is
    one ``ValueError`` saying which (:mod:`.saved`)."""
    opened = saved.read(path)   # one clear error: missing, foreign, damaged or hostile file
    try:
        report = QuantizeReport.from_dict(opened.meta["report"])
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"load_quantized: {path} is corrupt: its report does not read back ({exc})") from None
    return QuantizedModule(opened.runner, opened.program, opened.meta["mode"], report, keep=opened.module,
                           check=opened.check)
