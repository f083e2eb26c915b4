"""Checkpoints of each arch's own code (the reference, github.com/SamsungSAILMontreal/
TinyRecursiveModels, for its five; EqR's and URM's for theirs): our state_dict names under theirs
(`model.inner.*`), the model config that a checkpoint's tensor shapes determine, and loading one
into a model.TRM (a fine-tuning's puzzle table reset to its mean row)."""
from __future__ import annotations

import dataclasses

import torch

from model import TRM, TRMConfig, swiglu_width


def reference_names(config: TRMConfig) -> dict[str, str]:
    """Our state_dict name → the name its arch's own code gives the tensor under `model.inner.`:
    the TRM reference's for its five archs, EqR's (the same names) and URM's (its blocks under
    `layers.{i}.`, its initial state `init_hidden`, the ConvSwiGLU's conv `mlp.dwconv`)."""
    scheme = config.scheme
    names = {
        "token_embedding": "embed_tokens.embedding_weight",
        "lm_head.weight": "lm_head.weight",
        "q_head.weight": "q_head.weight",
        "q_head.bias": "q_head.bias",
        **{name: name for name in scheme.inits},
    }
    if config.pos_encodings == "learned":
        names["position_embedding"] = "embed_pos.embedding_weight"
    if config.puzzle_emb_ndim > 0:
        names["puzzle_embedding.weight"] = "puzzle_emb.weights"
    networks = scheme.networks(config)
    ours_of = {"L": "blocks.{i}.", "H": "H_blocks.{i}."}
    for level in "LH":
        for i in range(networks.get(level, 0)):
            ours, theirs = ours_of[level].format(i=i), scheme.reference_block.format(level=level, i=i)
            if config.mlp_t:
                names[ours + "seq_mlp.gate_up.weight"] = theirs + "mlp_t.gate_up_proj.weight"
                names[ours + "seq_mlp.down.weight"] = theirs + "mlp_t.down_proj.weight"
            else:
                names[ours + "attn.qkv.weight"] = theirs + "self_attn.qkv_proj.weight"
                names[ours + "attn.out.weight"] = theirs + "self_attn.o_proj.weight"
            names[ours + "mlp.gate_up.weight"] = theirs + "mlp.gate_up_proj.weight"
            if config.conv_kernel:
                names[ours + "mlp.conv_weight"] = theirs + "mlp.dwconv.weight"
                names[ours + "mlp.conv_bias"] = theirs + "mlp.dwconv.bias"
            names[ours + "mlp.down.weight"] = theirs + "mlp.down_proj.weight"
    return names


def reference_state_dict(model: TRM) -> dict[str, torch.Tensor]:
    """Our weights under the reference's names (`model.inner.*`), loadable by its code; ValueError
    for a tensor of ours the reference's model has no place for."""
    ours, names = model.state_dict(), reference_names(model.config)
    unmapped = sorted(set(ours) - set(names))
    if unmapped:
        raise ValueError(f"no reference name for {unmapped}: the reference's {model.config.arch} has no such tensor")
    return {f"model.inner.{theirs}": ours[name] for name, theirs in names.items()}


