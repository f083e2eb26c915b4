"""Test-time scaling (PTRM, issue 37 and 47): noisy trajectories, depth D, best-Q / mode@K /
pass@K selection, any K, the settings' directories (noisy_trajectories.py, testtime*.py, eval_command.py)."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import data
import train
from commands import predict
from commands.eval_command import evaluate_command
from model import TRM, Carry, TRMConfig, loss_and_metrics
from modeling import counter_hash
from tests.test_model import random_batch, tiny_config
from tests.test_train import PROJECT_DIR, tiny_args
from testtime import batches as testtime_batches
from testtime import noisy_trajectories
from testtime import settings as testtime_settings
from training import halt_steps
from training.config import parse_config


def eval_steps(m: TRM, batch: dict, trajectories=None, steps=None):
    """Trainer.eval_step's math for D ACT steps (the model's halt_max_steps unless given) on CPU
    eager: (metrics, predictions and q_halt of the last step, the extra sums of trajectories)."""
    config = m.config
    m.config = dataclasses.replace(config, halt_max_steps=steps or config.halt_max_steps)
    carry = m.initial_carry(batch)
    extra = []
    d = m.config.halt_max_steps
    try:
        with torch.no_grad():
            for step in range(d):
                carry, outputs = m(carry, batch, perturb=None if trajectories is None else trajectories.perturb)
                scored_carry, scored = carry, outputs
                if trajectories is not None:  # the convergence residual's state, as Trainer.eval_step keeps it
                    if step == 0:
                        previous = torch.zeros_like(outputs["logits"], dtype=torch.float32)
                        total = torch.zeros_like(carry.steps, dtype=torch.float32)
                    previous, total = trajectories.residual_step(previous, total, outputs["logits"], carry.steps, d)
                    scored_carry, scored, extra = trajectories.select(carry, outputs, trajectories.residual(total, d))
                _, metrics = loss_and_metrics(scored_carry, scored, halted_losses=True)
    finally:
        m.config = config
    return metrics, scored["logits"].argmax(-1), scored["q_halt_logits"], extra


def trained_looking_model(config, seed=0):
    torch.manual_seed(seed)
    m = TRM(config).eval()
    with torch.no_grad():
        m.q_head.weight.normal_(std=0.5)  # q_halt varies by row
    return m


def test_one_trajectory_without_noise_is_the_evaluation_bit_for_bit():
    config = tiny_config()
    m, batch = trained_looking_model(config), random_batch(config, 16, seed=1)
    reference = eval_steps(m, batch)
    assert noisy_trajectories.trajectories_of(1, 0.0, seed=3) is None  # eval and training do not route it through ptrm
    # Routed through ptrm anyway, nothing changes.
    metrics, preds, q, _ = eval_steps(m, batch, noisy_trajectories.Trajectories(1, 0.0))
    assert torch.equal(preds, reference[1]) and torch.equal(q, reference[2])
    assert all(torch.equal(metrics[name], reference[0][name]) for name in metrics)
    # K identical trajectories (no noise) choose the first: the answers and counts of K=1; so do
    # K=3 trajectories with two padding rows after the puzzles' 48 (rows that count nowhere).
    for k, padding in ((4, 0), (3, 2)):
        repeated = {name: torch.cat([v.repeat_interleave(k, 0), v[:padding]]) for name, v in batch.items()}
        metrics, preds, q, _ = eval_steps(m, repeated, noisy_trajectories.Trajectories(k, 0.0))
        assert torch.equal(preds[:16 * k:k], reference[1]) and torch.equal(q[:16 * k:k], reference[2])
        for name in ("count", "exact_accuracy", "steps"):
            assert metrics[name] == reference[0][name], (k, name)
        # a float sum over 50 rows (zeros for the padding) rounds in another order than over 16
        torch.testing.assert_close(metrics["accuracy"], reference[0]["accuracy"], rtol=1e-6, atol=0)


def planted(answers: list[int], labels: list[int], rows: int, seq: int = 3, vocab: int = 5):
    """A halted carry and logits whose row r predicts token answers[r] everywhere (padding rows
    past len(answers): no labels)."""
    logits = torch.zeros(rows, seq, vocab)
    for r, a in enumerate(answers):
        logits[r, :, a] = 1.0
    label_rows = torch.full((rows, seq), -100, dtype=torch.int32)
    for r, a in enumerate(labels):
        label_rows[r] = a
    carry = Carry(z_H=torch.zeros(rows, 1, 1), z_L=torch.zeros(rows, 1, 1), steps=torch.full((rows,), 4),
                  halted=torch.ones(rows, dtype=torch.bool), current_data={"labels": label_rows},
                  rng_counter=torch.tensor(0))
    return carry, logits


def test_best_q_mode_and_pass_at_k_on_planted_answers_with_ties_and_padding():
    """K=4 in a batch of 14 rows: 3 puzzles, 2 padding rows. The rows' answers (one token each)
    and q_halt are planted so that best-Q, mode@K and pass@K differ."""
    k = 4
    answers = [0, 1, 1, 2,   # puzzle 0: answer 1 twice (mode), best q on trajectory 0 (answer 0)
               0, 0, 3, 3,   # puzzle 1: two answers twice each, the tie goes to the best q (trajectory 2: 3)
               1, 2, 3, 4,   # puzzle 2: four answers once each, the best q is a tie: the first (answer 1)
               1, 1]         # padding rows: no labels, never counted
    q_halt = torch.tensor([3.0, 0.0, 1.0, 2.0, 0.0, 1.0, 5.0, -1.0, 1.0, 1.0, 0.0, 0.0, 9.0, 9.0])
    labels = [1] * 4 + [0] * 4 + [1] * 4
    t = noisy_trajectories.Trajectories(k, 0.5)
    carry, logits = planted(answers, labels, 14)
    outputs = {"logits": logits, "q_halt_logits": q_halt}
    assert t.best(q_halt).int().argmax(1).tolist() == [0, 2, 0]
    # puzzle 0: of answer 1's two trajectories, the one with the better q (2)
    labelled = carry.current_data["labels"] != -100
    assert t.mode(logits.argmax(-1), q_halt, labelled).int().argmax(1).tolist() == [2, 2, 0]
    picked, selected, (mode_sum, pass_sum, _, _) = t.select(carry, outputs)
    assert picked.halted.tolist() == [True, False, False, False] * 3 + [False, False]
    assert selected["logits"].argmax(-1)[:, 0].tolist() == [0] * 4 + [3] * 4 + [1] * 4 + [0, 0]
    assert selected["q_halt_logits"].tolist() == [3.0] * 4 + [5.0] * 4 + [1.0] * 4 + [0.0, 0.0]
    _, metrics = loss_and_metrics(picked, selected, halted_losses=True)
    # best-Q solves puzzle 2 only; mode@K puzzles 0 and 2; pass@K all three.
    assert (metrics["count"], metrics["exact_accuracy"], mode_sum, pass_sum) == (3, 1, 1 + 1, 3)
    # pass@K is today's any_exact (the oracle, on a batch K divides).
    carry, logits = planted(answers[:12], labels, 12)
    valid = carry.current_data["labels"] != -100
    solved = (valid & (logits.argmax(-1) == carry.current_data["labels"])).sum(-1) == valid.sum(-1)
    any_exact = ((carry.halted & (valid.sum(-1) > 0)) & solved).view(-1, k).any(1).sum().float()
    assert t.select(carry, {"logits": logits, "q_halt_logits": q_halt[:12]})[2][1] == any_exact == 3


def test_mode_at_k_votes_on_the_labelled_cells_only_as_arc_voting_does():
    """ARC: trajectories exact on every labelled cell (the grid and its end-of-grid border) that
    differ only in the padding (labels ignored, untrained predictions) are one answer for mode@K,
    which then picks what ARC's voter (crop to the grid, count votes) ranks first, and agrees with
    pass@K. Before, each padding variant was an answer of its own: mode@4 picked the wrong answer
    (the best q among four single votes) where pass@4 and ARC's voting were right."""
    from puzzles import arc
    k, seq, vocab = 4, arc.ARC_GRID_SIZE ** 2, 12
    grid = np.array([[3, 1], [4, 1], [5, 9]], np.uint8)
    inp, out = arc.encode_arc_pair(grid, grid)
    wrong = out.copy()
    wrong[0] = arc.ARC_FIRST_COLOUR + 7  # a labelled cell wrong
    predictions = np.stack([wrong, out, out, out]).astype(np.int64)
    for r in (1, 2, 3):  # the padding, far from the grid: a different scribble in each
        predictions[r, seq - 10 * r:seq - 10 * r + 5] = arc.ARC_FIRST_COLOUR + r
    logits = torch.nn.functional.one_hot(torch.from_numpy(predictions), vocab).float()
    labels = torch.from_numpy(out.astype(np.int64)).masked_fill(torch.from_numpy(out == arc.ARC_PAD), -100)
    labels = labels.to(torch.int32).expand(k, seq).clone()
    q_halt = torch.tensor([3.0, 0.0, 1.0, 2.0])  # the wrong answer rates highest
    carry = Carry(z_H=torch.zeros(k, 1, 1), z_L=torch.zeros(k, 1, 1), steps=torch.full((k,), 4),
                  halted=torch.ones(k, dtype=torch.bool), current_data={"labels": labels},
                  rng_counter=torch.tensor(0))
    t = noisy_trajectories.Trajectories(k, 0.5)
    _, _, (mode_sum, pass_sum, _, _) = t.select(carry, {"logits": logits, "q_halt_logits": q_halt})
    assert (mode_sum, pass_sum) == (1, 1)
    chosen = t.mode(logits.argmax(-1), q_halt, labels != -100)
    # the three padding variants are one answer of three votes; of them, the best q (trajectory 3)
    assert chosen.tolist() == [[False, False, False, True]]
    # ARC's voting on the same rows: crop each prediction to its grid, one vote per row
    candidates = {}
    for r in range(k):
        key = arc.grid_key(arc.decode_arc_grid(predictions[r]))
        stats = candidates.setdefault(key, [0, 0])
        stats[0] += 1
        stats[1] += int(arc.sigmoid(q_halt[r].numpy()) * arc.Q_SCALE)
    top = arc.ArcEvaluator.ranked(candidates)[0]
    assert top == arc.grid_key(grid) == arc.grid_key(arc.decode_arc_grid(predictions[int(chosen.int().argmax())]))
    assert candidates[top][0] == 3


