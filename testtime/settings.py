"""The settings of test-time scaling (PTRM, docs/test-time-scaling.md): which (K, noise, depth D,
noise latent) points `train.py eval`'s flags name, the point training's evaluations use, and where
each point's results live in a run: {RUN}/test-time/{setting_name(...)}/, metrics.json written
last (its presence: the setting is done).

    K16-noise0.3-D64          K=16 trajectories, sigma 0.3 on z_L, 64 ACT steps
    K16-noise0.3-D64-both     the same, with the noise on z_H and z_L
"""
from __future__ import annotations

import math
from dataclasses import dataclass

DIR = "test-time"
"""The directory inside a run that holds its test-time evaluations, one directory per setting."""
NOISE_LATENTS = ("z_L", "z_H", "both")
"""Where the noise enters: the low-level latent z_L (the default, as this project always did), the
high-level z_H, or both."""


def setting_name(k: int, noise: float, act_steps: int, latent: str = "z_L") -> str:
    """The directory name of one test-time setting: K{K}-noise{noise:g}-D{D}, with -{latent}
    appended when the noise enters elsewhere than z_L (e.g. K16-noise0.3-D64, K4-noise1-D16-both)."""
    if latent not in NOISE_LATENTS:
        raise ValueError(f"noise latent {latent!r} must be one of {', '.join(NOISE_LATENTS)}")
    return f"K{k}-noise{noise:g}-D{act_steps}" + ("" if latent == "z_L" else f"-{latent}")


def setting_dir(run_dir: str, k: int, noise: float, act_steps: int, latent: str = "z_L") -> str:
    """{run_dir}/test-time/{setting_name}: where `train.py eval --init-from RUN` writes a setting."""
    from rundir import storage

    return storage.join_url(run_dir, DIR, setting_name(k, noise, act_steps, latent))


@dataclass(frozen=True)
class Setting:
    """One point of test-time scaling."""

    k: int
    """Trajectories per puzzle."""
    noise: float
    """sigma: the standard deviation of the Gaussian noise added at every ACT step."""
    act_steps: int
    """D: ACT steps run per puzzle (the model's halt_max_steps: the reference's evaluation)."""
    latent: str = "z_L"
    """Where the noise enters (NOISE_LATENTS)."""

    @property
    def name(self) -> str:
        return setting_name(self.k, self.noise, self.act_steps, self.latent)

    @property
    def is_reference(self) -> bool:
        """One trajectory without noise: the reference's evaluation (at its depth or another)."""
        return self.k == 1 and self.noise == 0


def parse_trajectories(text: str) -> list[int]:
    """[K, ...] of --eval.trajectories: one count or a comma list such as 1,4,16 (each >= 1)."""
    try:
        ks = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        ks = []
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"eval.trajectories={text!r} must be one count or a comma list of counts >= 1 "
                         "(e.g. --eval.trajectories 1,4,16)")
    return ks


def parse_noises(text: str) -> list[float]:
    """[sigma, ...] of --eval.noise: one scale or a comma list such as 0,0.3 (each >= 0)."""
    try:
        noises = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        noises = []
    if not noises or any(not math.isfinite(n) or n < 0 for n in noises):
        raise ValueError(f"eval.noise={text!r} must be one scale or a comma list of scales >= 0 "
                         "(e.g. --eval.noise 0.3)")
    return noises


def act_steps_of(eval_config, halt_max_steps: int) -> int:
    """D of --eval.act-steps: the model's halt_max_steps when not given."""
    steps = getattr(eval_config, "act_steps", None)
    return halt_max_steps if steps is None else int(steps)


def settings(eval_config, halt_max_steps: int, breadth_without_noise: bool = False) -> list[Setting]:
    """Every point of `train.py eval`'s flags: each noise at each K, but noise 0 at K=1 only
    (without noise every trajectory is the first: K > 1 would cost K times for K=1's answers)
    unless `breadth_without_noise` (an arch whose rows draw their own initial states and noise,
    EqR: its K rows differ without test-time noise, EqR's breadth B); one depth and one latent."""
    ks, noises = parse_trajectories(eval_config.trajectories), parse_noises(eval_config.noise)
    d, latent = act_steps_of(eval_config, halt_max_steps), getattr(eval_config, "noise_latent", "z_L")
    points = []
    for noise in noises:
        for k in ks if noise or breadth_without_noise else [1]:
            point = Setting(k, noise, d, latent)
            if point not in points:
                points.append(point)
    return points


def training_eval_setting(eval_config, halt_max_steps: int) -> Setting:
    """The one setting of a training run's evaluations (and of the evaluation program tpu_compile.py
    compiles): the last of eval.trajectories and of eval.noise, at eval.act_steps."""
    return Setting(parse_trajectories(eval_config.trajectories)[-1], parse_noises(eval_config.noise)[-1],
                   act_steps_of(eval_config, halt_max_steps), getattr(eval_config, "noise_latent", "z_L"))
