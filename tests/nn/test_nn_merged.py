"""Merged embedding bags against the nn.EmbeddingBag tables and torch optimizers they replace,
on the compiled kernels and on the pure-torch paths (the ``kernels`` fixture runs both)."""
from __future__ import annotations

import pytest
from nn_helpers import dispatch, kernels  # noqa: F401 - the fixtures

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from xlaunch.kernels.optim.splitbf16 import join  # noqa: E402
from xlaunch.nn import (EmbeddingSpec, MergedEmbeddingBag, MergedEmbeddingBagWithAdaGrad,  # noqa: E402
                        MergedEmbeddingBagWithCat, MergedEmbeddingBagWithSGD, native)

pytestmark = pytest.mark.torch
BATCH = 6


def make_tables(modes=("mean", "sum", "max"), dims=(8, 8, 4), rows=(40, 25, 18), last=(False, False, True),
                seed: int = 0) -> list[nn.EmbeddingBag]:
    torch.manual_seed(seed)
    return [nn.EmbeddingBag(r, d, mode=m, include_last_offset=li) for r, d, m, li in zip(rows, dims, modes, last)]


def make_inputs(tables: list[nn.EmbeddingBag], dtype=torch.int64, seed: int = 1) -> tuple[list, list]:
    """Per table: random bag sizes (an empty bag in each); include_last_offset tables get B + 1 offsets."""
    gen = torch.Generator().manual_seed(seed)
    indices, offsets = [], []
    for table in tables:
        sizes = torch.randint(0, 5, (BATCH,), generator=gen)
        sizes[1] = 0                                         # an empty bag in every table
        starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        total = int(starts[-1])
        indices.append(torch.randint(0, table.num_embeddings, (total,), generator=gen).to(dtype))
        offsets.append((starts if table.include_last_offset else starts[:-1]).to(dtype))
    return indices, offsets


def reference(tables, indices, offsets, weights=None) -> list[torch.Tensor]:
    weights = weights or [None] * len(tables)
    return [t(i.long(), o.long(), per_sample_weights=w) for t, i, o, w in zip(tables, indices, offsets, weights)]


def copies(tables: list[nn.EmbeddingBag]) -> list[nn.EmbeddingBag]:
    return [nn.EmbeddingBag.from_pretrained(t.weight.detach().clone(), freeze=False, mode=t.mode,
                                            include_last_offset=t.include_last_offset) for t in tables]


def touched(indices) -> list[torch.Tensor]:
    """Rows each table's bags look up."""
    return [torch.unique(i).long() for i in indices]


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_forward_equals_the_tables_for_every_mode_dim_and_offsets_form(kernels, index_dtype):
    tables = make_tables()
    indices, offsets = make_inputs(tables, index_dtype)
    merged = MergedEmbeddingBag.from_embeddingbag_list(tables)
    with torch.no_grad():
        got, want = merged(indices, offsets), reference(tables, indices, offsets)
    assert [tuple(g.shape) for g in got] == [(BATCH, 8), (BATCH, 8), (BATCH, 4)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert torch.equal(got[1][1], torch.zeros(8)) and torch.equal(got[2][1], torch.zeros(4))   # empty bags

    square = torch.randint(0, 18, (BATCH, 3), dtype=index_dtype)    # 2-D indices: bags of equal size
    with torch.no_grad():
        got = merged([indices[0], indices[1], square], [offsets[0], offsets[1], None])[2]
    torch.testing.assert_close(got, tables[2](square.long()))


def test_bf16_weights_pool_like_bf16_tables(kernels):
    tables = [t.to(torch.bfloat16) for t in make_tables(modes=("mean", "sum", "sum"))]
    indices, offsets = make_inputs(tables)
    with torch.no_grad():
        got = MergedEmbeddingBag.from_embeddingbag_list(tables)(indices, offsets)
        want = reference(tables, indices, offsets)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)


