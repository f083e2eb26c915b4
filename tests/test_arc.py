"""Tests of puzzles/arc.py: hand-made votes with known pass@k, tie breaks, augmentation inversion,
sharded voting, submission files and the evaluator on a dataset built by build_arc."""
import gzip
import json
import os
import pickle

import numpy as np
import pytest

import data
from data import EvalBatches
from puzzles import arc
from puzzles.arc import (
    VOTES_FORMAT,
    ArcEvaluator,
    decode_summary,
    encode_summary,
    grid_key,
    key_grid,
    sigmoid,
    write_submission,
)
from puzzles.build_arc import build_arc
from tests.data_fixtures import ARC_EVALUATION, ARC_EVALUATION_SOLUTIONS, arc_files

# ------------------------------------------------------------------------------------------
# Hand-made tasks and predictions
# ------------------------------------------------------------------------------------------

G = lambda rows: np.array(rows, dtype=np.uint8)  # noqa: E731

TEST_PUZZLES = {
    # Two test inputs: the first is solved at rank 1, the second at rank 2.
    "A": {"train": [], "test": [{"input": [[1, 2, 3]], "output": [[3, 2, 1]]},
                                {"input": [[4], [5]], "output": [[5, 4], [4, 5]]}]},
    # Votes tie 2:2; mean sigmoid(q_halt) puts a wrong grid first, the solution second.
    "B": {"train": [], "test": [{"input": [[6, 0], [0, 7]], "output": [[7, 0], [0, 6]]}]},
    # Three wrong grids with 2 votes each beat the solution's single vote: rank 4.
    "C": {"train": [], "test": [{"input": [[8]], "output": [[8, 8]]}]},
    # No predictions at all.
    "D": {"train": [], "test": [{"input": [[9, 9]], "output": [[1]]}]},
}
COLOUR_MAPS = [np.arange(10), np.array([0, 3, 1, 2, 9, 8, 7, 6, 5, 4]),
               np.array([0, 9, 8, 7, 6, 5, 4, 3, 2, 1])]
AUGMENTATIONS = [(0, COLOUR_MAPS[0]), (1, COLOUR_MAPS[1]), (6, COLOUR_MAPS[2]),
                 (7, COLOUR_MAPS[1]), (3, COLOUR_MAPS[2])]


def identifier_names():
    names = ["<blank>"]
    for task in TEST_PUZZLES:
        for transform_id, colours in AUGMENTATIONS:
            names.append(task if transform_id == 0 and (colours == np.arange(10)).all()
                         else arc.arc_identifier(task, transform_id, colours))
    return names


IDENTIFIERS = identifier_names()


def make_row(task, test_index, aug_index, predicted, logit):
    """One evaluation row: the augmented test input and an augmented predicted grid."""
    transform_id, colours = AUGMENTATIONS[aug_index]
    name = IDENTIFIERS[1 + list(TEST_PUZZLES).index(task) * len(AUGMENTATIONS) + aug_index]
    assert arc.parse_arc_identifier(name)[0] == task
    test_input = G(TEST_PUZZLES[task]["test"][test_index]["input"])
    inputs, preds = arc.encode_arc_pair(arc.augment_arc_grid(test_input, transform_id, colours),
                                        arc.augment_arc_grid(G(predicted), transform_id, colours))
    return IDENTIFIERS.index(name), inputs, preds, logit


WRONG = [[[1]], [[2, 2]], [[3], [3]], [[4, 5, 6]]]


