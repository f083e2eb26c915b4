"""The recursion schemes of the reference's five architectures (its config/arch/*.yaml and
models/recursive_reasoning/*.py), each one small class registered by the reference's name.

The model (model.TRM) owns what they share: embeddings, the blocks, the heads, the ACT wrapper,
the loss. A scheme says which networks exist ("L": `blocks`, the reference's L_level; "H":
`H_blocks`, its H_level), which initial states (buffers under the reference's names), the shapes
of its two carried states (z_H, z_L; a state a scheme does not use is a [1, 1] placeholder), the
sequence of updates one ACT step applies, and how many of the last ones take a gradient. Every
scheme runs as a flat list of updates: the first len - grad_updates under no_grad, the rest with
it, which is exactly each reference file's loop.

    trm            z_L <- L(z_L, z_H + x) L_cycles times, z_H <- L(z_H, z_L); H_cycles times
    trm_singlez    one state z: z <- L(z + x) L_cycles times, z <- L(z); H_cycles times
    trm_hier6      six z_L slots: slot i <- L(sum of slots, z_H + x), z_H <- L(z_H, sum of slots)
    hrm            trm's updates with separate H and L networks, gradient through the last two only
    transformers_baseline   z <- H(z, x) once per ACT step (H_layers blocks, no cycles)
"""
from __future__ import annotations

from collections.abc import Callable

import torch

ARCHS = ("trm", "trm_singlez", "trm_hier6", "hrm", "transformers_baseline")
HIER_SLOTS = 6
PLACEHOLDER = (1, 1)  # the shape (per row) of a state a scheme does not carry


class Scheme:
    """TRM's (y, z) recursion (the reference's trm.py); the other schemes override parts."""

    name = "trm"
    inits = ("H_init", "L_init")
    yaml: dict = {}
    """The fields its reference yaml sets to other values than trm.yaml (the presets' base)."""
    forced: dict = {}
    """Fields the reference's file fixes whatever its yaml says (e.g. HRM's ceil(ndim/width)
    puzzle positions, its Q-continue halting)."""
    reference_class = "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1"
    """The reference's model class as its arch yaml's `name` (module under models/ @ class)."""
    reference_fields = ("H_cycles", "L_cycles", "H_layers", "L_layers", "hidden_size", "expansion", "num_heads",
                        "pos_encodings", "rms_norm_eps", "rope_theta", "halt_max_steps", "halt_exploration_prob",
                        "forward_dtype", "puzzle_emb_ndim", "mlp_t", "puzzle_emb_len", "no_ACT_continue")
    """The fields of ours that its reference config class reads (besides what pretrain.py takes
    from the dataset: seq_len, vocab_size, num_puzzle_identifiers; and batch_size)."""

    def networks(self, config) -> dict[str, int]:
        """The networks and their blocks: {"L": layers} (the one shared net), {"L", "H"}, {"H"}."""
        return {"L": config.L_layers, "H": config.L_layers} if config.separate_H_L else {"L": config.L_layers}

    def state_shapes(self, config) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The per-row shapes of z_H and z_L."""
        return (config.total_len, config.hidden_size), (config.total_len, config.hidden_size)

    def initial_states(self, model) -> tuple[torch.Tensor, torch.Tensor]:
        """What a reset row's z_H and z_L become (broadcast over positions)."""
        return model.H_init, model.L_init

    def grad_updates(self, config) -> int:
        """How many of the last updates take a gradient: the last recursion (L_cycles + 1), or the
        last L and the last H update (the 1-step gradient)."""
        return 2 if config.one_step_grad else config.L_cycles + 1

    def schedule(self, config) -> list[str]:
        """One ACT step's updates in order: "L" (z_L's, L_cycles per recursion) or "H" (z_H's)."""
        return (["L"] * config.L_cycles + ["H"]) * config.H_cycles

    def network_of(self, update: str, config) -> str:
        """The network an update applies: the H one where it exists, else the shared L one."""
        return update if update in self.networks(config) else "L"

    def updates(self, model, x: torch.Tensor) -> list[Callable]:
        """One ACT step's updates in order, each (z_H, z_L) -> (z_H, z_L)."""
        c = model.config
        update = {"L": lambda z_H, z_L: (z_H, model.net(z_L, z_H + x, self.network_of("L", c))),
                  "H": lambda z_H, z_L: (model.net(z_H, z_L, self.network_of("H", c)), z_L)}
        return [update[kind] for kind in self.schedule(c)]

    def output(self, z_H: torch.Tensor, z_L: torch.Tensor) -> torch.Tensor:
        """The state the heads read."""
        return z_H

    def problems(self, config) -> list[str]:
        """What this scheme's code cannot run, or runs differently from the reference."""
        return []

    def recurse(self, model, z_H: torch.Tensor, z_L: torch.Tensor, x: torch.Tensor):
        """(z_H, z_L, the state the heads read) after one ACT step's updates."""
        updates = self.updates(model, x)
        first_with_grad = len(updates) - min(self.grad_updates(model.config), len(updates))
        with torch.no_grad():
            for update in updates[:first_with_grad]:
                z_H, z_L = update(z_H, z_L)
        for update in updates[first_with_grad:]:
            z_H, z_L = update(z_H, z_L)
        return z_H, z_L, self.output(z_H, z_L)


