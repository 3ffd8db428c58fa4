"""Caffe2's own tutorial code runs with only its imports changed (issue 35 item 3): the arguments Caffe2
accepted on any op and ignored (`run_once=0` on fills, cuDNN flags, ...) are accepted and ignored,
listed in one place (core.schema.IGNORED_ARGS) and in docs/caffe2_migration.md."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from graphpar import core, workspace
from graphpar.core.schema import IGNORED_ARGS

MIGRATION = Path(__file__).resolve().parents[2] / "docs" / "caffe2_migration.md"


def test_the_toy_regression_tutorial_learns_the_true_weights() -> None:
    """Caffe2's "Toy Regression" tutorial as written (fills with run_once=0, ops called on blob
    references, hand-written SGD): W and B approach the generating [2.0, 1.5] and 0.5."""
    init_net = core.Net("init")
    W = init_net.UniformFill([], "W", shape=[1, 2], min=-1., max=1.)  # noqa: N806 - the tutorial's names
    B = init_net.ConstantFill([], "B", shape=[1], value=0.0)  # noqa: N806
    W_gt = init_net.GivenTensorFill([], "W_gt", shape=[1, 2], values=[2.0, 1.5])  # noqa: N806
    B_gt = init_net.GivenTensorFill([], "B_gt", shape=[1], values=[0.5])  # noqa: N806
    ONE = init_net.ConstantFill([], "ONE", shape=[1], value=1.)  # noqa: N806
    ITER = init_net.ConstantFill([], "ITER", shape=[1], value=0, dtype=core.DataType.INT64)  # noqa: N806

    train_net = core.Net("train")
    X = train_net.GaussianFill([], "X", shape=[64, 2], mean=0.0, std=1.0, run_once=0)  # noqa: N806
    Y_gt = X.FC([W_gt, B_gt], "Y_gt")  # noqa: N806
    noise = train_net.GaussianFill([], "noise", shape=[64, 1], mean=0.0, std=1.0, run_once=0)
    Y_noise = Y_gt.Add(noise, "Y_noise")  # noqa: N806
    Y_noise = Y_noise.StopGradient([], "Y_noise")  # noqa: N806
    Y_pred = X.FC([W, B], "Y_pred")  # noqa: N806
    dist = train_net.SquaredL2Distance([Y_noise, Y_pred], "dist")
    loss = dist.AveragedLoss([], ["loss"])
    gradient_map = train_net.AddGradientOperators([loss])
    train_net.Iter(ITER, ITER)
    LR = train_net.LearningRate(ITER, "LR", base_lr=-0.1, policy="step", stepsize=20, gamma=0.9)  # noqa: N806
    train_net.WeightedSum([W, ONE, gradient_map[W], LR], W)
    train_net.WeightedSum([B, ONE, gradient_map[B], LR], B)

    workspace.RunNetOnce(init_net)
    workspace.CreateNet(train_net)
    for _ in range(100):
        workspace.RunNet(train_net.Proto().name)
    assert int(workspace.FetchBlob("ITER")[0]) == 100
    np.testing.assert_allclose(workspace.FetchBlob("W"), [[2.0, 1.5]], atol=0.1)
    np.testing.assert_allclose(workspace.FetchBlob("B"), [0.5], atol=0.1)


def test_the_ignored_arguments_change_nothing_and_others_are_still_refused() -> None:
    plain, flagged = core.Net("plain"), core.Net("flagged")
    plain.GaussianFill([], "x", shape=[3, 2], mean=1.0, std=2.0)
    flagged.GaussianFill([], "x", shape=[3, 2], mean=1.0, std=2.0, **dict.fromkeys(IGNORED_ARGS, 0))
    results = []
    for net in (plain, flagged):
        workspace.ResetWorkspace()
        workspace.SetSeed(3)
        workspace.RunNetOnce(net)
        results.append(workspace.FetchBlob("x"))
    np.testing.assert_array_equal(results[0], results[1])
    with pytest.raises(TypeError, match="GaussianFill in net 'typo': unknown argument 'run_twice'"):
        core.Net("typo").GaussianFill([], "x", shape=[1], run_twice=0)


def test_the_migration_guide_lists_every_ignored_argument() -> None:
    section = re.search(r"\*\*Arguments Caffe2 ignored\*\*([^\n]*)", MIGRATION.read_text())  # a table row
    assert section, "docs/caffe2_migration.md: no 'Arguments Caffe2 ignored' row"
    assert set(re.findall(r"`([a-z][a-z0-9_]*)`", section.group(1))) == set(IGNORED_ARGS)