def hand_made_rows():
    A0, A1 = TEST_PUZZLES["A"]["test"][0]["output"], TEST_PUZZLES["A"]["test"][1]["output"]
    B0, C0 = TEST_PUZZLES["B"]["test"][0]["output"], TEST_PUZZLES["C"]["test"][0]["output"]
    return [
        # A, test 0: solution 3 votes, a wrong grid 2 votes with higher q -> rank 1.
        make_row("A", 0, 0, A0, -1.0), make_row("A", 0, 1, A0, -2.0), make_row("A", 0, 2, A0, 0.0),
        make_row("A", 0, 3, WRONG[0], 5.0), make_row("A", 0, 4, WRONG[0], 5.0),
        # A, test 1: a wrong grid 3 votes, the solution 2 -> rank 2.
        make_row("A", 1, 0, WRONG[1], 0.0), make_row("A", 1, 1, WRONG[1], 0.0),
        make_row("A", 1, 2, WRONG[1], 0.0), make_row("A", 1, 3, A1, 9.0),
        make_row("A", 1, 4, A1, 9.0),
        # B: 2 votes each; mean sigmoid 0.5 (solution, logits +-4) < sigmoid(0.2) (wrong),
        # and a third grid with one vote of high q.
        make_row("B", 0, 0, B0, 4.0), make_row("B", 0, 1, B0, -4.0),
        make_row("B", 0, 2, WRONG[2], 0.2), make_row("B", 0, 3, WRONG[2], 0.2),
        make_row("B", 0, 4, WRONG[3], 8.0),
        # C: three wrong grids with 2 votes each, the solution 1 vote (highest q) -> rank 4.
        make_row("C", 0, 0, WRONG[0], 0.0), make_row("C", 0, 1, WRONG[0], 0.0),
        make_row("C", 0, 2, WRONG[1], 0.0), make_row("C", 0, 3, WRONG[1], 0.0),
        make_row("C", 0, 4, WRONG[2], 0.0), make_row("C", 0, 0, WRONG[2], 0.0),
        make_row("C", 0, 1, C0, 10.0),
    ]


def as_batches(rows, batch_size, rng=None):
    """Batches of ``rows`` (order shuffled by ``rng``), the last padded with junk invalid rows."""
    order = np.arange(len(rows)) if rng is None else rng.permutation(len(rows))
    for start in range(0, len(rows), batch_size):
        chunk = [rows[i] for i in order[start:start + batch_size]]
        padding = batch_size - len(chunk)
        ids = np.array([r[0] for r in chunk] + [1] * padding, np.int32)  # junk ids on pad rows
        inputs = np.stack([r[1] for r in chunk] + [chunk[0][1]] * padding).astype(np.int32)
        preds = np.stack([r[2] for r in chunk] + [chunk[0][2]] * padding).astype(np.int32)
        logits = np.array([r[3] for r in chunk] + [100.0] * padding, np.float32)
        valid = np.arange(batch_size) < len(chunk)
        yield {"inputs": inputs, "puzzle_identifiers": ids}, preds, logits, valid


def evaluate(rows, hosts=1, batch_size=4, seed=None):
    """Votes of ``rows`` split round-robin over ``hosts`` evaluators, merged."""
    rng = None if seed is None else np.random.default_rng(seed)
    summaries = []
    for host in range(hosts):
        evaluator = ArcEvaluator(IDENTIFIERS, TEST_PUZZLES)
        evaluator.begin()
        for batch, preds, logits, valid in as_batches(rows[host::hosts], batch_size, rng):
            evaluator.update(batch, preds, logits, valid)
        summaries.append(pickle.loads(pickle.dumps(evaluator.summary())))  # as if sent
    return evaluator, ArcEvaluator.merge(summaries)


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------

def test_hand_made_pass_at_k():
    evaluator, merged = evaluate(hand_made_rows())
    # Per task (A has two test inputs):  pass@1  pass@2  pass@5  pass@10
    #   A: test 0 rank 1, test 1 rank 2     1/2     1       1       1
    #   B: rank 2                           0       1       1       1
    #   C: rank 4                           0       0       1       1
    #   D: no votes                         0       0       0       0
    expected = {"pass@1": 0.5 / 4, "pass@2": 2 / 4, "pass@5": 3 / 4, "pass@10": 3 / 4}
    assert evaluator.result(merged) == pytest.approx(expected, abs=1e-12)
    assert evaluator.result(merged, ks=(3, 4)) == pytest.approx({"pass@3": 0.5, "pass@4": 0.75})
    assert evaluator.stats(merged) == {"voted_rows": 22, "unmatched_rows": 0, "candidates": 11,
                                       "unvoted_test_inputs": 1}