class SingleZ(Scheme):
    """trm_singlez.py: one latent z (carried as z_L); its "H" update is L(z) with no injection."""

    name = "trm_singlez"
    reference_class = "recursive_reasoning.trm_singlez@TinyRecursiveReasoningModel_ACTV1"
    inits = ("L_init",)

    def state_shapes(self, config):
        return PLACEHOLDER, (config.total_len, config.hidden_size)

    def initial_states(self, model):
        return torch.zeros((), dtype=model.L_init.dtype, device=model.L_init.device), model.L_init

    def updates(self, model, x):
        update = {"L": lambda z_H, z_L: (z_H, model.net(z_L, x, "L")),
                  "H": lambda z_H, z_L: (z_H, model.net(z_L, None, "L"))}
        return [update[kind] for kind in self.schedule(model.config)]

    def output(self, z_H, z_L):
        return z_L


def slot_sum(z_L: torch.Tensor) -> torch.Tensor:
    """z_L[:, 0] + ... + z_L[:, 5] added left to right, in the states' dtype, as the reference
    writes it (a sum over the slot dimension would round once, in float32)."""
    total = z_L[:, 0]
    for i in range(1, z_L.shape[1]):
        total = total + z_L[:, i]
    return total


class Hier6(Scheme):
    """trm_hier6.py: six z_L slots, each with its own initial state; the i-th L update of a
    recursion writes slot i from the sum of all six, z_H reads the sum."""

    name = "trm_hier6"
    reference_class = "recursive_reasoning.trm_hier6@TinyRecursiveReasoningModel_ACTV1"
    inits = ("H_init",) + tuple(f"L{i}_init" for i in range(1, HIER_SLOTS + 1))

    def state_shapes(self, config):
        return (config.total_len, config.hidden_size), (HIER_SLOTS, config.total_len, config.hidden_size)

    def initial_states(self, model):
        slots = torch.stack([getattr(model, name) for name in self.inits[1:]])
        return model.H_init, slots[:, None, :]

    def updates(self, model, x):
        def update_L(slot):
            def update(z_H, z_L):
                new = model.net(slot_sum(z_L), z_H + x, "L")
                return z_H, torch.cat([z_L[:, :slot], new[:, None], z_L[:, slot + 1:]], dim=1)
            return update
        update_H = lambda z_H, z_L: (model.net(z_H, slot_sum(z_L), "L"), z_L)
        out, slot = [], 0
        for kind in self.schedule(model.config):  # the i-th L update of a recursion writes slot i
            out.append(update_L(slot) if kind == "L" else update_H)
            slot = slot + 1 if kind == "L" else 0
        return out

    def problems(self, config):
        if config.L_cycles > HIER_SLOTS:
            return [f"L_cycles={config.L_cycles}: trm_hier6's L updates write slots 1..L_cycles of "
                    f"its {HIER_SLOTS} (the reference fails past 6); use L_cycles <= {HIER_SLOTS}"]
        return []


