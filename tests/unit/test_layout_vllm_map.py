"""``layout.vllm_map``'s probe without an engine: a weight loader replayed into integer
probes yields the box of the HF tensor and the region of the parameter it lands in, and
a loader that does anything but copy a box as it lies is refused. (The recording over a
real model's ``load_weights`` runs in the vLLM integration tests.)"""

from __future__ import annotations

import inspect

import pytest
import torch

from tensorhub_cli.layout.boxes import Box
from tensorhub_cli.layout.engine_map import _probe
from tensorhub_cli.layout.vllm_map import EngineMap, LayerPlan, ParamPlan, _Call


def call_for(loader, shape, *extra):
    meta = torch.nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
    bound = inspect.signature(loader).bind(meta, None, *extra)
    return _Call("w", "layer", "weight", meta, loader, bound, True)


def rows_of_rank(rank, world):
    def loader(param, loaded_weight, shard=None):
        n = loaded_weight.shape[0] // world
        at = {None: 0, "k": param.shape[0] - 2 * n, "v": param.shape[0] - n}[shard]
        param.data[at:at + n].copy_(loaded_weight.narrow(0, rank * n, n))
    return loader


def test_a_row_slice_into_a_fused_parameter_is_its_box_and_region():
    # rank 1 of 2 of a [8, 6] tensor, as the "k" part at rows [2:6) of a [10, 6] parameter
    box, region = _probe(call_for(rows_of_rank(1, 2), (10, 6), "k"), (8, 6))
    assert box == Box((4, 0), (4, 6))
    assert region == ((2, 6, False), (0, 6, False))


def test_an_expert_lands_in_its_slice_of_a_stacked_parameter():
    def loader(param, loaded_weight, expert):
        param.data[expert, :, 2:].copy_(loaded_weight[:, 1:5])

    box, region = _probe(call_for(loader, (3, 4, 6), 2), (4, 8))
    assert box == Box((0, 1), (4, 4))
    assert region == ((2, 3, True), (0, 4, False), (2, 6, False))


@pytest.mark.parametrize("how, why", [
    (lambda p, w: p.data.copy_(w.t()), "as it lies"),
    (lambda p, w: p.data.copy_(w.flip(0)), "as it lies"),
    (lambda p, w: p.data.copy_(w * 2), "as it lies"),
    (lambda p, w: p.data[::2].copy_(w[:2]), "one box"),
])
def test_a_loader_that_changes_the_tensor_is_refused(how, why):
    with pytest.raises(ValueError, match=why):
        _probe(call_for(how, (4, 4)), (4, 4))


def test_a_loader_that_writes_nothing_maps_nothing():
    assert _probe(call_for(lambda p, w: None, (4, 4)), (4, 4)) is None


def test_the_shadow_is_one_buffer_and_its_targets_name_the_boxes():
    emap = EngineMap({"l": LayerPlan("l", "copy", {
        "weight": ParamPlan((10, 6), torch.float32, [("w", Box((4, 0), (4, 6)), ((6, 10, False), (0, 6, False)))]),
        "bias": ParamPlan((3,), torch.float32, [("b", Box((0,), (3,)), ((0, 3, False),))])})},
        {"w": ((8, 6), "float32"), "b": ((3,), "float32")}, {}, [])
    shadow = emap.allocate("cpu")
    assert shadow["l:weight"].untyped_storage().data_ptr() == shadow["l:bias"].untyped_storage().data_ptr()
    targets = emap.targets(shadow)
    (slot,) = targets["l:weight"].slots
    assert slot.box == Box((4, 0), (4, 6)) and slot.view.data_ptr() == shadow["l:weight"][6].data_ptr()
    assert emap.shard_bytes == (24 + 3) * 4
    assert emap.check({"w": ((8, 6), "float32"), "b": ((3,), "float32")}) == []
    problems = emap.check({"w": ((4, 6), "float32"), "x": ((1,), "float32")})
    assert len(problems) == 2 and problems[0].startswith("w:") and "b: missing" in problems[1], problems


def test_the_whole_path_drops_vllms_failed_to_load_warning_only_for_buffer_only_layers():
    # vLLM's layerwise reload warns "<Layer>: Failed to load weights" for a layer that
    # loaded nothing; a rotary embedding holds only a computed cache: spurious there.
    import logging

    from tensorhub_cli.adapters.vllm import QuietBufferOnly

    class RotaryEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos_sin_cache", torch.zeros(4), persistent=False)

    model = torch.nn.Sequential(RotaryEmbedding(), torch.nn.Linear(2, 2))
    quiet = QuietBufferOnly(model)

    def record(cls):
        return logging.LogRecord("x", logging.WARNING, "f", 1, QuietBufferOnly.MESSAGE, (cls,), None)

    assert not quiet.filter(record("RotaryEmbedding"))
    assert quiet.filter(record("Linear"))  # (a layer with parameters that loaded nothing: a real warning)
