"""EqR's convergence-residual selection as a test-time selection beside best-Q, mode@K and pass@K
(issue 55, "EqR's evaluation as test-time settings"; testtime/noisy_trajectories.py): the
residual tracked over the ACT steps on a hand-made batch (closed form), the same scores, picks and
top-k accuracy as EqR's own evaluate() (tests/reference/eqr/evaluators/eval_fn.py, run on CPU
with a model that replays a logits sequence), EqR's breadth (its K rows draw different initial
states) and the settings that allow it without test-time noise."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fleet.plan import ScalingGrid
from model import TRM, Carry
from tests.reference.loading import load_family
from testtime import noisy_trajectories
from testtime import settings as testtime_settings

EQR_DIR = Path(__file__).parent / "reference" / "eqr"


def load_eval_fn():
    """EqR's evaluators/eval_fn.py, imported unchanged with its folder first on sys.path. The
    modules it imports only for type annotations (config.schema, dataset.puzzle_dataset) and the
    two packages not installed here (tqdm: a progress bar that only iterates; omegaconf: used only
    with an eval_dir) are stand-ins; every sys.modules name touched is put back after."""
    class Bar:  # tqdm.tqdm as eval_fn uses it: iterate, close
        def __init__(self, iterable=None, *args, **kwargs):
            self.iterable = iterable

        def __iter__(self):
            return iter(self.iterable)

        def close(self):
            pass

    stand_ins = {"omegaconf": {"OmegaConf": None}, "config": {}, "config.schema": {"PretrainConfig": object},
                 "dataset": {}, "dataset.puzzle_dataset": {"PuzzleDatasetMetadata": object}, "tqdm": {"tqdm": Bar}}
    return load_family(EQR_DIR, "evaluators.eval_fn", stand_ins=stand_ins)[0]


def carry_of(labels: torch.Tensor, steps: int) -> Carry:
    rows = labels.shape[0]
    return Carry(z_H=torch.zeros(rows, 1, 1), z_L=torch.zeros(rows, 1, 1), steps=torch.full((rows,), steps),
                 halted=torch.ones(rows, dtype=torch.bool), current_data={"labels": labels},
                 rng_counter=torch.tensor(0))


def run_selection(t: noisy_trajectories.Trajectories, logits_of_step, labels: torch.Tensor, act_steps: int):
    """What Trainer.eval_step does with trajectories, on CPU eager: residual_step after each of the
    D steps (a stale previous logits at step 1, as the device state holds the last batch's), then
    select at step D. Returns (residual [rows], select's extra sums)."""
    rows, seq = labels.shape
    previous, total = torch.full((rows, seq, logits_of_step(1).shape[-1]), 7.0), torch.full((rows,), 3.0)
    for step in range(1, act_steps + 1):
        logits = logits_of_step(step)
        previous, total = t.residual_step(previous, total, logits, torch.full((rows,), step), act_steps)
    residual = t.residual(total, act_steps)
    _, _, extra = t.select(carry_of(labels, act_steps), {"logits": logits, "q_halt_logits": torch.zeros(rows)},
                           residual)
    return residual, extra


# Hand-made batch: K=3, two puzzles and one padding row, D=4 ACT steps, three positions of a
# vocabulary of 5. Row r's logits at step t are (10 + f_r(t)) on its answer token, 0
# elsewhere, at every position: its answer never changes and ||logits_t - logits_{t-1}||_2 over the
# vocabulary is |f_r(t) - f_r(t-1)| at every position.
ANSWERS = [1, 2, 3,    # puzzle 0 (label 2): only trajectory 1 is right
           0, 4, 4,    # puzzle 1 (label 4): trajectories 1 and 2 are right
           2]          # padding: no labels
F = [[0, 0, 5, 10],    # changes 0, 5, 5: last two 5.0, all three 10/3
     [0, 9, 10, 11],   # 9, 1, 1: last two 1.0, all 11/3
     [0, 0, 0, 3],     # 0, 0, 3: last two 1.5, all 1.0
     [0, 1, 2, 3],     # 1, 1, 1: 1.0 (tied with the next: the lower index wins)
     [0, 1, 2, 3],     # 1, 1, 1: 1.0
     [0, 2, 4, 6],     # 2, 2, 2: 2.0
     [0, 0, 0, 0]]     # padding: 0, never counted
LABELS = torch.tensor([[2] * 3] * 3 + [[4] * 3] * 3 + [[-100] * 3], dtype=torch.int32)


def planted_logits(step: int) -> torch.Tensor:
    logits = torch.zeros(len(ANSWERS), 3, 5)
    for r, a in enumerate(ANSWERS):
        logits[r, :, a] = 10.0 + F[r][step - 1]
    return logits


@pytest.mark.parametrize("window, residuals, conv, top2", [
    # window 2: puzzle 0 picks trajectory 1 (1.0; right), its top-2 {1, 2} half right; puzzle 1 picks
    # trajectory 0 by the tie (wrong), its top-2 {0, 1} half right
    (2, [5.0, 1.0, 1.5, 1.0, 1.0, 2.0, 0.0], 1.0, 1.0),
    # window 0 (EqR: all D - 1 changes): puzzle 0 picks trajectory 2 (1.0; wrong), top-2 {2, 0} none right
    (0, [10 / 3, 11 / 3, 1.0, 1.0, 1.0, 2.0, 0.0], 0.0, 0.5),
    # window 3 = D - 1: all of them, as window 0 (EqR keeps all unless 0 < window < D - 1)
    (3, [10 / 3, 11 / 3, 1.0, 1.0, 1.0, 2.0, 0.0], 0.0, 0.5),
])
def test_convergence_residual_and_pick_on_a_hand_made_batch(window, residuals, conv, top2):
    sums = {}
    for top_k in (1, 2):
        t = noisy_trajectories.Trajectories(3, 0.0, window=window, top_k=top_k)
        residual, extra = run_selection(t, planted_logits, LABELS, act_steps=4)
        torch.testing.assert_close(residual, torch.tensor(residuals), rtol=1e-6, atol=1e-6)
        mode, passed, by_conv, top_k_sum = (float(v) for v in extra)
        # the other selections are unchanged by the residual: mode@K solves puzzle 1 only (answer 4
        # twice), pass@K both
        assert (mode, passed) == (1.0, 2.0)
        assert by_conv == conv
        sums[top_k] = top_k_sum
    assert sums[1] == conv  # top-1 is conv itself
    assert sums[2] == top2
    picks = noisy_trajectories.Trajectories(3, 0.0, window=window).convergence_ranks(torch.tensor(residuals))
    assert picks.argmin(1).tolist() == ([1, 0] if window == 2 else [2, 0])


def test_the_residual_sum_starts_over_at_each_puzzles_step_1():
    """The device state carries the last batch's logits and sum into the next batch's step 1: the
    sum restarts there, and the step-1 change (against the last batch's logits) is never kept."""
    t = noisy_trajectories.Trajectories(2, 0.0, window=0)
    previous, total = torch.full((2, 1, 2), 100.0), torch.full((2,), 50.0)
    steps = [1, 2, 1, 2]  # two batches of two steps
    values = [0.0, 3.0, -4.0, 0.0]
    for step, v in zip(steps, values):
        previous, total = t.residual_step(previous, total, torch.tensor([[[v, 0.0]], [[0.0, v]]]),
                                          torch.full((2,), step), act_steps=2)
    assert total.tolist() == [4.0, 4.0]  # |0 - (-4)|, the second batch's only change


def test_conv_matches_eqrs_own_evaluator_on_the_same_logits():
    """EqR's evaluate() (evaluators/eval_fn.py, unchanged) on a model that replays a random logits
    sequence, G=3 puzzles x B=5 draws repeat_interleave'd, D=6 steps, window 3, top-k 2: its
    scores are our residuals, its top-1 and top-2 choices our ranks, and its reported top-1 and
    top-2 exact accuracies our conv and conv top-k sums over the puzzles."""
    eval_fn = load_eval_fn()
    g, b, d, seq, vocab, window, top_k = 3, 5, 6, 4, 7, 3, 2
    gen = torch.Generator().manual_seed(0)
    sequence = torch.randn(d, g * b, seq, vocab, generator=gen)
    sequence[-1] += 3 * torch.randn(g * b, seq, vocab, generator=gen)  # answers of their own
    answers = sequence[-1].argmax(-1)
    # Labels so that the picks matter (the residual reads no label): puzzle 0's is the answer of its
    # lowest-residual candidate, puzzle 1's of its second lowest, puzzle 2's of its highest.
    residual, _ = run_selection(noisy_trajectories.Trajectories(b, 0.0, window=window), lambda s: sequence[s - 1],
                                torch.zeros(g * b, seq, dtype=torch.int32), d)
    order = residual.view(g, b).argsort(1)
    labels = torch.stack([answers[p * b + order[p, place]] for p, place in enumerate((0, 1, b - 1))]).to(torch.int32)
    batch = {"inputs": torch.ones(g, seq, dtype=torch.int32), "labels": labels,
             "puzzle_identifiers": torch.zeros(g, dtype=torch.int32)}

    class Replay(torch.nn.Module):  # EqR's model as evaluate() calls it: one logits of the sequence per step
        def initial_carry(self, batch):
            return {"step": 0}

        def forward(self, carry, batch, return_keys):
            step = carry["step"]
            logits = sequence[step]
            preds = {"logits": logits, "preds": logits.argmax(-1)}
            return ({"step": step + 1}, torch.zeros(()), {"count": torch.tensor(float(g * b))}, preds,
                    step + 1 == d)

    seen = {}
    update_conv = eval_fn._update_conv

    def capture(state, preds, labels, scores, k):
        seen["scores"] = scores.clone()
        seen["picks"] = [torch.argsort(row)[:k].tolist() for row in scores]  # its line: argsort(row_scores)[:top_k]
        return update_conv(state, preds, labels, scores, k)

    eval_fn._update_conv = capture
    try:
        config = SimpleNamespace(eval_save_outputs=[], convergence_top_k=top_k, convergence_window=window,
                                 eval_dir=None)
        theirs, _ = eval_fn.evaluate(config, SimpleNamespace(model=Replay()), [("all", batch, g)],
                                     SimpleNamespace(sets=["all"]), [], rank=0, world_size=1, cpu_group=None,
                                     different_init=b)
    finally:
        eval_fn._update_conv = update_conv

    rows_labels = labels.repeat_interleave(b, 0)
    sums = {}
    for k in (1, top_k):
        t = noisy_trajectories.Trajectories(b, 0.0, window=window, top_k=k)
        residual, extra = run_selection(t, lambda s: sequence[s - 1], rows_labels, d)
        sums[k] = (float(extra[2]), float(extra[3]))
    torch.testing.assert_close(residual.view(g, b), seen["scores"], rtol=1e-6, atol=0)
    ranks = t.convergence_ranks(residual)
    assert [sorted(range(b), key=lambda j: ranks[p, j].item())[:top_k] for p in range(g)] == seen["picks"]
    assert sums[1][0] == sums[1][1]
    assert sums[1][0] / g == pytest.approx(theirs["convergence_top_k/cumulative_exact_acc_top1"])
    assert sums[top_k][1] / g == pytest.approx(theirs["convergence_top_k/exact_accuracy"])
    # conv solves puzzle 0; top-2 holds one right answer of two in puzzles 0 and 1
    assert (theirs["convergence_top_k/cumulative_exact_acc_top1"], theirs["convergence_top_k/exact_accuracy"]) == \
        pytest.approx((1 / 3, 2 / 6))


def test_eqr_rows_of_one_puzzle_draw_different_initial_states_and_breadth_needs_no_noise():
    """EqR's breadth B is K trajectories: each of a puzzle's K rows draws its own initial z_H and
    z_L (keyed by row), so the K rows differ without test-time noise; `train.py eval` and a
    study's @test-time lines then run K > 1 at noise 0 for an arch that draws (not for trm)."""
    from tests.test_eqr import small_config
    from tests.test_model import random_batch

    config = small_config()
    assert config.scheme.draws
    torch.manual_seed(0)
    m = TRM(config).eval()
    batch = {k: v.repeat_interleave(4, 0) for k, v in random_batch(config, 2, seed=1).items()}
    with torch.no_grad():
        carry, outputs = m(m.initial_carry(batch), batch)
    z = carry.z_H.view(2, 4, -1)
    assert all(not torch.equal(z[p, i], z[p, j]) for p in range(2) for i in range(4) for j in range(i))
    assert not torch.equal(outputs["logits"][0], outputs["logits"][1])

    flags = SimpleNamespace(trajectories="1,4", noise="0", act_steps=None, noise_latent="z_L")
    assert [p.name for p in testtime_settings.settings(flags, 16)] == ["K1-noise0-D16"]
    assert [p.name for p in testtime_settings.settings(flags, 16, breadth_without_noise=True)] == \
        ["K1-noise0-D16", "K4-noise0-D16"]
    grid = ScalingGrid((), (1, 4), (0.0,), None, ("z_L",), 1)
    assert [s.name for s in grid.settings(16)] == ["K1-noise0-D16"]
    assert [s.name for s in grid.settings(16, breadth_without_noise=True)] == ["K1-noise0-D16", "K4-noise0-D16"]