def test_per_sample_weights_scale_sum_pooled_lookups(kernels):
    tables = make_tables(modes=("sum", "sum", "mean"))
    indices, offsets = make_inputs(tables)
    gen = torch.Generator().manual_seed(5)
    weights = [torch.rand(len(indices[0]), generator=gen), None, None]
    merged = MergedEmbeddingBag.from_embeddingbag_list(tables)
    with torch.no_grad():
        got = merged(indices, offsets, per_sample_weights=weights)
    for g, w in zip(got, reference(tables, indices, offsets, weights)):
        torch.testing.assert_close(g, w)
    with pytest.raises(ValueError, match="table 2: per_sample_weights need pooling_mode 'sum'"):
        merged(indices, offsets, per_sample_weights=[None, None, torch.ones(len(indices[2]))])


def test_dense_gradient_equals_the_tables_gradients(kernels):
    tables = make_tables()
    indices, offsets = make_inputs(tables)
    merged = MergedEmbeddingBag.from_embeddingbag_list(tables)
    gen = torch.Generator().manual_seed(7)
    upstream = [torch.randn(BATCH, t.embedding_dim, generator=gen) for t in tables]
    torch.autograd.backward(merged(indices, offsets), upstream)
    torch.autograd.backward(reference(tables, indices, offsets), upstream)
    for number, table in enumerate(tables):
        torch.testing.assert_close(merged.layout.view(merged.weight.grad, number), table.weight.grad)


# Table sets for the update tests: the default mixes dims and modes (a run per table); "run" puts
# all tables in one run of one dim and mode (the pure-torch path pools and updates them in one
# block); "sorted" also sends the pure-torch step through its large-step path (sorted row sums).
RUNS = ["mixed", "run", "sorted"]


def run_tables(case, monkeypatch, modes) -> list[nn.EmbeddingBag]:
    if case == "sorted":
        import xlaunch.nn.bag_torch as bag_torch
        monkeypatch.setattr(bag_torch, "SMALL_STEP_LOOKUPS", 0)
    if case == "mixed":
        return make_tables(modes=modes)
    return make_tables(modes=(modes[0],) * 3, dims=(8, 8, 8))


@pytest.mark.parametrize("index_dtype,case", [(torch.int64, "mixed"), (torch.int32, "mixed"), (torch.int32, "run"),
                                              (torch.int64, "sorted")])
