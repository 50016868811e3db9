"""Where a run stands and what it has measured: saved in every checkpoint, summarized in
metrics.json.

Owns: the counters (epoch, step, batch in epoch), the measured times, the epoch records and
their summary. Must not touch: advancing them (trainer/loop.py), saving or writing them
(trainer/run.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Progress:
    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    batch_in_epoch: int = 0  # micro-batches of the current epoch already consumed
    train_time_s: float = 0.0  # training time, evaluation excluded
    eval_time_s: float = 0.0  # evaluation time
    compile_s: float = 0.0  # warm-up steps that compiled and autotuned before training was timed
    init_s: float = 0.0  # the model's initialization from the training data (fastcnn's whitening)
    # init + training + evaluation time until target_acc was first reached (compile_s not included)
    time_to_target_s: float | None = None
    epochs_to_target: int | None = None  # the epoch whose evaluation first reached target_acc
    best_test_acc: float | None = None
    first_loss: float | None = None  # the first log window's training loss: what divergence is measured by
    history: list[dict] = field(default_factory=list)  # one record per completed epoch

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def add_epoch(self, record: dict) -> None:
        if "test_acc" in record:
            self.best_test_acc = max(self.best_test_acc or 0.0, record["test_acc"])
        self.history.append(record)

    def note_target(self, record: dict, target_acc: float | None) -> None:
        """The first evaluation reaching target_acc (its accuracy with TTA where there is one)."""
        accuracy = record.get("test_acc_tta", record.get("test_acc"))
        if target_acc is None or accuracy is None or self.epochs_to_target is not None:
            return
        if accuracy >= target_acc:
            self.time_to_target_s = self.init_s + self.train_time_s + self.eval_time_s
            self.epochs_to_target = self.epoch

    def summary(self) -> dict:
        """Final numbers; images/s leaves out the first epoch (warm-up) when there are more."""
        timed = self.history[1:] if len(self.history) > 1 else self.history
        seconds = sum(r["epoch_s"] for r in timed)
        images = sum(r["img_per_s"] * r["epoch_s"] for r in timed)
        waits = [r["data_wait_frac"] * r["epoch_s"] for r in timed if r["data_wait_frac"] is not None]
        used = [r["mfu"] * r["epoch_s"] for r in timed if r.get("mfu") is not None]
        tested = [r for r in self.history if "test_acc" in r]
        peaks = [r["peak_mem_mb"] for r in self.history if r["peak_mem_mb"] is not None]
        return {
            "test_acc": tested[-1]["test_acc"] if tested else None,
            "test_acc_tta": tested[-1].get("test_acc_tta") if tested else None,
            # ema: test_acc is the average's; these weights were what the optimizer trained
            "test_acc_trained": tested[-1].get("test_acc_trained") if tested else None,
            "best_test_acc": self.best_test_acc,
            "test_loss": tested[-1]["test_loss"] if tested else None,
            "train_loss": self.history[-1]["train_loss"] if self.history else None,
            "img_per_s": images / seconds if seconds else None,
            "data_wait_frac": sum(waits) / seconds if waits and seconds else None,
            # over the same epochs as img_per_s; each epoch's at its own image size (data.low_res)
            "mfu": sum(used) / seconds if used and seconds else None,
            "epochs": self.epoch,
            "steps": self.step,
            "train_time_s": self.train_time_s,
            "eval_time_s": self.eval_time_s,
            "compile_s": self.compile_s,
            "init_s": self.init_s,
            "time_to_target_s": self.time_to_target_s,
            "epochs_to_target": self.epochs_to_target,
            "peak_mem_mb": max(peaks) if peaks else None,
            "history": self.history,
        }
