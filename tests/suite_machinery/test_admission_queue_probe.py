"""A probe behind a queue that ran ahead of it is told apart (queue_probe.QueuedProbe.served_ahead), on the
figures of a make-test-grid run where one did (docs/notes/2026-12-07-admission-power.md)."""

from pytest_kvoffload.serve.client import RequestResult
from pytest_kvoffload.suite_machinery.admission.queue_probe import LEAD_S, QueuedProbe


def queued(probe_s: float, background_s: float) -> QueuedProbe:
    return QueuedProbe(RequestResult(417, probe_s, probe_s), RequestResult(1260, background_s, background_s), {}, {})


# (probe, background) client TTFTs, seconds: the run's 20 probes (hit and cold, two servers), of which
# the guarded server's fifth cold probe reached the engine before its background and ran alone.
ROUNDS = [(1.680, 1.696), (2.181, 1.756), (1.996, 2.062), (2.376, 1.998), (1.875, 2.076), (2.239, 1.866),
          (1.684, 1.688), (1.895, 1.628), (1.486, 1.494), (1.897, 1.562), (2.700, 2.690), (2.320, 1.879),
          (2.043, 2.044), (2.263, 1.963), (1.828, 1.838), (2.440, 1.897), (1.562, 1.668), (1.806, 1.505),
          (1.844, 1.842), (0.509, 2.589)]


def test_a_probe_served_before_its_background_is_told_apart():
    ahead = [i for i, (p, b) in enumerate(ROUNDS) if queued(p, b).served_ahead]
    assert ahead == [19]


def test_the_near_misses_either_side_of_the_step():
    # Behind the queue, first tokens in one step: the background may trail by a few hundredths.
    assert not queued(1.5, 1.5 + LEAD_S + 0.1).served_ahead
    # Ahead of it: the background trails by most of its own prefill, here just over half its time.
    assert queued(1.0, 2.0 + 2 * LEAD_S + 0.3).served_ahead
    # Just under half: still within the step that ends the background's prefill.
    assert not queued(1.2, 2.0 + LEAD_S).served_ahead
