"""The last-token linear probe: logistic regression on the state of a response's last bag position."""

from __future__ import annotations

from halludetect.core.sections import Decay, LearningRate, Section
from halludetect.methods.spec import Method, register


class ProbeParams(Section):
    """Logistic regression on the state of a response's last bag position."""

    lr: LearningRate = 1e-3
    weight_decay: Decay = 0.0


register(
    Method("probe", "Last-token probe", ProbeParams, family="field", build=lambda net, d, p: net.LastTokenProbe(d))
)
