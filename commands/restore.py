"""Where a run's state comes from: the run directory's newest committed checkpoint (one decision
for every host, `resume_or_start`), or given weights: a run or checkpoint directory's EMA
weights, an exported model.safetensors or a checkpoint of the reference's, EqR's or URM's code
(reference/checkpoint_file.py) (`load_initial_weights` for
--run.init-from, `load_weights_for_eval` for the eval and predict commands)."""
from __future__ import annotations

import dataclasses
import json
import re
import time

import torch
import tyro

import data
from model import TRM, TRMConfig
from rundir import storage
from training import checkpoint
from training.config import (
    Config,
    ConfigError,
    arch_in,
    config_differences,
    config_from_dict,
    with_arch,
    with_new_fields,
)
from training.run_log import RunLog
from training.trainer import Trainer


class ConfigChangedError(ConfigError):
    pass


def refuse_changed_config(config: Config, saved: dict, identifiers: str | None) -> None:
    """Raise ConfigChangedError when the checkpoint's state says the run was made with another
    configuration in a way that matters (and run.allow_config_change is off)."""
    differences = config_differences(with_new_fields(saved["config"]), dataclasses.asdict(config))
    if saved.get("dataset_identifiers") not in (None, identifiers):
        differences.append(f"the dataset's puzzle identifiers: fingerprint {saved['dataset_identifiers']} "
                           f"in the run directory, {identifiers} now")
    if differences and not config.run.allow_config_change:
        raise ConfigChangedError(f"{config.run.dir} was created with another configuration:\n  "
                                 + "\n  ".join(differences)
                                 + "\nuse the original flags, a new --run.dir, or --run.allow-config-change")


def attempt(fn):
    """(None, fn()) or ((kind, message), None) when fn raised: kind "unreadable" for checkpoint
    contents that cannot be what was saved, "config" for a changed configuration, "stop" for
    anything else (storage failing, a state that does not match): what hosts compare."""
    try:
        return None, fn()
    except ConfigChangedError as e:
        return ("config", str(e)), None
    except checkpoint.IncompleteCheckpointError as e:
        return ("stop", str(e)), None
    except checkpoint.CheckpointError as e:
        return ("unreadable", str(e)), None
    except Exception as e:  # every host must reach the comparison, whatever failed
        return ("stop", f"{type(e).__name__}: {e}"), None