def _reference_inner(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The `model.inner.*` tensors of a reference checkpoint (optionally `_orig_mod.`-prefixed,
    as torch.compile saves them), without that prefix."""
    inner = {}
    for key, value in state_dict.items():
        key = key.removeprefix("_orig_mod.")
        if key.startswith("model.inner."):
            inner[key.removeprefix("model.inner.")] = value
    return inner


def reference_config(state_dict: dict[str, torch.Tensor], base: TRMConfig) -> TRMConfig:
    """`base` with every size that a reference checkpoint's tensor shapes determine: the arch
    (the registered scheme that recognises its initial states and networks, base's own arch first;
    another arch than base's brings that arch's yaml values), hidden_size, vocab_size, the layers
    of each network, expansion, mlp_t, the conv's kernel, learned positions, puzzle_emb_ndim and
    the number of puzzle identifiers. The rest (cycles, heads, seq_len, halting) is not in the
    weights and stays as `base` (or the arch's yaml) says."""
    from modeling.schemes import SCHEMES, arch_defaults

    inner = _reference_inner(state_dict)
    if "embed_tokens.embedding_weight" not in inner:
        raise ValueError("not a checkpoint of the reference's, EqR's or URM's code: no "
                         f"model.inner.embed_tokens.embedding_weight among its {len(state_dict)} tensors")
    vocab_size, hidden_size = inner["embed_tokens.embedding_weight"].shape
    layers = {level: len({k.split(".")[2] for k in inner if k.startswith(f"{level}_level.layers.")})
              for level in "LH"}
    as_arch = lambda arch: base if arch == base.arch else dataclasses.replace(base, **arch_defaults(arch))
    found = [arch for arch, scheme in SCHEMES.items() if scheme.recognises(set(inner), as_arch(arch))]
    if not found:
        inits = sorted(k for k in inner if k.endswith("_init"))
        raise ValueError(f"no registered arch ({', '.join(SCHEMES)}) recognises this checkpoint: initial "
                         f"states {inits}, networks {[f'{level}_level' for level in 'LH' if layers[level]]}; "
                         "pass --model.arch and the flags of its networks (e.g. --model.separate-H-L)")
    base = as_arch(base.arch if base.arch in found else found[0])
    block = base.scheme.reference_block
    starts = {level: block.split("{i}")[0].format(level=level) for level in "LH"}
    layers = {level: len({k[len(start):].split(".")[0] for k in inner if k.startswith(start)})
              for level, start in starts.items()}
    fields = {field: layers[level] for level, field in base.scheme.layer_fields(base).items() if layers[level]}
    mlp_t = any(".mlp_t." in k for k in inner)
    fields.update(vocab_size=vocab_size, hidden_size=hidden_size, mlp_t=mlp_t)
    if "puzzle_emb.weights" in inner:
        fields["num_puzzle_identifiers"], fields["puzzle_emb_ndim"] = inner["puzzle_emb.weights"].shape
    else:
        fields["puzzle_emb_ndim"] = 0
    if "embed_pos.embedding_weight" in inner:
        fields["pos_encodings"] = "learned"
    elif base.pos_encodings == "learned":
        fields["pos_encodings"] = "rope"
    # The inner SwiGLU width fixes the expansion only up to the rounding to 256: keep the base's
    # when it gives the same widths.
    first = block.format(level="L" if layers["L"] else "H", i=0)
    widths = {hidden_size: inner[first + "mlp.gate_up_proj.weight"].shape[0] // 2}
    conv = inner.get(first + "mlp.dwconv.weight")
    fields["conv_kernel"] = 0 if conv is None else conv.shape[-1]
    if mlp_t:
        seq_gate_up = inner[first + "mlp_t.gate_up_proj.weight"]
        widths[seq_gate_up.shape[1]] = seq_gate_up.shape[0] // 2
    candidates = [base.expansion, widths[hidden_size] * 3 / (2 * hidden_size)]
    fitting = [e for e in candidates if all(swiglu_width(w, e) == inner_w for w, inner_w in widths.items())]
    if not fitting:
        raise ValueError(f"no SwiGLU expansion gives the checkpoint's inner widths {widths} "
                         "(model width → inner width); pass --model.expansion")
    return dataclasses.replace(base, expansion=fitting[0], **fields)


def mean_row_table(table: torch.Tensor, rows: int) -> torch.Tensor:
    """A puzzle-embedding table of `rows` rows, each the mean of `table`'s rows: how the reference
    starts the table when fine-tuning on puzzles whose identifiers the weights were not trained
    on (the dense weights carry over; the new puzzles' rows are learned from there)."""
    return table.float().mean(0, keepdim=True).expand(rows, table.shape[1]).contiguous()


def load_reference_state_dict(model: TRM, state_dict: dict[str, torch.Tensor],
                              resize_puzzle_table: bool = True) -> None:
    """Load a reference checkpoint (keys `model.inner.*`, optionally prefixed `_orig_mod.`).

    A puzzle-embedding table with another number of identifiers is replaced by its mean row
    repeated, as the reference does when fine-tuning on a different dataset; with
    `resize_puzzle_table=False` (evaluation) it is an error instead.
    """
    inner = _reference_inner(state_dict)
    names = reference_names(model.config)
    missing = sorted(theirs for theirs in names.values() if theirs not in inner)
    unexpected = sorted(k for k in inner if k not in set(names.values()))
    if missing or unexpected:
        raise ValueError(
            "reference checkpoint does not match this TRMConfig "
            f"(missing: {missing or 'none'}; unexpected: {unexpected or 'none'}); "
            "check arch, mlp_t, pos_encodings, L_layers, H_layers and puzzle_emb_ndim")
    ours = model.state_dict()
    converted = {}
    for name, theirs in names.items():
        value = inner[theirs]
        expected = ours[name].shape
        if (name == "puzzle_embedding.weight" and resize_puzzle_table and value.shape != expected
                and value.shape[1:] == expected[1:]):
            print(f"puzzle embedding has {value.shape[0]} identifiers, this dataset {expected[0]}: "
                  "resetting every row to the checkpoint's mean row")
            value = mean_row_table(value, expected[0])
        if value.shape != expected:
            raise ValueError(f"reference tensor model.inner.{theirs} has shape {tuple(value.shape)}, "
                             f"this TRMConfig expects {tuple(expected)} (check hidden_size, "
                             "expansion, seq_len, vocab_size)")
        converted[name] = value.to(dtype=ours[name].dtype)
    model.load_state_dict(converted, strict=True)
