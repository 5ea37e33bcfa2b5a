"""How a run names the stop request it saved for (``summary.json``'s status)."""

import pytest
from etils import epath

from trainer.training import stopping


class Asked(stopping.NoStopRequests):
    def __init__(self, first):
        self.first = first


@pytest.mark.parametrize(
    "heard_from_peer, here, named",
    [
        # The launcher's signal reached process 1 before the boundary, this one after.
        ("SIGTERM to process 1", "SIGTERM", "SIGTERM"),
        # Only process 1 was asked.
        ("SIGTERM to process 1", None, "SIGTERM to process 1"),
        # Another request reached this process: the stop still came from the peer's.
        ("SIGTERM to process 1", "SIGINT", "SIGTERM to process 1"),
        ("SIGINT", "SIGINT", "SIGINT"),
    ],
)
def test_a_stop_heard_from_a_peer_is_the_jobs_once_it_arrives_here(
    tmp_path, heard_from_peer, here, named
):
    with stopping.Run(epath.Path(tmp_path), Asked(here), lock_timeout_s=0) as run:
        run.stopped_at, run.stopped_by = 4, heard_from_peer
    assert run.stopped_by == named
