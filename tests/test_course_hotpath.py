"""Chapter 10's checkers fail where they should, naming the mistake. The solved components are
taken from solutions/10 (their passing, engine included, is the notebook's own test under
nbval); each test breaks one of them the way a learner might."""

import os

import nbformat
import pytest

from minivllm.course import checks
from minivllm.course.checks.hotpath import expected_padding, optimal_padding
from tests.course_helpers import fails

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def solved():
    nb = nbformat.read(os.path.join(ROOT, "solutions", "10_cpu_share_of_a_step.ipynb"), as_version=4)
    scope: dict = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and "grade" not in cell.metadata.get("tags", []):
            exec(cell.source, scope)
    return scope


def test_a_batch_that_never_condenses_fails_naming_the_rows(solved):
    class NoCondense(solved["PersistentBatch"]):
        def condense(self):
            pass

    fails(checks.check_persistent_batch, NoCondense, "Exercise 10.1", "rows 0..")


def test_a_batch_that_forgets_sampled_tokens_on_leaving_its_row_fails(solved):
    class Forgetful(solved["PersistentBatch"]):
        def remove_request(self, req_id):
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.req_ids[row] = None  # the state keeps only the prompt

    fails(checks.check_persistent_batch, Forgetful, "token_ids")


def test_a_batch_that_appends_a_resumed_requests_blocks_fails(solved):
    class Appends(solved["PersistentBatch"]):
        def apply(self, so):
            so.scheduled_cached_reqs.resumed_from_preemption = [
                False for _ in so.scheduled_cached_reqs.resumed_from_preemption]
            super().apply(so)

    fails(checks.check_persistent_batch, Appends, "block_ids")


def test_a_batch_built_on_the_package_input_batch_fails_saying_it_is_hidden(solved):
    class Delegating(solved["PersistentBatch"]):
        def __init__(self, *args):
            from minivllm.worker import input_batch

            input_batch.InputBatch(4, 16, 4, None, False)
            super().__init__(*args)

    with pytest.raises(checks.Delegated, match="InputBatch, the package's own answer"):
        checks.check_persistent_batch(Delegating)


def test_a_graph_runner_that_does_not_pad_slots_fails_naming_the_buffer(solved):
    class StaleSlots(solved["GraphRunner"]):
        def __init__(self, replay, sizes, buffers):
            def replay_with_stale_slots(size):
                buffers["slot_mapping"][:size].clamp_(min=0)  # padding written like real tokens
                return replay(size)
            super().__init__(replay_with_stale_slots, sizes, buffers)

    fails(checks.check_graph_runner, StaleSlots, "Exercise 10.2", "slot_mapping")


def test_a_graph_runner_that_replays_the_unpadded_size_fails(solved):
    class Unpadded(solved["GraphRunner"]):
        def run(self, input_ids, positions, meta):
            self.sizes = sorted(set(self.sizes) | {input_ids.shape[0]})
            return super().run(input_ids, positions, meta)

    fails(checks.check_graph_runner, Unpadded, "replayed size")


def test_powers_of_two_are_not_the_best_capture_sizes():
    def powers_of_two(probs, max_graphs, max_batch):
        sizes = [min(2 ** i, max_batch) for i in range(max_graphs)]
        return sorted(set(sizes[:-1] + [max_batch]))

    fails(checks.check_capture_sizes, powers_of_two, "Exercise 10.3", "the best choice pads")


def test_capture_sizes_that_miss_the_largest_batch_fail():
    fails(checks.check_capture_sizes, lambda probs, g, m: [1], "not a valid choice")


def test_optimal_padding_by_hand():
    probs = {1: 0.5, 2: 0.25, 4: 0.25}
    assert expected_padding([4], probs) == pytest.approx(0.5 * 3 + 0.25 * 2)
    assert optimal_padding(probs, 1, 4) == pytest.approx(2.0)
    assert optimal_padding(probs, 2, 4) == pytest.approx(0.5)  # [1, 4] or [2, 4]
    assert optimal_padding(probs, 3, 4) == pytest.approx(0.0)