class HRM(Scheme):
    """hrm.py: trm's updates with an H network of H_layers and an L network of L_layers blocks;
    every update but the last L and H one without gradient; halts on q_halt > q_continue with the
    bootstrapped Q-continue target."""

    name = "hrm"
    reference_class = "recursive_reasoning.hrm@HierarchicalReasoningModel_ACTV1"
    reference_fields = Scheme.reference_fields[:-2]  # no puzzle_emb_len, no_ACT_continue (fixed, `forced`)
    yaml = dict(H_cycles=2, L_cycles=2, H_layers=4, L_layers=4)
    forced = dict(puzzle_emb_len=0, no_ACT_continue=False)

    def networks(self, config):
        return {"L": config.L_layers, "H": config.H_layers}

    def grad_updates(self, config):
        return 2


class Baseline(Scheme):
    """transformers_baseline.py: one state z (carried as z_L, so test-time noise perturbs it)
    through H_layers attention blocks with the input injected, once per ACT step; halts on
    q_halt > q_continue (act_enabled) with no Q-continue target."""

    name = "transformers_baseline"
    reference_class = "recursive_reasoning.transformers_baseline@Model_ACTV2"
    reference_fields = ("H_cycles", "H_layers", "hidden_size", "expansion", "num_heads", "pos_encodings",
                        "rms_norm_eps", "rope_theta", "halt_max_steps", "halt_exploration_prob", "forward_dtype",
                        "puzzle_emb_ndim", "act_enabled", "act_inference")
    inits = ("H_init",)
    yaml = dict(H_cycles=1, H_layers=8, num_heads=12, pos_encodings="rope")  # rope: the presets' "none" goes with mlp_t
    forced = dict(puzzle_emb_len=0, no_ACT_continue=False, mlp_t=False)

    def networks(self, config):
        return {"H": config.H_layers}

    def state_shapes(self, config):
        return PLACEHOLDER, (config.total_len, config.hidden_size)

    def initial_states(self, model):
        return torch.zeros((), dtype=model.H_init.dtype, device=model.H_init.device), model.H_init

    def grad_updates(self, config):
        return 1

    def schedule(self, config):
        return ["H"]

    def updates(self, model, x):
        return [lambda z_H, z_L: (z_H, model.net(z_L, x, "H"))]

    def output(self, z_H, z_L):
        return z_L

    def problems(self, config):
        if config.pos_encodings == "none":
            return ["pos_encodings='none': the reference's transformers_baseline has rope or learned "
                    "positions only (it raises otherwise); pass --model.pos-encodings rope"]
        return []


SCHEMES: dict[str, Scheme] = {s.name: s for s in (Scheme(), SingleZ(), Hier6(), HRM(), Baseline())}
BOOTSTRAPS_Q_CONTINUE = ("trm", "trm_singlez", "trm_hier6", "hrm")
"""The archs whose ACT wrapper adds the Q-continue target when no_ACT_continue is False (the
baseline's halts on q_continue but never computes its target: the reference's loss does not ask)."""


def arch_defaults(arch: str) -> dict:
    """The model fields that choosing `arch` sets (its yaml's values, then what its code fixes)."""
    if arch not in SCHEMES:
        raise ValueError(f"unknown arch {arch!r}: one of {', '.join(ARCHS)}")
    return {**SCHEMES[arch].yaml, **SCHEMES[arch].forced, "arch": arch}