HRM_RULE = TRMConfig(arch="hrm", no_ACT_continue=False).halt_score
"""hrm's halting rule, read from its registered scheme: q_halt - q_continue."""


def test_archs_that_halt_on_q_continue_rank_by_q_halt_minus_q_continue(monkeypatch):
    """hrm / transformers_baseline halt on q_halt > q_continue: that rule ranks their trajectories
    (selection) and reads the chosen one (halting histogram); TRM ranks by q_halt alone."""
    q_halt = torch.tensor([-1.0, -2.0])
    q_continue = torch.tensor([-0.5, -3.0])  # q_halt - q_continue: -0.5, 1.0
    carry, logits = planted([0, 1], [1, 1], 2)
    outputs = {"logits": logits, "q_halt_logits": q_halt, "q_continue_logits": q_continue}
    by_q_halt = noisy_trajectories.Trajectories(2, 0.5)
    by_rule = noisy_trajectories.Trajectories(2, 0.5, halt_score=HRM_RULE)
    assert by_q_halt.best(by_q_halt.scores(outputs)).tolist() == [[True, False]]
    assert by_rule.best(by_rule.scores(outputs)).tolist() == [[False, True]]
    picked, selected, _ = by_rule.select(carry, outputs)
    assert loss_and_metrics(picked, selected, halted_losses=True)[1]["exact_accuracy"] == 1
    # The halting histogram reads the chosen trajectory's rule: it says halt (-2 > -3) at step 1.
    carry = dataclasses.replace(picked, steps=torch.ones(2, dtype=torch.int32))
    _, counts = halt_steps.first_halt_counts(torch.zeros(2, dtype=torch.int32), carry, selected, 4, HRM_RULE)
    assert counts.tolist() == [1, 0, 0, 0, 0]
    # mode@K ties go to the rule's best trajectory too.
    labelled = carry.current_data["labels"] != -100
    assert by_rule.mode(logits.argmax(-1), by_rule.scores(outputs), labelled).tolist() == [[False, True]]
    # The evaluation takes the rule from the model's config (no_ACT_continue False: hrm's).
    for no_continue, expected in ((True, False), (False, True)):
        got = {}
        trainer = SimpleNamespace(config=SimpleNamespace(optim=SimpleNamespace(global_batch_size=32),
                                                         run=SimpleNamespace(seed=0),
                                                         model=TRMConfig(no_ACT_continue=no_continue)),
                                  sharding=SimpleNamespace(data_split=lambda: (0, 1)),
                                  set_evaluation=lambda t, d, got=got: got.update(t=t, d=d))
        noisy_trajectories.set_evaluation(trainer, testtime_settings.Setting(4, 0.3, 16))
        ranked = got["t"].scores({"q_halt_logits": q_halt, "q_continue_logits": q_continue})
        assert torch.equal(ranked, q_halt - q_continue if expected else q_halt)
        assert got["d"] == 16 and got["t"].host_rows == 32


