"""The check's config rendering: the staged config follows the policy's target, the CPU
stack loads its CPU form, and both are linted (issue 13, item 1)."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as pb

from modelship.errors import ValidationFailed
from modelship.policy import Policy
from modelship.triton.model_config import ModelSpec, TensorSpec, for_target, from_pbtxt, to_pbtxt
from tasks.validate import render_checked_configs

GRAPH = ModelSpec("fraud", inputs=(TensorSpec("x", "float32", (4,)),),
                  outputs=(TensorSpec("y", "float32", (2,)),))
GOLDEN = {"x": np.zeros((12, 4), dtype=np.float32)}


def test_gpu_policy_stages_kind_gpu_and_trial_loads_its_cpu_form() -> None:
    policy = Policy.model_validate({"triton": {
        "target": "gpu", "instance_group": {"count": 2, "gpus": [0]},
        "gpu": {"accelerator": "tensorrt", "tensorrt": {"precision": "FP16"}}}})
    rendered = render_checked_configs(GRAPH, policy, versions=[7], golden=GOLDEN)
    staged = from_pbtxt(to_pbtxt(rendered.staged))  # what the version folder holds
    assert [(g.kind, g.count, list(g.gpus)) for g in staged.instance_group] == [
        (pb.ModelInstanceGroup.KIND_GPU, 2, [0])]
    (trt,) = staged.optimization.execution_accelerators.gpu_execution_accelerator
    assert (trt.name, trt.parameters["precision_mode"]) == ("tensorrt", "FP16")
    assert [w.batch_size for w in staged.model_warmup] == [1, 12]
    assert rendered.cpu == for_target(staged, "cpu") == rendered.for_fleet("cpu")
    assert rendered.for_fleet("gpu") == staged
    assert rendered.cpu.instance_group[0].kind == pb.ModelInstanceGroup.KIND_CPU


def test_cpu_policy_stages_what_the_stack_loads() -> None:
    rendered = render_checked_configs(GRAPH, Policy(), versions=[1], golden=GOLDEN)
    assert rendered.staged == rendered.cpu
    assert not rendered.staged.model_warmup


def test_a_bad_gpu_rendering_fails_the_check_on_the_cpu_stack() -> None:
    # max_batch_size 0 with a golden batch: the GPU config is still rendered and linted.
    graph = ModelSpec("m", inputs=(TensorSpec("x", "float32", (0,)),),
                      outputs=(TensorSpec("y", "float32", (2,)),))
    policy = Policy.model_validate({"triton": {"target": "gpu"}})
    with pytest.raises(ValidationFailed, match="dims-value"):
        render_checked_configs(graph, policy, versions=[1], golden=GOLDEN)
