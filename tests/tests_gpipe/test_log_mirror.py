"""Recording self.log over micro-batches: one value per key, weighted by micro-batch size."""

import lightning as L
import pytest
import torch

from lightning_gpipe.log_mirror import LogRecorder


def test_values_are_weighted_by_micro_batch_share_and_options_kept() -> None:
    module = L.LightningModule()
    recorder = LogRecorder(module)
    for weight, value in [(0.5, 2.0), (0.25, 4.0), (0.25, 8.0)]:
        with recorder.capture(weight):
            module.log("loss", torch.tensor(value), True, sync_dist=True)  # prog_bar given positionally
            module.log_dict({"count": 1})
    assert "log" not in module.__dict__  # the class's own method is back
    records = {name: (value, options) for name, value, options in recorder.portable()}
    assert records["loss"][0].item() == pytest.approx(0.5 * 2 + 0.25 * 4 + 0.25 * 8)
    assert records["loss"][1]["prog_bar"] is True
    assert records["loss"][1]["sync_dist"] is True
    assert records["count"][0].item() == pytest.approx(1.0)


def test_unsendable_values_are_refused_with_the_reason() -> None:
    module = L.LightningModule()
    with pytest.raises(TypeError, match=r"self.log\('name', ...\) got a str"), LogRecorder(module).capture(1.0):
        module.log("name", "text")
