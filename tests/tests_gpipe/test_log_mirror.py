"""Recording self.log over micro-batches: one value per key, weighted by micro-batch share, moved to the host once."""

import threading
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics

from lightning_gpipe.log_mirror import LogRecorder


def test_values_are_weighted_by_micro_batch_share_and_options_kept() -> None:
    module = L.LightningModule()
    recorder = LogRecorder(module)
    for position, value in enumerate([2.0, 4.0, 8.0]):
        with recorder.capture(position):
            module.log("loss", torch.tensor(value), True, sync_dist=True)  # prog_bar given positionally
            module.log_dict({"count": 1})
    assert "log" not in module.__dict__  # the class's own method is back
    recorder.combine(torch.tensor([0.5, 0.25, 0.25]))
    records = {name: (value, options) for name, value, options in recorder.portable()[0]}
    assert records["loss"][0].item() == pytest.approx(0.5 * 2 + 0.25 * 4 + 0.25 * 8)
    assert records["loss"][1]["prog_bar"] is True
    assert records["loss"][1]["sync_dist"] is True
    assert records["count"][0].item() == pytest.approx(1.0)


def test_unsendable_values_are_refused_with_the_reason() -> None:
    module = L.LightningModule()
    with pytest.raises(TypeError, match=r"self.log\('name', ...\) got a str"), LogRecorder(module).capture(0):
        module.log("name", "text")


def test_logging_moves_values_to_the_host_once_per_step_not_per_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # R10: every self.log call on the last stage copied its value to the host (`.cpu()`), once per micro-batch, which
    # on a GPU waits for the device each time. Count the calls that read a tensor on the host.
    calls: list[str] = []
    for name in ("cpu", "item", "tolist", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: calls.append(_n) or _o(self, *a, **k)
        )
    module = L.LightningModule()
    recorder = LogRecorder(module)
    for position in range(8):
        with recorder.capture(position):
            module.log("loss", torch.tensor(float(position)))
            module.log("other", torch.tensor(1.0))
    recorder.combine(torch.full((8,), 1 / 8))
    assert calls == []
    records, scalars = recorder.portable({"total": torch.tensor(3.0)})
    assert calls == ["cpu"]  # one transfer for the whole step
    assert {name: value.item() for name, value, _options in records} == {"loss": 3.5, "other": 1.0}
    assert scalars["total"].item() == 3.0


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.f1 = torchmetrics.classification.MulticlassF1Score(num_classes=3, average="macro")


def test_a_metric_step_value_is_the_whole_batch_value() -> None:
    # Issue 17.6: the step value of a Metric logged on_step was the last micro-batch's.
    generator = torch.Generator().manual_seed(0)
    preds, target = torch.randint(0, 3, (12,), generator=generator), torch.randint(0, 3, (12,), generator=generator)
    module = _Module()
    module.f1.process_group = threading.Lock()  # as the strategy sets a ProcessGroup: neither can be deep-copied
    recorder = LogRecorder(module)
    for position, (p, t) in enumerate(zip(preds.chunk(4), target.chunk(4), strict=True)):
        with recorder.capture(position):
            module.f1(p, t)
            module.log("f1", module.f1, on_step=True)
    recorder.combine(torch.full((4,), 0.25))
    sent = recorder.portable()[0][0][1]
    whole = torchmetrics.functional.classification.multiclass_f1_score(preds, target, 3, average="macro")
    assert sent.forward_cache.item() == pytest.approx(whole.item())
    assert module.f1.compute().item() == pytest.approx(whole.item())  # the epoch value accumulates as before


class _Validated(L.LightningModule):
    """Logs each batch's mean with ``batch_size=`` the samples it saw: a micro-batch's count under the strategy."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Identity())

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        self.log("val_loss", self.layers(x).mean(), batch_size=len(x))


@pytest.mark.usefixtures("loopback_process_group")
def test_an_epoch_value_logged_with_batch_size_weighs_each_batch_by_all_its_samples() -> None:
    # Each micro-batch's `batch_size=` replaced the previous one, so Lightning's epoch mean weighed every batch by its
    # last micro-batch's count (here 1, for batches of 4, 4 and 2 samples) instead of the batch's: sizes must add up.
    from lightning_gpipe import GPipeStrategy

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10.0).unsqueeze(1)), batch_size=4)
    values = {}
    for name, strategy in {"plain": "auto", "gpipe": GPipeStrategy(pipe_size=1, chunks=4)}.items():
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        (values[name],) = trainer.validate(_Validated(), loader, verbose=False)
    assert values["plain"]["val_loss"] == pytest.approx(4.5)  # (1.5 * 4 + 5.5 * 4 + 8.5 * 2) / 10
    assert values["gpipe"]["val_loss"] == pytest.approx(values["plain"]["val_loss"])