def test_the_counter_hash_is_int32_and_draws_what_the_int64_hash_drew():
    """model.hashed_uniform and the noise: one int32 hash (modeling/counter_hash.py), whose draws are the
    int64 hashes' of before (values recorded from them). The integer hash and its uniform draws
    are exact on any CPU and asserted bit for bit; the Gaussian noise goes through log, sqrt and cos,
    whose last bit depends on the CPU's libm and vector width (recorded 1.8127593994140625, one ULP
    below what a 2-core Xeon computes), so it is asserted to a few ULPs."""
    u = counter_hash.hashed_uniform(7, torch.tensor(3), torch.arange(4), 0)
    assert u.tolist() == [0.8352841138839722, 0.6832155585289001, 0.6397753953933716, 0.6470803022384644]
    batch = {"inputs": torch.arange(8).view(2, 4) % 5, "puzzle_identifiers": torch.tensor([0, 3])}
    z = torch.zeros(2, 3, 2)
    _, noisy = noisy_trajectories.Trajectories(2, 1.0, seed=7).perturb(z, z, batch, torch.tensor([0, 5]))
    recorded = torch.tensor([[2.41269850730896, 1.8127593994140625], [1.2950316667556763, 0.5719338059425354]])
    torch.testing.assert_close(noisy[:, 0], recorded, rtol=4 * torch.finfo(torch.float32).eps, atol=0)
    assert counter_hash.mix(torch.tensor([1, -7], dtype=torch.int32)).dtype == torch.int32


