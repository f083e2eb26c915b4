"""STUB of the evaluation side's testtime.py (issue 47), only what the study needs, as that side
defines it, so that the study's tests run before it is merged; its file replaces this one whole.

The settings of test-time scaling: where each point's results live in a run,
{RUN}/test-time/{setting_name(...)}/, metrics.json written last (its presence: the setting is done).
"""
from __future__ import annotations

from dataclasses import dataclass

DIR = "test-time"
"""The directory inside a run that holds its test-time evaluations, one directory per setting."""
NOISE_LATENTS = ("z_L", "z_H", "both")
"""Where the noise enters: the low-level latent z_L (the default), the high-level z_H, or both."""


def setting_name(k: int, noise: float, act_steps: int, latent: str = "z_L") -> str:
    """The directory name of one test-time setting: K{K}-noise{noise:g}-D{D}, with -{latent}
    appended when the noise enters elsewhere than z_L (e.g. K16-noise0.3-D64, K4-noise1-D16-both)."""
    if latent not in NOISE_LATENTS:
        raise ValueError(f"noise latent {latent!r} must be one of {', '.join(NOISE_LATENTS)}")
    return f"K{k}-noise{noise:g}-D{act_steps}" + ("" if latent == "z_L" else f"-{latent}")


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
