"""`python -m trainer.evaluate RUN [key=value ...] [--export FORMAT] [--out FILE]`: test metrics.

RUN is a run folder (holding checkpoints/last.pt) or a checkpoint file. The run's own config
is used, with the overrides on top: `eval.tta=flip_translate`, `device=cpu`, `batch_size=1000`,
`data.root=/elsewhere`. The evaluated weights are the run's weight average when it trained
with ema, else its weights. The metrics are printed and written into the run folder, to
evaluation.json for its own settings and evaluation_<overrides>.json for others (each
evaluation keeps its file), or to --out; `--export` also saves the model for inference there
(export/, see trainer.export).
"""

# (This docstring is the command's --help.) Must not touch: training; it takes no decisions of
# its own: the toggles come from trainer/perf/, the metrics from trainer/evaluation.py.

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from trainer.checkpoint import CHECKPOINT
from trainer.config import (
    ExportFormat,
    TrainConfig,
    TrainerError,
    describe_omegaconf_error,
    schema_keys,
    to_train_config,
    unknown_key_message,
)
from trainer.job_names import overrides_text

log = logging.getLogger("trainer.evaluate")
EVALUATION = "evaluation.json"
ROOM = "free disk space or raise the file-size limit (ulimit -f)"  # where evaluation.json cannot be written


def checkpoint_file(run: str) -> Path:
    path = Path(run).expanduser()
    path = path / CHECKPOINT if path.is_dir() else path
    if not path.is_file():
        raise TrainerError(
            f"no checkpoint at {path}: give a run folder that holds {CHECKPOINT} or a checkpoint file"
        )
    return path


def run_folder(checkpoint_path: Path) -> Path:
    """checkpoints/last.pt lives in its run folder; any other checkpoint file gets its own folder."""
    if checkpoint_path.parent.name == CHECKPOINT.parent.name:
        return checkpoint_path.parent.parent
    return checkpoint_path.parent


def check_overrides(overrides: list[str]) -> None:
    """key=value, with a key of the schema and a value of its type: answered before torch is
    imported. The values are checked on the schema's defaults, one at a time, so only the
    value itself can be wrong here; how it fits the run's config is checked on that."""
    keys, schema = set(schema_keys()), OmegaConf.structured(TrainConfig)
    for override in overrides:
        key, equals, _ = override.partition("=")
        if not equals:
            raise TrainerError(f"'{override}' is not key=value: e.g. eval.tta=flip")
        if key not in keys:
            raise TrainerError(unknown_key_message(key))
        group = OmegaConf.select(schema, key)
        if OmegaConf.is_config(group):  # model=cnn: a choice of the trainer's command line
            raise TrainerError(
                f"{key} is a group of settings, and evaluate keeps the run's own: set one of its "
                f"fields instead, e.g. {key}.{next(iter(group))}=..."
            )
        try:
            OmegaConf.merge(schema, OmegaConf.from_dotlist([override]))
        except Exception as error:  # OmegaConf's messages span lines; keep the first
            raise TrainerError(describe_omegaconf_error(error)) from None


def with_overrides(saved: dict, overrides: list[str]) -> TrainConfig:
    """The saved config with overrides that check_overrides has passed."""
    merged = OmegaConf.merge(OmegaConf.create(saved), OmegaConf.from_dotlist(overrides))
    merged.resume = None
    return to_train_config(merged)


def evaluated_weights(state: dict) -> tuple[str, dict]:
    """('ema', the average's weights) when the run kept one, else ('model', its weights)."""
    if "ema" not in state:
        return "model", state["model"]
    prefix = "module."
    return "ema", {
        name[len(prefix) :]: value for name, value in state["ema"].items() if name.startswith(prefix)
    }


def evaluation_file(folder: Path, overrides: list[str]) -> Path:
    """Where an evaluation is written unless --out says: evaluation.json for the run's own
    settings, evaluation_<overrides>.json for others, so that each keeps its own file."""
    if not overrides:
        return folder / EVALUATION
    return folder / f"evaluation_{overrides_text(overrides)}.json"


def evaluate_run(
    run: str, overrides: list[str], export: ExportFormat = ExportFormat.none, out: Path | None = None
) -> dict:
    """The evaluation's record, also written to `out` (default: evaluation_file)."""
    checkpoint_file(run)  # mistakes in the command line are answered before torch is imported
    check_overrides(overrides)
    import torch

    from trainer import evaluation, perf
    from trainer.checkpoint import load_checkpoint
    from trainer.data import load_source, torch_loaders
    from trainer.distributed import Ranks
    from trainer.export import export_model
    from trainer.logging import path_in, write_json_atomic
    from trainer.models import build_model
    from trainer.trainer import resolve_device

    path, state = load_checkpoint(str(checkpoint_file(run)))
    cfg = with_overrides(state["config"], overrides)
    device = resolve_device(cfg.device, Ranks(), ddp=False)
    splits = load_source(cfg.data, cfg.seed)
    kwargs = perf.dataloader_kwargs(cfg, device, in_memory=splits.test.images is not None)
    _, test = torch_loaders(splits, False, cfg.batch_size, cfg.seed, 0, 1, loader_kwargs=kwargs)
    model = build_model(cfg.model, num_classes=len(splits.classes))
    weights_name, weights = evaluated_weights(state)
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise TrainerError(
            f"{path} does not fit this model and data ({str(error).strip().splitlines()[0]}): "
            "evaluate with the model and data the run was trained with"
        ) from None
    model = model.to(device, memory_format=perf.memory_format(cfg))
    metrics = evaluation.evaluate(
        model,
        perf.device_batches(cfg, test, device),
        evaluation.tta_views(cfg.eval.tta),
        device,
        perf.autocast_context(cfg, device),
        unsure_share=cfg.eval.tta_unsure,
    )
    folder = run_folder(path)
    result = {
        "checkpoint": path_in(folder, path),
        "weights": weights_name,
        "epoch": state.get("epoch"),
        "step": state.get("step"),
        "tta": cfg.eval.tta.value,
        **metrics,
        "overrides": overrides,
        "device": str(device),
        "torch": torch.__version__,
    }
    if export is not ExportFormat.none:
        result["export"] = path_in(folder, export_model(model, export, folder))
    write_json_atomic(out or evaluation_file(folder, overrides), result, "the evaluation", fix=ROOM)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", help="a run folder or a checkpoint file")
    parser.add_argument(
        "overrides", nargs="*", help="key=value on top of the run's config, e.g. eval.tta=flip"
    )
    choices = [fmt.value for fmt in ExportFormat if fmt is not ExportFormat.none]
    parser.add_argument("--export", choices=choices, help="also save the model for inference (export/)")
    parser.add_argument(
        "--out",
        type=Path,
        help="the JSON file to write (default: the run folder's evaluation.json, or "
        "evaluation_<overrides>.json when overrides are given)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        result = evaluate_run(args.run, args.overrides, ExportFormat(args.export or "none"), args.out)
    except TrainerError as error:
        print(f"evaluate: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    written = args.out or evaluation_file(run_folder(checkpoint_file(args.run)), args.overrides)
    print(f"wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