def test_noise_is_a_function_of_seed_puzzle_trajectory_and_step_on_the_chosen_latent():
    config = tiny_config()
    batch = {k: v.repeat_interleave(4, 0) for k, v in random_batch(config, 6, seed=2).items()}
    z = torch.zeros(24, config.total_len, config.hidden_size)
    steps = torch.zeros(24, dtype=torch.int32)
    t = noisy_trajectories.Trajectories(4, 1.0, seed=7)
    untouched, noise = t.perturb(z, z, batch, steps)
    assert untouched is z  # z_L only, the default
    assert abs(noise.std().item() - 1.0) < 0.02 and abs(noise.mean().item()) < 0.02
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[4])  # trajectories, puzzles
    assert not torch.equal(noise, t.perturb(z, z, batch, steps + 1)[1])
    assert not torch.equal(noise, dataclasses.replace(t, seed=8).perturb(z, z, batch, steps)[1])
    # The same puzzle elsewhere in the batch, or trajectory k at a larger K: the same noise.
    shifted = {k: v.roll(4, 0) for k, v in batch.items()}
    assert torch.equal(t.perturb(z, z, shifted, steps)[1].roll(-4, 0), noise)
    wider = {k: v.view(6, 4, *v.shape[1:])[:, :2].reshape(12, *v.shape[1:]) for k, v in batch.items()}
    assert torch.equal(noisy_trajectories.Trajectories(2, 1.0, seed=7).perturb(z[:12], z[:12], wider, steps[:12])[1],
                       noise.view(6, 4, *noise.shape[1:])[:, :2].reshape(12, *noise.shape[1:]))
    # z_H: its own draw; both: z_L's draw is the default's, z_H's the z_H one's.
    on_h, same = dataclasses.replace(t, latent="z_H").perturb(z, z, batch, steps)
    assert same is z and abs(on_h.std().item() - 1.0) < 0.02 and (on_h * noise).mean().abs() < 0.02
    both = dataclasses.replace(t, latent="both").perturb(z, z, batch, steps)
    assert torch.equal(both[0], on_h) and torch.equal(both[1], noise)


def test_noise_and_selection_on_a_sharded_xla_mesh_equal_cpu_eager(spmd_mesh):
    """K=3 in batches of 32 rows (10 puzzles and 2 padding rows), D = halt_max_steps + 2."""
    import torch_xla.debug.metrics as met

    import sharding

    config = tiny_config()
    m = trained_looking_model(config)
    puzzles = random_batch(config, 10, seed=3)
    batch = {k: torch.cat([v.repeat_interleave(3, 0), v[:2]]) for k, v in puzzles.items()}
    t = noisy_trajectories.Trajectories(3, 0.5, seed=1)
    depth = config.halt_max_steps + 2
    cpu = eval_steps(m, batch, t, depth)
    device = sharding.device()
    xla_model = TRM(config).eval()
    xla_model.load_state_dict(m.state_dict())
    xla_model = xla_model.to(device)
    xla_batch = {k: sharding.shard_batch_dim(v.to(device), spmd_mesh) for k, v in batch.items()}
    met.clear_all()
    xla = eval_steps(xla_model, xla_batch, t, depth)
    import torch_xla
    torch_xla.sync()
    assert not [n for n in met.counter_names() if n.startswith("aten::")]
    assert met.metric_data("TransferFromDeviceTime") is None, "the steps read a device value"
    assert torch.equal(xla[1].cpu(), cpu[1])
    # float32 on both, rounded in other orders over six noisy ACT steps
    torch.testing.assert_close(xla[2].cpu(), cpu[2], rtol=1e-4, atol=1e-4)
    assert xla[0]["exact_accuracy"].cpu() == cpu[0]["exact_accuracy"] and xla[0]["count"].cpu() == 10
    assert [e.cpu() for e in xla[3]] == cpu[3]