def test_hand_made_votes_and_tie_break():
    evaluator, merged = evaluate(hand_made_rows())
    votes = merged["votes"]
    b_pool = votes[("B", grid_key(G(TEST_PUZZLES["B"]["test"][0]["input"])))]
    solution = grid_key(G(TEST_PUZZLES["B"]["test"][0]["output"]))
    assert b_pool[solution][0] == 2
    assert b_pool[solution][1] / 2 ** 64 == pytest.approx(1.0)  # sigmoid(4) + sigmoid(-4)
    ranked = ArcEvaluator.ranked(b_pool)
    assert [key_grid(k).tolist() for k in ranked] == [WRONG[2], TEST_PUZZLES["B"]["test"][0]
                                                      ["output"], WRONG[3]]
    c_pool = votes[("C", grid_key(G([[8]])))]
    assert [c_pool[k][0] for k in ArcEvaluator.ranked(c_pool)] == [2, 2, 2, 1]


def test_exact_ties_are_broken_by_grid_bytes():
    rows = [make_row("C", 0, 1, [[5]], 1.0), make_row("C", 0, 2, [[4]], 1.0)]
    for order in (rows, rows[::-1]):
        evaluator, merged = evaluate(order)
        assert evaluator.submission(merged)["C"] == [{"attempt_1": [[4]], "attempt_2": [[5]]}]


def test_submission_format():
    evaluator, merged = evaluate(hand_made_rows())
    submission = evaluator.submission(merged)
    assert list(submission) == list(TEST_PUZZLES)
    assert submission["A"] == [{"attempt_1": [[3, 2, 1]], "attempt_2": [[1]]},
                               {"attempt_1": [[2, 2]], "attempt_2": [[5, 4], [4, 5]]}]
    assert submission["B"] == [{"attempt_1": [[3], [3]], "attempt_2": [[7, 0], [0, 6]]}]
    assert submission["D"] == [{"attempt_1": [[0]], "attempt_2": [[0]]}]  # no votes
    # One candidate: the second attempt repeats it.
    one, merged_one = evaluate([make_row("C", 0, 3, [[8, 8]], 0.0)])
    assert one.submission(merged_one)["C"] == [{"attempt_1": [[8, 8]], "attempt_2": [[8, 8]]}]
    assert one.submission(merged_one, attempts=3)["C"][0]["attempt_3"] == [[8, 8]]
    json.dumps(submission)  # plain JSON types


@pytest.mark.parametrize("transform_id", range(8))
def test_inversion_round_trips(transform_id):
    rng = np.random.default_rng(transform_id)
    grid = rng.integers(0, 10, size=(3, 5)).astype(np.uint8)  # not square: catches transposes
    colours = rng.permutation(10)
    augmented = arc.augment_arc_grid(grid, transform_id, colours)
    np.testing.assert_array_equal(arc.invert_arc_augmentation(augmented, transform_id, colours),
                                  grid)
    # Through the evaluator: encode on the canvas, crop, invert.
    name = arc.arc_identifier("T", transform_id, colours)
    evaluator = ArcEvaluator(["<blank>", name], {})
    _, sequence = arc.encode_arc_pair(augmented, augmented)
    task, original = evaluator.original_grid(sequence, 1)
    assert task == "T"
    np.testing.assert_array_equal(original, grid)


def test_crop_stops_at_pad_and_end_of_grid():
    evaluator = ArcEvaluator(["<blank>", "T"], {})
    canvas = np.zeros((30, 30), np.int32)
    canvas[:3, :4] = 2 + np.arange(12).reshape(3, 4) % 10
    canvas[1, 3] = arc.ARC_EOS  # shrinks the width from row 1 on: 3x3 beats 1x4
    _, grid = evaluator.original_grid(canvas.ravel(), 1)
    np.testing.assert_array_equal(grid, (np.arange(12).reshape(3, 4) % 10)[:3, :3])
    _, empty = evaluator.original_grid(np.zeros(900, np.int32), 1)
    assert empty.shape == (0, 0)


@pytest.mark.parametrize("hosts", [2, 4])
def test_sharded_voting_matches_one_host(hosts):
    rows = hand_made_rows()
    single_eval, single = evaluate(rows)
    evaluator, merged = evaluate(rows, hosts=hosts, batch_size=3, seed=hosts)
    assert merged == single
    assert evaluator.result(merged) == single_eval.result(single)
    assert evaluator.submission(merged) == single_eval.submission(single)
    assert ArcEvaluator.merge([merged]) == merged


