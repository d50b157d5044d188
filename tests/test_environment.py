"""The environment is coherent: torch and torchvision come from one build, and the stack imports."""

import torch


def test_stack_imports_and_torchvision_operator_runs() -> None:
    import lightning
    import timm
    import torchvision

    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 10.0, 10.0], [20.0, 20.0, 30.0, 30.0]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    # A torchvision built against another torch fails here with "operator torchvision::nms does not exist".
    keep = torchvision.ops.nms(boxes, scores, iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
    assert lightning.__version__
    model = timm.create_model("resnet18", pretrained=False, num_classes=3).eval()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)
