"""Every public constructor of xlaunch.nn refuses a bad argument in one line naming it (a float
count was truncated: EmbeddingSpec(3.5, 4) made a 3-row table), and takes numpy's integers."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from xlaunch.nn import (EmbeddingSpec, FrozenBatchNorm2d, MergedEmbeddingBag, MergedEmbeddingBagWithAdaGrad,  # noqa: E402
                        MergedEmbeddingBagWithCat, MergedEmbeddingBagWithSGD, RoIAlign, interaction, roi_align)

pytestmark = pytest.mark.torch
MERGED = [MergedEmbeddingBag, MergedEmbeddingBagWithCat, MergedEmbeddingBagWithSGD, MergedEmbeddingBagWithAdaGrad]


@pytest.mark.parametrize("cls", MERGED)
@pytest.mark.parametrize("spec, error, message", [
    (EmbeddingSpec(3.5, 4, "sum"), TypeError, "table 1: num_embeddings must be an integer, not 3.5 (float)"),
    (EmbeddingSpec(3, 4.0, "sum"), TypeError, "table 1: embedding_dim must be an integer, not 4.0 (float)"),
    (EmbeddingSpec(True, 4, "sum"), TypeError, "table 1: num_embeddings must be an integer, not True (bool)"),
    (EmbeddingSpec("3", 4, "sum"), TypeError, "table 1: num_embeddings must be an integer, not '3' (str)"),
    (EmbeddingSpec(-1, 4, "sum"), ValueError, "table 1: num_embeddings must be >= 0, got -1"),
    (EmbeddingSpec(3, 0, "sum"), ValueError, "table 1: embedding_dim must be >= 1, got 0"),
    (EmbeddingSpec(3, 4, ["sum"]), ValueError, "table 1: pooling_mode must be one of sum, mean, max, not ['sum']"),
    (EmbeddingSpec(3, 4, "sum", "float32"), TypeError, "table 1: dtype must be a torch.dtype, not 'float32'"),
    (EmbeddingSpec(3, 4, "sum", weight=[[0.0] * 4] * 3), TypeError, "table 1: weight must be a tensor or None, not list"),
    (EmbeddingSpec(3, 4, "sum", include_last_offset="False"), TypeError,
     "table 1: include_last_offset must be True or False, not 'False'"),
    (EmbeddingSpec(3, 4, "sum", sparse="no"), TypeError, "table 1: sparse must be True or False, not 'no'"),
    ((3,), TypeError, "table 1: expected an EmbeddingSpec, not tuple"),
])
def test_a_bad_table_spec_is_one_line_naming_the_table_and_the_field(cls, spec, error, message):
    with pytest.raises(error) as raised:
        cls([EmbeddingSpec(2, 4, "sum"), spec])
    assert str(raised.value) == message


@pytest.mark.parametrize("cls", MERGED)
def test_numpy_and_tensor_integers_are_counts(cls):
    merged = cls([EmbeddingSpec(np.int64(3), np.int32(4), "sum", include_last_offset=np.bool_(True)),
                  (torch.tensor(2), 4, "mean")])
    assert merged.layout.rows == [3, 2] and merged.layout.dims == [4, 4] and merged.layout.include_last == [True, False]
    assert all(type(n) is int for n in merged.layout.rows + merged.layout.dims)
    assert merged.weight.numel() == 3 * 4 + 2 * 4


def test_specs_must_be_a_list_of_specs():
    with pytest.raises(TypeError, match="^embedding_specs must be a list of EmbeddingSpec .one per table., not EmbeddingSpec$"):
        MergedEmbeddingBag(EmbeddingSpec(3, 4, "sum"))      # one spec, not a list (a tuple of its fields)


@pytest.mark.parametrize("cls, name", [(MergedEmbeddingBagWithSGD, "lr"), (MergedEmbeddingBagWithSGD, "weight_decay"),
                                       (MergedEmbeddingBagWithAdaGrad, "lr"), (MergedEmbeddingBagWithAdaGrad, "eps")])
def test_hyperparameters_are_finite_non_negative_numbers(cls, name):
    specs = [EmbeddingSpec(3, 4, "sum")]
    with pytest.raises(TypeError, match=f"^{name} must be a number, not 'x' \\(str\\)$"):
        cls(specs, **{name: "x"})
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"^{name} must be a finite number >= 0, got {bad}$"):
            cls(specs, **{name: bad})
    assert getattr(cls(specs, **{name: np.float32(0.5)}), name) == 0.5


def test_frozen_batch_norm_arguments():
    with pytest.raises(TypeError, match=r"^FrozenBatchNorm2d: num_features must be an integer, not 4.0 \(float\)$"):
        FrozenBatchNorm2d(4.0)
    with pytest.raises(ValueError, match="^FrozenBatchNorm2d: num_features must be >= 0, got -1$"):
        FrozenBatchNorm2d(-1)
    with pytest.raises(TypeError, match=r"^FrozenBatchNorm2d: eps must be a number, not 'a' \(str\)$"):
        FrozenBatchNorm2d(4, eps="a")
    with pytest.raises(ValueError, match="^FrozenBatchNorm2d: eps must be a finite number >= 0, got -1e-05$"):
        FrozenBatchNorm2d(4, eps=-1e-5)
    norm = FrozenBatchNorm2d(np.int64(4), eps=np.float32(0.5))
    assert norm.num_features == 4 and norm.weight.shape == (4,) and norm.eps == 0.5


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(output_size=2.5), TypeError, "roi_align: output_size must be an int or a pair (height, width) of ints, not 2.5"),
    (dict(output_size=(0, 2)), ValueError, "roi_align: output_size must be positive, got (0, 2)"),
    (dict(sampling_ratio=1.5), TypeError, "roi_align: sampling_ratio must be an integer, not 1.5 (float)"),
    (dict(spatial_scale="x"), TypeError, "roi_align: spatial_scale must be a number, not 'x' (str)"),
    (dict(spatial_scale=float("nan")), ValueError, "roi_align: spatial_scale must be a finite number, got nan"),
    (dict(aligned="False"), TypeError, "roi_align: aligned must be True or False, not 'False'"),
])
def test_roi_align_arguments_are_refused_by_the_module_and_the_function(kwargs, error, message):
    arguments = dict(output_size=2, spatial_scale=1.0, sampling_ratio=2, aligned=False, **{})
    arguments.update(kwargs)
    with pytest.raises(error) as raised:
        RoIAlign(**arguments)
    assert str(raised.value) == message
    image, boxes = torch.ones(1, 1, 4, 4), torch.tensor([[0.0, 0.0, 0.0, 3.0, 3.0]])
    with pytest.raises(error) as raised:
        roi_align(image, boxes, **arguments)
    assert str(raised.value) == message
    good = roi_align(image, boxes, np.int64(2), np.float64(1.0), np.int64(2), np.bool_(True))
    assert torch.allclose(good, torch.ones(1, 1, 2, 2))


def test_interaction_names_a_feature_that_is_not_a_tensor():
    with pytest.raises(TypeError, match="^interaction: feature 0 must be a .batch, dim. tensor, not list$"):
        interaction([1.0, 2.0], torch.ones(2, 2))
    with pytest.raises(TypeError, match="^interaction: feature 1 must be a .batch, dim. tensor, not int$"):
        interaction(torch.ones(2, 2), 5)              # (a ValueError about its shape before)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("cls", MERGED)
def test_per_sample_weights_and_the_dense_feature_are_cpu_real_tensors(cls, grad):
    """A meta tensor there pooled garbage on every path (the operators' fake kernel ran and its empty
    outputs came back as results); a list was an AttributeError; complex weights dropped their
    imaginary part with a warning."""
    merged = cls([EmbeddingSpec(5, 4, "sum")])
    indices, offsets = [torch.tensor([1, 2])], [torch.tensor([0])]
    dense = [torch.ones(1, 2)] if cls is MergedEmbeddingBagWithCat else []
    with torch.set_grad_enabled(grad):
        with pytest.raises(ValueError, match="per_sample_weights of table 0 are on meta; xlaunch.nn runs on the CPU"):
            merged(indices, offsets, *dense, per_sample_weights=[torch.ones(2, device="meta")])
        for psw, name in (([1.0, 2.0], "list"), (torch.ones(2, dtype=torch.complex64), "torch.complex64")):
            with pytest.raises(TypeError, match=f"per_sample_weights of table 0 must be a real tensor or None, not {name}"):
                merged(indices, offsets, *dense, per_sample_weights=[psw])
        if dense:
            with pytest.raises(ValueError, match="dense_feature is on meta; xlaunch.nn runs on the CPU"):
                merged(indices, offsets, torch.ones(1, 2, device="meta"))
            assert torch.equal(merged(indices, offsets, dense[0])[:, :2], dense[0])
