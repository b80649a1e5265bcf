"""Calibration batches matched against ``example_inputs`` (``inputs.calibration_batches``): a
DataLoader's ``(x, label)`` pairs calibrate on ``x`` alone, said in the report; a batch that cannot
be the model's inputs is one error naming it, before any work. weight_only: no compile, cheap.

Before the fix the label went to the model as a second input: a deep RuntimeError, or (a model
with an optional second argument the label fits) a calibration on the wrong inputs, unreported."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from quantize_models import skip_module_without_torchao  # noqa: E402

skip_module_without_torchao()

from xlaunch.kernels.quantize.api import quantize  # noqa: E402

pytestmark = pytest.mark.torch


class Scaled(nn.Module):
    """A Linear with an optional second input (a label of shape (B, 1) fits it): records what it gets."""

    seen: list = []

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        Scaled.seen.append(scale is not None)
        return self.linear(x) if scale is None else self.linear(x) * scale


def test_a_dataloader_of_input_label_pairs_calibrates_on_the_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 16, generator=gen), torch.randn(32, 1, generator=gen) * 100)
    model = Scaled().eval()
    Scaled.seen.clear()
    quantized = quantize(model, torch.randn(8, 16, generator=gen), calibration=DataLoader(data, batch_size=8),
                         mode="weight_only", progress=False)
    assert Scaled.seen and not any(Scaled.seen)   # the labels never reached the model
    report = quantized.report
    assert report.rel_error is not None and report.rel_error < 0.05, report.rel_error
    assert ("calibration: batches hold up to 2 items and example_inputs 1: the first 1 of each were the inputs, "
            "the rest (labels) left out") in report.warnings
    assert "the rest (labels) left out" in str(report)


def test_batches_matching_the_example_carry_no_note() -> None:
    x = torch.randn(8, 16)
    quantized = quantize(Scaled().eval(), x, calibration=[x[:4], (x[4:],)], mode="weight_only", progress=False)
    assert not any(w.startswith("calibration:") for w in quantized.report.warnings)


@pytest.mark.parametrize("calibration, match", [
    ([(torch.zeros(4, dtype=torch.int64),)], r"calibration batch 0, input 0: int64\[N\] where example_inputs "
                                              r"has float32\[N,16\]"),
    ([torch.zeros(4, 16), (torch.zeros(4, 32),)], r"calibration batch 1, input 0: float32\[N,32\] where"),
    ([(torch.zeros(4, 16).double(),)], r"float64\[N,16\] where example_inputs has float32\[N,16\]"),
    ([([torch.zeros(4, 16)], torch.zeros(4))], r"input 0: list where example_inputs has float32\[N,16\]"),
])
def test_a_batch_that_cannot_be_the_inputs_is_one_error(calibration: list, match: str) -> None:
    Scaled.seen.clear()
    with pytest.raises(ValueError, match=match):
        quantize(Scaled().eval(), torch.randn(8, 16), calibration=calibration, mode="weight_only", progress=False)
    assert Scaled.seen == []   # nothing ran


def test_a_batch_with_fewer_items_than_the_example_is_one_error() -> None:
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"calibration batch 0 holds 1 item\(s\), example_inputs 2"):
        quantize(Scaled().eval(), (x, torch.ones(8, 1)), calibration=[(x,)], mode="weight_only", progress=False)


class Counted:
    """An iterable of ``n`` calibration batches that counts how many were drawn (a DataLoader over a
    large data set, or a generator: drawing is the cost)."""

    def __init__(self, n: int, rows: int = 4) -> None:
        self.n, self.rows, self.drawn = n, rows, 0

    def __iter__(self):
        for _ in range(self.n):
            self.drawn += 1
            yield (torch.randn(self.rows, 16),)


def test_a_huge_calibration_is_read_up_to_the_cap_and_the_report_says_so() -> None:
    """Before, every batch was drawn and held (a 20000-image DataLoader: all 625 batches, 1.2 GiB),
    and each route then ran all of them."""
    from xlaunch.kernels.quantize import inputs

    huge = Counted(100_000)
    quantized = quantize(Scaled().eval(), torch.randn(4, 16), calibration=huge, mode="weight_only", progress=False)
    assert huge.drawn == inputs.MAX_BATCHES + 1   # the cap, and one more to know that more was there
    note = (f"calibration: the first {inputs.MAX_BATCHES} batches were used (quantize reads at most "
            f"{inputs.MAX_BATCHES} batches); the rest was not read")
    assert any(w.startswith(note) for w in quantized.report.warnings), quantized.report.warnings
    # exactly the cap: nothing left unread, no note
    batches, notes = inputs.calibration_batches(Counted(inputs.MAX_BATCHES), (torch.randn(4, 16),))
    assert len(batches) == inputs.MAX_BATCHES and notes == []


def test_calibration_inputs_are_bounded_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from xlaunch.kernels.quantize import inputs

    monkeypatch.setattr(inputs, "MAX_BYTES", 3 * 4 * 16 * 4)   # three batches of 4 x 16 float32
    many = Counted(10)
    batches, notes = inputs.calibration_batches(many, (torch.randn(4, 16),))
    assert len(batches) == 3 and many.drawn == 4
    assert notes == ["calibration: the first 3 batches were used (their inputs would pass 0 MiB); the rest was "
                     "not read (pass fewer batches, or a DataLoader over a subset, to choose them)"]
    big = Counted(2, rows=1000)   # one batch over the cap alone: still used
    assert len(inputs.calibration_batches(big, (torch.randn(4, 16),))[0]) == 1


def test_an_empty_batch_or_example_is_named_empty() -> None:
    """It said "must be a tensor or a non-empty tuple of inputs, not tuple" of an empty tuple."""
    with pytest.raises(TypeError, match=r"each calibration item must be .* non-empty tuple of inputs, not an empty tuple$"):
        quantize(Scaled().eval(), torch.randn(4, 16), calibration=[()], mode="weight_only", progress=False)
    with pytest.raises(TypeError, match=r"example_inputs must be .*, not an empty list$"):
        quantize(Scaled().eval(), [], mode="weight_only", progress=False)


class Picky(nn.Module):
    """Refuses a batch of 3 rows (the model's own error, as a shape mismatch deep inside would be)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise RuntimeError("batch of 3 refused")
        return self.linear(x)


def test_a_model_that_fails_on_its_inputs_is_one_error_naming_them() -> None:
    """It was the model's own exception from inside quantize (``RuntimeError: both arguments to
    linear need to be at least 1D``), naming neither argument; now one ValueError naming the inputs,
    with the model's error chained, before anything is built."""
    with pytest.raises(ValueError, match=r"^quantize: Picky fails on calibration batch 1 \(float32\[N,16\]\): "
                                         r"RuntimeError: batch of 3 refused$") as raised:
        quantize(Picky(), torch.randn(4, 16), calibration=[torch.randn(4, 16), torch.randn(3, 16)],
                 mode="weight_only", progress=False)
    assert isinstance(raised.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match=r"^quantize: Picky fails on example_inputs \(float32\[N,16\]\): "):
        quantize(Picky(), torch.randn(3, 16), mode="weight_only", progress=False)


def test_a_batch_of_no_rows_is_one_error() -> None:
    """An empty batch (0 rows) failed deep in the error measure (``max(): Expected reduction dim to be
    specified for input.numel() == 0``) after the route was built."""
    Scaled.seen.clear()
    with pytest.raises(ValueError, match=r"^quantize: calibration batch 1, input 0: float32\[0,16\] holds no rows"):
        quantize(Scaled().eval(), torch.randn(4, 16), calibration=[torch.randn(4, 16), torch.empty(0, 16)],
                 mode="weight_only", progress=False)
    with pytest.raises(ValueError, match=r"^quantize: example_inputs, input 0: float32\[0,16\] holds no rows"):
        quantize(Scaled().eval(), torch.empty(0, 16), mode="weight_only", progress=False)
    assert Scaled.seen == []   # nothing ran
