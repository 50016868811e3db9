"""What a run says of each epoch, and whether it learned: TensorBoard's scalars and the epoch's
log line (trainer/tags.py names the scalars), the input-pipeline hint, and the verdict on a run
that ended its epochs at chance.

Must not touch: the run folder's files, checkpoints and signals (trainer/run.py), the loop.
"""

from __future__ import annotations

import logging

from trainer import tags
from trainer.logging import RunLog, decimal, percent
from trainer.parts import Parts
from trainer.progress import Progress

log = logging.getLogger("trainer.run")

# A run of this many epochs and optimizer steps or more whose last test accuracy is within
# (CHANCE_MARGIN - 1) x chance x (1 - chance) of chance (1 / classes) did not learn: 14.5% for
# 10 classes (the cnn at lr 0.1 on 2,000 synthetic images, 150 steps, ended at 9.0%), 62.5%
# for 2, where 1.5x chance would call a run at 72% stuck. Shorter runs, smoke tests among
# them, are not judged.
CHANCE_EPOCHS = 3
CHANCE_STEPS = 100
CHANCE_MARGIN = 1.5


def accuracy_cell(record: dict) -> str:
    """The epoch line's test accuracy: the single view, and the TTA one beside it when on."""
    plain = decimal(record.get("test_acc"))
    tta = record.get("test_acc_tta")
    cell = plain if tta is None else f"{plain} (tta {decimal(tta)})"
    if "test_acc_trained" in record:  # ema: the cell above is the average's
        cell = f"{cell} (trained weights {decimal(record['test_acc_trained'])})"
    return cell


def report_epoch(run_log: RunLog, progress: Progress, parts: Parts, record: dict) -> None:
    """TensorBoard scalars, one log line, and the input-pipeline hint when data is slow."""
    so_far = progress.summary()
    run_log.scalars(
        progress.step,
        {
            tags.TEST_ACC: record.get("test_acc"),
            tags.TEST_ACC_TTA: record.get("test_acc_tta"),
            tags.TRAIN_ACC: record["train_acc"],
            tags.TRAINED_TEST_ACC: record.get("test_acc_trained"),
            tags.TRAINED_TEST_ACC_TTA: record.get("test_acc_tta_trained"),
            tags.TEST_LOSS: record.get("test_loss"),
            tags.IMG_PER_S: so_far["img_per_s"],
            tags.MFU: so_far["mfu"],
            tags.DATA_WAIT_FRAC: so_far["data_wait_frac"],
            tags.IMG_PER_S_EPOCH: record["img_per_s"],
            tags.PEAK_MEM_MB: record["peak_mem_mb"],
            tags.BEST_TEST_ACC: progress.best_test_acc,
            tags.TIME_TO_TARGET_S: progress.time_to_target_s,
            tags.EPOCH_S: record["epoch_s"],
            tags.TRAIN_TIME_S: progress.train_time_s,
        },
    )
    log.info(
        "epoch %d/%d | step %d | loss %.4f | train acc %.4f | test acc %s | %.0f img/s | mfu %s"
        " | data wait %s",
        progress.epoch,
        parts.epochs,
        progress.step,
        record["train_loss"],
        record["train_acc"],
        accuracy_cell(record),
        record["img_per_s"],
        percent(record["mfu"]),
        decimal(record["data_wait_frac"]),
    )
    if (record["data_wait_frac"] or 0.0) > 0.2:
        log.warning(
            "%.0f%% of the epoch waited for data: try more num_workers, pin_memory=true or data.loader=gpu",
            100 * record["data_wait_frac"],
        )


def did_not_learn(progress: Progress, parts: Parts) -> str | None:
    """Why a run that trained CHANCE_EPOCHS epochs and CHANCE_STEPS steps or more and tests at
    chance did not learn, with what to lower (it is then marked `diverged`); None otherwise."""
    tested = [record["test_acc"] for record in progress.history if "test_acc" in record]
    chance = 1 / len(parts.classes)
    judged = progress.epoch >= CHANCE_EPOCHS and progress.step >= CHANCE_STEPS
    if not judged or not tested or tested[-1] > chance + (CHANCE_MARGIN - 1) * chance * (1 - chance):
        return None
    advice = "optim.lr is 0: set e.g. optim.lr=0.05" if parts.lr_peak == 0 else parts.non_finite_advice
    return (
        f"test accuracy {tested[-1]:.1%} after {progress.epoch} epochs is chance for "
        f"{len(parts.classes)} classes: the run did not learn; {advice}"
    )
