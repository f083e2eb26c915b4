"""Record a small float32 CPU fixture of URM (github.com/UbiquantAI/URM) for side-by-side tests.

URM has no license file: none of its code is copied here or into the fixture. This script imports
URM's own modules from a checkout given on the command line (kept outside our repository), runs
them, and saves only tensors (inputs, weights, outputs, gradients) and a JSON description.

    # HEAD of a bare clone of URM (git clone --bare https://github.com/UbiquantAI/URM), extracted
    # into a temporary folder (tests/data/urm_fixture.safetensors was recorded at 41de2c3):
    .venv/bin/python tests/reference/urm/record_urm.py --git-dir URM.git --out tests/data/urm_fixture.safetensors
    # or an existing checkout:
    .venv/bin/python tests/reference/urm/record_urm.py --urm /tmp/src/urm --out fixture.safetensors

URM's code also needs pydantic (and its imports' packages) in the environment that runs this.
tests/test_urm.py reads the file this writes.

What runs (CONFIG below; every value is also in the file's metadata "config"):
  * URM's `models.urm.urm.URM` inside its `models.losses.ACTLossHead` ("stablemax_cross_entropy"),
    float32 (`forward_dtype="float32"`), on the CPU, torch.manual_seed(SEED) before construction.
  * Three shims, none of them URM code:
      - `flash_attn_interface.flash_attn_func` (URM's Attention imports flash-attn unconditionally)
        is provided as torch's scaled_dot_product_attention on [batch, seq, heads, head_dim]
        tensors (the same default scale 1/sqrt(head_dim); non-causal here);
      - `torch._dynamo.config.disable = True`, so URM's `@torch.compile` on `msign` runs eagerly;
      - each ConvSwiGLU `dwconv` (URM builds it in bfloat16 whatever forward_dtype is) is cast to
        float32 after construction (its initial values stay the bf16-rounded ones), so that the
        whole fixture is float32 (--conv-dtype bfloat16 keeps URM's bf16 conv instead).
  * Weights after URM's own init, then (as tests/test_archs.py does for TRM) the puzzle-embedding
    table ~ N(0, 1), q_head.weight ~ N(0, 0.3^2), q_head.bias = 0 (so that rows halt at different
    ACT steps), and every other 2-D weight and the embedding scaled by WEIGHT_SCALE (small weights
    keep float rounding from growing through the recursion).
  * TRAIN_STEPS ACT steps in training mode, a new random batch each step (rows that halted take the
    new batch's example), each step: forward, loss (URM's ACTLossHead), backward of loss/BATCH, and
    the gradients recorded and zeroed (no optimizer step: the weights stay fixed). URM's training
    halting draws its exploration from torch's global RNG with probability 0.1 (hardcoded); the
    script checks that exploration changed no row's halting (halted == steps >= loops | q_halt > 0),
    so a consumer can reproduce halting with exploration off.
  * `loops` ACT steps in evaluation mode (model.eval(), torch.no_grad) on one fresh batch.
  * One step of URM's Muon (models/muon.py) on the gradients of training step 0, with the parameter
    split of URM's pretrain.py when use_muon=True (2-D parameters -> Muon, the others -> its
    internal AdamW), both groups at lr MUON_LR and URM's defaults otherwise.

Tensor names in the file (all float32 unless said; "<p>" is a name of URM.state_dict(), without the
"_orig_mod.model." prefix a URM checkpoint adds):
  weights.<p>                                   the weights and persistent buffers used
  train.<t>.batch.{inputs,labels,puzzle_identifiers}   int32, the batch given at step t
  train.<t>.{logits,q_halt_logits,q_continue_logits}   outputs of step t
  train.<t>.{halted,steps}                      int32 (halted as 0/1), the carry after step t
  train.<t>.current_hidden                      the carried state after step t
  train.<t>.current_data.{inputs,labels,puzzle_identifiers}  int32, the examples rows worked on
  train.<t>.loss, train.<t>.metric.<name>       ACTLossHead's loss and metrics (float32 scalars)
  train.<t>.grad.<p>                            d(loss/BATCH)/d<p> of step t
  train.<t>.grad.puzzle_emb_rows                the gradient of the batch's gathered puzzle rows
  eval.batch.*, eval.<t>.{logits,q_halt_logits,q_continue_logits,current_hidden}
  muon.after.<p>                                parameters after the one Muon/AdamW step
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from tests.reference.loading import install_flash_attn_shim  # noqa: E402  (the repository's root first)

SEED = 5  # a seed whose exploration draws change no row's halting (the script checks)
BATCH = 6
TRAIN_STEPS = 5
WEIGHT_SCALE = 0.5
MUON_LR = 1e-2
CONFIG = dict(
    batch_size=BATCH,
    seq_len=8,
    vocab_size=6,
    num_puzzle_identifiers=5,
    puzzle_emb_ndim=24,      # > hidden_size: ceil(24/16) = 2 prefix positions, the second zero-padded
    num_layers=2,
    hidden_size=16,
    expansion=2.0,           # ConvSwiGLU inner width: round(2*16*2/3) = 21 -> 256 (multiple of 256)
    num_heads=2,
    pos_encodings="rope",    # URM always builds RoPE (over seq_len + puzzle_emb_len positions)
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    loops=3,                 # halt_max_steps
    H_cycles=2,
    L_cycles=2,
    forward_dtype="float32",
)


def checkout(git_dir: str) -> str:
    """URM's files at HEAD of a bare repository, in a new temporary folder (never our repo)."""
    target = tempfile.mkdtemp(prefix="urm_src_")
    archive = subprocess.run(["git", "--git-dir", git_dir, "archive", "HEAD"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", target], input=archive.stdout, check=True)
    return target


def install_shims() -> None:
    install_flash_attn_shim()
    torch._dynamo.config.disable = True


def make_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    c = CONFIG
    labels = torch.randint(1, c["vocab_size"], (BATCH, c["seq_len"]), generator=g, dtype=torch.int32)
    labels[:, :2] = -100  # positions without a target
    return {"inputs": torch.randint(1, c["vocab_size"], (BATCH, c["seq_len"]), generator=g, dtype=torch.int32),
            "labels": labels,
            "puzzle_identifiers": torch.randint(0, c["num_puzzle_identifiers"], (BATCH,), generator=g,
                                                dtype=torch.int32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--urm", help="a checkout of URM's files (its root: models/, pretrain.py, ...)")
    src.add_argument("--git-dir", help="URM's bare git directory; HEAD is extracted into a temp folder")
    parser.add_argument("--out", required=True, help="the .safetensors file to write")
    parser.add_argument("--conv-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=SEED, help=f"torch seed (default {SEED})")
    parser.add_argument("--perturb", type=float, default=0.0,
                        help="multiply every weight by (1 + PERTURB * N(0,1)) before recording: run twice "
                             "(0 and e.g. 1e-6) to see how much float rounding can grow (a check, not a fixture)")
    args = parser.parse_args()
    seed = args.seed

    root = os.path.abspath(args.urm) if args.urm else checkout(args.git_dir)
    commit = None
    if args.git_dir:
        commit = subprocess.run(["git", "--git-dir", args.git_dir, "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
    install_shims()
    sys.path.insert(0, root)
    from models.losses import ACTLossHead  # URM's
    from models.muon import Muon  # URM's
    from models.urm.urm import URM  # URM's

    torch.manual_seed(seed)
    head = ACTLossHead(URM(dict(CONFIG)), loss_type="stablemax_cross_entropy")
    model = head.model
    with torch.no_grad():
        for block in model.inner.layers:
            block.mlp.dwconv.to(getattr(torch, args.conv_dtype))
        for name, p in model.named_parameters():
            if p.ndim == 2 and "q_head" not in name:
                p.mul_(WEIGHT_SCALE)
        model.inner.puzzle_emb.weights.normal_()
        model.inner.q_head.weight.normal_(std=0.3)
        model.inner.q_head.bias.zero_()
        if args.perturb:
            noise = torch.Generator().manual_seed(12345)
            for t in list(model.parameters()) + [model.inner.puzzle_emb.weights]:
                t.mul_(1 + args.perturb * torch.randn(t.shape, generator=noise).to(t.dtype))

    tensors: dict[str, torch.Tensor] = {}
    put = lambda name, t: tensors.__setitem__(name, t.detach().clone().contiguous())
    as_int = lambda t: t.to(torch.int32)
    for name, t in model.state_dict().items():
        put(f"weights.{name}", t.float() if t.is_floating_point() else t)
    params = dict(model.named_parameters())
    rows = model.inner.puzzle_emb.local_weights

    g = torch.Generator().manual_seed(seed + 1)
    head.train()
    carry = None
    step0_grads = None
    for t in range(TRAIN_STEPS):
        batch = make_batch(g)
        if carry is None:
            carry = head.initial_carry(batch)
        carry, loss, metrics, outputs, _ = head(carry=carry, batch=batch, return_keys=["logits", "q_halt_logits",
                                                                                      "q_continue_logits"])
        (loss / BATCH).backward()
        # URM's exploration must not have changed any row's halting (see the docstring).
        expect = (carry.steps >= CONFIG["loops"]) | (outputs["q_halt_logits"] > 0)
        if not torch.equal(expect, carry.halted):
            raise SystemExit(f"exploration changed the halting at step {t}; pick another --seed")
        for k, v in batch.items():
            put(f"train.{t}.batch.{k}", v)
        for k in ("logits", "q_halt_logits", "q_continue_logits"):
            put(f"train.{t}.{k}", outputs[k].float())
        put(f"train.{t}.halted", as_int(carry.halted))
        put(f"train.{t}.steps", as_int(carry.steps))
        put(f"train.{t}.current_hidden", carry.current_hidden.float())
        for k, v in carry.current_data.items():
            put(f"train.{t}.current_data.{k}", as_int(v))
        put(f"train.{t}.loss", loss.float())
        for k, v in metrics.items():
            put(f"train.{t}.metric.{k}", v.float())
        for name, p in params.items():
            put(f"train.{t}.grad.{name}", p.grad.float())
        put(f"train.{t}.grad.puzzle_emb_rows", rows.grad.float())
        if t == 0:
            step0_grads = {name: p.grad.detach().clone() for name, p in params.items()}
        for p in params.values():
            p.grad = None
        rows.grad = None
        print(f"train step {t}: loss {loss.item():.6f} steps {carry.steps.tolist()} halted {carry.halted.int().tolist()}")

    head.eval()
    eval_batch = make_batch(g)
    for k, v in eval_batch.items():
        put(f"eval.batch.{k}", v)
    with torch.no_grad():
        carry = head.initial_carry(eval_batch)
        for t in range(CONFIG["loops"]):
            carry, loss, metrics, outputs, finished = head(carry=carry, batch=eval_batch, return_keys=[
                "logits", "q_halt_logits", "q_continue_logits"])
            for k in ("logits", "q_halt_logits", "q_continue_logits"):
                put(f"eval.{t}.{k}", outputs[k].float())
            put(f"eval.{t}.current_hidden", carry.current_hidden.float())
        put("eval.loss", loss.float())
        print(f"eval: {CONFIG['loops']} steps, all halted {bool(finished)}, loss {loss.item():.6f}")

    # One step of URM's Muon with pretrain.py's split (use_muon=True): 2-D -> Muon, others -> AdamW.
    for name, p in params.items():
        p.grad = step0_grads[name].clone()
    muon = Muon([{"params": [p for p in params.values() if p.ndim == 2], "use_muon": True, "lr": MUON_LR},
                 {"params": [p for p in params.values() if p.ndim != 2], "use_muon": False, "lr": MUON_LR,
                  "weight_decay": 0.1, "adamw_betas": (0.9, 0.95), "adamw_eps": 1e-8}])
    muon.step()
    for name, p in params.items():
        put(f"muon.after.{name}", p.float())

    meta = {
        "config": json.dumps(CONFIG),
        "seed": str(seed), "batch": str(BATCH), "train_steps": str(TRAIN_STEPS), "weight_scale": str(WEIGHT_SCALE),
        "conv_dtype": args.conv_dtype, "muon_lr": str(MUON_LR),
        "muon_groups": "2-D params: Muon(lr, weight_decay=0.1, matched_adamw_rms=0.2, momentum=0.95, nesterov, "
                       "ns_steps=5); others: its AdamW(lr, weight_decay=0.1, betas=(0.9,0.95), eps=1e-8)",
        "loss": "ACTLossHead(stablemax_cross_entropy): lm_loss + 0.5*q_halt_loss (sums over the batch); "
                "grads are of loss/batch",
        "urm_commit": commit or "unknown (--urm checkout)",
        "torch": torch.__version__,
        "generated_by": "record_urm.py (h55)",
    }
    from safetensors.torch import save_file
    save_file(tensors, args.out, metadata=meta)
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {len(tensors)} tensors, {size / 1e6:.2f} MB")
    if args.git_dir:  # the temporary checkout made above
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