def test_trajectory_flags_settings_and_any_k():
    assert testtime_settings.parse_trajectories("1,4,16") == [1, 4, 16]
    assert testtime_settings.parse_noises("0,0.3") == [0.0, 0.3]
    with pytest.raises(SystemExit, match=r"eval.trajectories='1,0' must be .* \(set it with --eval.trajectories\)"):
        parse_config(["demo", "--eval.trajectories", "1,0"])
    with pytest.raises(SystemExit, match=r"eval.noise='-1' must be"):
        parse_config(["demo", "--eval.noise=-1"])
    # Any K up to the batch: 100 at the paper's 768 (7 puzzles a batch), not 129 at 128.
    parse_config(["sudoku-mlp", "--eval.trajectories", "100", "--eval.noise", "0.3", "--eval.act-steps", "64"])
    with pytest.raises(SystemExit, match=r"K=129 exceeds the 128 rows"):
        parse_config(["demo", "--eval.trajectories", "129"])
    with pytest.raises(SystemExit, match=r"eval.act_steps=0 must be"):
        parse_config(["demo", "--eval.act-steps", "0"])
    # Noise 0 runs at K=1 only (issue 47: `4,16 --eval.noise 0,0.3` ran its noise-0 point at K=4).
    config = parse_config(["demo", "--eval.trajectories", "4,16", "--eval.noise", "0,0.3", "--eval.noise-latent",
                           "both"])
    assert [p.name for p in testtime_settings.settings(config.eval, 4)] == ["K1-noise0-D4-both", "K4-noise0.3-D4-both",
                                                                   "K16-noise0.3-D4-both"]
    assert testtime_settings.setting_name(16, 0.3, 64) == "K16-noise0.3-D64"
    assert testtime_settings.setting_dir("gs://b/runs/r", 100, 1.0, 16, "z_H") == "gs://b/runs/r/test-time/K100-noise1-D16-z_H"


def test_k_that_does_not_divide_the_batch_gives_each_puzzle_exactly_k_rows(demo_path):
    """K=100 at the paper's batch of 768 over 8 hosts (96 rows each: no whole puzzle; refused) and
    over 1; K=3 at 32 rows over 2 hosts: every test puzzle has exactly K rows, padding fills."""
    test_set = data.open_dataset(demo_path, "test")
    with pytest.raises(ValueError, match="K=100 exceeds the 96 rows"):
        testtime_batches.eval_batches(test_set, 768, 100, 0, 8)
    for size, k, hosts in ((768, 100, 1), (32, 3, 2), (48, 3, 2)):
        seen = []
        for host in range(hosts):
            batches = testtime_batches.eval_batches(test_set, size, k, host, hosts)
            for i in range(len(batches)):
                rows, valid = batches.batch(i), batches.valid(i)
                assert len(valid) == size // hosts and all(len(v) == size // hosts for v in rows.values())
                puzzles = size // hosts // k
                assert not valid[puzzles * k:].any() and (rows["labels"][puzzles * k:] == -100).all()
                inputs = rows["inputs"][:puzzles * k][valid[:puzzles * k]]
                assert (inputs.reshape(-1, k, inputs.shape[-1]) == inputs[::k, None]).all()
                seen += [tuple(x) for x in inputs[::k]]
        assert sorted(seen) == sorted(tuple(x) for x in test_set.inputs), (size, k, hosts)


ONE_DEVICE_EVAL = """
import json, sys
sys.path.insert(0, {project!r})
import sharding
from testtime import curve
from commands.eval_command import evaluate_command
evaluate_command({args!r})
print("RESULT" + json.dumps({{"curve": curve.saved_settings({run_dir!r}), "xla": sharding.xla_counters()}}))
"""


@pytest.fixture(scope="module")
def k3_run(demo_path, tmp_path_factory):
    """A demo run (float32: the partitioned program rounds differently from the one-device one,
    test_train) whose evaluations run K=3 trajectories at noise 0.5 in batches of 32 rows (10
    puzzles and 2 padding rows): (its directory, train.main's result, the common eval flags)."""
    tmp_path = tmp_path_factory.mktemp("k3")
    steps = ("--optim.max-steps", "30", "--eval.every-epochs", "1000", "--model.forward-dtype", "float32",
             "--eval.trajectories", "3", "--eval.noise", "0.5")
    trained = train.main(parse_config(tiny_args(demo_path, tmp_path, *steps)))
    common = ["--init-from", str(tmp_path / "run"), "--data.path", demo_path, "--data.cache-dir",
              str(tmp_path / "cache")]
    return tmp_path, trained, common


def test_training_evaluations_at_k_are_the_standalone_evaluation_at_that_setting(k3_run):
    """Training's evaluation at K=3, noise 0.5 (the last of the flags) is `train.py eval` at that
    setting, and not the evaluation without trajectories (whose lm_loss differs)."""
    tmp_path, trained, common = k3_run
    final = trained["final"]
    at_k = evaluate_command([*common, "--run.dir", str(tmp_path / "a")])  # the run's own flags: K=3, noise 0.5
    plain = evaluate_command([*common, "--run.dir", str(tmp_path / "b"), "--eval.trajectories", "1",
                              "--eval.noise", "0"])
    assert (at_k["trajectories"], at_k["noise"], plain["trajectories"]) == (3, 0.5, 1)
    for name in ("count", "exact_accuracy", "mode_exact_accuracy", "pass_exact_accuracy", "conv_exact_accuracy",
                 "conv_top_k_exact_accuracy"):
        assert final[name] == at_k[name], name
    assert final["conv_exact_accuracy"] == final["conv_top_k_exact_accuracy"] <= final["pass_exact_accuracy"]
    assert final["lm_loss"] == pytest.approx(at_k["lm_loss"], rel=1e-6)
    assert final["lm_loss"] != pytest.approx(plain["lm_loss"], rel=1e-4)
    assert final["count"] == 40 and final["pass_exact_accuracy"] >= max(final["exact_accuracy"],
                                                                         final["mode_exact_accuracy"])
    assert plain["mode_exact_accuracy"] == plain["pass_exact_accuracy"] == plain["exact_accuracy"]


