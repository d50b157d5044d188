"""Scatter and gather of nested batches, uneven sizes, and loss weights that keep the full-batch loss."""

import dataclasses
import logging
from collections import UserDict, namedtuple
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from lightning_gpipe import GPipeStrategy, Unbatched
from lightning_gpipe.engine.microbatch import batch_size, count_weights, gather, loss_weights, scatter

Batch = namedtuple("Batch", ["x", "y"])


@dataclasses.dataclass
class Record:
    tokens: torch.Tensor
    lengths: torch.Tensor
    language: str


def test_tensor_splits_into_even_chunks() -> None:
    microbatches = scatter(torch.arange(8).view(8, 1), 4)
    assert [mb.size for mb in microbatches] == [2, 2, 2, 2]
    assert [mb.index for mb in microbatches] == [0, 1, 2, 3]
    assert torch.equal(gather([mb.value for mb in microbatches]), torch.arange(8).view(8, 1))


def test_uneven_and_small_batches() -> None:
    assert [mb.size for mb in scatter(torch.zeros(10, 2), 4)] == [3, 3, 2, 2]
    assert [mb.size for mb in scatter(torch.zeros(3, 2), 8)] == [1, 1, 1]


@pytest.mark.parametrize("chunks", [1, 3, 4, 7])
def test_nested_batch_round_trip(chunks: int) -> None:
    batch = {
        "pair": Batch(torch.randn(7, 3), torch.arange(7)),
        "record": Record(torch.randint(0, 9, (7, 5)), torch.arange(7), "de"),
        "list": [torch.randn(7), 0.5, None],
        "scale": torch.tensor(2.0),
    }
    microbatches = scatter(batch, chunks)
    first = microbatches[0].value
    assert isinstance(first["pair"], Batch)
    assert isinstance(first["record"], Record)
    assert first["record"].language == "de"  # non-tensor leaves go to every micro-batch
    assert first["list"][1:] == [0.5, None]
    assert torch.equal(first["scale"], torch.tensor(2.0))  # 0-d tensors are not split
    joined = gather([mb.value for mb in microbatches])
    assert torch.equal(joined["pair"].x, batch["pair"].x)
    assert torch.equal(joined["record"].tokens, batch["record"].tokens)
    assert joined["record"].language == "de"  # equal in every micro-batch: kept once


@pytest.mark.parametrize(("total", "chunks"), [(8, 4), (10, 4), (7, 3), (5, 8)])
def test_weighted_micro_batch_losses_equal_the_full_batch_loss(total: int, chunks: int) -> None:
    logits, targets = torch.randn(total, 5, dtype=torch.float64), torch.randint(0, 5, (total,))
    full = F.cross_entropy(logits, targets)
    pieces = scatter((logits, targets), chunks)
    assert sum(mb.weight for mb in pieces) == pytest.approx(1.0)
    weighted = sum(mb.weight * F.cross_entropy(*mb.value) for mb in pieces)
    assert torch.allclose(weighted, full, rtol=1e-12, atol=0)


def test_batch_size_errors_name_the_problem() -> None:
    with pytest.raises(
        ValueError, match=r"share their dim-0 size, got batch\[0\]: 4, batch\[1\]: 3; wrap .* in Unbatched"
    ):
        batch_size((torch.zeros(4), torch.zeros(3)))
    with pytest.raises(TypeError, match="holds no tensor with a batch dimension"):
        batch_size(["a", 1])
    with pytest.raises(ValueError, match="empty batch"):
        scatter(torch.zeros(0, 3), 2)