def test_skipped_unmatched_and_reset():
    rows = hand_made_rows()[:3]
    evaluator = ArcEvaluator(IDENTIFIERS, TEST_PUZZLES)
    batch, preds, logits, valid = next(as_batches(rows, 6))
    batch["puzzle_identifiers"][3] = 0  # blank identifier, marked valid: skipped
    valid[3] = True
    # A row of task A whose input is no test input of A: counted as unmatched.
    row = make_row("A", 0, 1, [[1]], 0.0)
    batch["inputs"][4] = arc.encode_arc_pair(G([[1, 1]]), G([[1]]))[0]
    batch["puzzle_identifiers"][4] = row[0]
    valid[4] = True
    evaluator.update(batch, preds, logits, valid)
    stats = evaluator.stats(evaluator.summary())
    assert (stats["voted_rows"], stats["unmatched_rows"]) == (3, 1)
    evaluator.begin()
    assert evaluator.summary()["voted_rows"] == 0
    accumulating = ArcEvaluator(IDENTIFIERS, TEST_PUZZLES, accumulate=True)
    for _ in range(2):
        accumulating.begin()
        accumulating.update(*next(as_batches(rows, 4)))
    assert accumulating.summary()["voted_rows"] == 6
    accumulating.reset()
    assert accumulating.summary()["voted_rows"] == 0
    with pytest.raises(ValueError, match="outside identifiers.json"):
        batch["puzzle_identifiers"][0] = len(IDENTIFIERS)
        evaluator.update(batch, preds, logits, valid)


def test_a_nan_q_halt_still_votes_with_no_confidence():
    # A diverged model's q_halt logit can be NaN (or infinite): the evaluation goes on, the vote
    # counts and a NaN adds no confidence.
    rows = [make_row("C", 0, 1, [[5]], float("nan")), make_row("C", 0, 2, [[5]], 2.0),
            make_row("C", 0, 3, [[4]], float("inf"))]
    evaluator, merged = evaluate(rows)
    pool = merged["votes"][("C", grid_key(G([[8]])))]
    assert pool[grid_key(G([[5]]))] == [2, int(sigmoid(np.array([2.0]))[0] * 2 ** 64)]
    assert pool[grid_key(G([[4]]))] == [1, 2 ** 64]
    assert [key_grid(k).tolist() for k in ArcEvaluator.ranked(pool)] == [[[5]], [[4]]]


def test_sigmoid_is_stable():
    np.testing.assert_allclose(sigmoid(np.array([-1000.0, 0.0, 1000.0])), [0.0, 0.5, 1.0])
    np.testing.assert_allclose(sigmoid(np.array([2.0])), 1 / (1 + np.exp(-2.0)))


def test_built_dataset_end_to_end(tmp_path):
    """On a dataset from build_arc, perfect predictions (the labels) pass everything,
    and the submission written through write_submission holds the solutions."""
    out = str(tmp_path / "arc")
    build_arc(out, arc_files(str(tmp_path)), subsets=("training", "evaluation"),
                         test_sets=("evaluation",), num_aug=4, seed=1)
    evaluator = ArcEvaluator.from_dataset(out)
    test = data.open_dataset(out, "test")
    summaries = []
    for host in range(2):
        evaluator.begin()
        batches = EvalBatches(test, global_batch_size=4, process_index=host, process_count=2)
        for i in range(len(batches)):
            batch = batches.batch(i)
            preds = np.where(batch["labels"] < 0, 0, batch["labels"])
            evaluator.update(batch, preds, np.zeros(len(preds)), batches.valid(i))
        summaries.append(evaluator.summary())
    merged = ArcEvaluator.merge(summaries)
    assert evaluator.result(merged) == {"pass@1": 1.0, "pass@2": 1.0, "pass@5": 1.0,
                                        "pass@10": 1.0}
    assert evaluator.stats(merged)["voted_rows"] == test.num_examples
    assert evaluator.stats(merged)["unmatched_rows"] == 0
    path = write_submission(str(tmp_path / "eval" / "step_7"), evaluator.submission(merged))
    assert path.endswith(os.path.join("step_7", "submission.json"))
    with open(path) as f:
        submission = json.load(f)
    assert list(submission) == list(ARC_EVALUATION)
    assert [e["attempt_1"] for e in submission["task_e"]] == ARC_EVALUATION_SOLUTIONS["task_e"]
    with pytest.raises(data.DatasetError, match="test_puzzles.json"):
        os.remove(os.path.join(out, "test_puzzles.json"))
        ArcEvaluator.from_dataset(out)