def abandon_unreadable(config: Config, unreadable: list[str], sharding, log: RunLog) -> None:
    """Every committed checkpoint is unreadable: stop, unless run.start_over says to move them
    aside (process 0) and start from step 0."""
    if not config.run.start_over:
        raise SystemExit(f"error: no committed checkpoint of {config.run.dir} can be read ("
                         + ", ".join(unreadable) + "); nothing was trained or overwritten. Pass "
                         "--run.start-over to move them aside and start from step 0, or use a new --run.dir")
    aside = storage.join_url(config.run.dir, f"checkpoints-unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
    if sharding.is_main_process():
        fs, path = storage.filesystem(storage.join_url(config.run.dir, "checkpoints"))
        storage.with_retries("moving", path, lambda: fs.mv(path, storage.filesystem(aside)[1], recursive=True))
    sharding.barrier()
    log.say(f"--run.start-over: moved the unreadable checkpoints to {aside}; starting from step 0")


def resume_or_start(config: Config, identifiers: str | None, sharding, mesh, log: RunLog):
    """(start step, Trainer, whether it resumed): the run directory's newest committed
    checkpoint, or else run.init_from's weights, or else a fresh start (which writes config.json).

    One decision for the whole slice: process 0 lists the committed checkpoints, every host reads
    the newest (its rows of the carry) and builds the training state from it, and the hosts
    compare outcomes. All resume from the same step; or all pass over a checkpoint whose
    contents are unreadable to the next older one, saying so; or all stop with an error naming
    the step, the host and the cause (storage failing beyond its retries, a checkpoint that does
    not hold this run's state, a changed configuration). A run directory whose committed
    checkpoints are all unreadable never starts over at step 0 without --run.start-over.
    """
    def listing():
        committed = checkpoint.list_checkpoints(config.run.dir)
        newest = committed[0][0] if committed else -1
        for step, url in checkpoint.list_checkpoints(config.run.dir, committed_only=False):
            if step > newest:
                log.say(f"note: passing over {url}: no {checkpoint.COMMIT_MARKER} marker (a save that did not finish)")
        return committed
    error, candidates = attempt(listing) if sharding.is_main_process() else (None, None)
    error, candidates = sharding.broadcast_object((error, candidates))
    if error:
        raise SystemExit(f"error: cannot list the checkpoints of {config.run.dir} (host 0): {error[1]}")
    def carry_rows(name, shape):  # this host's rows of the carry; every row of the puzzle table
        return sharding.rows_here(shape[0]) if name.startswith("carry/") else (0, shape[0])

    unreadable = []
    for step, url in candidates:
        def resume(url=url):
            restore, saved = checkpoint.read_checkpoint(url, carry_rows)
            refuse_changed_config(config, saved, identifiers)
            return Trainer(config, sharding, mesh, restore)
        error, trainer = attempt(resume)
        errors = {host: e for host, e in enumerate(sharding.all_gather_object(error)) if e}
        if errors and all(kind == "unreadable" for kind, _ in errors.values()):
            for host, (_, message) in errors.items():
                log.say(f"warning: passing over checkpoint step {step}, unreadable on host {host}: {message}")
            unreadable.append(url)
            continue
        if errors:
            kind, message = next(iter(errors.values()))
            if kind == "config":
                raise SystemExit(f"error: {message}")
            raise SystemExit(f"error: cannot resume from {url} (step {step}); nothing was trained or written:\n"
                             + "\n".join(f"  host {host}: {message}" for host, (_, message) in errors.items())
                             + "\nFix the cause and relaunch; the run directory is unchanged.")
        log.say(f"resuming from {url} (step {step})")
        log.config_text(config)
        return step, trainer, True
    if unreadable:
        abandon_unreadable(config, unreadable, sharding, log)
    restore = None
    if config.run.init_from:
        try:
            restore = load_initial_weights(config.run.init_from, config.model, identifiers, log.say)
        except ConfigError as e:
            raise SystemExit(f"error: {e}")
        log.say(f"initial weights from {config.run.init_from}")
    if log.main_host:
        storage.write_bytes(storage.join_url(config.run.dir, "config.json"),
                               json.dumps(dataclasses.asdict(config), indent=2).encode())
    log.config_text(config)
    return 0, Trainer(config, sharding, mesh, restore), False


def load_initial_weights(url: str, model_config: TRMConfig, dataset_identifiers: str | None = None,
                         say=print) -> dict[str, torch.Tensor]:
    """`model/*` tensors to start training from: the EMA weights of a run or checkpoint
    directory, an exported model.safetensors, or a checkpoint of the reference's, EqR's or URM's
    code (the weights its evaluation reads: EqR's EMA average).

    Fine-tuning on other puzzles: when the weights' puzzle-embedding table was trained on other
    identifiers (another row count, or another fingerprint than `dataset_identifiers`), the
    dense weights are kept and every row of the table starts as the mean of the old rows (as the
    reference does), with one line said; the same identifiers keep the table."""
    from reference.checkpoint_file import read_checkpoint_file
    from reference.model_dir import read_model_dir
    from reference.weights import load_reference_state_dict, mean_row_table

    model = TRM(model_config)
    exported = read_model_dir(url)  # a model directory (train.py export --format reference), or None
    if exported:
        weights, _, _, trained_on = exported
    else:
        try:
            found = checkpoint.weights_of(url, say)
        except checkpoint.CheckpointError as e:
            raise ConfigError(str(e)) from None
        if found is None and not url.endswith(".safetensors"):
            theirs = None
            try:
                theirs = read_checkpoint_file(url).weights
                load_reference_state_dict(model, theirs)
            except ValueError as e:
                raise ConfigError(f"--run.init-from {url}: {e}{other_arch_hint(theirs, model_config)}") from None
            return {f"model/{k}": v for k, v in model.state_dict().items()}
        if found is None:
            weights, _, trained_on = checkpoint.read_exported(url)
        else:
            weights, state, _ = found
            trained_on = state.get("dataset_identifiers")
    table, expected = weights.get("puzzle_embedding.weight"), model.state_dict().get("puzzle_embedding.weight")
    if table is not None and expected is not None and table.shape[1:] == expected.shape[1:]:
        other_rows = table.shape[0] != expected.shape[0]
        if other_rows or (trained_on and dataset_identifiers and trained_on != dataset_identifiers):
            why = (f"{table.shape[0]} identifiers, this dataset {expected.shape[0]}" if other_rows else
                   f"identifiers with fingerprint {trained_on}, this dataset's {dataset_identifiers}")
            say(f"fine-tuning: the puzzle embedding of {url} was trained on {why}; the dense weights start "
                "from it and every table row from its mean row")
            weights["puzzle_embedding.weight"] = mean_row_table(table, expected.shape[0])
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise ConfigError(f"the weights of {url} do not fit this model (check mlp_t, pos_encodings, "
                          f"hidden_size, L_layers, puzzle_emb_ndim): {e}") from None
    return {f"model/{k}": v for k, v in model.state_dict().items()}


def other_arch_hint(state_dict: dict[str, torch.Tensor] | None, config: TRMConfig) -> str:
    """"; the file holds a model of arch X: pass --model.arch X" when the reference-format
    `state_dict` holds another arch's model than `config`'s (what reference_config recognises),
    else ""."""
    from reference.weights import reference_config

    try:
        arch = reference_config(state_dict, config).arch if state_dict is not None else config.arch
    except ValueError:
        return ""
    return "" if arch == config.arch else f"; the file holds a model of arch {arch}: pass --model.arch {arch}"


RESULTS_SUFFIX = ".eval"
"""The results directory of a model file or directory evaluated without --run.dir: MODEL.eval/
beside it (models/a.safetensors -> models/a.safetensors.eval/)."""


def results_dir(source: str, checkpoint_url: str | None = None) -> str:
    """Where the evaluation of `source` writes without --run.dir: a run directory's own (the
    directory it was read from, local or gs://, never the run.dir of its saved config); a
    checkpoint directory's run (RUN of RUN/checkpoints/step_N); a model file or directory,
    SOURCE.eval beside it (never the preset's shared runs/ directory). `checkpoint_url`: the
    checkpoint read, when `source` is a run or checkpoint directory."""
    source = source.rstrip("/")
    if checkpoint_url is not None and checkpoint_url.rstrip("/") == source:
        parent, _, _ = source.rpartition("/")
        if parent.rsplit("/", 1)[-1] == "checkpoints":
            return parent.rpartition("/")[0]
        return source + RESULTS_SUFFIX
    return source if checkpoint_url is not None else source + RESULTS_SUFFIX


def load_weights_for_eval(source: str, base: Config, overrides: list[str]):
    """(config, `model/*` weights, step, fingerprint of the identifiers the weights were trained
    on or None) from a run directory or checkpoint (EMA weights and the run's config), a model
    directory (train.py export --format reference|eqr|urm: the run's config), an exported
    model.safetensors (its model config) or a checkpoint of an arch's own code, the reference's,
    EqR's or URM's (the arch and sizes its tensors show, the settings of the config saved in it
    or of an all_config.yaml beside it, the rest from the preset `base`); `overrides`
    (command-line flags) apply on top. eval.max_examples is None (every test example, as a
    run's final evaluation reads) unless `overrides` set it: never the run's or the preset's
    training-time subset. run.dir is `results_dir` unless `overrides` set it."""
    from reference.weights import reference_config

    base = with_arch(base, arch_in(overrides))
    def with_overrides(config: Config, checkpoint_url: str | None = None) -> Config:
        config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, max_examples=None),
                                     run=dataclasses.replace(config.run, dir=results_dir(source, checkpoint_url)))
        return tyro.cli(Config, default=config, args=overrides)

    from reference.model_dir import config_from_all_config, files_beside_checkpoint, read_model_dir

    exported = read_model_dir(source)
    if exported:
        weights, saved, step, trained_on = exported
        config = config_from_dict(saved)
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, init_from=None))
        return with_overrides(config), {f"model/{k}": v for k, v in weights.items()}, step, trained_on
    if source.endswith(".safetensors"):
        weights, model_config, trained_on = checkpoint.read_exported(source)
        config = with_overrides(dataclasses.replace(base, model=TRMConfig(**model_config)))
        return config, {f"model/{k}": v for k, v in weights.items()}, 0, trained_on
    try:
        found = checkpoint.weights_of(source)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    if found is not None:
        ema, state, url = found
        print(f"evaluating the EMA weights of {url} (step {state['step']})", flush=True)
        weights = {f"model/{k}": v for k, v in ema.items()}
        config = with_overrides(config_from_dict(state["config"]), url)
        return config, weights, state["step"], state.get("dataset_identifiers")
    # A checkpoint of an arch's own code: its table must fit the dataset as it is (no resizing
    # for evaluation).
    from reference.checkpoint_file import read_checkpoint_file
    from reference.weights import load_reference_state_dict

    try:
        saved = read_checkpoint_file(source)
    except (ValueError, RuntimeError, OSError) as e:
        raise SystemExit(f"error: {source}: {e}")
    state_dict = saved.weights
    # The run's config saved in the file (EqR's), else an all_config.yaml beside it, gives the
    # arch's settings (and our model directory's config.json the identifiers the table was
    # trained on).
    beside, trained_on = files_beside_checkpoint(source)
    saved_config = saved.config if saved.config is not None else beside
    try:
        if saved_config is not None:
            base = config_from_all_config(saved_config, base)
        model_config = reference_config(state_dict, base.model)
        # The weights do not say seq_len: take the dataset's unless a flag says otherwise.
        data_path = with_overrides(base).data.path
        try:
            model_config = dataclasses.replace(model_config, seq_len=data.read_metadata(data_path, "test").seq_len)
        except data.DatasetError:
            pass  # reported with its fix when the dataset is opened
        config = with_overrides(dataclasses.replace(base, model=model_config))
        model = TRM(config.model)
        load_reference_state_dict(model, state_dict, resize_puzzle_table=False)
    except ValueError as e:
        raise SystemExit(f"error: {source}: {e}")
    return config, {f"model/{k}": v for k, v in model.state_dict().items()}, file_step(saved.step, source), trained_on


def file_step(saved_step, source: str) -> int:
    """The training step of an arch's own checkpoint file: the step saved in it (EqR's, URM's), else
    the one its name gives (the reference's step_N, EqR's step_N.pth, URM's step_N.pt), else 0."""
    if isinstance(saved_step, int) or (isinstance(saved_step, torch.Tensor) and saved_step.numel() == 1):
        return int(saved_step)
    named = re.fullmatch(r"step_(\d+)(\.\w+)?", source.rstrip("/").rsplit("/", 1)[-1])
    return int(named.group(1)) if named else 0