@pytest.mark.parametrize(
    ("chunks", "error", "match"),
    [
        (0, ValueError, "chunks=0 must be at least 1"),
        (-2, ValueError, "chunks=-2"),
        (2.0, TypeError, "must be an int"),
        (True, TypeError, "must be an int"),
    ],
)
def test_invalid_chunks_are_refused(chunks: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        scatter(torch.zeros(4), chunks)  # type: ignore[arg-type]


def test_gather_refuses_mixed_structures() -> None:
    with pytest.raises(ValueError, match="different structures"):
        gather([(torch.ones(1),), [torch.ones(1)]])


class Encoding(UserDict):
    """Stands in for Hugging Face's ``BatchEncoding``: a UserDict subclass with a method of its own."""

    def tokens(self) -> torch.Tensor:
        return self["input_ids"]


@pytest.mark.parametrize("kind", [UserDict, Encoding])
def test_userdict_batches_split_into_the_same_type(kind: type) -> None:
    # Tokenizers and collators return BatchEncoding, a UserDict; the splitter said it held no tensor.
    batch = kind(input_ids=torch.arange(12).view(6, 2), attention_mask=torch.ones(6, 2), language="de")
    assert batch_size(batch) == 6
    microbatches = scatter(batch, 3)
    assert [type(mb.value) for mb in microbatches] == [kind] * 3
    assert torch.equal(microbatches[1].value["input_ids"], torch.tensor([[4, 5], [6, 7]]))
    assert microbatches[2].value["language"] == "de"
    joined = gather([mb.value for mb in microbatches])
    assert type(joined) is kind
    assert torch.equal(joined["input_ids"], batch["input_ids"])


def test_gather_keeps_values_that_are_not_per_sample_as_the_step_returned_them() -> None:
    # Issue 17.9: predict_step's ints, strings and 0-d tensors came back as one copy per micro-batch.
    outputs = [{"i": 3, "tag": "v1", "scale": torch.tensor(2.0), "out": torch.ones(2, 1), "mb": m} for m in range(3)]
    joined = gather(outputs)
    assert joined["i"] == 3
    assert joined["tag"] == "v1"
    assert torch.equal(joined["scale"], torch.tensor(2.0))
    assert joined["out"].shape == (6, 1)
    assert joined["mb"] == [0, 1, 2]  # differing values: one per micro-batch, in order
    assert torch.equal(gather([torch.tensor(1.0), torch.tensor(2.0)]), torch.tensor([1.0, 2.0]))


def test_loss_weight_makes_a_token_mean_over_micro_batches_the_batch_token_mean() -> None:
    # Issue 17.5: micro-batches were weighted by samples, so a token-mean loss over ragged padding trained differently.
    generator = torch.Generator().manual_seed(0)
    losses = torch.rand(8, 5, generator=generator)  # per-token losses
    mask = torch.arange(5)[None] < torch.tensor([5, 1, 1, 1, 2, 4, 5, 3])[:, None]
    microbatches = scatter((losses, mask), 4)
    outputs = [{"loss": t[m].mean(), "loss_weight": m.sum()} for t, m in (mb.value for mb in microbatches)]
    weights = loss_weights(outputs, microbatches, torch.device("cpu"))
    combined = sum(w * out["loss"] for w, out in zip(weights, outputs, strict=True))
    assert combined.item() == pytest.approx(losses[mask].mean().item())
    assert loss_weights([torch.ones(())] * 4, microbatches, torch.device("cpu")).tolist() == [0.25] * 4
    with pytest.raises(ValueError, match="returned 'loss_weight' for 3 of 4 micro-batches; return it for all"):
        loss_weights([*outputs[:3], {"loss": torch.ones(())}], microbatches, torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"one real number per batch, not of shape \(2,\); e.g. \(target != ignore_index\).sum\(\)"
    ):
        loss_weights(
            [{"loss": o["loss"], "loss_weight": torch.ones(2)} for o in outputs], microbatches, torch.device("cpu")
        )


def test_counts_that_sum_to_zero_weigh_the_micro_batches_by_their_samples() -> None:
    # Regression: a batch whose labels were all ignored weighed each micro-batch 0 / 0, so its loss and logs were NaN.
    microbatches = scatter(torch.zeros(7, 2), 3)  # 3, 2 and 2 samples
    weights = count_weights([torch.tensor(0), 0, torch.tensor(0.0)], microbatches, torch.device("cpu"))
    assert weights.tolist() == pytest.approx([3 / 7, 2 / 7, 2 / 7])
    assert count_weights([1, 0, 3], microbatches, torch.device("cpu")).tolist() == [0.25, 0.0, 0.75]


def test_step_extras_join_the_other_keys_of_the_micro_batches_outputs() -> None:
    from lightning_gpipe.engine.microbatch import step_extras

    preds = torch.arange(5.0, requires_grad=True)
    outputs = [
        {"loss": torch.tensor(1.0), "preds": preds[:3] * 2, "tag": "a", "acc": torch.tensor(0.5)},
        {"loss": torch.tensor(2.0), "preds": preds[3:] * 2, "tag": "a", "acc": torch.tensor(1.0)},
    ]
    extras = step_extras(outputs)
    assert extras is not None
    assert extras.keys() == {"preds", "tag", "acc"}
    assert torch.equal(extras["preds"], torch.arange(5.0) * 2)  # per-sample: the batch's, as a plain step gives
    assert not extras["preds"].requires_grad
    assert extras["tag"] == "a"  # equal in every micro-batch: once
    assert torch.equal(extras["acc"], torch.tensor([0.5, 1.0]))  # a per-batch value: one per micro-batch
    assert step_extras([torch.tensor(1.0), torch.tensor(2.0)]) is None
    assert step_extras([{"loss": torch.tensor(1.0)}]) is None
    with pytest.raises(ValueError, match=r"different keys for the micro-batches of one batch \(\['a'\] and \['b'\]\)"):
        step_extras([{"loss": torch.tensor(1.0), "a": 1}, {"loss": torch.tensor(1.0), "b": 1}])


def test_unbatched_values_go_whole_to_every_microbatch_and_gather_once() -> None:
    # Issue 15 item 3: a (T, T) attention bias whose dim 0 equals the batch size was split like the tokens.
    tokens, bias = torch.arange(40).reshape(8, 5), torch.randn(8, 8)
    microbatches = scatter({"tokens": tokens, "bias": Unbatched(bias)}, 4)
    assert [mb.value["tokens"].shape[0] for mb in microbatches] == [2, 2, 2, 2]
    assert all(mb.value["bias"].value is bias for mb in microbatches)
    joined = gather([mb.value for mb in microbatches])
    assert torch.equal(joined["tokens"], tokens)
    assert isinstance(joined["bias"], Unbatched)
    assert joined["bias"].value is bias  # kept once, not concatenated to (32, 8)
    assert batch_size((tokens, Unbatched(torch.zeros(3)))) == 8


def test_a_batch_tensor_of_another_dim_0_is_refused_with_the_advice_to_mark_it() -> None:
    with pytest.raises(
        ValueError, match=r"batch\[1\]: 5; wrap a tensor without a batch dimension in Unbatched\(tensor\)"
    ):
        scatter((torch.zeros(8, 3), torch.zeros(5, 5)), 4)


def _collated(total: int) -> dict:
    # What default_collate makes of samples holding a string, a per-sample list of strings and tensors.
    samples = [
        {"text": f"s{i}", "tags": [f"a{i}", f"b{i}", f"c{i}"], "x": torch.full((2,), float(i)), "y": i}
        for i in range(total)
    ]
    return default_collate(samples)


@pytest.mark.parametrize("chunks", [2, 3, 8])
def test_per_sample_strings_are_split_with_their_rows(chunks: int) -> None:
    # Issue 29 item 3: a per-sample list of strings went whole to every micro-batch while the tensors were split, so
    # micro-batch i saw all 8 strings beside its own 2 rows.
    batch = _collated(8)
    microbatches = scatter(batch, chunks)
    for mb in microbatches:
        rows = mb.value["x"][:, 0].long().tolist()
        assert mb.value["text"] == [f"s{i}" for i in rows]
        # default_collate gives a per-sample list of 3 strings as 3 tuples of one string per sample.
        assert mb.value["tags"] == [tuple(f"{tag}{i}" for i in rows) for tag in "abc"]
        assert mb.value["y"].tolist() == rows
    joined = gather([mb.value for mb in microbatches], [mb.size for mb in microbatches])
    assert joined["text"] == batch["text"]
    assert joined["tags"] == batch["tags"]


def test_a_custom_collate_s_lists_per_sample_are_split_whole() -> None:
    # A list of N values each a list (ragged token lists, ids as ints, dicts of metadata) is one value per sample.
    batch = {
        "x": torch.arange(4),
        "words": [["a"], ["b", "c"], [], ["d", "e", "f"]],
        "ids": (10, 11, 12, 13),
        "meta": [{"lang": "de"}, {"lang": "fr"}, {"lang": "en"}, {"lang": "it"}],
    }
    first, second = (mb.value for mb in scatter(batch, 2))
    assert first["words"] == [["a"], ["b", "c"]]
    assert second["ids"] == (12, 13)  # the same type: a tuple stays a tuple
    assert second["meta"] == [{"lang": "en"}, {"lang": "it"}]


def test_a_collated_list_of_tensors_is_a_container_even_when_its_length_is_the_batch_size() -> None:
    # default_collate of a per-sample list of 2 tensors is a list of 2 batched tensors: each is split, not the list.
    batch = default_collate([{"feats": [torch.full((3,), float(i)), torch.full((5,), -float(i))]} for i in range(2)])
    first, second = (mb.value for mb in scatter(batch, 2))
    assert [tuple(t.shape) for t in first["feats"]] == [(1, 3), (1, 5)]
    assert second["feats"][1].tolist() == [[-1.0] * 5]


def test_lists_that_cannot_be_split_with_the_rows_are_refused_naming_the_field_and_the_fix() -> None:
    # A list of plain values of another length than the batch is not per-sample; it was handed whole to every
    # micro-batch. Now it must be marked.
    with pytest.raises(
        ValueError,
        match=r"batch\['names'\] is a list of 3 values in a batch of 8 samples, not one per sample: wrap it in "
        r"Unbatched",
    ):
        scatter({"x": torch.zeros(8), "names": ["cat", "dog", "bird"]}, 4)
    with pytest.raises(ValueError, match=r"batch\[1\]\[0\] is a list of 2 values in a batch of 8 samples"):
        batch_size((torch.zeros(8), [["a", "b"], ["c"]]))
    # default_collate of a per-sample list of 3 strings in a batch of 3: either level could be the samples'.
    with pytest.raises(
        ValueError,
        match=r"batch\['tags'\] is a list of 3 tuples of 3 values .* cannot be told; give tensors, or another "
        r"batch size",
    ):
        scatter(_collated(3), 3)
    marked = scatter({"x": torch.zeros(8), "names": Unbatched(["cat", "dog", "bird"])}, 4)
    assert all(mb.value["names"].value == ["cat", "dog", "bird"] for mb in marked)
    marked = scatter({"x": torch.zeros(2), "classes": Unbatched(("cat", "dog"))}, 2)  # as long as the batch, marked
    assert all(mb.value["classes"].value == ("cat", "dog") for mb in marked)
    with pytest.raises(
        TypeError, match=r"no tensor with a batch dimension \(lists are split with one, not alone\); give it one"
    ):
        batch_size({"text": ["a", "b"]})


def test_gather_concatenates_per_sample_lists_given_the_micro_batch_sizes() -> None:
    # predict_step returning its micro-batch's strings: they came back one list per position, not the batch's list.
    outputs = [{"text": ["a", "b", "c"], "tag": ["v", "1"]}, {"text": ["d", "e"], "tag": ["v", "1"]}]
    joined = gather(outputs, [3, 2])
    assert joined == {"text": ["a", "b", "c", "d", "e"], "tag": ["v", "1"]}  # a value equal in every one: once
    assert gather([("a", "b"), ("c", "d")], [2, 2]) == ("a", "b", "c", "d")
    assert gather([[["a"], ["b", "c"]], [["d"]]], [2, 1]) == [["a"], ["b", "c"], ["d"]]
    with pytest.raises(ValueError, match="2 micro-batch values but 1 sizes"):
        gather(outputs, [5])


def test_step_extras_concatenate_per_sample_lists() -> None:
    from lightning_gpipe.engine.microbatch import step_extras

    outputs = [{"loss": torch.tensor(1.0), "ids": ["x", "y"]}, {"loss": torch.tensor(1.0), "ids": ["z"]}]
    assert step_extras(outputs, [2, 1]) == {"ids": ["x", "y", "z"]}


class _Texts(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"text": f"sample {i}", "x": torch.full((4,), float(i)), "y": torch.tensor(i % 2)}


class _TextModel(L.LightningModule):
    """Checks in every step that its micro-batch's strings are its rows' own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.seen: list[tuple[list[str], list[int]]] = []

    def _check(self, batch: dict[str, Any]) -> None:
        self.seen.append((batch["text"], batch["x"][:, 0].long().tolist()))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self._check(batch)
        return F.cross_entropy(self.layers(batch["x"]), batch["y"])

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        self._check(batch)
        return {"text": batch["text"], "logits": self.layers(batch["x"])}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(chunks: int) -> L.Trainer:
    return L.Trainer(
        strategy=GPipeStrategy(pipe_size=1, chunks=chunks), accelerator="cpu", devices=1, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


@pytest.mark.usefixtures("loopback_process_group")
def test_the_strategy_splits_per_sample_strings_with_their_rows_and_gathers_them_back() -> None:
    # Issue 29 item 3 through the strategy: training and predict steps saw all 8 strings beside 2 rows, and
    # predict_step's per-micro-batch lists came back as one list per position.
    model = _TextModel()
    trainer = _trainer(chunks=4)
    trainer.fit(model, DataLoader(_Texts(), batch_size=8))
    predictions = trainer.predict(model, DataLoader(_Texts(), batch_size=8))
    assert len(model.seen) == 2 * 4 + 2 * 4
    for text, rows in model.seen:
        assert text == [f"sample {i}" for i in rows]
    assert predictions is not None
    assert predictions[1]["text"] == [f"sample {i}" for i in range(8, 16)]
    assert predictions[1]["logits"].shape == (8, 2)


@pytest.mark.usefixtures("loopback_process_group")
def test_chunks_larger_than_the_batch_warns_once_with_the_number_used(caplog: pytest.LogCaptureFixture) -> None:
    # Issue 29 C4: chunks=16 with batches of 8 ran 8 micro-batches while the log said "16 micro-batches per batch",
    # and nothing warned.
    model = _TextModel()
    with (
        caplog.at_level(logging.INFO),
        pytest.warns(UserWarning, match=r"chunks=16, but the first training batch holds 8 samples") as warned,
    ):
        _trainer(chunks=16).fit(model, DataLoader(_Texts(), batch_size=8))
    messages = [str(warning.message) for warning in warned if "chunks=16" in str(warning.message)]
    assert len(messages) == 1  # once, not every step
    assert "runs 8 micro-batches of one sample. Set chunks=8" in messages[0]
    assert "up to chunks=16 micro-batches per batch (a batch of N < 16 samples runs N)" in caplog.text
    assert len(model.seen) == 2 * 8


@pytest.mark.usefixtures("loopback_process_group")
def test_the_setup_line_of_one_micro_batch_says_so(caplog: pytest.LogCaptureFixture) -> None:
    # Regression: with chunks=1 the setup line read "(a batch of N < 1 samples runs N)" (and "1 stages").
    with caplog.at_level(logging.INFO):
        _trainer(chunks=1).fit(_TextModel(), DataLoader(_Texts(), batch_size=8))
    assert "GPipe: 1 pipeline of 1 stage, one micro-batch per batch (chunks=1);" in caplog.text
    assert "N < 1" not in caplog.text


class _IgnoredLabels(L.LightningModule):
    """Token classification whose labels may all be ignored (-100): its loss is ``sum / max(count, 1)``, 0 then."""

    returns_weight = False  # return {"loss", "loss_weight"} instead of declaring batch_loss_weight

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        ids, labels = batch
        logits = self.layers(ids)
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        count = (labels != -100).sum()
        loss = total / count.clamp(min=1)
        self.log("train_loss", loss)
        return {"loss": loss, "loss_weight": count} if self.returns_weight else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _DeclaredIgnoredLabels(_IgnoredLabels):
    def batch_loss_weight(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (batch[1] != -100).sum()


@pytest.mark.usefixtures("loopback_process_group")
@pytest.mark.parametrize(
    ("schedule", "virtual_stages", "declared"),
    [("gpipe", 1, True), ("gpipe", 1, False), ("1f1b", 1, True), ("zero_bubble", 1, True), ("interleaved", 2, True),
     ("zbv", 2, True)],
)  # fmt: skip
def test_a_batch_whose_labels_are_all_ignored_logs_a_zero_loss(
    schedule: str, virtual_stages: int, declared: bool
) -> None:
    # Regression: each micro-batch weighed count_i / sum(count) = 0 / 0, so the step's loss and the logged train_loss
    # were NaN where plain Lightning logs the module's 0 (EarlyStopping(check_finite=True) stopped on it).
    model = _DeclaredIgnoredLabels() if declared else _IgnoredLabels()
    model.returns_weight = not declared
    ids = torch.randint(0, 10, (6, 5), generator=torch.Generator().manual_seed(0))
    before = {name: value.clone() for name, value in model.state_dict().items()}
    trainer = L.Trainer(
        strategy=GPipeStrategy(pipe_size=1, chunks=3, schedule=schedule, virtual_stages=virtual_stages),
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader([(ids, torch.full_like(ids, -100))], batch_size=None))
    assert trainer.callback_metrics["train_loss"].item() == 0.0
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