# ------------------------------------------------------------------------------------------
# Aggregation over evaluations, and the saved votes
# ------------------------------------------------------------------------------------------

def test_votes_of_two_evaluations_merge_into_one_evaluation_of_both():
    """The reference's aggregated voting: two evaluations (say two EMA snapshots, whose rows
    differ) voted together score as one evaluation that saw every row of both, also when
    each is saved and read back; each snapshot alone scores differently."""
    rows = hand_made_rows()
    first, second = rows[::2], rows[1::2]
    _, votes_first = evaluate(first)
    _, votes_second = evaluate(second, hosts=2, seed=1)
    evaluator, votes_both = evaluate(rows)
    aggregated = ArcEvaluator.merge([votes_first, votes_second])
    assert aggregated == votes_both
    assert evaluator.result(aggregated) == evaluator.result(votes_both)
    assert evaluator.submission(aggregated) == evaluator.submission(votes_both)
    for alone in (votes_first, votes_second):
        assert evaluator.result(alone) != evaluator.result(aggregated)
    # Through the saved form, in either order.
    saved = [encode_summary(votes_first), encode_summary(votes_second)]
    assert ArcEvaluator.merge(decode_summary(b) for b in saved[::-1]) == votes_both
    assert ArcEvaluator.merge([decode_summary(saved[0])]) == votes_first


def test_saved_votes_round_trip_exactly():
    rng = np.random.default_rng(0)
    every_byte = bytes(range(256))  # keys are raw bytes, NUL and 0xff included
    summary = {"votes": {("task \u00e9\"/", every_byte): {b"": [1, 0], b"\x00\x01": [3, 2 ** 200 + 1],
                                                          every_byte[::-1]: [7, 3 * 2 ** 64 - 1]},
                         ("B", b"\x01\x01\x05"): {bytes(rng.integers(0, 256, 902, dtype=np.uint8)):
                                                   [10 ** 6, 10 ** 6 * 2 ** 64]}},
               "voted_rows": 10 ** 6 + 11, "unmatched_rows": 5}
    payload = encode_summary(summary)
    decoded = decode_summary(payload)
    assert decoded == summary
    assert type(decoded["votes"][("B", b"\x01\x01\x05")].popitem()[1][1]) is int
    assert encode_summary(decode_summary(payload)) == payload
    # Insertion order (which depends on batch order and hosts) does not change the bytes.
    reordered = {"votes": {pool: dict(reversed(list(candidates.items())))
                           for pool, candidates in reversed(list(summary["votes"].items()))},
                 "voted_rows": summary["voted_rows"], "unmatched_rows": summary["unmatched_rows"]}
    assert encode_summary(reordered) == payload
    empty = {"votes": {}, "voted_rows": 0, "unmatched_rows": 0}
    assert decode_summary(encode_summary(empty)) == empty
    # Real votes: the evaluator's summary survives too.
    _, merged = evaluate(hand_made_rows())
    assert decode_summary(encode_summary(merged)) == merged


def test_unreadable_votes_name_the_file():
    with pytest.raises(ValueError,
                       match="gs://b/eval/step_3/arc_votes.json.gz is not a readable ARC votes file"):
        decode_summary(b"not gzip", "gs://b/eval/step_3/arc_votes.json.gz")
    with pytest.raises(ValueError, match="format 'other'"):
        decode_summary(gzip.compress(json.dumps({"format": "other"}).encode()))
    bad_q = {"format": VOTES_FORMAT, "voted_rows": 1, "unmatched_rows": 0,
             "pools": [["A", "0101", [["0101", 1, 1.5]]]]}  # a float q_sum would have lost bits
    with pytest.raises(ValueError, match="q_sum 1.5"):
        decode_summary(gzip.compress(json.dumps(bad_q).encode()))
