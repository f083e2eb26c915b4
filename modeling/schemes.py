"""The recursion schemes: how one ACT step of each architecture updates its carried states. One
class per arch, registered once under the arch's name (`@register`); that class is all there is to
an arch: the reference's five (its config/arch/*.yaml and models/recursive_reasoning/*.py) below,
a new one by the same recipe (docs/faithfulness.md, "Adding an architecture").

The model (model.TRM) owns what they share: embeddings, the blocks, the heads, the ACT wrapper,
the loss. A scheme says which networks exist ("L": `blocks`, the reference's L_level; "H":
`H_blocks`, its H_level) and which config field sizes each, which initial states (buffers under
the reference's names), the shapes of its two carried states (z_H, z_L; a state a scheme does not
use is a [1, 1] placeholder), the sequence of updates one ACT step applies, and how many of the
last ones take a gradient. Every scheme runs as a flat list of updates: the first
len - grad_updates under no_grad, the rest with it, which is exactly each reference file's loop.
It also says what choosing it sets (`yaml`), what its reference code fixes (`forced`), which
config flags are its ablations, how its halting reads the Q head (`halt_score`), whether it
bootstraps the Q-continue target, how its reference checkpoint is recognised (`recognises`) and
its own config checks (`problems`).

    trm            z_L <- L(z_L, z_H + x) L_cycles times, z_H <- L(z_H, z_L); H_cycles times
    trm_singlez    one state z: z <- L(z + x) L_cycles times, z <- L(z); H_cycles times
    trm_hier6      six z_L slots: slot i <- L(sum of slots, z_H + x), z_H <- L(z_H, sum of slots)
    hrm            trm's updates with separate H and L networks, gradient through the last two only
    transformers_baseline   z <- H(z, x) once per ACT step (H_layers blocks, no cycles)
    eqr            trm's updates damped and noisy, z <- (1-λ)z + λ L(z, injection) + σε; fresh
                   random initial states per reset row (EqR, github.com/locuslab/EqR)
    urm            URM's (github.com/UbiquantAI/URM): one state z <- L(z + x), H_cycles * L_cycles
                   times, the last L_cycles with gradient; ConvSwiGLU blocks
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import torch

from modeling import counter_hash

HIER_SLOTS = 6
PLACEHOLDER = (1, 1)  # the shape (per row) of a state a scheme does not carry

SCHEMES: dict[str, RecursionScheme] = {}
"""Every registered arch: its name (--model.arch) -> its scheme, in registration order."""


def register(cls: type[RecursionScheme]) -> type[RecursionScheme]:
    """Class decorator: an instance of `cls` becomes the arch `cls.name`, which --model.arch
    accepts (and --help lists), TRMConfig checks, presets take with its yaml values, and a
    reference checkpoint is recognised as."""
    if not cls.name or cls.name in SCHEMES:
        raise ValueError(f"register {cls.__name__}: its name {cls.name!r} is "
                         + ("taken by " + type(SCHEMES[cls.name]).__name__ if cls.name else "empty")
                         + "; give the class a name = '...' of its own")
    SCHEMES[cls.name] = cls()
    return cls


def __getattr__(name: str):
    """`ArchName`: Literal[every registered arch's name], built when read (model.TRMConfig.arch's
    type: tyro's --help lists the choices, and a wrong one is an error naming them)."""
    if name == "ArchName":
        return Literal[tuple(SCHEMES)]
    raise AttributeError(f"module 'recursion' has no attribute {name!r}")


def arch_defaults(arch: str) -> dict:
    """The model fields that choosing `arch` sets (its yaml's values, then what its code fixes)."""
    if arch not in SCHEMES:
        raise ValueError(f"unknown arch {arch!r}: one of {', '.join(SCHEMES)}")
    return {**SCHEMES[arch].yaml, **SCHEMES[arch].forced, "arch": arch}


class RecursionScheme:
    """The recursion scheme of an architecture: how one ACT step updates (z_H, z_L), and everything
    else that differs between archs. The base computes TRM's (y, z) recursion (the reference's
    trm.py); an arch subclasses it, sets `name`, overrides what differs and is `@register`ed."""

    name: str = ""
    """The arch's name (--model.arch), the reference's."""
    inits: tuple[str, ...] = ("H_init", "L_init")
    """The initial states: buffers of model.TRM under the reference's names."""
    yaml: dict = {}
    """The fields its reference yaml sets to other values than trm.yaml (the presets' base)."""
    forced: dict = {}
    """Fields the reference's file fixes whatever its yaml says (e.g. HRM's ceil(ndim/width)
    puzzle positions, its Q-continue halting); another value is a config error."""
    ablations: tuple[str, ...] = ()
    """Boolean TRMConfig fields that vary this scheme (trm's separate_H_L); other archs refuse them."""
    own_fields: tuple[str, ...] = ()
    """TRMConfig fields only this scheme reads (EqR's damping and noise); other archs refuse a
    value other than the field's default."""
    draws: bool = False
    """Whether the scheme draws random numbers every ACT step: then its `initial_states(model, keys,
    carry)` and `updates(model, x, keys)` take the step's per-row int32 keys (model.TRM.forward
    makes them from the seed, the carry's rng_counter and the row; counter_hash turns a key into
    draws), so that every host draws the same and a resumed run continues exactly."""
    bootstraps_q_continue: bool = True
    """Whether, when the config learns a Q-continue (no_ACT_continue False), the ACT step computes
    its bootstrapped target (one more forward from the new state), as the reference's ACT wrapper."""

    reference_class = "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1"
    """The reference's model class as its arch yaml's `name` (module under models/ @ class)."""
    reference_fields = ("H_cycles", "L_cycles", "H_layers", "L_layers", "hidden_size", "expansion", "num_heads",
                        "pos_encodings", "rms_norm_eps", "rope_theta", "halt_max_steps", "halt_exploration_prob",
                        "forward_dtype", "puzzle_emb_ndim", "mlp_t", "puzzle_emb_len", "no_ACT_continue")
    """The fields of ours that its reference config class reads under our names (besides what
    pretrain.py takes from the dataset: seq_len, vocab_size, num_puzzle_identifiers; and batch_size)."""
    reference_renames: dict[str, str] = {}
    """Its config class's fields that are ours under another name: its name -> ours (URM's
    num_layers is our L_layers)."""
    reference_block = "{level}_level.layers.{i}."
    """Where its checkpoint names block i of network `level` ("L" or "H") under `model.inner.`."""

    # -- the networks and states --------------------------------------------------------------

    def layer_fields(self, config) -> dict[str, str]:
        """Each network ("L": `blocks`, "H": `H_blocks`) and the config field of its block count."""
        return {"L": "L_layers"}

    def networks(self, config) -> dict[str, int]:
        """The networks and their blocks: {"L": layers} (the one shared net), {"L", "H"}, {"H"}."""
        return {level: getattr(config, field) for level, field in self.layer_fields(config).items()}

    def state_shapes(self, config) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The per-row shapes of z_H and z_L."""
        return (config.total_len, config.hidden_size), (config.total_len, config.hidden_size)

    def initial_states(self, model) -> tuple[torch.Tensor, torch.Tensor]:
        """What a reset row's z_H and z_L become (broadcast over positions)."""
        return model.H_init, model.L_init

    # -- one ACT step -------------------------------------------------------------------------

    def grad_updates(self, config) -> int:
        """How many of the last updates take a gradient: the last recursion (L_cycles + 1)."""
        return config.L_cycles + 1

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

    def recurse(self, model, z_H: torch.Tensor, z_L: torch.Tensor, x: torch.Tensor, keys: torch.Tensor | None = None):
        """(z_H, z_L, the state the heads read) after one ACT step's updates; `keys`: the step's
        per-row draw keys of a scheme that `draws`."""
        updates = self.updates(model, x, keys) if self.draws else self.updates(model, x)
        first_with_grad = len(updates) - min(self.grad_updates(model.config), len(updates))
        with torch.no_grad():
            for update in updates[:first_with_grad]:
                z_H, z_L = update(z_H, z_L)
        for update in updates[first_with_grad:]:
            z_H, z_L = update(z_H, z_L)
        return z_H, z_L, self.output(z_H, z_L)

    # -- halting ------------------------------------------------------------------------------

    def halt_score(self, config, q_halt: torch.Tensor, q_continue: torch.Tensor | None = None) -> torch.Tensor:
        """How the Q head's logits read as halting: a row halts where the score is > 0, and a
        higher score is a surer halt. q_halt alone (sigmoid(q_halt) > 0.5) with no_ACT_continue
        or without q_continue logits; else q_halt - q_continue (q_halt > q_continue), the rule of
        the reference's hrm and transformers_baseline."""
        return q_halt if config.no_ACT_continue or q_continue is None else q_halt - q_continue

    def q_continue_target(self, config) -> bool:
        """Whether a training ACT step computes the bootstrapped Q-continue target (and its loss)."""
        return self.bootstraps_q_continue and not config.no_ACT_continue

    # -- reference checkpoints ----------------------------------------------------------------

    def recognises(self, keys: set[str], config) -> bool:
        """Whether a reference checkpoint with these tensor names (`model.inner.` stripped) is one
        of this scheme with `config` (its fields with this arch's yaml): the same initial states
        (`*_init`) and the same networks (`L_level`, `H_level`)."""
        inits = {k for k in keys if k.endswith("_init")}
        levels = {k.split("_level.")[0] for k in keys if "_level.layers." in k}
        return inits == set(self.inits) and levels == set(self.networks(config))

    def reference_problems(self, arch: dict) -> list[str]:
        """What of a saved config's `arch` section (its code's names and values) this scheme cannot
        compute, each naming the field (config_from_all_config refuses them)."""
        return []

    # -- config checks ------------------------------------------------------------------------

    def problems(self, config) -> list[str]:
        """This scheme's own checks: what its code cannot run, or runs differently from the
        reference (config_problems adds the checks every scheme shares)."""
        return []

    def config_problems(self, config) -> list[str]:
        """Every problem of `config` with this scheme (TRMConfig.problems): a `forced` field at
        another value, another arch's ablation, a network of no blocks, then `problems`."""
        out = [f"{name}={getattr(config, name)!r}: the reference's {self.name} fixes it at {value!r}"
               for name, value in self.forced.items() if getattr(config, name) != value]
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        for name in dict.fromkeys(f for scheme in SCHEMES.values() for f in scheme.own_fields):
            if name not in self.own_fields and getattr(config, name) != defaults[name]:
                owners = ", ".join(s.name for s in SCHEMES.values() if name in s.own_fields)
                out.append(f"{name}={getattr(config, name)!r}: a field of arch {owners}, not of arch "
                           f"{self.name} (leave it at {defaults[name]!r})")
        for flag in dict.fromkeys(f for scheme in SCHEMES.values() for f in scheme.ablations):
            if getattr(config, flag) and flag not in self.ablations:
                owners = ", ".join(s.name for s in SCHEMES.values() if flag in s.ablations)
                out.append(f"{flag} is an ablation of {owners} (the paper's), not of arch {self.name}")
        for level, field in self.layer_fields(config).items():
            if getattr(config, field) < 1:
                out.append(f"{field}={getattr(config, field)}: {self.name} needs an {level} network of "
                           "1 or more blocks")
        return out + self.problems(config)


@register
class TRMRecursion(RecursionScheme):
    """trm.py, with the paper's two ablations that no reference file holds: separate_H_L (z_H
    updated by a second network of L_layers blocks) and one_step_grad (gradient through the last
    L and H update only)."""

    name = "trm"
    ablations = ("separate_H_L", "one_step_grad")

    def layer_fields(self, config):
        return {"L": "L_layers", "H": "L_layers"} if config.separate_H_L else {"L": "L_layers"}

    def grad_updates(self, config):
        return 2 if config.one_step_grad else super().grad_updates(config)


@register
class SingleZ(RecursionScheme):
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


def slot_sum(slots) -> torch.Tensor:
    """slots[0] + ... + slots[5] added left to right, in the states' dtype, as the reference
    writes it (a sum over a slot dimension would round once, in float32)."""
    total = slots[0]
    for slot in slots[1:]:
        total = total + slot
    return total


@register
class Hier6(RecursionScheme):
    """trm_hier6.py: six z_L slots, each with its own initial state; the i-th L update of a
    recursion writes slot i from the sum of all six, z_H reads the sum. The carry holds the slots
    as one [B, 6, T, D] z_L; within an ACT step they are six tensors, so that an update writes
    only its own slot (no copy of the other five), and are stacked once at the end."""

    name = "trm_hier6"
    reference_class = "recursive_reasoning.trm_hier6@TinyRecursiveReasoningModel_ACTV1"
    inits = ("H_init",) + tuple(f"L{i}_init" for i in range(1, HIER_SLOTS + 1))

    def state_shapes(self, config):
        return (config.total_len, config.hidden_size), (HIER_SLOTS, config.total_len, config.hidden_size)

    def initial_states(self, model):
        slots = torch.stack([getattr(model, name) for name in self.inits[1:]])
        return model.H_init, slots[:, None, :]

    def updates(self, model, x):
        """Each (z_H, slots) -> (z_H, slots), slots a tuple of the six [B, T, D] states."""
        def update_L(slot):
            def update(z_H, slots):
                new = model.net(slot_sum(slots), z_H + x, "L")
                return z_H, slots[:slot] + (new,) + slots[slot + 1:]
            return update
        update_H = lambda z_H, slots: (model.net(z_H, slot_sum(slots), "L"), slots)
        out, slot = [], 0
        for kind in self.schedule(model.config):  # the i-th L update of a recursion writes slot i
            out.append(update_L(slot) if kind == "L" else update_H)
            slot = slot + 1 if kind == "L" else 0
        return out

    def recurse(self, model, z_H, z_L, x, keys=None):
        z_H, slots, out = super().recurse(model, z_H, tuple(z_L.unbind(1)), x, keys)
        return z_H, torch.stack(slots, dim=1), out

    def problems(self, config):
        if config.L_cycles > HIER_SLOTS:
            return [f"L_cycles={config.L_cycles}: trm_hier6's L updates write slots 1..L_cycles of "
                    f"its {HIER_SLOTS} (the reference fails past 6); use L_cycles <= {HIER_SLOTS}"]
        return []


@register
class HRM(RecursionScheme):
    """hrm.py: trm's updates with an H network of H_layers and an L network of L_layers blocks;
    every update but the last L and H one without gradient; halts on q_halt > q_continue with the
    bootstrapped Q-continue target."""

    name = "hrm"
    reference_class = "recursive_reasoning.hrm@HierarchicalReasoningModel_ACTV1"
    yaml = dict(H_cycles=2, L_cycles=2, H_layers=4, L_layers=4)
    forced = dict(puzzle_emb_len=0, no_ACT_continue=False)
    reference_fields = tuple(sorted(set(RecursionScheme.reference_fields) - set(forced),  # its code fixes those
                                    key=RecursionScheme.reference_fields.index))

    def layer_fields(self, config):
        return {"L": "L_layers", "H": "H_layers"}

    def grad_updates(self, config):
        return 2


@register
class Baseline(RecursionScheme):
    """transformers_baseline.py: one state z (carried as z_L, so test-time noise perturbs it)
    through H_layers attention blocks with the input injected, once per ACT step; halts on
    q_halt > q_continue (act_enabled) with no Q-continue target (the reference's loss does not
    ask for one)."""

    name = "transformers_baseline"
    reference_class = "recursive_reasoning.transformers_baseline@Model_ACTV2"
    reference_fields = ("H_cycles", "H_layers", "hidden_size", "expansion", "num_heads", "pos_encodings",
                        "rms_norm_eps", "rope_theta", "halt_max_steps", "halt_exploration_prob", "forward_dtype",
                        "puzzle_emb_ndim", "act_enabled", "act_inference")
    inits = ("H_init",)
    yaml = dict(H_cycles=1, H_layers=8, num_heads=12, pos_encodings="rope")  # rope: the presets' "none" goes with mlp_t
    forced = dict(puzzle_emb_len=0, no_ACT_continue=False, mlp_t=False)
    bootstraps_q_continue = False

    def layer_fields(self, config):
        return {"H": "H_layers"}

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


@register
class EqR(RecursionScheme):
    """EqR's models/eqr.py (Equilibrium Reasoners, github.com/locuslab/EqR @ 4d45856, arXiv
    2605.21488): trm's updates and gradient, each update damped and noisy,
    z <- (1-λ)·z + λ·L(z, injection) + σ·ε with λ = eqr_damping, σ = eqr_noise and ε standard
    normal per element, drawn at every update (no-gradient cycles and evaluation too); a reset
    row's z_H and z_L drawn fresh per row and position (JAX-style truncated normal of std 1, its
    H_init_std and L_init_std) instead of broadcast buffers; no puzzle embedding (no prefix); halts
    on q_halt alone. The draws are counter_hash's: per-row keys from model.TRM.forward, then one
    draw per (key, draw index, position, channel): index 0 z_H's initial state, 1 z_L's, 2 + u the
    noise of the step's u-th update; EqR draws torch's generator (its reset's z_H first, then z_L,
    then the updates in order), the same distributions."""

    name = "eqr"
    reference_class = "eqr@EqRModel"
    reference_fields = ("H_cycles", "L_cycles", "H_layers", "L_layers", "hidden_size", "expansion", "num_heads",
                        "pos_encodings", "rms_norm_eps", "rope_theta", "halt_max_steps", "halt_exploration_prob",
                        "forward_dtype", "mlp_t")
    reference_renames = {"lambda_": "eqr_damping", "noise_scale": "eqr_noise"}
    inits = ()
    own_fields = ("eqr_damping", "eqr_noise")
    draws = True
    forced = dict(puzzle_emb_ndim=0, puzzle_emb_len=0, no_ACT_continue=True)
    INIT_STD = 1.0
    """The initial states' std (EqR's H_init_std and L_init_std, 1.0 in its yaml)."""

    @staticmethod
    def draw_keys(keys: torch.Tensor, index: int) -> torch.Tensor:
        """int32 [B]: the keys of draw `index` of a step (0, 1: z_H's and z_L's initial states; 2 + u:
        the noise of update u)."""
        return keys + counter_hash.int32((index + 1) * 0x1B873593)

    def initial_states(self, model, keys=None, carry=None):
        """Fresh z_H and z_L [B, T, D] for every row (model.forward keeps them where a row resets),
        drawn in float32 and rounded to the states' dtype (EqR draws in the states' dtype)."""
        shape = tuple(carry.z_H.shape[1:])
        return tuple(counter_hash.hashed_truncated_normal(self.draw_keys(keys, index), shape, self.INIT_STD)
                     .to(state.dtype) for index, state in enumerate((carry.z_H, carry.z_L)))

    def noise(self, keys: torch.Tensor, update: int, z: torch.Tensor) -> torch.Tensor:
        """ε of update `update`: standard normal [B, T, D] in z's dtype (EqR's torch.randn_like(z))."""
        return counter_hash.hashed_normal(self.draw_keys(keys, 2 + update), tuple(z.shape[1:])).to(z.dtype)

    def updates(self, model, x, keys=None):
        """trm's updates as EqR's NoisyReasoningModule computes them, in the states' dtype:
        (1 - λ)·z + λ·f(z + injection) + ε·σ (no draw when σ = 0: EqR adds 0·ε)."""
        damping, sigma = model.config.eqr_damping, model.config.eqr_noise

        def damped(z, injection, update):
            new = model.net(z, injection, "L")
            out = (1 - damping) * z + damping * new
            return out + self.noise(keys, update, z) * sigma if sigma else out

        def make(kind, update):
            if kind == "L":
                return lambda z_H, z_L: (z_H, damped(z_L, z_H + x, update))
            return lambda z_H, z_L: (damped(z_H, z_L, update), z_L)
        return [make(kind, update) for update, kind in enumerate(self.schedule(model.config))]

    def problems(self, config):
        if config.pos_encodings == "learned":
            return ["pos_encodings='learned': EqR has rope, rope2d or none (it raises on learned); "
                    "pass --model.pos-encodings rope"]
        return []

    def reference_problems(self, arch):
        out = [f"{name}={arch[name]!r}: ours draws the initial states with std {self.INIT_STD} (EqR's yaml value)"
               for name in ("H_init_std", "L_init_std") if arch.get(name, self.INIT_STD) != self.INIT_STD]
        height, width = arch.get("board_height"), arch.get("board_width")
        if arch.get("pos_encodings") == "rope2d" and height is not None and height != width:
            out.append(f"board_height={height}, board_width={width}: our rope2d is EqR's on a square board only")
        return out


@register
class URM(RecursionScheme):
    """URM, the Universal Reasoning Model (github.com/UbiquantAI/URM @ 41de2c3, models/urm/urm.py,
    config/arch/urm.yaml; arXiv 2512.14693), written from its code (it has no license: nothing of
    it is copied). One state (carried as z_L) from the `init_hidden` buffer; each of the
    H_cycles * L_cycles updates is z <- blocks(z + x), the first (H_cycles - 1) * L_cycles without
    gradient (its truncated backpropagation); the heads read z. Its blocks are trm's post-norm
    attention blocks (RoPE always) with the ConvSwiGLU (conv_kernel 2) in place of the SwiGLU; the
    puzzle embedding takes ceil(ndim / width) positions; it halts on q_halt alone, with no
    Q-continue target. URM's names: num_layers is our L_layers, loops our halt_max_steps; its
    exploration probability is a constant 0.1 in its code (our halt_exploration_prob, 0.1 in its
    presets). Its checkpoints name the blocks model.inner.layers.{i}.* and the conv mlp.dwconv
    (reference/weights.reference_names); one is recognised by its `init_hidden` and those blocks."""

    name = "urm"
    reference_class = "urm.urm@URM"
    reference_fields = ("H_cycles", "L_cycles", "hidden_size", "expansion", "num_heads", "pos_encodings",
                        "rms_norm_eps", "rope_theta", "forward_dtype", "puzzle_emb_ndim")
    """Those of its URMConfig's fields that have our names."""
    reference_renames = {"num_layers": "L_layers", "loops": "halt_max_steps"}
    reference_block = "layers.{i}."
    inits = ("init_hidden",)
    yaml = dict(H_cycles=4, L_cycles=3, L_layers=8, halt_max_steps=16)
    forced = dict(conv_kernel=2, puzzle_emb_len=0, no_ACT_continue=True, pos_encodings="rope", mlp_t=False)
    bootstraps_q_continue = False

    def state_shapes(self, config):
        return PLACEHOLDER, (config.total_len, config.hidden_size)

    def initial_states(self, model):
        return torch.zeros((), dtype=model.init_hidden.dtype, device=model.init_hidden.device), model.init_hidden

    def grad_updates(self, config):
        return config.L_cycles

    def schedule(self, config):
        return ["L"] * (config.H_cycles * config.L_cycles)

    def updates(self, model, x):
        return [lambda z_H, z_L: (z_H, model.net(z_L, x, "L"))] * len(self.schedule(model.config))

    def output(self, z_H, z_L):
        return z_L

    def recognises(self, keys, config):
        return ("init_hidden" in keys and any(k.startswith("layers.") for k in keys)
                and not any(k.endswith("_init") or "_level." in k for k in keys))

    def problems(self, config):
        if config.H_layers:
            return [f"H_layers={config.H_layers}: URM has one network of L_layers blocks (its num_layers) "
                    "and no H network; leave H_layers at 0 and set --model.L-layers"]
        return []


# ----------------------------------------------------------------------------------------------
# The halting exploration annealed over the run (the seeds' contrib02_adaptive).
#
# The training's halting exploration probability annealed over the run (the seeds'
# contrib02_adaptive). The evaluation's halting-step distribution is training/halt_steps.py's.
#
# The rule is each arch's own (schemes.RecursionScheme.halt_score, read through
# TRMConfig.halt_score): a row says halt where its score is > 0 (q_halt alone with no_ACT_continue,
# sigmoid(q_halt) > 0.5; else q_halt - q_continue, the rule of hrm and transformers_baseline), and
# the higher the score, the more the row wants to halt. Training halts by it (model.py), the
# evaluation's histogram reads it (halt_steps.py), and test-time selection ranks by it (noisy_trajectories.py).
#
# The anneal. `exploration_prob(config, counter)`: the probability that a training row gets a
# random minimum number of ACT steps at training step counter + 1 (the carry's rng_counter counts
# the steps before), linear from halt_exploration_prob to halt_exploration_final over
# halt_exploration_anneal_steps steps, then flat; a device value, so the step's program is the
# same at every step and a resumed run (whose carry restores the counter) continues exactly.


def exploration_prob(config, counter: torch.Tensor):
    """The halting exploration probability of the training step after `counter` steps (a device
    value), or config.halt_exploration_prob (a float) when there is no anneal."""
    start, final = config.halt_exploration_prob, config.halt_exploration_final
    if final is None:
        return start
    progress = ((counter + 1).float() / config.halt_exploration_anneal_steps).clamp(max=1.0)
    return start + (final - start) * progress
