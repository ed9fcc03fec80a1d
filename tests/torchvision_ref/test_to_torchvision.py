"""``batch.to_torchvision()`` against the real torchvision: its boxes are
``tv_tensors.BoundingBoxes``, so a v2 transform applied afterwards moves them with the
image (plain tensors would stay where they were).  The stand-in cases (torchvision
missing or failing to load) are in tests/test_first_contact_detection.py.
"""
from __future__ import annotations

import numpy as np

from tv_reference import torch, tv_tensors, v2

from echo_native.boxes import Objects


def _objects():
    return Objects(np.float32([[[2, 4, 10, 20], [0, 0, 0, 0]]]), np.int64([[1, 0]]),
                   np.array([[True, False]]), np.array([[False, False]]),
                   canvas_size=(24, 32))


def test_boxes_are_bounding_boxes_on_the_batch_canvas():
    target = _objects().to_torchvision()[0]
    boxes = target["boxes"]
    assert isinstance(boxes, tv_tensors.BoundingBoxes)
    assert boxes.format == tv_tensors.BoundingBoxFormat.XYXY
    assert tuple(boxes.canvas_size) == (24, 32)
    assert boxes.tolist() == [[2.0, 4.0, 10.0, 20.0]]      # the valid box only
    assert target["labels"].tolist() == [1]


def test_a_v2_flip_after_to_torchvision_moves_the_boxes_with_the_image():
    target = _objects().to_torchvision()[0]
    image = torch.zeros(3, 24, 32, dtype=torch.uint8)
    image[:, 4:20, 2:10] = 255
    flipped, boxes = v2.RandomHorizontalFlip(p=1.0)(image, target["boxes"])
    assert boxes.tolist() == [[22.0, 4.0, 30.0, 20.0]]
    # the box still frames the object the image's flip moved
    assert bool((flipped[:, 4:20, 22:30] == 255).all())