def test_eval_writes_each_setting_into_the_run_resumably_and_leaves_its_eval_unchanged(k3_run, capsys):
    """`train.py eval --init-from RUN` at K 1,2 and noise 0,0.5: RUN/test-time/K1-noise0-D4,
    K1-noise0.5-D4, K2-noise0.5-D4 (noise 0 at K=1 only), each metrics.json with the settings'
    keys; RUN's own eval/ byte for byte unchanged; a second command skips every done setting."""
    tmp_path, trained, common = k3_run
    run_dir = tmp_path / "run"
    own = {p: p.read_bytes() for p in sorted((run_dir / "eval").rglob("*")) if p.is_file()}
    assert any(p.name == "metrics.json" for p in own)
    args = [*common, "--eval.trajectories", "1,2", "--eval.noise", "0,0.5"]
    result = evaluate_command(args)
    assert {p: p.read_bytes() for p in sorted((run_dir / "eval").rglob("*")) if p.is_file()} == own
    names = ["K1-noise0-D4", "K1-noise0.5-D4", "K2-noise0.5-D4"]
    assert sorted(p.name for p in (run_dir / "test-time").iterdir() if p.is_dir()) == sorted(names)
    saved = [json.loads((run_dir / "test-time" / n / "metrics.json").read_text()) for n in names]
    for row, (k, noise) in zip(saved, ((1, 0.0), (1, 0.5), (2, 0.5))):
        assert {"trajectories": k, "noise": noise, "act_steps": 4, "noise_latent": "z_L", "num_puzzles": 40,
                "step": 30, "act_steps_per_puzzle": k * 4}.items() <= row.items()
        assert row["best_q_exact_accuracy"] == row["exact_accuracy"] and row["token_accuracy"] == row["accuracy"]
        assert row["pass_exact_accuracy"] >= row["exact_accuracy"]
    assert saved[-1] == result
    assert all(r["transfers"] == 1 for r in saved)  # the metrics, read once per setting
    # the plot in the last setting evaluated (its own directory); nothing shared beside the settings
    assert (run_dir / "test-time" / names[-1] / "trajectories.png").read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in (run_dir / "test-time").iterdir() if not p.is_dir()] == []
    from testtime import curve
    assert [curve.name_of(r) for r in curve.saved_settings(str(run_dir))] == names
    capsys.readouterr()
    stamps = {n: (run_dir / "test-time" / n / "metrics.json").stat().st_mtime_ns for n in names}
    assert evaluate_command(args) == result
    assert capsys.readouterr().out.count("skipped") == 3
    assert {n: (run_dir / "test-time" / n / "metrics.json").stat().st_mtime_ns for n in names} == stamps


SETTING_EVAL = """
import sys
sys.path.insert(0, {project!r})
from commands.eval_command import evaluate_command
evaluate_command({args!r})
"""


def test_two_settings_of_one_run_evaluated_at_once_are_both_in_the_curve(k3_run):
    """Two processes evaluate two settings of one run at the same time, as two study holders do:
    the curve (rebuilt from the settings' own metrics.json by whoever reads it: the study report,
    the table `train.py eval` prints) holds both; no shared curve file, which the last writer of
    the two would have written with its own setting only, is written beside the settings."""
    import shutil

    from fleet.testtime_grid import selection_means
    from testtime import curve

    tmp_path, _, common = k3_run
    run_dir = tmp_path / "together"
    shutil.copytree(tmp_path / "run", run_dir, ignore=shutil.ignore_patterns("test-time"))
    flags = [*common[2:], "--init-from", str(run_dir)]
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(SETTING_EVAL.format(
        project=str(PROJECT_DIR), args=[*flags, "--eval.trajectories", k, "--eval.noise", noise]))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k, noise in (("1", "0"), ("2", "0.5"))]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    found = curve.settings_by_name(str(run_dir))  # what the study report reads (report.collect)
    assert sorted(found) == ["K1-noise0-D4", "K2-noise0.5-D4"]
    assert all(selection_means([row]) for row in found.values())
    assert [p.name for p in (run_dir / "test-time").iterdir() if not p.is_dir()] == []
    for name in found:
        assert (run_dir / "test-time" / name / "trajectories.png").exists()