def test_one_fused_sgd_step_equals_torch_sgd_on_the_touched_rows(kernels, index_dtype, case, monkeypatch):
    tables = run_tables(case, monkeypatch, ("mean", "sum", "mean"))
    indices, offsets = make_inputs(tables, index_dtype)
    decay = 0.0 if case == "run" else 0.1                   # without decay: each lookup's row added in place
    merged = MergedEmbeddingBagWithSGD.from_embeddingbag_list(tables, lr=0.5, weight_decay=decay)
    before = [w.clone() for w in merged.weights]
    gen = torch.Generator().manual_seed(11)
    upstream = [torch.randn(BATCH, t.embedding_dim, generator=gen) for t in tables]
    ref = copies(tables)
    torch.autograd.backward(reference(ref, indices, offsets), upstream)
    torch.optim.SGD([t.weight for t in ref], lr=0.5, weight_decay=decay).step()

    torch.autograd.backward(merged(indices, offsets), upstream)
    assert merged.weight.grad is None                       # the update replaced the gradient
    for number, rows in enumerate(touched(indices)):
        torch.testing.assert_close(merged.weights[number][rows], ref[number].weight.detach()[rows])
        untouched = torch.ones(tables[number].num_embeddings, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(merged.weights[number][untouched], before[number][untouched])


@pytest.mark.parametrize("case", RUNS)
def test_two_fused_adagrad_steps_equal_torch_adagrad(kernels, case, monkeypatch):
    tables = run_tables(case, monkeypatch, ("sum", "mean", "mean"))
    indices, offsets = make_inputs(tables)
    merged = MergedEmbeddingBagWithAdaGrad.from_embeddingbag_list(tables, lr=0.3, eps=1e-8)
    ref = copies(tables)
    optimizer = torch.optim.Adagrad([t.weight for t in ref], lr=0.3, eps=1e-8)
    gen = torch.Generator().manual_seed(13)
    for _ in range(2):
        upstream = [torch.randn(BATCH, t.embedding_dim, generator=gen) for t in tables]
        optimizer.zero_grad()
        torch.autograd.backward(reference(ref, indices, offsets), upstream)
        optimizer.step()
        torch.autograd.backward(merged(indices, offsets), upstream)
    for number, table in enumerate(ref):
        torch.testing.assert_close(merged.weights[number], table.weight.detach())
        torch.testing.assert_close(merged.layout.view(merged.state_sum, number), optimizer.state[table.weight]["sum"])


@pytest.mark.parametrize("fused", [MergedEmbeddingBagWithSGD, MergedEmbeddingBagWithAdaGrad])
def test_bf16_training_keeps_an_exact_fp32_master(kernels, fused):
    tables = make_tables(modes=("mean", "sum", "sum"))
    indices, offsets = make_inputs(tables)
    fp32 = fused.from_embeddingbag_list(tables, lr=0.25)
    split = fused.from_embeddingbag_list(tables, lr=0.25).to_bfloat16_train()
    assert split.weight.dtype == torch.bfloat16 and split.trail.dtype == torch.int16
    assert torch.equal(split.master_weight(), fp32.weight.detach())      # the split is exact
    gen = torch.Generator().manual_seed(17)
    for _ in range(2):
        upstream = [torch.randn(BATCH, t.embedding_dim, generator=gen) for t in tables]
        torch.autograd.backward(fp32(indices, offsets), upstream)
        out = split(indices, offsets)
        assert out[0].dtype == torch.bfloat16
        torch.autograd.backward(out, [u.bfloat16() for u in upstream])
    master = split.master_weight()
    # the same fp32 update on the master: equal up to the bf16 rounding of the upstream gradient
    torch.testing.assert_close(master, fp32.weight.detach(), rtol=0, atol=2e-2)
    assert not torch.equal(master, split.weight.detach().float())        # the trail holds real bits
    assert torch.equal(join(split.weight.detach(), split.trail), master)


@pytest.mark.parametrize("fused", [MergedEmbeddingBagWithSGD, MergedEmbeddingBagWithAdaGrad])
def test_dtype_casts_of_the_module_keep_the_master_and_the_sums(kernels, fused):
    """.float() of a split-bf16 module kept only the bf16 half (the low bits lost) and its trail,
    which failed the next update; .bfloat16() gave bf16 weights with no master and bf16 sums;
    .half() rounded Adagrad's sums to fp16."""
    tables = make_tables(modes=("mean", "sum", "sum"))
    indices, offsets = make_inputs(tables)
    gen = torch.Generator().manual_seed(5)
    upstream = [torch.randn(BATCH, t.embedding_dim, generator=gen) for t in tables]
    split = fused.from_embeddingbag_list(tables, lr=0.25).to_bfloat16_train()
    torch.autograd.backward(split(indices, offsets), [u.bfloat16() for u in upstream])
    master, sums = split.master_weight(), getattr(split, "state_sum", None)
    assert split.float() is split and split.weight.dtype == torch.float32 and split.trail is None
    assert torch.equal(split.weight.detach(), master)                     # the exact master, not the bf16 half
    plain = fused.from_embeddingbag_list(tables, lr=0.25)
    with torch.no_grad():
        plain.weight.copy_(master)
        if sums is not None:
            plain.state_sum.copy_(sums)
    for module in (split, plain):                                         # trains on as an fp32 module
        torch.autograd.backward(module(indices, offsets), upstream)
    assert torch.equal(split.weight, plain.weight)

    cast, reference_split = fused.from_embeddingbag_list(tables, lr=0.25), fused.from_embeddingbag_list(tables, lr=0.25)
    cast.bfloat16()
    reference_split.to_bfloat16_train()
    assert cast.trail is not None and torch.equal(cast.weight, reference_split.weight)
    assert torch.equal(cast.trail, reference_split.trail)
    for module in (cast, reference_split):
        torch.autograd.backward(module(indices, offsets), [u.bfloat16() for u in upstream])
    assert torch.equal(cast.master_weight(), reference_split.master_weight())
    if sums is not None:
        assert cast.state_sum.dtype == torch.float32 and torch.equal(cast.state_sum, reference_split.state_sum)
        sums = cast.state_sum.clone()
        cast.half()
        assert cast.state_sum.dtype == torch.float32 and torch.equal(cast.state_sum, sums)
        assert cast.trail is None and torch.equal(cast.weight, reference_split.master_weight().half())


def test_with_cat_writes_dense_and_tables_into_one_matrix(kernels):
    tables = make_tables(modes=("sum", "mean", "mean"), dims=(8, 4, 8))
    indices, offsets = make_inputs(tables)
    dense = torch.randn(BATCH, 5, requires_grad=True)
    merged = MergedEmbeddingBagWithCat.from_embeddingbag_list(tables)
    got = merged(indices, offsets, dense)
    want = torch.cat([dense, *reference(tables, indices, offsets)], dim=1)
    torch.testing.assert_close(got, want)
    upstream = torch.randn_like(got)
    got.backward(upstream)
    assert torch.equal(dense.grad, upstream[:, :5])
    want_grad = torch.autograd.grad(want, tables[1].weight, upstream)[0]
    torch.testing.assert_close(merged.layout.view(merged.weight.grad, 1), want_grad)


def test_specs_state_dict_and_ipex_checkpoints():
    specs = [EmbeddingSpec(10, 4, "sum", torch.float32, None, False, False),
             EmbeddingSpec(7, 6, "mean", torch.float32, torch.arange(42.0).view(7, 6), False, True)]
    merged = MergedEmbeddingBag(specs)
    assert merged.weight.shape == (10 * 4 + 7 * 6,) and torch.equal(merged.weights[1], torch.arange(42.0).view(7, 6))
    again = MergedEmbeddingBag(specs)
    again.load_state_dict(merged.state_dict())
    assert torch.equal(again.weight, merged.weight)
    ipex_style = {"weights.0": torch.ones(10, 4), "weights.1": torch.full((7, 6), 2.0)}
    again.load_state_dict(ipex_style)
    assert torch.equal(again.weights[0], torch.ones(10, 4)) and torch.equal(again.weights[1], torch.full((7, 6), 2.0))
    # IPEX's fused classes save only weights.N (no Adagrad sums, no bf16 low halves): they load into
    # ours with zero sums and low halves (Adagrad and split bf16 refused them: missing keys)
    for cls in (MergedEmbeddingBagWithSGD, MergedEmbeddingBagWithAdaGrad):
        for bf16 in (False, True):
            fused = cls(specs)
            if bf16:
                fused.to_bfloat16_train()
            if fused.trail is not None:
                fused.trail.fill_(7)
            getattr(fused, "state_sum", torch.empty(0)).fill_(3.0)
            fused.load_state_dict({key: value.to(fused.weight.dtype) for key, value in ipex_style.items()})
            assert torch.equal(fused.master_weight(), again.weight)
            assert fused.trail is None or not fused.trail.any()
            assert not getattr(fused, "state_sum", torch.zeros(1)).any()
    with pytest.raises(RuntimeError, match=r"size mismatch for weights.1: copying a param with shape \(6, 7\)"):
        again.load_state_dict({"weights.0": torch.ones(10, 4), "weights.1": torch.ones(6, 7)})
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "weights.1"'):
        again.load_state_dict({"weights.0": torch.ones(10, 4)})      # was KeyError: 'weights.1'
    loose = again.load_state_dict({"weights.0": torch.zeros(10, 4), "weights.5": torch.ones(1)}, strict=False)
    assert loose.missing_keys == ["weights.1"] and loose.unexpected_keys == ["weights.5"]
    assert not again.weights[0].any() and torch.equal(again.weights[1], torch.full((7, 6), 2.0))


def test_refusals_say_what_is_wrong(kernels):
    tables = make_tables()
    indices, offsets = make_inputs(tables)
    merged = MergedEmbeddingBag.from_embeddingbag_list(tables)
    bad = [indices[0].clone(), indices[1], indices[2]]
    bad[0][0] = 40                                                   # table 0 has 40 rows
    with pytest.raises((RuntimeError, IndexError)):
        merged(bad, offsets)
    with pytest.raises(ValueError, match="same number of bags"):
        merged(indices, [offsets[0][:-1], offsets[1], offsets[2]])
    with pytest.raises(ValueError, match="padding_idx"):
        MergedEmbeddingBag.from_embeddingbag_list([nn.EmbeddingBag(5, 2, padding_idx=0)])
    with pytest.raises(ValueError, match="sparse=True"):
        MergedEmbeddingBag.from_embeddingbag_list([nn.EmbeddingBag(5, 2, sparse=True)])
    with pytest.raises(ValueError, match="one weight dtype"):
        MergedEmbeddingBag([EmbeddingSpec(3, 2, dtype=torch.float32), EmbeddingSpec(3, 2, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="^lr must be a finite number >= 0, got -1.0$"):
        MergedEmbeddingBagWithSGD([EmbeddingSpec(3, 2)], lr=-1.0)


@pytest.mark.parametrize("case", ["mixed", "run"])
@pytest.mark.parametrize("fused", [MergedEmbeddingBag, MergedEmbeddingBagWithSGD, MergedEmbeddingBagWithAdaGrad])
def test_out_of_range_and_negative_indices_name_the_table_and_change_nothing(kernels, fused, case, monkeypatch):
    tables = run_tables(case, monkeypatch, ("mean", "sum", "sum"))
    indices, offsets = make_inputs(tables)
    merged = fused.from_embeddingbag_list(tables)
    before = merged.weight.detach().clone()
    for value, table in ((25, 1), (-1, 2)):                  # table 1 has 25 rows; table 2 18
        bad = [i.clone() for i in indices]
        bad[table][2] = value
        with pytest.raises(IndexError, match=rf"index {value} at position 2 of table {table} is out of range "
                                             rf"\[0, {tables[table].num_embeddings}\)"):
            torch.autograd.backward(merged(bad, offsets), [torch.ones(BATCH, t.embedding_dim) for t in tables])
        assert torch.equal(merged.weight.detach(), before) and merged.weight.grad is None


def _step_reference(tables, indices, offsets, upstream, optimizer, **hyper):
    ref = copies(tables)
    torch.autograd.backward(reference(ref, indices, offsets), upstream)
    optimizer([t.weight for t in ref], **hyper).step()
    return ref


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_fp64_fp16_bf16_forward_and_one_sgd_and_adagrad_step_equal_the_reference(kernels, dtype, tol):
    tables = [t.to(dtype) for t in make_tables(modes=("mean", "sum", "sum"))]
    indices, offsets = make_inputs(tables, torch.int32)
    gen = torch.Generator().manual_seed(19)
    upstream = [torch.randn(BATCH, t.embedding_dim, generator=gen).to(dtype) for t in tables]
    with torch.no_grad():
        for g, w in zip(MergedEmbeddingBag.from_embeddingbag_list(tables)(indices, offsets),
                        reference(tables, indices, offsets)):
            assert g.dtype == dtype
            torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for fused, optimizer, hyper in ((MergedEmbeddingBagWithSGD, torch.optim.SGD, {"lr": 0.5}),
                                    (MergedEmbeddingBagWithAdaGrad, torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-4})):
        merged = fused.from_embeddingbag_list(tables, **hyper)
        assert merged.weight.dtype == dtype                              # no cast of the user's weights
        torch.autograd.backward(merged(indices, offsets), upstream)
        ref = _step_reference(tables, indices, offsets, upstream, optimizer, **hyper)
        for number, table in enumerate(ref):
            torch.testing.assert_close(merged.weights[number].double(), table.weight.detach().double(),
                                       rtol=tol, atol=tol)


def test_mixed_dtypes_name_the_table_and_per_table_grads_are_populated(kernels):
    with pytest.raises(ValueError, match="table 1 has weight dtype torch.float64, table 0 torch.float32"):
        MergedEmbeddingBag([EmbeddingSpec(3, 2), EmbeddingSpec(3, 2, dtype=torch.float64)])
    tables = make_tables()
    indices, offsets = make_inputs(tables)
    merged = MergedEmbeddingBag.from_embeddingbag_list(tables)
    upstream = [torch.randn(BATCH, t.embedding_dim) for t in tables]
    torch.autograd.backward(merged(indices, offsets), upstream)
    torch.autograd.backward(reference(tables, indices, offsets), upstream)
    for view, table in zip(merged.weights, tables):
        torch.testing.assert_close(view.grad, table.weight.grad)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_outputs_follow_ipex(kernels, low):
    """IPEX's autocast rule for fp32 tables, bf16 and fp16 alike: without grad mode the forward
    pools a copy of the weights in the autocast dtype; with grad mode it runs in fp32, forward and
    backward exactly as without autocast."""
    tables = make_tables(modes=("mean", "sum", "sum"))
    indices, offsets = make_inputs(tables)
    merged = MergedEmbeddingBag.from_embeddingbag_list(tables)
    cat = MergedEmbeddingBagWithCat.from_embeddingbag_list(tables[1:])
    dense = torch.randn(BATCH, 3)
    upstream = [torch.randn(BATCH, t.embedding_dim, generator=torch.Generator().manual_seed(5)) for t in tables]
    with torch.autocast("cpu", dtype=low):
        with torch.no_grad():
            inference = merged(indices, offsets)
            joined = cat(indices[1:], offsets[1:], dense)
        training = merged(indices, offsets)
        torch.autograd.backward(training, upstream)
    expected = reference(tables, indices, offsets)
    assert {o.dtype for o in inference} == {low} and joined.dtype == low   # IPEX casts the weights for inference
    for got, want in zip(inference, expected):
        torch.testing.assert_close(got.float(), want.detach(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(joined.float(), torch.cat([dense] + [w.detach() for w in expected[1:]], dim=1),
                               rtol=2e-2, atol=2e-2)
    assert {o.dtype for o in training} == {torch.float32}            # and runs in their dtype when training
    grad = merged.weight.grad.clone()
    merged.weight.grad = None
    plain = merged(indices, offsets)                                  # the same, without autocast
    torch.autograd.backward(plain, upstream)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(training, plain))
    assert torch.equal(grad, merged.weight.grad)
    torch.autograd.backward(expected, upstream)                       # and nn.EmbeddingBag's gradients
    for view, table in zip(merged.weights, tables):
        torch.testing.assert_close(view.grad, table.weight.grad)


@pytest.mark.parametrize("fused,optimizer", [(MergedEmbeddingBagWithSGD, torch.optim.SGD),
                                             (MergedEmbeddingBagWithAdaGrad, torch.optim.Adagrad)])
def test_fused_classes_train_max_pooled_tables(kernels, fused, optimizer):
    tables = make_tables()                                           # table 2 is max-pooled
    indices, offsets = make_inputs(tables)
    merged = fused.from_embeddingbag_list(tables, lr=0.5)
    upstream = [torch.randn(BATCH, t.embedding_dim, generator=torch.Generator().manual_seed(23)) for t in tables]
    torch.autograd.backward(merged(indices, offsets), upstream)
    ref = _step_reference(tables, indices, offsets, upstream, optimizer, lr=0.5)
    for number, rows in enumerate(touched(indices)):
        torch.testing.assert_close(merged.weights[number][rows], ref[number].weight.detach()[rows])


def test_jit_trace_and_compile_fullgraph_record_the_ops(dispatch):
    tables = make_tables(modes=("mean", "sum", "sum"))
    indices, offsets = make_inputs(tables)
    merged = MergedEmbeddingBag.from_embeddingbag_list(tables)
    traced = torch.jit.trace(merged, (indices, offsets), check_trace=False)
    assert "xlaunch::merged_bag" in str(traced.graph)
    for got, want in zip(traced(indices, offsets), reference(tables, indices, offsets)):
        torch.testing.assert_close(got, want)
    overrun = [offsets[0].clone(), *offsets[1:]]
    overrun[0][-1] = len(indices[0]) + 1                 # the recorded op checks the offsets it is given
    with pytest.raises(RuntimeError, match=rf"ValueError: offset .* position {BATCH - 1} of table 0 is out of range"):
        traced(indices, overrun)                         # (the TorchScript interpreter wraps the error)
    eager = MergedEmbeddingBagWithSGD.from_embeddingbag_list(tables, lr=0.5)
    compiled_module = MergedEmbeddingBagWithSGD.from_embeddingbag_list(tables, lr=0.5)
    compiled = torch.compile(compiled_module, fullgraph=True)
    upstream = [torch.randn(BATCH, t.embedding_dim, generator=torch.Generator().manual_seed(29)) for t in tables]
    torch.autograd.backward(compiled(indices, offsets), upstream)    # the update runs in the compiled backward
    torch.autograd.backward(eager(indices, offsets), upstream)
    torch.testing.assert_close(compiled_module.weight, eager.weight)
    with pytest.raises(ValueError, match=rf"position {BATCH - 1} of table 0 is out of range"):
        compiled(indices, overrun)
    torch.testing.assert_close(compiled_module.weight, eager.weight)
    assert not torch.equal(eager.weight, merged.weight)


def test_the_per_table_torch_forward_equals_the_tables():
    tables = make_tables(modes=("sum", "mean", "max"))
    indices, offsets = make_inputs(tables, torch.int32)
    weights = [torch.rand(len(indices[0]), generator=torch.Generator().manual_seed(31)), None, None]
    with native.prefer_native(False), torch.no_grad():
        got = MergedEmbeddingBag.from_embeddingbag_list(tables)(indices, offsets, per_sample_weights=weights)
    for g, w in zip(got, reference(tables, indices, offsets, weights)):
        torch.testing.assert_close(g, w)


def test_cached_call_plan_still_checks_every_call(kernels):
    """The pure-torch forward caches each call signature's checked layout: a later call of the same
    signature (include_last_offset, empty bags, 2-D indices) pools right, and an index outside its
    own table still raises naming it, with the outputs of a good call unchanged afterwards."""
    torch.manual_seed(0)
    tables = [nn.EmbeddingBag(7, 4, mode="mean", include_last_offset=True), nn.EmbeddingBag(5, 4, mode="mean"),
              nn.EmbeddingBag(6, 4, mode="mean")]
    merged = MergedEmbeddingBag.from_embeddingbag_list(tables)
    indices = [torch.tensor([1, 6, 0, 3, 2]), torch.tensor([4, 0, 1]), torch.tensor([[5, 0], [1, 2], [3, 3]])]
    offsets = [torch.tensor([0, 2, 2, 5]), torch.tensor([0, 0, 3]), None]
    with torch.no_grad():
        for _ in range(2):
            got = merged(indices, offsets)
            for out, table, idx, off in zip(got, tables, indices, offsets):
                torch.testing.assert_close(out, table(idx, off))
        for table, bad, message in ((1, 5, r"index 5 at position 2 of table 1 is out of range \[0, 5\)"),
                                    (0, -1, r"index -1 at position 0 of table 0 is out of range \[0, 7\)")):
            wrong = [i.clone() for i in indices]
            wrong[table].view(-1)[2 if table else 0] = bad
            with pytest.raises(IndexError, match=message):
                merged(wrong, offsets)
        torch.testing.assert_close(merged(indices, offsets)[2], tables[2](indices[2]))