def test_depth_d_is_the_evaluation_at_halt_max_steps_and_goes_on_from_the_carry_beyond(k3_run):
    """--eval.act-steps 4 (the demo's halt_max_steps) is the evaluation without the flag; 6 is the
    EMA model's recursion run 6 ACT steps by hand from the initial state, eagerly."""
    from commands.restore import load_weights_for_eval
    from training.config import PRESETS

    tmp_path, _, common = k3_run
    plain = ["--eval.trajectories", "1", "--eval.noise", "0"]
    default = evaluate_command([*common, *plain, "--run.dir", str(tmp_path / "d")])
    at_4 = evaluate_command([*common, *plain, "--run.dir", str(tmp_path / "d4"), "--eval.act-steps", "4"])
    at_6 = evaluate_command([*common, *plain, "--run.dir", str(tmp_path / "d6"), "--eval.act-steps", "6"])
    assert {k: v for k, v in at_4.items() if k not in ("seconds_per_puzzle", "cpu_seconds_per_puzzle",
                                                        "compile_seconds", "compiles")} == \
        {k: v for k, v in default.items() if k not in ("seconds_per_puzzle", "cpu_seconds_per_puzzle",
                                                        "compile_seconds", "compiles")}
    assert (tmp_path / "d6" / "test-time" / "K1-noise0-D6" / "metrics.json").exists()
    assert sum(at_6[f"halted_at_{s}"] for s in range(1, 7)) + at_6["never_halted"] == pytest.approx(1.0)
    config, weights, _, _ = load_weights_for_eval(common[1], PRESETS["demo"][1], [])
    trm = TRM(config.model).eval()
    trm.load_state_dict({k.removeprefix("model/"): v for k, v in weights.items()})
    test_set = data.open_dataset(common[3], "test")
    inputs, labels = torch.from_numpy(test_set.inputs), torch.from_numpy(test_set.labels).long()
    ids = torch.from_numpy(np.repeat(test_set.puzzle_identifiers, np.diff(test_set.puzzle_indices)))
    by_depth = {}
    with torch.no_grad():
        x = trm.embed(inputs, ids)
        h_init, l_init = config.model.scheme.initial_states(trm)
        shape = (len(inputs), config.model.total_len, config.model.hidden_size)
        z_H, z_L = h_init.expand(shape), l_init.expand(shape)
        for depth in range(1, 7):
            z_H, z_L, logits, _, _ = trm.recurse(z_H, z_L, x)
            right = logits.argmax(-1) == labels
            by_depth[depth] = (right.all(-1).float().mean().item(), right.float().mean(-1).mean().item())
    assert by_depth[4] != by_depth[6]
    for result, depth in ((default, 4), (at_6, 6)):
        # float32 eager against the 8-device program: rounding may flip a token, not more
        assert result["exact_accuracy"] == pytest.approx(by_depth[depth][0], abs=1 / 40 + 1e-9)
        assert result["accuracy"] == pytest.approx(by_depth[depth][1], abs=1 / 640 + 1e-6)


def test_a_k_that_does_not_divide_the_batch_answers_as_a_dividing_batch_in_eval_on_1_and_8_devices_and_predict(
        k3_run):
    """K=3 at batches of 32 rows (10 puzzles, 2 padding rows) and of 48 (16 puzzles): the same
    answers; on one device as on the 8 of the mesh; and in predict."""
    tmp_path, _, common = k3_run
    args = [*common, "--run.dir", str(tmp_path / "k32"), "--eval.trajectories", "3", "--eval.noise", "0.5"]
    at_32 = evaluate_command(args)
    at_48 = evaluate_command([*common, "--run.dir", str(tmp_path / "k48"), "--eval.trajectories", "3",
                              "--eval.noise", "0.5", "--optim.global-batch-size", "48"])
    for name in ("count", "exact_accuracy", "mode_exact_accuracy", "pass_exact_accuracy"):
        assert at_32[name] == at_48[name], name
    assert at_32["accuracy"] == pytest.approx(at_48["accuracy"], rel=1e-6)

    # predict takes one K and noise and gives the evaluation's answers (the same noise per puzzle).
    test_set = data.open_dataset(common[3], "test")
    digits = lambda tokens: "".join(str(int(t) - 1) for t in tokens)  # noqa: E731
    csv_file = tmp_path / "test.csv"
    csv_file.write_text("source,question,answer,rating\n" + "".join(
        f"demo,{digits(q)},{digits(a)},0\n" for q, a in zip(test_set.inputs, test_set.labels)))
    predicted = predict.predict_command(["demo", common[0], common[1], "--puzzle-file", str(csv_file),
                                         "--eval.trajectories", "3", "--eval.noise", "0.5"])
    assert predicted["exact_accuracy"] == pytest.approx(at_32["exact_accuracy"])
    with pytest.raises(SystemExit, match="predict takes one --eval.trajectories K"):
        predict.predict_command(["demo", common[0], common[1], "--puzzle-file", str(csv_file),
                                 "--eval.trajectories", "1,4"])

    one_dir = str(tmp_path / "one")
    script = textwrap.dedent(ONE_DEVICE_EVAL.format(project=str(PROJECT_DIR), run_dir=one_dir,
                                                    args=[*args[:-6], "--run.dir", one_dir, *args[-4:],
                                                          "--run.cpu-devices", "1"]))
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads(proc.stdout.split("RESULT")[1])
    assert not one["xla"]["fallbacks"]
    (row,) = one["curve"]
    for name in ("exact_accuracy", "mode_exact_accuracy", "pass_exact_accuracy"):
        assert row[name] == at_32[name], name
    assert row["accuracy"] == pytest.approx(at_32["accuracy"], rel=1e-5)
    assert np.isfinite(at_32["seconds_per_puzzle"])


def test_projection_of_an_evaluation_at_k_trajectories():
    """bench.py --trajectories K / projection: an evaluation batch holds hosts x ((global_batch /
    hosts) // K) puzzles, as the evaluation lays them out."""
    from tpu_costs.run_costs import PAPER_DATASETS, flop_record, project_paper_run
    from tpu_costs.slices import slice_spec
    from training.config import PRESETS

    preset = PRESETS["sudoku-mlp"][1]
    record = flop_record("sudoku-mlp", preset, slice_spec("v4-8"))
    one = project_paper_run(record, preset, PAPER_DATASETS["sudoku-mlp"], 0.4)
    at_16 = project_paper_run(record, dataclasses.replace(preset, eval=dataclasses.replace(
        preset.eval, trajectories="1,16")), PAPER_DATASETS["sudoku-mlp"], 0.4)
    test_examples = PAPER_DATASETS["sudoku-mlp"].test_examples
    assert at_16["eval_act_steps"] == 10 * -(-test_examples // 48) * 16  # 768 // 16 puzzles a batch
    assert at_16["eval_ms_per_puzzle"] == pytest.approx(16 * one["eval_ms_per_puzzle"])
    assert at_16["test_eval_hours"] == pytest.approx(
        -(-test_examples // 48) * 16 * at_16["eval_ms_per_act_step"] / 3.6e6)
    # On 8 hosts each holds 96 rows of the batch: 96 // 10 = 9 puzzles at K=10, 72 a batch, not
    # 768 // 10 = 76 (the puzzles of one host never straddle another's rows: testtime_batches).
    at_10 = dataclasses.replace(preset, eval=dataclasses.replace(preset.eval, trajectories="1,10"))
    eight_hosts = project_paper_run(flop_record("sudoku-mlp", at_10, slice_spec("v4-64")), at_10,
                                    PAPER_DATASETS["sudoku-mlp"], 0.4)
    assert eight_hosts["test_eval_hours"] == pytest.approx(
        -(-test_examples // 72) * eight_hosts["act_steps"] * eight_hosts["eval_ms_per_act_step"] / 3.6e6)
    with pytest.raises(ValueError, match="K=100 exceeds the 96 rows"):
        at_100 = dataclasses.replace(preset, eval=dataclasses.replace(preset.eval, trajectories="1,100"))
        project_paper_run(flop_record("sudoku-mlp", at_100, slice_spec("v4-64")), at_100,
                          PAPER_DATASETS["sudoku-mlp"], 0.4)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="libtpu's compile-only client needs Python 3.11+")
def test_tpu_compile_compiles_the_evaluation_at_k_trajectories(tmp_path):
    """`tpu_compile.py demo --programs eval_step --eval.trajectories 8`: the evaluation program
    with its K rows per puzzle compiles for a v4-8 host and tells its device time per puzzle."""
    out = tmp_path / "k8.json"
    done = subprocess.run([sys.executable, "tpu_compile.py", "demo", "--slice", "v4-8", "--programs", "eval_step",
                           "--json", str(out), "--eval.trajectories", "8", "--eval.noise", "0.5"],
                          cwd=PROJECT_DIR, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TRM_TPU_COMPILE_CACHE=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["programs"]
    assert (result["trajectories"], result["noise"], result["puzzles_per_batch"]) == (8, 0.5, 128 // 8)
    from tpu_costs import compiled_programs
    per_puzzle = compiled_programs.eval_ms_per_puzzle(result)
    assert per_puzzle == pytest.approx(result["estimate_ms"] * 4 / 16)  # demo: 4 ACT steps, 16 puzzles a batch
    assert f"per test puzzle: {per_puzzle:.4f} ms of device time" in done.stdout
    assert "K=8 trajectories each, noise 0.5" in done.stdout
    assert result["hbm_bytes"]["total"] < result["hbm_capacity_bytes"]
